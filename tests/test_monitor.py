"""See inside a run (issue 14): per-rank system metrics, stragglers, TensorBoard, profiles.

The end-to-end test runs the real workflow (Snakemake, submitit local jobs, 2 gloo ranks) with
one rank slowed down by DDPFLOW_SLOW and the profiler on, then reads what a user would: the
TensorBoard events with tensorboard's own EventAccumulator, the per-rank files, the trace
and the report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from ddpflow.monitoring.rankstats import combine_epochs, stragglers
from ddpflow.monitoring.sampler import SystemSampler
from workflow_helpers import BIN, jobs_planned, snakemake, write_config


def test_a_ranks_peak_memory_is_its_own_not_its_launchers():
    """A rank is started by a process that may hold far more (the train rule's, submitit's):
    Linux carries the launcher's peak into the child's ru_maxrss across exec, so a rank's
    peak_rss_mib is read from VmHWM, the process's own high-water mark."""
    ballast = bytearray(768 * 2**20)
    ballast[::4096] = b"\1" * len(range(0, len(ballast), 4096))  # resident, page by page
    code = (
        "import resource; from ddpflow.runtime import peak_memory_mib; "
        "print(peak_memory_mib()['peak_rss_mib'], "
        "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    own, inherited = map(float, done.stdout.split())
    assert inherited >= 768  # what ru_maxrss says of a 100 MB process: the launcher's peak
    assert own < 300, own
    del ballast


def _rank(rank, train_s, compute_s, **extra):
    return {"rank": rank, "host": f"node{rank}", "train_s": train_s, "compute_s": compute_s,
            "samples_per_s": 100.0, **extra}  # fmt: skip


def test_a_rank_that_holds_the_others_up_is_flagged_and_the_waiters_are_not():
    # rank 2 spends 0.5 s more per epoch on its own; ranks 0 and 1 wait for it inside the
    # all-reduce (their forward + backward time is longer by that much): equal epoch times
    ranks = [_rank(0, 2.0, 1.5), _rank(1, 2.0, 1.52), _rank(2, 2.0, 1.0)]
    flagged = stragglers(ranks, margin=0.25)
    assert [f["rank"] for f in flagged] == [2]
    assert flagged[0]["host"] == "node2" and "own work 2.00 s" in flagged[0]["reason"]


def test_balanced_ranks_noise_and_a_single_rank_are_not_flagged():
    assert stragglers([_rank(0, 2.0, 1.0), _rank(1, 2.02, 1.01)], margin=0.25) == []
    # 40% more own work, but only 0.04 s: below the absolute floor (timer noise)
    assert stragglers([_rank(0, 0.14, 0.05), _rank(1, 0.1, 0.05)], margin=0.25) == []
    assert stragglers([_rank(0, 5.0, 1.0)], margin=0.25) == []


def test_a_gpu_whose_utilisation_lags_is_flagged():
    ranks = [_rank(r, 2.0, 1.0, gpu_util_percent=u) for r, u in enumerate((95, 96, 40, 94))]
    flagged = stragglers(ranks, margin=0.25)
    assert [f["rank"] for f in flagged] == [2] and "GPU utilisation 40%" in flagged[0]["reason"]


def test_epochs_combine_per_rank():
    epochs = [
        [_rank(0, 1.0, 0.5, cpu_percent=80, rss_mib=100), _rank(1, 1.0, 0.4, rss_mib=90)],
        None,  # an epoch of an older run without per-rank data
        [_rank(0, 2.0, 1.0, cpu_percent=40, rss_mib=120), _rank(1, 2.0, 0.8, rss_mib=95)],
    ]
    rows = combine_epochs(epochs)
    assert [r["rank"] for r in rows] == [0, 1]
    assert rows[0]["train_s"] == 3.0 and rows[0]["compute_s"] == 1.5
    assert rows[0]["cpu_percent"] == 60 and rows[0]["rss_mib"] == 120  # mean, peak
    assert rows[1]["rss_mib"] == 95


def test_system_sampler_measures_this_process(tmp_path):
    series = tmp_path / "rank-0.jsonl"
    sampler = SystemSampler(torch.device("cpu"), 0.05, rank=0, series=series)
    try:
        end = time.monotonic() + 0.6
        x = torch.randn(256, 256)
        while time.monotonic() < end:  # keep one core busy
            x = (x @ x).tanh()
        stats = sampler.take()
    finally:
        sampler.close()
    # busy: well above idle, never more than every core (100 = one core)
    assert 30 < stats["cpu_percent"] <= 100 * os.cpu_count() + 5
    assert stats["rss_mib"] > 50  # torch alone is larger
    assert "gpu_util_percent" not in stats  # CPU device: no GPU figures invented
    samples = [json.loads(line) for line in series.read_text().splitlines()]
    assert len(samples) >= 5
    assert all(s["rss_mib"] > 0 and 0 <= s["cpu_percent"] <= 100 * os.cpu_count() + 5
               for s in samples)  # fmt: skip


MONITORED = {
    "train": {
        "epochs": 3,
        "progress": False,
        "monitor": {"log_every_steps": 2, "system_interval_s": 0.5},
        "profile": {"enabled": True, "wait": 1, "warmup": 1, "active": 2, "ranks": "all"},
    },
    "runs": [{"name": "cnn"}],
}


@pytest.mark.e2e
def test_a_monitored_run_tensorboard_ranks_straggler_and_profile(workdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    configfile = write_config(workdir / "config.yaml", MONITORED)
    # rank 1 sleeps 50 ms before every step: rank 0 waits for it in each all-reduce
    result = snakemake(workdir, configfile, env={"DDPFLOW_SLOW": "1:0.05"})
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = workdir / "results/runs/cnn"
    summary = json.loads((run_dir / "train_summary.json").read_text())
    evaluation = json.loads((run_dir / "eval_metrics.json").read_text())

    # TensorBoard, read by tensorboard itself
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    per_epoch = {"train/loss", "val/loss", "val/accuracy", "train/lr", "train/samples_per_s",
                 "seconds/train", "seconds/forward", "system/rank0/cpu_percent",
                 "system/rank1/rss_mib", "train/model_tflops"}  # fmt: skip
    assert per_epoch <= tags, tags
    for tag in per_epoch:
        assert [e.step for e in events.Scalars(tag)] == [
            summary["steps"] // 3 * epoch for epoch in (1, 2, 3)
        ], tag
    steps = events.Scalars("train/loss_step")
    assert [e.step for e in steps] == list(range(2, summary["steps"] + 1, 2))
    accuracy = events.Scalars("val/accuracy")
    metrics = [json.loads(line) for line in (run_dir / "train_metrics.jsonl").open()]
    assert [e.value for e in accuracy] == pytest.approx([m["val_accuracy"] for m in metrics])
    final = events.Scalars("test/final_accuracy")
    assert len(final) == 1 and final[0].value == pytest.approx(evaluation["accuracy"])
    # the command the README gives reads them too (it needs setuptools' pkg_resources)
    shown = subprocess.run(
        [str(BIN / "tensorboard"), "--inspect", "--logdir", "results/runs"],
        capture_output=True, text=True, timeout=120, cwd=workdir,
    )  # fmt: skip
    assert shown.returncode == 0 and "val/accuracy" in shown.stdout, shown.stderr[-2000:]

    # per-rank system metrics, every epoch, plausible
    for record in metrics:
        assert [r["rank"] for r in record["ranks"]] == [0, 1]
        for r in record["ranks"]:
            assert 0 < r["cpu_percent"] <= 100 * os.cpu_count() + 5
            assert r["rss_mib"] > 50 and r["train_s"] > 0
        # each rank's own samples/s: together about the epoch's (every rank's) rate
        ranks_rate = sum(r["samples_per_s"] for r in record["ranks"])
        assert ranks_rate == pytest.approx(record["samples_per_s"], rel=0.25), record
    for rank in (0, 1):
        lines = (run_dir / "system" / f"rank-{rank}.jsonl").read_text().splitlines()
        assert lines and json.loads(lines[0])["rss_mib"] > 0

    # the slowed rank is flagged, in the log and in the report; the waiting rank is not
    flagged = json.loads((workdir / "results/report/summary.json").read_text())
    assert [f["rank"] for f in flagged["insight"]["cnn"]["stragglers"]] == [1]
    rank0_log = next((workdir / "logs/submitit/cnn/train").glob("*_0_log.err")).read_text()
    assert "straggler: rank 1 on" in rank0_log
    assert "is a straggler, the others wait for it" in result.stderr  # the terminal
    report = (workdir / "results/report/report.md").read_text()
    assert "## Ranks: system use and stragglers" in report
    assert "rank 1 on" in report and "is a straggler" in report

    # the profile: a Chrome trace that loads, and the top operators in the report
    for rank in (0, 1):  # ranks: all
        trace = json.loads((run_dir / f"profile/trace-rank{rank}.json").read_text())
        assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
    assert "## Profile: top operators by self time (rank 0)" in report
    assert "| aten::" in report and "optimizer steps 3–4" in report

    _efficiency_is_recorded_and_a_missed_estimate_flagged(workdir, summary, metrics, result.stderr)

    # monitoring settings change no result: nothing to redo; the profiler retrains
    edited = {**MONITORED, "train": {**MONITORED["train"], "monitor": {"tensorboard": False}}}
    write_config(configfile, edited)
    assert jobs_planned(workdir, configfile) == set()
    edited["train"]["profile"] = {"enabled": False}
    write_config(configfile, edited)
    assert {"train", "report"} <= jobs_planned(workdir, configfile)


def _efficiency_is_recorded_and_a_missed_estimate_flagged(workdir, summary, metrics, stderr):
    """The run's FLOPs (counted on the login node) and achieved TFLOP/s, its admitted memory
    estimate against its ranks' peaks, in train_summary.json, summary.json and the report;
    then the same records with an estimate made too low: the report names the miss."""
    efficiency, memory = summary["efficiency"], summary["memory"]
    assert efficiency["counted"] and efficiency["model_flops_per_step"] > 1e6
    assert efficiency["model_tflops"] == pytest.approx(
        efficiency["model_flops_per_step"] * summary["steps"] / summary["train_seconds"] / 1e12
    )
    assert "mfu" not in efficiency and efficiency["peak"] == "CPU ranks"
    assert f"); {efficiency['model_tflops']:.3g} model TFLOP/s\n" in stderr
    assert all(m["model_tflops"] > 0 and "mfu" not in m for m in metrics)
    assert [r["rank"] for r in memory["ranks"]] == [0, 1]
    assert memory["peak_bytes"] == max(r["peak_bytes"] for r in memory["ranks"])
    # the estimator holds on this run (bench/memory_estimate.py: within a few percent)
    assert abs(memory["difference"]) < 0.25 and not memory["estimator_miss"]
    run = json.loads((workdir / "results/report/summary.json").read_text())["runs"][0]
    assert run["model_tflops"] == efficiency["model_tflops"] and run["mfu"] is None
    assert run["memory_estimate_bytes"] == memory["estimate_bytes"]
    assert run["memory_peak_bytes"] == memory["peak_bytes"]
    report = (workdir / "results/report/report.md").read_text()
    assert "### Efficiency" in report and "estimator miss" not in report

    from ddpflow.monitoring.flops import memory_record

    low = {"memory": {"comparable_bytes": memory["peak_bytes"] // 2, "total_bytes": 1}}
    evaluation_file = workdir / "results/runs/cnn/eval_metrics.json"
    saved = evaluation_file.read_text()
    evaluation = json.loads(saved)
    evaluation["train"]["memory"] = memory_record(low, metrics, {})
    evaluation_file.write_text(json.dumps(evaluation))
    try:
        done = subprocess.run(
            [str(BIN / "python"), "-m", "ddpflow", "report", "--config", "config.yaml"],
            cwd=workdir,
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        report = (workdir / "results/report/report.md").read_text()
    finally:
        evaluation_file.write_text(saved)
    assert "+100.0% (rank " in report and "⚠ estimator miss" in report, report
    assert "Estimator misses: run 'cnn': rank " in report and "100% above the estimate" in report
