"""How the workflow scales with the number of runs (issue #27, "Scale measured").

For N runs (default 10, 100, 500), each case in a fresh temporary folder:

* **dag**: `snakemake -n` on a config whose `runs:` list has N entries differing only in
  `train.optimizer.lr` (the shipped config.yaml as every run's base; nothing staged or
  trained, so the dry run plans every job): wall time of the whole command. Beside it, the
  parts measured in this process: `ddpflow.config.check_runs` (the Snakefile's parse: schema
  and checks once per run) and one `ddpflow.config.run_by_name` (what scripts/train.py,
  evaluate.py and track.py each call once per job: it resolves every run again, so N runs
  cost 3N such calls of O(N) each).
* **report**: N synthetic finished runs from one sweep (train_metrics.jsonl,
  train_summary.json, eval_metrics.json in the formats the jobs write; 4 epochs, 10 classes,
  each run with a `sweep` block: an lr grid, a log-uniform weight decay, two models; one run
  in 10 pruned), then `ddpflow.report.build.build_report`: wall time and the bytes of
  report.md, report.html, plots/ and sweep.csv.

Per-run cost = measure / N; ratio = per-run cost at the largest N / at the smallest (1.0 is
linear growth, N_max/N_min is quadratic).

    bench/sweep_scale.py                          # 10, 100, 500: about 3 min on 2 cores
    bench/sweep_scale.py --sizes 10 50 --skip-dag
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import yaml
from ddpflow import config as ddpconfig

REPO = Path(__file__).resolve().parents[1]
CLASSES = [str(c) for c in range(10)]
KEYS = ["train.optimizer.lr", "train.optimizer.weight_decay", "model.name"]


def parse_args(argv):
    parser = harness.parser(__doc__, "sweep_scale.json")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 500])
    parser.add_argument("--skip-dag", action="store_true", help="report only")
    return parser.parse_args(argv)


def runs_config(n: int) -> dict:
    """A sweep of n learning rates (what a researcher writes), the shipped config as base."""
    lrs = [round(0.0001 * (i + 1), 6) for i in range(n)]
    return {"sweep": {"grid": {"train.optimizer.lr": lrs}, "max_runs": max(n, 256)}}


def measure_dag(n: int) -> dict:
    overrides = runs_config(n)
    with tempfile.TemporaryDirectory() as tmp:
        configfile = Path(tmp) / "runs.yaml"
        configfile.write_text(yaml.safe_dump(overrides))
        snakemake = str(Path(sys.executable).parent / "snakemake")
        cmd = [snakemake, "--snakefile", str(REPO / "Snakefile"), "--directory", tmp]
        cmd += ["--cores", "2", "--configfile", str(configfile), "-n", "--quiet", "rules"]
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        start, cpu = time.perf_counter(), _children_cpu()
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
        wall, dry_cpu = time.perf_counter() - start, _children_cpu() - cpu
    if done.returncode != 0:
        raise RuntimeError(f"snakemake -n with {n} runs failed:\n{done.stderr[-3000:]}")
    config = ddpconfig.load(REPO / "config" / "config.yaml", overrides)
    start = time.process_time()
    checked, resolved = ddpconfig.check_runs(config)
    parse = time.process_time() - start
    start = time.process_time()
    ddpconfig.run_by_name(checked, resolved[-1]["name"])
    by_name = time.process_time() - start
    return {
        "runs": n,
        "dry_run_wall_s": wall,
        "dry_run_cpu_s": dry_cpu,
        "check_runs_cpu_s": parse,
        "run_by_name_cpu_s": by_name,
        "run_by_name_calls": 3 * n,
        "run_by_name_total_cpu_s": 3 * n * by_name,
        "loadavg_after": harness.loadavg(),
    }


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _epoch(name: str, epoch: int, val: float) -> dict:
    return {
        "run": name,
        "attempt": 1,
        "epoch": epoch,
        "step": 30 * (epoch + 1),
        "train_loss": 2.0 / (epoch + 1),
        "val_accuracy": val - 0.05 * (3 - epoch),
        "val_loss": 1.5 / (epoch + 1),
        "lr": 0.01,
        "samples_per_s": 2000.0,
        "seconds": dict(data=0.1, forward=0.4, backward_sync=0.8, optimizer=0.1, epoch=1.5),
    }


def _eval(name: str, test: float, summary: dict, block: dict) -> dict:
    correct = round(test * 100)
    matrix = [
        [correct if i == j else (100 - correct) // 9 if j == (i + 1) % 10 else 0 for j in range(10)]
        for i in range(10)
    ]
    total = sum(map(sum, matrix))
    return {
        "run": name,
        "split": "test",
        "accuracy": test,
        "correct": correct * 10,
        "samples_evaluated": total,
        "test_size": total,
        "per_class_accuracy": [row[i] / sum(row) for i, row in enumerate(matrix)],
        "confusion_matrix": matrix,
        "class_names": CLASSES,
        "world_size": 2,
        "hosts": ["node0", "node0"],
        "eval_seconds": 0.4,
        "evaluated_by": "evaluate job",
        "train": summary,
        "provenance": _provenance(name, block),
    }


def _provenance(name: str, block: dict) -> dict:
    config = {"name": name, "model": {"name": block["values"]["model.name"]}, "sweep": block}
    return {
        "config": config,
        "git_commit": "0" * 40,
        "versions": {"torch": "2.14.1"},
        "hostnames": ["node0"],
        "created": "2026-11-24T00:00:00+00:00",
    }


def write_run(root: Path, i: int, n: int) -> dict:
    """One synthetic finished run of the sweep; every tenth one pruned after epoch 1."""
    lr, model = (0.1, 0.05, 0.02)[i % 3], ("cnn", "resnet18")[i % 2]
    wd = 10 ** (-5 + 3 * ((i * 7) % n) / n)
    name, val = f"lr{lr}-wd{wd:.3e}-{model}-{i}", 0.6 + 0.35 * ((i * 37) % n) / n
    block = {
        "values": dict(zip(KEYS, (lr, wd, model), strict=True)),
        "keys": KEYS,
        "log_keys": [KEYS[1]],
        "origin": "random",
        "prune": {"after_epochs": 1},
    }
    folder = root / name
    folder.mkdir(parents=True)
    epochs = [_epoch(name, e, val) for e in range(2 if i % 10 == 9 else 4)]
    (folder / "train_metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in epochs))
    summary = {
        "world_size": 2,
        "nodes": 1,
        "samples_per_s": 2000.0,
        "wall_seconds": 8.0,
        "epochs": 4,
        "attempts": 1,
        "hosts": ["node0", "node0"],
        "phase_seconds": {"data": 0.4, "forward": 1.6},
    }
    if i % 10 == 9:
        summary["pruned"] = {
            "epoch": 1,
            "val_accuracy": epochs[-1]["val_accuracy"],
            "median": 0.9,
            "runs": 4,
        }
    (folder / "train_summary.json").write_text(json.dumps(summary))
    (folder / "eval_metrics.json").write_text(json.dumps(_eval(name, 1.5 - val, summary, block)))
    return {
        "name": name,
        "train_metrics": str(folder / "train_metrics.jsonl"),
        "eval_metrics": str(folder / "eval_metrics.json"),
        "sweep": block,
    }


def measure_report(n: int) -> dict:
    from ddpflow.report.build import build_report  # matplotlib: here only

    with tempfile.TemporaryDirectory() as tmp:
        runs = [write_run(Path(tmp) / "runs", i, n) for i in range(n)]
        start, cpu = time.perf_counter(), time.process_time()
        paths = build_report(runs, Path(tmp) / "report")
        wall, build_cpu = time.perf_counter() - start, time.process_time() - cpu
        plots = sum(p.stat().st_size for p in (Path(tmp) / "report" / "plots").glob("*.png"))
        sizes = {
            "markdown_bytes": paths["markdown"].stat().st_size,
            "html_bytes": paths["html"].stat().st_size,
            "plots_bytes": plots,
            "plot_files": len([k for k in paths if k.startswith("plot_")]),
            "sweep_csv_bytes": paths["sweep_csv"].stat().st_size,
            "summary_json_bytes": paths["summary_json"].stat().st_size,
        }
    return {
        "runs": n,
        "build_wall_s": wall,
        "build_cpu_s": build_cpu,
        **sizes,
        "loadavg_after": harness.loadavg(),
    }


def per_run(rows: list[dict], keys: list[str]) -> dict:
    """Each measure / N at each N, and the ratio of the largest N's to the smallest N's."""
    out = {}
    for key in keys:
        costs = [row[key] / row["runs"] for row in rows]
        ratio = costs[-1] / costs[0] if costs[0] else None
        out[key] = {
            "per_run": dict(zip([r["runs"] for r in rows], costs, strict=True)),
            "ratio_largest_to_smallest": ratio,
        }
    return out


def table(report: dict) -> str:
    sizes = report["sizes"]
    rows = []
    for section in ("dag", "report"):
        for key, entry in report.get(f"{section}_per_run", {}).items():
            totals = [row[key] for row in report[section]]
            cells = [f"{t:.3g} ({t / n:.3g}/run)" for t, n in zip(totals, sizes, strict=True)]
            rows.append([key, *cells, f"{entry['ratio_largest_to_smallest']:.2f}"])
    return harness.markdown_table(["measure", *(f"N={n}" for n in sizes), "ratio"], rows)


CONDITIONS = {
    "dag": "snakemake -n --quiet rules, fresh folder (every job planned), shipped config.yaml "
    "+ a sweep grid of N train.optimizer.lr values; run_by_name: one call as a "
    "train/evaluate/track job's script makes it (3 per run); one measurement per N",
    "timing": "CPU seconds (user + sys; of the snakemake process for dag) are the measure: the "
    "machine was shared (load average in machine and per case), which stretches wall time, not "
    "CPU time; wall time beside it",
    "report": "build_report on N synthetic finished runs of one sweep (3 keys, one log-uniform; "
    "4 epochs, 10 classes, 1 in 10 pruned); one measurement",
}


def main(argv=None) -> int:
    args = parse_args(argv)
    sizes = sorted(args.sizes)
    # the login node's work: torch's installed version, not imported
    report = harness.head(
        "scale with the run count: snakemake -n, report build time and size",
        devices=False,
        sizes=sizes,
        conditions=CONDITIONS,
    )
    if not args.skip_dag:
        report["dag"] = [measure_dag(n) for n in sizes]
        report["dag_per_run"] = per_run(
            report["dag"],
            [
                "dry_run_cpu_s",
                "dry_run_wall_s",
                "check_runs_cpu_s",
                "run_by_name_cpu_s",
                "run_by_name_total_cpu_s",
            ],
        )
    report["report"] = [measure_report(n) for n in sizes]
    report["report_per_run"] = per_run(
        report["report"],
        ["build_cpu_s", "build_wall_s", "markdown_bytes", "html_bytes", "plots_bytes"],
    )
    print(table(report), flush=True)
    return harness.write(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
