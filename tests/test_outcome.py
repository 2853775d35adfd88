"""A failed run's record, and the report of the runs that finished (ddpflow.report.outcome)."""

from __future__ import annotations

import json
import os

from ddpflow.errors import UserError
from ddpflow.paths import RunPaths, work_dir
from ddpflow.report import outcome
from test_report import _write_run
from workflow_helpers import make_run

JOB_FAILED = (
    "ddpflow-train-wild failed (job 7312, 2 ranks, logs in logs/submitit/wild/train)\n"
    "  rank 1 on node3: ddpflow.loop.Diverged: run 'wild': the training loss became NaN\n"
    "  ranks [0] then lost their peers (collateral)\n"
)


def test_the_first_culprit_rank_is_the_cause(tmp_path):
    outcome.record_failure(tmp_path, "train", UserError(JOB_FAILED), "logs/train/wild.log")
    record = outcome.read_failure(tmp_path)
    assert record["cause"] == "rank 1 on node3: ddpflow.loop.Diverged: run 'wild': the " + (
        "training loss became NaN"
    )
    assert record["stage"] == "train" and record["log"] == "logs/train/wild.log"
    assert record["detail"].startswith("ddpflow-train-wild failed (job 7312")
    outcome.clear_failure(tmp_path)
    assert outcome.read_failure(tmp_path) is None


def test_a_bug_keeps_its_exception_type_and_a_stop_says_so(tmp_path):
    outcome.record_failure(tmp_path, "evaluate", KeyError("eval_seconds"), None)
    assert outcome.read_failure(tmp_path)["cause"] == "KeyError: 'eval_seconds'"
    outcome.record_failure(tmp_path, "train", KeyboardInterrupt(), None)
    assert outcome.read_failure(tmp_path)["cause"].startswith("stopped")


def test_an_interrupted_run_says_where_it_stopped_what_is_kept_and_how_to_go_on(tmp_path):
    run = make_run(train={"epochs": 12}, runs=[{"name": "cnn"}])
    work = work_dir(tmp_path, "cnn")
    outcome.record_failure(work, "train", KeyboardInterrupt(), "logs/train/cnn.log")
    entry = {"run": "cnn", **outcome.read_failure(work)}
    line = outcome._unfinished_line(entry, {"cnn": run}, tmp_path)
    assert "train interrupted; no checkpoint was written yet; the same command starts" in line
    (work / "metrics.jsonl").write_text('{"epoch": 1}\n{"epoch": 2}\n')
    (work / "checkpoints").mkdir()
    (work / "checkpoints/ckpt-000000040.pt").write_bytes(b"")
    line = outcome._unfinished_line(entry, {"cnn": run}, tmp_path)
    assert line.startswith("ddpflow: run 'cnn': train interrupted after epoch 2 of 12; its ")
    assert "checkpoint (step 40) is kept; the same command continues it: " in line
    left = make_run(
        launcher="slurm", machine={"cancel_on_interrupt": False}, runs=[{"name": "cnn"}]
    )
    line = outcome._unfinished_line(entry, {"cnn": left}, tmp_path)
    assert "its Slurm job keeps running (machine.cancel_on_interrupt: false); the same " in line
    assert "command reattaches to it" in line


def _publish(results, run: dict, config: dict) -> None:
    """Write fake train/eval metrics where the run's rules publish them, for `config`."""
    written = _write_run(results / "fake" / run["name"], run["name"], 2, 1, 100.0)
    paths = RunPaths.for_run(results, run)
    os.makedirs(os.path.dirname(paths.eval_metrics), exist_ok=True)
    evaluation = json.loads(written["eval_metrics"].read_text())
    evaluation["provenance"]["config"] = config
    with open(paths.eval_metrics, "w") as out:
        json.dump(evaluation, out)
    os.replace(written["train_metrics"], paths.train_metrics)


def test_report_of_the_finished_runs_names_the_failed_and_the_outdated(tmp_path):
    results = tmp_path / "results"
    ok = {**make_run(), "name": "ok"}
    stale = {**make_run(train={"epochs": 9}), "name": "stale"}
    wild = {**make_run(), "name": "wild"}
    runs = {run["name"]: run for run in (ok, stale, wild)}
    _publish(results, ok, ok)
    _publish(results, stale, {**stale, "train": {**stale["train"], "epochs": 2}})  # older config
    assert outcome.report_unfinished(runs, results) is None  # nothing failed: nothing written
    assert not (results / "report").exists()

    outcome.record_failure(work_dir(results, "wild"), "train", UserError(JOB_FAILED), "w.log")
    html = outcome.report_unfinished(runs, results)
    assert html == results / "report" / "report.html" and html.stat().st_mtime == 0
    summary = json.loads((results / "report" / "summary.json").read_text())
    assert [row["run"] for row in summary["runs"]] == ["ok"]
    unfinished = {entry["run"]: entry for entry in summary["unfinished"]}
    assert unfinished["wild"]["cause"].startswith("rank 1 on node3")
    assert unfinished["stale"]["cause"] == outcome.NOT_RUN  # a result of an older config
    markdown = (results / "report" / "report.md").read_text()
    assert "1 of 3 runs finished" in markdown and "| wild | train |" in markdown


def test_a_report_with_no_finished_run_still_renders(tmp_path):
    results = tmp_path / "results"
    wild = {**make_run(), "name": "wild"}
    outcome.record_failure(work_dir(results, "wild"), "train", RuntimeError("boom"), None)
    html = outcome.report_unfinished({"wild": wild}, results)
    page = html.read_text()
    assert "Runs that did not finish" in page and "RuntimeError: boom" in page
    assert "<img" not in page
    assert (results / "report" / "summary.csv").read_text() == "run\n"
