"""BatchNorm over a normalisation batch that several ranks hold (train.norm_batch_size).

When a rank's micro-batch is a part of the run's normalisation batch (more ranks than the
run's normalisation batches per step: checks.norm_batch), the `group` consecutive ranks that
hold one normalisation batch compute its mean and variance together: each training BatchNorm
all-reduces its per-channel sums of x and x squared within the group in the forward (one small
collective, in float64) and the gradients of those sums in the backward (one more; _GroupSum is
torch.distributed.nn's differentiable all_reduce, which warns in torch 2.14 that it is
deprecated, without the warning in every rank's log). The samples a layer normalises together
are then the ones one rank normalised at the run's own micro-batch, at any world size: what
SyncBatchNorm does across all ranks, within groups that keep the science. What it costs per
step: bench/norm_groups.py.

Which micro-batches a group computes at once is the schedule's (schedule.grouped): the parts
of one normalisation batch sit at the same accumulation step of the group's ranks. The running
statistics are updated from the group's statistics as torch's kernel would (momentum, or the
cumulative average), so batchnorm.ExactStatistics folds one normalisation batch per group.

    group = norm_process_group(env.world_size, env.rank, 2)   # collective: every rank calls it
    normalise_in_groups(model, group, 2)
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

_BatchNorm = nn.modules.batchnorm._BatchNorm


class _GroupSum(torch.autograd.Function):
    """The sum over the group's ranks; its gradient is the sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        summed = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(summed, group=group)
        return summed

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _GroupSum.apply(grad, ctx.group), None


def all_reduce_with_grad(tensor: torch.Tensor, group) -> torch.Tensor:
    return _GroupSum.apply(tensor, group)


def norm_process_group(world: int, rank: int, size: int):
    """This rank's normalisation group: ranks [k * size, (k + 1) * size). Collective: every
    rank creates every group, in the same order (None where size is 1)."""
    if size == 1:
        return None
    if size == world:  # the whole world: its own group, whose gloo collectives are quicker
        return dist.group.WORLD
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    return mine


def normalise_in_groups(model: nn.Module, group, size: int) -> int:
    """Every BatchNorm layer of the model normalises in training over the `size` ranks of
    `group`; in eval mode (validation, frozen layers) as before. Returns the layers."""
    if size == 1:
        return 0
    layers = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    for layer in layers:
        # an instance attribute: the class, its state_dict and its checkpoints stay torch's
        layer.forward = functools.partial(_group_forward, layer, group, size)  # type: ignore[method-assign]
    return len(layers)


def _group_forward(layer: _BatchNorm, group, size: int, x: torch.Tensor) -> torch.Tensor:
    if not layer.training:
        return type(layer).forward(layer, x)
    layer._check_input_dim(x)
    dims = [0, *range(2, x.dim())]
    shape = [1, -1] + [1] * (x.dim() - 2)
    values = x.float()
    count = values.numel() // values.shape[1] * size  # every part is the same size
    # one collective for both sums, in float64: E[x^2] - E[x]^2 loses nothing float32 holds
    wide = values.double()
    sums = all_reduce_with_grad(torch.cat([wide.sum(dims), wide.square().sum(dims)]), group)
    mean, square = (sums / count).chunk(2)
    var = (square - mean.square()).clamp_min(0.0)
    centred = values - mean.float().view(shape)
    out = centred * torch.rsqrt(var.float() + layer.eps).view(shape)
    if layer.affine:
        out = out * layer.weight.view(shape) + layer.bias.view(shape)
    _update_running(layer, mean.detach().float(), var.detach().float(), count)
    return out.to(x.dtype)


@torch.no_grad()
def _update_running(layer: _BatchNorm, mean, var, count: int) -> None:
    """torch's update: running = (1 - f) * running + f * batch, the unbiased variance, f the
    momentum or 1 / batches seen (momentum None)."""
    if not layer.track_running_stats or layer.running_mean is None:
        return
    assert layer.running_var is not None and layer.num_batches_tracked is not None
    layer.num_batches_tracked.add_(1)
    factor = layer.momentum
    if factor is None:
        factor = 1.0 / float(layer.num_batches_tracked)
    unbiased = var * (count / max(count - 1, 1))
    layer.running_mean.mul_(1 - factor).add_(mean.to(layer.running_mean.dtype), alpha=factor)
    layer.running_var.mul_(1 - factor).add_(unbiased.to(layer.running_var.dtype), alpha=factor)
