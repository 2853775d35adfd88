"""Per-rank memory of the training state, and training throughput, by strategy: ddp, zero
(ZeRO stage 1) and fsdp (FSDP2, ddpflow.training.sharding.shard).

For each model (torchvision ResNet-50; ViT-B/16 at image size 32, i.e. 4 patches), optimizer
(AdamW: 2 state tensors per parameter; SGD with momentum: 1), strategy and world size, fresh
rank processes with a real gloo process group on 127.0.0.1 build the model (random init, 10
classes), wrap it in DDP when world > 1 (``ddpflow.training.build.wrap_ddp`` with the config's DDP
defaults) or, for fsdp, shard it with ``ddpflow.training.sharding.shard`` (fully_shard per block and
on the root, as the training does), build the optimizer with
``ddpflow.training.build.make_optimizer``
(``sharded=True`` for zero: a ZeroRedundancyOptimizer), train --steps steps on random
batches of --batch 3x32x32 images, and then measure on every rank:

* bytes held by this rank of parameters, gradients (``p.grad``) and optimizer state (zero:
  the local optimizer's ``opt.optim.state``, i.e. this rank's shard; ddp: ``opt.state``;
  fsdp: the local shards of the DTensor parameters, gradients and state),
  each storage counted once (``untyped_storage().data_ptr()``): with DDP's
  gradient_as_bucket_view the gradients are views of its buckets, so the buckets are counted;
* the process's peak resident memory (``getrusage(RUSAGE_SELF).ru_maxrss``) and current RSS
  (``VmRSS``), and the RSS before the model was built (imports + process group).

Theory, with P the parameter bytes and k state tensors per parameter: ddp holds (2 + k)P per
rank (parameters, gradients, state), zero 2P + kP/N, fsdp (2 + k)P/N (fsdp runs at world sizes
above 1 only: ddpflow trains one rank plain). A row reports the largest rank's figures
(max over ranks) and measured/theory; the saving table compares zero with ddp at the same
world size. Every configuration runs in its own process group launch, so a peak RSS is that
configuration's alone. MB = 10^6 bytes.

Throughput (--throughput-model, default ddpflow's built-in resnet18 with the small-image
stem): each strategy at --throughput-world ranks, --throughput-batch images per rank, SGD,
--throughput-steps timed steps after 2 warm-up steps, in the same run; samples/s and the ratio
to ddp.

    python bench/memory.py                 # resnet50, vit_b_16 x adamw, sgd x 3 strategies x 1 2 4
    python bench/memory.py --quick         # resnet50 only, world sizes 1 and 2
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import resource
import sys
import time
from pathlib import Path

import harness
import torch
import torch.distributed as dist
import torchvision
import workers
from ddpflow.config.typed import OptimizerSpec, TrainDdpSpec, TrainFsdpSpec
from ddpflow.training import sharding
from ddpflow.training.build import make_optimizer, wrap_ddp
from ddpflow.training.models import build_model as ddpflow_model

NUM_CLASSES = 10
IMAGE_SHAPE = [3, 32, 32]
MODELS = {
    "resnet50": "torchvision.models.resnet50(weights=None, num_classes=10)",
    "vit_b_16": "torchvision.models.vit_b_16(weights=None, num_classes=10, image_size=32)",
}
# the config's optimizer keys (make_optimizer reads them); k = state tensors per parameter
_OPTIMIZER = {"lr": 1e-3, "weight_decay": 0.0, "betas": [0.9, 0.999], "momentum": 0.9}
OPTIMIZERS = {name: {"name": name, **_OPTIMIZER, "nesterov": False} for name in ("adamw", "sgd")}
STATE_TENSORS = {"adamw": 2, "sgd": 1}
STRATEGIES = ("ddp", "zero", "fsdp")
MB = 1e6


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, "memory.json", worker=True)
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    p.add_argument("--optimizers", nargs="+", choices=sorted(OPTIMIZERS), default=list(OPTIMIZERS))
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=2, help="training steps before measuring")
    p.add_argument("--batch", type=int, default=2, help="images per rank and step")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--quick", action="store_true", help="resnet50 only, world sizes 1 and 2")
    p.add_argument("--throughput-model", default="resnet18", help="a ddpflow model.name")
    p.add_argument("--throughput-world", type=int, default=2)
    p.add_argument("--throughput-batch", type=int, default=32)
    p.add_argument("--throughput-steps", type=int, default=8)
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.world_sizes = ["resnet50"], [1, 2]
    return args


# --- worker process: train a few steps, then count ----------------------------------


def build_model(name: str) -> torch.nn.Module:
    if name not in MODELS:  # the throughput case: a ddpflow model by name
        model = {"name": name, "cnn_channels": 32, "mlp_hidden": [200, 200], "kwargs": {}}
        return ddpflow_model(model, IMAGE_SHAPE, NUM_CLASSES)
    if name == "resnet50":
        return torchvision.models.resnet50(weights=None, num_classes=NUM_CLASSES)
    return torchvision.models.vit_b_16(
        weights=None, num_classes=NUM_CLASSES, image_size=IMAGE_SHAPE[-1]
    )


def vm_rss() -> int:
    """Current resident set size of this process, bytes (/proc/self/status VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_rss() -> int:
    """Peak resident set size of this process, bytes (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def tensors_in(state) -> list[torch.Tensor]:
    """Every tensor in an optimizer's per-parameter state ({param: {name: tensor}})."""
    return [v for per_param in state.values() for v in per_param.values() if torch.is_tensor(v)]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: an FSDP DTensor's local shard, else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def held_bytes(groups: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Bytes of the storages behind each group's tensors; a storage is counted once, in the
    first group that reaches it (a DDP bucket: in gradients, by its first gradient view)."""
    seen: set[int] = set()
    out = {}
    for name, tensors in groups.items():
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        out[name] = total
    return out


def train_and_measure(cfg: dict, rank: int, world: int) -> dict:
    device = torch.device("cpu")
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts them too)
    model = build_model(cfg["model"])
    zero, fsdp = cfg["strategy"] == "zero", cfg["strategy"] == "fsdp" and world > 1
    if fsdp:
        net = model = sharding.shard(model, device, TrainFsdpSpec(), "fp32")
    else:
        net = wrap_ddp(model, device, TrainDdpSpec()) if world > 1 else model
    opt_cfg = OPTIMIZERS[cfg["optimizer"]]
    opt = make_optimizer(
        model.parameters(),
        OptimizerSpec.from_dict(opt_cfg),
        opt_cfg["lr"],
        device,
        sharded=zero,
        dtensors=fsdp,
    )
    setup_peak = peak_rss()  # the model built whole, wrapped or sharded, no step yet
    gen = torch.Generator().manual_seed(1000 + rank)
    loss_fn = torch.nn.CrossEntropyLoss()
    warmup = cfg.get("warmup", 0)
    for step in range(warmup + cfg["steps"]):
        if step == warmup:
            start = time.perf_counter()
        x = torch.randn(cfg["batch"], *IMAGE_SHAPE, generator=gen)
        y = torch.randint(0, NUM_CLASSES, (cfg["batch"],), generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
    step_seconds = (time.perf_counter() - start) / cfg["steps"]
    del x, y, loss
    gc.collect()
    params = list(model.parameters())
    local = opt.optim if zero else opt  # zero: this rank's shard lives in the local optimizer
    owned = [p for group in local.param_groups for p in group["params"]]
    counted = held_bytes(
        {
            "params": [_local(p) for p in params],
            "grads": [_local(p.grad) for p in params if p.grad is not None],
            "optimizer": [_local(t) for t in tensors_in(local.state)],
        }
    )
    return {
        "rank": rank,
        "param_count": sum(p.numel() for p in params),
        "param_bytes_numel": sum(p.numel() * p.element_size() for p in params),
        "params_bytes": counted["params"],
        "grads_bytes": counted["grads"],
        "optimizer_bytes": counted["optimizer"],
        "total_bytes": sum(counted.values()),
        "grad_tensors": sum(p.grad is not None for p in params),
        "optimizer_state_tensors": len(tensors_in(local.state)),
        "owned_params": len(owned),
        "owned_param_bytes": sum(_local(p).numel() * p.element_size() for p in owned),
        "step_seconds": step_seconds,
        "rss_bytes": vm_rss(),
        "peak_rss_bytes": peak_rss(),
        "setup_peak_rss_bytes": setup_peak,
    }


def run_worker(cfg: dict) -> int:
    rank, world = cfg["rank"], cfg["world_size"]
    torch.set_num_threads(cfg["threads"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        base = vm_rss()  # imports (torch, torchvision, ddpflow) and the process group
        row = {**train_and_measure(cfg, rank, world), "rss_base_bytes": base}
        row["peak_rss_above_base_bytes"] = row["peak_rss_bytes"] - base
        rows = [None] * world if rank == 0 else None
        dist.gather_object(row, rows, dst=0)
        workers.answer(cfg, rows)
        dist.barrier()  # every rank is done with the group
    except BaseException:
        dist.destroy_process_group()
        raise
    # The figures are written: leave without tearing gloo down. Its teardown after FSDP
    # sometimes aborted a rank ("terminate called without an active exception", exit -6:
    # a CI run of test_bench_smoke.py), failing a benchmark whose work was complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- driver -------------------------------------------------------------------------


def launch(cfg: dict) -> list[dict]:
    """One (model, optimizer, strategy, world size) in fresh worker processes; every rank's
    figures."""
    return workers.launch(__file__, cfg)


def theory_bytes(param_bytes: int, k: int, strategy: str, world: int) -> float:
    """Parameters + gradients + optimizer state per rank: (2 + k)P, 2P + kP/N (zero), or
    (2 + k)P/N (fsdp)."""
    if strategy == "fsdp":
        return (2 + k) * param_bytes / world
    return 2 * param_bytes + k * param_bytes / (world if strategy == "zero" else 1)


RANK_FIGURES = (
    *("params_bytes", "grads_bytes", "optimizer_bytes", "total_bytes"),
    *("peak_rss_bytes", "peak_rss_above_base_bytes", "rss_bytes", "rss_base_bytes"),
    *("step_seconds", "setup_peak_rss_bytes"),
)


def summarize(cfg: dict, ranks: list[dict], seconds: float) -> dict:
    """The row: every rank's figures, the largest rank's, theory and their ratio."""
    k = STATE_TENSORS[cfg["optimizer"]]
    param_bytes = ranks[0]["param_bytes_numel"]
    theory = theory_bytes(param_bytes, k, cfg["strategy"], cfg["world_size"])
    state_theory = k * param_bytes / (1 if cfg["strategy"] == "ddp" else cfg["world_size"])
    top = {key: max(r[key] for r in ranks) for key in RANK_FIGURES}
    return {
        **{key: cfg[key] for key in ("model", "optimizer", "strategy", "world_size")},
        "state_tensors_per_param": k,
        "param_count": ranks[0]["param_count"],
        "param_bytes": param_bytes,
        "max_over_ranks": top,
        "theory_bytes": theory,
        "measured_over_theory": top["total_bytes"] / theory,
        "optimizer_over_theory": top["optimizer_bytes"] / state_theory,
        "ranks": ranks,
        "launch_wall_s": seconds,
    }


def savings(rows: list[dict]) -> list[dict]:
    """zero against ddp at the same model, optimizer and world size (largest rank)."""
    by_key = {(r["model"], r["optimizer"], r["strategy"], r["world_size"]): r for r in rows}
    out = []
    for (model, optim, strategy, world), zero in by_key.items():
        ddp = by_key.get((model, optim, "ddp", world))
        if strategy == "ddp" or ddp is None:
            continue
        z, d = zero["max_over_ranks"], ddp["max_over_ranks"]
        out.append(
            {
                "model": model,
                "optimizer": optim,
                "strategy": strategy,
                "world_size": world,
                "ddp_total_bytes": d["total_bytes"],
                "strategy_total_bytes": z["total_bytes"],
                "saving_bytes": d["total_bytes"] - z["total_bytes"],
                "saving_fraction": 1 - z["total_bytes"] / d["total_bytes"],
                "theory_saving_fraction": 1 - zero["theory_bytes"] / ddp["theory_bytes"],
                "optimizer_ratio": z["optimizer_bytes"] / d["optimizer_bytes"],
                "peak_rss_saving_bytes": d["peak_rss_bytes"] - z["peak_rss_bytes"],
            }
        )
    return out


def format_table(report: dict) -> str:
    c = report["conditions"]
    lines = [
        f"# per-rank training-state memory, cpu/gloo, batch {c['batch_per_rank']}/rank, "
        f"{c['steps']} steps; largest rank; MB = 10^6 bytes",
        "| model | optimizer | strategy | world | params MB | grads MB | optimizer MB | "
        "total MB | theory MB | measured/theory | peak RSS MB |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in report["runs"]:
        m = r["max_over_ranks"]
        lines.append(
            f"| {r['model']} | {r['optimizer']} | {r['strategy']} | {r['world_size']} | "
            f"{m['params_bytes'] / MB:.1f} | {m['grads_bytes'] / MB:.1f} | "
            f"{m['optimizer_bytes'] / MB:.1f} | {m['total_bytes'] / MB:.1f} | "
            f"{r['theory_bytes'] / MB:.1f} | {r['measured_over_theory']:.3f} | "
            f"{m['peak_rss_bytes'] / MB:.0f} |"
        )
    if report["savings"]:
        lines += [
            "",
            "# zero and fsdp vs ddp, largest rank: training state (measured, theory), peak RSS",
            "| model | optimizer | strategy | world | ddp MB | strategy MB | saving | "
            "theory saving | optimizer vs ddp | peak RSS saving MB |",
            "|---|---|---|--:|--:|--:|--:|--:|--:|--:|",
        ]
        for s in report["savings"]:
            lines.append(
                f"| {s['model']} | {s['optimizer']} | {s['strategy']} | {s['world_size']} | "
                f"{s['ddp_total_bytes'] / MB:.1f} | {s['strategy_total_bytes'] / MB:.1f} | "
                f"{s['saving_fraction']:.1%} | {s['theory_saving_fraction']:.1%} | "
                f"{s['optimizer_ratio']:.3f} | {s['peak_rss_saving_bytes'] / MB:.0f} |"
            )
    if report.get("throughput"):
        t = report["throughput"]
        lines += [
            "",
            f"# throughput: {t['model']}, {t['world_size']} ranks x {t['batch_per_rank']} "
            f"images of 3x32x32, SGD, {t['steps']} timed steps after 2 warm-up",
            harness.markdown_table(
                ["strategy", "s/step (slowest rank)", "samples/s", "vs ddp"],
                map(throughput_cells, t["rows"]),
                rule="--:",
            ),
        ]
    return "\n".join(lines)


def throughput_cells(r: dict) -> list[str]:
    rates = [f"{r['samples_per_s']:.0f}", f"{r['vs_ddp']:.2f}x"]
    return [r["strategy"], f"{r['step_seconds']:.3f}", *rates]


def throughput(args: argparse.Namespace) -> dict:
    """Each strategy on the same model, batch and world size: samples/s and the ratio to ddp."""
    rows = []
    for strategy in args.strategies:
        case = {"model": args.throughput_model, "optimizer": "sgd", "strategy": strategy}
        cfg = {**case, "world_size": args.throughput_world, "steps": args.throughput_steps}
        cfg.update(warmup=2, batch=args.throughput_batch, threads=args.threads)
        print(f"running throughput {strategy} ...", flush=True)
        seconds = max(r["step_seconds"] for r in launch(cfg))
        rate = args.throughput_batch * args.throughput_world / seconds
        rows.append({"strategy": strategy, "step_seconds": seconds, "samples_per_s": rate})
    base = next((r["samples_per_s"] for r in rows if r["strategy"] == "ddp"), None)
    for row in rows:
        row["vs_ddp"] = row["samples_per_s"] / base if base else float("nan")
    return {
        "model": args.throughput_model,
        "world_size": args.throughput_world,
        "batch_per_rank": args.throughput_batch,
        "steps": args.throughput_steps,
        "rows": rows,
    }


def plan(args: argparse.Namespace) -> list[dict]:
    cores = os.cpu_count() or 1
    configs = []
    for model in args.models:
        for optim in args.optimizers:
            for world in args.world_sizes:
                if world * args.threads > cores:
                    over = f"{world} ranks x {args.threads} threads > {cores} cores"
                    print(f"note: {over} (memory is unaffected; steps are slower)", file=sys.stderr)
                for strategy in args.strategies:
                    if strategy == "fsdp" and world == 1:
                        continue  # one rank trains plain: the ddp row
                    configs.append(
                        {
                            "model": model,
                            "optimizer": optim,
                            "strategy": strategy,
                            "world_size": world,
                            "steps": args.steps,
                            "batch": args.batch,
                            "threads": args.threads,
                        }
                    )
    return configs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return run_worker(args.worker)
    report = harness.head(
        "per-rank memory of the training state and throughput: ddp, zero "
        "(ZeRO stage 1), fsdp (FSDP2)",
        conditions=conditions(args),
        runs=[],
    )
    start = time.perf_counter()
    for cfg in plan(args):
        name = f"{cfg['model']} {cfg['optimizer']} {cfg['strategy']} x{cfg['world_size']}"
        print(f"running {name} ...", flush=True)
        launch_start = time.perf_counter()
        ranks = launch(cfg)
        report["runs"].append(summarize(cfg, ranks, time.perf_counter() - launch_start))
    report["savings"] = savings(report["runs"])
    if args.throughput_steps > 0:
        report["throughput"] = throughput(args)
    report["wall_s"] = time.perf_counter() - start
    report["loadavg_after"] = harness.loadavg()
    print(format_table(report), flush=True)
    return harness.write(report, args.out)


def conditions(args: argparse.Namespace) -> dict:
    return {
        "device": "cpu",
        "backend": "gloo",
        "launch": "one process group launch per configuration (one process per rank, "
        "tcp rendezvous on 127.0.0.1), so peak RSS is that configuration's alone",
        "models": {name: MODELS[name] for name in args.models},
        "optimizers": {name: OPTIMIZERS[name] for name in args.optimizers},
        "optimizer_factory": "ddpflow.training.build.make_optimizer (fused kernels; "
        "sharded=True for "
        "zero: torch.distributed.optim.ZeroRedundancyOptimizer)",
        "state_tensors_per_param": {name: STATE_TENSORS[name] for name in args.optimizers},
        "strategies": args.strategies,
        "world_sizes": args.world_sizes,
        "ddp": "ddpflow.training.build.wrap_ddp when world > 1, settings: "
        + json.dumps(dataclasses.asdict(TrainDdpSpec())),
        "world_1": "no DDP wrapper (as Loop); zero at world 1 is a ZeroRedundancyOptimizer "
        "on a 1-rank group (Loop itself trains plain at 1 rank)",
        "steps": args.steps,
        "batch_per_rank": args.batch,
        "image_shape": IMAGE_SHAPE,
        "data": "torch.randn images, random labels, generator seeded per rank",
        "threads_per_rank": args.threads,
        "counting": "storage bytes behind parameters, p.grad and the optimizer state this "
        "rank holds (zero: opt.optim.state), each storage once (data_ptr)",
        "rss": "peak: getrusage(RUSAGE_SELF).ru_maxrss; current: /proc/self/status VmRSS; "
        "base: VmRSS after init_process_group, before the model",
        "theory": "P = parameter bytes, k state tensors per parameter: ddp (2 + k)P, "
        "zero 2P + kP/N, fsdp (2 + k)P/N per rank",
        "fsdp": "ddpflow.training.sharding.shard (fully_shard per block, then the root; "
        "reshard_after_forward, fp32), optimizer on the DTensor shards (foreach)",
        "row": "max over ranks of each figure; measured/theory = largest rank's total / theory",
        "mb": "10^6 bytes",
        "quick": args.quick,
    }


if __name__ == "__main__":
    raise SystemExit(main())
