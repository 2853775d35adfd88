"""The report's and the trackers' view of a task: the defaults of the Task protocol's report
hooks (ddpflow.task.base.Task inherits them; a task overrides what it adds). They read a
run's eval_metrics.json record (`ev`) and return plain data: the record's keys and types to
check, the summary's fields, the report's blocks (render.py's format-neutral tuples:
("h2", text), ("h3", text), ("p", text), ("table", headers, body, None)) and plots as
PlotSpec (ddpflow.report.plots draws them). Pure: no torch, no matplotlib, no report import.

    task.epoch_fields(); task.record_fields(); task.check_record(ev, n, where)
    task.summary_fields(ev); task.summary_record(ev); task.report_section(...)
    task.evaluation_plots(name, ev); task.tracker_metrics(ev); task.tracker_files(ev)
    label("val_mse"); shown("mse", 0.0123)       # "MSE"; "0.0123"
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from ddpflow.errors import ReportInputError

if TYPE_CHECKING:
    from ddpflow.task.selection import Selection

log = logging.getLogger("ddpflow.report.inputs")

NUM = (int, float)
OPTIONAL = (int, float, type(None))  # a metric a task may leave undefined (r2 of a constant)

# a metric key -> (its name in the report, its format); any other key reads as itself, .4g
READ = {
    "accuracy": ("accuracy", ".2%"),
    "exact_match": ("exact match", ".2%"),
    "f1_micro": ("F1 (micro)", ".4f"),
    "f1_macro": ("F1 (macro)", ".4f"),
    "mse": ("MSE", ".4g"),
    "mae": ("MAE", ".4g"),
    "r2": ("R²", ".4f"),
    "perplexity": ("perplexity", ".4f"),
    "bits_per_byte": ("bits per byte", ".4f"),
    "token_accuracy": ("token accuracy", ".2%"),
}


class PlotSpec(NamedTuple):
    """A plot of a run's evaluation: the report's file is f"{slug}_{run}.png", a tracker's
    f"{kind}.png"; ddpflow.report.plots.DRAWERS[kind](*args) draws it."""

    slug: str
    kind: str  # "confusion_matrix", "predicted_vs_true"
    caption: str
    args: tuple


def _bare(key: str) -> str:
    return key.removeprefix("val_").removeprefix("test_").removeprefix("final_val_")


def label(key: str) -> str:
    """A metric's name in the report: "MSE", "F1 (micro)", "accuracy"."""
    bare = _bare(key)
    return READ[bare][0] if bare in READ else bare.replace("_", " ")


def shown(key: str, value) -> str:
    """A metric's value as the report shows it (n/a where it is undefined)."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return "n/a"
    return format(value, READ.get(_bare(key), ("", ".4g"))[1])


def overall(ev: dict, keys) -> str:
    """The run's metrics in words: "MSE 0.0123, MAE 0.0871, R² 0.9512"."""
    return ", ".join(f"{label(k)} {shown(k, ev.get(k))}" for k in keys)


def numbers(values: list, n: int, what: str, where: str, kinds=OPTIONAL) -> None:
    """n values, each of kinds (never a bool), or a ReportInputError naming `what`."""
    if len(values) != n:
        raise ReportInputError(f"{where}: {what} has {len(values)} entries for {n} names")
    if any(isinstance(v, bool) or not isinstance(v, kinds) for v in values):
        kind = "count" if kinds is int else "number"
        raise ReportInputError(f"{where}: {what} holds a value that is not a {kind}")


class ReportView:
    """The report hooks' defaults: a task's headline metrics and its selection metric, no
    tables, plots or summary keys of its own."""

    name: str
    headline: tuple[str, ...]
    selection: Selection
    named_in_records: ClassVar[bool]
    names_word: ClassVar[str | None] = "class"  # what class_names name; None: they are empty
    train_record_key: ClassVar[str | None] = None  # its train_summary.json record (train_record)
    summary_keys: ClassVar[tuple[str, ...]] = ()  # summary.json's keys of summary_record

    def record_headline(self, ev: dict) -> list[str]:
        """The record's headline metric keys (the task's where the record names none)."""
        return [str(key) for key in ev.get("headline") or self.headline]

    def epoch_fields(self) -> dict:
        """The keys and types of its epoch records beyond train_loss and val_loss."""
        return {self.selection.metric: NUM}

    def record_fields(self) -> dict:
        """The keys and types of its evaluation record beyond those every record has."""
        return {}

    def check_record(self, data: dict, n: int, where: str) -> None:
        """What the report checks in an evaluation record beyond its keys and types (n: the
        number of class_names); a ReportInputError names what is wrong."""
        if data["samples_evaluated"] != data["test_size"]:
            evaluated, size = data["samples_evaluated"], data["test_size"]
            log.warning("%s: %d samples evaluated, test size %d", where, evaluated, size)

    def summary_fields(self, ev: dict) -> dict:
        """Its own columns of the run's summary row."""
        return {}

    def data_read(self, train: dict) -> str | None:
        """How its ranks read the data, where that is fixed (None: as the record says)."""
        return None

    def summary_record(self, ev: dict) -> dict[str, Any]:
        """summary.json's per-run keys of the task: {key: this run's value}."""
        return {}

    def compared_by(self, ev: dict) -> Any:
        """What else a run must share to be compared with another (a vocabulary)."""
        return None

    def report_section(self, members: list, label: str, own_label: str, focus, note) -> list:
        """Its tables for its runs (members: (name, epochs, ev)); label: the report's split
        words, own_label: those of its own runs; note: the focus note's blocks."""
        return []

    def evaluation_plots(self, name: str, ev: dict) -> list[PlotSpec]:
        """The figures of a run's evaluation."""
        return []

    def tracker_metrics(self, ev: dict) -> dict[str, float]:
        """The evaluation's figures as a tracker's step-0 metrics, named by the split (the
        headline metrics; one that is undefined is left out)."""
        split = ev.get("split", "test")
        return {
            f"{split}_{key}": float(ev[key])
            for key in self.record_headline(ev)
            if isinstance(ev.get(key), int | float) and not isinstance(ev.get(key), bool)
        }

    def tracker_files(self, ev: dict) -> dict[str, Any]:
        """JSON files a tracker keeps with the run: {file name: content}."""
        return {}
