"""What a checkpoint stops the training for, synchronous against asynchronous
(train.checkpoint.async), and what checkpointing every few steps costs the training.

Two gloo ranks on 127.0.0.1, 1 torch thread each, ddpflow's Loop and Checkpointer as the
training job builds them (strategy ddp, AdamW, fp32), the state after one trained epoch:

* blocking: Checkpointer.save's time on the slowest rank, the training's stop (synchronous:
  the gather and the whole write; asynchronous: the gather and the copy off the training's
  tensors), and the whole save (asynchronous: until the background write is committed),
  medians of --saves saves, alternating the two modes;
* training: epochs with a checkpoint every --every steps, synchronous and asynchronous,
  against epochs without (alternating, the order flipped every repeat): the step time of
  each, so what a checkpoint costs per step while the background write competes for the
  CPU; and what a checkpoint a minute would cost (blocking s / 60 s).

Models: the default job's CNN (1x8x8, global batch 64) and gpt at ~10M (6x384) and ~100M
(14x768) parameters (T 128, byte-level text, 2 blocks per rank and step); the training
measurement for the CNN and the 10M gpt (the 100M one takes seconds a step here).

    python bench/checkpoint.py            # ~5 minutes on 2 cores
    python bench/checkpoint.py --quick    # CNN and the 10M gpt, fewer saves
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness
import lm
import torch
import torch.distributed as dist
import workers
from ddpflow.config.typed import RunSpec
from ddpflow.training.build import placed_model
from ddpflow.training.checkpoint import Checkpointer
from ddpflow.training.loop import Loop
from ddpflow.training.rankdata import load_data
from loops import ddpflow_epoch, ddpflow_run, process_group, rank_device, synthetic

GPTS = {
    "gpt 10M": {"n_layer": 6, "n_head": 6, "n_embd": 384},
    "gpt 100M": {"n_layer": 14, "n_head": 12, "n_embd": 768},
}
MODES = ("sync", "async")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, "checkpoint.json", worker=True)
    p.add_argument("--saves", type=int, default=None, help="timed saves per mode (5; 3)")
    p.add_argument("--every", type=int, default=5, help="steps between checkpoints (training)")
    p.add_argument("--repeats", type=int, default=None, help="timed epochs per loop (4; 2)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    args.saves = args.saves or (3 if args.quick else 5)
    args.repeats = args.repeats or (2 if args.quick else 4)
    return args


def _cnn_loop(cfg: dict, env, device) -> tuple[Loop, dict]:
    case = {"model": "cnn", "shape": [1, 8, 8]}
    run_cfg = {**cfg, "case": case, "batch": 32, "warmup": 0, "repeats": 100}
    run = ddpflow_run(run_cfg)
    images, labels, norm = synthetic(case["shape"], 1024)
    _, loop = ddpflow_epoch(run_cfg, run, images, labels, norm, env, device)
    return loop, run


def _gpt_loop(cfg: dict, name: str, env, device) -> tuple[Loop, dict]:
    staged = cfg["staged"][name]
    gpt_cfg = {**cfg, "data": staged["data"], "gpt": GPTS[name], "batch": 2, "warmup": 0,
               "repeats": 100, "lr": 3e-4}  # fmt: skip
    run = lm.ddpflow_run(gpt_cfg, "fp32")
    spec = RunSpec.from_run(run)
    data = load_data(spec, staged["dir"], env, device, splits=("train", "val"))
    model, loaded = placed_model(spec, data.shape, data.num_classes, device)
    return Loop(spec, data, env, device, model, loaded), run


def _checkpointer(run: dict, cfg: dict, mode: str, every: int, name: str, env) -> Checkpointer:
    run = copy.deepcopy(run)
    run["train"]["checkpoint"].update({"async": mode == "async", "every_steps": every, "keep": 2})
    folder = Path(cfg["work"]) / name.replace(" ", "-") / mode
    return Checkpointer(RunSpec.from_run(run), folder, env)


def _slowest(seconds: float, device) -> float:
    value = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _blocking(loop: Loop, run: dict, cfg: dict, name: str, env, device) -> dict:
    """Each mode's median stop and whole save over cfg["saves"] saves, alternating."""
    ckpts = {mode: _checkpointer(run, cfg, mode, 0, name, env) for mode in MODES}
    stops: dict[str, list[float]] = {mode: [] for mode in MODES}
    whole: dict[str, list[float]] = {mode: [] for mode in MODES}
    for repeat in range(cfg["saves"]):
        for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
            dist.barrier()
            start = time.perf_counter()
            ckpts[mode].save(loop, "bench")
            stopped = time.perf_counter() - start
            ckpts[mode].saves.wait()
            done = time.perf_counter() - start
            stops[mode].append(_slowest(stopped, device))
            whole[mode].append(_slowest(done, device))
    newest = sorted((Path(cfg["work"]) / name.replace(" ", "-") / "sync").rglob("ckpt-*.pt"))
    return {
        "blocking_s": {mode: statistics.median(stops[mode]) for mode in MODES},
        "whole_save_s": {mode: statistics.median(whole[mode]) for mode in MODES},
        "checkpoint_bytes": newest[-1].stat().st_size if newest else None,
    }


def _training(loop: Loop, run: dict, cfg: dict, name: str, env, device) -> dict:
    """Step seconds of epochs without checkpoints and with one every cfg["every"] steps."""
    loops = ("none", *MODES)
    ckpts = {mode: _checkpointer(run, cfg, mode, cfg["every"], f"{name}-train", env)
             for mode in MODES}  # fmt: skip
    seconds: dict[str, list[float]] = {mode: [] for mode in loops}
    for repeat in range(cfg["repeats"]):
        for mode in loops if repeat % 2 == 0 else loops[::-1]:
            loop.watch_steps(ckpts[mode].on_step if mode != "none" else None)
            dist.barrier()
            start = time.perf_counter()
            loop.train_epoch()
            if mode != "none":
                ckpts[mode].saves.wait()  # its last write belongs to this epoch's cost
            seconds[mode].append(_slowest(time.perf_counter() - start, device))
    loop.watch_steps(None)
    step = {mode: statistics.median(seconds[mode]) / loop.steps_per_epoch for mode in loops}
    return {
        "step_s": step,
        "steps_per_epoch": loop.steps_per_epoch,
        "overhead_per_step": {mode: step[mode] / step["none"] - 1 for mode in MODES},
    }


def run_worker(cfg: dict) -> int:
    device, backend, _ = rank_device(cfg)
    rows = []
    with process_group(cfg, backend) as env:
        for name in cfg["models"]:
            loop, run = _cnn_loop(cfg, env, device) if name == "cnn" else _gpt_loop(
                cfg, name, env, device)  # fmt: skip
            loop.train_epoch()  # the optimizer's state exists, as in a real checkpoint
            row = {"model": name, "parameters": sum(p.numel() for p in loop.model.parameters())}
            row.update(_blocking(loop, run, cfg, name, env, device))
            if name in cfg["train_models"]:
                row.update(_training(loop, run, cfg, name, env, device))
            rows.append(row)
            del loop
    return workers.answer(cfg, rows)


def _stage_gpts(names, tmp: Path) -> dict:
    """Each gpt's byte-level corpus staged: 8 steps of 2 blocks per rank at 2 ranks."""
    staged = {}
    for name in names:
        args = argparse.Namespace(steps=8, batch=2, block=128)
        corpus = lm.write_corpus(tmp / "corpus.txt", lm.corpus_length(8 * 2 * 2, 128))
        fractions = {"val_fraction": lm.VAL_FRACTION, "test_fraction": lm.TEST_FRACTION}
        data = {"source": "text", "path": str(corpus), "block_size": args.block, **fractions}
        run = lm.ddpflow_run({"data": data, "world_size": 2, "gpt": GPTS[name], "batch": 2,
                              "warmup": 0, "repeats": 1, "lr": 3e-4, "device": "cpu",
                              "threads": 1}, "fp32")  # fmt: skip
        folder = tmp / f"staged-{name.replace(' ', '-')}"
        lm.stage_dataset(run["data"], folder, seed=0)
        staged[name] = {"data": data, "dir": str(folder)}
    return staged


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return run_worker(args.worker)
    start = time.perf_counter()
    models = ["cnn", "gpt 10M"] if args.quick else ["cnn", *GPTS]
    report = harness.head(
        "checkpoint",
        description="what a checkpoint stops the training for, synchronous vs asynchronous",
        conditions={
            "ranks": "2 gloo ranks on 127.0.0.1, 1 torch thread each, CPU, fp32, ddp, AdamW",
            "saves": args.saves,
            "every_steps": args.every,
            "repeats": args.repeats,
            "blocking": "Checkpointer.save on the slowest rank (median); whole: until written",
            "training": "epochs with a checkpoint every N steps vs none, alternating; the last "
            "write of an epoch counted in it",
        },
    )
    with tempfile.TemporaryDirectory(prefix="ddpflow-bench-ckpt-") as tmp:
        staged = _stage_gpts([m for m in models if m in GPTS], Path(tmp))
        cfg = {"models": models, "train_models": ["cnn", "gpt 10M"], "staged": staged,
               "world_size": 2, "threads": 1, "device": "cpu", "precision": "fp32",
               "saves": args.saves, "every": args.every, "repeats": args.repeats}  # fmt: skip
        report["runs"] = workers.launch(__file__, cfg, timeout_s=3600)
    report["conditions"]["loadavg_after"] = harness.loadavg()
    print("| model | parameters | stop sync (s) | stop async (s) | whole async (s) | per minute |")
    print("|---|---|---|---|---|---|")
    for r in report["runs"]:
        stop, whole = r["blocking_s"], r["whole_save_s"]
        minute = stop["async"] / 60
        print(f"| {r['model']} | {r['parameters']:,} | {stop['sync']:.3f} | {stop['async']:.3f} "
              f"| {whole['async']:.3f} | {minute:.2%} |")  # fmt: skip
    return harness.write(report, args.out, wall_since=start)


if __name__ == "__main__":
    sys.exit(main())
