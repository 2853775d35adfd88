"""The report's sweep view (ddpflow.report.sweep): runs a sweep made are ranked by validation
accuracy, never by test accuracy; sweep.csv holds one row per run; pruned, failed and
unfinished runs say so; log-uniform keys get log axes; runs without a sweep block report as
before. Real files: each run's train_metrics.jsonl, train_summary.json and eval_metrics.json
in the formats the jobs write, in tmp_path."""

from __future__ import annotations

import csv
import json
import re

import pytest
from ddpflow import pipeline
from ddpflow.report import sweep, sweep_plots
from ddpflow.report.build import build_report
from test_report import _eval, _table_headers, _write_run

KEYS = ["train.optimizer.lr", "train.optimizer.weight_decay", "model.name"]
LOG_KEYS = ["train.optimizer.weight_decay"]


def _block(lr, wd, model, origin="grid") -> dict:
    values = dict(zip(KEYS, (lr, wd, model), strict=True))
    return {"values": values, "keys": KEYS, "log_keys": LOG_KEYS, "origin": origin,
            "peers": ["every", "run"], "prune": None}  # fmt: skip


def sweep_run(root, name, val, test, block, pruned_at=None) -> dict:
    """One finished sweep run: val is the last epoch's validation accuracy, test the
    evaluation's; pruned_at: the epoch after which median pruning stopped it."""
    run = _write_run(root / name, name, 1, 1, 1000.0, accuracy=test)
    epochs = [json.loads(line) for line in run["train_metrics"].read_text().splitlines()]
    if pruned_at is not None:
        epochs = epochs[: pruned_at + 1]
    for number, epoch in enumerate(epochs):
        epoch["val_accuracy"] = val - 0.1 * (len(epochs) - 1 - number)
    run["train_metrics"].write_text("".join(json.dumps(e) + "\n" for e in epochs))
    summary = _eval(name, 1, 1, 1000.0, 1)["train"]
    if pruned_at is not None:
        summary["pruned"] = {"epoch": pruned_at, "val_accuracy": val, "median": val + 0.2,
                             "runs": 3}  # fmt: skip
    (run["train_metrics"].parent / "train_summary.json").write_text(json.dumps(summary))
    return {**run, "sweep": block}


def synthetic_sweep(root, n: int) -> list[dict]:
    """n sweep runs over an lr grid, a log-uniform weight decay and two models; validation
    and test accuracy deliberately disagree in order."""
    runs = []
    for i in range(n):
        lr, wd, model = (0.1, 0.05, 0.02)[i % 3], 10 ** (-5 + 3 * ((i * 7) % n) / n), "cnn"
        model = ("cnn", "resnet18")[i % 2]
        val = 0.6 + 0.35 * ((i * 37) % n) / n
        runs.append(sweep_run(root, f"lr{lr}-wd{wd:.2e}-{model}-{i}", val, 1.5 - val,
                              _block(lr, wd, model, "random")))  # fmt: skip
    return runs


def _csv(path) -> list[dict]:
    return list(csv.DictReader(path.open()))


def test_ranks_by_validation_not_test_accuracy(tmp_path):
    runs = [
        sweep_run(tmp_path, "a", val=0.90, test=0.97, block=_block(0.1, 1e-4, "cnn")),
        sweep_run(tmp_path, "b", val=0.95, test=0.80, block=_block(0.05, 1e-3, "cnn")),
        sweep_run(tmp_path, "c", val=0.70, test=0.99, block=_block(0.02, 1e-5, "resnet18")),
    ]
    paths = build_report(runs, tmp_path / "out")
    rows = _csv(paths["sweep_csv"])
    assert [(r["run"], r["rank"]) for r in rows] == [("b", "1"), ("a", "2"), ("c", "3")]
    summary = json.loads(paths["summary_json"].read_text())
    assert summary["best_run"] == summary["sweep"]["selected_run"] == "b"
    assert summary["sweep"]["selected_by"] == "val_accuracy"
    markdown = paths["markdown"].read_text()
    # the winner's test accuracy is stated as the selection's held-out figure
    assert "Selected: b (validation accuracy 95.00%); its test accuracy, 80.00%" in markdown
    assert "selected on validation accuracy among runs a, b, c: b." in markdown
    best_row = re.search(r"<tr class='best'>(.*?)</tr>", paths["html"].read_text()).group(1)
    assert "<td>b</td>" in best_row


def test_a_run_of_a_sweep_on_other_data_is_listed_not_ranked(tmp_path):
    """A sweep over data.path: c, on another file, has the highest validation accuracy but
    its figure does not compare with a's and b's; it is listed, not ranked nor selected."""
    runs = []
    for name, val, path in (("a", 0.90, "x.npz"), ("b", 0.95, "x.npz"), ("c", 0.99, "y.npz")):
        run = sweep_run(tmp_path, name, val=val, test=0.9, block=_block(0.1, 1e-4, "cnn"))
        ev = json.loads(run["eval_metrics"].read_text())
        ev["provenance"]["config"] = {"data": {"source": "npz", "path": path}}
        run["eval_metrics"].write_text(json.dumps(ev))
        runs.append(run)
    paths = build_report(runs, tmp_path / "out")
    rows = _csv(paths["sweep_csv"])
    assert [(r["run"], r["rank"], r["status"]) for r in rows] == [
        ("b", "1", "finished"), ("a", "2", "finished"), ("c", "", "other data"),
    ]  # fmt: skip
    summary = json.loads(paths["summary_json"].read_text())
    assert summary["best_run"] == summary["sweep"]["selected_run"] == "b"
    markdown = paths["markdown"].read_text()
    assert "A run on other data or another vocabulary than the sweep's first" in markdown
    assert "selected on validation accuracy among runs a, b: b" in markdown
    assert "c (data.path y.npz) were validated and tested on different data" in markdown


def test_a_tie_in_validation_accuracy_goes_to_the_lower_validation_loss(tmp_path):
    """Small validation sets tie often (two runs at 100%): the next criterion is still the
    validation split, never the name alone and never the test set."""
    runs = [
        sweep_run(tmp_path, "a", val=1.0, test=0.99, block=_block(0.1, 1e-4, "cnn")),
        sweep_run(tmp_path, "b", val=1.0, test=0.90, block=_block(0.05, 1e-3, "cnn")),
    ]
    for run, loss in zip(runs, (0.30, 0.05), strict=True):
        lines = run["train_metrics"].read_text().splitlines()
        last = {**json.loads(lines[-1]), "val_loss": loss}
        run["train_metrics"].write_text("\n".join([*lines[:-1], json.dumps(last)]) + "\n")
    rows = _csv(build_report(runs, tmp_path / "out")["sweep_csv"])
    assert [(r["run"], r["rank"]) for r in rows] == [("b", "1"), ("a", "2")]


def test_sweep_csv_has_one_row_per_run_with_every_key(tmp_path):
    runs = synthetic_sweep(tmp_path / "runs", 7)
    paths = build_report(runs, tmp_path / "out")
    with paths["sweep_csv"].open() as handle:
        header = next(csv.reader(handle))
    assert header == ["run", *KEYS, "val_accuracy", "test_accuracy", "epochs", "status", "rank"]
    rows = _csv(paths["sweep_csv"])
    assert sorted(r["run"] for r in rows) == sorted(r["name"] for r in runs)
    assert [int(r["rank"]) for r in rows] == list(range(1, 8))
    vals = [float(r["val_accuracy"]) for r in rows]
    assert vals == sorted(vals, reverse=True)
    first = next(r for r in runs if r["name"] == rows[0]["run"])
    assert float(rows[0]["train.optimizer.lr"]) == first["sweep"]["values"]["train.optimizer.lr"]
    assert rows[0]["model.name"] == first["sweep"]["values"]["model.name"]
    assert {r["epochs"] for r in rows} == {"4"} and {r["status"] for r in rows} == {"finished"}
    assert sorted(p.name for p in (tmp_path / "out" / "plots").glob("sweep_*.png")) == sorted(
        ["sweep_parallel.png", *(f"sweep_{k}.png" for k in KEYS)]
    )


def test_pruned_failed_and_unfinished_runs_say_so(tmp_path):
    runs = [
        sweep_run(tmp_path, "good", 0.95, 0.9, _block(0.1, 1e-4, "cnn")),
        sweep_run(tmp_path, "hopeless", 0.30, 0.3, _block(2.0, 1e-4, "cnn"), pruned_at=1),
    ]
    unfinished = [
        {"run": "crashed", "stage": "train", "cause": "boom", "log": "logs/train/crashed.log",
         "sweep": _block(0.5, 1e-4, "cnn")},
        {"run": "never", "stage": "-", "cause": "not run", "sweep": _block(1.0, 1e-4, "cnn")},
    ]  # fmt: skip
    paths = build_report(runs, tmp_path / "out", unfinished=unfinished)
    rows = {r["run"]: r for r in _csv(paths["sweep_csv"])}
    assert rows["hopeless"]["status"] == "pruned" and rows["hopeless"]["epochs"] == "2"
    assert rows["hopeless"]["rank"] == "2" and rows["good"]["rank"] == "1"
    assert rows["crashed"]["status"] == "failed" and rows["crashed"]["rank"] == ""
    assert rows["never"]["status"] == "unfinished" and rows["never"]["val_accuracy"] == ""
    markdown = paths["markdown"].read_text()
    assert "pruned after epoch 1" in markdown and "1 finished, 1 pruned, 1 failed" in markdown
    summary = json.loads(paths["summary_json"].read_text())
    assert all("sweep" not in entry for entry in summary["unfinished"])


def test_log_uniform_keys_get_a_log_axis():
    points = [
        {"run": f"r{i}", "values": {"wd": 10.0**-i, "lr": 0.1 * i, "m": "cnn"},
         "val_accuracy": 0.5 + 0.1 * i, "status": "finished"}
        for i in range(1, 5)
    ]  # fmt: skip
    assert sweep_plots.key_figure("wd", True, points, "r4").axes[0].get_xscale() == "log"
    assert sweep_plots.key_figure("lr", False, points, "r4").axes[0].get_xscale() == "linear"
    fig = sweep_plots.parallel_figure(["wd", "lr", "m"], ["wd"], points, "r4")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()][0] == "wd\n(log)"
    # decades evenly spaced on the log axis: 1e-4, 1e-3, 1e-2, 1e-1 at 0, 1/3, 2/3, 1
    ticks = {t.get_text(): t.get_position()[1] for t in ax.texts if t.get_position()[0] < 0.5}
    assert ticks["0.001"] == pytest.approx(1 / 3) and ticks["0.01"] == pytest.approx(2 / 3)


def test_runs_without_a_sweep_block_get_no_sweep_section(tmp_path):
    runs = synthetic_sweep(tmp_path / "runs", 3)
    out = tmp_path / "out"
    build_report(runs, out)
    assert (out / "sweep.csv").is_file()
    plain = [{k: v for k, v in run.items() if k != "sweep"} for run in runs]
    paths = build_report(plain, out)  # the sweep gone from the config: its view goes too
    assert "sweep_csv" not in paths and not (out / "sweep.csv").exists()
    assert not list((out / "plots").glob("sweep_*.png"))
    assert "Sweep" not in paths["markdown"].read_text()
    assert "sweep" not in json.loads(paths["summary_json"].read_text())


def test_a_long_ranking_shows_its_top_in_markdown_and_all_in_html(tmp_path):
    runs = synthetic_sweep(tmp_path / "runs", sweep.TOP_IN_TABLE + 5)
    paths = build_report(runs, tmp_path / "out")
    markdown = paths["markdown"].read_text()
    section = markdown.split("## Sweep")[1].split("\n## ")[0]
    table_rows = [line for line in section.splitlines() if re.match(r"\| \*{0,2}\d", line)]
    assert len(table_rows) == sweep.TOP_IN_TABLE
    assert f"The top {sweep.TOP_IN_TABLE} of {len(runs)} runs" in section
    page = paths["html"].read_text()
    assert f"<details><summary>All {len(runs)} runs of the sweep</summary><table>" in page


def test_the_report_rule_passes_each_runs_sweep_block(tmp_path):
    """pipeline.build_report, the report rule's and `python -m ddpflow report`'s, reads each
    run's records in results/runs/<run>/ and ranks the runs by the sweep points given."""
    runs = synthetic_sweep(tmp_path / "made", 3)
    (tmp_path / "results/runs").mkdir(parents=True)
    for run in runs:
        run["train_metrics"].parent.rename(tmp_path / "results/runs" / run["name"])
    names, points = [r["name"] for r in runs], [sweep.slim(r["sweep"]) for r in runs]
    pipeline.build_report(str(tmp_path / "results"), names, points)
    assert len(_csv(tmp_path / "results/report/sweep.csv")) == 3
    assert "peers" not in sweep.slim(runs[0]["sweep"])


def test_the_block_recorded_with_the_evaluation_is_used_when_none_is_given(tmp_path):
    runs = synthetic_sweep(tmp_path / "runs", 2)
    for run in runs:  # as ddpflow writes it: the resolved run (with its sweep) as config
        evaluation = json.loads(run["eval_metrics"].read_text())
        evaluation["provenance"]["config"]["sweep"] = run.pop("sweep")
        run["eval_metrics"].write_text(json.dumps(evaluation))
    paths = build_report(runs, tmp_path / "out")
    assert len(_csv(paths["sweep_csv"])) == 2


@pytest.mark.slow
def test_the_scale_benchmark_writes_complete_json(tmp_path):
    """bench/sweep_scale.py in a tiny configuration (its dry runs left out: seconds each)."""
    import subprocess
    import sys

    from workflow_helpers import REPO

    out = tmp_path / "scale.json"
    cmd = [sys.executable, str(REPO / "bench" / "sweep_scale.py"), "--sizes", "2", "4",
           "--skip-dag", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [row["runs"] for row in report["report"]] == [2, 4]
    assert all(row["html_bytes"] > 0 and row["build_cpu_s"] > 0 for row in report["report"])
    assert report["report_per_run"]["build_cpu_s"]["ratio_largest_to_smallest"] > 0


def test_a_sweep_evaluated_on_test_heads_its_table_test(tmp_path):
    """A sweep's runs are ranked by validation accuracy, but their per-class figures are the
    split they were evaluated on (here test): the heading says test."""
    runs = [
        sweep_run(tmp_path, "a", val=0.90, test=0.97, block=_block(0.1, 1e-4, "cnn")),
        sweep_run(tmp_path, "b", val=0.95, test=0.80, block=_block(0.05, 1e-3, "cnn")),
    ]
    markdown = build_report(runs, tmp_path / "out")["markdown"].read_text()
    assert "## Per-class test accuracy" in markdown
    assert "Per-class validation accuracy" not in markdown
    assert _table_headers(markdown) == ["| Class | a | b |"]
