"""BatchNorm running statistics that do not depend on the world size.

Training normalises each micro-batch with its own statistics (no SyncBatchNorm: that would
change the science), but torch's BatchNorm also folds each batch's mean and unbiased variance
into its running statistics, the ones the evaluated and saved model normalises with. Under
DDP each rank folds in only the micro-batches it computed, and rank 0's are saved: at W ranks
they have seen 1/W of every step. Here, whenever they are read, every rank holds exactly the
running statistics one rank computing every micro-batch of every step in the global order
would have (momentum, momentum=None's cumulative average and num_batches_tracked included):

- while a step runs, each training BatchNorm writes into a scratch vector with momentum 1
  (running = 1 * batch + 0 * scratch: torch's own batch mean and unbiased variance, at no
  extra compute), copied after each micro-step into that micro-batch's global slot;
- every few steps one all_gather of each rank's rows (the micro-batches it computed) gives
  every rank every micro-batch's statistics of those steps, folded into the real buffers step
  by step in the global order.

Why every few steps, not every step: a training forward normalises with the batch's own
statistics and never reads the running ones, and at 2 CPU ranks the collective's host time
was most of the cost (bench/batchnorm.py; issuing it asynchronously did not help where the
gloo thread competes for the same cores). So the rows of up to STEPS_PER_GATHER steps
(within GATHER_BYTES) wait for one collective, and whatever reads the running statistics
(validation, a checkpoint, the saved model, unfreezing, loading a state, the end of an
epoch) calls settle() first, on every rank: ddpflow.training.loop and .resume do. At one
rank each step folds at once.

Frozen BatchNorm layers (eval mode: fine-tuning) are left alone. Activation checkpointing's
recomputed forward keeps momentum 0 (sharding.checkpoint_activations), so it records nothing.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from ddpflow.training.schedule import first_position, norm_batch_part, share

_BatchNorm = nn.modules.batchnorm._BatchNorm
BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
STEPS_PER_GATHER = 64  # at most; 1 at one rank
GATHER_BYTES = 16 * 2**20  # the statistics held for one gather, at most


class _Layout:
    """The scratch and the slots of one set of training BatchNorm layers (kept across steps:
    the set changes only when layers are unfrozen), and each layer's own buffers."""

    def __init__(self, norms: list[_BatchNorm], micro_per_step: int, ranks: int, steps, device):
        self.norms = norms
        self.sizes = [m.num_features for m in norms for _ in range(2)]
        width = sum(self.sizes)
        self.scratch = torch.zeros(width, device=device)
        if steps is None:  # as many steps as fit GATHER_BYTES, up to STEPS_PER_GATHER
            steps = 1 if ranks == 1 else GATHER_BYTES // (4 * micro_per_step * width)
            steps = max(1, min(STEPS_PER_GATHER, steps))
        # [rank, step, micro-batch of the rank, width]: each rank's rows are contiguous
        # a rank's most micro-batches a step (the first ranks take one more where the world
        # size does not divide them: their neighbours' last row stays unused)
        most = -(-micro_per_step // ranks)
        self.slots = torch.zeros(ranks, steps, most, width, device=device)
        self.pending = 0  # steps recorded, not yet folded in
        views = self.scratch.split(self.sizes)
        # per layer: its scratch buffers (mean, var, batch counter) for the step's forwards
        self.scratch_buffers = [
            {
                "running_mean": views[2 * i],
                "running_var": views[2 * i + 1],
                "num_batches_tracked": torch.zeros((), dtype=torch.long, device=device),
            }
            for i in range(len(norms))
        ]
        self.own: list[dict[str, torch.Tensor]] = []
        self.momenta: list[float | None] = []

    def swap_in(self) -> None:
        """Each layer writes into its scratch, momentum 1 (its own batch statistics). The
        buffer dicts are set directly: nn.Module.__setattr__ costs microseconds per call."""
        self.own = [
            {k: cast(torch.Tensor, m._buffers[k]) for k in s}
            for m, s in zip(self.norms, self.scratch_buffers, strict=True)
        ]
        self.momenta = [m.momentum for m in self.norms]
        for m, scratch in zip(self.norms, self.scratch_buffers, strict=True):
            m._buffers.update(scratch)
            m.__dict__["momentum"] = 1.0

    def swap_out(self) -> None:
        for m, own, momentum in zip(self.norms, self.own, self.momenta, strict=True):
            m._buffers.update(own)
            m.__dict__["momentum"] = momentum


def batchnorm_layers(model: nn.Module) -> list[_BatchNorm]:
    """The model's BatchNorm layers that keep running statistics."""
    return [
        m
        for m in model.modules()
        if isinstance(m, _BatchNorm)
        and m.track_running_stats
        and all(m._buffers.get(k) is not None for k in BUFFERS)
    ]


def only_batchnorm_buffers(model: nn.Module) -> bool:
    """Whether every buffer of the model is a BatchNorm running statistic (which
    ExactStatistics keeps equal on every rank, so DDP need not broadcast buffers)."""
    norm_buffers = {
        id(b) for m in model.modules() if isinstance(m, _BatchNorm) for b in m.buffers(False)
    }
    return all(id(b) in norm_buffers for b in model.buffers())


class ExactStatistics:
    """A rank's side of the exact running statistics: begin_step before a step's first
    micro-step, record(micro) after each (micro: its index in the step, of all ranks),
    end_step after the last (a collective every few steps at several ranks), settle() on
    every rank before anything reads the running statistics, put_back() after an exception
    mid-step. steps_per_gather: None for GATHER_BYTES' worth."""

    def __init__(
        self,
        model: nn.Module,
        micro_per_step: int,
        world_size: int,
        device,
        steps_per_gather: int | None = None,
        group: int = 1,
        accum: int = 1,
    ):
        self.model, self.micro_per_step = model, micro_per_step
        # the step's positions folded, in the global order: one per normalisation batch (a
        # group of ranks holds each part of one, with its statistics: training.norm_groups)
        self._folded = _first_parts(micro_per_step, world_size, accum, group)
        self._slot = _slots(micro_per_step, world_size)  # a position's row in the slots
        self.world_size, self.device = world_size, device
        self._steps_per_gather = steps_per_gather
        self._layers = batchnorm_layers(model)  # the training ones of them at each step
        self._layout: _Layout | None = None
        self._active = False
        self._factors: tuple[torch.Tensor, torch.Tensor] | None = None  # fixed momenta only

    def begin_step(self) -> None:
        """Point every training BatchNorm at scratch buffers (momentum 1) for this step."""
        # frozen layers are in eval mode (weights.keep_frozen_statistics): left alone
        norms = [m for m in self._layers if m.training]
        if not norms:
            return
        layout = self._layout
        if layout is None or layout.norms != norms:  # the first step, or after unfreezing
            self.settle()  # the previous layers' steps first
            layout = self._layout = _Layout(
                norms, self.micro_per_step, self.world_size, self._steps_per_gather, self.device
            )
            self._factors = None
        layout.swap_in()
        self._active = True

    def record(self, micro: int) -> None:
        """After micro-batch `micro`'s forward: its statistics into its slot."""
        if self._active:
            layout = self._layout
            assert layout is not None
            rank, within = self._slot[micro]  # rank r: [first_position(r), + its share)
            layout.slots[rank, layout.pending, within].copy_(layout.scratch)

    def end_step(self) -> None:
        """The step's statistics wait for the gather; a collective once the slots are full."""
        if not self._active:
            return
        layout = self._layout
        assert layout is not None
        layout.swap_out()
        self._active = False
        layout.pending += 1
        if layout.pending == layout.slots.shape[1]:
            self.settle()

    def settle(self) -> None:
        """Every finished step's statistics folded into the buffers. A collective where steps
        are pending at several ranks: every rank calls it at the same point (they all have
        the same steps pending); otherwise nothing happens."""
        layout = self._layout
        if layout is None or layout.pending == 0:
            return
        if self.world_size > 1:  # every rank's rows of the pending steps (of every slot)
            slots = layout.slots
            mine = slots[dist.get_rank()].clone()
            # torch 2.14's name (all_gather_into_tensor warns there: deprecated)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(slots.view(-1, *slots.shape[2:]), mine)
        for step in range(layout.pending):
            self._fold(layout, step)
        layout.pending = 0

    def put_back(self) -> None:
        """Mid-step (an exception): the layers' own buffers and momenta back in place, the
        unfinished step's statistics dropped."""
        if self._active:
            assert self._layout is not None
            self._layout.swap_out()
            self._active = False

    def _fold(self, layout: _Layout, step: int) -> None:
        """running = f * batch + (1 - f) * running per micro-batch of the step in the global
        order, as torch's kernels compute it (f: momentum, or 1 / num_batches_tracked when
        None)."""
        buffers = [b for own in layout.own for b in (own["running_mean"], own["running_var"])]
        running = torch.cat([b.float() for b in buffers])
        factors, keep = self._update_factors(layout)
        rows = layout.slots[:, step].reshape(-1, layout.slots.shape[-1])  # [rank, row]
        for index, micro in enumerate(self._folded):
            running = factors[index] * rows[micro] + keep[index] * running
        torch._foreach_copy_(buffers, list(running.split(layout.sizes)))
        batches = len(self._folded)
        torch._foreach_add_([own["num_batches_tracked"] for own in layout.own], batches)

    def _update_factors(self, layout: _Layout) -> tuple[torch.Tensor, torch.Tensor]:
        """(f, 1 - f) per micro-batch and statistic, [micro-batches, width] in float32 from
        float64 like torch's; computed once unless a layer has momentum None."""
        if self._factors is not None:
            return self._factors
        columns = []
        count = len(self._folded)
        steps = torch.arange(1, count + 1, device=self.device, dtype=torch.float64)
        for m, own, momentum in zip(layout.norms, layout.own, layout.momenta, strict=True):
            if momentum is None:  # cumulative average: 1 / batches seen, this one included
                factor = 1.0 / (own["num_batches_tracked"].double() + steps)
            else:
                factor = torch.full_like(steps, momentum)
            columns.append(factor[:, None].expand(-1, 2 * m.num_features))
        factors = torch.cat(columns, dim=1)
        pair = (factors.float(), (1.0 - factors).float())
        if all(momentum is not None for momentum in layout.momenta):
            self._factors = pair
        return pair


def _slots(micro_per_step: int, world: int) -> list[tuple[int, int]]:
    """(rank, row) of each step position (schedule.rank_micro_batches' blocks)."""
    return [
        (rank, position - first_position(micro_per_step, world, rank))
        for rank in range(world)
        for position in range(
            first_position(micro_per_step, world, rank),
            first_position(micro_per_step, world, rank) + share(micro_per_step, world, rank),
        )
    ]


def _first_parts(micro_per_step: int, world: int, accum: int, group: int) -> list[int]:
    """The rows of the slots ([rank, row] flattened) whose statistics are folded, in the
    global order: every position's at group 1; else the first part of each normalisation
    batch, by the batch's index (groups share evenly: a position is its row there)."""
    most = -(-micro_per_step // world)
    if group == 1:
        return [rank * most + row for rank, row in _slots(micro_per_step, world)]
    parts = {norm_batch_part(j, accum, group): j for j in range(micro_per_step)}
    return [parts[(norm, 0)] for norm in range(micro_per_step // group)]
