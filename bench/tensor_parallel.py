"""Tensor parallelism on CPU ranks: the gpt's training step time and each rank's training
state (parameters, gradients, optimizer state), at 2 gloo ranks and one global batch, as
ddp at train.tensor_parallel 1 (the baseline: 2 data-parallel ranks), ddp at
tensor_parallel 2 (1 data x 2 tensor ranks) and fsdp at tensor_parallel 1.

Each configuration is ddpflow's Loop as tasks.TrainTask builds it (tensor_parallel.arrange:
the data view of the rank on a (data, tensor) mesh; load_data: the staged token blocks and
their TokenFeed; build.placed_model; Loop: the strategy's wrapper, GradientSync under
tensor parallelism, AdamW as build.make_optimizer makes it for that layout), on the same
data (one text file of the standard library's email package's .py sources, staged by
ddpflow as bytes), the same gpt and initial weights, the same global batch of blocks (micro
batch = global batch / data-parallel ranks, no accumulation) and the same AdamW.

Per gpt size, one launch of 2 rank processes (gloo on 127.0.0.1, 1 torch thread each)
builds the three Loops and trains them alternately, one epoch of --steps optimizer steps at
a time (the order flipped every repeat), after one untimed warm-up epoch each:

* step time: the wall time between consecutive optimizer steps within an epoch (a step's
  data, forward, backward with its all-reduces, optimizer), median over the timed epochs'
  steps; each rank's median, the slowest rank's reported;
* training state per rank: the bytes of the local tensors a rank holds right after an
  optimizer step (an optimizer step post-hook: the gradients and the optimizer state both
  exist), numel x element size of each parameter, gradient and optimizer state tensor
  (DTensor: to_local()), the largest over the warm-up epoch's steps (the hook is gone
  before the timed epochs); the largest rank's reported. Theory: ddp
  holds 4P (AdamW: parameters, gradients, two moments), tensor_parallel 2 4(W + S/2) with S
  the blocks' split projections and W the rest (embeddings, norms), fsdp 4P/2;
* all-reduces per step: one untimed, profiled epoch per configuration after the timing
  (torch.profiler; every ProcessGroup all-reduce, DDP's buckets and DTensor's collectives
  included, between two optimizer steps), the count on rank 0.

    python bench/tensor_parallel.py           # gpt 2x128 (T 64) and 4x256 (T 128), ~1 minute
    python bench/tensor_parallel.py --quick   # a tiny gpt, 3 steps, 1 repeat (seconds)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness
import torch
import torch.distributed as dist
import workers
from ddpflow import config as ddpconfig
from ddpflow.config.typed import RunSpec
from ddpflow.data.staging import stage_dataset
from ddpflow.training import tensor_parallel
from ddpflow.training.build import placed_model
from ddpflow.training.loop import Loop
from ddpflow.training.rankdata import load_data
from lm import CORPUS_PACKAGE, TEST_FRACTION, VAL_FRACTION, corpus_length, write_corpus
from loops import process_group, schedule

CPU = torch.device("cpu")
WORLD = 2
CASES = {  # name: (train.strategy, train.tensor_parallel)
    "ddp": ("ddp", 1),
    "ddp_tp2": ("ddp", 2),
    "fsdp": ("fsdp", 1),
}
BASELINE = "ddp"
SIZES = {  # name: (n_layer, n_embd, n_head, block_size)
    "small": (2, 128, 4, 64),
    "large": (4, 256, 8, 128),
    "tiny": (1, 32, 2, 16),  # --quick
}
OPTIMIZER = {"name": "adamw", "lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}
SPLIT = ("attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight")
SPLIT += ("mlp.0.weight", "mlp.0.bias", "mlp.2.weight")  # tensor_parallel's split tensors
STEP_MARK = "bench: optimizer step done"
KINDS = {  # a c10d op's name (part) -> the collective
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "broadcast": "broadcast",
}
MB = 1e6


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, "tensor_parallel.json", worker=True)
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["small", "large"])
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument("--global-batch", type=int, default=16, help="blocks per optimizer step")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per epoch")
    p.add_argument("--repeats", type=int, default=3, help="timed epochs per configuration")
    p.add_argument("--no-profile", action="store_true", help="skip counting the all-reduces")
    p.add_argument("--quick", action="store_true", help="the tiny gpt, 3 steps, 1 repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.steps, args.repeats, args.global_batch = ["tiny"], 3, 1, 8
    if BASELINE not in args.cases:
        p.error(f"--cases must include the baseline {BASELINE}")
    return args


# --- worker process: the Loops, timed and counted ------------------------------------------


def run_config(cfg: dict, case: str) -> dict:
    """The schema's defaults with this benchmark's data, gpt, batch, strategy and degree."""
    strategy, tensor = CASES[case]
    overrides = {
        "task": "language_model",
        "data": cfg["data"],
        "model": {"name": "gpt", "kwargs": gpt_kwargs(cfg["size"])},
        "train": {
            "global_batch_size": cfg["global_batch"],
            "micro_batch_size": cfg["global_batch"] * tensor // WORLD,
            "epochs": 1 + cfg["repeats"],
            "progress": False,
            "strategy": strategy,
            "tensor_parallel": tensor,
            "optimizer": OPTIMIZER,
            "lr_scaling": "none",
        },
        "machine": {"gpus_per_node": 0, "cpu_ranks_per_node": WORLD, "cpus_per_task": 1},
    }
    return ddpconfig.resolve_runs(ddpconfig.load(None, overrides))[0]


def gpt_kwargs(size: str) -> dict:
    n_layer, n_embd, n_head, _ = SIZES[size]
    return {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head}


def local_bytes(tensors) -> int:
    """numel x element size of each tensor's part on this rank (a DTensor's local shard)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def held(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    params = list(model.parameters())  # the tied embedding / output weight once
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    counted = {
        "params_bytes": local_bytes(params),
        "grads_bytes": local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer_bytes": local_bytes(state),
    }
    return {**counted, "total_bytes": sum(counted.values())}


def collective(name: str) -> str | None:
    """A profiler event's collective ("all_reduce", ...) if it is a ProcessGroup call."""
    if not name.startswith("c10d::"):
        return None
    op = name.removeprefix("c10d::")
    return next((kind for key, kind in KINDS.items() if key in op), op.strip("_"))


@contextlib.contextmanager
def quiet_stderr():
    """The profiler's own lines (kineto writes to file descriptor 2) kept off the output."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class Case:
    """One configuration's Loop on this rank, with its step times and its largest state."""

    def __init__(self, cfg: dict, case: str, env, staged: str):
        self.name = case
        spec = RunSpec.from_run(run_config(cfg, case))
        view, _ = tensor_parallel.arrange(spec, env, CPU, ["127.0.0.1"] * WORLD)
        data = load_data(spec, staged, view, CPU, splits=("train", "val"))
        model, loaded = placed_model(spec, data.shape, data.num_classes, CPU)
        self.loop = loop = Loop(spec, data, view, CPU, model, loaded)
        assert loop.steps_per_epoch == cfg["steps"], (loop.steps_per_epoch, cfg["steps"])
        self.step_ends: list[tuple[float, float]] = []  # (wall, this process's CPU) seconds
        self.steps: list[float] = []  # seconds, the timed epochs' steps after their first
        self.cpu: list[float] = []  # their CPU seconds (this rank's process, gloo included)
        self.phases: list[dict] = []
        self.peak: dict = {"total_bytes": -1}
        loop.watch_steps(self.on_step)
        # counted in the warm-up epoch only: the timed steps run without the hook
        self.counting = loop.optimizer.register_step_post_hook(self.after_optimizer)
        self.optimizer = {
            "class": type(loop.optimizer).__name__,
            **{k: loop.optimizer.defaults.get(k) for k in ("fused", "foreach")},
        }
        self.layout = {"data_ranks": view.world_size, "tensor_ranks": view.tensor_parallel}
        self.layout["micro_batch"] = spec.train.micro_batch_size

    def on_step(self, loop: Loop) -> None:
        self.step_ends.append((time.perf_counter(), time.process_time()))
        with torch.profiler.record_function(STEP_MARK):
            pass

    def after_optimizer(self, optimizer, args, kwargs) -> None:
        now = held(self.loop.model, optimizer)
        if now["total_bytes"] > self.peak["total_bytes"]:
            self.peak = now

    def epoch(self, timed: bool) -> None:
        self.step_ends = []
        record = self.loop.train_epoch()
        self.counting.remove()
        if timed:
            ends = self.step_ends
            self.steps += [b[0] - a[0] for a, b in zip(ends, ends[1:], strict=False)]
            self.cpu += [b[1] - a[1] for a, b in zip(ends, ends[1:], strict=False)]
            per = record["micro_steps"]
            self.phases.append({k: v / per for k, v in record["seconds"].items()})

    def collectives_per_step(self) -> list[dict]:
        """The collectives between consecutive optimizer steps of one profiled epoch, by
        kind: every ProcessGroup call (c10d::*), DDP's buckets and DTensor's included."""
        from torch.profiler import ProfilerActivity, profile

        with quiet_stderr():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                self.loop.train_epoch()
            events = sorted(prof.events(), key=lambda e: e.time_range.start)
        counts: list[dict] = []
        current: dict | None = None
        for event in events:
            if event.name == STEP_MARK:
                if current is not None:
                    counts.append(current)
                current = {}
            elif current is not None and (kind := collective(event.name)):
                current[kind] = current.get(kind, 0) + 1
        return counts

    def result(self) -> dict:
        phases = {k: statistics.median(p[k] for p in self.phases) for k in self.phases[0]}
        return {
            "case": self.name,
            **self.layout,
            "step_seconds_median": statistics.median(self.steps),
            "step_seconds": self.steps,
            "step_cpu_seconds_median": statistics.median(self.cpu),
            "step_cpu_seconds": self.cpu,
            "phase_seconds_per_step": phases,
            "peak_state": self.peak,
            "optimizer": self.optimizer,
        }


def run_worker(cfg: dict) -> int:
    torch.set_num_threads(1)
    with process_group(cfg, "gloo") as env:
        cases = {name: Case(cfg, name, env, cfg["staged"]) for name in cfg["cases"]}
        for name, repeat in schedule(list(cases), 1, cfg["repeats"]):
            dist.barrier()
            cases[name].epoch(timed=repeat is not None)
        rows = [case.result() for case in cases.values()]
        if cfg["profile"]:  # untimed: the profiler slows what it records
            for row, case in zip(rows, cases.values(), strict=True):
                dist.barrier()
                steps = case.collectives_per_step()
                row["collectives_per_step"] = steps[0] if steps else None
                row["collectives_same_every_step"] = all(c == steps[0] for c in steps)
        ranks = [None] * WORLD if env.rank == 0 else None
        dist.gather_object(rows, ranks, dst=0)
        workers.answer(cfg, ranks)
        dist.barrier()
        # the figures are written: leave without tearing gloo down (bench/memory.py: its
        # teardown after FSDP sometimes aborted a rank whose work was complete)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# --- driver ---------------------------------------------------------------------------------


def stage(args: argparse.Namespace, size: str, tmp: Path) -> tuple[dict, str, dict]:
    """A corpus whose staged train split holds exactly steps x global batch blocks."""
    block = SIZES[size][3]
    length = corpus_length(args.steps * args.global_batch, block)
    corpus = write_corpus(tmp / f"corpus-{size}.txt", length)
    fractions = {"val_fraction": VAL_FRACTION, "test_fraction": TEST_FRACTION}
    data = {"source": "text", "path": str(corpus), "block_size": block, **fractions}
    cfg = {"data": data, "size": size, "global_batch": args.global_batch, "repeats": 1}
    run = run_config(cfg, BASELINE)
    staged = tmp / f"staged-{size}"
    manifest = stage_dataset(run["data"], staged, seed=0)
    return data, str(staged), manifest


def parameter_counts(size: str, vocab: int) -> dict:
    """The gpt's parameters (the tied weight once) and those tensor_parallel splits."""
    from ddpflow.training.gpt import gpt

    n_layer, n_embd, n_head, block = SIZES[size]
    model = gpt(vocab, block, {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head})
    named = dict(model.named_parameters())
    split = sum(p.numel() for n, p in named.items() if n.endswith(SPLIT))
    return {"parameters": sum(p.numel() for p in named.values()), "split_parameters": split}


def theory_bytes(case: str, counts: dict, element: int = 4) -> float:
    """AdamW in fp32: 4 tensors per parameter (itself, its gradient, two moments)."""
    strategy, tensor = CASES[case]
    whole, split = counts["parameters"] - counts["split_parameters"], counts["split_parameters"]
    per_rank = whole + split / tensor if strategy == "ddp" else (whole + split) / WORLD
    return 4 * element * per_rank


def summarize(size: str, ranks: list[list[dict]], counts: dict) -> dict:
    """Per configuration: the slowest rank's median step, the largest rank's state."""
    rows = []
    for per_rank in zip(*ranks, strict=True):
        first = per_rank[0]
        state = max((r["peak_state"] for r in per_rank), key=lambda s: s["total_bytes"])
        theory = theory_bytes(first["case"], counts)
        rows.append(
            {
                **{k: first[k] for k in ("case", "data_ranks", "tensor_ranks", "micro_batch")},
                "strategy": CASES[first["case"]][0],
                "step_seconds": max(r["step_seconds_median"] for r in per_rank),
                # CPU seconds of both ranks per step: robust to other work on the cores
                "step_cpu_seconds": sum(r["step_cpu_seconds_median"] for r in per_rank),
                "state": state,
                "theory_bytes": theory,
                "measured_over_theory": state["total_bytes"] / theory,
                "collectives_per_step": first.get("collectives_per_step"),
                "collectives_same_every_step": first.get("collectives_same_every_step"),
                "optimizer": first["optimizer"],
                "ranks": list(per_rank),
            }
        )
    base = next(r for r in rows if r["case"] == BASELINE)
    for row in rows:
        row["step_vs_baseline"] = row["step_seconds"] / base["step_seconds"]
        row["cpu_vs_baseline"] = row["step_cpu_seconds"] / base["step_cpu_seconds"]
        row["state_vs_baseline"] = row["state"]["total_bytes"] / base["state"]["total_bytes"]
    n_layer, n_embd, n_head, block = SIZES[size]
    gpt = {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "block_size": block}
    return {"size": size, "gpt": gpt, **counts, "rows": rows}


def cells(run: dict, r: dict) -> list[str]:
    g, s = run["gpt"], r["state"]
    comms = r["collectives_per_step"]
    return [
        f"{g['n_layer']}x{g['n_embd']} ({g['n_head']} heads), T {g['block_size']}",
        f"{r['strategy']} tp {r['tensor_ranks']}",
        f"{r['data_ranks']} x {r['tensor_ranks']}",
        f"{r['step_seconds'] * 1e3:.1f}",
        f"{r['step_vs_baseline']:.2f}x",
        f"{r['step_cpu_seconds'] * 1e3:.1f}",
        f"{r['cpu_vs_baseline']:.2f}x",
        f"{s['params_bytes'] / MB:.2f}",
        f"{s['grads_bytes'] / MB:.2f}",
        f"{s['optimizer_bytes'] / MB:.2f}",
        f"{s['total_bytes'] / MB:.2f}",
        f"{r['state_vs_baseline']:.2f}x",
        f"{r['measured_over_theory']:.3f}",
        "-" if comms is None else ", ".join(f"{SHORT.get(k, k)} {n}" for k, n in comms.items()),
    ]


SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS"}
HEADER = [
    *("gpt", "config", "data x tensor", "step ms", "vs ddp", "CPU ms/step", "vs ddp"),
    *("params MB", "grads MB", "optimizer MB", "state MB", "vs ddp", "/ theory"),
    "collectives/step",
]


def format_table(report: dict) -> str:
    c = report["conditions"]
    head = (
        f"# gpt at {WORLD} gloo ranks, global batch {c['global_batch']} blocks, AdamW fp32; "
        f"step: median of {c['repeats']} epochs x {c['steps'] - 1} steps, slowest rank; "
        "state: params + grads + optimizer, largest rank; MB = 10^6 bytes"
    )
    rows = [cells(run, r) for run in report["runs"] for r in run["rows"]]
    return head + "\n" + harness.markdown_table(HEADER, rows, rule="--:")


COUNTING = (
    "one profiled epoch per configuration after the timing: torch.profiler's c10d:: events "
    "(every ProcessGroup call: DDP's bucket all-reduces, DTensor's and FSDP's collectives) "
    "between two consecutive optimizer steps, rank 0, by kind (AR all-reduce, AG all-gather, "
    "RS reduce-scatter); fsdp's all-reduce is the loop's non-finite flag "
    "(training/divergence.py: its MAX all-reduce where no rank holds the output layer's "
    "whole gradient)"
)


def conditions(args: argparse.Namespace) -> dict:
    return {
        "world_size": WORLD,
        "threads_per_rank": 1,
        "global_batch": args.global_batch,
        "steps": args.steps,
        "repeats": args.repeats,
        "warmup_epochs": 1,
        "cases": {
            name: f"train.strategy {CASES[name][0]}, train.tensor_parallel {CASES[name][1]}"
            for name in args.cases
        },
        "timing": "one epoch of --steps optimizer steps per configuration at a time, the "
        "configurations alternating (order flipped every repeat) after a warm-up epoch each; "
        "a step: the wall time between consecutive optimizer steps within an epoch; the "
        "median over the timed epochs per rank, the slowest rank's; CPU ms/step: each "
        "rank's median process CPU time per step (its gloo threads included), summed over "
        "the ranks (robust to other work sharing the cores)",
        "state": "numel x element size of each parameter, gradient and optimizer state tensor "
        "a rank holds (DTensor: its local shard), right after each optimizer step of the "
        "warm-up epoch (an optimizer step post-hook), the largest step; the largest rank; "
        "theory: AdamW holds 4 fp32 tensors per parameter: ddp 4P, tensor_parallel 2 "
        "4(W + S/2) (S: the blocks' split projections, W: the rest), fsdp 4P/2",
        "collectives": "not counted (--no-profile)" if args.no_profile else COUNTING,
        "optimizer": f"AdamW {OPTIMIZER}; the kernel as build.make_optimizer picks it: fused "
        "(ddp), foreach (fsdp and tensor_parallel: every parameter a DTensor)",
        "data": f"the standard library's {CORPUS_PACKAGE} package's .py sources, staged as "
        "bytes (vocabulary 257), train exactly steps x global batch blocks",
        "launch": "one process per rank, gloo on 127.0.0.1; every configuration of a gpt size "
        "in the same two processes",
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return run_worker(args.worker)
    start = time.perf_counter()
    report = harness.head(
        "tensor_parallel",
        description="gpt step time and per-rank training state: ddp vs tensor_parallel 2 "
        "(and fsdp) at 2 CPU ranks",
        conditions=conditions(args),
        runs=[],
    )
    with tempfile.TemporaryDirectory(prefix="ddpflow-bench-tp-") as tmp:
        for size in args.sizes:
            data, staged, manifest = stage(args, size, Path(tmp))
            keys = ("global_batch", "steps", "repeats", "cases")
            cfg = {"data": data, "staged": staged, "size": size, "world_size": WORLD}
            cfg.update({k: getattr(args, k) for k in keys}, profile=not args.no_profile)
            print(f"measuring gpt {size}: {', '.join(args.cases)} ...", flush=True)
            ranks = workers.launch(__file__, cfg)
            counts = parameter_counts(size, manifest["vocab_size"])
            report["runs"].append(summarize(size, ranks, counts))
    report["conditions"]["loadavg_after"] = harness.loadavg()
    print(format_table(report), flush=True)
    return harness.write(report, args.out, wall_since=start)


if __name__ == "__main__":
    sys.exit(main())
