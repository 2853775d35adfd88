"""A task of one's own through the whole workflow, with no edit anywhere but the config: the
ordinal-regression task of tests/plugin_task/ordinal.py, copied into the working directory
and named `task: "ordinal:make"`, stages the digits (grade = digit // 2), trains and
evaluates at 2 CPU ranks, is reported with its own fields and table, exports as safetensors
only (its Task.exports), predicts (`snakemake predict`) with its own prediction form, and
gives a tracker its own metrics and file (ddpflow.tracking.record.collect, the track rule's
function, on the run's files: no tracker client is needed).
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from workflow_helpers import snakemake, write_config

pytestmark = pytest.mark.e2e

TASK_FILE = Path(__file__).parent / "plugin_task" / "ordinal.py"
RUN = "results/runs/default"
GRADES = 5


def _write_digits(workdir: Path) -> np.ndarray:
    """The 1,797 real 8x8 digits (scikit-learn's file, read by ddpflow) as an npz: grade =
    digit // 2 (0..4), 1,500 to train and validate, the rest the official test split; the
    first 24 test images again as predict's input."""
    from ddpflow.data.sources import load_source

    raw = load_source({"source": "digits"}, seed=0)
    x, y = np.asarray(raw.train_x), np.asarray(raw.train_y) // 2
    if raw.test_x is not None:
        x = np.concatenate([x, np.asarray(raw.test_x)])
        y = np.concatenate([y, np.asarray(raw.test_y) // 2])
    np.savez(workdir / "grades.npz", train_images=x[:1500], train_labels=y[:1500],
             test_images=x[1500:], test_labels=y[1500:])  # fmt: skip
    np.savez(workdir / "new.npz", images=x[1500:1524])
    return y[1500:]


CONFIG = {
    "task": "ordinal:make",
    "data": {"source": "npz", "path": "grades.npz"},
    "model": {"name": "mlp", "mlp_hidden": [64]},
    "train": {"epochs": 2, "progress": False, "global_batch_size": 64, "micro_batch_size": 32,
              "optimizer": {"lr": 0.05}},
    "machine": {"cpu_ranks_per_node": 2},
    "export": {"formats": ["safetensors", "torch_export"]},
    "predict": {"input": "new.npz"},
}  # fmt: skip


def test_a_plugin_task_stages_trains_evaluates_reports_predicts_exports_and_tracks(
    workdir, monkeypatch
):
    shutil.copy(TASK_FILE, workdir / "ordinal.py")
    truth = _write_digits(workdir)
    configfile = write_config(workdir / "config.yaml", CONFIG)
    done = snakemake(workdir, configfile)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]

    # staged by the task: its manifest record, its targets' layout
    staged = next((workdir / "results/staged").glob("npz-*"))
    manifest = json.loads((staged / "manifest.json").read_text())
    assert manifest["task"] == "ordinal" and manifest["num_classes"] == GRADES
    assert manifest["target_dtype"] == "int64" and manifest["target_shape"] == []
    assert sum(manifest["grade_counts"]["test"]) == len(truth)

    # evaluated at 2 ranks by its own exact sums
    ev = json.loads((workdir / RUN / "eval_metrics.json").read_text())
    assert ev["task"] == "ordinal" and ev["world_size"] == 2
    assert ev["samples_evaluated"] == ev["test_size"] == len(truth)
    assert ev["headline"] == ["mae", "accuracy", "within_one"]
    assert ev["selection"] == {"metric": "val_mae", "higher_is_better": False,
                               "label": "validation class error"}  # fmt: skip
    assert len(ev["per_grade_mae"]) == GRADES and 0.0 <= ev["mae"] < 1.0  # it learned
    epochs = [json.loads(line) for line in (workdir / RUN / "train_metrics.jsonl").open()]
    assert all("val_mae" in e and "val_accuracy" in e for e in epochs)

    # reported with its fields, its table and its summary key
    report = (workdir / "results/report/report.md").read_text()
    runs_table = report[report.index("## Runs") : report.index("## Machine and speed")]
    assert "MAE" in runs_table and "within one" in runs_table
    assert "## Per-grade test error" in report and "| Grade | Mean class error |" in report
    summary = json.loads((workdir / "results/report/summary.json").read_text())
    assert summary["runs"][0]["task"] == "ordinal"
    assert summary["per_grade_mae"]["default"]["grade 0"] == ev["per_grade_mae"][0]
    assert summary["selected_by"]["ordinal"]["metric"] == "val_mae"

    # exported as its Task.exports says: safetensors, and no traced export
    assert (workdir / RUN / "model.safetensors").is_file()
    assert not list((workdir / RUN).glob("model.pt2"))

    # predicted in its own form: a grade's name, its probability, the expected grade
    predicted = snakemake(workdir, configfile, "--cores", "2", "predict")
    assert predicted.returncode == 0, (predicted.stdout + predicted.stderr)[-4000:]
    with (workdir / RUN / "predictions.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 24
    names = [f"grade {g}" for g in range(GRADES)]
    assert all(r["prediction"] in names and 0.0 <= float(r["score"]) <= 1.0 for r in rows)
    errors = [abs(names.index(r["prediction"]) - int(t)) for r, t in zip(rows, truth, strict=False)]
    assert np.mean(errors) < 1.0 and all(0.0 <= float(r["expected_grade"]) <= 4.0 for r in rows)

    # a tracker's record: its metrics and its file, from the run's files
    monkeypatch.chdir(workdir)
    monkeypatch.setattr(sys, "path", [str(workdir), *sys.path])
    from ddpflow.tracking.record import collect

    kinds = (("train_metrics", "jsonl"), ("eval_metrics", "json"), ("train_summary", "json"))
    files = {key: workdir / RUN / f"{key}.{ext}" for key, ext in kinds}
    paths = SimpleNamespace(**files, model=workdir / RUN / "model.pt")
    record = collect({"name": "default", "dataset_id": "d"}, paths, workdir / "tracked")
    assert record.final["test_mae"] == ev["mae"] and record.final["grades"] == GRADES
    assert record.tags["task"] == "ordinal"
    kept = json.loads((workdir / "tracked/per_grade_mae.json").read_text())
    assert kept["grade 1"] == ev["per_grade_mae"][1]
    sys.modules.pop("ordinal", None)
