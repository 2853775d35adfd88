"""bench/throughput.py's Lightning loop: the case's model, data, batch, optimizer and lr trained
by a lightning.Trainer, in the benchmark's own ranks and process group.

The ranks and the gloo group exist already (throughput.py's workers), so the Trainer runs as
under an external launcher (LightningEnvironment with LOCAL_RANK set: it starts no process and
reuses the initialised group), strategy "ddp" at every world size (a 1-rank group at world 1,
as the raw loop). Lightning inserts the DistributedSampler itself (shuffle, set_epoch). The
step normalises the uint8 batch as the other two loops do; plain torch.optim.SGD (as a
Lightning user writes it) with the same LambdaLR schedule, stepped per optimizer step. The
Trainer measures only its loop: no logger, checkpointing, progress bar, model summary or
validation, which would all be extra work on Lightning's side.

One Trainer.fit() runs all of Lightning's epochs; the other loops' epochs run between them
from a callback, in the order throughput.measure() asks (alternating, flipped each repeat), so
that background load hits all loops alike. Lightning's epoch is timed from its
on_train_epoch_start to its on_train_epoch_end (barrier before, slowest rank): the sampler's
set_epoch and the first batch's fetch fall just before that window, the epoch-end logging
just after, both in Lightning's favour.

Needs Lightning importable: bench/install-peers and bench/.peers-site on PYTHONPATH
(throughput.py --lightning gives its workers that).
"""

from __future__ import annotations

import math
import os
import time

import lightning as L
import torch
import torch.distributed as dist
from ddpflow.training.evaluate import normalize
from ddpflow.training.models import build_model
from lightning.pytorch.plugins.environments import LightningEnvironment
from loops import peer_layout
from peers.digits_job import NUM_CLASSES, lightning_optimizers, sgd_schedule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

TRAINER_ARGS = {
    "accelerator": "cpu",
    "strategy": "ddp",
    "num_nodes": 1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "limit_val_batches": 0,
    "num_sanity_val_steps": 0,
}


class Module(L.LightningModule):
    def __init__(self, model: nn.Module, run: dict, lr: float, norm, steps_per_epoch: int):
        super().__init__()
        self.model, self.job, self.lr, self.norm = model, run, lr, norm
        self.steps = steps_per_epoch
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=run["train"]["label_smoothing"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_fn(self.model(normalize(x, *self.norm)), y)

    def configure_optimizers(self):
        train = self.job["train"]
        optimizer, scheduler = sgd_schedule(train, self.parameters(), self.lr, self.steps)
        return lightning_optimizers(optimizer, scheduler)


class Interleave(L.Callback):
    """Runs the other loops' epochs between Lightning's and times Lightning's own."""

    def __init__(self, driver: LightningLoop):
        self.driver = driver
        self.start = self.cpu_start = 0.0

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.driver.run_others_until_own()
        dist.barrier()
        self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        seconds = torch.tensor(time.perf_counter() - self.start, dtype=torch.float64)
        cpu = torch.tensor(time.process_time() - self.cpu_start, dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
        self.driver.record_own(float(seconds), float(cpu))


class LightningLoop:
    """The Lightning entry of throughput.measure()'s loops: it drives the whole schedule."""

    name = "lightning"

    def __init__(self, cfg: dict, run: dict, lr: float, images, labels, norm):
        rank, world = cfg["rank"], cfg["world_size"]
        # LightningEnvironment: an external launcher made this rank (no process spawned)
        os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
        os.environ["OMP_NUM_THREADS"] = str(cfg["threads"])  # else Lightning may reset it
        self.per_rank = math.ceil(len(labels) / world)  # DistributedSampler, drop_last=False
        self.world, self.threads = world, cfg["threads"]
        self.loader = DataLoader(
            TensorDataset(images, labels), batch_size=cfg["batch"], shuffle=True
        )
        steps = math.ceil(self.per_rank / cfg["batch"])
        torch.manual_seed(run["train"]["seed"])  # same initial weights as the other loops
        model = peer_layout(cfg, build_model(run["model"], cfg["case"]["shape"], NUM_CLASSES))
        self.module = Module(model, run, lr, norm, steps)
        self.precision = "bf16-mixed" if cfg["precision"] == "bf16" else "32-true"
        self.epochs = cfg["warmup"] + cfg["repeats"]
        self.queue: list = []

    def drive(self, schedule: list, run_other, record) -> None:
        """Run `schedule` ((loop name, repeat or None) in order): other loops through
        run_other(name, repeat), Lightning's epochs inside one Trainer.fit()."""
        self.queue, self.run_other, self.record = list(schedule), run_other, record
        trainer = L.Trainer(
            devices=self.world,
            max_epochs=self.epochs,
            plugins=[LightningEnvironment()],
            callbacks=[Interleave(self)],
            precision=self.precision,
            **TRAINER_ARGS,
        )
        trainer.fit(self.module, self.loader)
        while self.queue:  # the other loops' epochs after Lightning's last
            self.run_other(*self.queue.pop(0))

    def run_others_until_own(self) -> None:
        while self.queue[0][0] != self.name:
            self.run_other(*self.queue.pop(0))
        self.current = self.queue.pop(0)
        if torch.get_num_threads() != self.threads:
            raise RuntimeError(f"Lightning changed torch threads to {torch.get_num_threads()}")

    def record_own(self, seconds: float, cpu: float) -> None:
        samples = self.per_rank * self.world
        self.record(self.name, self.current[1], samples / seconds, samples / cpu)
