"""task: regression: a float target per sample, [n] or K targets [n, K] (an npz's float
train_labels/test_labels; a plug-in's values or vectors). The model learns the targets
standardised with the train split's mean and std (both in the manifest); the metrics undo it.
Loss: mean squared error, or Huber with task_kwargs.loss: huber (task_kwargs.huber_delta, in
standard deviations). Metrics from float64 sums (and the int64 sample count) summed over the
ranks, averaged over the K targets as scikit-learn's uniform_average does:

    mse = sum (pred - y)^2 / n      mae = sum |pred - y| / n
    r2  = 1 - sum (pred - y)^2 / sum (y - mean_eval)^2   (mean_eval: the scored split's mean)

The sums of y are taken around the train mean (exact shift), so r2 keeps its digits for
targets far from 0. The validation mse selects (lower is better). A histogram of (true,
predicted) over a fixed grid (int64 counts, the same at any world size) is the report's
predicted-vs-true plot."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ddpflow.errors import DataError, TaskError
from ddpflow.task.base import Selection, Task
from ddpflow.task.builtin_views import RegressionView

if TYPE_CHECKING:
    from ddpflow.config.typed import TrainSpec

LOSSES = ("mse", "huber")
BINS = 40  # the predicted-vs-true histogram's bins per axis
SPAN = 4.0  # its grid: the train mean +- SPAN train standard deviations
PLOTTED = 4  # targets with a histogram (the first ones)


class Regression(RegressionView, Task):
    name = "regression"
    selection = Selection("val_mse", False, "validation MSE")
    headline = ("mse", "mae", "r2")

    def target_layout(self, manifest: dict, n: int) -> tuple[np.dtype, tuple[int, ...]]:
        return np.dtype(np.float32), (n, manifest["num_classes"])

    def __init__(self, loss: str = "mse", huber_delta: float = 1.0):
        self.loss_name, self.huber_delta = loss, huber_delta

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> Regression:
        unknown = sorted(set(kwargs) - {"loss", "huber_delta"})
        if unknown:
            raise TaskError(f"task_kwargs {unknown}: task regression takes loss and huber_delta")
        loss = kwargs.get("loss", "mse")
        if loss not in LOSSES:
            raise TaskError(f"task_kwargs.loss {loss!r}: one of {', '.join(LOSSES)}")
        delta = kwargs.get("huber_delta", 1.0)
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or delta <= 0:
            raise TaskError(
                f"task_kwargs.huber_delta {delta!r}: a positive number (in the "
                "targets' standard deviations; 1.0 by default)"
            )
        return cls(loss, float(delta))

    def fingerprint(self) -> dict:
        if self.loss_name == "mse":
            return {}
        return {"loss": self.loss_name, "huber_delta": self.huber_delta}

    def stage_targets(self, labels, names, where: str):
        y = np.asarray(labels)
        if (
            y.ndim not in (1, 2)
            or y.dtype == np.bool_
            or not (np.issubdtype(y.dtype, np.floating) or np.issubdtype(y.dtype, np.integer))
        ):
            raise DataError(
                f"task regression: {where} is {y.dtype} of shape {list(y.shape)}; "
                "it needs numbers, one per sample [n] or K per sample [n, K]"
            )
        y = y.reshape(len(y), -1).astype(np.float32)
        bad = ~np.isfinite(y)
        if bad.any():
            first = np.argwhere(bad)[0]
            raise DataError(
                f"task regression: {where} holds {int(bad.sum())} NaN or infinite "
                f"values (the first at sample {first[0]}); drop those samples"
            )
        k = y.shape[1]
        if names is not None and len(names) != k:
            raise DataError(
                f"task regression: {where} has {k} targets per sample but "
                f"{len(names)} class_names; give one name per target"
            )
        default = ["target"] if k == 1 else [f"target_{i}" for i in range(k)]
        return y, list(names) if names is not None else default

    def manifest_fields(self, targets: dict, names: list[str]) -> dict:
        train = targets["train"].astype(np.float64)
        mean = train.mean(axis=0)
        std = train.std(axis=0)
        return {
            "target_mean": mean.tolist(),
            # a constant target: standardised by 1 (its loss is then plain MSE)
            "target_std": np.where(std > 0, std, 1.0).tolist(),
            "target_stats": {
                split: {
                    "min": y.min(axis=0).tolist() if len(y) else None,
                    "max": y.max(axis=0).tolist() if len(y) else None,
                }
                for split, y in targets.items()
            },
        }

    def loss(self, manifest: dict, train: TrainSpec):
        return StandardisedLoss(manifest, self.loss_name, self.huber_delta)

    def predictions(self, outputs, manifest: dict) -> list[dict]:
        """The predicted targets in their own units (one value, or one per target)."""
        import torch

        mean = torch.tensor(manifest["target_mean"], dtype=torch.float64)
        std = torch.tensor(manifest["target_std"], dtype=torch.float64)
        values = outputs.double().cpu() * std + mean
        one = values.shape[1] == 1
        return [{"prediction": float(v[0]) if one else v.tolist(), "score": None} for v in values]

    def new_state(self, manifest: dict, device) -> dict:
        import torch

        k = int(manifest["num_classes"])
        sums = {
            key: torch.zeros(k, dtype=torch.float64, device=device)
            for key in ("sq_err", "abs_err", "y", "y2")
        }
        plotted = min(k, PLOTTED)
        return {
            **sums,
            "samples": torch.zeros((), dtype=torch.int64, device=device),
            "loss": torch.zeros((), dtype=torch.float64, device=device),
            "hist": torch.zeros(plotted * BINS * BINS, dtype=torch.int64, device=device),
            # constants (their keys start with _: not summed over the ranks), made once
            "_mean": torch.tensor(manifest["target_mean"], dtype=torch.float64, device=device),
            "_std": torch.tensor(manifest["target_std"], dtype=torch.float64, device=device),
        }

    def update(self, state: dict, outputs, targets) -> None:
        import torch

        mean, std = state["_mean"], state["_std"]
        standard = outputs.double()
        predicted = standard * std + mean
        truth = targets.double().reshape(predicted.shape)
        error = predicted - truth
        state["sq_err"] += (error * error).sum(dim=0)
        state["abs_err"] += error.abs().sum(dim=0)
        centred = truth - mean  # the sums around the train mean: exact shift, more digits
        state["y"] += centred.sum(dim=0)
        state["y2"] += (centred * centred).sum(dim=0)
        state["samples"] += truth.shape[0]
        state["loss"] += _loss(
            self.loss_name, self.huber_delta, standard, (truth - mean) / std, "sum"
        )
        plotted = state["hist"].numel() // (BINS * BINS)
        for j in range(plotted):
            cells = _bin(truth[:, j], mean[j], std[j]) * BINS + _bin(
                predicted[:, j], mean[j], std[j]
            )
            state["hist"][j * BINS * BINS : (j + 1) * BINS * BINS] += torch.bincount(
                cells, minlength=BINS * BINS
            )

    def metrics(self, state: dict, manifest: dict) -> dict:
        n = int(state["samples"])
        sq, ab, y, y2 = (state[key].cpu().double() for key in ("sq_err", "abs_err", "y", "y2"))
        k = sq.numel()
        per_mse = (sq / n).tolist() if n else [0.0] * k
        per_mae = (ab / n).tolist() if n else [0.0] * k
        total = (y2 - y * y / n) if n else y2
        per_r2 = [
            1.0 - float(s) / float(t) if float(t) > 0 else None
            for s, t in zip(sq, total, strict=True)
        ]
        defined = [r for r in per_r2 if r is not None]
        mean, std = manifest["target_mean"], manifest["target_std"]
        edges = [[m - SPAN * s, m + SPAN * s] for m, s in zip(mean, std, strict=True)]
        plotted = state["hist"].numel() // (BINS * BINS)
        hist = state["hist"].cpu().view(max(plotted, 1), BINS, BINS).tolist() if plotted else []
        return {
            "mse": sum(per_mse) / k if k else 0.0,
            "mae": sum(per_mae) / k if k else 0.0,
            "r2": sum(defined) / len(defined) if defined else None,
            "per_target": {"mse": per_mse, "mae": per_mae, "r2": per_r2},
            "samples_evaluated": n,
            "loss": float(state["loss"]) / (n * k) if n and k else 0.0,
            "loss_name": self.loss_name,
            "predicted_vs_true": {"bins": BINS, "range": edges[:plotted], "counts": hist},
        }

    def validation(self, metrics: dict) -> dict:
        return {
            "val_mse": metrics["mse"],
            "val_mae": metrics["mae"],
            "val_r2": metrics["r2"],
            "val_loss": metrics["loss"],
        }


def _bin(values, mean, std):
    import torch

    low, width = mean - SPAN * std, 2 * SPAN * std / BINS
    return torch.clamp(((values - low) / width).floor().long(), 0, BINS - 1)


def _loss(name: str, delta: float, standard, target, reduction: str = "mean"):
    """The regression loss on standardised values: training's mean, evaluation's sum."""
    import torch.nn.functional as F

    if name == "huber":
        return F.huber_loss(standard, target, reduction=reduction, delta=delta)
    return F.mse_loss(standard, target, reduction=reduction)


def StandardisedLoss(manifest: dict, loss_name: str, huber_delta: float):
    """The training loss on standardised targets: (y - train mean) / train std."""
    import torch
    from torch import nn

    class _Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mean", torch.tensor(manifest["target_mean"]), persistent=False)
            self.register_buffer("std", torch.tensor(manifest["target_std"]), persistent=False)

        def forward(self, outputs, targets):
            target = ((targets.reshape(outputs.shape) - self.mean) / self.std).to(outputs.dtype)
            return _loss(loss_name, huber_delta, outputs, target)

    return _Loss()
