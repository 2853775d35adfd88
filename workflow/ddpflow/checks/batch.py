"""The global batch against the machine, checked before anything is queued: a world size
that cannot split it into whole micro-batches (naming those that can), train.micro_batch_size
auto resolved for every world size a request can run at, a global batch larger than the
staged training split, and one that leaves much of it out of each epoch.

    resolve_micro_batch("runs ('a')", train, machine)   # (train, how it was chosen)
"""

from __future__ import annotations

import logging

from ddpflow.config.machine import (
    ranks_per_node,
    request_world_sizes,
    splitting_micro_batch,
    working_world_sizes,
)
from ddpflow.config.schema import ConfigError
from ddpflow.words import counted

log = logging.getLogger(__name__)


def check_world_size(where: str, train: dict, world: int, machine_text: str = "") -> None:
    """Refuse, before anything is submitted, a world size that cannot compute the recipe's
    global batch in whole micro-batches, naming the sizes that can."""
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
    if count % world:
        works = ", ".join(map(str, working_world_sizes(train)))
        batches = counted(count, "micro-batch", "micro-batches")
        raise ConfigError(
            f"{where}: {global_} = {micro} x world size x accumulation steps "
            f"(train.global_batch_size = train.micro_batch_size x ...), but world size "
            f"{world}{machine_text} does not divide {batches}: world sizes "
            f"{works} work; {world} does not. Change the machine, or the two batch sizes, or "
            "set train.micro_batch_size: auto (the largest micro-batch that splits, per world "
            "size)"
        )


def resolve_micro_batch(where: str, train: dict, machine: dict) -> tuple[dict, dict]:
    """train.micro_batch_size as the run trains it, and how it was chosen. `auto`: the
    largest micro-batch up to train.max_micro_batch_size that splits the global batch at
    every world size of the request (request_world_sizes), else refused naming the world
    sizes that work. The cap leaves the train section (and so every fingerprint): the
    micro-batch it resolves to is the science, as a number written by hand is."""
    train = dict(train)
    cap = train.pop("max_micro_batch_size", None)
    if train["micro_batch_size"] != "auto":
        return train, {"size": train["micro_batch_size"], "auto": False, "max": cap}
    global_, worlds = train["global_batch_size"], request_world_sizes(machine)
    micro = splitting_micro_batch(global_, cap, worlds)
    if micro is None:
        works = [w for w in range(1, global_ + 1) if splitting_micro_batch(global_, cap, [w])]
        sizes = ", ".join(map(str, worlds))
        raise ConfigError(
            f"{where}: train.micro_batch_size auto finds no micro-batch "
            f"{f'up to train.max_micro_batch_size {cap} ' if cap else ''}that splits "
            f"train.global_batch_size {global_} evenly at world size {sizes} "
            f"({_nodes(machine)} x {ranks_per_node(machine)} ranks per node): world sizes "
            f"{_few(works)} work. Change the machine, or the global batch (a multiple of the "
            "world size)"
        )
    train["micro_batch_size"] = micro
    return train, {"size": micro, "auto": True, "max": cap}


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
        unit = micro * run["world_size"]  # a global batch this world size can split
        fits = train_samples // unit * unit
        advice = (
            f"set train.global_batch_size to at most {fits} (a multiple of micro_batch_size "
            f"{micro} x world size {run['world_size']})"
            if fits
            else f"lower train.micro_batch_size (now {micro}) and the global batch"
        )
        raise ConfigError(
            f"run {run['name']!r}: train.global_batch_size is {global_} but the staged "
            f"training split has only {train_samples} samples, so an epoch would have no "
            f"optimizer step; {advice}"
        )


def warn_what_sits_out(run: dict, samples: int) -> None:
    """A warning in the terminal when a large share of the training split sits out of each
    epoch (an epoch is whole global batches of a fresh shuffle): small data, large batch."""
    train = run["train"]
    global_, micro = train["global_batch_size"], train["micro_batch_size"]
    left = samples % global_
    if left * 5 <= samples:  # a fifth or less
        return
    unit = micro * run["world_size"]  # the global batches this world size can split
    fewer = min(range(unit, global_, unit), key=lambda b: (samples % b, -b), default=None)
    better = f"batch (e.g. {fewer})" if fewer and samples % fewer < left else "and micro batch"
    log.warning(
        "run %r: train.global_batch_size %d leaves %d of the %d training samples out of each "
        "epoch (the next epoch's shuffle leaves out others); a smaller global %s uses more of "
        "them per epoch", run["name"], global_, left, samples, better,
    )  # fmt: skip
