"""The settings that make a refused run fit, each one estimated on its own (no torch here).

A knob is offered only where, alone, it brings the rank's estimate within the memory it has
and stays within what the run's Slurm partition gives (a node's most memory, its most nodes):
a fix the user can apply. The model's own knobs (activation checkpointing, bf16, a torchvision
ResNet's small_input_stem) change the measured figures: ddpflow.checks.early measures each variant
(variant_runs) for a refused run and hands the figures in. Where no knob fits, the refusal
names the limit that none fits.

    variant_runs(run) -> {knob: run with it}             # what early measures again
    knobs(ctx) -> "knob (why); knob (why)" | "nothing ..."
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Protocol

from ddpflow.config.machine import (
    data_parallel_size,
    ranks_per_node,
    splitting_micro_batch,
    tensor_parallel_degree,
)

GIB = 2**30
# the built-in models have no torchvision stem to change (ddpflow.training.models)
NO_STEM = ("mlp", "cnn", "resnet18", "resnet34", "gpt")


@dataclasses.dataclass(frozen=True)
class Partition:
    """What a run's Slurm partition gives (ddpflow.checks.slurm.partition_limits)."""

    name: str
    mem_mb: int  # the most memory one node gives (MaxMemPerNode, else RealMemory)
    nodes: int  # the most nodes one job gets (MaxNodes, else the partition's nodes)
    gpu_types: tuple[str, ...] = ()


class Estimated(Protocol):
    """What the knobs read of a rank's estimate (memory.Estimate, which imports this module)."""

    @property
    def data(self) -> int: ...
    @property
    def runtime(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def total(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class Context:
    """A refused run, its estimate and what the knobs are weighed with."""

    run: dict
    est: Estimated  # memory.Estimate
    room: int
    figures: dict
    variants: dict  # {knob: figures measured with it}
    partition: Partition | None = None
    # memory.estimate, handed in by memory.py (which imports this module: no import circle)
    estimate: Callable[..., Any] | None = None


def _with(run: dict, section: str, **changes) -> dict:
    return {**run, section: {**run[section], **changes}}


def variant_runs(run: dict) -> dict[str, dict]:
    """The model-side knobs run has not set, each applied alone (their figures differ)."""
    train, model = run["train"], run["model"]
    out = {}
    if not train["activation_checkpointing"]:
        out["train.activation_checkpointing: true"] = _with(
            run, "train", activation_checkpointing=True
        )
    if train["precision"] == "fp32":
        out["train.precision: bf16"] = _with(run, "train", precision="bf16")
    stem = model.get("small_input_stem", True) and not model.get("weights")
    if stem and model["name"] not in NO_STEM and ":" not in model["name"]:
        out["model.small_input_stem: false"] = _with(run, "model", small_input_stem=False)
    return out


WHY = {
    "train.activation_checkpointing: true": "each block's activations recomputed in the "
    "backward instead of kept",
    "train.precision: bf16": "activations in about half the bytes",
    "model.small_input_stem: false": "the ImageNet stem shrinks the image 4x before the first "
    "block: different science, a model that sees less",
}


def knobs(ctx: Context) -> str:
    """The knobs that alone make ctx.run fit, with their estimates; else the smallest
    combination that does; else what none fits."""
    found = [*_batch_knobs(ctx), *_strategy_knobs(ctx), *_model_knobs(ctx), *_machine_knobs(ctx)]
    if found:
        return "; ".join(found)
    if together := _together(ctx):
        return f"no single knob fits {_limit_text(ctx)}; together they do: {together}"
    return f"nothing fits {_limit_text(ctx)}: a smaller model or a bigger machine"


def _together(ctx: Context) -> str | None:
    """Smaller micro- and evaluation batches alone, and with each of the model's own
    measured knobs: for each, the largest batches that fit, as one combination (the same
    science first; a model knob can leave far larger batches)."""
    bases: list[tuple[list[str], dict, dict]] = [([], ctx.run, ctx.figures)] + [
        ([knob], run, ctx.variants[knob])
        for knob, run in variant_runs(ctx.run).items()
        if ctx.variants.get(knob) and "error" not in ctx.variants[knob]
    ]
    found = []
    for changes, run, figures in bases:
        if fitted := _smallest_batches(ctx, run, figures):
            knobs_, total = fitted
            found.append(f"{', '.join(changes + knobs_)} ({_gb(total)} GB)")
            if not changes:
                break  # the same science fits: no reason to change the model
    return "; or ".join(found) or None


def _smallest_batches(ctx: Context, run: dict, figures: dict) -> tuple[list[str], int] | None:
    """The largest micro-batch, then evaluation batch, with which run fits, or None."""
    train = run["train"]
    world = data_parallel_size(train, run["world_size"])  # the ranks that split the batch
    fixed, per_sample = _activation_line(figures, train["micro_batch_size"])
    per_eval = figures.get("evaluation", 0) / max(figures.get("eval_batch", 0), 1)
    micros = [
        m
        for m in range(train["micro_batch_size"], 0, -1)
        if splitting_micro_batch(train["global_batch_size"], m, [world]) == m
    ]
    current = figures.get("eval_batch", 0)  # 0: no evaluation measured, nothing to cut
    evals = [current] + [
        2**k for k in range(int(math.log2(current or 1)), -1, -1) if 2**k < current
    ]
    for micro in micros:
        for size in evals:
            cut = {
                **figures,
                "activations": int(fixed + per_sample * micro),
                "evaluation": int(per_eval * size),
            }
            smaller = _with(run, "train", micro_batch_size=micro)
            smaller = _with(smaller, "eval", batch_size=size) if current else smaller
            if (total := _fits(ctx, smaller, cut)) is not None:
                changed = [f"train.micro_batch_size {micro}"] * (micro != train["micro_batch_size"])
                changed += [f"eval.batch_size {size}"] * (size != current)
                return changed, total
    return None


def _fits(ctx: Context, run: dict, figures: dict) -> int | None:
    """The estimate of run with figures, where it fits ctx.room; else None."""
    assert ctx.estimate is not None, "memory.refusal hands its estimate in"
    process = {"anon": ctx.est.runtime, "file": 0}
    total = ctx.estimate(run, figures, process, ctx.est.data).total
    return total if total <= ctx.room else None


def _batch_knobs(ctx: Context) -> list[str]:
    """The largest micro-batch (activations on the line through the two measurements) and
    evaluation batch (in proportion) that fit."""
    run, figures, out = ctx.run, ctx.figures, []
    train = run["train"]
    fixed, per_sample = _activation_line(figures, train["micro_batch_size"])
    cap, world = train["micro_batch_size"] - 1, data_parallel_size(train, run["world_size"])
    while cap >= 1 and per_sample > 0:
        micro = splitting_micro_batch(train["global_batch_size"], cap, [world])
        if micro is None:
            break
        acts = int(fixed + per_sample * micro)
        smaller = _with(run, "train", micro_batch_size=micro)
        if (total := _fits(ctx, smaller, {**figures, "activations": acts})) is not None:
            out.append(
                f"train.micro_batch_size {micro} ({_gb(total)} GB; the global batch stays, as "
                "more micro-batches per step)"
            )
            break
        cap = micro - 1
    out += _eval_batch_knob(ctx)
    return out


def _eval_batch_knob(ctx: Context) -> list[str]:
    figures, batch = ctx.figures, ctx.figures.get("eval_batch", 0)
    if not figures.get("evaluation") or batch <= 1:
        return []
    per_sample = figures["evaluation"] / batch
    for size in (2**k for k in range(int(math.log2(batch - 1)), -1, -1)):
        cut = {**figures, "evaluation": int(per_sample * size)}
        if (total := _fits(ctx, _with(ctx.run, "eval", batch_size=size), cut)) is not None:
            return [
                f"eval.batch_size {size}, or auto ({_gb(total)} GB; the evaluation scores alike)"
            ]
    return []


def _strategy_knobs(ctx: Context) -> list[str]:
    run = ctx.run
    out: list[str] = []
    ranks = data_parallel_size(run["train"], run["world_size"])
    if ranks == 1:
        return out
    tensor = tensor_parallel_degree(run["train"])
    for strategy in ("zero", "fsdp") if tensor == 1 else ("fsdp",):  # zero: not with it yet
        if run["train"]["strategy"] == strategy:
            continue
        total = _fits(ctx, _with(run, "train", strategy=strategy), ctx.figures)
        if total is not None:
            over = f"{ranks} ranks" if tensor == 1 else f"{ranks} data-parallel ranks"
            out.append(f"train.strategy: {strategy} (state divided by the {over}: {_gb(total)} GB)")
    return out


def _model_knobs(ctx: Context) -> list[str]:
    out = []
    for knob, run in variant_runs(ctx.run).items():
        figures = ctx.variants.get(knob)
        if figures and "error" not in figures and (total := _fits(ctx, run, figures)):
            out.append(f"{knob} ({WHY[knob]}: {_gb(total)} GB)")
    return out


def _machine_knobs(ctx: Context) -> list[str]:
    """More memory per rank: more mem_gb, or fewer ranks per node on more nodes (the world
    size kept), within the partition; on a GPU, more nodes where the state is sharded."""
    run, est, part = ctx.run, ctx.est, ctx.partition
    machine, per_node = run["machine"], ranks_per_node(run["machine"])
    out = []
    if est.device == "cpu" and run["launcher"] == "slurm":
        # with the library pages: the memory suggested must not warn again once set
        held = est.total + getattr(est, "shared", 0)
        need = math.ceil(held * per_node / GIB * 10) / 10
        if part is None or need * 1024 <= part.mem_mb:
            out.append(f"machine.mem_gb {need:g} or more")
        tensor = tensor_parallel_degree(run["train"])  # a node holds whole tensor groups
        for fewer in range(per_node - 1, 0, -1):
            nodes = machine["nodes"] * per_node // fewer
            most = part.mem_mb * 2**20 if part else None
            spares = machine.get("spare_nodes", 0)  # held by the job too: they need room
            if (machine["nodes"] * per_node) % fewer or (part and nodes + spares > part.nodes):
                continue
            if fewer % tensor:
                continue
            mem_gb = math.ceil(held * fewer / GIB * 10) / 10
            if most is None or mem_gb * GIB <= most:
                out.append(
                    f"machine.cpu_ranks_per_node {fewer} and machine.nodes {nodes} (the same "
                    f"world size) with machine.mem_gb {mem_gb:g}"
                )
                break
    elif est.device == "cpu":
        most = est.total and (ctx.room * per_node) // est.total
        most -= most % tensor_parallel_degree(run["train"])  # whole tensor groups
        if 1 <= most < per_node:
            out.append(f"machine.cpu_ranks_per_node {most} (each needs {_gb(est.total)} GB)")
    elif part is None or not part.gpu_types:
        out.append(f"a GPU with at least {math.ceil(est.total / GIB)} GB (machine.gpu_mem_gb)")
    return out


def _limit_text(ctx: Context) -> str:
    part, per_node = ctx.partition, ranks_per_node(ctx.run["machine"])
    if part is None:
        return f"the {_gb(ctx.room)} GB a rank has"
    if ctx.est.device == "cuda":
        return f"partition {part.name!r}'s GPUs ({'/'.join(part.gpu_types)}, {_gb(ctx.room)} GB)"
    return (
        f"partition {part.name!r}: a node gives at most {part.mem_mb} MB (its {per_node} ranks "
        f"{_gb(part.mem_mb * 2**20 / per_node)} GB each) on at most {part.nodes} nodes"
    )


def _gb(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}" if nbytes < 10 * GIB else f"{nbytes / GIB:.1f}"


def _activation_line(figures: dict, micro: int) -> tuple[float, float]:
    """(bytes that do not grow with the micro-batch, bytes per sample): the line through
    the measurements at micro-batch 2 and at the run's."""
    at_micro = figures["activations"]
    if micro <= 2:
        return 0.0, at_micro / micro
    per_sample = max(at_micro - figures["activations_at_2"], 0) / (micro - 2)
    return at_micro - per_sample * micro, per_sample
