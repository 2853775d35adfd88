"""The divergence watch: a NaN or infinite training loss on any rank stops every rank at the
same optimizer step (train.on_nonfinite: fail) or is warned about once (warn), without a
host sync per step."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from ddpflow.config.typed import RunSpec

log = logging.getLogger(__name__)


class Diverged(RuntimeError):
    """The training loss became NaN or infinite (train.on_nonfinite: fail)."""


class NonfiniteWatch:
    """Whether a step went non-finite, decided alike on every rank at the same step (see
    step_flag); on CUDA read one step late (the host never waits for the step it just
    queued), on a CPU right away."""

    def __init__(
        self,
        run: RunSpec,
        lr: float,
        device: torch.device,
        world_size: int,
        watched: nn.Parameter | None,
        scaler: torch.amp.GradScaler,
    ):
        self.run = run  # its name and train.on_nonfinite
        self.lr, self.device, self.world_size = lr, device, world_size
        # the output layer's parameter, whose all-reduced gradient carries a rank's NaN to
        # every rank (None under FSDP: a rank holds a shard of that gradient only; the
        # flags are MAX-reduced)
        self.watched, self.scaler = watched, scaler
        self._flag = torch.zeros((), device=device)  # 1.0 once a micro-step went non-finite
        self._unread: tuple | None = None  # (flag, epoch, step) not yet looked at
        self._warned = False

    def add(self, loss: torch.Tensor) -> None:
        """A micro-step's loss (detached, float), on the device: no host sync."""
        torch.maximum(self._flag, (~torch.isfinite(loss)).float(), out=self._flag)

    def step_flag(self) -> torch.Tensor:
        """1.0 if this optimizer step went non-finite, the same value on every rank; called
        before the optimizer zeroes the gradients (it may read one).

        A non-finite loss on any rank makes that rank's gradient of the output layer
        non-finite (NaN or inf logits give NaN there), and DDP's all-reduce hands every rank
        the same bits of the summed gradient: each rank reads the flag off its own copy, with
        no collective of its own (a MAX all-reduce per step held the 2-rank MLP at 1.05x
        the raw loop on CPU; without it 1.28x: bench/throughput.py, 2026-11-23). Where
        gradients may be legitimately infinite (fp16's GradScaler skips such steps) or the
        output layer got no gradient, the ranks' loss flags are MAX-reduced instead."""
        flag, self._flag = self._flag, torch.zeros((), device=self.device)
        if self.world_size == 1:
            return flag
        grad = self.watched.grad if self.watched is not None else None
        if grad is not None and not self.scaler.is_enabled():
            return (~torch.isfinite(grad).all()).float()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def after_step(self, flag: torch.Tensor, epoch: int, step: int) -> None:
        """The step's flag (step_flag), once the optimizer stepped: on CUDA the previous
        step's flag is read now, this one at the next step; elsewhere this one."""
        current = (flag, epoch, step)
        if self.device.type == "cuda":
            self.read(current)  # reads the previous step's flag
        else:
            self._unread = current
            self.read(None)

    def read(self, replace_with: tuple | None = None) -> None:
        """Look at the flag not yet read (None at the epoch's end: the host syncs there
        anyway); raises Diverged or warns once."""
        unread, self._unread = self._unread, replace_with
        if unread is None or not float(unread[0]):
            return
        _, epoch, step = unread
        where = f"run {self.run.name!r}: the training loss became NaN or infinite at epoch "
        where += f"{epoch + 1}, optimizer step {step} (on at least one rank)"
        advice = (
            f"Lower train.optimizer.lr (the effective lr is {self.lr:.4g}), raise "
            "train.warmup_epochs, or check the data"
        )
        if self.run.train.on_nonfinite == "fail":
            raise Diverged(
                f"{where}; every rank stopped there. {advice}; "
                "train.on_nonfinite: warn trains on regardless"
            )
        if not self._warned:
            self._warned = True
            log.warning("%s; training on (train.on_nonfinite: warn). %s", where, advice)


def output_parameter(model: nn.Module) -> nn.Parameter | None:
    """A trainable parameter of the last module registered that has one: the output layer's,
    in every built-in model and in the usual layout of any other (the divergence watch reads
    its gradient). By module, not by model.parameters(): gpt's output layer is tied to the
    token embedding, which parameters() lists once, first."""
    for module in reversed(list(model.modules())):
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if own:
            return own[-1]
    return None
