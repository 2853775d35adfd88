"""What BatchNorm's batch does to the science of the default job (digits, the built-in CNN
with BatchNorm, 12 epochs, global batch 64): runs at BatchNorm batches of 32, 16 and 8 (the
micro-batches `micro_batch_size: auto` resolves to at 1-2, 4 and 8 ranks with
`max_micro_batch_size: 32`), each with several `train.seed` values, in one run of the real
workflow.

Each run pins `train.micro_batch_size` to the number, which is then its normalisation batch
(train.norm_batch_size: BatchNorm normalises each micro-batch on one rank) and the unit of the
data order and random draws (training/schedule.py). The shipped config keeps a batch of 32 at
every world size (groups of ranks share it where auto resolves a smaller micro-batch), so the
16 and 8 rows are the science of writing norm_batch_size 16 or 8: this measures how much that
changes: test accuracy and loss (mean, standard deviation, range over the seeds) and the
training time, for each batch.

One workflow in a fresh directory, as a user runs it (`snakemake --cores 2` with the shipped
config.yaml copied in, overhead.py's run), whose `runs:` list holds one run per (batch,
seed), the cap set to null; the 32 / seed-0 run has the shipped default run's training
fingerprint. Every run trains at `--ranks` CPU ranks (default 2): the micro-batches, their
order and draws do not depend on the world size (tests/test_world_size.py), so a batch here
trains what it trains at 4 or 8 ranks, up to float summation order; the --check-seeds (0)
train 16 and 8 once more at 4 and 8 ranks to measure that.

    python bench/micro_batch.py             # 32, 16, 8 x seeds 0, 1, 2 + 2 checks: ~6 min
    python bench/micro_batch.py --micro-batches 32 16 --seeds 3 --check-seeds 3 --epochs 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness
import overhead
import yaml
from ddpflow import config as ddpconfig
from ddpflow.config.machine import splitting_micro_batch

REPO = Path(__file__).resolve().parents[1]
WORLD_SIZES = (1, 2, 4, 8)  # the user's CPU-rank edits (issue 32)
MEASURES = ("test_accuracy", "test_loss", "train_seconds", "wall_seconds")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, "micro_batch.json")
    p.add_argument("--config", type=Path, default=REPO / "config" / "config.yaml")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[32, 16, 8])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="train.seed values")
    p.add_argument("--ranks", type=int, default=2, help="machine.cpu_ranks_per_node")
    p.add_argument(
        "--check-seeds",
        type=int,
        nargs="*",
        default=[0],
        help="these seeds also train each micro-batch at the world size auto picks it for",
    )
    p.add_argument("--epochs", type=int, default=None, help="override train.epochs (smoke)")
    p.add_argument("--cores", type=int, default=2, help="snakemake --cores")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    return p.parse_args(argv)


def run_name(micro: int, seed: int, world: int | None = None) -> str:
    return f"micro{micro}-seed{seed}" + (f"-{world}ranks" if world else "")


def plan(micro_batches: list[int], seeds: list[int]) -> list[tuple[int, int]]:
    """(micro-batch, seed) in the order the runs are listed: seed by seed, the micro-batches'
    order flipped every seed, so that a drift in the machine's load hits all of them."""
    out = []
    for i, seed in enumerate(seeds):
        order = micro_batches if i % 2 == 0 else micro_batches[::-1]
        out += [(micro, seed) for micro in order]
    return out


def shipped(args: argparse.Namespace, ranks: int, seed: int = 0) -> dict:
    """The shipped config at `ranks` CPU ranks with train.seed `seed` (and --epochs)."""
    config = yaml.safe_load(args.config.read_text())
    config.setdefault("machine", {})["cpu_ranks_per_node"] = ranks
    config.setdefault("train", {})["seed"] = seed
    if args.epochs is not None:
        config["train"]["epochs"] = args.epochs
    return config


def auto_world_sizes(args: argparse.Namespace) -> dict[int, int | None]:
    """World size -> the micro-batch the shipped config's auto resolves to there."""
    (run,) = ddpconfig.check_runs(shipped(args, args.ranks))[1]
    global_batch, cap = run["train"]["global_batch_size"], run["micro_batch"]["max"]
    return {w: splitting_micro_batch(global_batch, cap, [w]) for w in WORLD_SIZES}


def check_plan(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """(micro-batch, seed, world size): each micro-batch that auto does not pick at --ranks
    once more at the largest world size auto picks it for, for each of --check-seeds (those
    among --seeds: each is compared with its run at --ranks)."""
    auto = auto_world_sizes(args)
    out = []
    for micro in args.micro_batches:
        worlds = [w for w, m in auto.items() if m == micro]
        if worlds and args.ranks not in worlds:
            seeds = [seed for seed in args.check_seeds if seed in args.seeds]
            out += [(micro, seed, max(worlds)) for seed in seeds]
    return out


def bench_config(args: argparse.Namespace) -> dict:
    """The shipped config with the bench's runs: one per (micro-batch, seed) at --ranks CPU
    ranks, then the check runs at their own world size; the micro-batch pinned in each."""
    config = shipped(args, args.ranks)
    del config["train"]["seed"]

    def entry(micro: int, seed: int, world: int | None = None) -> dict:
        train = {"micro_batch_size": micro, "max_micro_batch_size": None, "seed": seed}
        run = {"name": run_name(micro, seed, world), "train": train}
        return {**run, "machine": {"cpu_ranks_per_node": world}} if world else run

    config["runs"] = [entry(m, s) for m, s in plan(args.micro_batches, args.seeds)]
    config["runs"] += [entry(m, s, w) for m, s, w in check_plan(args)]
    return config


def same_science_as_shipped(args: argparse.Namespace, config: dict) -> dict[str, bool]:
    """Per bench run: does it have the training fingerprint of the shipped config's default
    run with that seed at that run's world size? True where auto picks its micro-batch."""
    out = {}
    for run in ddpconfig.check_runs(config)[1]:
        ranks, seed = run["machine"]["cpu_ranks_per_node"], run["train"]["seed"]
        (default,) = ddpconfig.check_runs(shipped(args, ranks, seed))[1]
        out[run["name"]] = ddpconfig.training_fingerprint(
            default
        ) == ddpconfig.training_fingerprint(run)
    return out


def batchnorm_rows(args: argparse.Namespace, global_batch: int) -> list:
    """What BatchNorm computes over for each micro-batch, and where auto picks it."""
    auto, ranks, rows = auto_world_sizes(args), args.ranks, []
    for micro in args.micro_batches:
        per_step = global_batch // micro
        rows.append(
            {
                "micro_batch": micro,
                "batchnorm_batch_samples": micro,
                "micro_batches_per_step": per_step,
                "auto_picks_it_at_world_sizes": [w for w, m in auto.items() if m == micro],
                "ranks_here": ranks,
                # each of rank 0's forwards updates the running statistics the model keeps
                "rank0_forwards_per_step_here": per_step // ranks,
                "rank0_forwards_per_step_at_auto_world_sizes": {
                    str(w): per_step // w for w, m in auto.items() if m == micro
                },
            }
        )
    return rows


def run_row(workdir: Path, micro: int, seed: int, world: int | None = None) -> dict:
    """One run's outcome from the files the workflow wrote."""
    folder = workdir / "results" / "runs" / run_name(micro, seed, world)
    train = json.loads((folder / "train_summary.json").read_text())
    ev = json.loads((folder / "eval_metrics.json").read_text())
    epochs = [
        json.loads(line) for line in (folder / "train_metrics.jsonl").read_text().splitlines()
    ]
    last = epochs[-1]
    return {
        "run": run_name(micro, seed, world),
        "micro_batch": train["micro_batch"],
        "seed": seed,
        "world_size": train["world_size"],
        "accumulation_steps": train["accumulation_steps"],
        "steps": train["steps"],
        "epochs": train["epochs"],
        "test_accuracy": ev["accuracy"],
        "test_loss": ev["loss"],
        "test_samples": ev["samples_evaluated"],
        "final_train_loss": last.get("train_loss"),
        "final_val_accuracy": last.get("val_accuracy"),
        "train_seconds": train["train_seconds"],
        "wall_seconds": train["wall_seconds"],
        "samples_per_s": train["samples_per_s"],
        "finished_at": datetime.datetime.fromtimestamp(
            (folder / "train_summary.json").stat().st_mtime, datetime.UTC
        ).isoformat(timespec="milliseconds"),
    }


def spread(values: list[float]) -> dict:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "all": values,
    }


def summarize(rows: list[dict], micro_batches: list[int]) -> list[dict]:
    out = []
    for micro in micro_batches:
        mine = sorted((r for r in rows if r["micro_batch"] == micro), key=lambda r: r["seed"])
        out.append(
            {
                "micro_batch": micro,
                "runs": len(mine),
                "seeds": [r["seed"] for r in mine],
                **{key: spread([r[key] for r in mine]) for key in MEASURES},
            }
        )
    return out


def format_table(report: dict) -> str:
    c = report["conditions"]
    lines = [
        f"# micro-batch and the science: {c['job']}; {c['ranks']} CPU ranks; mean +- std "
        f"(min-max) over seeds {report['seeds']}",
        "| micro-batch | auto at ranks | test accuracy | test loss | train s | task wall s |",
        "|--:|--|--|--|--|--|",
    ]
    auto = {r["micro_batch"]: r["auto_picks_it_at_world_sizes"] for r in report["batchnorm"]}
    for s in report["by_micro_batch"]:
        a, loss = s["test_accuracy"], s["test_loss"]
        lines.append(
            f"| {s['micro_batch']} | {', '.join(map(str, auto[s['micro_batch']])) or '-'} "
            f"| {a['mean']:.4f} +- {a['std']:.4f} ({a['min']:.4f}-{a['max']:.4f}) "
            f"| {loss['mean']:.4f} +- {loss['std']:.4f} "
            f"| {s['train_seconds']['mean']:.1f} +- {s['train_seconds']['std']:.1f} "
            f"| {s['wall_seconds']['mean']:.1f} +- {s['wall_seconds']['std']:.1f} |"
        )
    for c in report["at_auto_world_size"]:
        here = c["at_ranks_here"]
        lines.append(
            f"check: micro-batch {c['micro_batch']} seed {c['seed']} at {c['world_size']} ranks "
            f"(auto's) / at {here['world_size']}: test accuracy {c['test_accuracy']:.4f} / "
            f"{here['test_accuracy']:.4f}, test loss {c['test_loss']:.4f} / "
            f"{here['test_loss']:.4f}, last epoch's loss {c['final_train_loss']:.4f} / "
            f"{here['final_train_loss']:.4f}"
        )
    return "\n".join(lines)


def shown_path(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)


def conditions(args: argparse.Namespace, config: dict, run: dict, wall: float, rows: list) -> dict:
    train, ranks, tested = run["train"], args.ranks, rows[0]["test_samples"]
    return {
        "job": f"{run['data']['source']}, {run['model']['name']}, {train['epochs']} epochs, "
        f"global batch {train['global_batch_size']}, lr {train['optimizer']['lr']}",
        "config": shown_path(args.config),
        "ranks": ranks,
        "cores": args.cores,
        "runs_listed": [r["name"] for r in config["runs"]],
        "runs_trained_in_order": [r["run"] for r in sorted(rows, key=lambda r: r["finished_at"])],
        "order": "the runs are listed seed by seed, the micro-batches' order flipped every seed; "
        "Snakemake picks the order they train in (runs_trained_in_order, by the time each "
        "wrote its train_summary.json)",
        "workflow": "one snakemake --cores "
        f"{args.cores} in a fresh directory, all runs in its runs: list; the train rule takes "
        f"{ranks} threads (its ranks), so with --cores {args.cores} the runs train one after "
        f"another; whole workflow {wall:.0f} s (staging once, train, evaluate, report)",
        "world_size": f"the seed runs at {ranks} CPU ranks, not at the world size auto picks "
        "each micro-batch for: the micro-batches, their order and their random draws do not "
        "depend on the world size (tests/test_world_size.py: 1, 2, 4 ranks agree to float "
        "rounding per step), so they train what a run at 4 or 8 ranks with the same micro-batch "
        "trains, up to the gradients' summation order (whose rounding grows over the run's "
        "steps) and BatchNorm's running statistics (see batchnorm). The at_auto_world_size rows "
        "measure that difference: seed "
        f"{', '.join(map(str, args.check_seeds)) or '(none)'} once more at the world size auto "
        f"picks (its ranks oversubscribe the {args.cores} cores: their times are not comparable)",
        "batchnorm": "training normalises every BatchNorm layer with the statistics of one "
        "micro-batch on one rank (per channel, over micro-batch x height x width), the run's "
        "normalisation batch here (a pinned micro_batch_size with train.norm_batch_size auto): "
        f"{', '.join(map(str, args.micro_batches))} samples. The running mean/variance that "
        "evaluation uses are one rank's stepping through every micro-batch in the global order "
        "(ddpflow.training.batchnorm), folded once per normalisation batch",
        "resume": "the shipped config keeps the run's normalisation batch at every world size "
        "(train.norm_batch_size auto: the batch it trained with), so a world-size edit retrains "
        "nothing; writing norm_batch_size 16 or 8 does retrain, and this table is the "
        "difference that makes",
        "timing": "train_seconds: rank 0's training epochs from train_summary.json (no "
        "validation, start-up or evaluation); task wall: rank 0's whole task (data, model, fit "
        "with per-epoch validation, checkpoints, in-training evaluation). Every micro-batch at "
        f"{ranks} ranks, so a smaller micro-batch here means more accumulation steps per rank "
        "(the batchnorm rows' forwards per step) on the same cores: the time is what the "
        "smaller micro-batch costs at this world size, not the time of a run at 4 or 8 ranks "
        "(scaling.py measures world sizes). One run per (micro-batch, seed), no repeats; the "
        f"{args.cores} cores shared with other work (load average in machine and "
        "loadavg_after), which stretches wall time",
        "test": f"the test split ({tested} samples), evaluated by the training job in eval mode "
        "(BatchNorm's running statistics); accuracy and mean cross-entropy over the whole split",
        "spread": "std is the sample standard deviation over the seeds (train.seed: initial "
        "weights, data order and draws; the train/val/test split's seed, data.seed, fixed)",
        "loadavg_after": harness.loadavg(),
    }


def measure(args: argparse.Namespace, workdir: Path) -> dict:
    config = bench_config(args)
    configfile = workdir / "config" / "config.yaml"
    configfile.parent.mkdir(parents=True)
    configfile.write_text(yaml.safe_dump(config, sort_keys=False))
    first = ddpconfig.check_runs(ddpconfig.load(configfile))[1][0]
    same = same_science_as_shipped(args, ddpconfig.load(configfile))
    wall, _ = overhead.snakemake(workdir, configfile, args.cores)
    rows = [run_row(workdir, m, s) for m, s in plan(args.micro_batches, args.seeds)]
    checks = [run_row(workdir, m, s, w) for m, s, w in check_plan(args)]
    for row in rows + checks:
        row["same_training_fingerprint_as_shipped_default"] = same[row["run"]]
    return {
        "seeds": args.seeds,
        "micro_batches": args.micro_batches,
        "workflow_wall_s": wall,
        "max_micro_batch_size": first["micro_batch"]["max"],
        "batchnorm": batchnorm_rows(args, first["train"]["global_batch_size"]),
        "by_micro_batch": summarize(rows, args.micro_batches),
        "seed_runs": rows,
        "at_auto_world_size": [compare(check, rows) for check in checks],
        "conditions": conditions(args, config, first, wall, rows + checks),
    }


def compare(check: dict, rows: list[dict]) -> dict:
    """A check run at the world size auto picks its micro-batch for, beside the run with the
    same micro-batch and seed at --ranks."""
    key = (check["micro_batch"], check["seed"])
    (here,) = (r for r in rows if (r["micro_batch"], r["seed"]) == key)
    keys = ("world_size", "test_accuracy", "test_loss", "final_train_loss", "train_seconds")
    return {**check, "at_ranks_here": {k: here[k] for k in keys}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="ddpflow-micro-batch-"))
    start = time.perf_counter()
    try:
        report = {
            **harness.head("BatchNorm's batch and the science of the default job"),
            **measure(args, workdir),
        }
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    report["wall_s"] = time.perf_counter() - start
    print(format_table(report), flush=True)
    return harness.write(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
