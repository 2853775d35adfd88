"""The order and the pace of training, as pure functions of the config: which samples each
optimizer step and each rank's micro-batch take, the seed of a micro-batch's random draws,
and the learning rate per step.

The data order is the science's, not the machine's (step_micro_batches): each epoch is one
seeded shuffle cut into optimizer steps of train.global_batch_size samples, each step into
micro-batches of train.micro_batch_size; micro-batch j of step s is fixed by (seed, epoch, s,
j), and rank r computes the contiguous block j in [r*a, (r+1)*a) (a accumulation steps), so
every world size that divides the step computes the same micro-batches with the same random
draws, and the gradient is their mean. Where a rank's micro-batch is a part of the run's
normalisation batch (train.norm_batch_size), the parts of one normalisation batch go to the
ranks of one group at the same accumulation step (grouped), and its draws are made for the
whole normalisation batch (ddpflow.training.norm_groups). A language model's fresh windows
shift every block of an epoch by one offset drawn from (seed, epoch) (window_offset).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from ddpflow.config.typed import TrainSpec


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
    step the contiguous block j in [start, start + a) (first_position), a = micro-batches /
    world, the first ranks one more each where world does not divide them."""
    start, accum = (
        first_position(batches.shape[1], world, rank),
        share(batches.shape[1], world, rank),
    )
    return batches[:, start : start + accum].reshape(-1, batches.shape[2])


def share(count: int, world: int, rank: int) -> int:
    """A rank's micro-batches of a step's `count` (config.machine.rank_shares)."""
    base, extra = divmod(count, world)
    return base + (rank < extra)


def first_position(count: int, world: int, rank: int) -> int:
    """The step position of a rank's first micro-batch (the ranks before it hold the rest)."""
    base, extra = divmod(count, world)
    return rank * base + min(rank, extra)


def norm_batch_part(position: int, accum: int, group: int) -> tuple[int, int]:
    """(normalisation batch, part of it) of the micro-batch at `position` of a step
    (rank * accum + accumulation step, the position rank_micro_batches hands out) when
    `group` consecutive ranks hold each normalisation batch (train.norm_batch_size): the
    parts of one sit at the same accumulation step of the group's ranks."""
    rank, within = divmod(position, accum)
    team, part = divmod(rank, group)
    return team * accum + within, part


def grouped(batches: torch.Tensor, accum: int, group: int) -> torch.Tensor:
    """step_micro_batches' micro-batches in the positions a normalisation group computes
    them (norm_batch_part): normalisation batch b is micro-batches [b * group, (b + 1) *
    group) of the step's order, each part on one rank of its group. Unchanged at group 1."""
    if group == 1:
        return batches
    order = [
        norm * group + part
        for norm, part in (norm_batch_part(j, accum, group) for j in range(batches.shape[1]))
    ]
    return batches[:, order]


def micro_batch_seed(seed: int, epoch: int, step: int, micro: int) -> int:
    """The seed of the random draws of micro-batch `micro` of step `step` (augmentation,
    dropout): the same whichever rank computes it."""
    key = np.random.SeedSequence([seed, epoch, step, micro]).generate_state(2, np.uint64)
    return int(key[0] >> np.uint64(1))


WINDOW_DRAWS = 0x77696E64  # "wind": the offsets' own stream, apart from micro-batch draws


def window_offset(seed: int, epoch: int, block: int) -> int:
    """train.fresh_windows: the token offset in [0, block) where epoch `epoch`'s training
    blocks start (ddpflow.data.windows), a function of (seed, epoch) alone: every rank, every
    world size and a resumed run cut the same blocks."""
    key = np.random.SeedSequence([seed, epoch], spawn_key=(WINDOW_DRAWS,))
    return int(key.generate_state(1, np.uint64)[0] % np.uint64(block))


def effective_lr(train_cfg: TrainSpec) -> float:
    """The configured lr, scaled with the global batch (Goyal et al.: linear; or sqrt). The
    world size plays no part: the global batch is the recipe's."""
    ratio = train_cfg.global_batch_size / train_cfg.base_batch_size
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[train_cfg.lr_scaling]
    return train_cfg.optimizer.lr * factor


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
