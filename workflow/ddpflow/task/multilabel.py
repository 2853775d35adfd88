"""task: multilabel: each sample carries any number of K labels, a 0/1 vector [K] (the npz's
train_labels/test_labels [n, K] of 0/1, uint8 or bool; a plug-in's vectors). Loss: binary
cross-entropy with logits; a label is predicted where sigmoid(output) >= task_kwargs.threshold.
Metrics from int64 counts per label (true positives, false positives, false negatives) and of
samples whose every label is right, summed over the ranks:

    exact_match = samples with all K labels right / samples
    f1_micro    = 2 TP / (2 TP + FP + FN), the counts summed over the labels
    f1_macro    = the mean of the labels' F1 over the labels where it is defined (a label
                  never present and never predicted has none; per_label_f1 says null)

The validation f1_micro selects (higher is better)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ddpflow.errors import DataError, TaskError
from ddpflow.task.base import Selection, Task
from ddpflow.task.builtin_views import MultilabelView

if TYPE_CHECKING:
    from ddpflow.config.typed import TrainSpec

THRESHOLD = 0.5


class Multilabel(MultilabelView, Task):
    name = "multilabel"
    selection = Selection("val_f1_micro", True, "validation F1 (micro)")
    headline = ("exact_match", "f1_micro", "f1_macro")

    def target_layout(self, manifest: dict, n: int) -> tuple[np.dtype, tuple[int, ...]]:
        return np.dtype(np.uint8), (n, manifest["num_classes"])

    def __init__(self, threshold: float = THRESHOLD):
        self.threshold = threshold

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> Multilabel:
        unknown = sorted(set(kwargs) - {"threshold"})
        if unknown:
            raise TaskError(f"task_kwargs {unknown}: task multilabel takes threshold only")
        threshold = kwargs.get("threshold", THRESHOLD)
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, (int, float))
            or not (0.0 < threshold < 1.0)
        ):
            raise TaskError(
                f"task_kwargs.threshold {threshold!r}: a probability strictly "
                "between 0 and 1 (0.5 by default)"
            )
        return cls(float(threshold))

    def fingerprint(self) -> dict:
        # the threshold changes no trained weight, only which labels count as predicted:
        # it is the evaluation's (ddpflow.config.evaluation_fingerprint), not training's
        return {}

    def stage_targets(self, labels, names, where: str):
        y = np.asarray(labels)
        if y.ndim != 2:
            what = "one class per sample" if y.ndim == 1 else f"shape {list(y.shape)}"
            raise DataError(
                f"task multilabel: {where} holds {what}; it needs a 0/1 vector per sample "
                f"[n, K] (K labels; uint8 or bool); for one class per sample use "
                "task: classification"
            )
        if y.dtype != np.bool_ and not np.issubdtype(y.dtype, np.integer):
            raise DataError(
                f"task multilabel: {where} has dtype {y.dtype}; give 0/1 as uint8 "
                "or bool (y.astype('uint8'))"
            )
        if y.size and not np.isin(y, (0, 1)).all():
            bad = np.argwhere(~np.isin(y, (0, 1)))[0]
            raise DataError(
                f"task multilabel: {where} holds {y[tuple(bad)]} at sample "
                f"{bad[0]}, label {bad[1]}; every entry is 0 or 1"
            )
        k = y.shape[1]
        if names is not None and len(names) != k:
            raise DataError(
                f"task multilabel: {where} has {k} labels per sample but "
                f"{len(names)} class_names; give one name per label"
            )
        return y.astype(np.uint8), list(names) if names is not None else [str(i) for i in range(k)]

    def manifest_fields(self, targets: dict, names: list[str]) -> dict:
        return {
            "label_counts": {
                split: y.sum(axis=0, dtype=np.int64).tolist() if len(y) else [0] * len(names)
                for split, y in targets.items()
            }
        }

    def loss(self, manifest: dict, train: TrainSpec):
        from torch import nn

        class MultilabelBCE(nn.BCEWithLogitsLoss):
            def forward(self, outputs, targets):
                return super().forward(outputs, targets.to(outputs.dtype))

        return MultilabelBCE()

    def predictions(self, outputs, manifest: dict) -> list[dict]:
        """The labels predicted at the threshold, and the least certain decision's
        probability of being right (max(p, 1 - p) over the labels)."""
        names = manifest["class_names"]
        probs = outputs.float().sigmoid()
        sure = _least_certain(probs)
        return [
            {
                "prediction": [n for n, p in zip(names, row, strict=True) if p >= self.threshold],
                "score": float(s),
                "probabilities": [float(p) for p in row],
            }
            for row, s in zip(probs, sure, strict=True)
        ]

    def new_state(self, manifest: dict, device) -> dict:
        import torch

        k = int(manifest["num_classes"])
        counts = {
            key: torch.zeros(k, dtype=torch.int64, device=device) for key in ("tp", "fp", "fn")
        }
        scalars = {
            key: torch.zeros((), dtype=torch.int64, device=device) for key in ("samples", "exact")
        }
        return {**counts, **scalars, "loss": torch.zeros((), dtype=torch.float64, device=device)}

    def update(self, state: dict, outputs, targets) -> None:
        import torch.nn.functional as F

        logits = outputs.float()
        truth = targets.bool()
        predicted = logits.sigmoid() >= self.threshold
        # in float64: a float32 sum would depend on how the shards cut the batches
        state["loss"] += F.binary_cross_entropy_with_logits(
            logits.double(), truth.double(), reduction="sum"
        )
        state["tp"] += (predicted & truth).sum(dim=0)
        state["fp"] += (predicted & ~truth).sum(dim=0)
        state["fn"] += (~predicted & truth).sum(dim=0)
        state["exact"] += (predicted == truth).all(dim=1).sum()
        state["samples"] += truth.shape[0]

    def metrics(self, state: dict, manifest: dict) -> dict:
        tp, fp, fn = (state[key].cpu().tolist() for key in ("tp", "fp", "fn"))
        n, k = int(state["samples"]), len(tp)
        per_label = [_f1(t, p, f) for t, p, f in zip(tp, fp, fn, strict=True)]
        defined = [f for f in per_label if f is not None]
        micro = _f1(sum(tp), sum(fp), sum(fn))
        return {
            "exact_match": int(state["exact"]) / n if n else 0.0,
            "f1_micro": micro if micro is not None else 0.0,
            "f1_macro": sum(defined) / len(defined) if defined else 0.0,
            "per_label_f1": per_label,
            "true_positives": tp,
            "false_positives": fp,
            "false_negatives": fn,
            "exact_matches": int(state["exact"]),
            "samples_evaluated": n,
            "threshold": self.threshold,
            "loss": float(state["loss"]) / (n * k) if n and k else 0.0,
        }

    def validation(self, metrics: dict) -> dict:
        return {
            "val_f1_micro": metrics["f1_micro"],
            "val_f1_macro": metrics["f1_macro"],
            "val_exact_match": metrics["exact_match"],
            "val_loss": metrics["loss"],
        }


def _f1(tp: int, fp: int, fn: int) -> float | None:
    denominator = 2 * tp + fp + fn
    return 2 * tp / denominator if denominator else None


def _least_certain(probs):
    """Per sample, the least certain label decision: min over labels of max(p, 1 - p)."""
    return probs.where(probs >= 0.5, 1 - probs).min(dim=1).values
