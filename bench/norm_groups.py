"""What normalising BatchNorm's batch over a group of ranks costs per optimizer step
(train.norm_batch_size larger than the micro-batch: ddpflow.training.norm_groups).

The default job's shape at 4 ranks' micro-batch: the shipped config's CNN on 1x8x8 images,
global batch 64, micro-batch 16, at 2 CPU ranks (a real gloo group on 127.0.0.1, 1 torch
thread per rank). Each worker builds ddpflow's Loop twice: ``grouped`` (norm_batch_size 32:
the two ranks normalise each batch of 32 together, two all-reduces of each BatchNorm layer's
per-channel sums in the forward and two in the backward) and ``own`` (norm_batch_size 16:
each rank normalises its own micro-batch, the science of a run whose BatchNorm batch is 16).
They alternate epoch by epoch (order flipped every repeat) after --warmup untimed epochs; an
epoch's time is the slowest rank's. The figure: the step time of each and their ratio
(median over repeats: noisy on a shared machine).

    python bench/norm_groups.py              # ~1 minute on 2 cores
    python bench/norm_groups.py --quick      # fewer repeats
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import harness
import workers
from loops import (
    ddpflow_epoch,
    ddpflow_run,
    process_group,
    rank_device,
    schedule,
    synthetic,
    timed_epoch,
)

CASE = {"model": "cnn", "shape": [1, 8, 8], "samples": 1024}
LOOPS = {"grouped": 32, "own": 16}  # norm_batch_size at micro-batch 16
CPU_RANK = {"threads": 1, "device": "cpu", "precision": "fp32"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, "norm_groups.json", worker=True)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=None, help="timed epochs per loop (8; 3)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 8
    return args


def run_worker(cfg: dict) -> int:
    device, backend, sync = rank_device(cfg)
    with process_group(cfg, backend) as env:
        images, labels, norm = synthetic(CASE["shape"], CASE["samples"])
        epochs, groups = {}, {}
        for name, norm_batch in LOOPS.items():
            run = ddpflow_run(cfg)
            run["train"]["norm_batch_size"] = norm_batch
            epochs[name], loop = ddpflow_epoch(cfg, run, images, labels, norm, env, device)
            groups[name] = loop.norm_group
        seconds: dict[str, list[float]] = {name: [] for name in LOOPS}
        samples = CASE["samples"] // cfg["global_batch"] * cfg["global_batch"]  # per epoch
        for name, repeat in schedule(list(LOOPS), cfg["warmup"], cfg["repeats"]):
            rate = timed_epoch(epochs[name], device, sync)[0]
            if repeat is not None:
                seconds[name].append(samples / rate)
    steps = CASE["samples"] // cfg["global_batch"]
    return workers.answer(cfg, {"epoch_s": seconds, "groups": groups, "steps": steps})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return run_worker(args.worker)
    report = {
        **harness.head("cost of normalising BatchNorm's batch over a group of ranks per step"),
        "conditions": {
            "case": "cnn 1x8x8 (the digits' shape, 4 BatchNorm layers), synthetic uint8 "
            "images, random labels",
            "world_size": 2,
            "global_batch": args.global_batch,
            "micro_batch": args.micro_batch,
            "samples": CASE["samples"],
            "repeats": args.repeats,
            "warmup": args.warmup,
            "loops": "grouped: norm_batch_size 32 (2 ranks per batch); own: norm_batch_size "
            "16 (each rank its micro-batch); ddpflow's Loop, alternating epochs, order flipped "
            "every repeat; 1 thread/rank",
        },
    }
    start = time.perf_counter()
    batches = {"batch": args.micro_batch, "global_batch": args.global_batch}
    epochs = {"warmup": args.warmup, "repeats": args.repeats}
    got = workers.launch(__file__, {"case": CASE, "world_size": 2, **batches, **epochs,
                                    **CPU_RANK})  # fmt: skip
    step = {name: statistics.median(got["epoch_s"][name]) / got["steps"] for name in LOOPS}
    report["runs"] = [{
        "step_s": step, "ratio": step["grouped"] / step["own"],
        "extra_ms_per_step": (step["grouped"] - step["own"]) * 1e3,
        "groups": got["groups"], "raw": got,
    }]  # fmt: skip
    report["conditions"]["loadavg_after"] = harness.loadavg()
    report["wall_s"] = time.perf_counter() - start
    print("| loop | norm_batch_size | ranks per batch | step (ms) |")
    print("|---|---|---|---|")
    for name, norm_batch in LOOPS.items():
        ms = step[name] * 1e3
        print(f"| {name} | {norm_batch} | {got['groups'][name]} | {ms:.2f} |")
    print(f"grouped / own: {report['runs'][0]['ratio']:.3f}")
    return harness.write(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
