"""A 20-run sweep on the real Slurm test cluster with `--jobs 20`: every run finishes, the
report ranks all 20, and the workflow's status queries are batched (one sacct per interval
for all of its jobs, ddpflow.cluster.poll), whatever the number of runs."""

from __future__ import annotations

import csv
import json
import subprocess
import time

import pytest
from ddpflow.cluster import poll
from test_workflow_slurm import FAST_POLL
from workflow_helpers import REPO, snakemake, write_config

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

RUNS = 20
FEW = 3
POLL_S = 2.0
# staging on the login node: these tests are about polling (the workflow tests stage in a job)
MACHINE = {"nodes": 1, "cpu_ranks_per_node": 1, "partition": "debug", "account": "ddpflow",
           "mem_gb": 1, "time_min": 10, "pg_timeout_s": 60,
           "stage": {"where": "login"}}  # fmt: skip


def rpc_counts(cmd: list[str]) -> dict[str, int]:
    """RPC type -> count from `sdiag` (slurmctld) or `sacctmgr show stats` (slurmdbd)."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    counts = {}
    for line in out.splitlines():
        name, _, rest = line.strip().partition("(")
        if name.strip().isupper() and "count:" in rest:
            counts[name.strip()] = int(rest.split("count:")[1].split()[0])
    return counts


def test_twenty_runs_at_jobs_20_finish_with_batched_polling(slurm_cluster, tmp_path):
    config = {
        "train": {"epochs": 2, "progress": False},
        "machine": MACHINE,
        "sweep": {"grid": {"train.seed": list(range(RUNS))}},
    }
    configfile = write_config(tmp_path / "sweep.yaml", config)
    for reset in (["sdiag", "-r"], ["sacctmgr", "-i", "clear", "stats"]):
        subprocess.run(reset, capture_output=True, timeout=60)
    started = time.monotonic()
    # --cores: Snakemake 9 runs at most cores + 5 local rules at once (docs/sweeps.md)
    done = snakemake(tmp_path, configfile, "--profile", str(REPO / "profiles/slurm"),
                     *FAST_POLL, "--jobs", str(RUNS), "--cores", "24", timeout=1500)  # fmt: skip
    minutes = (time.monotonic() - started) / 60
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    ctld, dbd = rpc_counts(["sdiag"]), rpc_counts(["sacctmgr", "show", "stats"])
    print(f"{RUNS} runs in {minutes:.1f} min; slurmctld RPCs {ctld}; slurmdbd RPCs {dbd}")

    rows = list(csv.DictReader((tmp_path / "results/report/sweep.csv").open()))
    assert len(rows) == RUNS and sorted(int(r["rank"]) for r in rows) == list(range(1, RUNS + 1))
    assert {r["status"] for r in rows} == {"finished"}
    for row in rows:
        metrics_file = tmp_path / "results/runs" / row["run"] / "eval_metrics.json"
        metrics = json.loads(metrics_file.read_text())
        assert metrics["train"]["launcher"] == "slurm"

    # ddpflow's own record of its status queries: each asked for every registered job at
    # once, and there were at most one per interval (not one per run per interval)
    log = tmp_path / "results/work/.slurm_status/queries.log"
    queries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert queries and max(q["jobs"] for q in queries) > 1, queries
    times = sorted(q["time"] for q in queries)
    span_s = times[-1] - times[0]
    interval_s = 15.0
    assert len(queries) <= span_s / interval_s + 2, (len(queries), span_s)
    # no per-job `scontrol show job` while waiting (the old node-failure watch did one per
    # run every 15 s): slurmctld answered no single-job query for 20 runs
    assert ctld.get("REQUEST_JOB_INFO_SINGLE", 0) == 0, ctld


def test_concurrent_runs_share_one_status_query_per_interval(slurm_cluster, tmp_path):
    """3 runs train side by side on Slurm: ddpflow's own query log shows at most one sacct
    per interval for the workflow, each asking for all the jobs alive at the time."""
    runs = [{"name": f"seed{i}", "train": {"seed": i}} for i in range(FEW)]
    machine = {"nodes": 1, "cpu_ranks_per_node": 1, "partition": slurm_cluster.partition,
               "account": slurm_cluster.account, "mem_gb": 1, "time_min": 10,
               "stage": {"where": "login"}}  # fmt: skip
    configfile = write_config(tmp_path / "config.yaml", {
        "train": {"epochs": 6, "progress": False}, "machine": machine, "runs": runs})  # fmt: skip
    result = snakemake(
        tmp_path, configfile, "--profile", str(REPO / "profiles/slurm"), "--jobs", str(FEW),
        "--cores", "8", "--slurm-init-seconds-before-status-checks", "2",
        "--seconds-between-status-checks", "3", "--latency-wait", "5",
        env={poll.INTERVAL_ENV: str(POLL_S)},
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    lines = (tmp_path / "results/work" / poll.FOLDER / "queries.log").read_text().splitlines()
    queries = [json.loads(line) for line in lines]
    times = sorted(q["time"] for q in queries)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    span = times[-1] - times[0]
    assert max(q["jobs"] for q in queries) == FEW, "one query asked for every run's job"
    assert len({q["pid"] for q in queries}) > 1, "any waiting process may be the one to ask"
    # the count is bounded by the interval, not by the runs (3 runs polled alone: ~3x)
    assert len(queries) <= span / POLL_S + 2, (len(queries), span)
    assert min(gaps) >= 0.9 * POLL_S, f"two queries within one interval: {min(gaps):.2f}s"
    assert not list((tmp_path / "results/work" / poll.FOLDER / "jobs").iterdir())
