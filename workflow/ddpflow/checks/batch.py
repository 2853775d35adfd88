"""The global batch against the machine, checked before anything is queued: the world sizes
that split it into whole micro-batches, train.micro_batch_size auto resolved for every
world size a request can run at, a global batch larger than the staged training split, and
one that leaves much of it out of each epoch.

    splitting_micro_batch(256, 64, [2, 4])   # 64: 4 micro-batches, whole at 2 and 4 ranks
"""

from __future__ import annotations

import logging

from ddpflow.config.machine import micro_batches_per_step, ranks_per_node
from ddpflow.config.schema import ConfigError
from ddpflow.words import counted

log = logging.getLogger(__name__)


def working_world_sizes(train: dict) -> list[int]:
    """The world sizes that split a step's micro-batches evenly: divisors of global/micro."""
    count = micro_batches_per_step(train)
    return [w for w in range(1, count + 1) if count % w == 0]


def request_world_sizes(machine: dict) -> list[int]:
    """Every world size a job of this request can run at: machine.nodes, and each node count
    down to machine.min_nodes (placement shrinks a job there after node failures)."""
    per_node = ranks_per_node(machine)
    fewest = machine.get("min_nodes") or machine["nodes"]
    return [nodes * per_node for nodes in range(fewest, machine["nodes"] + 1)]


def splitting_micro_batch(global_batch: int, cap: int | None, worlds: list[int]) -> int | None:
    """The largest micro-batch up to `cap` that cuts the global batch into whole
    micro-batches which every world size in `worlds` shares out evenly (None: there is none)."""
    for micro in range(min(cap or global_batch, global_batch), 0, -1):
        count, rest = divmod(global_batch, micro)
        if not rest and all(count % world == 0 for world in worlds):
            return micro
    return None


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
