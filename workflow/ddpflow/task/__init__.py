"""What a run learns: its task (the top-level `task:` key). A task owns what a sample's target
is and how it is staged and checked, the model's output size, the loss, the evaluation's
metric states (sums that all-reduce exactly: int64 counts, float64 sums with their counts)
and the metrics computed from them, and the validation metric that selects (the best run of
a sweep, median pruning) with its direction. Everything else (the sample order, accumulation,
ddp/zero/fsdp, precision, checkpoints, resume at any world size, trackers) does not know
which task runs.

    task: classification      # the default: one class per sample, cross-entropy, accuracy
    task: multilabel          # 0/1 label vectors, BCE with logits, exact match and F1
    task: regression          # float targets, MSE (or Huber), mse, mae, r2
    task: language_model      # token data, next-token cross-entropy, perplexity
    task: "my_tasks:make"     # your own: a function (**task_kwargs) returning a Task

The protocol (ddpflow.task.base.Task) is documented in docs/tasks.md. The rest of ddpflow asks
the task object, never its name: get_task / run_task for a config's run, record_task for an
eval_metrics.json record (the report, trackers), manifest_task for a staged manifest. Not to
be confused with ddpflow.training.entry, the callables a rank runs. Imports no torch at
module level: the login node resolves a task while it parses the config.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ddpflow.errors import DataError, TaskError
from ddpflow.plugins import call_plugin, is_plugin
from ddpflow.task.base import Selection, Task

if TYPE_CHECKING:
    import numpy as np

    from ddpflow.config.typed import RunView, SectionView

__all__ = [
    "BUILT_IN_TASKS",
    "DEFAULT_TASK",
    "Selection",
    "Task",
    "TaskError",
    "get_task",
    "manifest_task",
    "record_task",
    "run_task",
    "selection_of",
]

DEFAULT_TASK = "classification"
BUILT_IN_TASKS = ("classification", "multilabel", "regression", "language_model")


def get_task(name: str = DEFAULT_TASK, kwargs: dict | None = None) -> Task:
    """The task named by `task:` with `task_kwargs:` (checked: a TaskError names the key)."""
    return _get_task(name, _frozen(kwargs or {}))


@functools.cache
def _get_task(name: str, frozen: tuple) -> Task:
    kwargs = dict(frozen)
    if name == "classification":
        from ddpflow.task.classification import Classification

        return Classification.from_kwargs(kwargs)
    if name == "multilabel":
        from ddpflow.task.multilabel import Multilabel

        return Multilabel.from_kwargs(kwargs)
    if name == "regression":
        from ddpflow.task.regression import Regression

        return Regression.from_kwargs(kwargs)
    if name == "language_model":
        from ddpflow.task.lm import LanguageModel

        return LanguageModel.from_kwargs(kwargs)
    if not is_plugin(name):
        raise TaskError(
            f"task {name!r}: not a task; use one of {', '.join(BUILT_IN_TASKS)} "
            "or your own, written 'package.module:function'"
        )
    task = call_plugin(name, "task", TaskError, kwargs=kwargs, given=f"task_kwargs {kwargs}")
    missing = [attr for attr in Task.REQUIRED if not hasattr(task, attr)]
    if missing:
        raise TaskError(
            f"task {name!r}: the function returned a {type(task).__name__} "
            f"without {', '.join(missing)} (the Task protocol: docs/tasks.md)"
        )
    return task


def run_task(section: RunView | SectionView) -> Task:
    """The task of a resolved run, or of its data section (ddpflow.config.runs puts a task
    other than classification, and a plug-in task's kwargs, there: what staging reads): its
    task and task_kwargs, classification where absent."""
    return get_task(section.get("task", DEFAULT_TASK), section.get("task_kwargs") or {})


def task_targets(
    task: Task, labels, names: list[str] | None, where: str, n: int
) -> tuple[np.ndarray, list[str]]:
    """A source's targets as `task` stages them (checked), one per image, and their names."""
    targets, names = task.stage_targets(labels, names, where)
    if len(targets) != n:
        raise DataError(f"{where} has {len(targets)} entries but there are {n} images")
    return targets, names


def _frozen(kwargs: dict) -> tuple:
    return tuple(sorted((k, _hashable(v)) for k, v in kwargs.items()))


def _hashable(value):
    if isinstance(value, dict):
        return _frozen(value)
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


def selection_of(record: dict | None) -> Selection:
    """The validation metric that selects a run (an epoch record key) and its direction, as
    a train summary or evaluation record states it; records without one are classification's
    (every run trained before tasks existed)."""
    chosen = (record or {}).get("selection")
    if isinstance(chosen, dict) and "metric" in chosen:
        return Selection(
            str(chosen["metric"]),
            bool(chosen.get("higher_is_better", True)),
            str(chosen.get("label", chosen["metric"])),
        )
    return get_task(DEFAULT_TASK).selection


def manifest_task(manifest: dict) -> Task:
    """The task that reads a staged manifest's targets: the built-in one it names (a
    manifest without a task: classification's), else the protocol's defaults, which read
    the layout the manifest records (a plug-in task's target_dtype and target_shape)."""
    name = manifest.get("task", DEFAULT_TASK)
    return get_task(name) if name in BUILT_IN_TASKS else Task()


def record_task(ev: dict) -> Task:
    """The task of an evaluation record (eval_metrics.json), for the report and trackers:
    classification where it names none; a plug-in task resolved from the run's config as it
    trained (task, task_kwargs); where that no longer resolves (the code moved), the
    record's own headline and selection with the protocol's defaults."""
    name = ev.get("task") if isinstance(ev.get("task"), str) and ev.get("task") else None
    if name is None or name in BUILT_IN_TASKS:
        return get_task(name or DEFAULT_TASK)
    config = (ev.get("provenance") or {}).get("config") or {}
    spec = config.get("task") if isinstance(config, dict) else None
    if isinstance(spec, str) and is_plugin(spec):
        try:
            task = get_task(spec, config.get("task_kwargs") or {})
        except TaskError:
            task = None
        if task is not None and task.name == name:
            return task
    return _Recorded(name, selection_of(ev), tuple(ev.get("headline") or ()))


class _Recorded(Task):
    """A task known only from its records: their name, headline and selection."""

    def __init__(self, name: str, selection: Selection, headline: tuple[str, ...]):
        self.name, self.selection, self.headline = name, selection, headline
