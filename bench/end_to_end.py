"""End to end: ddpflow's default workflow against the same job written as a standalone PyTorch
Lightning script and as the raw PyTorch DDP tutorial script, from command to test accuracy.

* ``ddpflow``: ``snakemake --cores 2`` in a fresh directory holding only the shipped config
  (overhead.py's run: staging, training with per-epoch validation and checkpoints, the
  in-training evaluation, the report);
* ``lightning``: ``python bench/peers/lightning_digits.py`` (Trainer, strategy ddp, 2 CPU
  devices), with bench/.peers-site on its PYTHONPATH (bench/install-peers);
* ``raw``: ``python bench/peers/raw_digits.py`` (mp.spawn, gloo, DDP, DistributedSampler).

The same job for all three (bench/peers/digits_job.py): digits split as ddpflow stages it,
ddpflow's CNN and initial weights, epochs, global batch (the peers' per-rank batch is
ddpflow's micro-batch, no accumulation), steps per epoch, SGD and lr schedule, 2 CPU ranks.
Each run starts in a fresh temporary directory; its wall time is the harness's, from starting
the command to its exit. The three alternate run by run (order flipped every repeat) so that
background load hits all of them; the table gives the median and the range.

    python bench/end_to_end.py                      # 3 repeats of each, ~3 min on 2 cores
    python bench/end_to_end.py --repeats 1 --epochs 1 --only lightning raw
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import overhead
import yaml
from ddpflow import config as ddpconfig
from workers import lightning_version, peers_env

REPO = Path(__file__).resolve().parents[1]
PEERS = ("ddpflow", "lightning", "raw")
SCRIPTS = {name: REPO / "bench" / "peers" / f"{name}_digits.py" for name in ("lightning", "raw")}
TIMEOUT_S = 1800


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, "peers.json")
    p.add_argument("--config", type=Path, default=REPO / "config" / "config.yaml")
    p.add_argument("--epochs", type=int, default=None, help="override train.epochs (smoke)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each")
    p.add_argument("--only", nargs="+", choices=PEERS, default=list(PEERS))
    p.add_argument("--cores", type=int, default=2, help="snakemake --cores")
    return p.parse_args(argv)


def job_config(args: argparse.Namespace, tmp: Path) -> tuple[Path, dict]:
    """The config all three run (the shipped one, or a copy with --epochs) and its run."""
    config = args.config
    if args.epochs is not None:
        text = yaml.safe_load(args.config.read_text())
        text.setdefault("train", {})["epochs"] = args.epochs
        config = tmp / "config.yaml"
        config.write_text(yaml.safe_dump(text, sort_keys=False))
    return config, ddpconfig.resolve_runs(ddpconfig.load(config))[0]


def run_ddpflow(config: Path, cores: int) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="ddpflow-peers-"))
    try:
        wall, _ = overhead.snakemake(workdir, overhead.fresh_workdir(config, workdir), cores)
        _, train, ev = overhead.run_outputs(workdir)
        manifest_file = next((workdir / "results" / "staged").glob("*/manifest.json"))
        sizes = json.loads(manifest_file.read_text())["sizes"]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "wall_s": wall,
        "test_accuracy": ev["accuracy"],
        "test_samples": sizes["test"],
        "test_samples_counted": ev["samples_evaluated"],
        "train_samples": sizes["train"],
        "epochs": train["epochs"],
        "world_size": train["world_size"],
        "train_seconds": train["train_seconds"],
    }


def run_script(peer: str, job_file: Path) -> dict:
    """One peer script in a fresh directory; wall time from start to exit."""
    workdir = Path(tempfile.mkdtemp(prefix=f"ddpflow-peers-{peer}-"))
    result = workdir / "result.json"
    cmd = [sys.executable, str(SCRIPTS[peer]), "--job", str(job_file), "--result", str(result)]
    env = peers_env() if peer == "lightning" else None  # Lightning for its script alone
    try:
        start = time.perf_counter()
        proc = subprocess.run(
            cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
        wall = time.perf_counter() - start
        if proc.returncode:
            output = (proc.stdout + proc.stderr)[-3000:]
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output}")
        return {"wall_s": wall, **json.loads(result.read_text())}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_all(args, peers: list[str], config: Path, job_file: Path) -> list[dict]:
    runs = []
    for repeat in range(args.repeats):
        for peer in peers if repeat % 2 == 0 else peers[::-1]:
            print(f"repeat {repeat + 1}/{args.repeats}: {peer} ...", flush=True)
            try:
                if peer == "ddpflow":
                    row = run_ddpflow(config, args.cores)
                else:
                    row = run_script(peer, job_file)
            except (RuntimeError, OSError, subprocess.TimeoutExpired, StopIteration) as exc:
                print(f"{peer} failed: {exc}", file=sys.stderr)
                row = {"error": str(exc)[-3000:]}
            runs.append({"peer": peer, "repeat": repeat, **row})
    return runs


def summarize(runs: list[dict], peer: str) -> dict:
    ok = [r for r in runs if r["peer"] == peer and "error" not in r]
    if not ok:
        failed = [r["error"] for r in runs if r["peer"] == peer]
        return {"error": failed[-1] if failed else "not run"}
    walls = [r["wall_s"] for r in ok]
    keys = ("test_samples", "test_samples_counted", "train_samples", "epochs", "world_size")
    return {
        "wall_s": statistics.median(walls),
        "wall_min_s": min(walls),
        "wall_max_s": max(walls),
        "runs": len(ok),
        "test_accuracy": statistics.median(r["test_accuracy"] for r in ok),
        "test_accuracies": sorted({r["test_accuracy"] for r in ok}),
        **{k: ok[-1][k] for k in keys},
    }


def format_table(report: dict) -> str:
    c, s = report["conditions"], report["summary"]
    lines = [
        f"# end to end: ddpflow's default job ({c['job']}), command start to exit; "
        f"median of {c['repeats']} runs each, alternating",
        f"{'peer':<10} {'wall s':>7} {'min-max':>11} | {'test acc':>8} {'counted':>7} | "
        f"{'train samples x epochs':>22}",
    ]
    for peer, row in s.items():
        if "error" in row:
            lines.append(f"{peer:<10} {'-':>7} {'':>11} | {row['error'].splitlines()[0][:60]}")
            continue
        spread = f"{row['wall_min_s']:.1f}-{row['wall_max_s']:.1f}"
        lines.append(
            f"{peer:<10} {row['wall_s']:7.1f} {spread:>11} | {row['test_accuracy']:8.4f} "
            f"{row['test_samples_counted']:>7} | "
            f"{row['train_samples']:>14} x {row['epochs']:>5}"
        )
    if (ratio := report.get("ddpflow_vs_lightning_wall")) is not None:
        verdict = "meets" if ratio <= 1.0 else "MISSES"
        lines.append(
            f"ddpflow / lightning wall time: {ratio:.2f}x ({verdict} target <= 1.0x: no slower)"
        )
    lines.append(
        "(counted: test samples summed over ranks; Lightning's test DistributedSampler pads "
        "to equal shards, ddpflow and raw score unpadded shards)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    peers = [p for p in PEERS if p in args.only]
    version = lightning_version() if "lightning" in peers else None
    with tempfile.TemporaryDirectory(prefix="ddpflow-peers-job-") as tmp:
        config, job = job_config(args, Path(tmp))
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job))
        if "lightning" in peers and version is None:
            peers.remove("lightning")
        runs = run_all(args, peers, config, job_file)
    report = harness.head(
        "end to end: ddpflow's default workflow vs Lightning and raw DDP scripts",
        conditions=conditions(args, job),
        job=job,
        runs=runs,
        summary={p: summarize(runs, p) for p in PEERS if p in args.only},
    )
    report["provenance"]["versions"]["lightning"] = version
    if "lightning" in args.only and version is None:
        report["summary"]["lightning"] = {
            "error": "Lightning not importable from bench/.peers-site: run bench/install-peers"
        }
    walls = {p: report["summary"].get(p, {}).get("wall_s") for p in ("ddpflow", "lightning")}
    if None not in walls.values():
        report["ddpflow_vs_lightning_wall"] = walls["ddpflow"] / walls["lightning"]
    print(format_table(report), flush=True)
    harness.write(report, args.out)
    return 1 if any("error" in r for r in runs) else 0


def conditions(args: argparse.Namespace, job: dict) -> dict:
    t, m = job["train"], job["machine"]
    ranks = m["nodes"] * m["cpu_ranks_per_node"]
    return {
        "job": f"{job['data']['source']}, {job['model']['name']}, {t['epochs']} epochs, "
        f"global batch {t['global_batch_size']} ({t['micro_batch_size']}/rank), {ranks} CPU "
        "ranks, gloo",
        "config": str(args.config),
        "epochs_override": args.epochs,
        "repeats": args.repeats,
        "cores": args.cores,
        "timing": "perf_counter around each command, start to exit, in a fresh temporary "
        "directory; the peers alternate run by run, order flipped every repeat",
        "ddpflow": "snakemake --cores N --configfile <fresh dir>/config/config.yaml (cold: "
        "staging, train + per-epoch validation + checkpoints, in-train evaluation, report)",
        "lightning": "bench/peers/lightning_digits.py: Trainer(accelerator=cpu, devices=ranks, "
        "strategy=ddp) with its defaults (sanity check, checkpoint, logger, progress bar)",
        "raw": "bench/peers/raw_digits.py: mp.spawn, gloo, DDP, DistributedSampler, "
        "loss.item() per step, all_reduce of correct/total",
        "batch": "the peers' per-rank batch is train.micro_batch_size at the job's world size "
        "(global batch = ddpflow's, no accumulation); their loaders drop each rank's short "
        "last batch (drop_last), so every epoch is ddpflow's floor(n / global batch) steps "
        "(ddpflow's order: one shuffle cut into steps; the peers': DistributedSampler)",
        "shared": "bench/peers/digits_job.py: ddpflow's split, normalisation, model, lr "
        "scaling and schedule; plain torch.optim.SGD in the peers (ddpflow: fused)",
    }


if __name__ == "__main__":
    raise SystemExit(main())
