"""How far the same training drifts apart at 1, 2 and 4 ranks: gradient accumulation's order.

Every world size computes the same micro-batches with the same random draws and steps with
their mean gradient, but not in the same order of floating-point additions: one rank adds a
step's micro-batch gradients one after another into .grad (micro-batch 16 of a global batch
64: four in sequence), while at 2 and 4 ranks each rank accumulates its own (two, one) and
DDP's all-reduce adds the ranks' sums. The last bits differ after the first step, and SGD
carries the difference on. This measures how far it goes on the default job: the shipped
config's CNN and optimizer on its data, scikit-learn's real 8x8 digits, split as staging splits
them (ddpflow.data.staging.split_indices: the train split, trained on in whole steps, and the
validation split), global batch 64, micro-batch 16 (--micro-batch), --epochs 3, at --world-sizes
1 2 4 real gloo ranks on 127.0.0.1 (1 torch thread each, fp32). Per world size: each epoch's
training loss (every micro-batch's, summed over the ranks) and the validation metrics;
between world sizes: the parameters' relative distance ||a - b|| / ||b|| after the last
epoch, the largest absolute difference, and whether they are bitwise equal.

    python bench/accumulation_drift.py            # ~1 minute on 2 cores
    python bench/accumulation_drift.py --world-sizes 1 2 --epochs 1   # a smoke run
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path

import harness
import numpy as np
import torch
import workers
from ddpflow.data.sources import load_digits
from ddpflow.data.staging import split_indices
from ddpflow.training.loop import fit
from ddpflow.training.rankdata import Split
from loops import ddpflow_epoch, ddpflow_run, process_group, rank_device


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, "accumulation_drift.json", worker=True)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3)
    return p.parse_args(argv)


def digits(data_cfg: dict) -> tuple[dict, tuple[torch.Tensor, torch.Tensor]]:
    """The digits' {"train", "val"} splits as staging makes them, (uint8 NCHW images,
    labels), and the train split's per-channel mean and std in 0..1 units."""
    raw = load_digits()
    assert isinstance(raw.train_x, np.ndarray)
    plan = split_indices(raw, data_cfg, data_cfg["seed"])
    splits = {}
    for name in ("train", "val"):
        pool, index = plan[name]
        assert pool == "train", plan  # the digits have no official test split
        splits[name] = (torch.from_numpy(raw.train_x[index]), torch.from_numpy(raw.train_y[index]))
    scaled = splits["train"][0].double().div(255.0)
    mean, std = scaled.mean([0, 2, 3]), scaled.std([0, 2, 3], unbiased=False)
    return splits, (mean.float().view(1, -1, 1, 1), std.float().view(1, -1, 1, 1))


def run_worker(cfg: dict) -> int:
    device, backend, _ = rank_device(cfg)
    with process_group(cfg, backend) as env:
        run = ddpflow_run(cfg)
        if run["data"]["source"] != "digits":
            raise SystemExit(f"the shipped config's data is {run['data']['source']}, not digits")
        splits, norm = digits(run["data"])
        images, labels = splits["train"]
        _, loop = ddpflow_epoch(cfg, run, images, labels, norm, env, device)
        loop.data.splits["val"] = Split(*(t.to(device) for t in splits["val"]))
        fit(loop, lambda record: None)
        state = loop.full_model_state()
    if cfg["rank"] == 0:
        names = [name for name, _ in loop.model.named_parameters()]
        torch.save({k: state[k].detach().cpu() for k in names}, cfg["params_file"])
    keep = ("train_loss", "val_loss", "val_accuracy")
    history = [{k: r[k] for k in keep if k in r} for r in loop.history]
    return workers.answer(cfg, {"history": history, "lr": loop.lr})


def distance(a: dict, b: dict) -> dict:
    """a against b over every parameter: relative L2 distance, largest difference, bitwise."""
    flat_a, flat_b = (torch.cat([p.double().flatten() for p in x.values()]) for x in (a, b))
    return {
        "relative_l2": float((flat_a - flat_b).norm() / flat_b.norm()),
        "max_abs": float((flat_a - flat_b).abs().max()),
        "bitwise_equal": all(torch.equal(a[k], b[k]) for k in a),
    }


def measure(args: argparse.Namespace, world: int, params_file: Path) -> dict:
    # loops.ddpflow_run's keys: the epochs are warmup + repeats
    shape = {"case": {"model": "cnn", "shape": [1, 8, 8]}, "world_size": world, "warmup": 0}
    batch = {"batch": args.micro_batch, "global_batch": args.global_batch}
    machine = {"threads": 1, "device": "cpu", "precision": "fp32"}
    mine = {"repeats": args.epochs, "params_file": str(params_file)}
    cfg = {**shape, **batch, **machine, **mine}
    got = workers.launch(__file__, cfg)
    micro_per_step = args.global_batch // args.micro_batch
    return {
        "world_size": world,
        "micro_batches_per_rank": micro_per_step // world,  # added into .grad in sequence
        "epochs": got["history"],
        "lr": got["lr"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return run_worker(args.worker)
    report = harness.head(
        "accumulation_drift",
        description="the same training at several world sizes: losses and parameter "
        "distance from the order of gradient additions",
        conditions={
            "case": "the shipped config's cnn, optimizer and data (scikit-learn's 8x8 digits, "
            "its train and val splits as staged), fp32, 1 thread/rank",
            "global_batch": args.global_batch,
            "micro_batch": args.micro_batch,
            "epochs": args.epochs,
            "world_sizes": args.world_sizes,
        },
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ddpflow-drift-") as tmp:
        files = {w: Path(tmp) / f"params-{w}.pt" for w in args.world_sizes}
        report["runs"] = [measure(args, w, files[w]) for w in args.world_sizes]
        params = {w: torch.load(f, weights_only=True) for w, f in files.items()}
    pairs = itertools.combinations(args.world_sizes, 2)
    report["distances"] = [{"a": a, "b": b, **distance(params[a], params[b])} for a, b in pairs]
    report["conditions"]["loadavg_after"] = harness.loadavg()
    for r in report["runs"]:
        losses = ", ".join(f"{e['train_loss']:.7f}" for e in r["epochs"])
        print(f"world {r['world_size']}: train loss per epoch {losses}")
    for d in report["distances"]:
        close = f"relative distance {d['relative_l2']:.3g}, largest {d['max_abs']:.3g}"
        print(f"{d['a']} vs {d['b']} ranks: {close}, bitwise {d['bitwise_equal']}")
    return harness.write(report, args.out, wall_since=start)


if __name__ == "__main__":
    sys.exit(main())
