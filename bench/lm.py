"""Language-model training: ddpflow's step (task: language_model) against a nanoGPT-style
loop, in tokens per second, fp32 and bf16, at 1 and 2 ranks.

Both loops train the same model (ddpflow's GPT, ddpflow.training.gpt, with the same initial
weights: checked), on the same data (one text file the benchmark writes from the Python
sources of the standard library's email package, staged by ddpflow: both read the staged
train split's token array by memory map), with the same per-rank batch of B blocks of T
tokens, the same AdamW hyper-parameters (lr, betas, weight decay on every parameter, no
gradient clipping) and the same per-step lr (warmup + cosine):

* ``ddpflow``: ``ddpflow.training.loop.Loop`` built as ``tasks.TrainTask`` builds it
  (``load_data``: the token blocks by memory map and their TokenFeed; ``placed_model``;
  ``Loop``: the LanguageModel task's loss, fused AdamW, ``train.precision``, DDP when world
  > 1; the checkpointer's per-step hook), one ``train_epoch()`` per repeat;
* ``nanogpt``: bench/nanogpt_loop.py, nanoGPT's train.py loop written out: random offsets
  into the token array, ``model(x)`` -> ``F.cross_entropy``, ``backward``, ``step``,
  ``zero_grad``, DDP when world > 1, the lr set by hand every iteration, ``loss.item()`` every
  10 steps; AdamW's default (non-fused) implementation on CPU as nanoGPT has it
  (``--peer-fused-adamw`` gives it the fused kernel ddpflow uses).

One repeat is `--steps` optimizer steps (ddpflow: one epoch; the staged train split holds
exactly that many global batches of blocks); its time is the slowest rank's after a barrier.
The loops alternate repeat by repeat (order flipped every repeat) after `--warmup` untimed
repeats each; each figure is the median over `--repeats`. Ranks are separate processes
(``python bench/lm.py --worker ...``) with a gloo process group on 127.0.0.1 and 1 torch
thread each. FLOPs = 6 x N x tokens, N = the parameters less the position embedding
(nanoGPT's non-embedding count; the token embedding counts once, as the tied output layer);
the attention's 12 x layers x width x T per token is recorded but not added. MFU = achieved
FLOP/s / `--peak-tflops` (a CPU has no datasheet peak: without it only GFLOP/s is given).

    bench/lm.py                  GPT 4x128 (4 heads), T 128, 16 blocks/rank, 10 steps a repeat,
                                 fp32 and bf16 at 1 and 2 ranks (about 2 minutes on 2 cores)
    bench/lm.py --quick          a 2x64 GPT, T 32, 4 blocks/rank, 2 steps, 1 repeat (seconds)
    bench/lm.py --gpu --peak-tflops 989    on one GPU (bf16 peak of an H100 SXM), world 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness
import torch
import workers
from ddpflow import config as ddpconfig
from ddpflow.config.typed import RunSpec
from ddpflow.data.staging import stage_dataset
from ddpflow.data.text import open_tokens
from ddpflow.data.windows import split_tokens, train_blocks
from ddpflow.training.build import cpu_has_native_bf16, placed_model
from ddpflow.training.checkpoint import Checkpointer
from ddpflow.training.gpt import gpt
from ddpflow.training.loop import Loop
from ddpflow.training.rankdata import load_data
from ddpflow.training.schedule import lr_schedule
from loops import process_group, rank_device, schedule, timed_epoch
from nanogpt_loop import NanoGPTLoop, Recipe

LOOPS = ("nanogpt", "ddpflow")
OPTIMIZER = {"name": "adamw", "betas": [0.9, 0.95], "weight_decay": 0.1}  # nanoGPT's
VAL_FRACTION = TEST_FRACTION = 0.25  # of the corpus (a block or more); train: the repeat
CORPUS_PACKAGE = "email"  # the stdlib package whose .py sources are the text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, "lm.json", worker=True)
    p.add_argument("--world-sizes", type=int, nargs="+", default=None, help="CPU 1 2, GPU 1")
    p.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    p.add_argument("--batch", type=int, default=16, help="blocks per rank and step")
    p.add_argument("--block", type=int, default=128, help="tokens per block (data.block_size)")
    p.add_argument("--layers", type=int, default=4, help="GPT n_layer")
    p.add_argument("--heads", type=int, default=4, help="GPT n_head")
    p.add_argument("--embd", type=int, default=128, help="GPT n_embd")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per repeat")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per loop")
    p.add_argument("--warmup", type=int, default=1, help="untimed repeats per loop")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--lr", type=float, default=6e-4, help="AdamW lr (no batch scaling)")
    p.add_argument("--gpu", action="store_true", help="on CUDA (nccl), world size 1 default")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak for MFU (datasheet)")
    fused = "the nanoGPT loop with fused AdamW on CPU too (isolates the loop from the kernel)"
    p.add_argument("--peer-fused-adamw", action="store_true", help=fused)
    p.add_argument("--quick", action="store_true", help="a tiny GPT, 2 steps, 1 repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.embd, args.block, args.batch = 2, 64, 32, 4
        args.steps, args.repeats, args.warmup = 2, 1, 1
    args.world_sizes = args.world_sizes or ([1] if args.gpu else [1, 2])
    return args


# --- the data: one text file, staged by ddpflow ---------------------------------------------


def corpus_text() -> bytes:
    """The .py sources of the standard library's CORPUS_PACKAGE, in sorted order."""
    import importlib

    root = Path(importlib.import_module(CORPUS_PACKAGE).__file__).parent
    return b"\n".join(p.read_bytes() for p in sorted(root.rglob("*.py")))


def corpus_length(train_blocks_wanted: int, block: int) -> int:
    """The file length whose staged train split holds exactly train_blocks_wanted blocks
    (ddpflow.data.text: val and test are rounded fractions of the whole, train the rest)."""
    length = int((train_blocks_wanted * block + 1) / (1 - VAL_FRACTION - TEST_FRACTION))
    while True:
        train = length - round(length * VAL_FRACTION) - round(length * TEST_FRACTION)
        blocks = train_blocks(train, block)
        if blocks == train_blocks_wanted:
            return length
        length += 1 if blocks < train_blocks_wanted else -1


def write_corpus(path: Path, length: int) -> Path:
    text = corpus_text()
    path.write_bytes((text * (length // len(text) + 1))[:length])
    return path


def ddpflow_run(cfg: dict, precision: str) -> dict:
    """The schema's defaults with this benchmark's data, model, batch, optimizer, machine."""
    cuda = cfg["device"] == "cuda"
    overrides = {
        "task": "language_model",
        "data": cfg["data"],
        "model": {"name": "gpt", "kwargs": cfg["gpt"]},
        "train": {
            "global_batch_size": cfg["batch"] * cfg["world_size"],
            "micro_batch_size": cfg["batch"],
            "epochs": cfg["warmup"] + cfg["repeats"],
            "progress": False,
            "precision": precision,
            "optimizer": {**OPTIMIZER, "lr": cfg["lr"]},
            "lr_scaling": "none",
            "schedule": "cosine",
            "warmup_epochs": 1,
        },
        "machine": {
            "gpus_per_node": 1 if cuda else 0,
            "cpu_ranks_per_node": 1 if cuda else cfg["world_size"],
            "cpus_per_task": cfg["threads"],
        },
    }
    return ddpconfig.resolve_runs(ddpconfig.load(None, overrides))[0]


# --- worker process: the two loops ----------------------------------------------------------


def build_loops(cfg: dict, precision: str, env, device):
    """(ddpflow's Loop, the nanoGPT loop), the same model and initial weights, and whether
    those weights are equal (checked before either trains)."""
    run = ddpflow_run(cfg, precision)
    spec = RunSpec.from_run(run)
    data = load_data(spec, cfg["staged"], env, device, splits=("train", "val"))
    model, loaded = placed_model(spec, data.shape, data.num_classes, device)
    loop = Loop(spec, data, env, device, model, loaded)
    loop.watch_steps(Checkpointer(spec, cfg["work"], env).on_step)
    assert loop.steps_per_epoch == cfg["steps"], (loop.steps_per_epoch, cfg["steps"])

    torch.manual_seed(run["train"]["seed"])
    peer_model = gpt(data.num_classes, cfg["block"], cfg["gpt"])
    same = all(
        torch.equal(a, b.to(a.device))
        for a, b in zip(model.state_dict().values(), peer_model.state_dict().values(), strict=True)
    )
    tcfg = spec.train
    total = loop.steps_per_epoch * tcfg.epochs
    factor = lr_schedule(tcfg.schedule, round(tcfg.warmup_epochs * loop.steps_per_epoch), total)
    tokens = open_tokens(cfg["staged"], "train", data.manifest, verify=False)
    recipe = Recipe(
        **{k: cfg[k] for k in ("block", "batch", "steps")},
        lr=loop.lr,
        lr_factor=factor,
        betas=OPTIMIZER["betas"],
        weight_decay=OPTIMIZER["weight_decay"],
        precision=precision,
        fused=True if cfg["peer_fused_adamw"] else None,
    )
    peer = NanoGPTLoop(peer_model, tokens, recipe, device, env.world_size, env.rank, env.is_master)
    return loop, peer, same


def data_ms_per_batch(loop: Loop, peer: NanoGPTLoop, batch: int, calls: int = 20) -> dict:
    """Each loop's batch alone, ms (median of 5 runs of `calls`): ddpflow's TokenFeed
    gather + split_tokens (what its data phase does besides seeding), nanoGPT's get_batch."""
    gen = torch.Generator().manual_seed(0)
    n = len(loop.feed.blocks)
    indices = [torch.randint(n, (batch,), generator=gen) for _ in range(calls)]

    def ddpflow():
        for raw in loop.feed.epoch(indices, 0):
            split_tokens(raw)

    def nanogpt():
        for _ in range(calls):
            peer.get_batch()

    out = {}
    for name, fn in (("ddpflow", ddpflow), ("nanogpt", nanogpt)):
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - start) * 1e3 / calls)
        out[name] = statistics.median(runs)
    return out


def measure(cfg: dict, precision: str, env, device, sync) -> dict:
    loop, peer, same = build_loops(cfg, precision, env, device)
    block = cfg["block"]

    def ddpflow_epoch():
        record = loop.train_epoch()
        return {**record, "samples": record["samples"] * block}  # blocks -> tokens

    epochs = {"nanogpt": peer.epoch, "ddpflow": ddpflow_epoch}
    rates = {name: ([], [], []) for name in LOOPS}
    phases = []
    for name, repeat in schedule(list(LOOPS), cfg["warmup"], cfg["repeats"]):
        rate, cpu_rate, record = timed_epoch(epochs[name], device, sync)
        if repeat is None:
            continue
        rates[name][0].append(rate)
        rates[name][1].append(cpu_rate)
        if name == "ddpflow":
            rates[name][2].append(record["train_loss"])
            phases.append({k: v / record["micro_steps"] for k, v in record["seconds"].items()})
        else:
            rates[name][2].append(record["last_loss"])
    out = {
        name: {
            "tokens_per_s": statistics.median(wall),
            "all": wall,
            "tokens_per_cpu_s": statistics.median(cpu),
            "all_per_cpu_s": cpu,
            # ddpflow: the last repeat's mean loss; nanogpt: its last step's
            "train_loss_last_repeat": losses[-1],
        }
        for name, (wall, cpu, losses) in rates.items()
    }
    out["ddpflow"]["phase_seconds_per_step"] = {
        k: statistics.median(p[k] for p in phases) for k in phases[0]
    }
    out["ddpflow"]["optimizer"] = type(loop.optimizer).__name__ + (
        " (fused)" if loop.optimizer.defaults.get("fused") else ""
    )
    out["nanogpt"]["optimizer"] = type(peer.optimizer).__name__ + (
        " (fused)" if peer.optimizer.defaults.get("fused") else ""
    )
    out["same_initial_weights"] = same
    if env.is_master:
        out["data_ms_per_batch"] = data_ms_per_batch(loop, peer, cfg["batch"])
    return out


def run_worker(cfg: dict) -> int:
    device, backend, sync = rank_device(cfg)
    results = {}
    with process_group(cfg, backend) as env:
        for precision in cfg["precisions"]:
            results[precision] = measure(cfg, precision, env, device, sync)
    return workers.answer(cfg, results)


# --- driver ---------------------------------------------------------------------------------


def model_flops(args: argparse.Namespace, vocab: int) -> dict:
    """Parameter counts and training FLOPs per token (6 x N; N without the position
    embedding), and the attention's FLOPs per token that 6 x N leaves out."""
    model = gpt(vocab, args.block, gpt_kwargs(args))
    parameters = sum(p.numel() for p in model.parameters())  # the tied weight once
    counted = parameters - model.wpe.weight.numel()
    return {
        "name": "gpt",
        "kwargs": gpt_kwargs(args),
        "vocab_size": vocab,
        "block_size": args.block,
        "parameters": parameters,
        "position_embedding_parameters": model.wpe.weight.numel(),
        "flops_parameters": counted,
        "flops_per_token": 6 * counted,
        "attention_flops_per_token": 12 * args.layers * args.embd * args.block,
    }


def gpt_kwargs(args: argparse.Namespace) -> dict:
    return {"n_layer": args.layers, "n_head": args.heads, "n_embd": args.embd}


def stage(args: argparse.Namespace, world: int, tmp: Path) -> tuple[dict, str, dict]:
    """The corpus for this world size (train: steps x global batch blocks), staged."""
    blocks = args.steps * args.batch * world
    corpus = write_corpus(tmp / f"corpus-{world}.txt", corpus_length(blocks, args.block))
    fractions = {"val_fraction": VAL_FRACTION, "test_fraction": TEST_FRACTION}
    data = {"source": "text", "path": str(corpus), "block_size": args.block, **fractions}
    run = ddpflow_run({"data": data, "world_size": world, **launch_args(args)}, "fp32")
    staged = tmp / f"staged-{world}"
    manifest = stage_dataset(run["data"], staged, seed=0)
    return data, str(staged), manifest


def finish_row(cfg: dict, precision: str, result: dict, flops: dict, peak: float | None):
    per_token = flops["flops_per_token"]
    for name in LOOPS:
        r = result[name]
        r["gflops"] = r["tokens_per_s"] * per_token / 1e9
        r["mfu"] = r["tokens_per_s"] * per_token / peak if peak else None
        # CPU seconds of all ranks per wall second and rank: ~1 when each rank had a core
        r["cpu_busy_per_rank"] = r["tokens_per_s"] / r["tokens_per_cpu_s"] / cfg["world_size"]
    return {
        "precision": precision,
        "device": cfg["device"],
        "world_size": cfg["world_size"],
        "threads": cfg["threads"],
        "batch": cfg["batch"],
        "block_size": cfg["block"],
        "steps_per_repeat": cfg["steps"],
        "tokens_per_repeat": cfg["steps"] * cfg["batch"] * cfg["block"] * cfg["world_size"],
        **result,
        "speedup": result["ddpflow"]["tokens_per_s"] / result["nanogpt"]["tokens_per_s"],
        "cpu_time_speedup": result["ddpflow"]["tokens_per_cpu_s"]
        / result["nanogpt"]["tokens_per_cpu_s"],
        "loadavg_after": harness.loadavg(),
    }


def format_table(report: dict) -> str:
    c, m = report["conditions"], report["model"]
    k = m["kwargs"]
    lines = [
        f"# language-model training step, {report['runs'][0]['device']}: GPT {k['n_layer']} "
        f"layers x {k['n_embd']} ({k['n_head']} heads), {m['parameters']:,} parameters, "
        f"T {m['block_size']}, batch {c['batch']}/rank, AdamW; median of {c['repeats']} "
        f"repeats of {c['steps_per_repeat']} steps after {c['warmup_repeats']}; slowest rank",
        f"{'precision':<9} {'world':>5} | {'nanoGPT tok/s':>13} {'ddpflow tok/s':>13} "
        f"{'ratio':>6} | {'by CPU s':>8} | {'GFLOP/s nano / ddpflow':>22} | {'MFU':>13}",
    ]
    for r in report["runs"]:
        n, d = r["nanogpt"], r["ddpflow"]
        mfu = f"{n['mfu']:.1%}/{d['mfu']:.1%}" if d["mfu"] is not None else "- (no peak)"
        lines.append(
            f"{r['precision']:<9} {r['world_size']:>5} | {n['tokens_per_s']:13.0f} "
            f"{d['tokens_per_s']:13.0f} {r['speedup']:5.2f}x | {r['cpu_time_speedup']:7.2f}x | "
            f"{n['gflops']:10.1f} / {d['gflops']:9.1f} | {mfu:>13}"
        )
    lines.append(
        "(tokens/s: all ranks, wall time; ratio: ddpflow / nanoGPT-style loop (goal >= 1.0x); "
        "'by CPU s': the same in tokens per CPU-second of all ranks, robust to other load; "
        f"GFLOP/s: 6 x {m['flops_parameters']:,} parameters x tokens/s; MFU needs "
        "--peak-tflops)"
    )
    for r in report["runs"]:
        data = r.get("data_ms_per_batch")
        if data:
            phases = r["ddpflow"]["phase_seconds_per_step"].items()
            lines.append(
                f"# {r['precision']} x{r['world_size']}: a batch alone, ms: ddpflow "
                f"{data['ddpflow']:.3f}, nanoGPT {data['nanogpt']:.3f}; ddpflow's step, ms: "
                + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in phases)
            )
    return "\n".join(lines)


def conditions(args: argparse.Namespace, load_before) -> dict:
    return {
        "threads": args.threads,
        "batch": args.batch,
        "block_size": args.block,
        "world_sizes": args.world_sizes,
        "precisions": args.precisions,
        "repeats": args.repeats,
        "warmup_repeats": args.warmup,
        "steps_per_repeat": args.steps,
        "timing": "one repeat = --steps optimizer steps (ddpflow: one Loop.train_epoch()); "
        "barrier before, the slowest rank's wall time; median of repeats; the loops "
        "alternate repeat by repeat, order flipped every repeat, after the warmup repeats",
        "ddpflow": "Loop as tasks.TrainTask builds it: load_data (TokenBlocks by memory map, "
        "TokenFeed), build.placed_model, Loop (LanguageModel's mean cross-entropy, "
        "train.precision, DDP at world > 1, the checkpointer's per-step hook); "
        "micro_batch_size = batch, global_batch_size = batch x world (no accumulation)",
        "nanogpt": "bench/nanogpt_loop.py: nanoGPT's train.py loop: B random offsets into "
        "the same staged train token array (memory map opened once), model(x) -> "
        "F.cross_entropy, the next batch drawn, backward, step, zero_grad(set_to_none); "
        "lr set by hand each step; loss.item() every 10 steps on rank 0; DDP at world > 1 "
        "(its defaults); no gradient clipping (ddpflow has none)",
        "optimizer": f"AdamW lr {args.lr} (the effective lr, no batch scaling), betas "
        f"{OPTIMIZER['betas']}, weight decay {OPTIMIZER['weight_decay']} on every parameter "
        "(nanoGPT decays 2-D weights only: not reproduced, so the arithmetic is the same); "
        "warmup 1 repeat, then cosine over all repeats, per step; ddpflow fused AdamW; the "
        "nanoGPT loop "
        + (
            "fused AdamW too (--peer-fused-adamw)"
            if args.peer_fused_adamw
            else "fused on CUDA only, the default implementation elsewhere (as nanoGPT)"
        ),
        "precision": "fp32; bf16 = train.precision: bf16 (torch.autocast bfloat16) for ddpflow, "
        "the same autocast around forward and loss for the nanoGPT loop",
        "bf16_native": cpu_has_native_bf16() if not args.gpu else None,
        "data": f"one text file of the standard library's {CORPUS_PACKAGE} package's .py "
        "sources (written by the benchmark, nothing downloaded), staged by ddpflow as bytes "
        f"(vocabulary 257), val and test {VAL_FRACTION} each; train holds exactly "
        "steps x batch x world blocks of T + 1 tokens",
        "flops": "6 x N x tokens, N = all parameters (the tied embedding/output weight once) "
        "less the position embedding; the attention's 12 x n_layer x n_embd x T per token "
        "(model.attention_flops_per_token) not included",
        "mfu": "achieved FLOP/s / --peak-tflops; without a peak (a CPU) only GFLOP/s",
        "peak_tflops": args.peak_tflops,
        "launch": "one process per rank, gloo (nccl on CUDA) on 127.0.0.1",
        "load": {"loadavg_before": load_before},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return run_worker(args.worker)
    if args.gpu and not torch.cuda.is_available():
        print("--gpu: no CUDA device visible", file=sys.stderr)
        return 2
    start = time.perf_counter()
    load_before = harness.loadavg()
    peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    report = harness.head(
        "language-model training step: ddpflow (task: language_model) vs a nanoGPT-style loop",
        conditions=conditions(args, load_before),
        runs=[],
    )
    with tempfile.TemporaryDirectory(prefix="ddpflow-bench-lm-") as tmp:
        for world in args.world_sizes:
            data, staged, manifest = stage(args, world, Path(tmp))
            report.setdefault("model", model_flops(args, manifest["vocab_size"]))
            cfg = {"data": data, "staged": staged, "world_size": world, **launch_args(args)}
            print(f"measuring world size {world} ({', '.join(args.precisions)}) ...", flush=True)
            results = workers.launch(__file__, cfg)
            for precision in args.precisions:
                row = finish_row(cfg, precision, results[precision], report["model"], peak)
                report["runs"].append(row)
    load_after = harness.loadavg()
    report["conditions"]["load"] = load_note(load_before, load_after, report["runs"])
    report["wall_s"] = time.perf_counter() - start
    print(format_table(report), flush=True)
    return harness.write(report, args.out)


def launch_args(args: argparse.Namespace) -> dict:
    """What every rank of every world size gets from the command line."""
    keys = ("block", "batch", "steps", "threads", "warmup", "repeats", "lr", "precisions")
    return {
        **{k: getattr(args, k) for k in keys},
        "gpt": gpt_kwargs(args),
        "device": "cuda" if args.gpu else "cpu",
        "peer_fused_adamw": args.peer_fused_adamw,
    }


def load_note(before, after, runs: list[dict]) -> dict:
    """The 1/5/15-minute load averages before and after, and the direct sign of other work
    during the timed repeats: the ranks' CPU-seconds per wall second and rank."""
    busy = min(r[name]["cpu_busy_per_rank"] for r in runs for name in LOOPS)
    note = {"loadavg_before": before, "loadavg_after": after, "min_cpu_busy_per_rank": busy}
    shared = busy < 0.9
    note["note"] = (
        f"the ranks' CPU-busy fraction was at least {busy:.2f} in every timed loop: "
        + (
            "other work shared the cores during the measurement (the 'by CPU s' ratios are the "
            "ones to read)"
            if shared
            else "every rank had a core to itself (no other load to speak of)"
        )
        + (
            f"; 1-minute load average {before[0]:.2f} before (it decays over minutes: it "
            f"still counts work that ended before the start) and {after[0]:.2f} after (it "
            "counts the benchmark's own ranks)"
            if before and after
            else ""
        )
    )
    return note


if __name__ == "__main__":
    sys.exit(main())
