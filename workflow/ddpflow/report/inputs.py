"""The report's inputs: every run's train_metrics.jsonl and eval_metrics.json, read and
checked for every key and type the report reads. A run whose files cannot be read is not an
error of the report: load_runs returns it as an unfinished-runs entry naming the run, the file
and what is wrong, and the report is written without it.

    loaded, unreadable = load_runs([{"name", "train_metrics", "eval_metrics"}, ...])
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ddpflow.errors import ReportInputError
from ddpflow.report.render import PHASES

log = logging.getLogger(__name__)

_NUM = (int, float)
_TRAIN_SPEC = {
    "run": str, "attempt": int, "epoch": int, "step": int, "train_loss": _NUM,
    "val_accuracy": _NUM, "val_loss": _NUM, "lr": _NUM, "samples_per_s": _NUM,
    "seconds": {key: _NUM for key in (*PHASES, "epoch")},
}  # fmt: skip
_EVAL_SPEC = {
    "run": str, "accuracy": _NUM, "per_class_accuracy": list, "confusion_matrix": list,
    "class_names": list, "samples_evaluated": int, "test_size": int, "world_size": int,
    "hosts": list, "eval_seconds": _NUM,
    "train": {
        "world_size": int, "nodes": int, "samples_per_s": _NUM, "wall_seconds": _NUM,
        "epochs": int, "attempts": int, "hosts": list, "phase_seconds": dict,
    },
    "provenance": {
        "config": dict, "git_commit": (str, type(None)), "versions": dict, "hostnames": list,
        "created": str,
    },
}  # fmt: skip


def _check(obj: dict, spec: dict, where: str, prefix: str = "") -> None:
    for key, kind in spec.items():
        if key not in obj:
            raise ReportInputError(f"{where}: missing key {prefix + key!r}")
        value, expected = obj[key], dict if isinstance(kind, dict) else kind
        # bool is an int subclass; a JSON true where a count belongs is a producer bug
        if isinstance(value, bool) or not isinstance(value, expected):
            raise ReportInputError(f"{where}: key {prefix + key!r} has type {type(value).__name__}")
        if isinstance(kind, dict):
            _check(value, kind, where, f"{prefix}{key}.")


def _read_text(path, where: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ReportInputError(f"{where}: cannot read file ({err})") from err


def load_train_metrics(name: str, path) -> list[dict]:
    """Per-epoch records sorted by epoch; a resumed attempt re-does epochs, the last one wins."""
    where = f"run {name!r}: train_metrics {path}"
    by_epoch: dict[int, dict] = {}
    for number, line in enumerate(_read_text(path, where).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ReportInputError(f"{where}: line {number} is not JSON ({err.msg})") from err
        if not isinstance(record, dict):
            raise ReportInputError(f"{where}: line {number} is not a JSON object")
        _check(record, _TRAIN_SPEC, f"{where} line {number}")
        by_epoch[record["epoch"]] = record
    if not by_epoch:
        raise ReportInputError(f"{where}: no epochs recorded")
    return [by_epoch[epoch] for epoch in sorted(by_epoch)]


def load_eval_metrics(name: str, path) -> dict:
    """The evaluation JSON, checked for every key the report reads and for class consistency."""
    where = f"run {name!r}: eval_metrics {path}"
    try:
        data = json.loads(_read_text(path, where))
    except json.JSONDecodeError as err:
        raise ReportInputError(f"{where}: not JSON ({err.msg})") from err
    if not isinstance(data, dict):
        raise ReportInputError(f"{where}: not a JSON object")
    _check(data, _EVAL_SPEC, where)
    n, matrix = len(data["class_names"]), data["confusion_matrix"]
    if not n:
        raise ReportInputError(f"{where}: no class (class_names is empty)")
    if len(data["per_class_accuracy"]) != n or len(matrix) != n:
        raise ReportInputError(f"{where}: class_names, per_class_accuracy, confusion_matrix differ")
    if any(not isinstance(row, list) or len(row) != n for row in matrix):
        raise ReportInputError(f"{where}: confusion_matrix is not {n}x{n}")
    if any(not isinstance(c, int) or isinstance(c, bool) for row in matrix for c in row):
        raise ReportInputError(f"{where}: confusion_matrix holds a value that is not a count")
    # None: a class with no sample in the evaluated split (shown as n/a)
    numbers = [a for a in data["per_class_accuracy"] if a is not None]
    if any(isinstance(a, bool) or not isinstance(a, _NUM) for a in numbers):
        raise ReportInputError(f"{where}: per_class_accuracy holds a value that is not a number")
    # Padded samplers double-count (README: Exact evaluation): a count mismatch is loud, not fatal.
    total = sum(sum(row) for row in matrix)
    if not data["samples_evaluated"] == data["test_size"] == total:
        log.warning("%s: %d samples evaluated, test size %d, confusion total %d", where,
                    data["samples_evaluated"], data["test_size"], total)  # fmt: skip
    return data


def load_runs(runs: list[dict], unfinished=()) -> tuple[list[tuple], list[dict]]:
    """The runs whose records can be read, and one unfinished entry per run whose records
    cannot (missing, cut short, a key or type the report needs is not there): the report is
    written without it, naming it and why."""
    if not runs and not unfinished:
        raise ReportInputError("build_report: no runs given")
    loaded, unreadable, names = [], [], set()
    for run in runs:
        missing = {"name", "train_metrics", "eval_metrics"} - set(run)
        if missing:
            raise ReportInputError(f"run {run.get('name')!r}: missing {sorted(missing)}")
        name = str(run["name"])
        if name in names:
            raise ReportInputError(f"run {name!r}: listed twice")
        names.add(name)
        try:
            evals = load_eval_metrics(name, run["eval_metrics"])
            loaded.append((name, load_train_metrics(name, run["train_metrics"]), evals))
        except ReportInputError as err:
            log.warning("report: %s", err)
            unreadable.append(unrenderable(name, str(err), run.get("sweep")))
    return loaded, unreadable


def unrenderable(name: str, cause: str, sweep_block=None) -> dict:
    """The unfinished-runs entry of a run whose records the report cannot show."""
    cause = f"records cannot be shown: {cause}"
    return {"run": name, "stage": "report", "cause": cause, "sweep": sweep_block}
