"""Decoding with and without the GPT's KV cache (ddpflow.training.kvcache): new tokens per
second of ddpflow.training.gpt.generate, as `snakemake generate` calls it on a rank.

Each case builds ddpflow's GPT (random weights, seed 0, fp32, eval mode) and continues one
prompt of --prompt random token ids by --new tokens, greedily (temperature 0: no draw, so
both ways must give the same tokens: checked and recorded), a batch of one as the generate
ranks run it. ``cache`` keeps the keys and values of the tokens read (each step reads one
new position while the context fits in block_size); ``recompute`` reads the whole context
(its last block_size tokens) at every step. The two alternate repeat by repeat (order flipped
every repeat) after --warmup untimed repeats each; each figure is the median over --repeats.
One process, --threads torch threads (1: a CPU rank's default). Tokens/s is by wall time;
tokens per CPU-second (the process's CPU time) is less sensitive to other load.

Cases: the default gpt (4 x 128, 4 heads) at block_size 128 and a wider one (4 x 256, 8
heads) at block_size 256, prompt + new tokens filling the block; and the default gpt at
block_size 64 generating past it, where the context slides and every step after the block
is full reads it anew (the cache helps only until then).

    python bench/generate.py             # ~1 minute on 1 core
    python bench/generate.py --quick     # a tiny GPT, a few tokens, 1 repeat (seconds)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import harness
import torch
from ddpflow.training.gpt import GPT, generate
from loops import schedule

VOCAB = 257  # data.source text: the bytes and the end-of-document token
# (name, n_layer, n_head, n_embd, block_size, new tokens): prompt + new fill the block, or not
CASES = [
    ("gpt 4x128, T 128", 4, 4, 128, 128, 112),
    ("gpt 4x256, T 256", 4, 8, 256, 256, 240),
    ("gpt 4x128, T 64, past the block", 4, 4, 128, 64, 112),
]
QUICK = [("gpt 2x64, T 32", 2, 4, 64, 32, 24)]
WAYS = ("cache", "recompute")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, "generate.json")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per way")
    p.add_argument("--warmup", type=int, default=1, help="untimed repeats per way")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--quick", action="store_true", help="a tiny GPT, 1 repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.prompt, args.repeats, args.warmup = 8, 1, 1
    return args


def measure(case: tuple, args: argparse.Namespace) -> dict:
    name, layers, heads, width, block, new = case
    torch.manual_seed(0)
    model = GPT(VOCAB, block, n_layer=layers, n_head=heads, n_embd=width).eval()
    prompt = torch.randint(0, VOCAB, (args.prompt,)).tolist()
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    cpu: dict[str, list[float]] = {way: [] for way in WAYS}
    tokens: dict[str, list[int]] = {}
    for way, repeat in schedule(list(WAYS), args.warmup, args.repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        out = generate(model, prompt, new, block, 0, temperature=0.0, cache=way == "cache")
        took, took_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        tokens[way] = out
        if repeat is not None:
            seconds[way].append(took)
            cpu[way].append(took_cpu)
    median = {way: statistics.median(seconds[way]) for way in WAYS}
    rate = {way: new / median[way] for way in WAYS}
    by_cpu = {way: new / statistics.median(cpu[way]) for way in WAYS}
    return {
        "case": name,
        "n_layer": layers,
        "n_head": heads,
        "n_embd": width,
        "block_size": block,
        "prompt_tokens": args.prompt,
        "new_tokens": new,
        "cached_steps": max(0, min(new, block - args.prompt + 1)),
        "parameters": sum(p.numel() for p in model.parameters()),
        **{
            key: {
                "tokens_per_s": rate[way],
                "tokens_per_cpu_s": by_cpu[way],
                "seconds": seconds[way],
                "cpu_seconds": cpu[way],
            }
            for key, way in (("with_cache", "cache"), ("recompute", "recompute"))
        },
        "speedup": rate["cache"] / rate["recompute"],
        "cpu_time_speedup": by_cpu["cache"] / by_cpu["recompute"],
        "same_tokens": tokens["cache"] == tokens["recompute"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    report = harness.head(
        "decoding tokens/s with and without the GPT's KV cache",
        conditions={
            "device": "cpu",
            "threads": args.threads,
            "precision": "fp32",
            "batch": 1,
            "prompt_tokens": args.prompt,
            "decoding": "greedy (temperature 0): both ways must give the same tokens",
            "weights": "random (seed 0): speed does not depend on what the model learned",
            "repeats": args.repeats,
            "warmup": args.warmup,
            "schedule": "cache and recompute alternate, order flipped every repeat; median",
        },
    )
    report["runs"] = [measure(case, args) for case in (QUICK if args.quick else CASES)]
    report["conditions"]["loadavg_after"] = harness.loadavg()
    header = ["case", "new tokens", "cache tokens/s", "recompute tokens/s", "speedup"]
    header += ["by CPU s", "same"]
    rows = [
        [
            r["case"],
            r["new_tokens"],
            f"{r['with_cache']['tokens_per_s']:.0f}",
            f"{r['recompute']['tokens_per_s']:.0f}",
            f"{r['speedup']:.2f}x",
            f"{r['cpu_time_speedup']:.2f}x",
            "yes" if r["same_tokens"] else "NO",
        ]
        for r in report["runs"]
    ]
    print(harness.markdown_table(header, rows, rule="--:"), flush=True)
    return harness.write(report, args.out, wall_since=start)


if __name__ == "__main__":
    sys.exit(main())
