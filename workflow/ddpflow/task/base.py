"""The Task protocol: what a task implements (the built-in ones and your own).

A task is an object with these attributes (subclass Task to inherit the defaults):

    name: str                  # shown in logs, the manifest and the report
    selection: Selection       # the epoch record key that selects, and its direction
    stage_targets(labels, names, where) -> (targets, names)
        # staging, on the login node: a source's labels array as the task stages it (checked:
        # a DataError naming `where` and the fix), and the names of its classes/labels/targets
    strata(targets) -> integer array [n] or None
        # what the val/test split is stratified by; None: a seeded random split
    manifest_fields(targets_by_split, names) -> dict
        # what the manifest records about the targets (counts, statistics)
    outputs(manifest) -> int   # the model's output size
    loss(manifest, train) -> callable(outputs, targets) -> scalar tensor (a mean)
        # train: the run's train section, typed (config.typed.TrainSpec:
        # train.label_smoothing; it reads as a dict too)
    new_state(manifest, device) -> dict[str, tensor]
        # the evaluation's metric state: int64 counts and float64 sums only (all-reduced
        # with SUM, so the totals are the same at any world size); a key starting with "_"
        # holds a constant for update (not summed)
    update(state, outputs, targets) -> None  # adds one batch's counts and sums
    metrics(state, manifest) -> dict
        # the final metrics from the summed state; holds "samples_evaluated" and "loss"
    validation(metrics) -> dict  # the epoch record's val_* keys (selection.metric among them)
    headline: tuple of metric keys   # the scalars logs, trackers and TensorBoard show
    predictions(outputs, manifest) -> [{"prediction": ..., "score": ...}, ...]
        # optional: the form of a prediction, one dict per sample (a class name and its
        # probability; a list of label names; a target's value)

What a task decides beyond training and evaluation has a default here (a user's task
overrides only what it needs; docs/tasks.md lists every hook):

    reads: "images" | "tokens"        # the data sources it learns from (tokens: text, tokens)
    stages_targets: bool              # True: stage_targets stages the sources' labels
    target_layout(manifest, n)        # the staged targets' dtype and shape
    manifest_record(targets, names)   # what the manifest says about the targets
    named_in_records: bool            # its records name it (False: classification's)
    exports: tuple | None             # the export.formats that apply (None: all)
    no_prediction: str | None         # why it cannot predict (None: predictions() says how)
    prediction_options(settings)      # predict settings its predictions() takes
    train_record(loop, generated)     # its own train_summary.json record
    throughput(summary)               # the training speed in the log
    and the report's and trackers' view of it (ddpflow.task.views.ReportView)

Nothing else in ddpflow knows which task runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ddpflow.errors import TaskError
from ddpflow.task.selection import Selection
from ddpflow.task.views import ReportView

if TYPE_CHECKING:  # the login node resolves a task without importing torch
    import torch
    from torch import nn

    from ddpflow.config.typed import TrainSpec


class Task(ReportView):
    """Defaults of the protocol; the built-in tasks subclass it."""

    REQUIRED: ClassVar[tuple[str, ...]] = (
        "name",
        "selection",
        "stage_targets",
        "outputs",
        "loss",
        "new_state",
        "update",
        "metrics",
        "validation",
    )
    name: str = "task"
    selection: Selection
    headline: tuple[str, ...] = ()  # the metrics' scalar keys, in the order logs show them
    reads: ClassVar[str] = "images"  # "tokens": data.source text or tokens
    stages_targets: ClassVar[bool] = True  # False: the sources' class labels, as they stage them
    named_in_records: ClassVar[bool] = True  # False: its records are those before tasks existed
    exports: ClassVar[tuple[str, ...] | None] = None  # the export.formats that apply; None: all
    no_prediction: ClassVar[str | None] = None  # why snakemake predict cannot run it

    if TYPE_CHECKING:
        # the protocol's methods without a default, declared for the type checker only: a
        # task lacking one still fails get_task's check of REQUIRED
        def stage_targets(
            self, labels: Any, names: Any, where: str
        ) -> tuple[np.ndarray, list[str]]: ...

        def loss(self, manifest: dict, train: TrainSpec) -> nn.Module: ...

        def new_state(self, manifest: dict, device: Any) -> dict[str, torch.Tensor]: ...

        def update(self, state: dict, outputs: torch.Tensor, targets: torch.Tensor) -> None: ...

        def metrics(self, state: dict, manifest: dict) -> dict: ...

        def validation(self, metrics: dict) -> dict: ...

    def describe(self, metrics: dict) -> str:
        """One line for the log: the headline metrics and the count scored."""
        shown = ", ".join(f"{key} {_number(metrics.get(key))}" for key in self.headline)
        return f"{shown} ({metrics['samples_evaluated']} samples)"

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> Task:
        if kwargs:
            raise TaskError(
                f"task {cls.name}: task_kwargs {sorted(kwargs)} are not its keys; it takes none"
            )
        return cls()

    def strata(self, targets: np.ndarray) -> np.ndarray | None:
        return None

    def manifest_fields(self, targets: dict[str, np.ndarray], names: list[str]) -> dict:
        return {}

    def predictions(self, outputs, manifest: dict) -> list[dict]:
        """One sample's prediction per row of outputs: {"prediction", "score", ...}."""
        raise NotImplementedError(f"task {self.name} does not say what a prediction is")

    def outputs(self, manifest: dict) -> int:
        return int(manifest["num_classes"])

    def target_layout(self, manifest: dict, n: int) -> tuple[np.dtype, tuple[int, ...]]:
        """The dtype and shape of a split's n staged targets: as the manifest records them
        (manifest_record writes target_dtype and target_shape)."""
        return np.dtype(manifest["target_dtype"]), (n, *manifest["target_shape"])

    def manifest_record(self, targets: dict[str, np.ndarray], names: list[str]) -> dict:
        """The manifest's record of the staged targets: the task, its manifest_fields and how
        the targets are stored where the task does not say it (target_layout reads it)."""
        record = {"task": self.name, **self.manifest_fields(targets, names)}
        if type(self).target_layout is Task.target_layout:
            sample = targets["train"]
            record.update(target_dtype=str(sample.dtype), target_shape=list(sample.shape[1:]))
        return record

    def can_predict(self) -> bool:
        """Whether snakemake predict can run it: it says what a prediction is."""
        method = getattr(type(self), "predictions", None)
        return self.no_prediction is None and callable(method) and method is not Task.predictions

    def prediction_options(self, settings: dict) -> dict:
        """The keyword arguments predictions() takes from the predict section (settings)."""
        return {}

    def train_record(self, loop: Any, generated: Any) -> dict:
        """Its own keys of train_summary.json, from the finished loop (rank 0)."""
        return {}

    def throughput(self, summary: dict) -> str:
        """The training speed as the log says it, from train_summary.json."""
        return f"{summary['samples_per_s']:.0f} samples/s"

    def fingerprint(self) -> dict[str, Any]:
        """What of this task changes a trained model (the training fingerprint's task keys)."""
        return {}


def _number(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"
