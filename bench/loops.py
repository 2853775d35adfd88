"""The pieces the training benchmarks share (throughput, scaling, batchnorm, lm,
accumulation_drift, finetune and Lightning's loop): synthetic data, ddpflow's run and Loop
as TrainTask builds them, a peer's model layout, the timed epoch and the alternating
schedule, and a worker rank's device and process group."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from ddpflow import config as ddpconfig
from ddpflow import runtime
from ddpflow.cluster.distenv import DistEnv
from ddpflow.config.typed import RunSpec
from ddpflow.training.checkpoint import Checkpointer
from ddpflow.training.loop import Loop
from ddpflow.training.models import build_model, place
from ddpflow.training.rankdata import RankData, Split
from torch import nn

REPO = Path(__file__).resolve().parents[1]
NUM_CLASSES = 10


def synthetic(shape: list[int], samples: int, seed: int = 0):
    """uint8 images, random labels, and their per-channel mean/std in 0..1 units."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (samples, *shape), generator=gen, dtype=torch.uint8)
    labels = torch.randint(0, NUM_CLASSES, (samples,), generator=gen)
    scaled = images.double().div(255.0)
    dims = [0, 2, 3]
    mean, std = scaled.mean(dims).float(), scaled.std(dims, unbiased=False).float()
    view = [1, shape[0], 1, 1]
    return images, labels, (mean.view(view), std.view(view))


def ddpflow_run(cfg: dict) -> dict:
    """The shipped config with this benchmark's model, batch, epochs and machine."""
    cuda = cfg["device"] == "cuda"
    overrides = {
        "model": {"name": cfg["case"]["model"]},
        "train": {
            # the per-rank batch as the micro-batch, one per rank and step (no accumulation),
            # unless the caller fixes the global batch (bench/scaling.py)
            "global_batch_size": cfg.get("global_batch") or cfg["batch"] * cfg["world_size"],
            "micro_batch_size": cfg["batch"],
            "epochs": cfg["warmup"] + cfg["repeats"],
            "progress": False,
            "precision": "bf16" if cuda else cfg["precision"],
            "ddp": cfg.get("ddp", {}),
        },
        "machine": {
            "gpus_per_node": 1 if cuda else 0,
            "cpu_ranks_per_node": cfg["world_size"],
            "cpus_per_task": cfg["threads"],
        },
        "runs": [{"name": "bench"}],
    }
    loaded = ddpconfig.load(REPO / "config" / "config.yaml", overrides)
    return ddpconfig.resolve_runs(loaded)[0]


def ddpflow_epoch(cfg: dict, run: dict, images, labels, norm, env: DistEnv, device):
    """ddpflow's Loop as TrainTask builds it; returns (epoch function, loop)."""
    data = RankData(
        splits={
            "train": Split(images.to(device), labels.to(device)),
            "val": Split(images[:64].to(device), labels[:64].to(device)),
        },
        norm=tuple(t.to(device) for t in norm),
        num_classes=NUM_CLASSES,
        shape=cfg["case"]["shape"],
        device=device,
    )
    torch.manual_seed(run["train"]["seed"])
    model = place(build_model(run["model"], data.shape, NUM_CLASSES), device, True)
    loop = Loop(RunSpec.from_run(run), data, env, device, model)
    # what TrainTask runs after every optimizer step (checkpoint and stop-signal checks);
    # the shipped config checkpoints per epoch, outside train_epoch(), so nothing is written
    loop.watch_steps(Checkpointer(RunSpec.from_run(run), cfg["work"], env).on_step)
    if cfg.get("compile"):
        loop.wrapped = torch.compile(loop.wrapped)
    return (lambda: loop.train_epoch()), loop


def peer_layout(cfg: dict, model: nn.Module) -> nn.Module:
    """The peer's model as its user writes it (NCHW), or, --peer-channels-last, in the
    layout ddpflow gives convolutional models."""
    if cfg.get("peer_channels_last"):
        return place(model, torch.device("cpu"), True, move=False)
    return model


def timed_epoch(epoch_fn, device, sync) -> tuple[float, float, dict]:
    """One epoch: global samples per wall second (slowest rank) and per CPU second (all
    ranks' process time summed: robust to other processes sharing the cores)."""
    sync()
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    record = epoch_fn()
    sync()
    seconds = torch.tensor(time.perf_counter() - start, dtype=torch.float64, device=device)
    cpu = torch.tensor(time.process_time() - cpu_start, dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
    samples = record["samples"]  # of all ranks
    return samples / float(seconds), samples / float(cpu), record


def schedule(names: list[str], warmup: int, repeats: int) -> list[tuple[str, int | None]]:
    """(loop, repeat) in run order: each loop's warmup epochs (repeat None), then the loops
    alternating repeat by repeat, the order flipped every repeat."""
    order = [(name, None) for name in names for _ in range(warmup)]
    for repeat in range(repeats):
        order += [(name, repeat) for name in (names if repeat % 2 == 0 else names[::-1])]
    return order


def rank_device(cfg: dict) -> tuple[torch.device, str, object]:
    """This worker's device, process-group backend and device sync (a no-op on CPU)."""
    torch.set_num_threads(cfg["threads"])
    if cfg["device"] != "cuda":
        return torch.device("cpu"), "gloo", lambda: None
    device = torch.device("cuda", cfg["rank"])
    torch.cuda.set_device(device)
    runtime.configure_cuda(deterministic=False)  # as TrainTask does (cuDNN autotuning)
    return device, "nccl", torch.cuda.synchronize


@contextlib.contextmanager
def process_group(cfg: dict, backend: str):
    """The tutorial's set-up: one real process group on 127.0.0.1 (every loop of the worker
    shares it), and the DistEnv ddpflow's Loop gets; destroyed on the way out."""
    rank, world = cfg["rank"], cfg["world_size"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        yield DistEnv(rank, world, rank, world, 0, 1, "127.0.0.1", cfg["port"], "bench", "bench")
    finally:
        dist.destroy_process_group()
