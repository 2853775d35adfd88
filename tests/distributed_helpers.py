"""Start a real gloo process group the way ddpflow's ranks start one, and collect results.

Each rank is a spawned process that gets submitit's local-executor variables
(SUBMITIT_EXECUTOR=local, SUBMITIT_LOCAL_*), then goes through the production path:
ddpflow.cluster.distenv.discover() and distenv.init_process_group() with a rendezvous directory
(rank 0 binds a free port and publishes it in a file). `target(env, *args)` runs on every
rank and its return value comes back to the test, ordered by rank.

A fresh interpreter needs seconds to import torch, so ranks come from a fork server that
imported torch and ddpflow once per test session (a clean parent: it never ran a torch op,
so no thread pool is forked); tests still run one group per world size and do several
checks inside it. At most 3 ranks at once: the test machine has 2 cores.
"""

from __future__ import annotations

import itertools
import os
import pickle
import queue
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

MAX_RANKS = 4
PG_TIMEOUT_S = 30  # a deadlocked collective fails after this instead of hanging the suite
LAUNCH_TIMEOUT_S = 120
_JOB_IDS = itertools.count(1)
_PRELOAD = [
    "torch",
    "torch.distributed",
    "ddpflow.cluster.distenv",
    "ddpflow.training.evaluate",
    "ddpflow.training.loop",
]
# launcher variables of an outer job that must not leak into the ranks (a nested job would
# inherit the outer one's rank and shape)
_FOREIGN_PREFIXES = ("SLURM_", "SUBMITIT_", "TORCHELASTIC_")
_FOREIGN_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


def submitit_local_env(rank: int, world_size: int, job_id: str) -> dict[str, str]:
    """The variables submitit's local executor gives task `rank` of a job."""
    return {
        "SUBMITIT_EXECUTOR": "local",
        "SUBMITIT_LOCAL_JOB_ID": job_id,
        "SUBMITIT_LOCAL_NTASKS": str(world_size),
        "SUBMITIT_LOCAL_GLOBALID": str(rank),
        "SUBMITIT_LOCAL_LOCALID": str(rank),
        "SUBMITIT_LOCAL_NODEID": "0",
        "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
    }


def _rank_main(
    rank, world_size, job_id, rendezvous_dir, target, args, results, backend, interface=None
):
    import torch.distributed as dist
    from ddpflow.cluster import distenv

    for name in list(os.environ):
        if name.startswith(_FOREIGN_PREFIXES) or name in _FOREIGN_NAMES:
            del os.environ[name]
    os.environ.update(submitit_local_env(rank, world_size, job_id))
    torch.set_num_threads(1)  # several ranks on 2 cores: intra-op threads only contend
    try:
        env = distenv.discover()
        if backend == "nccl":  # one GPU per rank, chosen before NCCL creates a communicator
            torch.cuda.set_device(env.local_rank)
        distenv.init_process_group(env, backend, PG_TIMEOUT_S, rendezvous_dir, interface)
        if backend == "nccl" and world_size == 1:  # distenv needs no group for one rank
            dist.init_process_group(
                backend, init_method=f"file://{rendezvous_dir}/nccl-store", rank=0, world_size=1
            )
        try:
            # plain pickle: torch's queue would pass tensors as shared-memory file
            # descriptors, which die with this process before the test reads them
            results.put((rank, "ok", pickle.dumps(target(env, *args))))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - any failure of a rank goes back to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_group(
    world_size: int,
    target,
    args: tuple,
    rendezvous_dir: Path,
    backend: str = "gloo",
    interface: str | None = None,
) -> list:
    """Run target(env, *args) on `world_size` spawned ranks; return the results by rank.
    backend "nccl": rank r uses GPU r (tests/test_gpu.py); interface: as
    machine.network_interface.

    Raises AssertionError with the failing ranks' tracebacks if any rank fails or hangs.
    """
    assert 1 <= world_size <= MAX_RANKS, "the test machine has 2 cores"
    Path(rendezvous_dir).mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server first starts
    results = ctx.Queue()
    job_id = f"{os.getpid()}{next(_JOB_IDS)}"
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                rank,
                world_size,
                job_id,
                str(rendezvous_dir),
                target,
                args,
                results,
                backend,
                interface,
            ),  # fmt: skip
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    collected: dict[int, tuple[str, object]] = {}
    try:
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            try:
                rank, status, value = results.get(timeout=max(0.1, min(1.0, remaining)))
            except queue.Empty:
                died = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if remaining <= 0 or died:
                    exitcodes = [p.exitcode for p in procs]
                    raise AssertionError(
                        f"ranks gave {sorted(collected)} of {world_size} results "
                        f"(exit codes {exitcodes})"
                    ) from None
                continue
            collected[rank] = (status, value)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(collected.items()) if s != "ok"]
    assert not errors, "\n".join(errors)
    return [pickle.loads(collected[rank][1]) for rank in range(world_size)]


def port_files(rendezvous_dir: Path) -> list[str]:
    """Port files rank 0 published in rendezvous_dir (rendezvous-<job>-<restart>.port)."""
    return sorted(p.name for p in Path(rendezvous_dir).glob("rendezvous-*.port"))


def make_data(n_train: int, n_val: int, num_classes: int = 4, seed: int = 0, device=None):
    """A RankData as ddpflow.training.rankdata.load_data returns it, from synthetic 8x8 images:
    class c lights up quadrant c, plus noise (learnable in a few epochs by a small MLP); on
    device (default: the CPU)."""
    from ddpflow.training.rankdata import RankData, Split

    gen = torch.Generator().manual_seed(seed)

    def split(n):
        labels = torch.randint(0, num_classes, (n,), generator=gen)
        images = torch.randint(0, 120, (n, 1, 8, 8), generator=gen)
        for c in range(num_classes):
            row, col = divmod(c, 2)
            images[labels == c, :, 4 * row : 4 * row + 4, 4 * col : 4 * col + 4] += 120
        return images.to(torch.uint8), labels.to(torch.int64)

    train_x, train_y = split(n_train)
    val_x, val_y = split(n_val)
    scaled = train_x.float() / 255.0
    shape = [1, 1, 1, 1]
    device = torch.device("cpu") if device is None else device
    return RankData(
        splits={
            "train": Split(train_x.to(device), train_y.to(device)),
            "val": Split(val_x.to(device), val_y.to(device)),
        },
        norm=(scaled.mean().view(shape).to(device), scaled.std().view(shape).to(device)),
        num_classes=num_classes,
        shape=[1, 8, 8],
        device=device,
    )


def make_task_data(task: str, n_train: int, n_val: int, seed: int = 0):
    """make_data's images with a multilabel or regression task's targets, as load_data returns
    them: multilabel, which of the 4 quadrants are lit (uint8 [n, 4]; 10% of the entries
    flipped, so the metrics are not all 1); regression, the lit quadrants' brightness plus
    noise (float32 [n, 2]), with the train split's mean and std in the manifest."""
    from ddpflow.task import get_task
    from ddpflow.training.rankdata import RankData, Split

    gen = torch.Generator().manual_seed(seed)

    def split(n):
        lit = torch.rand(n, 4, generator=gen) < 0.5
        images = torch.randint(0, 120, (n, 1, 8, 8), generator=gen)
        for q in range(4):
            row, col = divmod(q, 2)
            images[lit[:, q], :, 4 * row : 4 * row + 4, 4 * col : 4 * col + 4] += 120
        if task == "multilabel":
            flipped = lit ^ (torch.rand(n, 4, generator=gen) < 0.1)
            return images.to(torch.uint8), flipped.to(torch.uint8)
        mean = images.float().mean(dim=(1, 2, 3))
        targets = torch.stack([mean / 10.0, mean / 20.0 + 3.0], dim=1)
        targets += 0.3 * torch.randn(n, 2, generator=gen)
        return images.to(torch.uint8), targets.float()

    train_x, train_y = split(n_train)
    val_x, val_y = split(n_val)
    scaled = train_x.float() / 255.0
    manifest = {"task": task}
    if task == "regression":
        manifest.update(target_mean=train_y.double().mean(0).tolist(),
                        target_std=train_y.double().std(0, unbiased=False).tolist())  # fmt: skip
    return RankData(
        splits={"train": Split(train_x, train_y), "val": Split(val_x, val_y)},
        norm=(scaled.mean().view(1, 1, 1, 1), scaled.std().view(1, 1, 1, 1)),
        num_classes=4 if task == "multilabel" else 2,
        shape=[1, 8, 8],
        manifest=manifest,
        task=get_task(task),
    )


def own_listeners() -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket this process holds, read from
    /proc/net/tcp and tcp6 of its network namespace, matched by socket inode to
    /proc/self/fd: what `ss -ltnp` shows for the process. "0.0.0.0" or "::" is a wildcard."""
    import ipaddress
    import socket

    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or int(fields[9]) not in inodes:  # 0A: LISTEN
                continue
            hex_address, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_address)
            # the kernel prints each 32-bit word in host (little-endian) order
            words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]
            packed = b"".join(words)
            address = str(ipaddress.ip_address(packed)) if family == socket.AF_INET6 else \
                socket.inet_ntoa(packed)  # fmt: skip
            found.append((address, int(hex_port, 16)))
    return sorted(found)
