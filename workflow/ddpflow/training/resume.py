"""A Loop's checkpoint state: what an exact resume needs, how it is gathered from the ranks,
and how a loaded state is put back (at any world size, under any strategy)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpflow.config.machine import SHARDED_STRATEGIES
from ddpflow.data import feed
from ddpflow.training import evaluate, sharding, tensor_parallel, zero_state

if TYPE_CHECKING:
    from ddpflow.cluster.distenv import DistEnv
    from ddpflow.config.typed import TrainSpec
    from ddpflow.runtime import PhaseClock
    from ddpflow.training.batchnorm import ExactStatistics
    from ddpflow.training.rankdata import RankData


class Resumable:
    """Loop's state_dict / load_state_dict and the collectives around them (a mix-in: it
    reads the Loop's model, optimizer, schedule and position)."""

    # what it reads and sets of the Loop (Loop.__init__ assigns them)
    env: DistEnv
    device: torch.device
    data: RankData
    tcfg: TrainSpec
    micro_batch_size: int
    model: nn.Module
    wrapped: nn.Module
    sharded_optimizer: bool
    fsdp: bool
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    autocast: Callable | None
    loss_fn: nn.Module
    clock: PhaseClock
    epoch: int
    epoch_step: int
    step_losses: torch.Tensor
    _global_step_losses: torch.Tensor | None
    epoch_seconds: dict[str, float]
    history: list[dict]
    segments: list[dict]
    norm_stats: ExactStatistics  # settled (every rank) before its buffers are read or replaced

    if TYPE_CHECKING:

        def global_step_losses(self) -> torch.Tensor: ...

        def unfreeze_if_due(self, epoch: int) -> None: ...

    def gather_state(self) -> None:
        """Collective, before rank 0 takes state_dict(): ZeRO's optimizer state lives in
        shards, which rank 0 collects (a checkpoint holds the whole state, as with ddp, so a
        run resumes under either strategy and at any world size's sharding); the epoch's
        step losses so far are summed over the ranks (a checkpoint holds the global sums)."""
        self.norm_stats.settle()  # the BatchNorm statistics of every finished step
        if self.sharded_optimizer:  # its tensors sent as tensors, not pickled
            zero_state.consolidate(self.optimizer)
        self._global_step_losses = self.global_step_losses()

    def release_gathered_state(self) -> None:
        """After a checkpoint is written: drop the whole optimizer state gather_state()
        collected on rank 0 (ZeroRedundancyOptimizer keeps it until the next consolidation,
        which would hold two copies at once)."""
        if self.sharded_optimizer:
            zero_state.release(self.optimizer)

    def full_model_state(self) -> dict:
        """Collective under FSDP: the whole model's state dict, on rank 0 (what model.pt
        holds; the other ranks get an empty dict). Elsewhere the local state dict."""
        self.norm_stats.settle()
        if self.fsdp or self.env.tensor_parallel > 1:
            return sharding.full_model_state(self.model)
        return self.model.state_dict()

    def state_dict(self) -> dict:
        """Everything an exact resume needs (the caller adds RNG states and the config hash).
        Rank 0 only where the optimizer is sharded, after gather_state() on every rank;
        without gather_state(), every rank calls it (BatchNorm statistics may be pending).
        FSDP: without the model and optimizer, which sharding.save writes (every rank)."""
        self.clock.settle()  # the partial epoch's phase seconds are part of the state
        self.norm_stats.settle()  # a collective only where gather_state() did not settle
        tensors: dict = {}
        if not self.checkpoints_sharded:
            tensors = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
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
            "world_size": self.env.processes,  # the ranks that wrote it
            "tensor_parallel": self.env.tensor_parallel,
            "segments": [dict(s) for s in self.segments],
        }

    @property
    def checkpoints_sharded(self) -> bool:
        """Strategy fsdp checkpoints in DCP's resharding format at every world size (on one
        rank too, where it trains unsharded), so that any world size continues them."""
        return self.tcfg.strategy in SHARDED_STRATEGIES or self.env.tensor_parallel > 1

    def load_state_dict(self, state: dict, path: Path | None = None) -> None:
        """Collective, at any world size: the position is global, the step losses are the
        ranks' sums (rank 0 takes them, the others start from zero), ZeRO's optimizer state
        is whole and DCP reshards. FSDP: the model and optimizer shards are read from the
        DCP directory next to the checkpoint at path."""
        self.norm_stats.settle()  # nothing pending folds into the loaded buffers later
        self.unfreeze_if_due(state["epoch"])  # the checkpoint's optimizer holds every parameter
        kernels = _kernel_choices(self.optimizer)
        if "sharded" in state:
            assert path is not None, "a sharded checkpoint is read from beside its path"
            sharding.load(self.model, self.optimizer, path, state["sharded"])
        elif self.env.tensor_parallel > 1:  # a whole state (ddp at tensor_parallel 1)
            whole = state["model"], state["optimizer"]
            tensor_parallel.load_whole(self.model, self.optimizer, *whole)
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
        ddp = getattr(self.wrapped, "_orig_mod", self.wrapped)  # under torch.compile
        if not isinstance(ddp, DDP):
            return
        # synchronised backwards the uninterrupted run had done: one per optimizer step
        iterations = min(self.scheduler.last_epoch, 2 if ddp.static_graph else 1)
        if iterations == 0:
            return
        train = self.data.train
        size = min(self.micro_batch_size, train.inputs.shape[0])
        raw = feed.rows(train.inputs, 0, size)
        x, y = evaluate.model_batch(raw, train.labels[:size], self.data.norm, self.data.tokens)
        buffers = [b.detach().clone() for b in self.model.buffers()]  # BatchNorm statistics
        was_training = self.wrapped.training
        cuda = [self.device] if self.device.type == "cuda" else []
        # the graph of a training step (train mode, autocast, outside no_sync), so gradients
        # become ready in the same order
        with torch.random.fork_rng(devices=cuda), torch.enable_grad():
            self.wrapped.train()
            for _ in range(iterations):
                with self.autocast() if self.autocast else contextlib.nullcontext():
                    loss = self.loss_fn(self.wrapped(x), y)
                loss.backward()
                self.model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for buffer, saved in zip(self.model.buffers(), buffers, strict=True):
                buffer.copy_(saved)
        self.wrapped.train(was_training)


def _kernel_choices(optimizer) -> list[dict]:
    """Each param group's fused/foreach flags: how the optimizer computes, not what."""
    return [{k: g[k] for k in ("fused", "foreach") if k in g} for g in optimizer.param_groups]
