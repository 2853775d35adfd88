"""Whether a run's ranks fit their memory, decided before anything is queued.

ddpflow.training.footprint measures one training step of the unsharded model on fake tensors
(parameters, buffers, gradients, optimizer state, activations at the micro-batch, the largest
FSDP unit); here, without torch, those figures become one rank's peak at the run's world size
and strategy, plus the data the rank holds and the process itself, and are compared with the
memory a rank has:

* CPU ranks: machine.mem_gb shared by the node's ranks (Slurm), or this machine's memory
  shared by the ranks (the local launcher, which asks for no memory);
* GPU ranks: the GPU's memory, machine.gpu_mem_gb, or, where that is null, the GPU the local
  launcher finds, or the GPU type in the Slurm partition's GRES where its memory is known.

Per rank, with P parameters, G gradients, O optimizer state (bytes) and N ranks:

    plain (1 rank)  P + G + O + A
    ddp             P + G + O + A (G twice without train.ddp.gradient_as_bucket_view)
    zero            P + G + O/N + A
    fsdp            (P + G + O)/N + A + two units' parameters gathered (the current
                    and the prefetched; all of them without reshard_after_forward) + one
                    unit's unsharded gradients
    hsdp            as fsdp with N the shard group's ranks (train.hsdp.shard_size)

With train.tensor_parallel T, P, G and O are first a rank's share of the split model
(ddpflow.checks.tensor_parallel.rank_figures: each GPT block's projections 1/T, the rest
whole), N counts the data-parallel ranks (world size / T), and ddp keeps no buckets (no
DistributedDataParallel wraps the model).

where A, what a step and the evaluation add: on a GPU the larger of a training micro-batch's
activations and an evaluation forward's (torch's caching allocator hands the blocks the step
freed to the evaluation); on a CPU rank their sum, since glibc keeps the blocks a step frees
in its heap (they are below its mmap threshold, which rises to 32 MiB after the first large
free) while an evaluation's large tensors come from fresh mappings: measured in
bench/memory_estimate.py and tests/test_fits.py.

On CPU ranks the process itself counts too: its own (anonymous) resident memory after a
few real steps of a tiny model (the libraries' file-backed pages are not counted: the node's
ranks share them, and they are page cache the kernel drops under pressure).

A rank that cannot fit is refused naming the estimate and the knobs that alone would make it
fit within its partition (ddpflow.checks.memory_knobs); above WARN_SHARE a warning says so.

    figures_key(run, shape, outputs) -> (key, request)    # the measurement to ask for
    estimate(run, figures, process, data_bytes) -> Estimate
    judge(run, est, capacity) -> (verdict, text)           # "fits" | "tight" | "refused"
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from ddpflow.checks import memory_knobs
from ddpflow.checks.tensor_parallel import rank_figures
from ddpflow.config.machine import (
    SHARDED_STRATEGIES,
    data_parallel_size,
    hsdp_mesh,
    hsdp_shard_size,
    ranks_per_node,
    tensor_parallel_degree,
)

GIB = 2**30
WARN_SHARE = 0.8
CUDA_CONTEXT = GIB // 2  # the CUDA context and kernels a GPU rank holds outside tensors
# the memory of GPU types as Slurm's GRES names them, where the name decides it
GPU_MEMORY_GB = {
    "h200": 141,
    "h100": 80,
    "gh200": 96,
    "l40s": 48,
    "l40": 48,
    "a40": 48,
    "a6000": 48,
    "l4": 24,
    "a10": 24,
    "a30": 24,
    "t4": 16,
    "p100": 16,
    "a100_80g": 80,
    "a100-80g": 80,
    "a100_40g": 40,
    "a100-40g": 40,
    "v100_32g": 32,
    "v100-32g": 32,
    "v100_16g": 16,
}


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One rank's peak, by part (bytes)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    data: int
    runtime: int
    device: str  # "cpu" | "cuda"
    # the rank's share of the libraries' pages its node's ranks map together: page cache the
    # kernel can drop under pressure, so in the warning but not in total (a rank's own RSS
    # shows all of them)
    shared: int = 0

    # zero: the optimizer state rank 0 gathers for a checkpoint, when no activations are held
    gather: int = 0
    # an evaluation forward's activations (validation, the evaluation after training)
    evaluation: int = 0

    @property
    def transient(self) -> int:
        """What a step and the evaluation add to what the rank holds throughout."""
        if self.device == "cpu":  # glibc keeps the step's freed blocks (module docstring)
            return max(self.activations + self.evaluation, self.gather)
        return max(self.activations, self.evaluation, self.gather)

    @property
    def total(self) -> int:
        held = self.parameters + self.gradients + self.optimizer + self.data + self.runtime
        return held + self.transient

    def parts(self) -> str:
        names = ("parameters", "gradients", "optimizer", "activations", "evaluation", "data")
        text = ", ".join(f"{name} {gb(getattr(self, name))}" for name in (*names, "runtime"))
        if self.gather > self.activations:  # zero's rank 0 at a checkpoint
            text += f"; {gb(self.gather)} of optimizer state gathered for a checkpoint"
        return text


def _auto_eval_words(run, figures: dict) -> str:
    """', evaluation at eval.batch_size auto: 64' where auto chose it."""
    if run["eval"]["batch_size"] != "auto" or not figures.get("eval_batch"):
        return ""
    return f", evaluation at eval.batch_size auto: {figures['eval_batch']}"


def gb(nbytes: float) -> str:
    """GB as machine.mem_gb counts them (2**30 bytes: Slurm's --mem in MB of 2**20)."""
    return f"{nbytes / GIB:.2f}" if nbytes < 10 * GIB else f"{nbytes / GIB:.1f}"


def device_of(run) -> str:
    return "cuda" if run["machine"]["gpus_per_node"] else "cpu"


def figures_request(run, shape: list[int], outputs: int, eval_rows: int | None = None) -> dict:
    """What ddpflow.training.footprint.measure needs for this run (its cache key too);
    eval_rows: the most rows a rank scores in the training job (None: not known yet)."""
    train = run["train"]
    return {
        "model": run["model"],
        "shape": list(shape),
        "outputs": int(outputs),
        "micro_batch": int(train["micro_batch_size"]),
        "precision": train["precision"],
        "device_type": device_of(run),
        "checkpointing": bool(train["activation_checkpointing"]),
        "eval_batch": eval_batch(run, eval_rows),
        "optimizer": {
            k: train["optimizer"][k]
            for k in ("name", "momentum", "nesterov", "weight_decay", "betas")
        },
    }


AUTO_EVAL_BATCH = 512  # the most eval.batch_size auto chooses (its default as a number)


def eval_batch(run, rows: int | None) -> int:
    """The inputs of one evaluation forward in the training job: eval.batch_size (auto: the
    most it may choose, AUTO_EVAL_BATCH), or a rank's whole shard where that is smaller."""
    size = run["eval"]["batch_size"]
    size = AUTO_EVAL_BATCH if size == "auto" else int(size)
    ranks = data_parallel_size(run["train"], run["world_size"])  # each scores its shard
    return size if rows is None else max(1, min(size, math.ceil(rows / ranks)))


def estimate(run, figures: dict, process: dict, data_bytes: int) -> Estimate:
    """One rank's peak (rank 0's, the largest) from the measured figures at the run's world
    size and strategy; process: a rank's process before its model ({"anon", "file"}
    resident bytes). With train.tensor_parallel: the figures of a rank's tensor share
    (tensor_parallel.rank_figures), across the data-parallel ranks."""
    train, world = run["train"], run["world_size"]
    strategy = train["strategy"] if world > 1 else "plain"
    device, figures = device_of(run), rank_figures(run, figures)
    params = figures["parameters"] + figures["buffers"]
    grads, opt = figures["gradients"], figures["optimizer"]
    acts, gather = figures["activations"], 0
    wrapped = tensor_parallel_degree(train) == 1  # DistributedDataParallel, and its buckets
    if strategy in ("ddp", "zero") and wrapped and not train["ddp"]["gradient_as_bucket_view"]:
        grads *= 2  # the buckets beside the gradients
    if strategy == "zero":
        opt = math.ceil(opt / world)
        # rank 0 gathers every rank's optimizer state for each checkpoint, after a step's
        # activations are freed: the larger of the two is its peak
        gather = figures["optimizer"] - opt
    if strategy in SHARDED_STRATEGIES:  # hsdp: sharded across its shard group only
        params, grads, opt = _fsdp_share(train, shard_group(run), device, figures)
    runtime = process["anon"] if device == "cpu" else CUDA_CONTEXT
    shared = process["file"] // ranks_per_node(run["machine"]) if device == "cpu" else 0
    return Estimate(
        params,
        grads,
        opt,
        acts,
        data_bytes,
        runtime,
        device,
        shared,
        gather,
        evaluation=figures.get("evaluation", 0),
    )


def auto_eval_batch(run, figures: dict, process: dict, data_bytes: int, room) -> int:
    """eval.batch_size auto: the largest power of two up to what the figures measured
    (eval_batch: 512 or a rank's shard) whose estimate, library pages included, keeps within
    WARN_SHARE of room; where room is unknown (None), the training's micro-batch."""
    measured = int(figures.get("eval_batch") or 0)
    micro = int(run["train"]["micro_batch_size"])
    if room is None or not measured:
        return max(1, min(measured or micro, micro))
    per_input = figures.get("evaluation", 0) / measured
    size = measured
    while size > 1:
        scaled = {**figures, "evaluation": int(per_input * size)}
        est = estimate(run, scaled, process, data_bytes)
        if est.total + est.shared <= WARN_SHARE * room:
            break
        size = 2 ** ((size - 1).bit_length() - 1)  # the power of two below
    return size


def with_eval_batch(figures: dict, size: int) -> dict:
    """The figures with the evaluation's activations at `size` inputs (in proportion)."""
    measured = figures.get("eval_batch") or 0
    if not measured:
        return figures
    evaluation = int(figures.get("evaluation", 0) / measured * size)
    return {**figures, "evaluation": evaluation, "eval_batch": size}


def shard_group(run) -> int:
    """The ranks one copy of the model is sharded across: the world (its data-parallel
    ranks) under fsdp, the shard group under hsdp."""
    world = data_parallel_size(run["train"], run["world_size"])
    if run["train"]["strategy"] != "hsdp":
        return world
    mesh = hsdp_mesh(world, hsdp_shard_size(run["train"], run["machine"]))
    return mesh[1] if mesh else world


def _fsdp_share(train, world: int, device: str, figures: dict) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) of an FSDP rank: its shards, plus what it
    gathers whole. On a GPU two units' parameters (the current and the prefetched; all
    without reshard_after_forward) and one unit's gradients. On a CPU rank all of them:
    glibc keeps the blocks FSDP gathers and frees each step (below its mmap threshold),
    measured in bench/memory_estimate.py, and rank 0 gathers the whole model for model.pt."""
    unit, gathered_dtype = figures["largest_unit"], 0.5 if train["precision"] == "bf16" else 1.0
    whole = figures["parameters"]
    gathered = whole if device == "cpu" or not train["fsdp"]["reshard_after_forward"] else 2 * unit
    unsharded_grads = figures["gradients"] if device == "cpu" else unit
    params = math.ceil(whole / world) + figures["buffers"] + int(gathered * gathered_dtype)
    grads = math.ceil(figures["gradients"] / world) + unsharded_grads
    opt = math.ceil(figures["optimizer"] / world)
    if train["fsdp"]["cpu_offload"] and device == "cuda":  # shards in host memory
        return int(2 * unit * gathered_dtype) + figures["buffers"], unit, 0
    return params, grads, opt


def capacity(
    run, launcher: str, local_gpu_bytes: int | None, gres_types: list[str]
) -> tuple[int | None, str]:
    """(bytes one rank has, what that figure is) for the run's ranks; None: unknown."""
    machine = run["machine"]
    per_node = ranks_per_node(machine)
    if device_of(run) == "cuda":
        if machine.get("gpu_mem_gb"):
            return int(machine["gpu_mem_gb"] * GIB), f"machine.gpu_mem_gb {machine['gpu_mem_gb']}"
        if launcher == "local" and local_gpu_bytes:
            return local_gpu_bytes, f"this machine's GPU, {gb(local_gpu_bytes)} GB"
        known = {GPU_MEMORY_GB.get(t.lower()) for t in gres_types}
        if len(gres_types) and len(known) == 1 and (size := known.pop()) is not None:
            types = "/".join(sorted(set(gres_types)))
            return size * GIB, f"the partition's GPU type {types}, {size} GB"
        return None, "the GPU's memory is unknown (set machine.gpu_mem_gb)"
    if launcher == "local":
        total = local_memory_bytes()
        if total is None:
            return None, "this machine's memory is unknown"
        what = f"this machine's {gb(total)} GB"
        return total // per_node, f"{what} over {per_node} ranks" if per_node > 1 else what
    total = int(machine["mem_gb"] * GIB)
    share = f" over {per_node} ranks per node" if per_node > 1 else ""
    return total // per_node, f"machine.mem_gb {machine['mem_gb']}{share}"


def local_memory_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return None


def judge(
    run,
    est: Estimate,
    room: int | None,
    room_text: str,
    figures: dict,
    variants: dict | None = None,
    partition: memory_knobs.Partition | None = None,
) -> tuple[str, str]:
    """("fits" | "tight" | "refused" | "unknown", the line or the refusal) for run;
    variants: the figures of memory_knobs.variant_runs(run) where measured; partition: the
    run's Slurm partition, whose limits a knob must keep."""
    name, micro = run["name"], run["train"]["micro_batch_size"]
    where = "GPU" if est.device == "cuda" else "rank"
    head = (
        f"run {name!r}: about {gb(est.total)} GB per {where} ({est.parts()}; activations "
        f"at train.micro_batch_size {micro}{_auto_eval_words(run, figures)})"
    )
    if est.shared:
        head += f", and {gb(est.shared)} GB of library pages shared with the node's other ranks"
    if room is None:
        return "unknown", f"{head}; not compared: {room_text}"
    share, with_pages = est.total / room, (est.total + est.shared) / room
    if with_pages <= WARN_SHARE:
        return "fits", f"{head}, of {gb(room)} GB ({room_text}): {with_pages:.0%}"
    if share <= 1:
        return "tight", (
            f"{head}: {with_pages:.0%} of the {gb(room)} GB a {where} has ({room_text}), "
            "close to its limit"
        )
    return "refused", (
        f"{head}: does not fit the {gb(room)} GB a {where} has ({room_text}). "
        "To fit: "
        + memory_knobs.knobs(
            memory_knobs.Context(run, est, room, figures, variants or {}, partition, estimate)
        )
    )
