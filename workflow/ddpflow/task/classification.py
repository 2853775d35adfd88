"""task: classification (the default): one integer class 0..K-1 per sample, cross-entropy,
accuracy, per-class accuracy and the confusion matrix from one int64 count matrix."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ddpflow.errors import DataError
from ddpflow.task.base import Selection, Task
from ddpflow.task.builtin_views import ClassificationView

if TYPE_CHECKING:
    from ddpflow.config.typed import TrainSpec


class Classification(ClassificationView, Task):
    name = "classification"
    selection = Selection("val_accuracy", True, "validation accuracy")
    headline = ("accuracy",)
    stages_targets = False  # the sources check and stage their class labels themselves
    named_in_records = False  # its records and manifests are those written before tasks

    def target_layout(self, manifest: dict, n: int) -> tuple[np.dtype, tuple[int, ...]]:
        return np.dtype(np.int64), (n,)

    def manifest_record(self, targets: dict, names: list[str]) -> dict:
        k = len(names)
        counts = {split: np.bincount(y, minlength=k).tolist() for split, y in targets.items()}
        return {"class_counts": counts}

    def prediction_options(self, settings: dict) -> dict:
        return {"top": settings["top_k"]}

    def stage_targets(self, labels: np.ndarray, names, where: str):
        labels = check_labels(one_class_per_sample(np.asarray(labels), where), where)
        top = int(labels.max()) if len(labels) else 0
        return labels, list(names) if names is not None else [str(k) for k in range(top + 1)]

    def strata(self, targets: np.ndarray) -> np.ndarray:
        return targets

    def loss(self, manifest: dict, train: TrainSpec):
        from torch import nn

        return nn.CrossEntropyLoss(label_smoothing=train.label_smoothing)

    def new_state(self, manifest: dict, device) -> dict:
        import torch

        k = int(manifest["num_classes"])
        return {
            "confusion": torch.zeros(k * k, dtype=torch.int64, device=device),
            "loss": torch.zeros((), dtype=torch.float64, device=device),
        }

    def update(self, state: dict, outputs, targets) -> None:
        import torch
        import torch.nn.functional as F

        k = int(state["confusion"].numel() ** 0.5)
        state["loss"] += F.cross_entropy(outputs.float(), targets, reduction="sum").double()
        state["confusion"] += torch.bincount(targets * k + outputs.argmax(dim=1), minlength=k * k)

    def metrics(self, state: dict, manifest: dict) -> dict:
        k = int(state["confusion"].numel() ** 0.5)
        confusion = state["confusion"].cpu().view(k, k)
        correct, total = int(confusion.diag().sum()), int(confusion.sum())
        per_class_total = confusion.sum(dim=1)
        per_class = [
            (int(c) / int(t)) if int(t) else None
            for c, t in zip(confusion.diag(), per_class_total, strict=True)
        ]
        return {
            "accuracy": correct / total if total else 0.0,
            "correct": correct,
            "samples_evaluated": total,
            "per_class_accuracy": per_class,
            "confusion_matrix": confusion.tolist(),
            "loss": float(state["loss"]) / total if total else 0.0,
        }

    def predictions(self, outputs, manifest: dict, top: int = 5) -> list[dict]:
        """The most probable class (softmax), its probability and the top classes."""
        names = manifest["class_names"]
        probs = outputs.float().softmax(dim=1)
        best = probs.topk(min(top, probs.shape[1]), dim=1)
        return [
            {
                "prediction": names[int(i[0])],
                "score": float(p[0]),
                "top_k": [(names[int(c)], float(q)) for c, q in zip(i, p, strict=True)],
            }
            for p, i in zip(best.values, best.indices, strict=True)
        ]

    def describe(self, metrics: dict) -> str:
        return (
            f"{metrics['correct']} of {metrics['samples_evaluated']} correct, accuracy "
            f"{metrics['accuracy']:.4f}"
        )

    def validation(self, metrics: dict) -> dict:
        return {"val_accuracy": metrics["accuracy"], "val_loss": metrics["loss"]}


def check_labels(labels: np.ndarray, where: str) -> np.ndarray:
    """Labels as int64, or a DataError naming `where` if they are not integers 0..K-1."""
    if not np.issubdtype(labels.dtype, np.integer) or (len(labels) and labels.min() < 0):
        raise DataError(
            f"{where}: labels must be integers 0..K-1 (got {labels.dtype}, "
            f"min {labels.min() if len(labels) else '-'})"
        )
    return labels.astype(np.int64)


# what a label must be: more than one value per sample is refused, never cut to one of them
ONE_CLASS = (
    "a label is one integer class 0..K-1 per sample under task: classification (for several "
    "labels per sample set task: multilabel; for float or vector targets task: regression)"
)


def one_class_per_sample(labels: np.ndarray, where: str) -> np.ndarray:
    """Labels [n] as they are, a column [n, 1] as [n] (Keras's layout); any other shape, e.g.
    [n, 3] (three values per sample), a DataError naming it."""
    if labels.ndim == 2 and labels.shape[1] == 1:
        return labels[:, 0]
    if labels.ndim == 1:
        return labels
    one_hot = (
        labels.ndim == 2
        and labels.size
        and np.isin(labels, (0, 1)).all()
        and (labels.sum(axis=1) == 1).all()
    )
    hint = "; they look one-hot: give labels.argmax(axis=1)" if one_hot else ""
    raise DataError(f"{where}: labels have shape {list(labels.shape)}; {ONE_CLASS}{hint}")
