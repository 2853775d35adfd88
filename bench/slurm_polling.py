"""Scheduler load of N concurrent runs: Slurm query RPCs per minute, from `sdiag` (slurmctld)
and `sacctmgr show stats` (slurmdbd), while N train jobs of one workflow run side by side.

Needs the real test cluster (`bash tests/slurm/cluster.sh up`, as root). For each code tree
(--code LABEL=PATH: this checkout, or another worktree such as the code before batching) and
each run count, it starts `snakemake --profile <code>/profiles/slurm --jobs N` on a config of
N digits/cnn runs (different train.seed, 1 node x 1 rank, many epochs) in a workflow folder
under /tmp, waits until all N train jobs RUN, resets both counters, waits --window seconds
(nothing else queries Slurm meanwhile: the bench itself sleeps), reads the counters, then stops
Snakemake (its SIGTERM cancels the jobs). Query RPCs are the read-only ones
(REQUEST_*INFO*, DBD_GET_*), minus the bench's own stats RPCs.

    python bench/slurm_polling.py --code new=. --code old=/work/wt-poll-base --runs 1 20 \
        --out bench/results/cpu-2026-11-24/slurm_polling.json

The test cluster has 4 CPUs per node; the partition is switched to OverSubscribe=FORCE:8
for the bench (restored after) so that 20 one-CPU jobs run at once on 2 nodes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import harness
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

RPC_LINE = re.compile(r"^\s+([A-Z][A-Z0-9_]+)\s+\(\s*\d+\)\s+count:(\d+)")
OWN_RPCS = {"REQUEST_STATS_INFO", "DBD_GET_STATS", "REQUEST_PING"}


def is_query(name: str) -> bool:
    """Read-only requests: job/node/partition info from slurmctld, DBD_GET_* from slurmdbd."""
    if name in OWN_RPCS:
        return False
    return (name.startswith("REQUEST_") and "INFO" in name) or name.startswith("DBD_GET_")


def rpc_counts(text: str) -> dict[str, int]:
    """`sdiag` / `sacctmgr show stats`: the 'by message type' block -> {type: count}."""
    out, inside = {}, False
    for line in text.splitlines():
        if "by message type" in line:
            inside = True
        elif "by user" in line or "Pending RPC" in line:
            inside = False
        elif inside and (m := RPC_LINE.match(line)):
            out[m.group(1)] = out.get(m.group(1), 0) + int(m.group(2))
    return out


def sh(*cmd: str, check: bool = True) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=60).stdout


def config_for(runs: int, partition: str, account: str) -> dict:
    return {
        "train": {"epochs": 500, "progress": False},
        "machine": {
            "nodes": 1,
            "cpu_ranks_per_node": 1,
            "partition": partition,
            "account": account,
            "mem_gb": 0.5,
            "time_min": 30,
        },
        "runs": [{"name": f"seed{i}", "train": {"seed": i}} for i in range(runs)],
    }


def running_train_jobs() -> int:
    out = sh("squeue", "-h", "-t", "RUNNING", "-o", "%j", check=False)
    return sum(1 for name in out.split() if name.startswith("ddpflow-train-"))


def start(code: Path, workdir: Path, runs: int, cores: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(code / "workflow")}
    snakemake = str(Path(sys.executable).parent / "snakemake")
    cmd = [snakemake, "--snakefile", str(code / "Snakefile"), "--directory", str(workdir)]
    cmd += ["--configfile", str(workdir / "config.yaml"), "--profile", str(code / "profiles/slurm")]
    cmd += ["--jobs", str(runs), *(["--cores", str(cores)] if cores else [])]
    log = open(workdir / "snakemake.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to Snakemake: its rules cancel their jobs; then make sure the queue is empty."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    sh("scancel", "--user", os.environ.get("USER", "root"), check=False)
    deadline = time.monotonic() + 120
    while sh("squeue", "-h", check=False).strip() and time.monotonic() < deadline:
        time.sleep(2)


def measure(label: str, code: Path, runs: int, window_s: float, args) -> dict:
    workdir = Path(args.tmp) / f"{label}-{runs}"
    subprocess.run(["rm", "-rf", str(workdir)], check=True)
    workdir.mkdir(parents=True)
    config = config_for(runs, args.partition, args.account)
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    proc = start(code, workdir, runs, args.cores)
    began = time.monotonic()
    try:
        while running_train_jobs() < runs:
            if proc.poll() is not None or time.monotonic() - began > args.start_timeout:
                raise RuntimeError(
                    f"{label} x{runs}: not all jobs ran; see {workdir}/snakemake.log"
                )
            time.sleep(3)
        ramp_s = time.monotonic() - began
        time.sleep(5)  # the last rule process's start-up queries are over
        sh("sdiag", "-r")
        sh("sacctmgr", "-i", "clear", "stats")
        time.sleep(window_s)
        ctld, dbd = rpc_counts(sh("sdiag")), rpc_counts(sh("sacctmgr", "show", "stats"))
        still = running_train_jobs()
    finally:
        stop(proc)
    return row(label, runs, window_s, ramp_s, still, ctld, dbd)


def row(label, runs, window_s, ramp_s, still, ctld, dbd) -> dict:
    per_min = 60.0 / window_s
    queries = {k: v for k, v in {**ctld, **dbd}.items() if is_query(k)}
    return {
        "code": label,
        "runs": runs,
        "window_s": window_s,
        "seconds_until_all_running": round(ramp_s, 1),
        "train_jobs_running_at_end": still,
        "queries_per_min": round(sum(queries.values()) * per_min, 1),
        "queries_per_min_by_type": {k: round(v * per_min, 1) for k, v in sorted(queries.items())},
        "slurmctld_rpcs": ctld,
        "slurmdbd_rpcs": dbd,
    }


def table(rows: list[dict]) -> str:
    types = sorted({t for r in rows for t in r["queries_per_min_by_type"]})

    def cells(r: dict) -> list:
        by = r["queries_per_min_by_type"]
        return [r["code"], r["runs"], r["queries_per_min"], *(by.get(t, 0) for t in types)]

    return harness.markdown_table(["code", "runs", "queries/min", *types], map(cells, rows))


def main() -> None:
    parser = harness.parser(__doc__, None)
    parser.add_argument("--code", action="append", default=[], help="LABEL=PATH (repeatable)")
    parser.add_argument("--runs", type=int, nargs="+", default=[1, 20])
    parser.add_argument("--window", type=float, default=120.0)
    parser.add_argument("--cores", type=int, default=0, help="--cores for snakemake (0: none)")
    parser.add_argument("--partition", default="debug")
    parser.add_argument("--account", default="ddpflow")
    parser.add_argument("--tmp", default="/tmp/ddpflow-bench-polling")
    parser.add_argument("--start-timeout", type=float, default=400.0)
    args = parser.parse_args()
    codes = [c.split("=", 1) for c in args.code] or [["new", str(REPO)]]
    started = harness.now()
    sh("scontrol", "update", f"PartitionName={args.partition}", "OverSubscribe=FORCE:8")
    rows = []
    try:
        for label, path in codes:
            for runs in args.runs:
                rows.append(measure(label, Path(path).resolve(), runs, args.window, args))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        sh("scontrol", "update", f"PartitionName={args.partition}", "OverSubscribe=NO")
    print(table(rows))
    if args.out:
        result = {
            **harness.head("slurm_polling"),
            "started": started,
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "slurm": sh("sinfo", "--version").strip(),
            "conditions": {
                "cluster": "tests/slurm/cluster.sh: 2 slurmd nodes in namespaces, 4 CPUs each "
                "(claimed; the machine has 2 cores), partition OverSubscribe=FORCE:8",
                "workflow": "digits/cnn, N runs differing in train.seed, 1 node x 1 CPU rank, "
                "500 epochs (stopped after the window), snakemake --profile slurm --jobs N"
                + (f" --cores {args.cores}" if args.cores else ""),
                "window": f"{args.window:.0f} s, starting 5 s after all N train jobs RUN; "
                "counters reset (sdiag -r, sacctmgr clear stats) at its start",
                "queries": "RPC types REQUEST_*INFO* (slurmctld) and DBD_GET_* (slurmdbd), "
                "minus REQUEST_STATS_INFO/DBD_GET_STATS/REQUEST_PING (the bench's and "
                "the daemons' own)",
                "poll_interval_s": os.environ.get("DDPFLOW_SLURM_POLL_S", "default (15)"),
            },
            "rows": rows,
        }
        harness.write(result, args.out)


if __name__ == "__main__":
    main()
