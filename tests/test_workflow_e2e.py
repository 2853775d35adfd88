"""End to end: the real Snakemake workflow, real submitit local jobs, 2 real gloo ranks."""

from __future__ import annotations

import json
import re

import matplotlib.image
import pytest
from workflow_helpers import jobs_planned, snakemake, write_config

pytestmark = pytest.mark.e2e

FAST = {"train": {"epochs": 6, "progress": False}, "runs": [{"name": "cnn"}]}
# two named runs in one config: both trained, evaluated and compared in one report
TWO_RUNS = {
    **FAST,
    "runs": [
        {"name": "cnn"},
        {"name": "mlp", "model": {"name": "mlp"}, "train": {"epochs": 4, "progress": True}},
    ],
}


@pytest.mark.smoke
def test_smoke_the_default_job_trains_evaluates_reports_then_plans_nothing(workdir):
    """The small end-to-end run of `make test-fast`: the shipped config, 2 epochs, 2 ranks."""
    configfile = write_config(
        workdir / "config.yaml", {"train": {"epochs": 2, "progress": False}}, default_exports=True
    )
    result = snakemake(workdir, configfile)
    assert result.returncode == 0, result.stderr[-3000:]
    # export.formats' default: the model as safetensors beside model.pt, linked from the report
    assert (workdir / "results/runs/default/model.safetensors").stat().st_size > 0
    assert "model.safetensors" in (workdir / "results/report/report.md").read_text()
    metrics = json.loads((workdir / "results/runs/default/eval_metrics.json").read_text())
    assert metrics["samples_evaluated"] == metrics["test_size"] == 359
    assert metrics["world_size"] == 2 and metrics["accuracy"] > 0.5
    # the rank's start-up as bench/slurm_scale.py reads it: the group, then the first step
    startup = json.loads((workdir / "results/runs/default/train_summary.json").read_text())
    startup = startup["startup"]
    assert 0 <= startup["rendezvous_s"] < 60 and startup["group_up_at"] < startup["first_step_at"]
    assert len(startup["checkpoint_save_s"]) == 2  # one per epoch
    assert (workdir / "results/report/report.html").stat().st_size > 0
    assert jobs_planned(workdir, configfile) == set()
    # the train rule said, before the job was queued, what a rank needs and how it compares
    # with the memory it has (ddpflow.checks.memory), and each rank recorded its real peak
    assert re.search(
        r"run 'default': about [\d.]+ GB per rank \(parameters .* over 2 ranks\): "
        r"\d+%",
        result.stderr,
    ), result.stderr[-3000:]
    first = json.loads(
        (workdir / "results/runs/default/train_metrics.jsonl").read_text().splitlines()[0]
    )
    assert all(rank["peak_rss_mib"] > 100 for rank in first["ranks"])


def test_whole_workflow_then_partial_rerun(workdir):
    configfile = write_config(workdir / "config.yaml", TWO_RUNS)
    result = snakemake(workdir, configfile)
    assert result.returncode == 0, result.stderr[-3000:]

    metrics = json.loads((workdir / "results/runs/cnn/eval_metrics.json").read_text())
    assert metrics["samples_evaluated"] == metrics["test_size"] == 359
    assert metrics["world_size"] == 2 and len(metrics["hosts"]) == 2
    assert metrics["accuracy"] > 0.9
    assert sum(map(sum, metrics["confusion_matrix"])) == 359
    assert metrics["provenance"]["config"]["train"]["epochs"] == 6

    report = workdir / "results/report"
    for name in ("report.md", "report.html", "summary.json", "summary.csv"):
        assert (report / name).stat().st_size > 0
    for png in ("loss", "val_accuracy", "throughput", "confusion_cnn"):
        image = matplotlib.image.imread(report / "plots" / f"{png}.png")
        assert image.ndim == 3 and image.shape[0] > 100
    # one allocation per run: the training job evaluated; no evaluate job was submitted
    assert len(list((workdir / "logs/submitit/cnn/train").glob("*_submitted.pkl"))) == 1
    assert not (workdir / "logs/submitit/cnn/evaluate").exists()
    assert metrics["evaluated_by"] == "train job"
    # mlp's rank 0 had its progress on: whole lines in its log, no bar's carriage returns
    rank_logs = list((workdir / "logs/submitit/mlp/train").glob("*_0_log.err"))
    assert rank_logs and all("\r" not in p.read_text() for p in rank_logs)
    # live progress: rank 0's epochs, in the rule's log (and the terminal) while it trained
    train_log = (workdir / "logs/train/cnn.log").read_text()
    for epoch in range(1, 7):
        assert f"run 'cnn' epoch {epoch}/6: train loss " in train_log, train_log
    assert "s left" in train_log
    summary = json.loads((report / "summary.json").read_text())
    rows = {row["run"]: row for row in summary["runs"]}
    assert sorted(rows) == ["cnn", "mlp"]
    assert rows["cnn"]["accuracy"] == metrics["accuracy"] and rows["cnn"]["epochs"] == 6
    assert rows["mlp"]["epochs"] == 4 and summary["best_run"] in rows
    mlp = json.loads((workdir / "results/runs/mlp/eval_metrics.json").read_text())
    assert mlp["provenance"]["config"]["model"]["name"] == "mlp"
    assert mlp["provenance"]["config"]["train"]["epochs"] == 4
    assert "mlp" in (report / "report.md").read_text()

    # delete one output: only it and what depends on it are redone
    # (the evaluation is then scored anew, in a job of its own: the same counts and loss)
    model = workdir / "results/runs/cnn/model.pt"
    model_mtime = model.stat().st_mtime_ns
    (workdir / "results/runs/cnn/eval_metrics.json").unlink()
    assert jobs_planned(workdir, configfile) == {"evaluate", "report", "all"}
    rerun = snakemake(workdir, configfile)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert model.stat().st_mtime_ns == model_mtime
    again = json.loads((workdir / "results/runs/cnn/eval_metrics.json").read_text())
    assert again["evaluated_by"] == "evaluate job"
    assert len(list((workdir / "logs/submitit/cnn/evaluate").glob("*_submitted.pkl"))) == 1
    for key in ("accuracy", "confusion_matrix", "loss", "samples_evaluated"):
        assert again[key] == metrics[key], key
    assert jobs_planned(workdir, configfile) == set()

    # Snakemake's own report, with the items registered through report()
    smk_report = snakemake(workdir, configfile, "--report", str(workdir / "smk-report.html"))
    assert smk_report.returncode == 0, smk_report.stderr[-2000:]
    html = (workdir / "smk-report.html").read_text(errors="replace")
    assert "report.html" in html and "loss.png" in html


def test_failing_rank_gives_clear_error_and_no_partial_output(workdir):
    configfile = write_config(workdir / "config.yaml", FAST)
    result = snakemake(workdir, configfile, env={"DDPFLOW_FAULT": "raise:1:1:2"})
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "rank 1 on " in output
    assert "InjectedFault: injected fault on rank 1 at epoch 1 step 2" in output
    assert "ranks [0] then lost their peers" in output
    run_dir = workdir / "results/runs/cnn"
    leftovers = sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else []
    # no output of the rule; what the failed attempt recorded about itself (TensorBoard curves
    # and system samples up to the failure: see inside a run) is kept for the post-mortem
    assert set(leftovers) <= {"tensorboard", "system"}, f"partial outputs left: {leftovers}"
    # the staged data (already computed) survives the failure
    assert any((workdir / "results/staged").iterdir())


def test_a_diverging_run_fails_alone_and_the_report_names_it(workdir):
    """train.optimizer.lr far too large: the loss turns NaN/inf, every rank stops at that
    step, the train rule fails with the reason; the other run of the config trains and
    evaluates on (keep-going, profiles/default) and the report of it names the failed run.
    Dropping the failed run from the config then redoes the report alone."""
    diverging = {
        "train": {"epochs": 3, "progress": False, "warmup_epochs": 0},
        "runs": [{"name": "steady"}, {"name": "wild", "train": {"optimizer": {"lr": 1e12}}}],
    }
    configfile = write_config(workdir / "config.yaml", diverging)
    result = snakemake(workdir, configfile)
    assert result.returncode != 0
    log = (workdir / "logs/train/wild.log").read_text()
    cause = "run 'wild': the training loss became NaN or infinite at epoch 1"
    assert cause in log, log[-3000:]
    assert "Lower train.optimizer.lr" in log
    assert not (workdir / "results/runs/wild/model.pt").exists()
    assert not (workdir / "results/runs/wild/eval_metrics.json").exists()
    # the other run finished, and the report of it names the failed one and why
    assert (workdir / "results/runs/steady/eval_metrics.json").is_file()
    report = workdir / "results/report"
    markdown = (report / "report.md").read_text()
    assert "## Runs that did not finish" in markdown and "1 of 2 runs finished" in markdown
    assert cause in markdown and "logs/train/wild.log" in markdown
    summary = json.loads((report / "summary.json").read_text())
    assert [row["run"] for row in summary["runs"]] == ["steady"]
    (unfinished,) = summary["unfinished"]
    assert unfinished["run"] == "wild" and unfinished["stage"] == "train"
    assert unfinished["cause"].startswith("rank ") and cause in unfinished["cause"]
    output = result.stdout + result.stderr
    assert "ddpflow: run 'wild' did not finish (train failed: rank " in output
    assert "report of the 1 finished of 2 runs" in output

    # the failed run dropped from config.yaml: the report alone is redone, without it
    write_config(configfile, {**diverging, "runs": [{"name": "steady"}]})
    assert jobs_planned(workdir, configfile) == {"report", "all"}
    rerun = snakemake(workdir, configfile)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "wild" not in (report / "report.md").read_text()
    assert json.loads((report / "summary.json").read_text())["unfinished"] == []
