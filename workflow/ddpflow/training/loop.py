"""The training loop: a rank's epochs of optimizer steps, its micro-batches and validation.

Launch (every launcher reaches the same code through ddpflow.cluster.distenv.discover):
  snakemake --cores 2                                  # local executor, 2 CPU ranks
  snakemake --profile profiles/slurm                   # submitit's Slurm executor
  srun python -m ddpflow train --run default ...       # plain sbatch (scripts/sbatch_train.sh)
  torchrun --nproc-per-node 2 -m ddpflow train ...     # torchrun

The order of the samples is schedule.py's (the same micro-batches with the same random draws
at every world size); the training objects are build.py's, the non-finite watch is
divergence.py's and the checkpoint state resume.py's. The batches come from the feed
(ddpflow.data.feed): index_select on the device where the split was loaded whole, or read
ahead from the staged shards in host memory by DataLoader workers and copied to the device
when it is streamed (data.loading).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpflow.cluster.distenv import DistEnv
from ddpflow.config import accumulation_steps, micro_batches_per_step
from ddpflow.config.machine import SHARDED_STRATEGIES
from ddpflow.config.typed import RunSpec
from ddpflow.data import feed
from ddpflow.data.windows import TokenFeed
from ddpflow.monitoring.flops import loop_epoch_figures
from ddpflow.runtime import PHASES, PhaseClock
from ddpflow.training import evaluate, faults, sharding, weights
from ddpflow.training.batchnorm import ExactStatistics
from ddpflow.training.build import build_training, unfrozen
from ddpflow.training.divergence import NonfiniteWatch, output_parameter
from ddpflow.training.norm_groups import norm_process_group, normalise_in_groups
from ddpflow.training.rankdata import RankData
from ddpflow.training.resume import Resumable
from ddpflow.training.schedule import (
    first_position,
    grouped,
    micro_batch_seed,
    norm_batch_part,
    rank_micro_batches,
    step_micro_batches,
)

log = logging.getLogger(__name__)


def _train_feed(data: RankData) -> feed.MemoryFeed | feed.StreamFeed | TokenFeed:
    """The training batches: load_data's feed, or, for tensors given directly (tests,
    benchmarks), one over the train inputs in memory."""
    if data.feed is not None:
        return data.feed
    assert isinstance(data.train.inputs, torch.Tensor)  # load_data streams its own
    return feed.MemoryFeed(data.train.inputs)


class Loop(Resumable):
    """One run's training state and its epoch loop (state is what a checkpoint holds)."""

    # what the train rule admitted the run with (monitoring.flops.read_admitted: the FLOPs
    # per sample and the memory estimate); the job's entry sets it
    admitted: dict | None = None

    def __init__(
        self,
        run: RunSpec,
        data: RankData,
        env: DistEnv,
        device: torch.device,
        model: nn.Module,
        loaded: dict | None = None,
    ):
        self.run, self.data, self.env, self.device = run, data, env, device
        self.loaded, self.frozen = loaded, weights.freeze(model, run.train.freeze)  # fine-tuning
        self.feed = _train_feed(data)  # the Loop's own from here on
        self.tcfg = tcfg = run.train
        # resolved for this world size by config.checks (never "auto" once a run is resolved)
        assert isinstance(tcfg.micro_batch_size, int), tcfg.micro_batch_size
        self.micro_batch_size: int = tcfg.micro_batch_size
        self.micro_per_step = micro_batches_per_step(tcfg)
        # this rank's micro-batches of a step (the first ranks one more where the world size
        # does not divide them) and the step position of its first
        self.accum = accumulation_steps(tcfg, env.world_size, env.rank)
        self.first = first_position(self.micro_per_step, env.world_size, env.rank)
        self.steps_per_epoch = data.train.inputs.shape[0] // tcfg.global_batch_size
        loss_fn = data.task.loss(data.task_manifest, tcfg)
        parts = build_training(run, env, device, model, self.steps_per_epoch, loss_fn)
        self.strategy, self.model, self.wrapped = parts.strategy, parts.model, parts.wrapped
        self.sharded_optimizer = self.strategy == "zero"
        self.fsdp = self.strategy in SHARDED_STRATEGIES  # fsdp or hsdp
        self.lr, self.optimizer, self.scheduler = parts.lr, parts.optimizer, parts.scheduler
        self.scaler, self.autocast, self.loss_fn = parts.scaler, parts.autocast, parts.loss_fn
        self.grad_sync = parts.grad_sync
        self._compiling = tcfg.compile and env.is_master
        self.clock = PhaseClock(device)
        # position (global: epoch and optimizer step within it, never a rank's own index) and
        # partial-epoch accumulators: all of it goes into a checkpoint, so a resumed run
        # continues mid-epoch where the interrupted one stopped, at any world size
        self.epoch, self.epoch_step = 0, 0
        # this rank's summed micro-batch losses per step of the epoch: summed over the ranks
        # at the epoch's end (and at a checkpoint), the whole step's loss at any world size
        self.step_losses = torch.zeros(self.steps_per_epoch, device=device)
        self._global_step_losses: torch.Tensor | None = None  # gather_state's, for state_dict
        self.segments: list[dict] = []  # [{world_size, hosts, attempt, start_step, end_step}]
        self.epoch_seconds = dict.fromkeys(PHASES, 0.0)
        self.history: list[dict] = []
        # called after every optimizer step (checkpoint / stop checks): watch_steps sets it
        self._on_step: Callable[[Loop], None] | None = None
        self.last_loss: torch.Tensor | None = None  # the last micro-step's, on the device
        watched = None if self.fsdp else output_parameter(self.model)
        # BatchNorm's batch and running statistics, the same at any world size
        self.norm_group, self.norm_stats = _norm_batches(self.model, tcfg, env, device, self.accum)
        self.nonfinite = NonfiniteWatch(run, self.lr, device, env.world_size, watched, self.scaler)

    def watch_steps(self, callback: Callable[[Loop], None] | None) -> None:
        """callback(loop) after every optimizer step (the checkpointer and the monitor's)."""
        self._on_step = callback

    def begin_segment(self, hosts: list[str], attempt: int, redone: int | None = None) -> None:
        """A stretch of training on this allocation starts at the current step (redone: the
        steps of the interrupted attempt it trains again, checkpoint.steps_redone)."""
        step = self.scheduler.last_epoch
        segment = {"world_size": self.env.processes, "hosts": list(hosts), "attempt": attempt}
        if redone is not None:
            segment["steps_redone"] = redone
        if self.env.tensor_parallel > 1:  # world_size / tensor_parallel data-parallel ranks
            segment["tensor_parallel"] = self.env.tensor_parallel
        self.segments.append({**segment, "start_step": step, "end_step": step})

    def close_segment(self, step: int | None = None) -> None:
        """The current stretch has trained (and saved) up to `step` (default: the current)."""
        if self.segments:
            self.segments[-1]["end_step"] = self.scheduler.last_epoch if step is None else step

    @property
    def pruned(self) -> dict | None:
        """The pruning record of the last epoch (ddpflow.training.pruning), if it was pruned:
        the training stops there. In the history, so a resumed run keeps the decision."""
        return self.history[-1].get("pruned") if self.history else None

    @property
    def micro_batches_per_epoch(self) -> int:
        """The micro-batches this rank computes in an epoch (what its progress bar counts)."""
        return self.steps_per_epoch * self.accum

    def train_epoch(self, progress=None) -> dict:
        """Finish the current epoch from self.epoch_step; returns its mean loss and seconds."""
        self.wrapped.train()
        if self.frozen:  # frozen BatchNorm layers keep their running statistics
            weights.keep_frozen_statistics(self.model)
        tcfg, env = self.tcfg, self.env
        batches = step_micro_batches(
            self.data.train.inputs.shape[0],
            tcfg.global_batch_size,
            self.micro_batch_size,
            tcfg.seed,
            self.epoch,
        )
        batches = grouped(batches, self.accum, self.norm_group)  # a group: one norm batch
        mine = rank_micro_batches(batches, env.world_size, env.rank)
        feed_ = self.feed
        assert feed_ is not None  # __init__ made one
        device_batches = mine.to(self.device)
        start = self.epoch_step * self.accum
        inputs = feed_.epoch(device_batches if not feed_.streamed else mine, start, self.epoch)
        if progress is not None:
            progress.update(start)
        try:
            self._micro_steps(range(start, len(mine)), device_batches, inputs, progress)
        except BaseException:  # mid-step: the BatchNorm layers get their own buffers back
            self.norm_stats.put_back()
            raise
        self.norm_stats.settle()  # the epoch's last steps' BatchNorm statistics (collective)
        self.nonfinite.read(None)  # the epoch's last step (the host syncs here anyway)
        # One host sync per epoch, not per step (the tutorials' .item() every step stalls).
        self.clock.settle()
        return self._close_epoch(batches, mine)

    def _micro_steps(self, indices: range, device_batches, inputs, progress) -> None:
        """This rank's micro-steps `indices` of the epoch, the step callbacks after each
        optimizer step."""
        for index in indices:
            step, within = divmod(index, self.accum)
            self.last_loss = self._timed_micro_step(index, device_batches[index], inputs)
            self.step_losses[step] += self.last_loss
            if progress is not None:
                progress.update(1)
            if within == self.accum - 1:
                self.epoch_step = step + 1
                if self._on_step is not None:
                    self._on_step(self)

    def _timed_micro_step(self, index: int, batch, inputs) -> torch.Tensor:
        """The epoch's micro-step `index` of this rank, with the fault injection of the tests
        (ddpflow.training.faults) and the log of torch.compile's first step."""
        env, accum = self.env, self.accum
        step, within = divmod(index, accum)
        micro = self.first + within  # the micro-batch's index in its step
        faults.maybe_inject(env.rank, self.epoch, index)
        if slow := faults.slow_seconds(env.rank):
            time.sleep(slow)
        started = time.perf_counter() if self._compiling else 0.0
        if within == 0:
            self.norm_stats.begin_step()
        loss = self._micro_step(batch, inputs, within == accum - 1, step, micro)
        self.norm_stats.record(micro)
        if within == accum - 1:  # before the step's callbacks (a checkpoint holds them)
            self.norm_stats.end_step()
        if self._compiling:  # the first step compiled the forward and backward
            self._compiling = False
            took = time.perf_counter() - started
            log.info(
                "torch.compile: the first step took %.1f s (compiling forward and backward)", took
            )
        return loss

    def _close_epoch(self, batches: torch.Tensor, mine: torch.Tensor) -> dict:
        """The finished epoch's record; the position moves to the next epoch's start."""
        record = {
            "train_loss": float(self.global_step_losses().sum()) / batches[:, :, 0].numel(),
            "seconds": dict(self.epoch_seconds),
            "samples": batches.numel(),  # of all ranks
            "rank_samples": mine.numel(),  # of this rank (the same on every rank)
            "micro_steps": len(mine),  # of each rank
        }
        self.epoch, self.epoch_step = self.epoch + 1, 0
        self.step_losses.zero_()
        self.epoch_seconds = dict.fromkeys(PHASES, 0.0)
        self.unfreeze_if_due(self.epoch)  # before the epoch's checkpoint: it holds the new state
        return record

    def unfreeze_if_due(self, epoch: int) -> None:
        """From train.unfreeze_at_epoch (counted from 1; `epoch` is the next one's 0-based
        index) every parameter trains: the wrapper, optimizer and schedule are rebuilt."""
        due = self.tcfg.unfreeze_at_epoch
        if not self.frozen or due is None or epoch < due - 1:
            return
        self.norm_stats.settle()  # into the layers trained so far
        self.frozen = []
        at = self.scheduler.last_epoch  # the steps taken: the new schedule goes on from there
        self.wrapped, self.optimizer, self.scheduler = unfrozen(
            self.run, self.env, self.device, self.model, self.wrapped, self.steps_per_epoch, at
        )
        if self.env.is_master:
            log.info("epoch %d: every parameter trains from here (train.unfreeze_at_epoch)", due)

    def global_step_losses(self) -> torch.Tensor:
        """Collective: each step's summed micro-batch losses over all ranks (the step's loss
        times its micro-batch count), the same at every world size up to summation order.
        A copy: this rank's own sums stay as they are."""
        losses = self.step_losses.detach().clone()
        if self.env.world_size > 1:
            dist.all_reduce(losses, group=self.env.group)
        return losses

    def _micro_step(self, batch, inputs, last_micro, step, micro) -> torch.Tensor:
        """Micro-batch `micro` of the epoch's step `step`: `batch` its sample indices (on the
        device), `inputs` the feed's iterator of the epoch's batches (uint8 images or token
        blocks; in memory: index_select; streamed: read ahead by DataLoader workers)."""
        accum, seconds = self.accum, self.epoch_seconds
        self.clock.step()
        with self.clock.phase(seconds, "data"):
            x = next(inputs)
            # every random draw of this micro-batch (augmentation, a model's dropout) comes
            # from (seed, epoch, step, micro), whichever rank computes it (its normalisation
            # batch's, sliced, where a group of ranks holds that: norm_groups)
            norm, part = norm_batch_part(micro, accum, self.norm_group)
            draws = micro_batch_seed(self.tcfg.seed, self.epoch, step, norm)
            _seed_random_draws(draws, self.device)
            if not self.data.tokens:  # a language model's blocks: no augmentation
                x = feed.augment(x, self.tcfg.augment, draws, (part, self.norm_group))
            y = self.data.train.labels.index_select(0, batch)
            x, y = evaluate.model_batch(x, y, self.data.norm, self.data.tokens)
        # no_sync(): skip the gradient all-reduce on all but the last micro-step
        skip_sync: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if not last_micro and self.env.world_size > 1:
            # not FSDP: wrapped is DDP, or DDP compiled (which forwards no_sync to it)
            skip_sync = (
                sharding.no_gradient_sync(self.model)
                if self.fsdp
                else cast(DDP, self.wrapped).no_sync()
            )
        with skip_sync:
            with (
                self.clock.phase(seconds, "forward"),
                self.autocast() if self.autocast else contextlib.nullcontext(),
            ):
                loss = self.loss_fn(self.wrapped(x), y)
            with self.clock.phase(seconds, "backward_sync"):
                # DDP/FSDP average over the ranks, so 1/accum here makes the gradient the
                # mean over the step's micro-batches (no extra kernel when accum is 1)
                self.scaler.scale(_share_of_step(loss, accum, self)).backward()
                if last_micro and self.grad_sync is not None:
                    self.grad_sync()  # tensor parallelism under ddp
        loss = loss.detach().float()
        self.nonfinite.add(loss)
        if last_micro:
            flag = self.nonfinite.step_flag()  # before zero_grad: it may read a gradient
            with self.clock.phase(seconds, "optimizer"):
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.optimizer.zero_grad(set_to_none=True)
                self.scheduler.step()
            self.nonfinite.after_step(flag, self.epoch, self.scheduler.last_epoch)
        return loss

    def validate(self) -> dict:
        self.norm_stats.settle()
        sync_buffers(self.model, self.env.world_size)
        scoring = self.data.scoring(evaluate.batch_size(self.run, self.admitted), self.autocast)
        result = evaluate.evaluate_split(self.model, self.data.val, scoring, self.env)
        assert result is not None  # without guard a failed evaluation raises
        return self.data.task.validation(result)


def _share_of_step(loss: torch.Tensor, accum: int, loop: Loop) -> torch.Tensor:
    """A micro-batch's loss as its part of the step's mean: 1/accum where every rank
    computes accum micro-batches (DDP and FSDP then average over the ranks); world /
    micro-batches where the ranks' shares differ, so that each micro-batch weighs the same."""
    world, count = loop.env.world_size, loop.micro_per_step
    if count % world:
        return loss * (world / count)
    return loss / accum if accum > 1 else loss


def _norm_batches(model: nn.Module, tcfg, env: DistEnv, device, accum: int):
    """(ranks per normalisation batch, the running statistics' fold): BatchNorm normalises
    train.norm_batch_size samples together, shared by a group of ranks where a rank's
    micro-batch is smaller (training.norm_groups; a run resolved before the key normalises
    its micro-batch), and its running statistics are one rank's (training.batchnorm)."""
    norm, micro = tcfg.norm_batch_size, tcfg.micro_batch_size
    group = norm // micro if isinstance(norm, int) else 1
    normalise_in_groups(model, norm_process_group(env.world_size, env.rank, group), group)
    per_step = micro_batches_per_step(tcfg)
    fold = ExactStatistics(model, per_step, env.world_size, device, group=group, accum=accum)
    return group, fold


def _seed_random_draws(seed: int, device: torch.device) -> None:
    """Seed the generators a forward draws from (dropout): the CPU's, and on a GPU rank
    its device's. Not torch.manual_seed: while CUDA is uninitialised (CPU ranks) it queues
    a lazy seeding of every accelerator, with a stack trace each, ~0.35 ms per micro-step
    (bench/scaling.py) against ~2 us here."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


def sync_buffers(model: nn.Module, world_size: int) -> None:
    """Every rank takes rank 0's buffers (BatchNorm statistics) before scoring, so that all
    shards are scored by the model rank 0 checkpoints and saves. DDP broadcasts buffers at
    the start of each forward, so after a step each rank's statistics include its own last
    batch: without this, each shard would be scored by a slightly different model. Training
    is unchanged (the next forward broadcasts the same buffers again)."""
    if world_size > 1:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def fit(loop: Loop, on_epoch, progress_factory=None) -> float:
    """Train the remaining epochs; on_epoch(record) runs on every rank after each epoch, after
    the record joined loop.history (so a checkpoint written there includes it). A record
    that on_epoch marks "pruned" ends the training after its epoch."""
    start = time.perf_counter()
    while loop.epoch < loop.tcfg.epochs and loop.pruned is None:
        epoch_start, first_step = time.perf_counter(), loop.scheduler.last_epoch
        progress = progress_factory(loop) if progress_factory else None
        record = loop.train_epoch(progress)
        if progress is not None:
            progress.close()
        train_seconds = time.perf_counter() - epoch_start
        record.update(loop.validate())
        record["seconds"].update(train=train_seconds, epoch=time.perf_counter() - epoch_start)
        record.update(
            epoch=loop.epoch,
            step=loop.scheduler.last_epoch,
            lr=loop.optimizer.param_groups[0]["lr"],
        )
        # global samples (all ranks) per second of training, validation excluded
        record["samples_per_s"] = record["samples"] / train_seconds
        if loop.data.tokens:  # a language model: block_size tokens per sample
            record["tokens_per_s"] = record["samples_per_s"] * loop.data.shape[0]
        steps = loop.scheduler.last_epoch - first_step  # this attempt's: a resumed epoch's part
        record.update(loop_epoch_figures(loop, steps, train_seconds))
        loop.history.append(record)
        on_epoch(record)
    return time.perf_counter() - start
