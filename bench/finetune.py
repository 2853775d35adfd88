"""Fine-tuning's training step: what `train.freeze: backbone` saves against training every
parameter, model by model.

Each case trains ddpflow's `Loop` (built as `tasks.TrainTask` builds it: `placed_model`, then
`Loop`, whose `build_training` gives the optimizer the trainable parameters only) on one
rank, in one process, three ways on the same model, data and batch:

* ``scratch``: random initialisation, every parameter trains (the baseline);
* ``full``: `model.weights` loaded (a file this benchmark writes: the same architecture at
  another seed with a 1000-class head, which `load_weights` re-initialises to 10 classes, as
  from ImageNet weights), every parameter trains: full fine-tuning, the same compute as
  scratch (the control);
* ``frozen``: the same weights, `train.freeze: backbone`: every parameter but the classifier
  head has requires_grad False and the backbone's BatchNorm layers stay in eval mode
  (`keep_frozen_statistics`), so autograd computes no weight gradient in the backbone and,
  since nothing before the head needs a gradient, no backward through it at all; the
  optimizer holds the head alone.

One repeat is one `Loop.train_epoch()` of `--steps` optimizer steps (one micro-batch each, no
accumulation); the modes alternate repeat by repeat (order flipped every repeat) after
`--warmup` untimed epochs each; each figure is the median over `--repeats`. Speedup =
scratch's epoch seconds / the mode's. Synthetic uint8 images normalised by their per-channel
mean/std, random labels; the shipped config's SGD (Nesterov momentum, cosine schedule); fp32,
channels_last (ddpflow's default for convolutional models); 1 torch thread.

    bench/finetune.py              cnn and resnet18 on 3x32x32 (about 1.5 minutes on 2 cores)
    bench/finetune.py --quick      the CNN only, fewer repeats
    bench/finetune.py --cases resnet18 --steps 2 --repeats 3
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
from ddpflow import config as ddpconfig
from ddpflow.cluster.distenv import DistEnv
from ddpflow.config.typed import RunSpec
from ddpflow.training.build import placed_model
from ddpflow.training.loop import Loop
from ddpflow.training.models import build_model
from ddpflow.training.rankdata import RankData, Split
from loops import NUM_CLASSES, schedule, synthetic

REPO = Path(__file__).resolve().parents[1]
# steps: optimizer steps per epoch (= per repeat) at the default batch; ResNet-18 is kept to
# a few steps so that the CPU time stays bounded (~1 s a step from scratch on one thread)
CASES = {
    "cnn": {"model": "cnn", "shape": [3, 32, 32], "steps": 16},
    "resnet18": {"model": "resnet18", "shape": [3, 32, 32], "steps": 4},
}
MODES = ("scratch", "full", "frozen")
SOURCE_CLASSES = 1000  # the weights file's head, as ImageNet weights have (re-initialised)
SINGLE = DistEnv(0, 1, 0, 1, 0, 1, "127.0.0.1", 29500, "bench", "single")
CPU = torch.device("cpu")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, "finetune.json")
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    p.add_argument("--batch", type=int, default=32, help="micro-batch = global batch (1 rank)")
    p.add_argument(
        "--steps", type=int, default=None, help="steps per epoch (per case: cnn 16, resnet18 4)"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed epochs per mode")
    p.add_argument("--warmup", type=int, default=1, help="untimed epochs per mode")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--quick", action="store_true", help="the CNN only, 3 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.cases, args.repeats = ["cnn"], min(args.repeats, 3)
    return args


# --- one mode: its run, its Loop ------------------------------------------------------------


def write_source_weights(case: dict, path: Path) -> Path:
    """The file `full` and `frozen` start from: the case's model at seed 1 with a
    SOURCE_CLASSES head, as a state dict (what a pretrained checkpoint is to ddpflow)."""
    torch.manual_seed(1)
    model_cfg = {**ddpconfig.validate({})["model"], "name": case["model"]}
    model = build_model(model_cfg, case["shape"], SOURCE_CLASSES)
    torch.save(model.state_dict(), path)
    return path


def mode_run(case: dict, mode: str, weights: Path, args: argparse.Namespace, epochs: int):
    """The shipped config with the case's model, this mode's weights and freeze, the batch
    as one micro-batch per step on one CPU rank."""
    model = {"name": case["model"]}
    train = {
        "global_batch_size": args.batch,
        "micro_batch_size": args.batch,
        "epochs": epochs,
        "progress": False,
        "precision": "fp32",
    }
    if mode != "scratch":
        model["weights"] = str(weights)
    if mode == "frozen":
        train["freeze"] = "backbone"
    overrides = {
        "model": model,
        "train": train,
        "machine": {"gpus_per_node": 0, "cpu_ranks_per_node": 1, "cpus_per_task": args.threads},
        "runs": [{"name": f"bench-{mode}"}],
    }
    loaded = ddpconfig.load(REPO / "config" / "config.yaml", overrides)
    return ddpconfig.resolve_runs(loaded)[0]


def make_loop(run: dict, images, labels, norm, shape: list[int]) -> Loop:
    """ddpflow's Loop as TrainTask builds it: placed_model (seed, weights, layout), then Loop
    (freeze, then build_training: the optimizer over the trainable parameters)."""
    spec = RunSpec.from_run(run)
    data = RankData(
        splits={"train": Split(images, labels), "val": Split(images[:8], labels[:8])},
        norm=norm,
        num_classes=NUM_CLASSES,
        shape=shape,
        device=CPU,
    )
    model, loaded = placed_model(spec, data.shape, NUM_CLASSES, CPU)
    return Loop(spec, data, SINGLE, CPU, model, loaded)


def describe(loop: Loop) -> dict:
    """What trains: the optimizer's parameters against the model's, and what was loaded."""
    held = {id(p): p for group in loop.optimizer.param_groups for p in group["params"]}
    return {
        "parameters": sum(p.numel() for p in loop.model.parameters()),
        "trainable_parameters": sum(p.numel() for p in held.values()),
        "requires_grad_parameters": sum(
            p.numel() for p in loop.model.parameters() if p.requires_grad
        ),
        "frozen_tensors": len(loop.frozen),
        "weights_head": loop.loaded["head"] if loop.loaded else None,
    }


def frozen_state(loop: Loop) -> dict[str, torch.Tensor]:
    """The frozen parameters and the buffers of the modules that hold only frozen ones (the
    backbone's BatchNorm statistics): what training in `frozen` mode must leave alone."""
    frozen = set(loop.frozen)
    owners = {name.rpartition(".")[0] for name in frozen}
    head = {name.rpartition(".")[0] for name, _ in loop.model.named_parameters()} - owners
    state = loop.model.state_dict()
    keep = [k for k in state if k in frozen or k.rpartition(".")[0] not in head]
    return {k: state[k].detach().clone() for k in keep}


# --- timing -----------------------------------------------------------------------------------


def timed_epoch(loop: Loop) -> tuple[float, float, dict]:
    """One epoch: (wall seconds, process CPU seconds, Loop's epoch record)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    record = loop.train_epoch()
    return time.perf_counter() - start, time.process_time() - cpu_start, record


def summary(wall: list[float], cpu: list[float], phases: list[dict], steps: int, samples: int):
    epoch_s, cpu_s = statistics.median(wall), statistics.median(cpu)
    return {
        "epoch_s": epoch_s,
        "all_epoch_s": wall,
        "epoch_cpu_s": cpu_s,
        "all_epoch_cpu_s": cpu,
        "steps_per_s": steps / epoch_s,
        "samples_per_s": samples / epoch_s,
        "samples_per_cpu_s": samples / cpu_s,
        "phase_seconds_per_step": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
    }


def measure(name: str, args: argparse.Namespace, work: Path) -> dict:
    """The three modes of one case, alternating; the row of the JSON."""
    case = CASES[name]
    steps = args.steps or case["steps"]
    samples = steps * args.batch
    images, labels, norm = synthetic(case["shape"], samples)
    weights = write_source_weights(case, work / f"{name}-source.pt")
    epochs = args.warmup + args.repeats
    runs = {mode: mode_run(case, mode, weights, args, epochs) for mode in MODES}
    loops = {mode: make_loop(runs[mode], images, labels, norm, case["shape"]) for mode in MODES}
    before = frozen_state(loops["frozen"])
    times: dict[str, tuple[list, list, list]] = {mode: ([], [], []) for mode in MODES}
    for mode, repeat in schedule(list(MODES), args.warmup, args.repeats):
        wall, cpu, record = timed_epoch(loops[mode])
        if repeat is not None:
            times[mode][0].append(wall)
            times[mode][1].append(cpu)
            times[mode][2].append({k: v / steps for k, v in record["seconds"].items()})
    modes = {
        mode: {**describe(loops[mode]), **summary(*times[mode], steps, samples)} for mode in MODES
    }
    after = frozen_state(loops["frozen"])
    base, base_cpu = modes["scratch"]["epoch_s"], modes["scratch"]["epoch_cpu_s"]
    return {
        "case": f"{name}:{'x'.join(map(str, case['shape']))}",
        "model": case["model"],
        "shape": case["shape"],
        "batch": args.batch,
        "steps_per_epoch": steps,
        "samples_per_epoch": samples,
        "modes": modes,
        "speedup_vs_scratch": {m: base / modes[m]["epoch_s"] for m in MODES},
        "cpu_speedup_vs_scratch": {m: base_cpu / modes[m]["epoch_cpu_s"] for m in MODES},
        # the frozen mode trained its head alone: backbone weights and statistics as loaded
        "frozen_backbone_unchanged": before.keys() == after.keys()
        and all(torch.equal(before[k], after[k]) for k in before),
        "loadavg_after": harness.loadavg(),
    }


# --- report -----------------------------------------------------------------------------------


def format_table(report: dict) -> str:
    c = report["conditions"]
    lines = [
        f"# fine-tuning's training step: 1 rank, {c['threads']} thread, batch {c['batch']}, "
        f"fp32 channels_last; median of {c['repeats']} epochs after {c['warmup_epochs']}",
        f"{'case':<18} {'mode':<8} {'trainable':>11} {'epoch s':>8} {'steps/s':>8} "
        f"{'samples/s':>9} | {'speedup':>7} {'by CPU s':>8}",
    ]
    for r in report["runs"]:
        for mode, m in r["modes"].items():
            lines.append(
                f"{r['case']:<18} {mode:<8} {m['trainable_parameters']:>11,} "
                f"{m['epoch_s']:8.3f} {m['steps_per_s']:8.2f} {m['samples_per_s']:9.1f} | "
                f"{r['speedup_vs_scratch'][mode]:6.2f}x {r['cpu_speedup_vs_scratch'][mode]:7.2f}x"
            )
    lines.append(
        "(speedup: scratch's epoch seconds / the mode's; 'by CPU s': the same in process CPU "
        "seconds, robust to other load; trainable: the parameters the optimizer holds)"
    )
    return "\n".join(lines)


def conditions(args: argparse.Namespace) -> dict:
    return {
        "threads": args.threads,
        "batch": args.batch,
        "repeats": args.repeats,
        "warmup_epochs": args.warmup,
        "steps_per_epoch": {n: args.steps or CASES[n]["steps"] for n in args.cases},
        "timing": "one Loop.train_epoch() per repeat (wall and process CPU seconds), median "
        "of repeats; the modes alternate repeat by repeat, order flipped every repeat, after "
        "the warmup epochs of each",
        "loop": "ddpflow.training.loop.Loop built as tasks.TrainTask builds it "
        "(build.placed_model, then Loop: train.freeze applied, then build_training's optimizer "
        "over build.trainable's parameters); one process, no process group, no DDP",
        "config": "the shipped config/config.yaml (SGD, Nesterov momentum, weight decay, cosine "
        "schedule with warmup); train.micro_batch_size = global_batch_size = batch; fp32; "
        "convolutional models in channels_last",
        "modes": "scratch: random init (seed of the config), all parameters train; full: "
        "model.weights loaded, all parameters train; frozen: the same weights, train.freeze: "
        "backbone (the head alone trains, the backbone's BatchNorm in eval mode)",
        "weights": f"written by the benchmark: the same model at seed 1 with a "
        f"{SOURCE_CLASSES}-class head (re-initialised to {NUM_CLASSES} classes on loading)",
        "data": f"synthetic uint8 images normalised by their per-channel mean/std, random "
        f"labels, {NUM_CLASSES} classes; the same images in every mode",
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    report = harness.head(
        "fine-tuning's training step: from scratch vs full fine-tuning vs train.freeze: backbone",
        conditions=conditions(args),
        runs=[],
    )
    with tempfile.TemporaryDirectory(prefix="ddpflow-bench-finetune-") as tmp:
        for name in args.cases:
            print(f"measuring {name} ...", flush=True)
            report["runs"].append(measure(name, args, Path(tmp)))
    report["wall_s"] = time.perf_counter() - start
    print(format_table(report), flush=True)
    return harness.write(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
