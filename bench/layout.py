"""CPU training step by layout and precision: what `train.channels_last` and `train.precision:
bf16` do on this CPU, model by model.

Each case builds the model as ddpflow does (built-in, torchvision by name, small-image stem),
on one rank with one torch thread, batch 32 of random inputs of the case's shape, SGD with
momentum as shipped, and times whole training steps (forward, backward, optimizer) three
ways: fp32 NCHW (how the model is written, the baseline), fp32 channels_last (ddpflow's
default for models with convolutions) and bf16 autocast in channels_last
(`train.precision: bf16`). The three alternate repeat by repeat; each figure is the median
over repeats of the mean step time of `--steps` steps, after two untimed steps.

    bench/layout.py                    the default cases
    bench/layout.py --quick            fewer steps and repeats, the small cases only
    bench/layout.py --cases cnn:1x8x8 resnet50:3x32x32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import harness
import torch
from ddpflow import config as ddpconfig
from ddpflow.training.models import build_model, place

# model:CxHxW; the default digits are 1x8x8, the throughput benchmark's images 1x28x28 / 3x32x32
CASES = [
    *("cnn:1x8x8", "cnn:1x28x28", "resnet18:1x8x8", "resnet18:3x32x32"),
    *("resnet50:1x8x8", "resnet50:3x32x32", "mobilenet_v3_small:3x32x32"),
    "shufflenet_v2_x0_5:1x8x8",
]
QUICK_CASES = ["cnn:1x8x8", "resnet18:1x8x8", "mobilenet_v3_small:3x32x32"]
# name: (channels_last, bf16)
VARIANTS = {
    "fp32_nchw": (False, False),
    "fp32_channels_last": (True, False),
    "bf16_channels_last": (True, True),
}
NUM_CLASSES, BATCH = 10, 32


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, "layout.json")
    p.add_argument("--cases", nargs="+", default=None, help="model:CxHxW ...")
    p.add_argument("--steps", type=int, default=4, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small cases, 2 steps, 2 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.cases, args.steps, args.repeats = args.cases or QUICK_CASES, 2, 2
    args.cases = args.cases or CASES
    return args


def parse_case(case: str) -> tuple[str, list[int]]:
    name, _, shape = case.partition(":")
    return name, [int(n) for n in shape.split("x")]


def make_step(name: str, shape: list[int], channels_last: bool, bf16: bool):
    """One training step of the case's model in this layout and precision."""
    torch.manual_seed(0)
    model_cfg = {**ddpconfig.validate({})["model"], "name": name}  # the shipped defaults
    model = place(build_model(model_cfg, shape, NUM_CLASSES), torch.device("cpu"), channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(BATCH, *shape), torch.randint(0, NUM_CLASSES, (BATCH,))

    def step() -> None:
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def measure(case: str, steps: int, repeats: int) -> dict:
    name, shape = parse_case(case)
    runs = {variant: make_step(name, shape, *how) for variant, how in VARIANTS.items()}
    for step in runs.values():  # untimed: allocations, oneDNN primitive caches
        step(), step()
    times: dict[str, list[float]] = {variant: [] for variant in runs}
    for repeat in range(repeats):
        order = list(runs) if repeat % 2 == 0 else list(runs)[::-1]
        for variant in order:
            start = time.perf_counter()
            for _ in range(steps):
                runs[variant]()
            times[variant].append((time.perf_counter() - start) / steps)
    medians = {variant: statistics.median(t) for variant, t in times.items()}
    base = medians["fp32_nchw"]
    return {
        "case": case,
        "model": name,
        "shape": shape,
        "step_s": medians,
        "all_step_s": times,
        "speedup_vs_fp32_nchw": {variant: base / s for variant, s in medians.items()},
    }


def format_table(report: dict) -> str:
    c = report["conditions"]
    lines = [
        f"# CPU training step by layout and precision: 1 rank, {c['threads']} thread, batch "
        f"{c['batch']}; median of {c['repeats']} repeats of {c['steps']} steps",
        f"{'case':<28} {'fp32 NCHW ms':>12} {'fp32 CL ms':>10} {'bf16 CL ms':>10} | "
        f"{'CL':>6} {'bf16 CL':>7}  (speedup vs fp32 NCHW)",
    ]
    for r in report["runs"]:
        ms, up = r["step_s"], r["speedup_vs_fp32_nchw"]
        lines.append(
            f"{r['case']:<28} {ms['fp32_nchw'] * 1e3:12.1f} {ms['fp32_channels_last'] * 1e3:10.1f} "
            f"{ms['bf16_channels_last'] * 1e3:10.1f} | {up['fp32_channels_last']:5.2f}x "
            f"{up['bf16_channels_last']:6.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    bf16_native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    report = {
        **harness.head("CPU training step: fp32 NCHW vs fp32 channels_last vs bf16 channels_last"),
        "conditions": {
            "threads": 1,
            "batch": BATCH,
            "steps": args.steps,
            "repeats": args.repeats,
            "timing": "mean step time over `steps` steps per repeat, median of repeats; the "
            "three variants alternate repeat by repeat, order flipped each repeat; 2 untimed "
            "steps first",
            "model": "ddpflow.training.models.build_model with the shipped model defaults "
            "(small-image "
            "stem), random init, seed 0; "
            "SGD momentum 0.9; random inputs and labels",
        },
        "runs": [],
    }
    report["machine"]["cpu_bf16_instructions"] = bf16_native
    for case in args.cases:
        print(f"measuring {case} ...", flush=True)
        report["runs"].append(measure(case, args.steps, args.repeats))
    print(format_table(report), flush=True)
    if not bf16_native:
        print("# this CPU has no bf16 instructions: bf16 is emulated by oneDNN", flush=True)
    return harness.write(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
