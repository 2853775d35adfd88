"""The report's inputs: every run's train_metrics.jsonl and eval_metrics.json, read and
checked for every key and type the report reads, for the run's task (its eval_metrics.json
names it; classification where it names none): classification's accuracy, per-class accuracy
and confusion matrix, multilabel's F1 and per-label counts, regression's errors per target
and predicted-vs-true histogram, and for any other task its headline metrics. A run whose
files cannot be read is not an error of the report: load_runs returns it as an
unfinished-runs entry naming the run, the file and what is wrong, and the report is written
without it.

    loaded, unreadable = load_runs([{"name", "train_metrics", "eval_metrics"}, ...])
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ddpflow.errors import ReportInputError
from ddpflow.report import metrics
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
_OPTIONAL = (int, float, type(None))  # a metric a task may leave undefined (r2 of a constant)
# each task's epoch keys in place of classification's val_accuracy (its val_loss stays)
_TASK_EPOCH = {
    "multilabel": {"val_f1_micro": _NUM, "val_f1_macro": _NUM, "val_exact_match": _NUM},
    "regression": {"val_mse": _NUM, "val_mae": _NUM, "val_r2": _OPTIONAL},
    "language_model": {"val_perplexity": _NUM, "val_token_accuracy": _NUM},
}
# what a task other than classification records about itself (training.records.task_fields)
_TASK_SPEC = {
    "task": str,
    "headline": list,
    "selection": {"metric": str, "higher_is_better": bool, "label": str},
}
_CLASSES_ONLY = ("accuracy", "per_class_accuracy", "confusion_matrix")
_COMMON_EVAL = {key: kind for key, kind in _EVAL_SPEC.items() if key not in _CLASSES_ONLY}
_TASK_EVAL = {
    "multilabel": {
        **dict.fromkeys(("exact_match", "f1_micro", "f1_macro"), _NUM),
        **dict.fromkeys(("per_label_f1", "true_positives", "false_positives"), list),
        "false_negatives": list,
    },
    "regression": {
        "mse": _NUM,
        "mae": _NUM,
        "r2": _OPTIONAL,
        "per_target": dict.fromkeys(("mse", "mae", "r2"), list),
        "predicted_vs_true": {"bins": int, "range": list, "counts": list},
    },
    "language_model": {"perplexity": _NUM, "token_accuracy": _NUM, "tokens": int},
}
_NAMELESS = ("language_model",)  # tasks whose outputs have no names (a vocabulary's ids)


def _check(obj: dict, spec: dict, where: str, prefix: str = "") -> None:
    for key, kind in spec.items():
        if key not in obj:
            raise ReportInputError(f"{where}: missing key {prefix + key!r}")
        value, expected = obj[key], dict if isinstance(kind, dict) else kind
        # bool is an int subclass; a JSON true where a count belongs is a producer bug
        if (isinstance(value, bool) and expected is not bool) or not isinstance(value, expected):
            raise ReportInputError(f"{where}: key {prefix + key!r} has type {type(value).__name__}")
        if isinstance(kind, dict):
            _check(value, kind, where, f"{prefix}{key}.")


def _read_text(path, where: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ReportInputError(f"{where}: cannot read file ({err})") from err


def _train_spec(evaluation: dict | None) -> dict:
    """The keys of an epoch record of the run's task: classification's val_accuracy, another
    task's val_* keys (one it does not know: its selection metric)."""
    task = metrics.task_of(evaluation or {})
    if task == metrics.CLASSIFICATION:
        return _TRAIN_SPEC
    chosen = metrics.selection(evaluation)
    own = _TASK_EPOCH.get(task, {chosen.metric: _NUM})
    spec = {}
    for key, kind in _TRAIN_SPEC.items():
        spec.update(own if key == "val_accuracy" else {key: kind})
    return spec


def load_train_metrics(name: str, path, evaluation: dict | None = None) -> list[dict]:
    """Per-epoch records sorted by epoch; a resumed attempt re-does epochs, the last one wins.
    evaluation: the run's eval_metrics.json record, which names its task (None:
    classification's epoch keys)."""
    where = f"run {name!r}: train_metrics {path}"
    spec = _train_spec(evaluation)
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
        _check(record, spec, f"{where} line {number}")
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
    if "task" in data and not isinstance(data["task"], str):
        raise ReportInputError(f"{where}: key 'task' has type {type(data['task']).__name__}")
    if metrics.task_of(data) != metrics.CLASSIFICATION:
        return _task_eval(data, where)
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


def _task_eval(data: dict, where: str) -> dict:
    """The evaluation record of a task other than classification, checked as its task writes it."""
    task = data["task"]
    _check(data, {**_COMMON_EVAL, **_TASK_SPEC, **_TASK_EVAL.get(task, {})}, where)
    n = len(data["class_names"])
    if not n and task not in _NAMELESS:
        what = {"multilabel": "label", "regression": "target"}.get(task, "class")
        raise ReportInputError(f"{where}: no {what} (class_names is empty)")
    for key in data["headline"]:
        value = data.get(key, False)
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, _OPTIONAL):
            raise ReportInputError(f"{where}: headline metric {key!r} is not a number")
    if task == "multilabel":
        _multilabel(data, n, where)
    elif task == "regression":
        _regression(data, n, where)
    if data["samples_evaluated"] != data["test_size"]:
        evaluated, size = data["samples_evaluated"], data["test_size"]
        log.warning("%s: %d samples evaluated, test size %d", where, evaluated, size)
    return data


def _numbers(values: list, n: int, what: str, where: str, kinds=_OPTIONAL) -> None:
    """n values, each of kinds (never a bool)."""
    if len(values) != n:
        raise ReportInputError(f"{where}: {what} has {len(values)} entries for {n} names")
    if any(isinstance(v, bool) or not isinstance(v, kinds) for v in values):
        kind = "count" if kinds is int else "number"
        raise ReportInputError(f"{where}: {what} holds a value that is not a {kind}")


def _multilabel(data: dict, n: int, where: str) -> None:
    _numbers(data["per_label_f1"], n, "per_label_f1", where)
    for key in ("true_positives", "false_positives", "false_negatives"):
        _numbers(data[key], n, key, where, int)


def _regression(data: dict, n: int, where: str) -> None:
    for key in ("mse", "mae", "r2"):
        values = data["per_target"][key]
        _numbers(values, n, f"per_target.{key}", where, _OPTIONAL if key == "r2" else _NUM)
    histogram = data["predicted_vs_true"]
    bins, ranges, counts = histogram["bins"], histogram["range"], histogram["counts"]
    if bins < 1 or len(ranges) != len(counts) or len(counts) > n:
        raise ReportInputError(
            f"{where}: predicted_vs_true has {bins} bins, {len(ranges)} ranges and "
            f"{len(counts)} histograms for {n} targets"
        )
    for span in ranges:
        if (
            not isinstance(span, list)
            or len(span) != 2
            or any(isinstance(v, bool) or not isinstance(v, _NUM) for v in span)
            or not span[0] < span[1]
        ):
            raise ReportInputError(f"{where}: predicted_vs_true.range holds {span!r}: no [lo, hi]")
    for grid in counts:
        if not isinstance(grid, list) or len(grid) != bins:
            raise ReportInputError(f"{where}: predicted_vs_true.counts is not {bins}x{bins}")
        if any(not isinstance(row, list) or len(row) != bins for row in grid):
            raise ReportInputError(f"{where}: predicted_vs_true.counts is not {bins}x{bins}")
        for row in grid:
            _numbers(row, bins, "predicted_vs_true.counts", where, int)


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
            epochs = load_train_metrics(name, run["train_metrics"], evals)
            loaded.append((name, epochs, evals))
        except ReportInputError as err:
            log.warning("report: %s", err)
            unreadable.append(unrenderable(name, str(err), run.get("sweep")))
    return loaded, unreadable


def unrenderable(name: str, cause: str, sweep_block=None) -> dict:
    """The unfinished-runs entry of a run whose records the report cannot show."""
    cause = f"records cannot be shown: {cause}"
    return {"run": name, "stage": "report", "cause": cause, "sweep": sweep_block}
