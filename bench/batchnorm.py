"""What the exact BatchNorm running statistics cost per optimizer step
(ddpflow.training.batchnorm: every micro-batch's statistics, one all_gather per few steps).

The default job's shape: the shipped config's CNN on 1x8x8 images (the digits' size), global
batch 64, micro-batch 32 (--micro-batch), at --world-sizes 1 and 2 CPU ranks (a real gloo
group on 127.0.0.1, 1 torch thread per rank, fresh processes per world size). Each worker
builds ddpflow's Loop twice, as throughput.py builds it: ``exact`` (today's loop) and
``rank0`` (the loop without the fold: each rank's BatchNorm updates its own statistics, as
torch does, and rank 0's are saved). The two alternate epoch by epoch (order flipped every
repeat) after --warmup untimed epochs each; an epoch's time is the slowest rank's. Two
figures: the epoch time's ratio (exact / rank0, median over repeats: noisy on a shared
machine) and the fold's own time, measured around its calls (begin_step, record, end_step and
settle, the all_gather included) in the exact loop, per optimizer step and as a share of the
step. At 2 ranks an epoch's 16 steps wait for one all_gather, at the epoch's end (up to
batchnorm.STEPS_PER_GATHER steps share one).

    python bench/batchnorm.py              # ~1 minute on 2 cores
    python bench/batchnorm.py --quick      # fewer repeats
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import harness
import workers
from ddpflow.training.batchnorm import ExactStatistics
from loops import (
    ddpflow_epoch,
    ddpflow_run,
    process_group,
    rank_device,
    schedule,
    synthetic,
    timed_epoch,
)
from torch import nn

CASE = {"model": "cnn", "shape": [1, 8, 8], "samples": 1024}
LOOPS = ("exact", "rank0")
CPU_RANK = {"threads": 1, "device": "cpu", "precision": "fp32"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, "batchnorm.json", worker=True)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=None, help="timed epochs per loop (8; 3)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 8
    return args


class _Timed:
    """The fold's three calls, timed (seconds summed over an epoch's steps)."""

    def __init__(self, inner: ExactStatistics):
        self.inner, self.seconds = inner, 0.0

    def _timed(self, fn, *args) -> None:
        start = time.perf_counter()
        fn(*args)
        self.seconds += time.perf_counter() - start

    def begin_step(self) -> None:
        self._timed(self.inner.begin_step)

    def record(self, micro: int) -> None:
        self._timed(self.inner.record, micro)

    def end_step(self) -> None:
        self._timed(self.inner.end_step)

    def settle(self) -> None:
        self._timed(self.inner.settle)

    def put_back(self) -> None:
        self.inner.put_back()


def run_worker(cfg: dict) -> int:
    device, backend, sync = rank_device(cfg)
    with process_group(cfg, backend) as env:
        run = ddpflow_run(cfg)
        images, labels, norm = synthetic(CASE["shape"], CASE["samples"])
        epochs, loops = {}, {}
        for name in LOOPS:
            epochs[name], loops[name] = ddpflow_epoch(cfg, run, images, labels, norm, env, device)
        loops["exact"].norm_stats = timer = _Timed(loops["exact"].norm_stats)
        # torch's own update: nothing to fold (a model without BatchNorm layers)
        loops["rank0"].norm_stats = ExactStatistics(nn.Identity(), 1, env.world_size, device)
        seconds: dict[str, list[float]] = {name: [] for name in LOOPS}
        fold: list[float] = []
        samples = CASE["samples"] // cfg["global_batch"] * cfg["global_batch"]  # per epoch
        for name, repeat in schedule(list(LOOPS), cfg["warmup"], cfg["repeats"]):
            timer.seconds = 0.0
            rate = timed_epoch(epochs[name], device, sync)[0]
            if repeat is not None:
                seconds[name].append(samples / rate)
                if name == "exact":
                    fold.append(timer.seconds)
    steps = CASE["samples"] // cfg["global_batch"]
    return workers.answer(cfg, {"epoch_s": seconds, "fold_s": fold, "steps": steps})


def measure(args: argparse.Namespace, world: int) -> dict:
    batches = {"batch": args.micro_batch, "global_batch": args.global_batch}
    epochs = {"warmup": args.warmup, "repeats": args.repeats}
    cfg = {"case": CASE, "world_size": world, **batches, **epochs, **CPU_RANK}
    got = workers.launch(__file__, cfg)
    exact, rank0 = (statistics.median(got["epoch_s"][n]) for n in LOOPS)
    step_s = exact / got["steps"]
    fold_step_s = statistics.median(got["fold_s"]) / got["steps"]
    return {
        "world_size": world,
        "micro_per_rank": args.global_batch // (args.micro_batch * world),
        "epoch_s": {"exact": exact, "rank0": rank0},
        "epoch_ratio": exact / rank0,
        "step_s": step_s,
        "fold_step_s": fold_step_s,
        "fold_share": fold_step_s / step_s,
        "raw": got,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return run_worker(args.worker)
    report = {
        **harness.head("cost of the exact BatchNorm running statistics per optimizer step"),
        "conditions": {
            "case": "cnn 1x8x8 (the digits' shape), synthetic uint8 images, random labels",
            "global_batch": args.global_batch,
            "micro_batch": args.micro_batch,
            "samples": CASE["samples"],
            "repeats": args.repeats,
            "warmup": args.warmup,
            "loops": "exact: ddpflow's Loop; rank0: the same without the fold (torch's own "
            "update per rank); alternating epochs, order flipped every repeat; 1 thread/rank",
        },
    }
    start = time.perf_counter()
    report["runs"] = [measure(args, world) for world in args.world_sizes]
    report["conditions"]["loadavg_after"] = harness.loadavg()
    report["wall_s"] = time.perf_counter() - start
    for r in report["runs"]:
        step, fold = f"{r['step_s'] * 1e3:.2f} ms", f"{r['fold_step_s'] * 1e6:.0f} us"
        print(
            f"world {r['world_size']}: step {step}, fold {fold} per step ({r['fold_share']:.2%}),"
            f" epoch exact/rank0 {r['epoch_ratio']:.3f}"
        )
    return harness.write(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
