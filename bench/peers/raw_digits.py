"""ddpflow's default job as the raw PyTorch DDP tutorial script: mp.spawn, gloo, DDP,
DistributedSampler, loss.item() every step, validation after every epoch and the test
accuracy at the end, each an all_reduce of correct/total over unpadded shards. The batch per
rank is ddpflow's micro-batch, so the global batch is ddpflow's at the same world size; the
sampler and loader drop the remainder (drop_last), so an epoch is ddpflow's floor(n / global
batch) full steps.

Same job as `snakemake` with the shipped config (digits_job.py says what is shared):

    .venv/bin/python bench/peers/raw_digits.py [--job run.json] [--result result.json]
"""

from __future__ import annotations

import os
import socket
import sys
import time

import digits_job
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def accuracy(model, images, labels, batch: int, rank: int, world: int) -> tuple[float, int]:
    """Exact: each rank scores its own contiguous, unpadded shard; one all_reduce of counts."""
    from ddpflow.training.evaluate import shard_bounds

    start, stop = shard_bounds(len(labels), world, rank)
    model.eval()
    counts = torch.zeros(2, dtype=torch.int64)  # correct, total
    with torch.no_grad():
        for i in range(start, stop, batch):
            logits = model(images[i : min(i + batch, stop)])
            counts[0] += int((logits.argmax(1) == labels[i : min(i + batch, stop)]).sum())
            counts[1] += len(logits)
    dist.all_reduce(counts)
    return int(counts[0]) / int(counts[1]), int(counts[1])


def worker(rank: int, world: int, job: dict, port: int, result_file: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(job["machine"]["cpus_per_task"])
    data = digits_job.load_splits(job)
    train_x, train_y = data["train"]
    dataset = TensorDataset(train_x, train_y)
    seed = job["train"]["seed"]
    sampler = DistributedSampler(dataset, world, rank, shuffle=True, seed=seed, drop_last=True)
    batch = digits_job.micro_batch(job)  # per rank: global batch = batch x world
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=True)
    model = DDP(digits_job.build(job, train_x))
    optimizer, scheduler = digits_job.optimizer_and_schedule(job, model.parameters(), len(loader))
    loss_fn = nn.CrossEntropyLoss(label_smoothing=job["train"]["label_smoothing"])
    eval_batch = job["eval"]["batch_size"]
    start = time.perf_counter()
    for epoch in range(job["train"]["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        running = 0.0
        for x, y in loader:
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            running += loss.item()
        val_acc, _ = accuracy(model.module, *data["val"], eval_batch, rank, world)
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {running / len(loader):.4f} val {val_acc:.4f}")
    train_seconds = time.perf_counter() - start
    test_acc, counted = accuracy(model.module, *data["test"], eval_batch, rank, world)
    if rank == 0:
        torch.save(model.module.state_dict(), "model.pt")
        print(f"test accuracy {test_acc:.4f} ({counted} samples)")
        if result_file:
            digits_job.write_result(
                result_file,
                peer="raw",
                test_accuracy=test_acc,
                test_samples=len(data["test"][1]),
                test_samples_counted=counted,
                train_samples=len(train_y),
                epochs=job["train"]["epochs"],
                world_size=world,
                train_seconds=train_seconds,
            )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args, job = digits_job.command_line(__doc__, argv)
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    world = digits_job.world_size(job)
    mp.spawn(worker, args=(world, job, port, args.result), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
