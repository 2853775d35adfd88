"""The report's view of a run's task (ddpflow.task): which metrics head the run's row, how
each one reads, and which validation metric selects its best run in which direction.

A classification record carries no task (classification's records are those written before
tasks existed): its headline is accuracy and its selection validation accuracy, higher
better. A record of another task names its task, its headline metrics and its selection
(ddpflow.training.records.task_fields). Runs of different tasks are never compared with
each other: each task has its own best run. Pure: no matplotlib, no torch.

    task_of(ev); headline(ev); selection(ev)        # from an eval_metrics.json record
    shown("mse", 0.0123)                            # "0.0123"
"""

from __future__ import annotations

import math

from ddpflow.task import Selection, selection_of

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

CLASSIFICATION = "classification"

# a metric key -> (its name in the report, its format); any other key reads as itself, .4g
_READ = {
    "accuracy": ("accuracy", ".2%"),
    "exact_match": ("exact match", ".2%"),
    "f1_micro": ("F1 (micro)", ".4f"),
    "f1_macro": ("F1 (macro)", ".4f"),
    "mse": ("MSE", ".4g"),
    "mae": ("MAE", ".4g"),
    "r2": ("R²", ".4f"),
    "perplexity": ("perplexity", ".4f"),
    "token_accuracy": ("token accuracy", ".2%"),
}


def task_of(ev: dict) -> str:
    """The run's task, as its evaluation record names it (classification where it names none)."""
    task = ev.get("task")
    return task if isinstance(task, str) and task else CLASSIFICATION


def headline(ev: dict) -> list[str]:
    """The evaluation record's headline metric keys: ["accuracy"] for classification."""
    if task_of(ev) == CLASSIFICATION:
        return ["accuracy"]
    return [str(key) for key in ev.get("headline") or ()]


def selection(ev: dict) -> Selection:
    """The validation metric that selects the run and its direction."""
    return selection_of(ev)


def eval_key(chosen: Selection) -> str:
    """The evaluation record's key of the selection metric ("val_mse" -> "mse")."""
    return chosen.metric.removeprefix("val_")


def _bare(key: str) -> str:
    return key.removeprefix("val_").removeprefix("test_").removeprefix("final_val_")


def label(key: str) -> str:
    """A metric's name in the report: "MSE", "F1 (micro)", "accuracy"."""
    bare = _bare(key)
    return _READ[bare][0] if bare in _READ else bare.replace("_", " ")


def shown(key: str, value) -> str:
    """A metric's value as the report shows it (n/a where it is undefined)."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return "n/a"
    return format(value, _READ.get(_bare(key), ("", ".4g"))[1])


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
