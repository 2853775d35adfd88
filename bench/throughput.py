"""Training throughput: ddpflow's loop vs the raw PyTorch DDP tutorial loop.

Both loops train the same model (ddpflow.training.models) on the same synthetic uint8 images,
normalised with the same per-channel mean/std, with the same per-rank batch, world size,
optimizer (the shipped config's SGD) and initial weights. ddpflow gets the per-rank batch as
train.micro_batch_size and the global batch as train.global_batch_size = batch x world (one
micro-batch per rank and step, no accumulation: the raw loop's step), and the epoch sizes are
whole global batches, so both loops take the same steps of the same sizes:

* ``raw``: the FashionMNIST DDP tutorial, as written there: TensorDataset + DataLoader
  (batch_size, sampler=DistributedSampler, pin_memory on CUDA), ``sampler.set_epoch``,
  per-step ``.to(device)``, zero_grad/backward/step, ``loss.item()`` every step, the model
  always wrapped in DDP (a 1-rank process group at world size 1).
* ``ddpflow``: ``ddpflow.training.loop.Loop`` built as ``tasks.TrainTask`` builds it (the shipped
  config, the dataset held as tensors on the device, its order from
  ``schedule.step_micro_batches`` + ``rank_micro_batches``, the checkpointer's per-step hook),
  one ``train_epoch()`` per repeat.

One repeat is one epoch; its time is the slowest rank's (barrier before, MAX all-reduce
after) and samples/s = global samples / that time. The two loops alternate repeat by
repeat (after --warmup untimed epochs each), so machine noise hits both; the reported
value is the median over --repeats. Ranks are ``python this-file --worker ...`` processes
with a real gloo (CPU) or nccl (GPU) process group on 127.0.0.1.

    python bench/throughput.py                                    # CPU: mlp, cnn, resnet18
    python bench/throughput.py --cases mlp --world-sizes 1 --repeats 1 --warmup 0
    python bench/throughput.py --gpu [--compile]                  # ResNet-18 32x32, batch 512
    python bench/throughput.py --lightning    # ddpflow vs a Lightning Trainer: mlp x2, cnn x2,
                                              # resnet18 x1 (bench/install-peers first)

``--lightning`` puts a lightning.Trainer's loop (bench/lightning_loop.py) in place of the raw
one: same model, data, batch, optimizer, lr and schedule, its epochs alternating with
ddpflow's in the same ranks and process group.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import harness
import torch
import workers
from ddpflow import runtime
from ddpflow.training.models import build_model
from loops import (
    NUM_CLASSES,
    ddpflow_epoch,
    ddpflow_run,
    peer_layout,
    process_group,
    rank_device,
    schedule,
    synthetic,
    timed_epoch,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

# samples: global samples per epoch (= per repeat); ResNet-18 is kept to a few batches on CPU
CASES = {
    "mlp": {"model": "mlp", "shape": [1, 28, 28], "samples": 8192},
    "cnn": {"model": "cnn", "shape": [1, 28, 28], "samples": 1024},
    "resnet18": {"model": "resnet18", "shape": [3, 32, 32], "samples": 256},
}
# --lightning: the CPU cases against Lightning, each at one world size
LIGHTNING_WORLD = {"mlp": 2, "cnn": 2, "resnet18": 1}
LIGHTNING_TARGET = 1.2  # ddpflow's loop vs Lightning's, every CPU case
TRAINER_NOTE = "without logger, checkpointing, progress bar, summary or validation"
GPU_CASE = {"model": "resnet18", "shape": [3, 32, 32], "samples": 512 * 40}
# dense bf16 peak, TFLOP/s (vendor datasheets; SXM parts); --peak-tflops overrides
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, None, worker=True)  # --out: throughput[_lightning].json
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    p.add_argument("--world-sizes", type=int, nargs="+", default=None, help="CPU: 1 2; GPU: 1")
    p.add_argument("--batch", type=int, default=None, help="per rank (CPU 32, GPU 512)")
    p.add_argument("--threads", type=int, default=None, help="per rank (CPU: 1)")
    p.add_argument("--repeats", type=int, default=5, help="timed epochs per loop")
    p.add_argument("--warmup", type=int, default=1, help="untimed epochs per loop")
    p.add_argument("--samples-scale", type=float, default=1.0, help="scale epoch sizes")
    p.add_argument("--gpu", action="store_true", help="ResNet-18 on CUDA: bf16, channels_last")
    p.add_argument(
        "--lightning", action="store_true", help="ddpflow vs a Lightning Trainer (not raw)"
    )
    p.add_argument("--compile", action="store_true", help="--gpu: torch.compile ddpflow's model")
    precision = "CPU: every loop in this precision (ddpflow train.precision, Lightning "
    precision += "'bf16-mixed', the raw loop under torch.autocast)"
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help=precision)
    layout = "CPU: the peer's convolutional model in channels_last too, as ddpflow places it "
    layout += "(isolates the loops from the layout)"
    p.add_argument("--peer-channels-last", action="store_true", help=layout)
    p.add_argument("--peak-tflops", type=float, default=None, help="GPU peak for MFU")
    return p.parse_args(argv)


# --- worker process: the two loops --------------------------------------------------


class SyncClock(runtime.PhaseClock):
    """The per-phase timing ddpflow had before CUDA events: torch.cuda.synchronize before and
    after every phase (8 per step), wall time in between."""

    @contextlib.contextmanager
    def phase(self, store, key):
        torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        torch.cuda.synchronize()
        store[key] = store.get(key, 0.0) + time.perf_counter() - start


class NoClock(runtime.PhaseClock):
    """No per-phase timing at all: the floor the other two are compared with."""

    @contextlib.contextmanager
    def phase(self, store, key):
        yield


# GPU: what per-phase timing costs, each a separate Loop in the same run (bench/README.md)
TIMING_VARIANTS = {"ddpflow_sync_timing": SyncClock, "ddpflow_no_timing": NoClock}


def raw_epoch(cfg: dict, run: dict, lr: float, images, labels, norm, device):
    """The tutorial's loop, verbatim in spirit; returns the epoch function."""
    rank, world = cfg["rank"], cfg["world_size"]
    dataset = TensorDataset(images, labels)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(
        dataset, batch_size=cfg["batch"], sampler=sampler, pin_memory=device.type == "cuda"
    )
    torch.manual_seed(run["train"]["seed"])
    model = peer_layout(cfg, build_model(run["model"], cfg["case"]["shape"], NUM_CLASSES))
    model = model.to(device)
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=cfg["precision"] == "bf16")
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = run["train"]["optimizer"]
    if opt["name"] != "sgd":  # the tutorial's optimizer; the shipped config's too
        raise ValueError(f"raw loop: only sgd is written out, config has {opt['name']!r}")
    optimizer = torch.optim.SGD(
        ddp.parameters(),
        lr=lr,
        momentum=opt["momentum"],
        nesterov=opt["nesterov"],
        weight_decay=opt["weight_decay"],
    )
    loss_fn = nn.CrossEntropyLoss()
    mean, std = (t.to(device) for t in norm)
    state = {"epoch": 0}

    def epoch() -> dict:
        sampler.set_epoch(state["epoch"])
        state["epoch"] += 1
        ddp.train()
        running_loss = 0.0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            x = (x.float() / 255.0 - mean) / std
            with autocast:
                loss = loss_fn(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
        # global samples (all ranks), as Loop's epoch record counts them
        return {"samples": len(sampler) * world, "train_loss": running_loss / len(loader)}

    return epoch


def measure(loops: dict, cfg: dict, device, sync) -> dict:
    """Warm each loop up, then alternate them repeat by repeat (order flipped each time). A
    loop with drive() (Lightning's Trainer owns its epoch loop) runs the whole schedule."""
    rates = {name: ([], []) for name in loops}
    phases = []

    def record(name, repeat, rate, cpu_rate):
        if repeat is not None:
            rates[name][0].append(rate)
            rates[name][1].append(cpu_rate)

    def run(name, repeat):
        rate, cpu_rate, rec = timed_epoch(loops[name], device, sync)
        record(name, repeat, rate, cpu_rate)
        if name == "ddpflow" and repeat is not None:
            phases.append({k: v / rec["micro_steps"] for k, v in rec["seconds"].items()})

    order = schedule(list(loops), cfg["warmup"], cfg["repeats"])
    driver = next((fn for fn in loops.values() if hasattr(fn, "drive")), None)
    if driver is not None:
        driver.drive(order, run, record)
    else:
        for name, repeat in order:
            run(name, repeat)
    out = {
        name: {
            "samples_per_s": statistics.median(wall),
            "all": wall,
            "samples_per_cpu_s": statistics.median(cpu),
            "all_per_cpu_s": cpu,
        }
        for name, (wall, cpu) in rates.items()
    }
    out["ddpflow"]["phase_seconds_per_step"] = {
        k: statistics.median(p[k] for p in phases) for k in phases[0]
    }
    return out


# kernels by what they compute (torch.profiler's self CPU time of aten ops, by name)
OP_KINDS = {
    "convolution": ("conv",),
    "batch_norm": ("batch_norm",),
    "matmul": ("addmm", "mm", "linear", "bmm"),
}


def op_kind(op: str) -> str:
    return next((k for k, parts in OP_KINDS.items() if any(p in op for p in parts)), "other_ops")


def op_shares(epoch_fn, profile: bool) -> dict | None:
    """One epoch of ddpflow's loop under torch.profiler (rank 0; the others train along):
    the shares of its wall time spent in convolution, batch-norm and matmul kernels (which
    every loop runs alike), in other aten ops, and outside any op: Python, and waiting for
    the gradient all-reduce, which gloo runs on its own thread (the inherent cost of
    communication on this machine; what a loop could still save is in "other" and part of
    "outside")."""
    if not profile:
        epoch_fn()
        return None
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    with profiler(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        epoch_fn()
        wall_us = (time.perf_counter() - start) * 1e6
    shares = dict.fromkeys([*OP_KINDS, "other_ops"], 0.0)
    for event in prof.key_averages():
        if event.key.startswith("aten::"):
            shares[op_kind(event.key.removeprefix("aten::"))] += event.self_cpu_time_total / wall_us
    shares["outside_ops"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def run_worker(cfg: dict) -> int:
    device, backend, sync = rank_device(cfg)
    with process_group(cfg, backend) as env:
        run = ddpflow_run(cfg)
        images, labels, norm = synthetic(cfg["case"]["shape"], cfg["samples"])
        ours, loop = ddpflow_epoch(cfg, run, images, labels, norm, env, device)
        loops = {"ddpflow": ours}
        if cfg["baseline"] == "lightning":
            from lightning_loop import LightningLoop  # bench/.peers-site, --lightning only

            loops["lightning"] = LightningLoop(cfg, run, loop.lr, images, labels, norm)
        else:
            loops = {"raw": raw_epoch(cfg, run, loop.lr, images, labels, norm, device), **loops}
        if cfg["device"] == "cuda" and not cfg.get("compile"):
            for name, clock in TIMING_VARIANTS.items():
                loops[name], variant = ddpflow_epoch(cfg, run, images, labels, norm, env, device)
                variant.clock = clock(device)
        result = measure(loops, cfg, device, sync)
        result["lr"] = loop.lr
        if cfg["device"] == "cpu":  # where the step's time goes: one more, profiled epoch
            result["ddpflow"]["op_shares"] = op_shares(ours, profile=env.is_master)
    return workers.answer(cfg, result)


# --- driver -------------------------------------------------------------------------


def launch(cfg: dict) -> dict:
    """One (case, world size) in fresh worker processes; rank 0's measurements."""
    lightning = cfg["baseline"] == "lightning"
    return workers.launch(__file__, cfg, env=workers.peers_env() if lightning else None)


@torch.no_grad()
def forward_flops(model: nn.Module, shape: list[int]) -> int:
    """Forward FLOPs of one sample (2 x multiply-adds), counted by torch's FLOP counter."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    was_training = model.training
    model.eval()
    with counter:
        model(torch.zeros(1, *shape))
    model.train(was_training)
    return int(counter.get_total_flops())


def train_flops_per_sample(case: dict) -> int:
    """3 x forward FLOPs (forward + backward), torch's FLOP counter on one sample."""
    spec = {"name": case["model"], "mlp_hidden": [200, 200], "cnn_channels": 32}
    model = build_model(spec, case["shape"], NUM_CLASSES)
    return 3 * forward_flops(model, case["shape"])


def peak_flops(args: argparse.Namespace) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if not (args.gpu and torch.cuda.is_available()):
        return None
    name = torch.cuda.get_device_name(0)
    return next((v * 1e12 for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def threads(args: argparse.Namespace, cores: int, world: int) -> int:
    """Torch threads per rank: 1 on CPU by default (world x threads <= cores, and every
    world size runs the same per-rank conditions); cores // world on GPU (collation)."""
    count = args.threads or (max(1, cores // world) if args.gpu else 1)
    if count * world > cores:
        print(f"warning: {world} ranks x {count} threads > {cores} cores", file=sys.stderr)
    return count


def plan(args: argparse.Namespace) -> list[dict]:
    cores = os.cpu_count() or 1
    if args.gpu:
        cases, device = {"resnet18": GPU_CASE}, "cuda"
        worlds, batch = args.world_sizes or [1], args.batch or 512
    else:
        cases, device = {name: CASES[name] for name in args.cases}, "cpu"
        worlds, batch = args.world_sizes or [1, 2], args.batch or 32
    pairs = [(name, world) for world in worlds for name in cases]
    if args.lightning:  # each case at its own world size unless --world-sizes says otherwise
        pairs = [(n, w) for n in cases for w in args.world_sizes or [LIGHTNING_WORLD[n]]]
    configs = []
    for name, world in pairs:
        # whole batches on every rank: no ragged last step (and no recompile)
        step = batch * world
        samples = max(step, round(cases[name]["samples"] * args.samples_scale / step) * step)
        configs.append(
            {
                "name": name,
                "case": cases[name],
                "device": device,
                "world_size": world,
                "batch": batch,
                "threads": threads(args, cores, world),
                "samples": samples,
                "repeats": args.repeats,
                "warmup": max(args.warmup, 1) if args.compile else args.warmup,
                "compile": args.compile,
                "baseline": "lightning" if args.lightning else "raw",
                "precision": args.precision,  # the peers' (and ddpflow's on CPU)
                "peer_channels_last": args.peer_channels_last,
            }
        )
    if not args.gpu and not args.lightning and "mlp" in cases:
        configs += ddp_variants(configs)
    return configs


# DDP settings exposed in the config (train.ddp), measured where communication dominates:
# the MLP at world size > 1 (its step is ~2.8 ms of compute and ~5 ms of gradient sync)
DDP_VARIANTS = {
    "bucket1mb": {"bucket_cap_mb": 1},
    "no_bucket_view": {"gradient_as_bucket_view": False},
    "static_graph": {"static_graph": True},
    "bf16_compress": {"comm_hook": "bf16_compress"},
}


def ddp_variants(configs: list[dict]) -> list[dict]:
    base = [c for c in configs if c["name"] == "mlp" and c["world_size"] > 1]
    return [
        {**c, "name": f"mlp+{label}", "ddp": settings}
        for c in base
        for label, settings in DDP_VARIANTS.items()
    ]


def format_table(rows: list[dict]) -> str:
    first, base = rows[0], rows[0]["baseline"]
    short = base[:5]  # raw / light
    w = max(9, *(len(r["name"]) for r in rows))
    target = " target" if base == "lightning" else ""
    lines = [
        f"# training throughput, {first['device']}, "
        + (
            "ddpflow bf16, raw fp32, "
            if first["device"] == "cuda"
            else f"{first.get('precision', 'fp32')}, "
        )
        + f"peers {'channels_last' if first.get('peer_channels_last') else 'NCHW'}, "
        f"batch {first['batch']}/rank; median of "
        f"{first['repeats']} epochs after {first['warmup']} warmup; slowest rank",
        f"{'case':<{w}} {'world':>5} {'threads':>7} {'samples':>7} | {short + ' samp/s':>12} "
        f"{'ddpflow samp/s':>14} {'speedup':>7} | {'by CPU s':>8} | {'GFLOP/s':>7} {'MFU':>11}"
        + target,
    ]
    for r in rows:
        mfu = "-"
        if r["ddpflow"].get("mfu") is not None:  # GPU: raw / ddpflow
            mfu = f"{r[base]['mfu']:.1%}/{r['ddpflow']['mfu']:.1%}"
        verdict = ""
        if base == "lightning":
            verdict = f" {'meets' if r['speedup'] >= LIGHTNING_TARGET else 'MISSES'} "
            verdict += f"{LIGHTNING_TARGET}x"
        lines.append(
            f"{r['name']:<{w}} {r['world_size']:>5} {r['threads']:>7} {r['samples']:>7} | "
            f"{r[base]['samples_per_s']:12.1f} {r['ddpflow']['samples_per_s']:14.1f} "
            f"{r['speedup']:6.2f}x | {r['cpu_time_speedup']:7.2f}x | "
            f"{r['ddpflow']['gflops']:7.1f} {mfu:>11}{verdict}"
        )
    lines.append(
        f"(samples/s: all ranks together, wall time; speedup: ddpflow / {base}; 'by CPU s': the "
        "same ratio in samples per CPU-second of all ranks, robust to other load; GFLOP/s: "
        f"ddpflow, 3 x forward FLOPs; MFU: {base}/ddpflow vs dense bf16 peak, GPU only)"
    )
    return "\n".join(lines)


def finish_row(cfg: dict, result: dict, peak: float | None) -> dict:
    flops = train_flops_per_sample(cfg["case"])
    base = cfg["baseline"]
    for name in (base, "ddpflow"):
        rate = result[name]["samples_per_s"]
        result[name]["gflops"] = rate * flops / 1e9
        result[name]["mfu"] = rate * flops / peak if peak else None
    speedup = result["ddpflow"]["samples_per_s"] / result[base]["samples_per_s"]
    cpu_ratio = result["ddpflow"]["samples_per_cpu_s"] / result[base]["samples_per_cpu_s"]
    row = {**cfg, **result, "train_flops_per_sample": flops, "speedup": speedup}
    row["cpu_time_speedup"] = cpu_ratio
    return {**row, "loadavg_after": harness.loadavg()}  # others' work = noise


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return run_worker(args.worker)
    if args.gpu and not torch.cuda.is_available():
        print("--gpu: no CUDA device visible", file=sys.stderr)
        return 2
    if args.gpu and args.lightning:
        print("--lightning: CPU cases only", file=sys.stderr)
        return 2
    if args.gpu and (args.precision != "fp32" or args.peer_channels_last):
        print("--precision, --peer-channels-last: CPU cases only (--gpu is bf16)", file=sys.stderr)
        return 2
    name = "throughput_lightning" if args.lightning else "throughput"
    out = args.out or harness.OUT / f"{name}.json"
    peak = peak_flops(args)
    base = "Lightning Trainer" if args.lightning else "raw PyTorch DDP tutorial loop"
    report = harness.head(
        f"training throughput: ddpflow.training.loop.Loop vs {base}",
        conditions=conditions(args, peak),
        runs=[],
    )
    if args.lightning and not add_lightning(report):
        print(report["skipped"], file=sys.stderr)
        return harness.write(report, out)
    for cfg in plan(args):
        print(f"running {cfg['name']} at world size {cfg['world_size']} ...", flush=True)
        report["runs"].append(finish_row(cfg, launch(cfg), peak))
    print(format_table(report["runs"]), flush=True)
    for row in report["runs"]:
        print_notes(row)
    return harness.write(report, out)


def conditions(args: argparse.Namespace, peak: float | None) -> dict:
    return {
        "timing": "one epoch per repeat, barrier before, slowest rank; median of repeats",
        "order": "the loops alternate each repeat, order flipped every repeat",
        "repeats": args.repeats,
        "warmup_epochs": args.warmup,
        "data": "synthetic uint8 images, random labels, normalised by per-channel mean/std",
        "raw": "TensorDataset+DataLoader(DistributedSampler), .to(device), loss.item() "
        "per step, DDP-wrapped at every world size (1-rank group at world 1)",
        "ddpflow": "Loop from the shipped config (SGD nesterov, cosine schedule); "
        "micro_batch_size = the per-rank batch, global_batch_size = batch x world (no "
        "accumulation); order: step_micro_batches + rank_micro_batches; "
        "DDP only when world > 1; "
        + (
            "bf16 autocast, channels_last, fused SGD"
            if args.gpu
            else f"{args.precision}, convolutional models in channels_last"
        ),
        "peers": (
            f"{args.precision}; "
            + (
                "convolutional models in channels_last like ddpflow's"
                if args.peer_channels_last
                else "models in their default NCHW layout"
            )
        ),
        "launch": "one process per rank, tcp rendezvous on 127.0.0.1",
        "peak_flops": peak,
    }


def print_notes(row: dict) -> None:
    """Where ddpflow's CPU epoch goes, and on GPU what its per-phase timing costs."""
    if shares := row["ddpflow"].get("op_shares"):
        spent = ", ".join(f"{kind} {share:.0%}" for kind, share in shares.items())
        print(f"# {row['name']} x{row['world_size']}: ddpflow's epoch time in: {spent}")
    if "ddpflow_no_timing" in row:
        names = {"ddpflow_no_timing": "no_timing", "ddpflow": "cuda events (shipped)"}
        names["ddpflow_sync_timing"] = "sync_timing"
        rates = {names[n]: row[n]["samples_per_s"] for n in names}
        base = rates["no_timing"]
        cost = ", ".join(f"{n} {r:.0f} ({r / base - 1:+.1%})" for n, r in rates.items())
        print(f"# per-phase timing cost, samples/s (vs no timing): {cost}")


def add_lightning(report: dict) -> bool:
    """Lightning's version and loop into the report; False (and why) when not importable."""
    version = workers.lightning_version()
    report["provenance"]["versions"]["lightning"] = version
    report["conditions"]["lightning"] = (
        "lightning.Trainer(strategy='ddp', accelerator='cpu') in the benchmark's ranks and "
        "process group (LightningEnvironment), its DistributedSampler, plain SGD + the same "
        f"LambdaLR per step; timed on_train_epoch_start -> end; Trainer {TRAINER_NOTE}"
    )
    report["conditions"]["target"] = f"ddpflow >= {LIGHTNING_TARGET}x Lightning"
    if version is None:
        report["skipped"] = (
            "Lightning is not importable from bench/.peers-site (run bench/install-peers): "
            "no Lightning rows"
        )
    return version is not None


if __name__ == "__main__":
    raise SystemExit(main())
