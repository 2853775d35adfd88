"""What a micro-batch decides for the science, apart from the machine: train.norm_batch_size.

A micro-batch is the samples one rank computes in one forward. Most of what it decides is the
order of float sums, a machine matter like the world size. What it decides for the science:

- BatchNorm normalises each forward's samples together: its batch is the normalisation batch
  (`norm`). When a rank's micro-batch is smaller, the ranks that together hold one
  normalisation batch (`group` consecutive ranks, ddpflow.training.norm_groups) normalise it
  together, so a run normalises over the same samples at any world size;
- augmentation draws are made per normalisation batch and sliced, so they are the same too;
- a model that draws random numbers in its forward (dropout; torchvision's and your own
  models, which ddpflow cannot see into) keeps the micro-batch as its science, as before.

The normalisation batch of `micro_batch_size: auto` is the one the run trained with (its
train_summary.json: a run trained before the key keeps its identity at any world size), or
for a new run the micro-batch auto resolves to at one rank: a function of the recipe alone.

    role = batch_role(run)                      # "norm", "free" or "draws"
    norm, group = normalisation(where, train, cap, worlds, recorded)
"""

from __future__ import annotations

import json
from pathlib import Path

from ddpflow.config.fingerprint import TOKEN_SOURCES
from ddpflow.config.machine import splitting_micro_batch
from ddpflow.config.schema import ConfigError
from ddpflow.kept import KEPT
from ddpflow.paths import RUN_FILES, run_dir

# built-in models with BatchNorm and no random draws in their forward
BATCH_NORM_MODELS = ("cnn", "resnet18", "resnet34")
# built-in models with neither: their micro-batch is a machine setting alone
PLAIN_MODELS = ("mlp",)


def batch_role(run: dict) -> str:
    """How the micro-batch acts on this run's science. "norm": a batch that BatchNorm
    normalises (or augmentation draws for), kept by the normalisation batch; "free": none,
    the micro-batch is the machine's; "draws": the forward draws random numbers per
    micro-batch (dropout, or a model ddpflow cannot see into), so the micro-batch is the
    science."""
    model = run["model"]
    name = model["name"]
    if name == "gpt":
        plain = not (model.get("kwargs") or {}).get("dropout")
    elif name in PLAIN_MODELS + BATCH_NORM_MODELS:
        plain = True
    else:
        return "draws"
    images = run["data"]["source"] not in TOKEN_SOURCES  # augmentation draws for images
    if name in BATCH_NORM_MODELS or (plain and images and run["train"]["augment"]["enabled"]):
        return "norm"
    return "free" if plain else "draws"


def recorded_norm_batch(results_dir: str, name: str) -> int | None:
    """The normalisation batch the run last trained with (its train_summary.json's
    norm_batch; from a run before the key, its micro_batch), else None. The kept copy
    (ddpflow.kept) counts while a rerun has its outputs removed."""
    folder = run_dir(results_dir, name)
    name = RUN_FILES["train_summary"]
    for path in (folder / name, folder / KEPT / "train" / name):
        summary = _read(path)
        if summary:
            value = summary.get("norm_batch", summary.get("micro_batch"))
            return value if isinstance(value, int) and value > 0 else None
    return None


def _read(path: Path) -> dict | None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def normalisation(
    where: str, train: dict, cap: int | None, worlds: list[int], recorded, shape: str = ""
) -> tuple[int, int]:
    """(normalisation batch, ranks per normalisation group) for a "norm" run; the micro-batch
    is norm // group. Refused, naming what works, where no group of ranks can hold it."""
    global_, micro = train["global_batch_size"], train["micro_batch_size"]
    norm = train["norm_batch_size"]
    if norm == "auto" and micro != "auto":
        return micro, 1  # a number alone is the micro-batch as before (checks.batch refuses)
    if norm == "auto":  # the run's own, else (a run's first) the recipe's
        norm = kept_batch(global_, recorded) or _new_norm(global_, cap, worlds)
    if global_ % norm:
        raise ConfigError(
            f"{where}: train.global_batch_size {global_} is not a multiple of "
            f"train.norm_batch_size {norm}: a step is whole normalisation batches; set one "
            f"a multiple of the other (e.g. norm_batch_size {_divisor_below(global_, norm)})"
        )
    if micro != "auto" and norm % micro:
        raise ConfigError(
            f"{where}: train.micro_batch_size {micro} does not divide "
            f"train.norm_batch_size {norm}: the ranks that share a normalisation batch "
            f"hold equal parts of it; set micro_batch_size to a divisor of {norm} "
            f"(e.g. {_divisor_below(norm, micro)}) or auto"
        )
    groups = _groups(norm, micro, global_, worlds)
    if not groups:
        raise ConfigError(_refusal(where, train, norm, worlds, shape))
    within_cap = [g for g in groups if cap is None or norm // g <= cap]
    return norm, (within_cap or groups)[0]


def kept_batch(global_: int, recorded: int | None) -> int | None:
    """The batch the run trained with, where it still splits the global batch (a global
    batch edited to one it does not divide is a new recipe)."""
    return recorded if recorded and global_ % recorded == 0 else None


def free_science(train: dict, cap: int | None, recorded: int | None, micro: int) -> int:
    """A "free" run's science batch (its micro-batch decides nothing): the batch it trained
    with, so no world size retrains it; a number written for micro_batch_size or
    norm_batch_size is the user's own."""
    if train["norm_batch_size"] != "auto":
        return train["norm_batch_size"]
    if train["micro_batch_size"] != "auto":
        return micro
    global_ = train["global_batch_size"]
    return kept_batch(global_, recorded) or splitting_micro_batch(global_, cap, [1]) or micro


def _groups(norm: int, micro, global_: int, worlds: list[int]) -> list[int]:
    """The group sizes (ranks per normalisation batch) that every world size can hold, even
    shares first; else 1 where the ranks take unequal numbers of normalisation batches."""
    sizes = [norm // micro] if micro != "auto" else range(1, norm + 1)
    even = [g for g in sizes if norm % g == 0 and _fits(g, global_ // norm, worlds)]
    return even or [g for g in sizes if _fits(g, global_ // norm, worlds, uneven=True)]


def _new_norm(global_: int, cap: int | None, worlds: list[int]) -> int:
    """A new run's normalisation batch: the micro-batch auto resolves to at one rank (the
    recipe's alone), unless the request cannot hold it at every world size it may run at
    (machine.min_nodes): then the largest up to the cap that it can."""
    first = splitting_micro_batch(global_, cap, [1]) or 1
    for norm in range(first, 0, -1):
        if global_ % norm == 0 and _groups(norm, "auto", global_, worlds):
            return norm
    return first  # refused by the caller, naming the world sizes that work


def _fits(group: int, norms: int, worlds: list[int], uneven: bool = False) -> bool:
    """Whether every world size holds normalisation groups of `group` consecutive ranks that
    share out the step's `norms` normalisation batches evenly; uneven: each rank its own
    normalisation batches, the first ranks one more (at least one each)."""
    if uneven:
        return group == 1 and all(norms >= w for w in worlds)
    return all(w % group == 0 and norms % (w // group) == 0 for w in worlds)


def _divisor_below(number: int, near: int) -> int:
    return max(d for d in range(1, number + 1) if number % d == 0 and d <= max(near, 1))


def working_worlds(global_: int, norm: int, micro) -> list[int]:
    """The world sizes (up to the step's samples) that hold the normalisation batches."""
    return [w for w in range(1, global_ + 1) if _groups(norm, micro, global_, [w])]


def _refusal(where: str, train: dict, norm: int, worlds: list[int], shape: str) -> str:
    global_, micro = train["global_batch_size"], train["micro_batch_size"]
    works = working_worlds(global_, norm, micro)
    shown = ", ".join(map(str, works[:12])) + (f", ... ({len(works)} in all)" * (len(works) > 12))
    sizes = ", ".join(map(str, worlds))
    given = f" with train.micro_batch_size {micro}" if micro != "auto" else ""
    groups = _groups(norm, "auto", global_, worlds)
    if micro != "auto" and groups:  # the science holds at this size with smaller parts
        fix = (
            f"To keep the science at this size, write train.micro_batch_size: "
            f"{norm // groups[0]} and train.norm_batch_size: {norm} ({groups[0]} ranks "
            "normalise each batch together: nothing retrains), or micro_batch_size: auto"
        )
    else:
        held = [n for n in range(norm - 1, 0, -1) if global_ % n == 0]
        smaller = next((n for n in held if _groups(n, "auto", global_, worlds)), None)
        number = f": {smaller}" if smaller else " to a number that splits at this size"
        fix = (
            f"Change the machine, or set train.norm_batch_size{number} (the science changes: "
            "the run retrains)"
        )
    return (
        f"{where}: world size {sizes}{shape} cannot hold train.global_batch_size {global_} as "
        f"whole normalisation batches of {norm} (train.norm_batch_size, BatchNorm's batch: "
        f"{global_ // norm} per step, each normalised by one rank or by a group of ranks "
        f"that holds equal parts of it){given}: world sizes {shown} work. {fix}"
    )
