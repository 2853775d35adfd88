"""The report's inputs: every run's train_metrics.jsonl and eval_metrics.json, read and
checked for every key and type the report reads, for the run's task (its eval_metrics.json
names it; classification where it names none): the keys every record has, and those the
task's Task.record_fields and Task.check_record name (ddpflow.task). A run whose
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
from ddpflow.report.render import PHASES
from ddpflow.task import Task, record_task
from ddpflow.task.views import OPTIONAL as _OPTIONAL

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
# what a task other than classification records about itself (training.summaries.task_fields)
_TASK_SPEC = {
    "task": str,
    "headline": list,
    "selection": {"metric": str, "higher_is_better": bool, "label": str},
}
_CLASSES_ONLY = ("accuracy", "per_class_accuracy", "confusion_matrix")
_COMMON_EVAL = {key: kind for key, kind in _EVAL_SPEC.items() if key not in _CLASSES_ONLY}


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
    """The keys of an epoch record of the run's task: its own val_* keys in place of
    classification's val_accuracy (ddpflow.task: Task.epoch_fields)."""
    own = record_task(evaluation or {}).epoch_fields()
    spec: dict = {}
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
    return _task_eval(data, record_task(data), where)


def _task_eval(data: dict, task: Task, where: str) -> dict:
    """The evaluation record checked as its task writes it (ddpflow.task: Task.record_fields,
    Task.check_record): the keys every record has, what a task other than classification
    says about itself, the task's own keys and their consistency."""
    own = _TASK_SPEC if task.named_in_records else {}
    _check(data, {**_COMMON_EVAL, **own, **task.record_fields()}, where)
    n = len(data["class_names"])
    if not n and task.names_word is not None:
        raise ReportInputError(f"{where}: no {task.names_word} (class_names is empty)")
    for key in data.get("headline", ()) if task.named_in_records else ():
        value = data.get(key, False)
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, _OPTIONAL):
            raise ReportInputError(f"{where}: headline metric {key!r} is not a number")
    task.check_record(data, n, where)
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
