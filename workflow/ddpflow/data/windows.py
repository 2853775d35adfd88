"""A token split's windows (docs/language-models.md): the blocks training draws its
micro-batches from, and the windows evaluation scores. A window is block_size + 1 tokens
(B inputs and their B next-token targets) read from the staged split by memory map.

Training (TokenBlocks(scored=False)): window i starts at offset + i*B, non-overlapping. The
offset is 0, or under train.fresh_windows the epoch's draw in [0, B) from (seed, epoch)
(schedule.window_offset): each epoch cuts new block boundaries. The block count is the same
every epoch: (n - 1) // B from offset 0, and under fresh windows (n - B) // B, what every
offset in [0, B) leaves whole. The epoch's order is schedule.step_micro_batches' permutation
of block indices, so the blocks a step reads depend on (seed, epoch, step, micro-batch)
alone: exact at any world size and across a resume at another one.

Scoring (scored=True): every target position 1..n-1 scored exactly once. Window i starts at
i*S (S: eval.stride, B by default). The first window scores all its B targets, each later
one only its last S (its first B - S targets are context: they are what it conditions on,
already scored by an earlier window), the Hugging Face perplexity-with-stride method; S = B
gives non-overlapping windows. 1 + ceil((n - 1 - B) / S) windows, the last padded with PAD.

Which targets count is decided in one place, split_tokens: a target the window does not score
is PAD, which the loss and every metric ignore (ddpflow.task.lm).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

PAD = -1  # a target that is not scored: a window's padding, or its context under a stride


def train_blocks(n: int, block: int, fresh: bool = False) -> int:
    """Training blocks of a split of n tokens: from offset 0, or (fresh) from any offset."""
    return max(n - (block if fresh else 1), 0) // block


def scored_windows(n: int, block: int, stride: int) -> int:
    """Windows that score positions 1..n-1 once at this stride."""
    return 0 if n < 2 else 1 + math.ceil(max(n - 1 - block, 0) / stride)


def scored_blocks(n: int, block: int) -> int:
    """Non-overlapping scored windows: ceil((n - 1) / B)."""
    return scored_windows(n, block, block)


def train_samples(run: dict, manifest: dict) -> int:
    """The training samples an epoch of this run draws from (a language model's blocks under
    its train.fresh_windows; the staged count otherwise)."""
    if manifest.get("kind") != "tokens":
        return manifest["sizes"]["train"]
    fresh = run["train"].get("fresh_windows", False)
    return train_blocks(manifest["tokens"]["train"], manifest["block_size"], fresh)


def scored_samples(manifest: dict, split: str, stride: int | None) -> int:
    """The samples an evaluation of `split` scores: the staged count, or a language model's
    windows at eval.stride."""
    if stride is None or manifest.get("kind") != "tokens":
        return manifest["sizes"][split]
    return scored_windows(manifest["tokens"][split], manifest["block_size"], stride)


class TokenBlocks:
    """A split's windows ([n_windows, B + 1] int64 when read): training's blocks, or
    (scored=True) the windows that score every position once at `stride` (default B).
    fresh: training blocks at any offset in [0, B) (their count leaves room for it).
    Slicing gives a view of a contiguous range of windows (an evaluation shard); rows() and
    gather() read from the memory map."""

    def __init__(
        self,
        tokens: np.ndarray,
        block: int,
        scored: bool,
        device,
        start: int = 0,
        stop: int | None = None,
        *,
        stride: int | None = None,
        fresh: bool = False,
    ):
        import torch

        self.tokens, self.block, self.scored = tokens, block, scored
        self.stride, self.fresh = stride or block, fresh
        self.device, self.dtype = torch.device(device), torch.int64
        n = len(tokens)
        total = (
            scored_windows(n, block, self.stride) if scored else train_blocks(n, block, self.fresh)
        )
        self.start, self.stop = start, total if stop is None else stop

    @property
    def shape(self) -> tuple[int, int]:
        return (self.stop - self.start, self.block + 1)

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key: slice) -> TokenBlocks:
        start, stop, _ = key.indices(len(self))
        return self._view(self.start + start, self.start + stop)

    def _view(self, start: int, stop: int | None, stride: int | None = None) -> TokenBlocks:
        return TokenBlocks(
            self.tokens,
            self.block,
            self.scored,
            self.device,
            start,
            stop,
            stride=stride or self.stride,
            fresh=self.fresh,
        )

    def windows(self, stride: int) -> TokenBlocks:
        """The whole split's scored windows at `stride` (eval.stride)."""
        assert self.scored and 1 <= stride <= self.block, (self.scored, stride, self.block)
        return self._view(0, None, stride)

    def context(self):
        """int64 [n, 1] on the device: the leading targets of each window (of this view)
        that it does not score, already scored by an earlier window: 0 for the split's first
        window, B - stride for the others (split_tokens makes them PAD)."""
        import torch

        index = torch.arange(self.start, self.stop, device=self.device).view(-1, 1)
        return (index > 0).long() * (self.block - self.stride)

    def gather(self, indices, offset: int = 0) -> np.ndarray:
        """int64 [k, B + 1] of the windows at `indices` (relative to this view), training's
        shifted by `offset` tokens: one gather from the memory map (only the pages of these
        windows are read)."""
        step = self.stride if self.scored else self.block
        starts = (np.asarray(indices, dtype=np.int64) + self.start) * step + offset
        positions = starts[:, None] + np.arange(self.block + 1)
        inside = positions < len(self.tokens)  # a scored split's last window is partial
        if inside.all():
            return self.tokens[positions].astype(np.int64)
        out = np.full(positions.shape, PAD, dtype=np.int64)
        out[inside] = self.tokens[positions[inside]]
        return out

    def rows(self, start: int, stop: int):
        import torch

        stop = min(stop, len(self))
        batch = torch.from_numpy(self.gather(np.arange(start, stop)))
        return batch.to(self.device, non_blocking=True) if self.device.type == "cuda" else batch


class TokenFeed:
    """The training batches of a token split: each micro-batch's blocks gathered from the
    memory map (int64 [k, B + 1]) at the epoch's offset, and moved to the device.
    offsets: epoch -> the epoch's offset (train.fresh_windows); None: always 0."""

    streamed = True  # takes the batches' indices on the host

    def __init__(self, blocks: TokenBlocks, offsets: Callable[[int], int] | None = None):
        assert offsets is None or blocks.fresh, "fresh offsets need blocks that leave room"
        self.blocks, self.offsets = blocks, offsets

    def epoch(self, batches, start: int, epoch: int = 0):
        offset = self.offsets(epoch) if self.offsets else 0
        for index in range(start, len(batches)):
            yield self._batch(batches[index], offset)

    def _batch(self, indices, offset: int):
        import torch

        batch = torch.from_numpy(self.blocks.gather(indices.numpy(), offset))
        device = self.blocks.device
        return batch.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else batch

    def close(self) -> None:
        pass


def split_tokens(raw, context=None):
    """A window batch's model inputs (block_size ids; padding read as 0) and targets (the
    next ids). The one place that decides which targets are scored: padding stays PAD, and
    with `context` (int64 [k, 1], TokenBlocks.context) each row's first context[i] targets
    become PAD too; the loss and every metric count the targets that are not PAD."""
    inputs, targets = raw[:, :-1].clamp(min=0), raw[:, 1:]
    if context is not None and context.shape[-1]:  # sliding windows (eval.stride)
        import torch

        positions = torch.arange(targets.shape[1], device=targets.device)
        targets = targets.masked_fill(positions < context, PAD)
    return inputs, targets
