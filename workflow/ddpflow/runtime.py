"""Small shared helpers: rank-prefixed logging, devices, atomic writes, provenance."""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)
# the timed phases of a training step, in order: loop.Loop measures them with a PhaseClock
# (below); every epoch's "seconds" record and the report's columns and summary rows use these
# keys
PHASES = ("data", "forward", "backward_sync", "optimizer")


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a Slurm task's allocation), else
    the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


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


def device_name(device) -> str:
    """'NVIDIA H100 80GB HBM3' for a CUDA device, 'cpu' otherwise (what the report shows)."""
    if getattr(device, "type", device) != "cuda":
        return "cpu"
    import torch

    return torch.cuda.get_device_name(device)


def configure_cuda(deterministic: bool) -> None:
    """Before the first CUDA kernel: deterministic kernels (cuBLAS reads its workspace setting
    when its handle is created) or cuDNN autotuning of convolution algorithms."""
    import torch

    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # warn_only: an op without a deterministic CUDA kernel logs its name instead of failing a
    # run hours in; tests/test_gpu.py proves a resume bitwise exact
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.backends.cudnn.benchmark = not deterministic


def new_file_mode(path: Path) -> int:
    """0600 for a file in a private folder (mode 0700: ddpflow.cluster.private), else 0666
    (less the umask, as for any file)."""
    return 0o666 if path.parent.stat().st_mode & 0o077 else 0o600


@contextmanager
def atomic_writer(path: str | Path) -> Iterator:
    """A binary file handle on a temporary sibling of `path`: on success it is fsynced and
    renamed over `path`, on any error removed. Readers never see a partial file. In a
    private folder (mode 0700: job and work folders, ddpflow.cluster.private) the file is
    0600; elsewhere the umask decides, as for any file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        with os.fdopen(os.open(tmp, flags, new_file_mode(path)), "wb") as fh:
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


# torch.load(weights_only=True) had known bypasses that run code from a crafted file before
# these versions: CVE-2025-32434 (fixed in 2.6) and CVE-2026-24747 (fixed in 2.10)
SAFE_WEIGHTS_ONLY = (2, 10)


def weights_only_problem(version: str) -> str | None:
    """Why torch `version` cannot be trusted to load checkpoints and weights, or None."""
    import re

    found = re.match(r"(\d+)\.(\d+)", version)
    if found and (int(found[1]), int(found[2])) >= SAFE_WEIGHTS_ONLY:
        return None
    wanted = ".".join(map(str, SAFE_WEIGHTS_ONLY))
    return (
        f"torch {version} loads checkpoints and weights with weights_only=True, which has known "
        f"bypasses before torch {wanted} (CVE-2025-32434, CVE-2026-24747): a crafted file could "
        f"run code as you. Install torch>={wanted} (envs/requirements.txt pins a safe one)"
    )


def safe_torch_load(source, map_location=None):
    """torch.load(weights_only=True), refused on a torch with known weights_only bypasses."""
    import torch

    problem = weights_only_problem(torch.__version__)
    if problem is not None:
        raise RuntimeError(problem)
    return torch.load(source, map_location=map_location, weights_only=True)


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """A file's sha256, read in 1 MiB blocks."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def atomic_torch_save(obj, path: str | Path) -> str:
    """torch.save, atomically; returns the sha256 of the bytes written (a checksum sidecar).
    The bytes are hashed as torch writes them to the file: no copy of the whole checkpoint
    is held in memory (a ViT-B/16's with Adam is 1 GB: rank 0 peaked that much higher)."""
    import hashlib
    from typing import IO, cast

    import torch

    digest = hashlib.sha256()
    with atomic_writer(path) as fh:
        writer = _HashingWriter(fh, digest)
        try:  # torch.save only writes and flushes: the writer is a binary file to it
            torch.save(obj, cast(IO[bytes], writer))
        except RuntimeError as err:
            if writer.error is not None:  # torch reports a failed write as its own error:
                raise writer.error from err  # the OSError (a full disk) is what happened
            raise
    return digest.hexdigest()


class _HashingWriter:
    """A write-only file that feeds every byte to a hash on its way to the real file, and
    keeps the first OSError of a write (torch.save replaces it by a RuntimeError)."""

    def __init__(self, fh, digest):
        self.fh, self.digest, self.error = fh, digest, None

    def write(self, data) -> int:
        self.digest.update(data)
        try:
            return self.fh.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.fh.flush()


def append_jsonl(path: str | Path, record: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, new_file_mode(path))
    with os.fdopen(fd, "a") as fh:
        fh.write(json.dumps(record, sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(new: Path, target: Path) -> None:
    """Rename the complete `new` over `target`, keeping the old copy until the swap is done.

    rename(2) cannot replace a non-empty directory, so the old one is first renamed aside. A
    crash between the two renames leaves target absent but both copies on disk as siblings.
    """
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, old / target.name)
    try:
        os.replace(new, target)
    except BaseException:
        if old is not None:
            os.replace(old / target.name, target)
            old.rmdir()
        raise
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class PhaseClock:
    """Seconds per phase of a training step, added into a dict per phase key.

    CPU: the wall time of every step's phases. CUDA: a pair of CUDA events around each phase
    of every `sample_every`-th step (the second of each group, never the first step of an
    epoch, which carries one-off cuDNN autotuning), read when `settle()` is called (end of
    epoch, before a checkpoint) and scaled by steps / sampled steps. No torch.cuda.synchronize
    per phase, which stalls the launch queue (8 per step: -19% and -25% images/s on an H100;
    events measured -8% and -10% against no timing, within the spread between runs: README,
    Performance). On CUDA the phases are GPU time, estimated from the sampled steps; their
    sum can be below the wall time when the host is the bottleneck.
    """

    def __init__(self, device, sample_every: int = 16):
        self.cuda = getattr(device, "type", device) == "cuda"
        self.sample_every = sample_every
        self._steps = 0  # steps begun since the last settle()
        self._sampled = 0  # of which timed with events
        self._timing = not self.cuda
        self._pending: list = []  # (store, key, start event, end event), not yet read

    def step(self) -> None:
        """Call at the start of every step: decides whether CUDA events time this one."""
        if self.cuda:
            self._timing = self._steps % self.sample_every == min(1, self.sample_every - 1)
            self._sampled += self._timing
        self._steps += 1

    @contextmanager
    def phase(self, store: dict, key: str) -> Iterator[None]:
        if not self._timing:
            yield
            return
        if not self.cuda:
            start = time.perf_counter()
            yield
            store[key] = store.get(key, 0.0) + time.perf_counter() - start
            return
        import torch

        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        yield
        end.record()
        self._pending.append((store, key, begin, end))

    def settle(self) -> None:
        """Add the recorded CUDA intervals, scaled to all steps since the last settle."""
        if self._pending:
            self._pending[-1][3].synchronize()
            scale = self._steps / self._sampled
            for store, key, start, end in self._pending:
                store[key] = store.get(key, 0.0) + start.elapsed_time(end) / 1000.0 * scale
            self._pending.clear()
        self._steps = self._sampled = 0


# provenance's versions: the name each is recorded under -> the distribution that holds it
_DISTRIBUTIONS = {
    "torchvision": "torchvision",
    "submitit": "submitit",
    "snakemake": "snakemake",
    "numpy": "numpy",
    "sklearn": "scikit-learn",
    "yaml": "PyYAML",
    "tensorboard": "tensorboard",
}


def provenance() -> dict:
    """Where a result came from: code version, package versions, machine."""
    from importlib import metadata

    import torch

    versions: dict[str, str | None] = {"python": platform.python_version()}
    versions["torch"] = torch.__version__
    # the installed distributions' versions, read from their metadata: importing them to
    # ask (torchvision, snakemake, scikit-learn) cost a rank 1-2 s of start-up
    for name, dist in _DISTRIBUTIONS.items():
        try:
            versions[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:  # absence is information
            versions[name] = None
    return {
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "versions": versions,
        "host": socket.gethostname(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _git(*args: str) -> str | None:
    """stdout of a git command in this package's checkout; None outside one (or no git)."""
    try:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=10, cwd=Path(__file__).parent
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def git_dirty() -> bool | None:
    """True when the code differs from git_commit (uncommitted changes to tracked files)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status.strip())


def git_commit() -> str | None:
    return (_git("rev-parse", "HEAD") or "").strip() or None


def peak_rss_bytes() -> int:
    """This process's own peak resident memory: Linux's VmHWM. getrusage's ru_maxrss is not
    it: Linux carries the launching process's peak across exec (a rank started by a 1.5 GB
    process reports 1.5 GB however little it uses); elsewhere it is all there is."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_memory_mib() -> dict[str, float]:
    """This process's peaks so far, in MiB: resident memory (peak_rss_mib) and, once CUDA is
    in use, the GPU memory its tensors took (gpu_peak_alloc_mib): what ddpflow.checks.memory
    estimates before a run is queued."""
    peaks = {"peak_rss_mib": peak_rss_bytes() / 2**20}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        peaks["gpu_peak_alloc_mib"] = torch.cuda.max_memory_allocated() / 2**20
        peaks["gpu_peak_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
    return peaks
