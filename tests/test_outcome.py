"""A failed run's record, and the report of the runs that finished (ddpflow.report.outcome)."""

from __future__ import annotations

import json
import logging
import os

import pytest
from ddpflow import pipeline
from ddpflow.errors import UserError
from ddpflow.paths import RunPaths, staged_dir, work_dir
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


def _runs(*runs: dict) -> dict[str, dict]:
    return {run["name"]: run for run in runs}


def _stage(run: dict, results, log_file) -> None:
    """Stage the run's data through the stage rule's function; it fails here."""
    handlers = list(logging.getLogger().handlers)
    try:
        with pytest.raises(SystemExit):
            pipeline.run_rule(
                pipeline.stage_data,
                str(log_file),
                run["data"],
                str(staged_dir(results, run["dataset_id"])),
            )
    finally:  # run_rule logs to the rule's file: not to this test process's other tests
        for handler in set(logging.getLogger().handlers) - set(handlers):
            logging.getLogger().removeHandler(handler)
            handler.close()


def test_a_staging_failure_is_the_cause_of_every_run_of_its_dataset(tmp_path, capsys):
    """A wrong data.path fails the stage rule: no train rule of its runs ever ran, and the
    report names each of them with the staging's cause (not an older failure of their own)."""
    results = tmp_path / "results"
    ok = {**make_run(), "name": "ok"}
    npz = make_run(data={"source": "npz", "path": "missing.npz"})
    own, twin = {**npz, "name": "own"}, {**npz, "name": "twin"}
    _publish(results, ok, ok)
    outcome.record_failure(work_dir(results, "own"), "train", RuntimeError("old"), "o.log")
    _stage(npz, results, tmp_path / "stage.log")  # the stage rule's code, as Snakemake runs it
    html = outcome.report_unfinished(_runs(ok, own, twin), results)
    summary = json.loads((html.parent / "summary.json").read_text())
    assert [row["run"] for row in summary["runs"]] == ["ok"]
    causes = {e["run"]: (e["stage"], e["cause"], e["log"]) for e in summary["unfinished"]}
    missing = ("stage", "data.path missing.npz: no such file", str(tmp_path / "stage.log"))
    assert causes == dict.fromkeys(["own", "twin"], missing)
    said = capsys.readouterr().err
    assert (
        "ddpflow: run 'twin' did not finish (stage failed: data.path missing.npz: no such "
        "file); fix that, then run the same command again" in said
    )
    assert "report of the 1 finished of 3 runs" in said
    # staged since (the file was put back): the record no longer describes the runs
    (results / "staged" / npz["dataset_id"]).mkdir(parents=True)
    assert outcome.run_failure(own, results)["cause"] == "RuntimeError: old"
    assert outcome.run_failure(twin, results) is None


def test_a_stop_with_no_failure_record_replaces_the_last_configs_report(tmp_path, capsys):
    """Snakemake stopped (or a rule failed without a record): the report still describes
    this config, never the runs of the one before."""
    results = tmp_path / "results"
    ok, new = {**make_run(), "name": "ok"}, {**make_run(), "name": "new"}
    _publish(results, ok, ok)
    html = outcome.report_unfinished(_runs(ok, new), results)
    summary = json.loads((html.parent / "summary.json").read_text())
    assert [row["run"] for row in summary["runs"]] == ["ok"]
    assert [(e["run"], e["cause"]) for e in summary["unfinished"]] == [("new", outcome.NOT_RUN)]
    assert "ddpflow: run 'new' did not finish\n" in capsys.readouterr().err
    # a failure record older than the result of this config (a failed retraining whose
    # outputs were given back, then the edit reverted) does not unfinish the run
    outcome.record_failure(work_dir(results, "ok"), "train", RuntimeError("edit"), "o.log")
    html = outcome.report_unfinished(_runs(ok, new), results)
    summary = json.loads((html.parent / "summary.json").read_text())
    assert [row["run"] for row in summary["runs"]] == ["ok"]


def test_a_stopped_retrain_of_a_finished_run_is_an_interrupted_training(tmp_path, capsys):
    """Ctrl-C while a finished run retrains on an edited config: its previous outputs came
    back (ddpflow.kept), but this config's training was interrupted: said as for a first
    training, with how to go on, and the report lists it as such."""
    results = tmp_path / "results"
    cnn = {**make_run(train={"epochs": 6}), "name": "cnn"}
    _publish(results, cnn, {**cnn, "train": {**cnn["train"], "epochs": 2}})  # the last config
    outcome.record_failure(work_dir(results, "cnn"), "train", KeyboardInterrupt(), "c.log")
    assert outcome.interrupted_runs(_runs(cnn), results) == {"cnn"}
    html = outcome.report_unfinished(_runs(cnn), results, restored=["cnn"])
    summary = json.loads((html.parent / "summary.json").read_text())
    (entry,) = summary["unfinished"]
    assert summary["runs"] == [] and entry["stage"] == "train" and entry["interrupted"]
    said = capsys.readouterr().err
    assert (
        "ddpflow: run 'cnn': train interrupted; no checkpoint was written yet; the same "
        "command starts it again: " in said
    )
    assert "fix" not in said


def test_the_hooks_end_snakemakes_rescheduling_timers_and_only_those():
    """Snakemake's scheduler leaves a non-daemon Timer (its rate limiter's timespan) that
    holds the process a second after the last job; the hooks cancel those, no other."""
    import gc
    import threading

    from ddpflow.cluster.interrupts import exit_promptly

    def reschedule():  # as Snakemake's lambda: its module names the scheduler
        pass

    reschedule.__module__ = "snakemake.scheduling.job_scheduler"
    theirs, other = threading.Timer(30, reschedule), threading.Timer(30, lambda: None)
    theirs.start()
    other.start()
    try:
        assert exit_promptly() == 1
        theirs.join(timeout=5)
        assert not theirs.is_alive() and other.is_alive()
    finally:
        other.cancel()
        gc.unfreeze()  # exit_promptly froze this test process's objects


def test_a_stop_signal_snakemake_was_started_ignoring_stays_ignored():
    """A background job of a non-interactive shell starts Snakemake with SIGINT ignored
    (`nohup`: SIGHUP): it goes on after a SIGINT, so forwarding it to the rules would only
    stop the training for Snakemake to retry it. The signals it handles are forwarded."""
    import subprocess
    import sys

    probe = (
        "import signal\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "from ddpflow.cluster.interrupts import forward_stop_signals\n"
        "forward_stop_signals()\n"
        "print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN,\n"
        "      signal.getsignal(signal.SIGTERM).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "handler"], out.stdout + out.stderr


def test_a_cause_that_ends_in_a_colon_names_its_first_problem(tmp_path):
    """An image folder's problems: the cause is the first line and the first problem (the
    file), not a line that stops at 'fix them and rerun:'."""
    problems = (
        "data.root pics: 2 problems, nothing was staged; fix them and rerun:\n"
        "  - pics/train/cat/bad.png: not a readable image (truncated)\n"
        "  - pics/train/dog/worse.png: not a readable image (empty)"
    )
    outcome.record_failure(tmp_path, "stage", UserError(problems), "logs/stage/x.log")
    assert outcome.read_failure(tmp_path)["cause"] == (
        "data.root pics: 2 problems, nothing was staged; fix them and rerun: "
        "pics/train/cat/bad.png: not a readable image (truncated) (and 1 more line: see the log)"
    )


def test_a_staging_job_that_slurm_failed_is_named_with_slurms_words(tmp_path, monkeypatch):
    """srun refused the staging job's step before ddpflow's script ran (no failure record):
    the cause is the last error line of the plugin's log of that job, not "not run"."""
    monkeypatch.chdir(tmp_path)
    run = make_run()
    log = tmp_path / ".snakemake/slurm_logs/rule_stage" / run["dataset_id"] / "41.log"
    log.parent.mkdir(parents=True)
    log.write_text(
        "host: node1\nsrun: error: Unable to create step for job 41: More processors "
        "requested than permitted\n"
    )
    failure = outcome.stage_job_failure(run, tmp_path / "results")
    assert failure["stage"] == "stage" and failure["log"].endswith("41.log")
    assert failure["cause"] == (
        "the staging job failed in Slurm: srun: error: Unable to create step for job 41: "
        "More processors requested than permitted (machine.stage sets its resources)"
    )
    (tmp_path / "results/staged" / run["dataset_id"]).mkdir(parents=True)  # staged after all
    assert outcome.stage_job_failure(run, tmp_path / "results") is None
