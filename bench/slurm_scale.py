"""Scale on real Slurm: the same small job through `snakemake --profile slurm` at 1, 2, 4, 8
and 16 nodes x 1 CPU rank, on the Slurm test cluster (tests/slurm/cluster.sh up N as root;
this script brings the cluster up at each size and down at the end).

Per size, from the rank's own record (train_summary.json "startup") and the login node:

* submission to first step: the submitit job folder's submission (its *_submitted.pkl) to
  rank 0's first optimizer step finished;
* the rendezvous: rank 0's store and process group (distenv.init_process_group);
* the per-step all-reduce: rank 0's backward_sync phase per optimizer step (the gradient
  all-reduce overlapped with the backward pass, as a user's job pays it);
* a checkpoint write: rank 0's median Checkpointer.save (the RNG gather and the write);
* Slurm queries per minute: every sbatch, srun, sacct, squeue, scontrol and sinfo started
  under Snakemake (a logging shim on PATH in front of the real command);
* the login node's CPU seconds: os.wait4's rusage of Snakemake and what it reaped.

Then each figure's growth with the node count N as a least-squares slope of log(figure) on
log(N), and what that slope predicts at 128 nodes. Every node of the test cluster is a
namespace on this one machine: its cores are shared by all ranks, so the step figures grow
with N here for a reason a real cluster does not have (the conditions say so).

    python bench/slurm_scale.py --nodes 1 2 4 8 16 --out bench/results/<dir>/slurm_scale.json
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CLUSTER = REPO / "tests" / "slurm" / "cluster.sh"
SLURM_COMMANDS = ("sbatch", "srun", "sacct", "squeue", "scontrol", "sinfo", "scancel")
FIGURES = ("to_first_step_s", "rendezvous_s", "step_sync_s", "checkpoint_s", "queries_per_min")


# the performance page's heading
DESCRIPTION = "the same small job through snakemake --profile slurm at 1 to 16 nodes"


def config_for(nodes: int, epochs: int) -> dict:
    return {
        "model": {"name": "cnn", "cnn_channels": 8},
        "train": {"epochs": epochs, "progress": False, "global_batch_size": 64,
                  "micro_batch_size": max(1, 64 // nodes)},
        "machine": {"nodes": nodes, "cpu_ranks_per_node": 1, "cpus_per_task": 1,
                    "partition": os.environ.get("DDPFLOW_SLURM_PARTITION", "debug"),
                    "account": os.environ.get("DDPFLOW_SLURM_ACCOUNT", "ddpflow"),
                    "mem_gb": 1.5, "time_min": 30, "stage": {"where": "login"}},
        "runs": [{"name": "scale"}],
    }  # fmt: skip


def write_shims(folder: Path, calls: Path) -> None:
    """A logging shim per Slurm command: one line per call, then the real command."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in SLURM_COMMANDS:
        real = shutil.which(name)
        if real is None:
            continue
        shim = folder / name
        shim.write_text(f'#!/bin/sh\necho "$(date +%s.%N) {name}" >> {calls}\nexec {real} "$@"\n')
        shim.chmod(0o755)


def cluster(*args: str) -> None:
    subprocess.run(["bash", str(CLUSTER), *args], check=True, capture_output=True, text=True)


def run_size(nodes: int, epochs: int, root: Path) -> dict:
    workdir = root / f"n{nodes}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    (workdir / "config.yaml").write_text(yaml.safe_dump(config_for(nodes, epochs)))
    calls = workdir / "slurm_calls.txt"
    write_shims(workdir / "shims", calls)
    snakemake = str(Path(sys.executable).parent / "snakemake")
    cmd = [snakemake, "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir)]
    cmd += ["--configfile", str(workdir / "config.yaml"), "--profile", str(REPO / "profiles/slurm")]
    path = f"{workdir / 'shims'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}"
    env = {**os.environ, "PATH": path + os.environ["PATH"], "PYTHONPATH": str(REPO / "workflow")}
    with (workdir / "snakemake.log").open("w") as log:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - start
    if os.waitstatus_to_exitcode(status):
        tail = (workdir / "snakemake.log").read_text()[-2000:]
        raise RuntimeError(f"{nodes} nodes: snakemake failed:\n{tail}")
    return row_of(nodes, workdir, wall, usage.ru_utime + usage.ru_stime, calls)


def row_of(nodes: int, workdir: Path, wall: float, login_cpu: float, calls: Path) -> dict:
    summary = json.loads((workdir / "results/runs/scale/train_summary.json").read_text())
    startup = summary["startup"]
    submitted = min(p.stat().st_mtime for p in workdir.glob("logs/submitit/**/*_submitted.pkl"))
    queries = calls.read_text().splitlines() if calls.is_file() else []
    saves = startup.get("checkpoint_save_s") or [math.nan]
    return {
        "nodes": nodes,
        "world_size": summary["world_size"],
        "hosts": sorted(set(summary["hosts"])),
        "wall_s": round(wall, 2),
        "to_first_step_s": round(startup["first_step_at"] - submitted, 3),
        "rendezvous_s": round(startup["rendezvous_s"], 4),
        "step_sync_s": summary["phase_seconds"]["backward_sync"] / max(1, summary["steps"]),
        "checkpoint_s": statistics.median(saves),
        "slurm_queries": len(queries),
        "queries_per_min": round(60 * len(queries) / wall, 2),
        "login_cpu_s": round(login_cpu, 2),
    }


def slope(rows: list[dict], key: str) -> dict:
    """Least squares of log(figure) on log(nodes): the exponent, and its figure at 128."""
    points = [(math.log(r["nodes"]), math.log(r[key])) for r in rows if r[key] and r[key] > 0]
    if len(points) < 2:
        return {"exponent": None, "at_128": None}
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return {"exponent": round(b, 3), "at_128": round(math.exp(my + b * (math.log(128) - mx)), 4)}


def main() -> None:
    parser = harness.parser(__doc__, "slurm_scale.json")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--tmp", type=Path, default=Path("/tmp/ddpflow-bench-scale"))
    args = parser.parse_args()
    result = {**harness.head("slurm_scale", description=DESCRIPTION), "rows": []}
    try:
        for nodes in args.nodes:
            cluster("down")
            cluster("up", str(nodes))
            row = run_size(nodes, args.epochs, args.tmp)
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
    finally:
        cluster("down")
    rows = result["rows"]
    keys = (*FIGURES, "login_cpu_s")
    result["growth"] = {key: slope(rows, key) for key in keys}
    result["conditions"] = {
        "cluster": "tests/slurm/cluster.sh up N: N slurmd in network namespaces on this one "
        "machine (all ranks share its cores)",
        "job": f"digits, cnn (8 channels), {args.epochs} epochs, global batch 64, 1 CPU rank "
        "per node, snakemake --profile slurm as shipped, staging on the login node",
    }
    head = ["nodes", *keys]
    print(harness.markdown_table(head, [[r["nodes"], *(r[k] for k in keys)] for r in rows]))
    print(json.dumps(result["growth"], indent=1))
    harness.write(result, args.out)


if __name__ == "__main__":
    main()
