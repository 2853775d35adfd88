"""What this machine has, probed without importing torch: the GPUs a local rank may use,
the first one's memory, whether the CPU has bf16 instructions. The local launcher's checks
(values.py) and the memory estimate (early.py) read them at parse time."""

from __future__ import annotations

import functools
import os
import subprocess
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
