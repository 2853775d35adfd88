"""The report's view of a run's task (ddpflow.task): which metrics head the run's row, how
each one reads, and which validation metric selects its best run in which direction.

A classification record carries no task (classification's records are those written before
tasks existed): its headline is accuracy and its selection validation accuracy, higher
better. A record of another task names its task, its headline metrics and its selection
(ddpflow.training.summaries.task_fields). Runs of different tasks are never compared with
each other: each task has its own best run. What else the report shows of a task, the task
says (ddpflow.task.record_task(ev): Task's report hooks). Pure: no matplotlib, no torch.

    task_of(ev); headline(ev); selection(ev)        # from an eval_metrics.json record
    shown("mse", 0.0123)                            # "0.0123"
"""

from __future__ import annotations

import math

from ddpflow.task import DEFAULT_TASK, Selection, record_task, selection_of
from ddpflow.task.views import label, shown

__all__ = [
    "CLASSIFICATION",
    "eval_key",
    "headline",
    "label",
    "metric_name",
    "score",
    "selection",
    "shown",
    "task_of",
]

CLASSIFICATION = DEFAULT_TASK  # the task of a record that names none


def task_of(ev: dict) -> str:
    """The run's task, as its evaluation record names it (classification where it names none)."""
    task = ev.get("task")
    return task if isinstance(task, str) and task else DEFAULT_TASK


def headline(ev: dict) -> list[str]:
    """The evaluation record's headline metric keys: ["accuracy"] for classification."""
    return record_task(ev).record_headline(ev)


def selection(ev: dict) -> Selection:
    """The validation metric that selects the run and its direction."""
    return selection_of(ev)


def eval_key(chosen: Selection) -> str:
    """The evaluation record's key of the selection metric ("val_mse" -> "mse")."""
    return chosen.metric.removeprefix("val_")


def metric_name(chosen: Selection) -> str:
    """The selection's metric without its split: "validation MSE" -> "MSE"."""
    return chosen.label.removeprefix("validation ").removeprefix("val ")


def direction(chosen: Selection) -> str:
    """Words for the direction, where it is not the usual one ("" for higher is better)."""
    return "" if chosen.higher_is_better else " (lower is better)"


def score(chosen: Selection, value) -> tuple:
    """A sort key of a metric's value, best first; a value that is missing or not finite
    sorts after every number (a diverged run's NaN never wins)."""
    finite = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return (not finite, chosen.key(value) if finite else 0.0)
