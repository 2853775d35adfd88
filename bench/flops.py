"""What counting a run's FLOPs costs the login node, against the memory measurement it rides
on, and how the count compares with the gpt's formula.

Per model, in this one process on fake tensors (torch's FakeTensorMode, as
ddpflow.checks.early's subprocess measures): ddpflow.training.footprint.measure (the memory
measurement, the FLOP count included) and footprint.count_flops alone (one forward and
backward of one micro-batch under FlopCounterMode), each timed --repeats times after one
untimed call (the first call of a process pays torch's dispatch warm-up, which the early
subprocess pays once for all runs); the figure is the median and the count's share of the
measurement. Models: the shipped cnn (1x8x8), resnet18 and torchvision's resnet50 and
vit_b_16 (3x32x32, micro-batch 32), and gpt at 4x128 (T 64) and GPT-2 small's 12x768
(T 1024, vocabulary 50304, micro-batch 8). For the gpts, the count against 6N + 12LHQT
(monitoring.flops.gpt_formula_flops).

    python bench/flops.py             # ~1 minute on 2 cores
    python bench/flops.py --quick     # cnn and the small gpt, 2 repeats
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import harness
import torch
from ddpflow.monitoring.flops import gpt_formula_flops
from ddpflow.training import footprint
from ddpflow.training.models import build_model
from torch._subclasses.fake_tensor import FakeTensorMode

GPT_SMALL = {"n_layer": 4, "n_head": 4, "n_embd": 128}
GPT2 = {"n_layer": 12, "n_head": 12, "n_embd": 768}
CASES = {
    "cnn": ({"name": "cnn", "cnn_channels": 32}, [1, 8, 8], 10, 32),
    "resnet18": ({"name": "resnet18"}, [3, 32, 32], 10, 32),
    "resnet50": ({"name": "resnet50"}, [3, 32, 32], 10, 32),
    "vit_b_16": ({"name": "vit_b_16", "kwargs": {"image_size": 32}}, [3, 32, 32], 10, 32),
    "gpt 4x128": ({"name": "gpt", "kwargs": GPT_SMALL}, [64], 256, 32),
    "gpt 12x768": ({"name": "gpt", "kwargs": GPT2}, [1024], 50304, 8),
}
QUICK = ("cnn", "gpt 4x128")
OPTIMIZER = {"name": "adamw", "lr": 1e-3, "weight_decay": 0.0, "betas": [0.9, 0.999]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, "flops.json")
    p.add_argument("--repeats", type=int, default=None, help="timed calls of each (5; 2)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    return args


def _timed(call, repeats: int) -> tuple[float, object]:
    """The median seconds of `repeats` calls after an untimed one, and the last result."""
    result = call()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


def measure_case(name: str, repeats: int) -> dict:
    model_cfg, shape, outputs, micro = CASES[name]
    args = dict(shape=shape, outputs=outputs, micro_batch=micro, precision="fp32")
    measure_s, figures = _timed(
        lambda: footprint.measure(
            model_cfg,
            **args,
            device_type="cpu",
            checkpointing=False,
            optimizer=OPTIMIZER,
            eval_batch=micro,
        ),  # fmt: skip
        repeats,
    )
    with FakeTensorMode():
        with footprint._no_init():
            model = build_model(model_cfg, shape, outputs)
        inputs = footprint._inputs(micro, shape)
        count_s, counted = _timed(lambda: footprint.count_flops(model, inputs), repeats)
        parameters = sum(p.numel() for p in model.parameters())
    row = {
        "model": name,
        "shape": shape,
        "micro_batch": micro,
        "flops_per_micro_batch": counted,
        "count_s": count_s,
        "measure_s": measure_s,
        "count_share_of_measure": count_s / measure_s,
        "measured_flops_match": figures["model_flops"] == counted,
    }
    if model_cfg["name"] == "gpt":
        kw, block = model_cfg["kwargs"], shape[0]
        n = parameters - block * kw["n_embd"]  # less the position embedding
        formula = gpt_formula_flops(n, kw["n_layer"], kw["n_embd"], block) * block * micro
        row.update(formula_flops=formula, counted_over_formula=counted / formula)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.simplefilter("ignore")  # MemTracker's notes on hooks
    torch.set_num_threads(1)
    start = time.perf_counter()
    names = QUICK if args.quick else tuple(CASES)
    report = harness.head(
        "flops",
        description="the cost of counting a run's FLOPs on the login node",
        conditions={
            "where": "one process, fake tensors, 1 torch thread, fp32, no checkpointing",
            "timing": f"median of {args.repeats} calls after one untimed call",
            "baseline": "footprint.measure: the memory measurement (the count included)",
            "models": {n: {"shape": CASES[n][1], "micro_batch": CASES[n][3]} for n in names},
        },
    )
    report["runs"] = [measure_case(name, args.repeats) for name in names]
    report["conditions"]["loadavg_after"] = harness.loadavg()
    print("| model | FLOPs / micro-batch | count (ms) | measure (ms) | share | vs formula |")
    print("|---|---|---|---|---|---|")
    for r in report["runs"]:
        versus = f"{r['counted_over_formula']:.4f}" if "counted_over_formula" in r else "–"
        times = f"{r['count_s'] * 1e3:.1f} | {r['measure_s'] * 1e3:.1f}"
        share = f"{r['count_share_of_measure']:.0%}"
        print(f"| {r['model']} | {r['flops_per_micro_batch']:.3g} | {times} | {share} | {versus} |")
    return harness.write(report, args.out, wall_since=start)


if __name__ == "__main__":
    sys.exit(main())
