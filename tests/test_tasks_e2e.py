"""A regression sweep and a multi-label run through the whole workflow at 2 ranks, as a user
runs it (snakemake, an npz of their own): the task's metrics in eval_metrics.json and in the
report; the sweep ranked by validation MSE, lowest first; the same metrics scored again at
1 rank; a multi-label task on single-label data refused before any rank starts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from workflow_helpers import snakemake, write_config

pytestmark = pytest.mark.e2e

HEADLINE = {
    "regression": ("mse", "mae", "r2"),
    "multilabel": ("exact_match", "f1_micro", "f1_macro"),
}
SHOWN = {"regression": ("MSE", "MAE", "R²"), "multilabel": ("exact match", "F1 (micro)")}


def _write_arrays(workdir) -> None:
    """8x8 images with random quadrants lit: which ones (4 labels, 5% flipped), and two float
    targets from their brightness (plus noise), with an official test split."""
    rng = np.random.default_rng(0)

    def images(n):
        lit = rng.random((n, 4)) < 0.5
        x = rng.integers(0, 100, (n, 8, 8))
        for q in range(4):
            r, c = divmod(q, 2)
            x[lit[:, q], 4 * r : 4 * r + 4, 4 * c : 4 * c + 4] += 120
        return x.astype(np.uint8), lit ^ (rng.random((n, 4)) < 0.05)

    (x, lit), (tx, tlit) = images(640), images(161)
    names = np.array(["top_left", "top_right", "bottom_left", "bottom_right"])
    np.savez(workdir / "tags.npz", train_images=x, train_labels=lit, test_images=tx,
             test_labels=tlit, class_names=names)  # fmt: skip

    def targets(x):
        mean = x.reshape(len(x), -1).mean(axis=1)
        y = np.stack([mean / 10.0, x[:, :4, :4].reshape(len(x), -1).mean(axis=1) / 20.0], 1)
        return (y + 0.2 * rng.standard_normal(y.shape)).astype(np.float32)

    np.savez(workdir / "reg.npz", train_images=x, train_labels=targets(x), test_images=tx,
             test_labels=targets(tx), class_names=np.array(["brightness", "top_left"]))  # fmt: skip


def _config(ranks: int) -> dict:
    return {
        "model": {"name": "mlp", "mlp_hidden": [64]},
        "train": {"epochs": 4, "global_batch_size": 32, "micro_batch_size": 16,
                  "optimizer": {"lr": 0.05}},
        "machine": {"cpu_ranks_per_node": ranks},
        # the regression runs are a sweep's two points (its base is the top level): lr 0.05
        # learns in 4 epochs, lr 0.0005 barely moves, so the sweep has a clear order
        "task": "regression",
        "data": {"source": "npz", "path": "reg.npz"},
        "sweep": {"grid": {"train.optimizer.lr": [0.0005, 0.05]}},
        "runs": [{"name": "tags", "task": "multilabel",
                  "data": {"source": "npz", "path": "tags.npz"}}],
    }  # fmt: skip


REG, SLOW = "lr-0.05", "lr-0.0005"  # the sweep's points


def test_a_regression_and_a_multilabel_run_train_evaluate_and_report(workdir):
    _write_arrays(workdir)
    done = snakemake(workdir, write_config(workdir / "config.yaml", _config(2)))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    scored = {}
    for run, task in ((REG, "regression"), (SLOW, "regression"), ("tags", "multilabel")):
        record = json.loads((workdir / f"results/runs/{run}/eval_metrics.json").read_text())
        assert record["task"] == task and record["world_size"] == 2
        assert record["samples_evaluated"] == record["test_size"] == 161
        assert all(isinstance(record[key], float) for key in HEADLINE[task])
        scored[run] = record
        summary = json.loads((workdir / f"results/runs/{run}/train_summary.json").read_text())
        assert summary["selection"] == record["selection"]
    assert scored[REG]["r2"] > 0.5 and scored[REG]["selection"]["metric"] == "val_mse"
    assert 0.6 < scored["tags"]["f1_micro"] < 1.0  # learned, and not trivially perfect
    positives = int(np.load(workdir / "tags.npz")["test_labels"].sum())
    tags = scored["tags"]
    assert sum(tags["true_positives"]) + sum(tags["false_negatives"]) == positives
    assert f"evaluate '{REG}' on the test split: mse " in output
    report = (workdir / "results/report/report.md").read_text()
    runs_table = report[report.index("## Runs") : report.index("## Machine and speed")]
    for task in ("regression", "multilabel"):
        for label in SHOWN[task]:
            assert label in runs_table, (task, label)
    assert "## Per-label test F1" in report and "| top\\_left | " in report
    assert (workdir / f"results/report/plots/predicted_vs_true_{REG}.png").is_file()

    # the sweep is ranked by the validation MSE each point kept (its last epoch's), lowest
    # first: read from the points' own epoch records, not from the report
    kept = {}
    for run in (REG, SLOW):
        epochs = (workdir / f"results/runs/{run}/train_metrics.jsonl").read_text().splitlines()
        kept[run] = json.loads(epochs[-1])["val_mse"]
    assert kept[REG] < kept[SLOW]
    sweep = json.loads((workdir / "results/report/summary.json").read_text())["sweep"]
    assert sweep["selected_by"] == "val_mse" and sweep["higher_is_better"] is False
    ranking = [(row["run"], row["rank"], row["val_mse"]) for row in sweep["ranking"]]
    assert ranking == [(REG, 1, kept[REG]), (SLOW, 2, kept[SLOW])]
    assert sweep["selected_run"] == REG
    assert "Ranked by validation MSE (lower is better)" in report

    # the same model scored again at 1 rank (eval_metrics.json deleted, one rank per node):
    # the counts equal, the float64 sums to rounding
    for run in (REG, "tags"):
        (workdir / f"results/runs/{run}/eval_metrics.json").unlink()
    again = snakemake(workdir, write_config(workdir / "config.yaml", _config(1)))
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert "localrule train" not in again.stdout + again.stderr  # nothing retrains
    for run in (REG, "tags"):
        one = json.loads((workdir / f"results/runs/{run}/eval_metrics.json").read_text())
        before = scored[run]
        assert one["world_size"] == 1 and one["samples_evaluated"] == 161
        counts = ("true_positives", "false_positives", "false_negatives", "exact_matches")
        for key in counts if run == "tags" else ():
            assert one[key] == before[key], key
        for key in (*HEADLINE[before["task"]], "loss"):
            assert one[key] == pytest.approx(before[key], rel=1e-6), (run, key)


def test_a_multilabel_task_on_single_labels_is_refused_before_any_rank_starts(workdir):
    rng = np.random.default_rng(0)
    np.savez(workdir / "single.npz", train_images=rng.integers(0, 255, (60, 8, 8), np.uint8),
             train_labels=np.arange(60) % 3)  # fmt: skip
    config = {"task": "multilabel", "data": {"source": "npz", "path": "single.npz"}}
    done = snakemake(workdir, write_config(workdir / "config.yaml", config))
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert (
        "task multilabel: data.path single.npz: train_labels holds one class per sample" in output
    )
    assert not (workdir / "logs/train").exists() and not (workdir / "results/staged").exists()
