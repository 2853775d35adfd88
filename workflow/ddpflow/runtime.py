"""Small shared helpers: rank-prefixed logging, devices, atomic writes, provenance."""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)
# the timed phases of a training step, in order: loop.Loop measures them with `timed`, every
# epoch's "seconds" record and the report's columns and summary rows use these keys
PHASES = ("data", "forward", "backward_sync", "optimizer")


def setup_logging(rank: int | None = None, level: int = logging.INFO) -> None:
    """Every line says which rank and host wrote it (interleaved multi-rank logs stay readable)."""
    prefix = f"[rank {rank} {socket.gethostname()}] " if rank is not None else ""
    fmt = f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s"
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)


def select_device(gpus_per_node: int, local_rank: int):
    """cuda:<local rank> when GPUs are requested (one GPU per rank), else the CPU."""
    import torch

    if gpus_per_node == 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if os.environ.get("DDPFLOW_ALLOW_CPU_FALLBACK") == "1":
            log.warning(
                "machine.gpus_per_node=%d but no CUDA device: running on CPU "
                "(DDPFLOW_ALLOW_CPU_FALLBACK=1)",
                gpus_per_node,
            )
            return torch.device("cpu")
        raise RuntimeError(
            f"machine.gpus_per_node is {gpus_per_node} but {socket.gethostname()} has no usable "
            "CUDA device; set machine.gpus_per_node: 0 for CPU ranks"
        )
    # With --gpus-per-node every task sees all of the node's GPUs: pick ours by local rank.
    # With per-task binding each task sees exactly one, device 0.
    index = local_rank if torch.cuda.device_count() > local_rank else 0
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


@contextmanager
def atomic_writer(path: str | Path) -> Iterator:
    """A binary file handle on a temporary sibling of `path`: on success it is fsynced and
    renamed over `path`, on any error removed. Readers never see a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_writer(path) as fh:
        fh.write(data)


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def atomic_torch_save(obj, path: str | Path) -> str:
    """torch.save, atomically; returns the sha256 of the bytes written (a checksum sidecar)."""
    import hashlib
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    atomic_write_bytes(path, data)
    return hashlib.sha256(data).hexdigest()


def append_jsonl(path: str | Path, record: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(record, sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


@contextmanager
def timed(store: dict, key: str, sync=None) -> Iterator[None]:
    """Add the block's wall seconds to store[key]; `sync` (e.g. cuda.synchronize) makes the
    measurement honest for asynchronous devices."""
    if sync:
        sync()
    start = time.perf_counter()
    yield
    if sync:
        sync()
    store[key] = store.get(key, 0.0) + time.perf_counter() - start


def provenance() -> dict:
    """Where a result came from: code version, package versions, machine."""
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("torchvision", "submitit", "snakemake", "numpy"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - optional packages, absence is information
            versions[name] = None
    return {
        "git_commit": git_commit(),
        "versions": versions,
        "host": socket.gethostname(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).parent,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None
