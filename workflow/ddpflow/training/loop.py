"""The DDP training loop.

Launch (every launcher reaches the same code through ddpflow.cluster.distenv.discover):
  snakemake --cores 2                                  # local executor, 2 CPU ranks
  snakemake --profile profiles/slurm                   # submitit's Slurm executor
  srun python -m ddpflow train --run default ...       # plain sbatch (scripts/sbatch_train.sh)
  torchrun --nproc-per-node 2 -m ddpflow train ...     # torchrun

The data order is the science's, not the machine's (step_micro_batches): each epoch is one
seeded shuffle cut into optimizer steps of train.global_batch_size samples, each step into
micro-batches of train.micro_batch_size; micro-batch j of step s is fixed by (seed, epoch, s,
j), and rank r computes the contiguous block j in [r*a, (r+1)*a) (a accumulation steps), so
every world size that divides the step computes the same micro-batches with the same random
draws, and the gradient is their mean. The batches come from the feed (feed.py: in memory or
streamed from the staged shards).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpflow.config import accumulation_steps, micro_batches_per_step
from ddpflow.data import feed
from ddpflow.runtime import PHASES, PhaseClock
from ddpflow.training import evaluate, faults, sharding

log = logging.getLogger(__name__)


class Diverged(RuntimeError):
    """The training loss became NaN or infinite (train.on_nonfinite: fail)."""


def step_micro_batches(n: int, global_batch: int, micro: int, seed: int, epoch: int):
    """The epoch's sample indices as [steps, micro-batches per step, micro]: one seeded
    shuffle of the n training samples (a function of seed and epoch alone), cut into
    n // global_batch optimizer steps; the n % global_batch samples left over sit out this
    epoch (the next shuffle draws others). The same at every world size."""
    generator = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(n, generator=generator)
    steps = n // global_batch
    return order[: steps * global_batch].view(steps, global_batch // micro, micro)


def rank_micro_batches(batches: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """This rank's micro-batches in the order it computes them, [steps * a, micro]: of each
    step the contiguous block j in [rank * a, (rank + 1) * a), a = micro-batches / world."""
    accum = batches.shape[1] // world
    return batches[:, rank * accum : (rank + 1) * accum].reshape(-1, batches.shape[2])


def micro_batch_seed(seed: int, epoch: int, step: int, micro: int) -> int:
    """The seed of the random draws of micro-batch `micro` of step `step` (augmentation,
    dropout): the same whichever rank computes it."""
    key = np.random.SeedSequence([seed, epoch, step, micro]).generate_state(2, np.uint64)
    return int(key[0] >> np.uint64(1))


def effective_lr(train_cfg: dict) -> float:
    """The configured lr, scaled with the global batch (Goyal et al.: linear; or sqrt). The
    world size plays no part: the global batch is the recipe's."""
    ratio = train_cfg["global_batch_size"] / train_cfg["base_batch_size"]
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[train_cfg["lr_scaling"]]
    return train_cfg["optimizer"]["lr"] * factor


def make_optimizer(
    params, opt_cfg: dict, lr: float, device: torch.device, sharded=False, dtensors=False
):
    """The configured optimizer; sharded: ZeRO stage 1 (each rank holds and updates the state
    of 1/N of the parameters, then broadcasts them: the same arithmetic per element);
    dtensors: FSDP's sharded parameters, which the fused kernels do not take (foreach)."""
    # fused kernels (one kernel for all parameters) exist for CUDA and CPU tensors; on CPU
    # the default per-tensor loop was 3-5x slower per step (bench/throughput.py, MLP/CNN)
    fast = {"foreach": True} if dtensors else {"fused": True}
    kwargs = {"lr": lr, "weight_decay": opt_cfg["weight_decay"], **fast}
    if opt_cfg["name"] == "sgd":
        cls = torch.optim.SGD
        kwargs.update(momentum=opt_cfg["momentum"],
                      nesterov=opt_cfg["nesterov"] and opt_cfg["momentum"] > 0)  # fmt: skip
    else:
        cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[opt_cfg["name"]]
        kwargs.update(betas=tuple(opt_cfg["betas"]))
    if sharded:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
    return cls(params, **kwargs)


def lr_schedule(schedule: str, warmup_steps: int, total_steps: int):
    """Multiplier per optimizer step: linear warmup, then constant or cosine to zero."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def autocast_factory(precision: str, device: torch.device):
    """A context-manager factory for mixed precision; None means fp32. bf16 on CUDA and on
    CPU ranks (oneDNN's bf16 kernels: AMX / AVX512-BF16; bench/layout.py); fp16 on CUDA
    only (CPU ranks train it in fp32: fp16 needs loss scaling and few CPUs compute it
    natively)."""
    if precision == "fp32" or (precision == "fp16" and device.type != "cuda"):
        return None
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device.type, dtype=dtype)


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN computes bf16 in hardware here (AVX512-BF16 or AMX); without it
    bf16 autocast on a CPU is emulated and slower than fp32."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def wrap_ddp(model: nn.Module, device: torch.device, ddp_cfg: dict) -> DDP:
    """DDP with the configured bucket size, bucket views, static graph and compression hook."""
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=ddp_cfg["bucket_cap_mb"],
        gradient_as_bucket_view=ddp_cfg["gradient_as_bucket_view"],
        static_graph=ddp_cfg["static_graph"],
    )
    if ddp_cfg["comm_hook"] != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = {
            "bf16_compress": default_hooks.bf16_compress_hook,
            "fp16_compress": default_hooks.fp16_compress_hook,
        }[ddp_cfg["comm_hook"]]
        ddp.register_comm_hook(None, hook)
    return ddp


class Loop:
    """One run's training state and its epoch loop (state is what a checkpoint holds)."""

    def __init__(self, run: dict, data: dict, env, device: torch.device, model: nn.Module):
        self.run, self.data, self.env, self.device = run, data, env, device
        if data.get("feed") is None:  # tensors given directly (tests, benchmarks)
            data["feed"] = feed.MemoryFeed(data["train_x"])
        tcfg = run["train"]
        self.tcfg = tcfg
        # one rank: nothing to shard, every strategy is plain training
        self.strategy = tcfg["strategy"] if env.world_size > 1 else "ddp"
        self.sharded_optimizer = self.strategy == "zero"
        self.fsdp = self.strategy == "fsdp"
        if tcfg["activation_checkpointing"]:  # before sharding: FSDP's hooks wrap it
            blocks = sharding.checkpoint_activations(model)
            if env.is_master:
                log.info("activation checkpointing: %d blocks recompute their forward in "
                         "the backward", blocks)  # fmt: skip
        if self.fsdp:  # sharded in place: the model's parameters become DTensor shards
            self.model = self.ddp = sharding.shard(model, device, tcfg)
        else:
            self.model = model
            self.ddp = wrap_ddp(model, device, tcfg["ddp"]) if env.world_size > 1 else model
        self._compiling = tcfg["compile"] and env.is_master
        if tcfg["compile"]:
            # the DDP module is compiled (not the model inside): dynamo then splits the graph
            # at DDP's bucket boundaries, so the all-reduce still overlaps the backward
            self.ddp = torch.compile(self.ddp)
        self.lr = effective_lr(tcfg)
        self.micro_per_step = micro_batches_per_step(tcfg)
        self.accum = accumulation_steps(tcfg, env.world_size)
        self.optimizer = make_optimizer(
            model.parameters(), tcfg["optimizer"], self.lr, device, self.sharded_optimizer,
            dtensors=self.fsdp,
        )  # fmt: skip
        self.steps_per_epoch = self._optimizer_steps_per_epoch()
        total = self.steps_per_epoch * tcfg["epochs"]
        warmup = round(tcfg["warmup_epochs"] * self.steps_per_epoch)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_schedule(tcfg["schedule"], warmup, total)
        )
        self.autocast = autocast_factory(tcfg["precision"], device)
        self.scaler = torch.amp.GradScaler(
            "cuda", enabled=tcfg["precision"] == "fp16" and device.type == "cuda"
        )
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=tcfg["label_smoothing"])
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
        self.on_step = None  # called after every optimizer step (checkpoint / stop checks)
        self.last_loss: torch.Tensor | None = None  # the last micro-step's, on the device
        # divergence watch: 1.0 once a step went non-finite, decided alike on every rank at
        # the same step (see _step_flag); on CUDA read one step late (the host never waits
        # for the step it just queued)
        self._nonfinite = torch.zeros((), device=device)
        # (FSDP: a rank holds a shard of that gradient only; the flags are MAX-reduced)
        self._watched = None if self.fsdp else _output_parameter(model)
        self._unread: tuple | None = None  # (flag, epoch, step) not yet looked at
        self._warned_nonfinite = False

    @property
    def micro_batches_per_epoch(self) -> int:
        """The micro-batches this rank computes in an epoch (what its progress bar counts)."""
        return self.steps_per_epoch * self.accum

    def _optimizer_steps_per_epoch(self) -> int:
        return self.data["train_x"].shape[0] // self.tcfg["global_batch_size"]

    def train_epoch(self, progress=None) -> dict:
        """Finish the current epoch from self.epoch_step; returns its mean loss and seconds."""
        self.ddp.train()
        tcfg, env, accum = self.tcfg, self.env, self.accum
        batches = step_micro_batches(
            self.data["train_x"].shape[0], tcfg["global_batch_size"], tcfg["micro_batch_size"],
            tcfg["seed"], self.epoch,
        )  # fmt: skip
        mine = rank_micro_batches(batches, env.world_size, env.rank)
        feed_ = self.data["feed"]
        device_batches = mine.to(self.device)
        start = self.epoch_step * accum
        images = feed_.epoch(device_batches if not feed_.streamed else mine, start)
        if progress is not None:
            progress.update(start)
        for index in range(start, len(mine)):
            step, within = divmod(index, accum)
            micro = env.rank * accum + within  # the micro-batch's index in its step
            faults.maybe_inject(env.rank, self.epoch, index)
            if slow := faults.slow_seconds(env.rank):
                time.sleep(slow)
            last_micro = within == accum - 1
            started = time.perf_counter() if self._compiling else 0.0
            self.last_loss = self._micro_step(
                device_batches[index], images, last_micro, step, micro
            )
            if self._compiling:  # the first step compiled the forward and backward
                self._compiling = False
                log.info("torch.compile: the first step took %.1f s (compiling forward and "
                         "backward)", time.perf_counter() - started)  # fmt: skip
            self.step_losses[step] += self.last_loss
            if progress is not None:
                progress.update(1)
            if last_micro:
                self.epoch_step = step + 1
                if self.on_step is not None:
                    self.on_step(self)
        self._read_nonfinite(None)  # the epoch's last step (the host syncs here anyway)
        # One host sync per epoch, not per step (the tutorials' .item() every step stalls).
        self.clock.settle()
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
        return record

    def global_step_losses(self) -> torch.Tensor:
        """Collective: each step's summed micro-batch losses over all ranks (the step's loss
        times its micro-batch count), the same at every world size up to summation order.
        A copy: this rank's own sums stay as they are."""
        losses = self.step_losses.detach().clone()
        if self.env.world_size > 1:
            dist.all_reduce(losses)
        return losses

    def gather_state(self) -> None:
        """Collective, before rank 0 takes state_dict(): ZeRO's optimizer state lives in
        shards, which rank 0 collects (a checkpoint holds the whole state, as with ddp, so a
        run resumes under either strategy and at any world size's sharding); the epoch's
        step losses so far are summed over the ranks (a checkpoint holds the global sums)."""
        if self.sharded_optimizer:
            self.optimizer.consolidate_state_dict(to=0)
        self._global_step_losses = self.global_step_losses()

    def full_model_state(self) -> dict:
        """Collective under FSDP: the whole model's state dict, on rank 0 (what model.pt
        holds; the other ranks get an empty dict). Elsewhere the local state dict."""
        if self.fsdp:
            return sharding.full_model_state(self.model)
        return self.model.state_dict()

    def state_dict(self) -> dict:
        """Everything an exact resume needs (the caller adds RNG states and the config hash).
        Rank 0 only where the optimizer is sharded, after gather_state() on every rank.
        FSDP: without the model and optimizer, which sharding.save writes (every rank)."""
        self.clock.settle()  # the partial epoch's phase seconds are part of the state
        tensors = {} if self.checkpoints_sharded else {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }  # fmt: skip
        losses = self._global_step_losses
        return {
            **tensors,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.epoch,
            "epoch_step": self.epoch_step,
            "step": self.scheduler.last_epoch,
            "step_losses": (losses if losses is not None else self.step_losses).detach().cpu(),
            "epoch_seconds": dict(self.epoch_seconds),
            "history": list(self.history),
            "world_size": self.env.world_size,
            "segments": [dict(s) for s in self.segments],
        }

    @property
    def checkpoints_sharded(self) -> bool:
        """Strategy fsdp checkpoints in DCP's resharding format at every world size (on one
        rank too, where it trains unsharded), so that any world size continues them."""
        return self.tcfg["strategy"] == "fsdp"

    def load_state_dict(self, state: dict, path: Path | None = None) -> None:
        """Collective, at any world size: the position is global, the step losses are the
        ranks' sums (rank 0 takes them, the others start from zero), ZeRO's optimizer state
        is whole and DCP reshards. FSDP: the model and optimizer shards are read from the
        DCP directory next to the checkpoint at path."""
        kernels = _kernel_choices(self.optimizer)
        if "sharded" in state:
            sharding.load(self.model, self.optimizer, path, state["sharded"])
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        # a loaded param group brings the kernel choice of the run that wrote it (fused on
        # one rank, foreach for FSDP's DTensors, which fused kernels refuse): keep this run's
        for group, own in zip(self.optimizer.param_groups, kernels, strict=True):
            group.update(own)
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.epoch_step = state["epoch"], state["epoch_step"]
        losses = state["step_losses"].to(self.device)
        self.step_losses = losses if self.env.is_master else torch.zeros_like(losses)
        self.epoch_seconds = dict(state["epoch_seconds"])
        self.history = list(state["history"])
        self.segments = [dict(s) for s in state["segments"]]
        self.prime_ddp()

    def prime_ddp(self) -> None:
        """Put DDP's gradient buckets in the state an uninterrupted run has at this step, and
        change nothing else: synchronised forward/backward passes whose gradients, BatchNorm
        buffer updates and RNG draws are all discarded (weights and optimizer stay untouched).

        Why: DDP lays its buckets out in reverse parameter order, then rebuilds them once, in
        the order gradients became ready, at the forward after the first synchronised backward
        (static_graph: after the second; the first only counts the gradient hooks). gloo's ring
        all-reduce adds an element's per-rank values in an order that depends on the element's
        offset in the bucket, so from 3 ranks on (2 ranks: a + b == b + a) a resumed run whose
        fresh DDP still had the initial layout summed gradients in another order than the
        uninterrupted run did at the same step: the last bits differed, then the whole run.
        Collective: every rank calls it (Loop.load_state_dict does). The iteration counts
        follow torch's DDP internals; tests/test_resume_exact.py fails if a torch upgrade
        moves the rebuild.
        """
        ddp = getattr(self.ddp, "_orig_mod", self.ddp)  # under torch.compile
        if not isinstance(ddp, DDP):
            return
        # synchronised backwards the uninterrupted run had done: one per optimizer step
        iterations = min(self.scheduler.last_epoch, 2 if ddp.static_graph else 1)
        if iterations == 0:
            return
        size = min(self.tcfg["micro_batch_size"], self.data["train_x"].shape[0])
        x = evaluate.normalize(feed.rows(self.data["train_x"], 0, size), *self.data["norm"])
        y = self.data["train_y"][:size]
        buffers = [b.detach().clone() for b in self.model.buffers()]  # BatchNorm statistics
        was_training = self.ddp.training
        cuda = [self.device] if self.device.type == "cuda" else []
        # the graph of a training step (train mode, autocast, outside no_sync), so gradients
        # become ready in the same order
        with torch.random.fork_rng(devices=cuda), torch.enable_grad():
            self.ddp.train()
            for _ in range(iterations):
                with self.autocast() if self.autocast else contextlib.nullcontext():
                    loss = self.loss_fn(self.ddp(x), y)
                loss.backward()
                self.model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for buffer, saved in zip(self.model.buffers(), buffers, strict=True):
                buffer.copy_(saved)
        self.ddp.train(was_training)

    def _micro_step(self, batch, images, last_micro, step, micro) -> torch.Tensor:
        """Micro-batch `micro` of the epoch's step `step`: `batch` its sample indices (on the
        device), `images` the feed's iterator of the epoch's uint8 batches (in memory:
        index_select; streamed: read ahead by DataLoader workers)."""
        accum, seconds = self.accum, self.epoch_seconds
        self.clock.step()
        with self.clock.phase(seconds, "data"):
            x = next(images)
            # every random draw of this micro-batch (augmentation, a model's dropout) comes
            # from (seed, epoch, step, micro), whichever rank computes it
            draws = micro_batch_seed(self.tcfg["seed"], self.epoch, step, micro)
            _seed_random_draws(draws, self.device)
            x = feed.augment(x, self.tcfg["augment"], draws)
            x = evaluate.normalize(x, *self.data["norm"])
            y = self.data["train_y"].index_select(0, batch)
        # no_sync(): skip the gradient all-reduce on all but the last micro-step
        skip_sync = contextlib.nullcontext()
        if not last_micro and self.env.world_size > 1:
            skip_sync = sharding.no_gradient_sync(self.model) if self.fsdp else self.ddp.no_sync()
        with skip_sync:
            with (
                self.clock.phase(seconds, "forward"),
                self.autocast() if self.autocast else contextlib.nullcontext(),
            ):
                loss = self.loss_fn(self.ddp(x), y)
            with self.clock.phase(seconds, "backward_sync"):
                # DDP/FSDP average over the ranks, so 1/accum here makes the gradient the
                # mean over the step's micro-batches (no extra kernel when accum is 1)
                self.scaler.scale(loss / accum if accum > 1 else loss).backward()
        loss = loss.detach().float()
        torch.maximum(self._nonfinite, (~torch.isfinite(loss)).float(), out=self._nonfinite)
        if last_micro:
            flag = self._step_flag()  # before zero_grad: it may read a gradient
            with self.clock.phase(seconds, "optimizer"):
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.optimizer.zero_grad(set_to_none=True)
                self.scheduler.step()
            self._watch_nonfinite(flag)
        return loss

    def _step_flag(self) -> torch.Tensor:
        """1.0 if this optimizer step went non-finite, the same value on every rank.

        A non-finite loss on any rank makes that rank's gradient of the output layer
        non-finite (NaN or inf logits give NaN there), and DDP's all-reduce hands every rank
        the same bits of the summed gradient: each rank reads the flag off its own copy, with
        no collective of its own (a MAX all-reduce per step held the 2-rank MLP at 1.05x
        the raw loop on CPU; without it 1.28x: bench/throughput.py, 2026-11-23). Where
        gradients may be legitimately infinite (fp16's GradScaler skips such steps) or the
        output layer got no gradient, the ranks' loss flags are MAX-reduced instead."""
        flag, self._nonfinite = self._nonfinite, torch.zeros((), device=self.device)
        if self.env.world_size == 1:
            return flag
        grad = self._watched.grad if self._watched is not None else None
        if grad is not None and not self.scaler.is_enabled():
            return (~torch.isfinite(grad).all()).float()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def _watch_nonfinite(self, flag: torch.Tensor) -> None:
        current = (flag, self.epoch, self.scheduler.last_epoch)
        if self.device.type == "cuda":
            self._read_nonfinite(current)  # reads the previous step's flag
        else:
            self._unread = current
            self._read_nonfinite(None)

    def _read_nonfinite(self, replace_with: tuple | None) -> None:
        unread, self._unread = self._unread, replace_with
        if unread is None or not float(unread[0]):
            return
        _, epoch, step = unread
        where = f"run {self.run['name']!r}: the training loss became NaN or infinite at epoch "
        where += f"{epoch + 1}, optimizer step {step} (on at least one rank)"
        advice = (
            f"Lower train.optimizer.lr (the effective lr is {self.lr:.4g}), raise "
            "train.warmup_epochs, or check the data"
        )
        if self.tcfg["on_nonfinite"] == "fail":
            raise Diverged(
                f"{where}; every rank stopped there. {advice}; "
                "train.on_nonfinite: warn trains on regardless"
            )
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            log.warning("%s; training on (train.on_nonfinite: warn). %s", where, advice)

    def validate(self) -> dict:
        sync_buffers(self.model, self.env.world_size)
        images, labels = self.data["val_x"], self.data["val_y"]
        result = evaluate.evaluate_split(
            self.model,
            images,
            labels,
            self.data["num_classes"],
            self.run["eval"]["batch_size"],
            self.data["norm"],
            self.env.rank,
            self.env.world_size,
            self.autocast,
        )
        return {"val_accuracy": result["accuracy"], "val_loss": result["loss"]}


def _seed_random_draws(seed: int, device: torch.device) -> None:
    """Seed the generators a forward draws from (dropout): the CPU's, and on a GPU rank
    its device's. Not torch.manual_seed: while CUDA is uninitialised (CPU ranks) it queues
    a lazy seeding of every accelerator, with a stack trace each, ~0.35 ms per micro-step
    (bench/scaling.py) against ~2 us here."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


def _kernel_choices(optimizer) -> list[dict]:
    """Each param group's fused/foreach flags: how the optimizer computes, not what."""
    return [{k: g[k] for k in ("fused", "foreach") if k in g} for g in optimizer.param_groups]


def _output_parameter(model: nn.Module) -> nn.Parameter | None:
    """The last trainable parameter registered: the output layer's, in every built-in model
    and in the usual layout of any other (the divergence watch reads its gradient)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return trainable[-1] if trainable else None


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
    the record joined loop.history (so a checkpoint written there includes it)."""
    start = time.perf_counter()
    while loop.epoch < loop.tcfg["epochs"]:
        epoch_start = time.perf_counter()
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
        loop.history.append(record)
        on_epoch(record)
    return time.perf_counter() - start
