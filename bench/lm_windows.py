"""What fresh windows each epoch (train.fresh_windows) do to a language model's validation
loss, and what sliding-window evaluation (eval.stride) does to the same model's score.

One byte-level gpt (ddpflow.training.gpt, --layers x --width, 4 heads, block --block, no
dropout) trained twice per seed from the same initial weights, with the same shuffles and
the same steps: every epoch cutting the same block boundaries (train.fresh_windows: false)
and every epoch cutting them at a new offset drawn from (seed, epoch) (true). Per epoch: the
training loss and the validation loss (non-overlapping windows, as training validates). At
the end, each model's validation loss at eval.stride block, block/2, block/4 and block/8:
each token scored once, with at least block - stride tokens of context.

Corpus: the .py sources of this Python's standard library package --package (email by
default: nothing downloaded), copied as a folder and staged by ddpflow as bytes (data.source
text, 257 tokens), train/val/test the first 70% / next 10% / last 20% of the files in
sorted order (data.val_fraction 0.1, test_fraction 0.2): the validation text follows the
training text, never trained on. AdamW (lr --lr, betas 0.9/0.95, weight decay 0.1), global batch
--batch blocks, 1 warmup epoch then cosine, fp32, 1 rank (1 torch thread) per run, --parallel
runs at a time.

    python bench/lm_windows.py            # 2 seeds x 2 settings x 8 epochs (block 64, batch 16):
                                          # about 20 minutes on 2 busy cores
    python bench/lm_windows.py --quick    # json's sources, a 2x64 gpt, block 32, 2 epochs,
                                          # 1 seed (seconds)
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import harness
import torch
import workers
from ddpflow import config as ddpconfig
from ddpflow.config.typed import RunSpec
from ddpflow.data.staging import stage_dataset
from ddpflow.training import evaluate
from ddpflow.training.loop import Loop, fit
from ddpflow.training.models import build_model
from ddpflow.training.rankdata import load_data
from loops import process_group, rank_device


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, "lm_windows.json", worker=True)
    p.add_argument("--package", default="email", help="the standard library package's sources")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="global batch, in blocks")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--parallel", type=int, default=2, help="runs at a time (1 thread each)")
    p.add_argument("--quick", action="store_true", help="json, a tiny model, 2 epochs, 1 seed")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.block, args.batch = 2, 64, 32, 16
        args.package, args.epochs, args.seeds = "json", 2, [0]
    return args


def corpus(package: str, folder: Path) -> dict:
    """The package's non-empty .py files copied into `folder` (relative paths kept)."""
    root = Path(importlib.import_module(package).__file__).parent
    files = sorted(p for p in root.rglob("*.py") if p.stat().st_size)
    digest, total = hashlib.sha256(), 0
    for path in files:
        rel = path.relative_to(root)
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, folder / rel)
        digest.update(rel.as_posix().encode() + b"\0" + path.read_bytes())
        total += path.stat().st_size
    return {"package": package, "files": len(files), "bytes": total, "sha256": digest.hexdigest()}


def run_config(cfg: dict) -> dict:
    """The schema's defaults with this benchmark's data, model, optimizer and windows."""
    overrides = {
        "task": "language_model",
        "data": {"source": "text", "path": cfg["corpus"], "block_size": cfg["block"]},
        "model": {
            "name": "gpt",
            "kwargs": {"n_layer": cfg["layers"], "n_head": 4, "n_embd": cfg["width"]},
        },
        "train": {
            "epochs": cfg["epochs"],
            "global_batch_size": cfg["batch"],
            "micro_batch_size": cfg["batch"],
            "progress": False,
            "seed": cfg["seed"],
            "fresh_windows": cfg["fresh_windows"],
            "optimizer": {
                "name": "adamw",
                "lr": cfg["lr"],
                "betas": [0.9, 0.95],
                "weight_decay": 0.1,
            },
            "lr_scaling": "none",
            "schedule": "cosine",
            "warmup_epochs": 1,
        },
        "machine": {"cpu_ranks_per_node": 1, "cpus_per_task": 1},
    }
    return ddpconfig.resolve_runs(ddpconfig.load(None, overrides))[0]


def strides(block: int) -> list[int]:
    return [block // d for d in (1, 2, 4, 8) if block // d >= 1]


def run_worker(cfg: dict) -> int:
    device, backend, _ = rank_device(cfg)
    with process_group(cfg, backend) as env:
        spec = RunSpec.from_run(run_config(cfg))
        data = load_data(spec, cfg["staged"], env, device, splits=("train", "val"))
        torch.manual_seed(spec.train.seed)  # as TrainTask.work: the same initial weights
        model = build_model(spec.resolved["model"], data.shape, data.num_classes)
        loop = Loop(spec, data, env, device, model)
        start = time.perf_counter()
        fit(loop, lambda record: None)
        seconds = time.perf_counter() - start
        scored = {
            str(stride): evaluate.evaluate_split(
                loop.model, data.val, data.scoring(64, stride=stride), env
            )
            for stride in strides(cfg["block"])
        }
    epochs = [{k: r[k] for k in ("train_loss", "val_loss")} for r in loop.history]
    result = {
        "seed": cfg["seed"],
        "fresh_windows": cfg["fresh_windows"],
        "train_blocks": len(data.train.inputs),
        "steps_per_epoch": loop.steps_per_epoch,
        "epochs": epochs,
        "val_loss_by_stride": {s: r["loss"] for s, r in scored.items()},
        "val_tokens_by_stride": {s: r["tokens"] for s, r in scored.items()},
        "train_seconds": seconds,
    }
    return workers.answer(cfg, result)


def summarize(runs: list[dict]) -> list[dict]:
    """Per setting, over the seeds: the final and the best validation loss, their means."""
    out = []
    for fresh in (False, True):
        mine = [r for r in runs if r["fresh_windows"] == fresh]
        final = [r["epochs"][-1]["val_loss"] for r in mine]
        best = [min(e["val_loss"] for e in r["epochs"]) for r in mine]
        out.append(
            {
                "fresh_windows": fresh,
                "seeds": [r["seed"] for r in mine],
                "final_val_loss_mean": statistics.fmean(final),
                "best_val_loss_mean": statistics.fmean(best),
                "final_train_loss_mean": statistics.fmean(
                    r["epochs"][-1]["train_loss"] for r in mine
                ),
            }
        )
    return out


def measure(args: argparse.Namespace, staged: Path, folder: Path) -> list[dict]:
    base = {"world_size": 1, "threads": 1, "device": "cpu", "staged": str(staged)}
    base |= {"corpus": str(folder), "block": args.block, "layers": args.layers}
    base |= {"width": args.width, "batch": args.batch, "epochs": args.epochs, "lr": args.lr}
    cfgs = [
        {**base, "seed": seed, "fresh_windows": fresh}
        for seed in args.seeds
        for fresh in (False, True)
    ]
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        return list(pool.map(lambda cfg: workers.launch(__file__, cfg), cfgs))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return run_worker(args.worker)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ddpflow-windows-") as tmp:
        folder = Path(tmp) / "corpus"
        source = corpus(args.package, folder)
        cfg = {"corpus": str(folder), "block": args.block, "layers": args.layers}
        cfg |= {"width": args.width, "batch": args.batch, "epochs": args.epochs}
        cfg |= {"lr": args.lr, "seed": 0, "fresh_windows": False}
        manifest = stage_dataset(run_config(cfg)["data"], Path(tmp) / "staged", seed=0)
        report = harness.head(
            "lm_windows",
            description="validation loss with the same block boundaries every epoch vs a "
            "fresh offset each epoch; the same models scored at smaller eval strides",
            conditions={
                "corpus": {**source, "tokens": manifest["tokens"]},
                "staging": "data.source text (bytes, 257 tokens), val_fraction 0.1, "
                "test_fraction 0.2, contiguous splits in sorted file order",
                "model": f"gpt {args.layers}x{args.width}, 4 heads, block {args.block}, "
                "dropout 0, tied embedding",
                "training": f"{args.epochs} epochs, global batch {args.batch} blocks (1 "
                f"micro-batch), AdamW lr {args.lr} betas 0.9/0.95 weight decay 0.1, 1 warmup "
                "epoch then cosine, fp32, 1 rank, 1 torch thread",
                "seeds": args.seeds,
                "settings": "train.fresh_windows false / true from the same initial weights "
                "and shuffles (train.seed)",
                "validation": "val split, non-overlapping windows (as training validates); "
                "val_loss_by_stride: the final model at eval.stride block .. block/8",
            },
        )
        report["runs"] = measure(args, Path(tmp) / "staged", folder)
    report["summary"] = summarize(report["runs"])
    report["conditions"]["loadavg_after"] = harness.loadavg()
    header = ["fresh_windows", "seeds", "final val loss", "best val loss", "final train loss"]
    rows = [
        [
            s["fresh_windows"],
            s["seeds"],
            f"{s['final_val_loss_mean']:.4f}",
            f"{s['best_val_loss_mean']:.4f}",
            f"{s['final_train_loss_mean']:.4f}",
        ]
        for s in report["summary"]
    ]
    print(harness.markdown_table(header, rows))
    return harness.write(report, args.out, wall_since=start)


if __name__ == "__main__":
    sys.exit(main())
