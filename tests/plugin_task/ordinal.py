"""A task of one's own, written in this one file (docs/writing-a-task.md): ordinal
regression. A target is one of K ordered classes (a rating, a grade, a stage); the model
gives K - 1 logits, logit k saying "the class is above k" (the cumulative link); the
predicted class is the number of those above one half. Its metrics are exact sums: the
int64 absolute class error and counts, so the mean absolute error (in classes, lower is
better: it selects) is the same at any world size.

    task: "ordinal:make"          # this file in the directory you run snakemake from
    task_kwargs: {}

It overrides the report's, the trackers' and the exports' hooks of the Task protocol: its
epoch and evaluation keys, a per-class error table, its summary.json key, its tracker
metrics and file, and safetensors as its only export. Imports no torch at module level
(the login node resolves the task while it reads the config and the report).
"""

from __future__ import annotations

import numpy as np
from ddpflow.errors import DataError, ReportInputError
from ddpflow.task.base import Selection, Task

NUM = (int, float)


class Ordinal(Task):
    name = "ordinal"
    selection = Selection("val_mae", False, "validation class error")
    headline = ("mae", "accuracy", "within_one")
    exports = ("safetensors",)  # its head is K - 1 logits: no traced export
    names_word = "grade"

    # --- staging (login node): a target is one class 0..K-1 of an order -----------------
    def stage_targets(self, labels, names, where):
        y = np.asarray(labels).reshape(len(labels), -1)
        if y.shape[1] != 1 or not np.issubdtype(y.dtype, np.integer) or (y < 0).any():
            raise DataError(f"task ordinal: {where} must hold one grade 0..K-1 per sample")
        y = y[:, 0].astype(np.int64)
        grades = int(y.max()) + 1
        if grades < 3:
            raise DataError(f"task ordinal: {where} has {grades} grades; it needs 3 or more")
        return y, list(names) if names is not None else [f"grade {g}" for g in range(grades)]

    def manifest_fields(self, targets, names):
        k = len(names)
        return {
            "grade_counts": {s: np.bincount(y, minlength=k).tolist() for s, y in targets.items()}
        }

    def outputs(self, manifest):
        return int(manifest["num_classes"]) - 1

    # --- ranks: the loss and the evaluation's sums --------------------------------------
    def loss(self, manifest, train):
        import torch.nn.functional as F
        from torch import nn

        class CumulativeBCE(nn.Module):
            def forward(self, outputs, targets):
                above = _above(targets, outputs.shape[1]).to(outputs.dtype)
                return F.binary_cross_entropy_with_logits(outputs, above)

        return CumulativeBCE()

    def new_state(self, manifest, device):
        import torch

        k = int(manifest["num_classes"])

        def counts(n=()):
            return torch.zeros(n, dtype=torch.int64, device=device)

        return {
            "samples": counts(),
            "exact": counts(),
            "within_one": counts(),
            "error": counts(),
            "class_error": counts(k),
            "class_samples": counts(k),
            "loss": torch.zeros((), dtype=torch.float64, device=device),
        }

    def update(self, state, outputs, targets):
        import torch.nn.functional as F

        logits = outputs.double()
        above = _above(targets, outputs.shape[1]).double()
        state["loss"] += F.binary_cross_entropy_with_logits(logits, above, reduction="sum")
        error = (_grade(outputs) - targets).abs()
        k = state["class_error"].numel()
        state["class_error"] += error.new_zeros(k).index_add_(0, targets, error)
        state["class_samples"] += targets.bincount(minlength=k)
        state["error"] += error.sum()
        state["exact"] += (error == 0).sum()
        state["within_one"] += (error <= 1).sum()
        state["samples"] += targets.shape[0]

    def metrics(self, state, manifest):
        n = int(state["samples"])
        per_class = [
            int(e) / int(c) if int(c) else None
            for e, c in zip(
                state["class_error"].tolist(), state["class_samples"].tolist(), strict=True
            )
        ]
        return {
            "mae": int(state["error"]) / n if n else 0.0,
            "accuracy": int(state["exact"]) / n if n else 0.0,
            "within_one": int(state["within_one"]) / n if n else 0.0,
            "per_grade_mae": per_class,
            "samples_evaluated": n,
            "loss": float(state["loss"]) / n if n else 0.0,
        }

    def validation(self, metrics):
        return {
            "val_mae": metrics["mae"],
            "val_accuracy": metrics["accuracy"],
            "val_loss": metrics["loss"],
        }

    # --- predict: a grade, its probability, the expected grade --------------------------
    def predictions(self, outputs, manifest):
        import torch

        names = manifest["class_names"]
        above = outputs.float().sigmoid()  # P(grade > k), k = 0..K-2
        ones, zeros = above.new_ones(len(above), 1), above.new_zeros(len(above), 1)
        cumulative = torch.cat([ones, above, zeros], dim=1)
        probs = (cumulative[:, :-1] - cumulative[:, 1:]).clamp(min=0)
        grades = _grade(outputs)
        return [
            {"prediction": names[int(g)], "score": float(p[int(g)]), "expected_grade": float(e)}
            for g, p, e in zip(grades, probs, above.sum(dim=1), strict=True)
        ]

    # --- the report and the trackers ----------------------------------------------------
    def epoch_fields(self):
        return {"val_mae": NUM, "val_accuracy": NUM}

    def record_fields(self):
        return {"mae": NUM, "within_one": NUM, "per_grade_mae": list}

    def check_record(self, data, n, where):
        if len(data["per_grade_mae"]) != n:
            raise ReportInputError(
                f"{where}: per_grade_mae has {len(data['per_grade_mae'])} entries for {n} grades"
            )
        super().check_record(data, n, where)

    def summary_record(self, ev):
        names = map(str, ev["class_names"])
        return {"per_grade_mae": dict(zip(names, ev["per_grade_mae"], strict=True))}

    def report_section(self, members, label, own_label, focus, note):
        blocks = [("h2", f"Per-grade {own_label} error"), *note]
        for name, _, ev in members:
            if focus is None or name in focus:
                body = [
                    [str(g), "n/a" if e is None else f"{e:.3f}"]
                    for g, e in zip(ev["class_names"], ev["per_grade_mae"], strict=True)
                ]
                blocks += [("h3", name), ("table", ["Grade", "Mean class error"], body, None)]
        return blocks

    def tracker_metrics(self, ev):
        return {**super().tracker_metrics(ev), "grades": float(len(ev["class_names"]))}

    def tracker_files(self, ev):
        return {
            "per_grade_mae.json": dict(zip(ev["class_names"], ev["per_grade_mae"], strict=True))
        }


def _above(targets, k: int):
    """The cumulative targets [n, k]: column j is 1 where the grade is above j."""
    import torch

    return (targets[:, None] > torch.arange(k, device=targets.device)).long()


def _grade(outputs):
    return (outputs.float().sigmoid() > 0.5).sum(dim=1)


def make() -> Ordinal:
    return Ordinal()
