"""What this machine has, probed without importing torch: the GPUs a local rank may use,
the first one's memory, whether the CPU has bf16 instructions. The local launcher's checks
(values.py) and the memory estimate (early.py) read them at parse time."""

from __future__ import annotations

import functools
import os
import subprocess
from importlib.metadata import version as package_version
from pathlib import Path


def local_gpu_count() -> int:
    """GPUs a process here may use: CUDA_VISIBLE_DEVICES when set, else the NVIDIA device
    files (/dev/nvidia0, ...: what a container is given), else the driver's list."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    devices = [p for p in Path("/dev").glob("nvidia*") if p.name[len("nvidia") :].isdigit()]
    if devices:
        return len(devices)
    driver = Path("/proc/driver/nvidia/gpus")
    return len(list(driver.iterdir())) if driver.is_dir() else 0


@functools.cache
def local_gpu_memory_bytes() -> int | None:
    """The memory of the first GPU a local rank gets (the first of CUDA_VISIBLE_DEVICES, an
    index or UUID), from nvidia-smi without importing torch; None where it cannot be read.
    (A MIG slice reads as its whole GPU.)"""
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", first]
    try:
        done = subprocess.run(query, capture_output=True, text=True, timeout=30)
        return int(float(done.stdout.split()[0]) * 2**20) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def cpu_computes_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this machine's CPU has bf16 instructions (read without importing torch;
    the ranks ask oneDNN itself, build.cpu_has_native_bf16). True where unknown."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return True
    flags = next((line for line in text.splitlines() if line.startswith("flags")), None)
    return flags is None or bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


def check_output_folders(config: dict) -> None:
    """results_dir and logs_dir can be made and written here, before Snakemake lists their
    files (a path below a regular file, in /proc or without permission otherwise ends in
    Snakemake's own tracebacks). Nothing is created: the nearest folder that exists must be
    a folder this user can write."""
    from ddpflow.config.schema import ConfigError

    for key in ("results_dir", "logs_dir"):
        folder = Path(config[key]).expanduser().absolute()
        why = _unwritable(folder)
        if why:
            raise ConfigError(
                f"{key} {config[key]!r} cannot be created or written here ({why}); set "
                f"{key} to a folder you can write (a relative path is below the working "
                "directory)"
            )


def check_run_folders(results_dir: str, names) -> None:
    """Each run's folder that exists, and the files in it, can be written: a rerun replaces
    them and first keeps the finished ones aside (ddpflow.kept); an immutable or read-only
    one is refused here, naming it, not met as a traceback once the workflow started."""
    from ddpflow.config.schema import ConfigError
    from ddpflow.paths import run_dir

    for name in names:
        folder = run_dir(results_dir, name)
        if not folder.is_dir():
            continue
        stuck = [p for p in (folder, *folder.iterdir()) if not os.access(p, os.W_OK)]
        if stuck:
            raise ConfigError(
                f"run {name!r}: {stuck[0]} cannot be written by this user (read-only or "
                "immutable: `ls -ld` and `lsattr -d` say which), so its outputs could be "
                "neither redone nor kept aside for a failed rerun; make it writable again, "
                "or set results_dir to another folder"
            )


def _unwritable(folder: Path) -> str | None:
    """Why `folder` cannot be made or written (None: it can)."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if existing.is_relative_to("/proc") or existing.is_relative_to("/sys"):
        return f"{existing} is the kernel's, not a folder for files"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user"
    return None


def missing_data(run: dict) -> list[str]:
    """A run's own data that is not where the config says (found here, on the login node,
    not inside a staging job and its retry)."""
    data, source = run["data"], run["data"]["source"]
    key = "root" if source == "image_folder" else "path"
    if source not in ("image_folder", "npz", "text", "tokens"):
        return []
    where = f"run {run['name']!r}: data.{key}"
    if not data[key]:
        return [f"{where} is required for data.source {source}"]
    if Path(data[key]).expanduser().exists():
        return []
    return [
        f"{where} {data[key]}: no such file or folder here (a relative path is read from the "
        f"working directory, {Path.cwd()}); fix the path"
    ]


@functools.cache
def version(package: str) -> str:
    """An installed package's version, read once (a sweep asks it for every run)."""
    return package_version(package)


def user_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ddpflow"
