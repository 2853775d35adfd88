"""Failure to next step: what a lost rank or node costs, restarted inside the job vs by a new
job, on the Slurm test cluster (tests/slurm/cluster.sh up 3 as root; this script brings the
cluster up and down).

One 2-node x 1 CPU rank training through `snakemake --profile slurm` per case; once it has
written its second checkpoint, the failure is made and timed (t0):

* `rank, in job`: rank 1's process SIGKILLed on node2 (machine.restarts_in_job 3, the
  default): the job's supervisor restarts the ranks in place;
* `node, spare`: node2 dies (its slurmd stopped, Slurm told it is DOWN, its rank killed) under
  a job with machine.spare_nodes 1: the spare node3 takes its place;
* `rank, new job` (the baseline, how every failure was handled before): the same kill with
  machine.restarts_in_job 0: the job fails, the rule's retry (the profile's `retries: 1`)
  submits a new job, which resumes from the checkpoint. On this idle cluster its queue wait
  is a scheduler pass; on a busy one it is whatever the queue holds.

What the seconds from t0 to the first optimizer step after it are made of: the step's end
(srun's --kill-on-bad-exit, or Slurm taking the node away), the supervisor's Slurm queries
(or, for a new job, Snakemake's retry and the submission), the new step's start to its
process group up (srun, Python and torch imported, the rendezvous), and from there to the
first step (data, model, the checkpoint read, one step). From the supervisor's events
(results/work/<run>/restarts.jsonl), the new job's submission time, and rank 0's start-up
record (train_summary.json "startup").

    python bench/restart_in_job.py --out bench/results/<dir>/restart_in_job.json
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import harness
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CLUSTER = REPO / "tests" / "slurm" / "cluster.sh"
STATE = Path(os.environ.get("DDPFLOW_SLURM_DIR", "/tmp/ddpflow-slurm"))
DESCRIPTION = "failure to next step: a restart inside the job vs a new job, on real Slurm"
CASES = {  # name: (machine keys, how node2 fails)
    "rank, in job": ({}, "rank"),
    "node, spare": ({"spare_nodes": 1}, "node"),
    "rank, new job": ({"restarts_in_job": 0}, "rank"),
}


def config_for(machine: dict, epochs: int) -> dict:
    return {
        "model": {"name": "cnn", "cnn_channels": 8},
        "train": {
            "epochs": epochs,
            "progress": False,
            "global_batch_size": 64,
            "micro_batch_size": 32,
            "checkpoint": {"every_steps": 0, "every_epochs": 1},
        },
        "machine": {
            "nodes": 2,
            "cpu_ranks_per_node": 1,
            "partition": "debug",
            "account": "ddpflow",
            "mem_gb": 1.5,
            "time_min": 30,
            "stage": {"where": "login"},
            **machine,
        },
        "runs": [{"name": "rs"}],
    }


def cluster(*args: str) -> None:
    subprocess.run(["bash", str(CLUSTER), *args], check=True, capture_output=True, text=True)


def ranks_on(node: str) -> list[int]:
    found = subprocess.run(
        ["ip", "netns", "pids", f"ddpf-{node}"], capture_output=True, text=True, timeout=30
    ).stdout.split()
    out = []
    for pid in found:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().startswith("python"):
                out.append(int(pid))
    return out


def fail(node: str, how: str) -> float:
    """node2's rank killed (and, for `node`, the node held DOWN with its slurmd stopped);
    returns t0."""
    if how == "node":
        os.kill(int((STATE / "pids" / f"slurmd-{node}.pid").read_text()), signal.SIGSTOP)
        subprocess.run(
            ["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=bench"],
            check=True,
            timeout=30,
        )
    t0 = time.time()
    for pid in ranks_on(node):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return t0


def restore(node: str) -> None:
    os.kill(int((STATE / "pids" / f"slurmd-{node}.pid").read_text()), signal.SIGCONT)
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], timeout=30)


def run_case(name: str, epochs: int, root: Path) -> dict:
    machine, how = CASES[name]
    workdir = root / name.replace(", ", "-").replace(" ", "_")
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    (workdir / "config.yaml").write_text(yaml.safe_dump(config_for(machine, epochs)))
    snakemake = str(Path(sys.executable).parent / "snakemake")
    cmd = [
        snakemake,
        "--snakefile",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        "--configfile",
        str(workdir / "config.yaml"),
        "--profile",
        str(REPO / "profiles/slurm"),
    ]
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "DDPFLOW_SLURM_POLL_S": "2",
        "DDPFLOW_SLOW": "0,1:0.01",
    }
    checkpoints = workdir / "results/work/rs/checkpoints"
    with (workdir / "snakemake.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
        while len(list(checkpoints.glob("ckpt-*.pt"))) < 2:
            if proc.poll() is not None:
                raise RuntimeError(f"{name}: snakemake ended before its second checkpoint")
            time.sleep(0.1)
        t0 = fail("node2", how)
        try:
            code = proc.wait(timeout=900)
        finally:
            if how == "node":
                restore("node2")
    if code:
        raise RuntimeError(
            f"{name}: snakemake failed:\n{(workdir / 'snakemake.log').read_text()[-2000:]}"
        )
    return row_of(name, workdir, t0)


def row_of(name: str, workdir: Path, t0: float) -> dict:
    summary = json.loads((workdir / "results/runs/rs/train_summary.json").read_text())
    startup = summary["startup"]  # the last step's (or the new job's) rank 0
    path = workdir / "results/work/rs/restarts.jsonl"
    events = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    failed = [e for e in events if e["event"] == "failed"]
    started = [e for e in events if e["event"] == "start" and e["restart"] > 0]
    if failed:  # inside the job: the step's end, then the supervisor's queries
        ended, relaunched = failed[-1]["time"], started[-1]["time"]
    else:  # a new job: the rule failed and its retry submitted one
        pickles = sorted(
            workdir.glob("logs/submitit/rs/train/*_submitted.pkl"),
            key=lambda p: int(p.name.split("_")[0]),
        )
        ended, relaunched = None, pickles[-1].stat().st_mtime  # its end: not seen apart
    jobs = {p.name.split("_")[0] for p in workdir.glob("logs/submitit/rs/train/*_0_log.out")}
    return {
        "case": name,
        "jobs": len(jobs),
        "to_next_step_s": round(startup["first_step_at"] - t0, 2),
        "step_end_s": None if ended is None else round(ended - t0, 2),
        "to_relaunch_s": round(relaunched - (t0 if ended is None else ended), 2),
        "to_group_up_s": round(startup["group_up_at"] - relaunched, 2),
        "to_first_step_s": round(startup["first_step_at"] - startup["group_up_at"], 2),
        "steps_redone": summary["segments"][-1].get("steps_redone"),
        "world_size": summary["world_size"],
        "hosts": sorted(set(summary["hosts"])),
    }


def main() -> int:
    parser = harness.parser(__doc__, "restart_in_job.json")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tmp", type=Path, default=Path("/tmp/ddpflow-bench-restart"))
    args = parser.parse_args()
    started = time.perf_counter()
    result = {**harness.head("restart_in_job", description=DESCRIPTION), "rows": []}
    try:
        cluster("up", "3")
        for _ in range(args.repeats):
            for name in CASES:
                row = run_case(name, args.epochs, args.tmp)
                print(json.dumps(row), flush=True)
                result["rows"].append(row)
    finally:
        cluster("down")
    result["conditions"] = {
        "cluster": "tests/slurm/cluster.sh up 3: 3 slurmd in network namespaces on this one "
        "machine (Slurm 22.05, SchedulerParameters bf_interval=2,sched_interval=2; all ranks "
        "share its cores); no other jobs, so a new job's queue wait is one scheduler pass",
        "job": f"digits, cnn (8 channels), {args.epochs} epochs, global batch 64 (micro-batch 32), "
        "2 nodes x 1 CPU rank, a checkpoint every epoch, DDPFLOW_SLOW 10 ms per micro-step, "
        "DDPFLOW_SLURM_POLL_S 2, failure after the second checkpoint",
    }
    keys = [
        "to_next_step_s",
        "step_end_s",
        "to_relaunch_s",
        "to_group_up_s",
        "to_first_step_s",
        "jobs",
        "steps_redone",
    ]
    print(
        harness.markdown_table(
            ["case", *keys], [[r["case"], *(r[k] for k in keys)] for r in result["rows"]]
        )
    )
    return harness.write(result, args.out, wall_since=started)


if __name__ == "__main__":
    sys.exit(main())
