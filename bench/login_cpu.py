"""Login-node CPU of a whole workflow on the Slurm test cluster: what `snakemake --profile
slurm` and everything it starts on the login node (rule scripts, sbatch, sacct) use, while
staging and training run in Slurm jobs.

Needs the real test cluster (`bash tests/slurm/cluster.sh up` as root, then
`eval "$(bash tests/slurm/cluster.sh env)"`). It writes an image folder of --images 32x32 PNGs
(10 classes), a config that stages it in a Slurm job (machine.stage) and trains a CNN on
2 nodes x 2 CPU ranks for --epochs, runs the shipped profile (profiles/slurm, its 30 s
status checks) and measures:

* the login node's CPU seconds: os.wait4's rusage of Snakemake and every process it started
  and reaped (exact, whatever their life);
* the largest single login-node process: every descendant of Snakemake sampled from /proc
  twice a second (utime + stime; a process living under half a second is missed, and can
  use at most that);
* the wall time, and from the stage log and train_summary.json where staging and training ran.

    python bench/login_cpu.py --images 20000 --epochs 40 \
        --out bench/results/cpu-2026-11-26/login_cpu.json
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import harness
import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

TICK = os.sysconf("SC_CLK_TCK")


def write_images(folder: Path, count: int, seed: int = 0) -> None:
    """count 32x32 RGB PNGs in 10 class folders: class c brightens a band of rows."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in range(10):
        (folder / "train" / f"class{c}").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        c = i % 10
        pixels = rng.integers(0, 120, (32, 32, 3), dtype=np.uint8)
        pixels[3 * c : 3 * c + 3] += 120
        Image.fromarray(pixels).save(folder / "train" / f"class{c}" / f"{i:06d}.png")


def config_for(args) -> dict:
    return {
        "data": {"source": "image_folder", "root": "images", "image_size": [32, 32], "channels": 3},
        "model": {"name": "cnn"},
        "train": {
            "epochs": args.epochs,
            "progress": False,
            "global_batch_size": 128,
            "micro_batch_size": 32,
        },
        "machine": {
            "nodes": 2,
            "cpu_ranks_per_node": 2,
            "partition": args.partition,
            "account": args.account,
            "mem_gb": 2,
            "time_min": 120,
            "stage": {"cpus": 4, "mem_gb": 2, "time_min": 60},
        },
        "runs": [{"name": "cnn"}],
    }


def descendants(root: int) -> dict[int, tuple[int, str]]:
    """{pid: (CPU ticks so far, command)} of root and every process below it."""
    parents, info = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        parents[int(entry.name)] = int(fields[1])
        info[int(entry.name)] = (int(fields[11]) + int(fields[12]), cmd.strip()[:160])
    keep, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in keep:
                keep.add(child)
                frontier.append(child)
    return {pid: info[pid] for pid in keep if pid in info}


def run_workflow(workdir: Path) -> dict:
    snakemake = str(Path(sys.executable).parent / "snakemake")
    cmd = [snakemake, "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir)]
    cmd += ["--configfile", str(workdir / "config.yaml"), "--profile", str(REPO / "profiles/slurm")]
    env = {**os.environ, "PYTHONPATH": str(REPO / "workflow")}
    log = open(workdir / "snakemake.log", "w")  # noqa: SIM115 - closed below
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    peak: dict[int, tuple[int, str]] = {}
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        for child, (ticks, command) in descendants(proc.pid).items():
            if ticks >= peak.get(child, (-1, ""))[0]:
                peak[child] = (ticks, command)
        time.sleep(0.5)
    wall = time.monotonic() - start
    log.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    top = sorted(peak.values(), reverse=True)[:5]
    return {
        "returncode": proc.returncode,
        "wall_s": round(wall, 1),
        "login_cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "login_cpu_percent_of_wall": round(100 * (usage.ru_utime + usage.ru_stime) / wall, 3),
        "login_max_rss_mib": round(usage.ru_maxrss / 1024, 1),
        "largest_processes": [{"cpu_s": round(t / TICK, 2), "command": c} for t, c in top],
    }


def main() -> None:
    parser = harness.parser(__doc__, None)
    parser.add_argument("--images", type=int, default=20000)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--partition", default="debug")
    parser.add_argument("--account", default="ddpflow")
    parser.add_argument("--tmp", default="/tmp/ddpflow-bench-login")
    args = parser.parse_args()
    workdir = Path(args.tmp)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    started = harness.now()
    began = time.monotonic()
    write_images(workdir / "images", args.images)
    print(f"wrote {args.images} images in {time.monotonic() - began:.0f}s", flush=True)
    (workdir / "config.yaml").write_text(yaml.safe_dump(config_for(args)))
    row = run_workflow(workdir)
    stage_log = next((workdir / "logs/stage").glob("*.log"), None)
    staged = stage_log.read_text() if stage_log else ""
    where = re.search(r"in Slurm job (\d+) on (\S+)", staged)
    last = staged.splitlines()[-1] if staged else None
    row["staging"] = {"job": where and where[1], "node": where and where[2], "line": last}
    summary = workdir / "results/runs/cnn/train_summary.json"
    if summary.is_file():
        train = json.loads(summary.read_text())
        keys = ("slurm_job_id", "hosts", "world_size", "epochs", "wall_seconds", "train_seconds")
        row["training"] = {k: train.get(k) for k in keys}
    print(json.dumps(row, indent=2))
    if args.out:
        sinfo = subprocess.run(["sinfo", "--version"], capture_output=True, text=True)
        result = {
            **harness.head("login_cpu"),
            "started": started,
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "slurm": sinfo.stdout.strip(),
            "conditions": {
                "cluster": "tests/slurm/cluster.sh: 2 slurmd nodes in network namespaces on "
                "the same 2-core machine (the login node's processes and the jobs share it)",
                "workflow": f"{args.images} 32x32 PNGs (image folder), staged in a Slurm job "
                f"(machine.stage cpus 4); cnn, {args.epochs} epochs on 2 nodes x 2 CPU ranks; "
                "snakemake --profile profiles/slurm as shipped (status checks every 30 s, "
                "ddpflow's shared sacct every 15 s)",
                "login_cpu": "os.wait4 rusage of snakemake and every process it started and "
                "reaped (utime + stime)",
            },
            "rows": [row],
        }
        harness.write(result, args.out)


if __name__ == "__main__":
    main()
