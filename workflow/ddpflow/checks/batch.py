"""The global batch against the machine, checked before anything is queued: a world size
that cannot split it into whole micro-batches (naming those that can), train.micro_batch_size
auto resolved for every world size a request can run at, a global batch larger than the
staged training split, and one that leaves much of it out of each epoch. With
train.tensor_parallel the data-parallel ranks (world size / tensor_parallel) split the
global batch: a tensor group's ranks compute the same micro-batches.

    resolve_micro_batch("runs ('a')", train, machine)   # (train, how it was chosen)
"""

from __future__ import annotations

import logging

from ddpflow.checks.norm_batch import free_science, normalisation
from ddpflow.checks.tensor_parallel import check_tensor_group
from ddpflow.config.machine import (
    data_parallel_size,
    ranks_per_node,
    request_world_sizes,
    sharing_micro_batch,
    splitting_micro_batch,
    tensor_parallel_degree,
    working_world_sizes,
)
from ddpflow.config.schema import ConfigError
from ddpflow.words import counted

log = logging.getLogger(__name__)


def check_world_size(where: str, train: dict, world: int, machine_text: str = "") -> None:
    """Refuse, before anything is submitted, a world size that cannot compute the recipe's
    global batch in whole micro-batches, naming the sizes that can. With
    train.tensor_parallel, the data-parallel ranks (world size / tensor_parallel) split it."""
    global_, micro = train["global_batch_size"], train["micro_batch_size"]
    if global_ % micro:
        raise ConfigError(
            f"{where}: train.global_batch_size {global_} is not a multiple of "
            f"train.micro_batch_size {micro}: a step is a whole number of micro-batches; "
            f"set global_batch_size to a multiple of {micro} (e.g. "
            f"{max(micro, global_ // micro * micro)} or {(global_ // micro + 1) * micro}) or "
            "another micro_batch_size"
        )
    count = global_ // micro
    grouped = train.get("norm_batch_size", micro) not in ("auto", micro)  # norm_groups
    if tensor_parallel_degree(train) > 1:  # the data-parallel ranks split the global batch
        if count % data_parallel_size(train, world):
            raise ConfigError(_data_ranks_refusal(where, train, world, machine_text))
    elif world > count or (grouped and count % world):  # a rank with nothing, or a group
        works = ", ".join(map(str, working_world_sizes(train)))
        batches = counted(count, "micro-batch", "micro-batches")
        why = f"is more than {batches} a step: world sizes up to {count} work ({works} evenly)"
        if world <= count:  # groups sharing a normalisation batch need equal shares
            shared = "ranks sharing BatchNorm's batch (train.norm_batch_size) need"
            why = f"does not divide {batches}, which {shared}: world sizes {works} work"
        raise ConfigError(
            f"{where}: {global_} = {micro} x world size x accumulation steps "
            f"(train.global_batch_size = train.micro_batch_size x ...), but world size "
            f"{world}{machine_text} {why}. Change the machine, or the two batch sizes, or set "
            "train.micro_batch_size: auto (the largest micro-batch that splits, per world size)"
        )


def _data_ranks_refusal(where: str, train: dict, world: int, machine_text: str) -> str:
    global_, micro = train["global_batch_size"], train["micro_batch_size"]
    tensor = tensor_parallel_degree(train)
    data, count = world // tensor, global_ // micro
    works = ", ".join(map(str, working_world_sizes(train)))
    shape = machine_text.strip().removeprefix("(").removesuffix(")")  # "machine.nodes ..."
    shape = f"; {shape}" if shape else ""
    return (
        f"{where}: {global_} = {micro} x data-parallel ranks x accumulation steps "
        f"(train.global_batch_size = train.micro_batch_size x ...), but {data} data-parallel "
        f"ranks (world size {world} / train.tensor_parallel {tensor}{shape}) do not divide "
        f"{counted(count, 'micro-batch', 'micro-batches')}: {works} data-parallel ranks "
        f"work; {data} do not. Change the machine or train.tensor_parallel, or the two batch "
        "sizes, or set train.micro_batch_size: auto (the largest micro-batch that splits, per "
        "world size)"
    )


def resolve_micro_batch(
    where: str, train: dict, machine: dict, role: str = "draws", recorded: int | None = None
) -> tuple[dict, dict]:
    """train.micro_batch_size as the run trains it, its normalisation batch
    (train.norm_batch_size, checks.norm_batch) and how they were chosen. role: batch_role's;
    recorded: the normalisation batch the run last trained with. `auto`: the largest
    micro-batch up to train.max_micro_batch_size that splits the global batch at every world
    size of the request (request_world_sizes; with train.tensor_parallel, its data-parallel
    ranks), else refused naming the world sizes that work; under BatchNorm, the largest part
    of the normalisation batch that groups of ranks can hold. The cap leaves the train
    section (and so every fingerprint). The science the fingerprint holds is "science": the
    normalisation batch where the micro-batch is not the science itself."""
    train = dict(train)
    cap = train.pop("max_micro_batch_size", None)
    train.setdefault("norm_batch_size", "auto")
    check_tensor_group(where, train, machine)  # else the data-parallel ranks are no count
    worlds = [data_parallel_size(train, world) for world in request_world_sizes(machine)]
    auto = train["micro_batch_size"] == "auto"
    if role == "norm":
        shape = f" ({_nodes(machine)} x {ranks_per_node(machine)} ranks per node)"
        norm, group = normalisation(where, train, cap, worlds, recorded, shape)
        micro, science = norm // group, norm
    else:
        found = train["micro_batch_size"]
        if auto:  # evenly shared where one is, else the first ranks take one more (not
            # across tensor groups: their data-parallel ranks share evenly)
            share = splitting_micro_batch if tensor_parallel_degree(train) > 1 else None
            found = (share or sharing_micro_batch)(train["global_batch_size"], cap, worlds)
            if found is None:
                raise ConfigError(_auto_refusal(where, train, cap, worlds, machine))
        micro = found
        norm, group = micro, 1
        science = micro if role == "draws" else free_science(train, cap, recorded, micro)
    train["micro_batch_size"], train["norm_batch_size"] = micro, norm
    info = dict(size=micro, auto=auto, max=cap, norm=norm, group=group, science=science)
    return train, {**info, "role": role, "recorded": recorded}


def _auto_refusal(where: str, train: dict, cap: int | None, worlds: list[int], machine) -> str:
    global_, tensor = train["global_batch_size"], tensor_parallel_degree(train)
    works = [w for w in range(1, global_ + 1) if splitting_micro_batch(global_, cap, [w])]
    sizes, shape = ", ".join(map(str, worlds)), f"{ranks_per_node(machine)} ranks per node"
    at, fix, count = f"world size {sizes}", "Change the machine", "world size"
    if tensor > 1:
        at, shape = f"{sizes} data-parallel ranks", f"{shape} / train.tensor_parallel {tensor}"
        fix, count = "Change the machine or train.tensor_parallel", "data-parallel ranks"
    return (
        f"{where}: train.micro_batch_size auto finds no micro-batch "
        f"{f'up to train.max_micro_batch_size {cap} ' if cap else ''}that splits "
        f"train.global_batch_size {global_} evenly at {at} ({_nodes(machine)} x {shape}): "
        f"{'world sizes' if tensor == 1 else 'data-parallel ranks'} {_few(works)} work. "
        f"{fix}, or the global batch (a multiple of the {count})"
    )


def _nodes(machine: dict) -> str:
    fewest = machine.get("min_nodes")
    if fewest and fewest < machine["nodes"]:
        return f"machine.min_nodes {fewest} to nodes {machine['nodes']}"
    return f"machine.nodes {machine['nodes']}"


def _few(values: list[int], shown: int = 12) -> str:
    text = ", ".join(map(str, values[:shown]))
    return text + (f", ... ({len(values)} in all)" if len(values) > shown else "")


def check_batch_fits(run: dict, train_samples: int) -> None:
    """Before the training job is submitted: an epoch takes floor(samples / global batch)
    steps, so a global batch larger than the staged training split would train nothing."""
    global_, micro = run["train"]["global_batch_size"], run["train"]["micro_batch_size"]
    if global_ > train_samples:
        unit = micro * data_parallel_size(run["train"], run["world_size"])  # splits alike
        fits = train_samples // unit * unit
        advice = (
            f"set train.global_batch_size to at most {fits} (a multiple of micro_batch_size "
            f"{micro} x {_data_ranks(run)})"
            if fits
            else f"lower train.micro_batch_size (now {micro}) and the global batch"
        )
        raise ConfigError(
            f"run {run['name']!r}: train.global_batch_size is {global_} but the staged "
            f"training split has only {train_samples} samples, so an epoch would have no "
            f"optimizer step; {advice}"
        )


def _data_ranks(run: dict) -> str:
    """'world size 4', or with tensor parallelism '2 data-parallel ranks (world size 4 /
    train.tensor_parallel 2)'."""
    world, tensor = run["world_size"], tensor_parallel_degree(run["train"])
    if tensor == 1:
        return f"world size {world}"
    return (
        f"{data_parallel_size(run['train'], world)} data-parallel ranks (world size {world} / "
        f"train.tensor_parallel {tensor})"
    )


def warn_what_sits_out(run: dict, samples: int) -> None:
    """A warning in the terminal when a large share of the training split sits out of each
    epoch (an epoch is whole global batches of a fresh shuffle): small data, large batch."""
    train = run["train"]
    global_, micro = train["global_batch_size"], train["micro_batch_size"]
    left = samples % global_
    if left * 5 <= samples:  # a fifth or less
        return
    unit = micro * data_parallel_size(train, run["world_size"])  # the batches it can split
    fewer = min(range(unit, global_, unit), key=lambda b: (samples % b, -b), default=None)
    better = f"batch (e.g. {fewer})" if fewer and samples % fewer < left else "and micro batch"
    log.warning(
        "run %r: train.global_batch_size %d leaves %d of the %d training samples out of each "
        "epoch (the next epoch's shuffle leaves out others); a smaller global %s uses more of "
        "them per epoch", run["name"], global_, left, samples, better,
    )  # fmt: skip
