"""BatchNorm running statistics that do not depend on the world size.

Training normalises each micro-batch with its own statistics (no SyncBatchNorm: that would
change the science), but torch's BatchNorm also folds each batch's mean and unbiased variance
into its running statistics, the ones the evaluated and saved model normalises with. Under
DDP each rank folds in only the micro-batches it computed, and rank 0's are saved: at W ranks
they have seen 1/W of every step. Here every rank ends each optimizer step with exactly the
running statistics one rank computing every micro-batch of the step in the global order
would have (momentum, momentum=None's cumulative average and num_batches_tracked included):

- while a step runs, each training BatchNorm writes into a scratch vector with momentum 1
  (running = 1 * batch + 0 * scratch: torch's own batch mean and unbiased variance, at no
  extra compute), copied after each micro-step into that micro-batch's global slot;
- at the step's end one sum all_reduce of the zero-filled [micro-batches, statistics] slots
  (each rank filled its own rows: x + 0 is exact) gives every rank every micro-batch's
  statistics, folded into the real buffers in the global order.

Frozen BatchNorm layers (eval mode: fine-tuning) are left alone. Activation checkpointing's
recomputed forward keeps momentum 0 (sharding.checkpoint_activations), so it records nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

_BatchNorm = nn.modules.batchnorm._BatchNorm


@dataclass(frozen=True)
class _Saved:
    """A module's own buffers and momentum, put aside while the step writes into scratch."""

    module: _BatchNorm
    mean: torch.Tensor
    var: torch.Tensor
    tracked: torch.Tensor
    momentum: float | None


def tracked_norms(model: nn.Module) -> list[_BatchNorm]:
    """The BatchNorm layers whose running statistics a training forward updates now."""
    return [
        m
        for m in model.modules()
        if isinstance(m, _BatchNorm)
        and m.training
        and m.track_running_stats
        and m.running_mean is not None
        and m.running_var is not None
        and m.num_batches_tracked is not None
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
    end_step after the last (a collective at several ranks)."""

    def __init__(self, model: nn.Module, micro_per_step: int, world_size: int, device):
        self.model, self.micro_per_step = model, micro_per_step
        self.world_size, self.device = world_size, device
        self._saved: list[_Saved] = []
        self._scratch = torch.zeros(0, device=device)
        self._slots = torch.zeros(0, device=device)

    def begin_step(self) -> None:
        """Point every training BatchNorm at scratch buffers (momentum 1) for this step."""
        norms = tracked_norms(self.model)
        if not norms:
            return
        width = sum(2 * m.num_features for m in norms)
        if self._scratch.numel() != width:  # the first step, or after unfreezing
            self._scratch = torch.zeros(width, device=self.device)
            self._slots = torch.zeros(self.micro_per_step, width, device=self.device)
        else:
            self._slots.zero_()
        offset = 0
        for m in norms:
            c = m.num_features
            assert m.running_mean is not None and m.running_var is not None
            assert m.num_batches_tracked is not None  # tracked_norms checked all three
            self._saved.append(
                _Saved(m, m.running_mean, m.running_var, m.num_batches_tracked, m.momentum)
            )
            m.running_mean = self._scratch[offset : offset + c]
            m.running_var = self._scratch[offset + c : offset + 2 * c]
            m.num_batches_tracked = torch.zeros_like(m.num_batches_tracked)
            m.momentum = 1.0  # the scratch holds this micro-batch's own statistics
            offset += 2 * c

    def record(self, micro: int) -> None:
        """After micro-batch `micro`'s forward: its statistics into its slot."""
        if self._saved:
            self._slots[micro].copy_(self._scratch)

    def end_step(self) -> None:
        """Collective: every micro-batch's statistics to every rank, folded in in order."""
        if not self._saved:
            return
        if self.world_size > 1:
            dist.all_reduce(self._slots)
        saved, self._saved = self._saved, []
        for s in saved:
            s.module.running_mean, s.module.running_var = s.mean, s.var
            s.module.num_batches_tracked, s.module.momentum = s.tracked, s.momentum
        self._fold(saved)

    def _fold(self, saved: list[_Saved]) -> None:
        """running = f * batch + (1 - f) * running per micro-batch in the global order, as
        torch's kernels compute it (f: momentum, or 1 / num_batches_tracked when None)."""
        buffers = [b for s in saved for b in (s.mean, s.var)]
        running = torch.cat([b.float() for b in buffers])
        factors = self._factors(saved)  # [micro-batches, width], float64
        keep = (1.0 - factors).float()
        factors = factors.float()
        for micro in range(self.micro_per_step):
            running = factors[micro] * self._slots[micro] + keep[micro] * running
        sizes = [b.numel() for b in buffers]
        torch._foreach_copy_(buffers, list(running.split(sizes)))
        torch._foreach_add_([s.tracked for s in saved], self.micro_per_step)

    def _factors(self, saved: list[_Saved]) -> torch.Tensor:
        """Each micro-batch's update factor per statistic, in float64 like torch's."""
        columns = []
        steps = torch.arange(1, self.micro_per_step + 1, device=self.device, dtype=torch.float64)
        for s in saved:
            if s.momentum is None:  # cumulative average: 1 / batches seen, this one included
                factor = 1.0 / (s.tracked.double() + steps)
            else:
                factor = torch.full_like(steps, s.momentum)
            columns.append(factor[:, None].expand(-1, 2 * s.module.num_features))
        return torch.cat(columns, dim=1)
