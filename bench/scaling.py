"""Strong scaling of ddpflow's loop on this machine's CPU ranks, and what the new sampler costs.

1. Strong scaling: ddpflow's Loop (the shipped config, built as throughput.py
   builds it) trains the same science at world sizes 1, 2 and 4: the same model, synthetic
   data, global batch (--global-batch 64) and micro-batch (--micro-batch 16), so the ranks
   accumulate 4, 2 and 1 micro-batches per optimizer step. Each world size runs in fresh
   rank processes (a real gloo group on 127.0.0.1, 1 torch thread per rank), one epoch per
   repeat after --warmup untimed ones; an epoch's time is the slowest rank's (barrier
   before) and samples/s = the epoch's global samples / that time. The world sizes run in
   --rounds rounds, the order flipped each round, so background load hits all of them; the
   value is the median over all timed epochs. Speedup = samples/s / world 1's, efficiency
   = speedup / world. The epochs' training losses are recorded too: the same science gives
   the same loss at every world size (up to the summation order of the gradients).

2. Sampler cost: producing one rank's micro-batch indices for an epoch, as Loop.train_epoch
   does now (step_micro_batches + rank_micro_batches + .to(device)) against the order it
   replaced (DistributedSampler's: randperm, pad, stride; re-implemented here as
   old_epoch_indices), the order alone and with its micro-batches handed out as each loop
   took them (old: .split(micro) once; new: one row view per micro-step), for --sampler-n
   samples at each world size (rank 0), in this process with 1 torch thread, alternating
   (order flipped every repeat), median of --sampler-repeats. Then the per-micro-step
   seeding the loop does, loop._seed_random_draws(micro_batch_seed(seed, epoch, step, micro)),
   against torch.manual_seed of the same seed (what it did first),
   and its parts, median of --seed-repeats batches of --seed-calls calls, alternating, and
   its share of the fastest training micro-step measured in part 1.

    python bench/scaling.py                 # ~3 min on 2 cores
    python bench/scaling.py --quick         # smaller epochs, 1 round, fewer repeats
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import harness
import torch
import workers
from ddpflow import config as ddpconfig
from ddpflow.training.loop import _seed_random_draws
from ddpflow.training.schedule import micro_batch_seed, rank_micro_batches, step_micro_batches
from loops import ddpflow_epoch, ddpflow_run, process_group, rank_device, synthetic, timed_epoch
from throughput import CASES

IMAGENET_TRAIN = 1_281_167  # ImageNet-1k's train split: the "1.28M" case


# (--quick, full) where the option is not given
DEFAULTS = {
    "samples": (256, 1024),
    "repeats": (2, 4),
    "rounds": (1, 2),
    "sampler_repeats": (5, 21),
    "seed_repeats": (3, 11),
    "sampler_n": ([50_000], [50_000, IMAGENET_TRAIN]),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, "scaling.json", worker=True)
    p.add_argument("--case", choices=sorted(CASES), default="cnn", help="throughput.py's case")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--global-batch", type=int, default=64, help="samples per optimizer step")
    p.add_argument("--micro-batch", type=int, default=16, help="samples per rank per pass")
    p.add_argument("--samples", type=int, default=None, help="per epoch (1024; --quick 256)")
    p.add_argument("--repeats", type=int, default=None, help="timed epochs per launch (4; 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed epochs per launch")
    p.add_argument("--rounds", type=int, default=None, help="launches per world size (2; 1)")
    sizes = f"dataset sizes (50000 {IMAGENET_TRAIN}; --quick 50000)"
    p.add_argument("--sampler-n", type=int, nargs="+", default=None, help=sizes)
    p.add_argument("--sampler-repeats", type=int, default=None, help="(21; --quick 5)")
    p.add_argument("--seed-calls", type=int, default=1000, help="seedings per timed batch")
    p.add_argument("--seed-repeats", type=int, default=None, help="(11; --quick 3)")
    p.add_argument("--quick", action="store_true", help="smaller and fewer: bench/run --quick")
    args = p.parse_args(argv)
    for key, (quick, full) in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    return args


# --- 1. strong scaling: the worker ---------------------------------------------------


def run_worker(cfg: dict) -> int:
    """One launch: warmup + repeats epochs of ddpflow's Loop; rank 0 writes the rates."""
    device, backend, sync = rank_device(cfg)
    with process_group(cfg, backend) as env:
        run = ddpflow_run(cfg)
        images, labels, norm = synthetic(cfg["case"]["shape"], cfg["samples"])
        epoch, loop = ddpflow_epoch(cfg, run, images, labels, norm, env, device)
        epochs = [timed_epoch(epoch, device, sync) for _ in range(cfg["warmup"] + cfg["repeats"])]
        result = {
            "accum": loop.accum,
            "micro_per_step": loop.micro_per_step,
            "lr": loop.lr,
            "samples_per_s": [e[0] for e in epochs[cfg["warmup"] :]],
            "samples_per_cpu_s": [e[1] for e in epochs[cfg["warmup"] :]],
            "train_loss": [e[2]["train_loss"] for e in epochs],  # warmup's too: same science
            "epoch_samples": epochs[-1][2]["samples"],
            "micro_steps": epochs[-1][2]["micro_steps"],
        }
    return workers.answer(cfg, result)


# --- 1. strong scaling: the driver ---------------------------------------------------


def scaling_plan(args: argparse.Namespace) -> list[dict]:
    """One launch config per (round, world size), the order flipped every round."""
    train = {"global_batch_size": args.global_batch, "micro_batch_size": args.micro_batch}
    for world in args.world_sizes:  # refuse what Loop would refuse, before any launch
        ddpconfig.check_world_size("scaling", train, world)
    case = {"name": args.case, "case": CASES[args.case], "samples": args.samples}
    batches = {"batch": args.micro_batch, "global_batch": args.global_batch}
    epochs = {"repeats": args.repeats, "warmup": args.warmup}
    rank = {"device": "cpu", "threads": 1, "precision": "fp32"}
    launches = []
    for round_ in range(args.rounds):
        worlds = args.world_sizes if round_ % 2 == 0 else args.world_sizes[::-1]
        launches += [
            {**case, **rank, "world_size": w, **batches, **epochs, "round": round_} for w in worlds
        ]
    return launches


def strong_scaling(args: argparse.Namespace) -> dict:
    results: dict[int, list[dict]] = {w: [] for w in args.world_sizes}
    for cfg in scaling_plan(args):
        print(f"  round {cfg['round']}: world size {cfg['world_size']} ...", flush=True)
        load = harness.loadavg()
        results[cfg["world_size"]].append({**workers.launch(__file__, cfg), "loadavg_before": load})
    rows = [scaling_row(w, runs) for w, runs in results.items()]
    base = next(r for r in rows if r["world_size"] == min(args.world_sizes))
    for row in rows:
        row["speedup"] = row["samples_per_s"] / base["samples_per_s"]
        row["efficiency"] = row["speedup"] * base["world_size"] / row["world_size"]
        row["cpu_time_ratio"] = row["samples_per_cpu_s"] / base["samples_per_cpu_s"]
        diffs = [abs(a - b) for a, b in zip(row["train_loss"], base["train_loss"], strict=True)]
        # epoch 1: the summation order's bits; later epochs: those bits grown by training
        row["first_loss_diff_vs_base"], row["max_loss_diff_vs_base"] = diffs[0], max(diffs)
    return {"rows": rows}


def scaling_row(world: int, runs: list[dict]) -> dict:
    """One world size over its launches: medians of all timed epochs."""
    rates = [r for run in runs for r in run["samples_per_s"]]
    cpu_rates = [r for run in runs for r in run["samples_per_cpu_s"]]
    first = runs[0]
    epoch_s = first["epoch_samples"] / statistics.median(rates)
    return {
        "world_size": world,
        "accum": first["accum"],
        "cores_available": os.cpu_count(),
        "oversubscribed": world > (os.cpu_count() or 1),
        "samples_per_s": statistics.median(rates),
        "all_samples_per_s": rates,
        "samples_per_cpu_s": statistics.median(cpu_rates),
        "epoch_samples": first["epoch_samples"],
        "micro_steps_per_rank": first["micro_steps"],
        "micro_step_s": epoch_s / first["micro_steps"],
        "train_loss": first["train_loss"],  # per epoch, warmup included
        "train_loss_spread": max(
            abs(a - b)
            for run in runs
            for a, b in zip(run["train_loss"], first["train_loss"], strict=True)
        ),
        "lr": first["lr"],
        "loadavg_before": [run["loadavg_before"] for run in runs],
    }


# --- 2. sampler and seeding cost -----------------------------------------------------


def old_epoch_indices(n: int, world: int, rank: int, seed: int, epoch: int) -> torch.Tensor:
    """The order the loop used before (removed from ddpflow.training.loop), as the baseline:
    DistributedSampler(shuffle=True, drop_last=False): pad by repeating, then stride."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    total = math.ceil(n / world) * world
    if total > n:
        order = torch.cat([order, order.repeat(math.ceil((total - n) / n))[: total - n]])
    return order[rank:total:world]


def old_order(n: int, world: int, epoch: int) -> torch.Tensor:
    return old_epoch_indices(n, world, 0, 0, epoch).to("cpu")  # the old loop's .to(device)


def new_order(n: int, world: int, global_batch: int, micro: int, epoch: int) -> torch.Tensor:
    """What Loop.train_epoch builds now: the epoch's steps, then this rank's micro-batches."""
    batches = step_micro_batches(n, global_batch, micro, 0, epoch)
    return rank_micro_batches(batches, world, 0).to("cpu")


def order_fns(args: argparse.Namespace, n: int, world: int) -> dict:
    """The four per-epoch workloads: each order alone, and with its micro-batches handed out
    as the loops take them (old: .split(micro) once; new: one row view per micro-step)."""
    glob, micro = args.global_batch, args.micro_batch
    return {
        "old": lambda e: old_order(n, world, e),
        "new": lambda e: new_order(n, world, glob, micro, e),
        "old_batches": lambda e: old_order(n, world, e).split(micro),
        "new_batches": lambda e: [m for m in new_order(n, world, glob, micro, e)],
    }


def sampler_cost(args: argparse.Namespace) -> list[dict]:
    rows = []
    for n in args.sampler_n:
        for world in args.world_sizes:
            times = alternate(order_fns(args, n, world), args.sampler_repeats)
            row = {"n": n, "world_size": world}
            row.update({f"{k}_s": statistics.median(v) for k, v in times.items()})
            row["new_over_old"] = row["new_s"] / row["old_s"]
            row["new_over_old_batches"] = row["new_batches_s"] / row["old_batches_s"]
            rows.append({**row, "all_s": times})
            old, new = (f"{row[k] * 1e3:.2f} ms" for k in ("old_batches_s", "new_batches_s"))
            print(f"  sampler n={n} world {world}: old {old}, new {new} per epoch", flush=True)
    return rows


def alternate(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each fn(epoch) per repeat (epoch = repeat: a fresh shuffle each time), the
    fns alternating, order flipped every repeat, after one untimed call each."""
    names = list(fns)
    for name in names:
        fns[name](repeats)
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            fns[name](repeat)
            times[name].append(time.perf_counter() - start)
    return times


CPU = torch.device("cpu")


def loop_seeding(i: int) -> None:
    """What Loop._micro_step does per micro-batch on a CPU rank."""
    _seed_random_draws(micro_batch_seed(0, 1, i // 4, i % 4), CPU)


def torch_seeding(i: int) -> None:
    """What it did first (torch.manual_seed): the baseline."""
    torch.manual_seed(micro_batch_seed(0, 1, i // 4, i % 4))


def nested(depth: int, fn, i: int) -> None:
    """fn(i) called `depth` frames deeper (a rank's stack under its launcher is deep)."""
    return fn(i) if depth == 0 else nested(depth - 1, fn, i)


# the per-micro-step seeding, and its parts. While CUDA is not initialised (a CPU rank),
# torch.manual_seed also queues lazy seeding calls for the other devices, each with a
# formatted stack trace (torch.cuda._lazy_call): its cost grows with the caller's stack
# depth, hence the "_depth_30" cases; the loop seeds the generators directly instead
# (loop._seed_random_draws). "cpu_generator" is a reference: the CPU generator alone
SEED_DEPTH = 30
SEEDINGS = {
    "loop": loop_seeding,
    "loop_depth_30": lambda i: nested(SEED_DEPTH, loop_seeding, i),
    "torch_manual_seed_loop": torch_seeding,
    "torch_manual_seed_loop_depth_30": lambda i: nested(SEED_DEPTH, torch_seeding, i),
    "micro_batch_seed": lambda i: micro_batch_seed(0, 1, i // 4, i % 4),
    "torch_manual_seed": lambda i: torch.manual_seed(i),
    "cpu_generator": lambda i: torch.default_generator.manual_seed(i),
}


def seeding_cost(args: argparse.Namespace) -> dict:
    """Seconds per call of each SEEDINGS entry: batches of --seed-calls calls, alternating."""
    calls = args.seed_calls
    batches = {name: (lambda _, f=f: [f(i) for i in range(calls)]) for name, f in SEEDINGS.items()}
    times = alternate(batches, args.seed_repeats)
    per_call = {name: [t / calls for t in ts] for name, ts in times.items()}
    median = {k: statistics.median(v) for k, v in per_call.items()}
    return {"seconds_per_call": median, "all_seconds_per_call": per_call}


# --- report ----------------------------------------------------------------------------


def format_table(report: dict) -> str:
    c = report["conditions"]
    lines = [
        f"# strong scaling: {c['case']}, global batch {c['global_batch']} in micro-batches of "
        f"{c['micro_batch']}, {c['samples']} samples/epoch, 1 thread/rank, gloo; median of "
        f"{c['rounds']} x {c['repeats']} epochs after {c['warmup']}; slowest rank; "
        f"{c['cores']} cores",
        harness.markdown_table(
            SCALING_HEADER, map(scaling_cells, report["scaling"]["rows"]), rule="--:"
        ),
        f"({c['note']}; by CPU s: samples per CPU-second of all ranks against world "
        f"{min(c['world_sizes'])}'s, the less load-sensitive ratio; loss diff: the "
        "epoch's training loss against the first world size's)",
        "",
        f"# sampler: one rank's batch indices per epoch, global {c['global_batch']} / micro "
        f"{c['micro_batch']}; median of {c['sampler_repeats']}, alternating",
        harness.markdown_table(SAMPLER_HEADER, map(sampler_cells, report["sampler"]), rule="--:"),
    ]
    s = report["seeding"]
    parts = ", ".join(f"{k} {v * 1e6:.1f}" for k, v in s["seconds_per_call"].items())
    share = s["share_of_micro_step"]
    lines.append(
        f"seeding per micro-step (us per call): {parts}; the loop's is {share['loop']:.2%} "
        f"({share['loop_depth_30']:.2%} 30 frames deeper) of the fastest micro-step above "
        f"({s['micro_step_s'] * 1e3:.1f} ms)"
    )
    return "\n".join(lines)


SCALING_HEADER = [
    "world",
    "accum",
    "samples/s",
    "speedup",
    "efficiency",
    "by CPU s",
    "loss diff epoch 1 / max",
]
SAMPLER_HEADER = [
    "n",
    "world",
    "old ms",
    "new ms",
    "new / old",
    "old + batches ms",
    "new + batches ms",
    "new / old",
]


def scaling_cells(r: dict) -> list[str]:
    loss = f"{r['first_loss_diff_vs_base']:.1e} / {r['max_loss_diff_vs_base']:.1e}"
    rates = (f"{r['speedup']:.2f}x", f"{r['efficiency']:.0%}", f"{r['cpu_time_ratio']:.2f}x")
    return [r["world_size"], r["accum"], f"{r['samples_per_s']:.1f}", *rates, loss]


def sampler_cells(r: dict) -> list[str]:
    ms = [f"{r[k] * 1e3:.2f}" for k in ("old_s", "new_s", "old_batches_s", "new_batches_s")]
    ratios = [f"{r[k]:.2f}x" for k in ("new_over_old", "new_over_old_batches")]
    return [r["n"], r["world_size"], ms[0], ms[1], ratios[0], ms[2], ms[3], ratios[1]]


def conditions(args: argparse.Namespace) -> dict:
    cores = os.cpu_count() or 1
    over = [w for w in args.world_sizes if w > cores]
    note = f"{cores} cores: no world size oversubscribes them"
    if over:
        note = (
            f"{cores} cores: world size {', '.join(map(str, over))} oversubscribes them "
            f"(more ranks than cores), so its ideal speedup here is {cores}x, not the world size"
        )
    return {
        "case": f"{args.case} {'x'.join(map(str, CASES[args.case]['shape']))}",
        "world_sizes": args.world_sizes,
        "global_batch": args.global_batch,
        "micro_batch": args.micro_batch,
        "accum": {w: args.global_batch // (args.micro_batch * w) for w in args.world_sizes},
        "samples": args.samples,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "cores": cores,
        "note": note,
        "loop": "ddpflow.training.loop.Loop from the shipped config (SGD nesterov, cosine "
        "schedule, "
        "fp32, CNN in channels_last), data on the device, DDP only when world > 1",
        "timing": "one epoch per repeat, barrier before, slowest rank; fresh rank processes "
        "per launch; world sizes in rounds, order flipped each round; median of all epochs",
        "sampler": "in the driver process, 1 torch thread, rank 0, each call a fresh epoch's "
        "shuffle: old = randperm + pad + stride (DistributedSampler's order) + .to('cpu'); "
        "new = step_micro_batches + rank_micro_batches + .to('cpu'); '+ batches': old "
        ".split(micro) once, new one row view per micro-batch (Loop's device_batches[i]); "
        "after one untimed call each, the four alternating, order flipped every repeat",
        "sampler_repeats": args.sampler_repeats,
        "seeding": "loop = loop._seed_random_draws(micro_batch_seed(seed, epoch, step, "
        "micro)) as Loop._micro_step calls it on a CPU rank, and its parts; "
        "torch_manual_seed_loop = the same seed through torch.manual_seed (the baseline: what "
        "the loop did first); cpu_generator = torch.default_generator.manual_seed alone "
        "(reference); *_depth_30: 30 frames deeper (torch.manual_seed formats stack traces "
        "for its lazy device seeding while CUDA is not initialised); "
        f"{args.seed_calls} calls per timed batch, "
        "median of "
        f"{args.seed_repeats} batches, alternating",
        "cuda_initialised": torch.cuda.is_initialized(),
        "shared_machine": "other engineers' jobs share these cores: see the load averages "
        "(machine.loadavg_at_start, each launch's loadavg_before, loadavg_after); "
        "'by CPU s' (samples per CPU-second of all ranks) is the less load-sensitive figure",
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return run_worker(args.worker)
    torch.set_num_threads(1)  # the sampler and seeding, as a rank with 1 thread runs them
    report = harness.head(
        "strong scaling of ddpflow's loop on CPU ranks; cost of the "
        "world-size-independent sampler and per-micro-batch seeding",
        conditions=conditions(args),
    )
    start = time.perf_counter()
    print("strong scaling ...", flush=True)
    report["scaling"] = strong_scaling(args)
    print("sampler and seeding ...", flush=True)
    report["sampler"] = sampler_cost(args)
    report["seeding"] = seeding_cost(args)
    fastest = min(r["micro_step_s"] for r in report["scaling"]["rows"])
    per_call = report["seeding"]["seconds_per_call"]
    shares = {k: per_call[k] / fastest for k in ("loop", "loop_depth_30")}
    report["seeding"].update(micro_step_s=fastest, share_of_micro_step=shares)
    report["conditions"]["loadavg_after"] = harness.loadavg()
    report["wall_s"] = time.perf_counter() - start
    print(format_table(report), flush=True)
    return harness.write(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
