"""The job of ddpflow's default workflow, as a standalone script would set it up: shared by
lightning_digits.py and raw_digits.py so that the two differ only in their training loop.

What it takes from ddpflow (so that the job is identical, not a copy that could drift):

* the settings: the first run of the shipped config/config.yaml, schema defaults filled in
  (the harness, bench/end_to_end.py, passes it as JSON; without it the script loads the config);
* the data: scikit-learn's digits split by ddpflow.data.staging.split_indices (stratified,
  seeded: the same train/val/test samples as the stage rule; make_splits below) and
  standardised with the train split's per-channel mean/std (channel_stats below,
  ddpflow.training.evaluate.normalize);
* the model: ddpflow.training.models.build_model (the CNN), initialised after
  torch.manual_seed(seed);
* the batch: train.micro_batch_size per rank at the job's world size, one micro-batch per
  rank and step, so the global batch is train.global_batch_size (check_job refuses a job
  that would need gradient accumulation); the loaders drop each rank's short last batch, so
  an epoch is ddpflow's floor(train samples / global batch) full steps;
* the lr: ddpflow.training.schedule.effective_lr (linear scaling with the global batch) and
  ddpflow.training.schedule.lr_schedule (linear warmup, then cosine, per optimizer step).

What the scripts write themselves, as their users would: the loop, the optimizer (plain
torch.optim.SGD, not ddpflow's fused kernel), samplers, validation and the test accuracy.
Staging (checksummed files on disk) is what the workflow adds and a script does not.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
NUM_CLASSES = 10  # digits 0-9 (check_job allows no other source)


def command_line(doc: str, argv: list[str] | None) -> tuple[argparse.Namespace, dict]:
    """Both scripts' options: --job (the run as JSON) and --result; the checked job."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--job", help="the resolved run as JSON (default: config/config.yaml)")
    p.add_argument("--result", help="write accuracy and samples here (rank 0)")
    args = p.parse_args(argv)
    job = load_job(args.job)
    check_job(job)
    return args, job


def load_job(path: str | None) -> dict:
    """The resolved run (data, model, train, eval, machine sections)."""
    if path:
        return json.loads(Path(path).read_text())
    from ddpflow import config

    return config.resolve_runs(config.load(REPO / "config" / "config.yaml"))[0]


def check_job(job: dict) -> None:
    """What these scripts write out; anything else would silently be another job."""
    train = job["train"]
    per_step = train["micro_batch_size"] * world_size(job)  # one micro-batch per rank
    no_accumulation = "train.global_batch_size (micro_batch_size x world size: no accumulation)"
    unsupported = {
        "data.source": (job["data"]["source"], "digits"),
        "train.optimizer.name": (train["optimizer"]["name"], "sgd"),
        no_accumulation: (train["global_batch_size"], per_step),
        "machine.gpus_per_node": (job["machine"]["gpus_per_node"], 0),
    }
    for key, (value, supported) in unsupported.items():
        if value != supported:
            raise SystemExit(f"peer scripts support {key}: {supported!r} only, not {value!r}")


def world_size(job: dict) -> int:
    return job["machine"]["nodes"] * job["machine"]["cpu_ranks_per_node"]


def load_splits(job: dict) -> dict:
    """{split: (float images standardised, int64 labels)} for train, val and test."""
    from ddpflow.data.sources import load_digits
    from ddpflow.training.evaluate import normalize

    splits = make_splits(load_digits(), job["data"], job["data"]["seed"])
    mean, std = channel_stats(splits["train"][0])
    view = [1, len(mean), 1, 1]
    norm = (torch.tensor(mean).view(view), torch.tensor(std).view(view))
    return {
        name: (normalize(torch.from_numpy(x), *norm), torch.from_numpy(y))
        for name, (x, y) in splits.items()
    }


def make_splits(raw, data_cfg: dict, seed: int) -> dict:
    """{split: (images, labels)} in memory (sources held as arrays): see
    ddpflow.data.staging.split_indices."""
    from ddpflow.data.staging import split_indices

    pools = {"train": (raw.train_x, raw.train_y), "test": (raw.test_x, raw.test_y)}
    return {
        split: (pools[pool][0][idx], pools[pool][1][idx])
        for split, (pool, idx) in split_indices(raw, data_cfg, seed).items()
    }


def channel_stats(images: np.ndarray, chunk: int = 4096) -> tuple[list[float], list[float]]:
    """Per-channel mean and std (population) in 0..1 units, from exact integer sums.

    Chunked so that CIFAR-sized uint8 arrays are never copied whole into float64.
    """
    total = np.zeros(images.shape[1], np.int64)
    squares = np.zeros(images.shape[1], np.int64)
    for start in range(0, len(images), chunk):
        part = images[start : start + chunk].astype(np.int64)
        total += part.sum(axis=(0, 2, 3))
        squares += (part * part).sum(axis=(0, 2, 3))
    count = len(images) * images.shape[2] * images.shape[3]
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean * mean, 0.0))
    return (mean / 255.0).tolist(), (std / 255.0).tolist()


def build(job: dict, images: torch.Tensor) -> torch.nn.Module:
    from ddpflow.training.models import build_model

    torch.manual_seed(job["train"]["seed"])  # same initial weights on every rank
    return build_model(job["model"], list(images.shape[1:]), NUM_CLASSES)


def optimizer_and_schedule(job: dict, params, steps_per_epoch: int):
    """SGD at ddpflow's effective lr and the LambdaLR to step after every optimizer step."""
    from ddpflow.config.typed import TrainSpec
    from ddpflow.training.schedule import effective_lr

    lr = effective_lr(TrainSpec.from_dict(job["train"]))
    return sgd_schedule(job["train"], params, lr, steps_per_epoch)


def sgd_schedule(train: dict, params, lr: float, steps_per_epoch: int):
    """Plain torch.optim.SGD (as a script writes it; ddpflow uses the fused kernel) and
    ddpflow's warmup + cosine multiplier per optimizer step (also bench/lightning_loop.py)."""
    from ddpflow.training.schedule import lr_schedule

    opt = train["optimizer"]
    optimizer = torch.optim.SGD(
        params,
        lr=lr,
        momentum=opt["momentum"],
        nesterov=opt["nesterov"] and opt["momentum"] > 0,
        weight_decay=opt["weight_decay"],
    )
    total = steps_per_epoch * train["epochs"]
    warmup = round(train["warmup_epochs"] * steps_per_epoch)
    factor = lr_schedule(train["schedule"], warmup, total)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def lightning_optimizers(optimizer, scheduler) -> dict:
    """configure_optimizers()'s answer: the scheduler stepped per optimizer step."""
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def steps_per_epoch(job: dict, train_samples: int) -> int:
    """Lightning's steps: its DistributedSampler pads to equal shards of ceil(n / world) and
    the DataLoader's drop_last=True leaves out each rank's short last batch. ddpflow takes
    floor(n / global batch): the same 20 for the digits' 1,294 at 2 ranks x 32 (they differ
    only where the padding completes one more batch)."""
    per_rank = math.ceil(train_samples / world_size(job))
    return per_rank // micro_batch(job)


def micro_batch(job: dict) -> int:
    """The per-rank batch of the peers' loaders: ddpflow's micro-batch."""
    return job["train"]["micro_batch_size"]


def write_result(path: str, **result) -> None:
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
