"""The report of runs of every task (ddpflow.task): a multilabel run's exact match and F1 with
its per-label table, a regression run's MSE, MAE and R² with its per-target table and
predicted-vs-true plot, next to a classification run in the same report. Each task's best
run is chosen by its own selection metric in its direction (a lower MSE wins), and a sweep
of regression runs ranks the lowest validation MSE first. Real files in results/runs/<run>/
in the formats the jobs write (training.summaries), built in tmp_path: no training."""

from __future__ import annotations

import csv
import json
import re

import matplotlib.image
import pytest
from ddpflow import pipeline
from ddpflow.report import plots
from ddpflow.report.build import build_report
from test_report import PNG_SIGNATURE, _epoch, _eval
from test_report_sweep import _block, _csv

LABELS = ["sky", "tree", "<car>"]
TARGETS = ["price", "rooms"]
BINS = 40
SPANS = [[0.0, 10.0], [1.0, 5.0]]


def _selection(metric: str, higher: bool, label: str) -> dict:
    return {"metric": metric, "higher_is_better": higher, "label": label}


def _task_eval(name: str, rate: float) -> dict:
    """A run's evaluation record less classification's keys (what every task writes)."""
    ev = _eval(name, 2, 1, rate, 1)
    for key in ("accuracy", "per_class_accuracy", "confusion_matrix"):
        del ev[key]
    return ev


def multilabel_eval(name: str, rate: float = 900.0) -> dict:
    """Three labels: sky (F1 80/88), tree (50/67), <car> never present nor predicted (F1 null)."""
    tp, fp, fn = [40, 25, 0], [5, 10, 0], [3, 7, 0]
    return {
        **_task_eval(name, rate),
        "task": "multilabel",
        "selection": _selection("val_f1_micro", True, "validation F1 (micro)"),
        "headline": ["exact_match", "f1_micro", "f1_macro"],
        "class_names": LABELS,
        "exact_match": 0.62,
        "f1_micro": 130 / 155,
        "f1_macro": (80 / 88 + 50 / 67) / 2,
        "per_label_f1": [80 / 88, 50 / 67, None],
        "true_positives": tp,
        "false_positives": fp,
        "false_negatives": fn,
        "exact_matches": 62,
        "threshold": 0.5,
        "loss": 0.21,
    }


def _histogram(spread: int) -> list[list[int]]:
    """A 40x40 count matrix of 100 samples near the diagonal (rows: true bin)."""
    grid = [[0] * BINS for _ in range(BINS)]
    for sample in range(100):
        true = 5 + (sample * 7) % 30
        grid[true][min(BINS - 1, true + sample % (spread + 1))] += 1
    return grid


def regression_eval(name: str, mse: float, rate: float = 900.0, r2: float | None = 0.9) -> dict:
    """Two targets; mse the mean of the targets' (price's twice rooms')."""
    return {
        **_task_eval(name, rate),
        "task": "regression",
        "selection": _selection("val_mse", False, "validation MSE"),
        "headline": ["mse", "mae", "r2"],
        "class_names": TARGETS,
        "mse": mse,
        "mae": mse / 2,
        "r2": r2,
        "per_target": {
            "mse": [mse * 4 / 3, mse * 2 / 3],
            "mae": [mse * 2 / 3, mse / 3],
            "r2": [r2, None],  # rooms is constant in the split: no R²
        },
        "loss": mse / 4,
        "loss_name": "mse",
        "predicted_vs_true": {
            "bins": BINS,
            "range": SPANS,
            "counts": [_histogram(2 if mse < 0.3 else 6), _histogram(1)],
        },
    }


def _epochs(name: str, ev: dict, rate: float) -> list[dict]:
    """Four epochs with the task's val_* keys in place of val_accuracy."""
    records = []
    for e in range(4):
        record = _epoch(name, 1, e, 2.0 - 0.4 * e, rate)
        worse = 1 + (3 - e) * 0.5  # the last epoch's figures are the evaluation's
        if ev.get("task") == "multilabel":
            del record["val_accuracy"]
            record.update(
                val_f1_micro=ev["f1_micro"] / worse,
                val_f1_macro=ev["f1_macro"] / worse,
                val_exact_match=ev["exact_match"] / worse,
            )
        elif ev.get("task") == "regression":
            del record["val_accuracy"]
            record.update(
                val_mse=ev["mse"] * worse,
                val_mae=ev["mae"] * worse,
                val_r2=None if e == 0 else 1 - worse / 10,  # undefined in the first epoch
            )
        records.append(record)
    return records


def write_run(results, name: str, ev: dict, rate: float = 900.0, epochs=None) -> dict:
    """results/runs/<name>/ with train_metrics.jsonl, eval_metrics.json, train_summary.json."""
    folder = results / "runs" / name
    folder.mkdir(parents=True)
    epochs = epochs or _epochs(name, ev, rate)
    (folder / "train_metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in epochs))
    (folder / "eval_metrics.json").write_text(json.dumps(ev))
    summary = dict(ev["train"])
    summary.update({k: ev[k] for k in ("task", "selection", "headline") if k in ev})
    (folder / "train_summary.json").write_text(json.dumps(summary))
    return {
        "name": name,
        "train_metrics": folder / "train_metrics.jsonl",
        "eval_metrics": folder / "eval_metrics.json",
    }


def classification_eval(name: str, rate: float = 1000.0) -> dict:
    return _eval(name, 1, 1, rate, 1)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A classification run, a multilabel run and two regression runs: reg-a is faster and
    listed first, reg-b has the lower MSE (and wins)."""
    results = tmp_path_factory.mktemp("mixed") / "results"
    runs = {
        "cls": classification_eval("cls"),
        "ml": multilabel_eval("ml"),
        "reg-a": regression_eval("reg-a", 0.50, rate=5000.0, r2=0.70),
        "reg-b": regression_eval("reg-b", 0.20, rate=800.0, r2=0.88),
    }
    for name, ev in runs.items():
        write_run(results, name, ev, rate=ev["train"]["samples_per_s"])
    paths = pipeline.build_report(str(results), list(runs), [None] * len(runs))
    return runs, paths, results / "report"


def test_every_task_is_reported_none_unfinished(mixed):
    runs, paths, out = mixed
    summary = json.loads(paths["summary_json"].read_text())
    assert summary["unfinished"] == []
    assert [row["run"] for row in summary["runs"]] == list(runs)
    rows = {row["run"]: row for row in summary["runs"]}
    assert rows["cls"]["task"] == "classification" and rows["cls"]["accuracy"] == 0.91
    for key in ("exact_match", "f1_micro", "f1_macro"):
        assert rows["ml"][key] == runs["ml"][key]
    for key in ("mse", "mae", "r2"):
        assert rows["reg-b"][key] == runs["reg-b"][key]
    assert rows["reg-b"]["task"] == "regression" and "accuracy" not in rows["reg-b"]
    assert rows["reg-b"]["final_val_mse"] == pytest.approx(0.20)
    assert rows["ml"]["final_val_f1_micro"] == pytest.approx(130 / 155)


def test_each_task_has_its_best_run_by_its_own_direction(mixed):
    """The lower validation MSE wins (reg-b), though reg-a is listed first and five times
    faster; runs of different tasks are not compared, and a run alone in its task (cls, ml)
    is neither ranked nor starred."""
    _, paths, _ = mixed
    summary = json.loads(paths["summary_json"].read_text())
    assert summary["best_by_task"] == {"regression": "reg-b"}
    assert summary["best_run"] is None  # the first listed run (cls) is compared with none
    assert [r["run"] for r in summary["runs"] if r["best"]] == ["reg-b"]
    assert [r["group"] for r in summary["runs"]] == [1, 2, 3, 3]
    assert summary["groups"][2] == {
        "group": 3, "task": "regression", "selected_by": "val_mse", "higher_is_better": False,
        "runs": ["reg-a", "reg-b"], "best": "reg-b",
    }  # fmt: skip
    assert summary["selected_by"]["regression"] == _selection("val_mse", False, "validation MSE")
    markdown = paths["markdown"].read_text()
    assert (
        "4 runs; selected on validation MSE (lower is better) among runs reg-a, reg-b: reg-b; "
        "runs of different tasks are not compared (classification, multilabel, regression)."
    ) in markdown
    assert "best test" not in markdown
    page = paths["html"].read_text()
    runs_table = page.split("<h2>Runs</h2>")[1].split("</table>")[0]
    best_rows = re.findall(r"<tr class='best'>(.*?)</tr>", runs_table)
    assert [re.search(r"<td>(.*?)</td>", r).group(1) for r in best_rows] == ["reg-b ★ best"]
    assert "<td>reg-a</td>" in runs_table and "<td>cls</td>" in runs_table


def test_the_runs_table_shows_each_runs_own_headline(mixed):
    _, paths, _ = mixed
    markdown = paths["markdown"].read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| Run |"))
    assert header.startswith("| Run | Task | Test metrics | Evaluated / test size |")
    row = next(line for line in markdown.splitlines() if line.startswith("| **reg-b"))
    assert "**regression**" in row and "**MSE 0.2, MAE 0.1, R² 0.8800**" in row
    row = next(line for line in markdown.splitlines() if line.startswith("| ml"))
    assert "exact match 62.00%, F1 (micro) 0.8387, F1 (macro) 0.8277" in row
    row = next(line for line in markdown.splitlines() if line.startswith("| cls"))
    assert "| accuracy 91.00% |" in row


def test_per_label_and_per_target_tables(mixed):
    runs, paths, _ = mixed
    markdown = paths["markdown"].read_text()
    assert "## Per-label test F1 and counts" in markdown
    assert "| Label | F1 | True positives | False positives | False negatives | Support |" in (
        markdown
    )
    assert "| sky | 0.9091 | 40 | 5 | 3 | 43 |" in markdown
    assert "| tree | 0.7463 | 25 | 10 | 7 | 32 |" in markdown
    assert "| &lt;car&gt; | n/a (never present, never predicted) | 0 | 0 | 0 | 0 |" in markdown
    assert "(62 of 100 samples exact); a label is predicted at probability ≥ 0.5" in markdown
    assert "## Per-target test errors" in markdown
    section = markdown.split("## Per-target test errors")[1].split("\n## ")[0]
    assert "### reg-a" in section and "### reg-b" in section
    assert "| Target | MSE | MAE | R² |" in section
    assert "| price | 0.2667 | 0.1333 | 0.8800 |" in section  # reg-b: 0.2 * 4/3, 0.2 * 2/3
    assert "| rooms | 0.1333 | 0.06667 | n/a |" in section
    # the classification run keeps its per-class table, and only it
    per_class = markdown.split("## Per-class test accuracy")[1].split("\n## ")[0]
    assert "| Class | cls |" in per_class and "reg-b" not in per_class
    page = paths["html"].read_text()
    assert "<td>sky</td><td>0.9091</td><td>40</td><td>5</td><td>3</td><td>43</td>" in page
    summary = json.loads(paths["summary_json"].read_text())
    tree = {"f1": 50 / 67, "true_positives": 25, "false_positives": 10, "false_negatives": 7}
    assert summary["per_label"]["ml"]["tree"] == {**tree, "support": 32}
    assert summary["per_target"]["reg-b"]["rooms"] == {
        "mse": runs["reg-b"]["per_target"]["mse"][1],
        "mae": runs["reg-b"]["per_target"]["mae"][1],
        "r2": None,
    }
    assert list(summary["per_class_accuracy"]) == ["cls"]


def test_plots_follow_each_task(mixed):
    """The selection metric of each task per epoch, a confusion matrix for classification
    only, a predicted-vs-true heatmap per regression run; every one embedded in the HTML."""
    _, paths, out = mixed
    stems = {p.stem for p in (out / "plots").glob("*.png")}
    assert {"val_accuracy", "val_f1_micro", "val_mse", "loss", "val_loss", "lr"} <= stems
    assert "predicted_vs_true_reg-a" in stems and "predicted_vs_true_reg-b" in stems
    assert {s for s in stems if s.startswith("confusion_")} == {"confusion_cls"}
    for png in (out / "plots").glob("*.png"):
        assert png.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(paths["plot_predicted_vs_true_reg-b"])
    assert image.ndim == 3 and image.shape[1] > image.shape[0]  # two panels side by side
    markdown = paths["markdown"].read_text()
    assert "](plots/predicted_vs_true_reg-b.png)" in markdown
    assert "Validation MSE per epoch (lower is better)" in markdown
    assert "](plots/val_f1_micro.png)" in markdown and "](plots/val_accuracy.png)" in markdown
    page = paths["html"].read_text()
    assert len(re.findall(r"src='data:image/png;base64,", page)) == len(stems)


def test_summary_csv_holds_every_tasks_headline(mixed):
    runs, paths, _ = mixed
    with paths["summary_csv"].open(newline="") as handle:
        reader = csv.DictReader(handle)
        rows = {row["run"]: row for row in reader}
        header = reader.fieldnames
    assert header[:3] == ["run", "task", "accuracy"]
    assert {"exact_match", "f1_micro", "f1_macro", "mse", "mae", "r2", "final_val_mse"} <= set(
        header
    )
    assert float(rows["reg-b"]["mse"]) == runs["reg-b"]["mse"] and rows["reg-b"]["accuracy"] == ""
    assert float(rows["ml"]["f1_micro"]) == runs["ml"]["f1_micro"]
    assert rows["cls"]["task"] == "classification" and rows["cls"]["mse"] == ""


def test_a_regression_report_heads_with_a_column_per_metric(tmp_path):
    """Runs of one task: a column for each of its headline metrics; the lower MSE is best."""
    results = tmp_path / "results"
    write_run(results, "slow-good", regression_eval("slow-good", 0.1, rate=100.0, r2=None))
    write_run(results, "fast-bad", regression_eval("fast-bad", 0.4, rate=9000.0))
    paths = pipeline.build_report(str(results), ["fast-bad", "slow-good"], [None, None])
    markdown = paths["markdown"].read_text()
    assert "| Run | Task | Test MSE | Test MAE | Test R² | Evaluated / test size |" in markdown
    assert "| **slow-good ★ best** | **regression** | **0.1** | **0.05** | **n/a** |" in markdown
    selected = "selected on validation MSE (lower is better) among runs fast-bad, slow-good: "
    assert selected + "slow-good." in markdown and "not compared" not in markdown
    assert "Per-class" not in markdown and "Confusion matrix" not in markdown
    summary = json.loads(paths["summary_json"].read_text())
    assert summary["best_run"] == "slow-good" and summary["runs"][1]["r2"] is None


def test_the_heatmap_is_drawn_in_the_targets_units():
    """Axes over each target's range (its units), the diagonal where predicted = true."""
    ev = regression_eval("r", 0.2)
    fig = plots.predicted_vs_true_figure("r", ev["predicted_vs_true"], TARGETS, "val")
    panels = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert len(panels) == 2
    for ax, (low, high), target in zip(panels, SPANS, TARGETS, strict=True):
        assert ax.get_xlim() == (low, high) and ax.get_ylim() == (low, high)
        assert ax.get_xlabel() == f"true {target}" and ax.get_ylabel() == f"predicted {target}"
        diagonal = [line for line in ax.get_lines() if line.get_label() == "predicted = true"]
        assert [list(diagonal[0].get_xdata()), list(diagonal[0].get_ydata())] == [
            [low, high],
            [low, high],
        ]
        image = ax.get_images()[0]
        assert list(image.get_extent()) == [low, high, low, high]
        # x: true bin (the records' rows), y: predicted bin (their columns)
        counts = image.get_array()
        assert counts.sum() == 100
    assert "validation split" in fig._suptitle.get_text()


def _break(record: dict, change) -> dict:
    change(record)
    return record


BROKEN = {
    # run name -> (eval record, epochs changed or None, what the reason names)
    "no-per-target": (
        _break(regression_eval("no-per-target", 0.2), lambda ev: ev.pop("per_target")),
        None,
        "missing key 'per_target'",
    ),
    "short-counts": (
        _break(multilabel_eval("short-counts"), lambda ev: ev["true_positives"].pop()),
        None,
        "true_positives has 2 entries for 3 names",
    ),
    "bad-histogram": (
        _break(
            regression_eval("bad-histogram", 0.2),
            lambda ev: ev["predicted_vs_true"]["counts"][0].pop(),
        ),
        None,
        "predicted_vs_true.counts is not 40x40",
    ),
    "no-val-mse": (regression_eval("no-val-mse", 0.2), "val_mse", "missing key 'val_mse'"),
    "no-selection": (
        _break(multilabel_eval("no-selection"), lambda ev: ev.pop("selection")),
        None,
        "missing key 'selection'",
    ),
}


def test_records_a_task_cannot_show_are_named_and_the_rest_reported(tmp_path):
    results = tmp_path / "results"
    write_run(results, "good", regression_eval("good", 0.3))
    for name, (ev, dropped, _) in BROKEN.items():
        epochs = _epochs(name, ev, 900.0)
        for epoch in epochs if dropped else ():
            del epoch[dropped]
        write_run(results, name, ev, epochs=epochs)
    names = ["good", *BROKEN]
    paths = pipeline.build_report(str(results), names, [None] * len(names))
    summary = json.loads(paths["summary_json"].read_text())
    assert [row["run"] for row in summary["runs"]] == ["good"]
    causes = {u["run"]: u["cause"] for u in summary["unfinished"]}
    for name, (_, _, reason) in BROKEN.items():
        assert reason in causes[name], causes[name]


def sweep_of_regressions(results, points: dict) -> list[dict]:
    """Regression sweep runs: name -> (validation MSE of the last epoch, test MSE, lr)."""
    runs = []
    for name, (val, test, lr) in points.items():
        ev = regression_eval(name, test)
        epochs = _epochs(name, ev, 900.0)
        epochs[-1]["val_mse"] = val
        block = _block(lr, 1e-4, "mlp")
        runs.append({**write_run(results, name, ev, epochs=epochs), "sweep": block})
    return runs


def test_a_regression_sweep_ranks_the_lowest_validation_mse_first(tmp_path):
    runs = sweep_of_regressions(
        tmp_path / "results",
        {"a": (0.30, 0.10, 0.1), "b": (0.05, 0.40, 0.05), "c": (0.90, 0.02, 0.02)},
    )
    paths = build_report(runs, tmp_path / "out")
    with paths["sweep_csv"].open() as handle:
        header = next(csv.reader(handle))
    assert header[-5:] == ["val_mse", "test_mse", "epochs", "status", "rank"]
    rows = _csv(paths["sweep_csv"])
    assert [(r["run"], r["rank"]) for r in rows] == [("b", "1"), ("a", "2"), ("c", "3")]
    assert float(rows[0]["val_mse"]) == 0.05 and float(rows[0]["test_mse"]) == 0.40
    summary = json.loads(paths["summary_json"].read_text())
    assert summary["sweep"]["selected_by"] == "val_mse"
    assert summary["sweep"]["higher_is_better"] is False
    assert summary["best_run"] == summary["sweep"]["selected_run"] == "b"
    assert summary["sweep"]["ranking"][0]["val_mse"] == 0.05
    markdown = paths["markdown"].read_text()
    assert "## Sweep: runs ranked by validation MSE" in markdown
    assert "Ranked by validation MSE (lower is better)" in markdown
    assert "Selected: b (validation MSE 0.05); its test MSE, 0.4, is the selection's" in markdown
    assert "selected on validation MSE (lower is better) among runs a, b, c: b." in markdown
    assert "| Rank | Run |" in markdown and "| Validation MSE | Test MSE |" in markdown
    stems = {p.stem for p in (tmp_path / "out/plots").glob("sweep_*.png")}
    assert "sweep_parallel" in stems and "sweep_train.optimizer.lr" in stems


def test_the_records_the_tasks_write_are_reported(tmp_path):
    """The real tasks' metrics and record fields (ddpflow.task, training.summaries), from a
    few scored batches: the report reads what the jobs write."""
    torch = pytest.importorskip("torch")
    from ddpflow.task import get_task
    from ddpflow.training.summaries import task_fields

    generator = torch.Generator().manual_seed(0)
    multilabel, regression = get_task("multilabel"), get_task("regression")
    state = multilabel.new_state({"num_classes": 3}, "cpu")
    truth = torch.randint(0, 2, (50, 3), generator=generator)
    multilabel.update(state, torch.randn(50, 3, generator=generator) + truth * 2.0, truth)
    ml = multilabel.metrics(state, {"num_classes": 3})
    manifest = {"num_classes": 2, "target_mean": [5.0, 3.0], "target_std": [1.0, 0.5]}
    state = regression.new_state(manifest, "cpu")
    targets = torch.randn(50, 2, generator=generator) * torch.tensor([1.0, 0.5]) + 4.0
    outputs = (targets - torch.tensor([5.0, 3.0])) / torch.tensor([1.0, 0.5]) + 0.1
    regression.update(state, outputs, targets)
    reg = regression.metrics(state, manifest)
    results = tmp_path / "results"
    for name, task, found, names in (
        ("ml", multilabel, ml, LABELS),
        ("reg", regression, reg, TARGETS),
    ):
        ev = {**_task_eval(name, 900.0), **found, "class_names": names, "test_size": 50}
        ev.update(task_fields({"task": task.name}))
        epochs = [{**_epoch(name, 1, e, 1.0, 900.0), **task.validation(found)} for e in range(2)]
        for epoch in epochs:
            del epoch["val_accuracy"]
        write_run(results, name, ev, epochs=epochs)
    paths = pipeline.build_report(str(results), ["ml", "reg"], [None, None])
    summary = json.loads(paths["summary_json"].read_text())
    assert summary["unfinished"] == [] and len(summary["runs"]) == 2
    assert summary["runs"][1]["mse"] == pytest.approx(reg["mse"])
    assert "plot_predicted_vs_true_reg" in paths


def test_per_target_tables_name_each_runs_split_where_they_differ(tmp_path):
    """Regression runs on val and on test: each run's table heading and its plot's caption
    name its split."""
    results = tmp_path / "results"
    runs = {"reg-v": regression_eval("reg-v", 0.3), "reg-t": regression_eval("reg-t", 0.2)}
    runs["reg-v"]["split"] = "val"
    for name, ev in runs.items():
        write_run(results, name, ev)
    paths = pipeline.build_report(str(results), list(runs), [None] * len(runs))
    markdown = paths["markdown"].read_text()
    section = markdown.split("## Per-target evaluation errors")[1].split("\n## ")[0]
    assert "### reg-v (validation split)" in section and "### reg-t (test split)" in section
    assert "Predicted against true values: reg-v, validation split (the red" in markdown
    assert "Predicted against true values: reg-t, test split (the red" in markdown
    assert json.loads(paths["summary_json"].read_text())["runs"][0]["split"] == "val"
