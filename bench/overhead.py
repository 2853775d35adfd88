"""Pipeline overhead: what Snakemake + submitit + process start-up + staging add to compute.

Runs the whole default workflow as a user would, in a fresh directory with the shipped
config/config.yaml copied in as the configfile:

    snakemake --snakefile <repo>/Snakefile --directory <tmp> --cores 2 --configfile <tmp>/...

and splits its wall time into the compute inside it and everything around it:

* compute: ``train_seconds`` from results/runs/<run>/train_summary.json (rank 0's fit():
  every epoch's training and validation) and ``eval_seconds`` from eval_metrics.json;
* per rule: start/finish from Snakemake's job records (.snakemake/metadata), and from the rule logs
  the seconds inside (stage: staging; train/evaluate: submitit submit -> all ranks done);
* the rest: Snakemake start-up/DAG (also timed alone as a dry run), each rule's Python
  start-up, submitit's process spawn + import + process-group rendezvous, loading data,
  writing outputs, the report.

    python bench/overhead.py [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TIMEOUT_S = 1800
INSIDE = re.compile(r"(?:ranks done|staged .*) in ([\d.]+)s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, "overhead.json")
    p.add_argument("--config", type=Path, default=REPO / "config" / "config.yaml")
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    return p.parse_args(argv)


def snakemake_bin() -> str:
    """The snakemake beside this Python (the project's venv), else the one on PATH."""
    beside = BIN / "snakemake"
    return str(beside) if beside.exists() else (shutil.which("snakemake") or "snakemake")


def snakemake(workdir: Path, configfile: Path, cores: int, *extra: str) -> tuple[float, str]:
    """Run the workflow in workdir; (wall seconds, combined output). Raises on failure."""
    cmd = [
        snakemake_bin(),
        "--snakefile",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        "--cores",
        str(cores),
        "--configfile",
        str(configfile),
        *extra,
    ]
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=workdir
    )
    seconds = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-3000:]}")
    return seconds, output


def rule_windows(workdir: Path) -> dict[str, list[float]]:
    """Rule name -> [start, finish] epoch seconds of its job, from Snakemake's own job
    records (.snakemake/metadata: starttime and endtime per output, sub-second)."""
    windows: dict[str, list[float]] = {}
    for record in (workdir / ".snakemake" / "metadata").glob("*"):
        meta = json.loads(record.read_text())
        if meta.get("starttime") is None or meta.get("endtime") is None:
            continue
        start, end = windows.setdefault(meta["rule"], [meta["starttime"], meta["endtime"]])
        windows[meta["rule"]] = [min(start, meta["starttime"]), max(end, meta["endtime"])]
    return dict(sorted(windows.items(), key=lambda item: item[1][0]))


def seconds_inside(rule_log: Path) -> float | None:
    """The rule's own account of its main work (staging, or submit -> ranks done)."""
    if not rule_log.is_file():
        return None
    found = INSIDE.findall(rule_log.read_text())
    return float(found[-1]) if found else None


def rule_table(workdir: Path, run: str) -> list[dict]:
    windows = rule_windows(workdir)
    rule_logs = {
        "stage": next(iter(sorted((workdir / "logs" / "stage").glob("*.log"))), None),
        "train": workdir / "logs" / "train" / f"{run}.log",
        "evaluate": workdir / "logs" / "evaluate" / f"{run}.log",
        "report": workdir / "logs" / "report.log",
    }
    rows = []
    for rule, (start, end) in windows.items():
        log = rule_logs.get(rule)
        rows.append(
            {
                "rule": rule,
                "seconds": end - start,
                "inside_seconds": seconds_inside(log) if log else None,
            }
        )
    return rows


def breakdown(total: float, dry: float, rules: list[dict], train: dict, ev: dict) -> dict:
    compute = train["train_seconds"] + ev["eval_seconds"]
    by_rule = {row["rule"]: row for row in rules}
    out = {
        "total_wall_s": total,
        "snakemake_dry_run_s": dry,
        "rules_s": sum(row["seconds"] for row in rules),
        "train_fit_s": train["train_seconds"],
        "train_task_wall_s": train["wall_seconds"],
        "train_pure_training_s": train["phase_seconds"].get("train"),
        "eval_s": ev["eval_seconds"],
        "compute_s": compute,
        "overhead_s": total - compute,
        "overhead_fraction": (total - compute) / total,
    }
    out["outside_rules_s"] = total - out["rules_s"]
    for rule, task_wall in (("train", train["wall_seconds"]), ("evaluate", ev["eval_seconds"])):
        inside = by_rule.get(rule, {}).get("inside_seconds")
        if inside is not None:
            # submit -> done minus the task's own wall: spawn, imports, rendezvous, polling
            out[f"{rule}_launch_s"] = inside - task_wall
    return out


ROWS = (
    ("total_wall_s", "snakemake, whole workflow (wall)"),
    ("snakemake_dry_run_s", "  snakemake start-up + DAG alone (dry run)"),
    ("outside_rules_s", "  outside any rule (start-up, DAG, scheduling)"),
    ("train_fit_s", "  train: fit() on rank 0 (train + per-epoch val)"),
    ("train_pure_training_s", "    of which training epochs only"),
    ("train_task_wall_s", "  train: task wall on rank 0 (data, model, fit, save)"),
    ("train_launch_s", "  train: submit->done minus task wall (spawn, import)"),
    ("eval_s", "  evaluate: eval_seconds"),
    ("evaluate_launch_s", "  evaluate: submit->done minus eval_seconds"),
    ("compute_s", "compute (train fit + eval)"),
    ("overhead_s", "overhead = total - compute"),
)


def format_table(result: dict) -> str:
    b = result["breakdown"]
    lines = [
        f"# pipeline overhead: default workflow, {result['conditions']['ranks']} ranks, "
        f"--cores {result['conditions']['cores']}; rule times from Snakemake's job records",
        f"{'rule':<10} {'wall s':>7} {'inside s':>9}",
    ]
    for row in result["rules"]:
        inside = f"{row['inside_seconds']:9.1f}" if row["inside_seconds"] is not None else "-"
        lines.append(f"{row['rule']:<10} {row['seconds']:7.0f} {inside:>9}")
    lines.append(f"{'component':<52} {'seconds':>8}")
    for key, label in ROWS:
        if b.get(key) is not None:
            lines.append(f"{label:<52} {b[key]:8.1f}")
    lines.append(f"{'overhead fraction of wall time':<52} {b['overhead_fraction']:8.1%}")
    return "\n".join(lines)


def fresh_workdir(config: Path, workdir: Path) -> Path:
    """The user's start: a directory holding only the config; returns the configfile."""
    configfile = workdir / "config" / "config.yaml"
    configfile.parent.mkdir(parents=True)
    shutil.copy(config, configfile)
    return configfile


def run_outputs(workdir: Path) -> tuple[Path, dict, dict]:
    """(run directory, train_summary.json, eval_metrics.json) of the workflow's one run."""
    run_dir = next((workdir / "results" / "runs").iterdir())
    train = json.loads((run_dir / "train_summary.json").read_text())
    ev = json.loads((run_dir / "eval_metrics.json").read_text())
    return run_dir, train, ev


def measure(args: argparse.Namespace, workdir: Path) -> dict:
    configfile = fresh_workdir(args.config, workdir)
    dry, _ = snakemake(workdir, configfile, args.cores, "--dry-run")
    total, output = snakemake(workdir, configfile, args.cores)
    run_dir, train, ev = run_outputs(workdir)
    rules = rule_table(workdir, run_dir.name)
    return {
        "run": run_dir.name,
        "rules": rules,
        "breakdown": breakdown(total, dry, rules, train, ev),
        "train_summary": train,
        "eval": {k: ev[k] for k in ("accuracy", "eval_seconds", "samples_evaluated")},
        "conditions": {
            "config": str(args.config),
            "cores": args.cores,
            "ranks": train["world_size"],
            "epochs": train["epochs"],
            "launcher": train["launcher"],
            "workdir": str(workdir),
            "timing": "one cold run in a fresh directory (staging included); perf_counter "
            "around the snakemake command; rule windows from Snakemake's job records "
            "(.snakemake/metadata)",
        },
        "snakemake_output_tail": output[-2000:],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="ddpflow-overhead-"))
    try:
        result = {
            **harness.head("pipeline overhead: whole default workflow vs its compute"),
            **measure(args, workdir),
        }
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(format_table(result), flush=True)
    return harness.write(result, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
