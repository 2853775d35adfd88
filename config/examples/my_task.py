"""A worked example of your own task (docs/tasks.md): classification scored by top-k accuracy.

Copy this file into the directory you run snakemake from and name its function in
config.yaml, with your data as an npz or a data plug-in:

    cp config/examples/my_task.py .
    task: "my_task:top_k"
    task_kwargs: {k: 3}
    data: {source: npz, path: my_arrays.npz}

ddpflow calls top_k(**task_kwargs) when it stages the data, on every rank and when it
reports. The object returned implements the Task protocol (ddpflow.task.base); subclassing
Task gives the defaults (a seeded random split, the class count as the model's output size,
every export format, the report's generic view: docs/writing-a-task.md). The metric
state holds only sums: int64 counts and float64 sums, which ddpflow all-reduces over the
ranks, so the metrics are those of the whole split at any world size. Editing this file
restages and retrains the runs that use it.
"""

from __future__ import annotations

import numpy as np
from ddpflow.errors import DataError
from ddpflow.task.base import Selection, Task


class TopK(Task):
    name = "top_k"
    headline = ("accuracy", "top_k_accuracy")

    def __init__(self, k: int):
        self.k = k
        # the epoch record key that picks a sweep's best run and drives pruning
        self.selection = Selection("val_top_k_accuracy", True, f"validation top-{k} accuracy")

    # --- staging (login node): what a target is -------------------------------------------
    def stage_targets(self, labels, names, where):
        y = np.asarray(labels).reshape(len(labels), -1)
        if y.shape[1] != 1 or not np.issubdtype(y.dtype, np.integer) or (y < 0).any():
            raise DataError(f"task top_k: {where} must hold one class 0..K-1 per sample")
        y = y[:, 0].astype(np.int64)
        classes = int(y.max()) + 1
        if classes <= self.k:
            raise DataError(f"task top_k: k {self.k} needs more than {self.k} classes, "
                            f"{where} has {classes}")  # fmt: skip
        return y, names if names is not None else [str(c) for c in range(classes)]

    def strata(self, targets):
        return targets  # val and test stratified by class, as classification does

    # --- ranks: the model's loss, and the evaluation's sums ----------------------------
    def loss(self, manifest, train):
        from torch import nn

        return nn.CrossEntropyLoss()

    def new_state(self, manifest, device):
        import torch

        def count():
            return torch.zeros((), dtype=torch.int64, device=device)

        return {"samples": count(), "top1": count(), "topk": count(),
                "loss": torch.zeros((), dtype=torch.float64, device=device)}  # fmt: skip

    def update(self, state, outputs, targets):
        import torch.nn.functional as F

        ranked = outputs.topk(self.k, dim=1).indices
        state["top1"] += (ranked[:, 0] == targets).sum()
        state["topk"] += (ranked == targets[:, None]).any(dim=1).sum()
        state["samples"] += targets.shape[0]
        state["loss"] += F.cross_entropy(outputs.double(), targets, reduction="sum")

    def metrics(self, state, manifest):
        n = int(state["samples"])
        return {"accuracy": int(state["top1"]) / n if n else 0.0,
                "top_k_accuracy": int(state["topk"]) / n if n else 0.0,
                "k": self.k, "samples_evaluated": n,
                "loss": float(state["loss"]) / n if n else 0.0}  # fmt: skip

    def validation(self, metrics):
        return {"val_top_k_accuracy": metrics["top_k_accuracy"],
                "val_accuracy": metrics["accuracy"], "val_loss": metrics["loss"]}  # fmt: skip

    # --- snakemake predict (optional): what a prediction is, one dict per sample ---------
    def predictions(self, outputs, manifest):
        names = manifest["class_names"]
        best = outputs.float().softmax(dim=1).topk(self.k, dim=1)
        return [
            {"prediction": names[int(i[0])], "score": float(p[0]),
             "top_k": [names[int(c)] for c in i]}
            for p, i in zip(best.values, best.indices, strict=True)
        ]  # fmt: skip

    # --- the report (optional): its epoch keys, checked when the report reads them ------
    def epoch_fields(self):
        return {"val_top_k_accuracy": (int, float), "val_accuracy": (int, float)}


def top_k(k: int = 3) -> TopK:
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    return TopK(k)
