"""Distributed, exact evaluation, for every task.

Every rank scores a disjoint, *unpadded* shard of the split (DistributedSampler would pad with
repeated samples, so summed counts would exceed the test set: 10,000 images at 3 ranks count as
10,002). The task's metric state holds only sums (int64 counts, float64 sums with their
counts), so an all_reduce of each gives the split's totals: classification's confusion matrix
exactly, a multi-label task's per-label true/false positive counts exactly, a regression's
squared-error sums in float64 (ddpflow.task).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddpflow.cluster.distenv import DistEnv, any_rank
from ddpflow.data.windows import TokenBlocks
from ddpflow.task import Task, get_task
from ddpflow.training import sharding

log = logging.getLogger(__name__)


def shard_bounds(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous shard; sizes differ by at most one, no padding."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def normalize(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 NCHW -> float, standardised with the train split's per-channel statistics."""
    # in place on the one float copy: the same values as (x / 255 - mean) / std, without
    # two more batch-sized temporaries (2.6x faster on a 256x3x64x64 batch: bench/data.py)
    return images.float().div_(255.0).sub_(mean).div_(std)


def model_batch(raw: torch.Tensor, labels: torch.Tensor, norm, tokens: bool = False):
    """A batch as the feed gives it (uint8 images; token blocks) -> (model input, targets):
    images standardised, with their labels; a token window's first block_size ids and the
    next ids, those it does not score PAD (`labels`: each window's context, or none;
    ddpflow.data.windows.split_tokens)."""
    if tokens:
        from ddpflow.data.windows import split_tokens

        return split_tokens(raw, labels)
    return normalize(raw, *norm), labels


@dataclass(frozen=True, slots=True)
class Scoring:
    """How a split is scored: the run's task (with the staged manifest it reads: the output
    count, a regression's target statistics), the train split's normalisation, the batch size
    and, during training, mixed precision (None: fp32)."""

    task: Task
    manifest: dict
    norm: tuple[torch.Tensor, torch.Tensor]
    batch_size: int
    autocast: Callable | None = None
    tokens: bool = False  # a language model's token windows (model_batch)
    stride: int | None = None  # their sliding windows (eval.stride); None: non-overlapping


@torch.no_grad()
def shard_state(model, images, labels, scoring: Scoring, forwards: int = 0) -> dict:
    """The task's metric state (int64 counts, float64 sums) of a shard already on the model's
    device. `model` must be the bare module, not the DDP wrapper: DDP's forward broadcasts
    buffers, a collective that would hang on unequal shard sizes.
    forwards: at least this many forward passes (an FSDP model's forward is a collective:
    every rank must run as many as the others; the extra ones score nothing)."""
    from ddpflow.data.feed import rows  # in memory or streamed from the shards

    model.eval()
    state = scoring.task.new_state(scoring.manifest, images.device)
    done, size = 0, scoring.batch_size
    precision = scoring.autocast or contextlib.nullcontext
    for start in range(0, images.shape[0], size):
        raw = rows(images, start, start + size)
        x, y = model_batch(raw, labels[start : start + size], scoring.norm, scoring.tokens)
        with precision():
            outputs = model(x)
        scoring.task.update(state, outputs, y)
        done += 1
    dtype = torch.int64 if scoring.tokens else torch.uint8
    for _ in range(done, forwards):
        blank = torch.zeros(1, *images.shape[1:], dtype=dtype, device=images.device)
        with precision():
            model(model_batch(blank, labels[:0], scoring.norm, scoring.tokens)[0])
    return state


def shard_counts(
    model, images, labels, num_classes: int, batch_size: int, norm, autocast=None, forwards=0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Classification's state of a shard: its int64 confusion matrix (rows = true class) and
    float64 summed cross-entropy."""
    scoring = Scoring(get_task(), {"num_classes": num_classes}, norm, batch_size, autocast)
    state = shard_state(model, images, labels, scoring, forwards)
    return state["confusion"].view(num_classes, num_classes), state["loss"]


def evaluate_split(
    model, split, scoring: Scoring, env: DistEnv, guard: bool = False
) -> dict | None:
    """Score env.rank's unpadded shard of `split` (a rankdata.Split), then sum the task's
    counts and sums over the ranks (one all_reduce per state tensor: int64 counts exactly,
    float64 sums), and compute the task's metrics from the totals.

    guard=True (the evaluation a training job adds before it ends): a rank whose scoring
    raises (out of memory at eval.batch_size, say) logs it, the ranks agree on it in one
    collective, and every rank returns None instead of raising, so a failed evaluation never
    fails the training it follows (the evaluate rule then scores the model in a job of its
    own). Without it the exception propagates, as in the evaluate job."""
    begin = time.perf_counter()
    images, labels = split.inputs, split.labels
    if scoring.stride is not None:  # a language model's sliding windows (eval.stride)
        assert isinstance(images, TokenBlocks), type(images)
        images = images.windows(scoring.stride)
        labels = images.context()  # per window: its leading targets that it does not score
    rank, world = env.rank, env.world_size
    start, stop = shard_bounds(images.shape[0], world, rank)
    # FSDP: as many forwards on every rank as the largest shard needs
    forwards = math.ceil(math.ceil(images.shape[0] / world) / scoring.batch_size)
    try:
        forwards = forwards if sharding.is_sharded(model) else 0
        state = shard_state(model, images[start:stop], labels[start:stop], scoring, forwards)
        failed = False
    except Exception:
        if not guard:
            raise
        log.exception("rank %d: the evaluation after training failed", rank)
        state, failed = scoring.task.new_state(scoring.manifest, images.device), True
    if guard and any_rank(world, failed):
        return None
    if world > 1:
        for key, value in state.items():
            if not key.startswith("_"):
                dist.all_reduce(value, op=dist.ReduceOp.SUM, group=env.group)
    result = scoring.task.metrics(state, scoring.manifest)
    total = result["samples_evaluated"]
    if total != images.shape[0]:
        raise RuntimeError(f"evaluation counted {total} samples, the split has {images.shape[0]}")
    result["eval_seconds"] = time.perf_counter() - begin
    return result


def summarize(confusion: torch.Tensor) -> dict:
    """Classification's metrics from an int64 confusion matrix (exact, no float accumulation)."""
    k = confusion.shape[0]
    state = {"confusion": confusion.reshape(k * k), "loss": torch.zeros((), dtype=torch.float64)}
    result = get_task().metrics(state, {"num_classes": k})
    del result["loss"]
    return result


def batch_size(run, admitted: dict | None) -> int:
    """The inputs per evaluation forward: eval.batch_size, or under auto what the train rule
    chose for this machine (admitted.json's eval_batch: checks.admission), else the
    training's micro-batch (which a rank holds with gradients: it holds it without)."""
    size = run.eval.batch_size
    if size != "auto":
        return int(size)
    return int((admitted or {}).get("eval_batch") or run.train.micro_batch_size)
