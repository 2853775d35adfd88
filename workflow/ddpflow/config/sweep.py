"""`sweep:` -> named runs. A grid (cross product of lists), seeded random draws and the rows of
a table file become ordinary run entries before the DAG is built: each point is the config's
sections with the point's dotted keys set, named from its values, so the same point always
gets the same name and adding a value only adds runs (design: sweeps expand into runs).
"""

from __future__ import annotations

import csv
import itertools
import math
import random
import re
from pathlib import Path

import yaml

from ddpflow.config.schema import ConfigError

SECTIONS = ("data", "model", "train", "eval", "machine")
DISTRIBUTIONS = ("choice", "uniform", "log_uniform", "int_uniform")
# significant digits kept of a drawn float: the value trained is the one in the run's name
DRAW_DIGITS = 3


def has_sweep(config: dict) -> bool:
    sweep = config.get("sweep") or {}
    return bool(sweep.get("grid") or sweep.get("random") or sweep.get("table"))


def sweep_entries(config: dict) -> list[dict]:
    """The sweep's points as run entries ({"name", <section>: overrides, "sweep": {...}}),
    grid first, then random draws, then table rows; a point met twice is one run."""
    sweep = config.get("sweep") or {}
    if not has_sweep(config):
        return []
    _refuse_too_many(sweep)
    points: list[tuple[str, dict, str]] = []  # (name, values, origin)
    points += [(_name(v), v, "grid") for v in _grid(sweep.get("grid") or {})]
    if sweep.get("random"):
        points += [(_name(v), v, "random") for v in _draws(sweep["random"])]
    if sweep.get("table"):
        points += _table(sweep["table"])
    points = _unique(points)
    if len(points) > sweep["max_runs"]:
        raise ConfigError(_too_many(len(points), sweep["max_runs"], "distinct points"))
    keys = list(dict.fromkeys(k for _, values, _ in points for k in values))
    log_keys = [k for k, spec in ((sweep.get("random") or {}).get("space") or {}).items()
                if "log_uniform" in spec]  # fmt: skip
    peers = [name for name, _, _ in points]
    block = {"keys": keys, "log_keys": log_keys, "peers": peers, "prune": sweep.get("prune")}
    return [
        {"name": name, **_overrides(values, name),
         "sweep": {**block, "values": dict(values), "origin": origin}}
        for name, values, origin in points
    ]  # fmt: skip


def _refuse_too_many(sweep: dict) -> None:
    """Count before expanding: a grid of a million points is refused, not built."""
    grid = math.prod(len(v) for v in (sweep.get("grid") or {}).values()) if sweep.get("grid") else 0
    draws = (sweep.get("random") or {}).get("samples", 0)
    if grid + draws > sweep["max_runs"]:
        parts = " x ".join(str(len(v)) for v in (sweep.get("grid") or {}).values())
        what = f"grid {parts} = {grid}" if grid else ""
        what += f"{' + ' if what else ''}random {draws}" if draws else ""
        raise ConfigError(_too_many(grid + draws, sweep["max_runs"], what))


def _too_many(count: int, limit: int, what: str) -> str:
    return (
        f"sweep: would create {count} runs ({what}), more than sweep.max_runs ({limit}); "
        "narrow the sweep or raise sweep.max_runs"
    )


def _grid(grid: dict) -> list[dict]:
    if not grid:
        return []
    keys = list(grid)
    combos = itertools.product(*(grid[k] for k in keys))
    return [dict(zip(keys, combo, strict=True)) for combo in combos]


def _draws(spec: dict) -> list[dict]:
    """`samples` points drawn from `space` with random.Random(seed): the same seed and space
    give the same points on any machine and Python version (Random's sequence is stable)."""
    rng = random.Random(spec["seed"])
    return [{key: _draw(rng, dist) for key, dist in spec["space"].items()}
            for _ in range(spec["samples"])]  # fmt: skip


def _draw(rng: random.Random, dist: dict):
    ((kind, arg),) = dist.items()
    if kind == "choice":
        return arg[rng.randrange(len(arg))]
    low, high = arg
    if not low < high:
        raise ConfigError(
            f"sweep.random.space: {kind} bounds {arg} must be [low, high] with low < high"
        )
    if kind == "int_uniform":
        return rng.randint(int(low), int(high))
    if kind == "log_uniform":
        value = math.exp(rng.uniform(math.log(low), math.log(high)))
    else:
        value = rng.uniform(low, high)
    return float(f"{value:.{DRAW_DIGITS}g}")


def _table(path: str) -> list[tuple[str, dict, str]]:
    """One point per row of a .tsv/.csv file whose header holds dotted keys (an optional
    `name` column names the row's run); cells are read as YAML scalars: 0.1, cnn, true."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"sweep.table: file {path} does not exist (relative to the "
                          "directory snakemake runs in)")  # fmt: skip
    delimiter = "," if file.suffix.lower() == ".csv" else "\t"
    with file.open(newline="") as f:
        rows = [row for row in csv.reader(f, delimiter=delimiter) if any(c.strip() for c in row)]
    if len(rows) < 2:
        raise ConfigError(f"sweep.table: {path} needs a header of dotted keys and a row per run")
    header = [h.strip() for h in rows[0]]
    points = []
    for line, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise ConfigError(f"sweep.table: {path} line {line} has {len(row)} cells, the "
                              f"header {len(header)}")  # fmt: skip
        values = {k: _cell(c, path, line) for k, c in zip(header, row, strict=True) if k != "name"}
        named = dict(zip(header, row, strict=True)).get("name", "").strip()
        points.append((named or _name(values), values, "table"))
    return points


def _cell(text: str, path: str, line: int):
    try:
        return yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"sweep.table: {path} line {line}: {text!r} is not a value: {exc}"
        ) from exc


def _unique(points: list[tuple[str, dict, str]]) -> list[tuple[str, dict, str]]:
    """One run per point; two different points under one name are refused."""
    seen: dict[str, dict] = {}
    out = []
    for name, values, origin in points:
        if name in seen:
            if seen[name] != values:
                raise ConfigError(
                    f"sweep: points {seen[name]} and {values} are both named {name!r}; give "
                    "the table a `name` column or values that differ in their name"
                )
            continue
        seen[name] = values
        out.append((name, values, origin))
    return out


def _name(values: dict) -> str:
    """lr-0.05_name-cnn: each swept key's last part and its value, in the sweep's key order.
    Two keys ending alike (train.x.lr, model.lr) keep more of their path."""
    labels = _labels(list(values))
    parts = [f"{labels[k]}-{_text(v)}" for k, v in values.items()]
    return "_".join(parts) or "point"


def _labels(keys: list[str]) -> dict[str, str]:
    labels = {}
    for key in keys:
        parts = key.split(".")
        depth = 1
        while depth < len(parts) and any(
            other != key and other.split(".")[-depth:] == parts[-depth:] for other in keys
        ):
            depth += 1
        labels[key] = "-".join(parts[-depth:])
    return labels


def _text(value) -> str:
    if isinstance(value, bool) or value is None:
        text = str(value).lower()
    elif isinstance(value, float):
        text = f"{value:g}"
    elif isinstance(value, (list, tuple)):
        text = "x".join(_text(v) for v in value)
    else:
        text = str(value)
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "empty"


def _overrides(values: dict, name: str) -> dict:
    """{"train.optimizer.lr": 0.1} -> {"train": {"optimizer": {"lr": 0.1}}}."""
    out: dict = {}
    for key, value in values.items():
        parts = key.split(".")
        if parts[0] not in SECTIONS or len(parts) < 2:
            raise ConfigError(
                f"sweep point {name!r}: key {key!r} must be dotted from a section: "
                f"{', '.join(s + '.' for s in SECTIONS)} (e.g. train.optimizer.lr)"
            )
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"sweep point {name!r}: key {key!r} is inside a value")
        node[parts[-1]] = value
    return out
