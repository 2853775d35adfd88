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

Nothing else in ddpflow knows which task runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:  # the login node resolves a task without importing torch
    import torch
    from torch import nn

    from ddpflow.config.typed import TrainSpec


@dataclass(frozen=True)
class Selection:
    """The validation metric that selects: the epoch record key, its direction, its label."""

    metric: str  # "val_accuracy", "val_mse", ...
    higher_is_better: bool
    label: str  # "validation accuracy"

    def record(self) -> dict:
        return {
            "metric": self.metric,
            "higher_is_better": self.higher_is_better,
            "label": self.label,
        }

    def key(self, value: float) -> float:
        """A sort key: smaller is better (sorted(..., key=selection.key) puts the best first)."""
        return -value if self.higher_is_better else value

    def worse_than(self, value: float, reference: float) -> bool:
        return value < reference if self.higher_is_better else value > reference


class Task:
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
            from ddpflow.task import TaskError

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

    def fingerprint(self) -> dict[str, Any]:
        """What of this task changes a trained model (the training fingerprint's task keys)."""
        return {}


def _number(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"
