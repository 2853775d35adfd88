"""Shared by the bench scripts: start a benchmark's ranks as fresh processes and collect
rank 0's result (each runs `python <script> --worker <json config with its rank>`), and
describe the machine a result was measured on."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path


def spawn_ranks(script: str, cfg: dict, timeout_s: float):
    """Run cfg["world_size"] workers of `script`; return the JSON rank 0 wrote to
    cfg["result_file"]. A worker that fails or outlives timeout_s fails the benchmark."""
    procs = [
        subprocess.Popen([sys.executable, script, "--worker", json.dumps({**cfg, "rank": rank})])
        for rank in range(cfg["world_size"])
    ]
    try:
        codes = [proc.wait(timeout=timeout_s) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if any(codes):
        raise RuntimeError(f"benchmark workers failed with exit codes {codes}")
    return json.loads(Path(cfg["result_file"]).read_text())


def machine_info() -> dict:
    """What a measurement depends on: host, CPU model and count, platform, devices, load."""
    import torch

    cpu_model = platform.processor()
    try:
        text = Path("/proc/cpuinfo").read_text()
        cpu_model = next(ln.split(":", 1)[1].strip() for ln in text.splitlines()
                         if ln.startswith("model name"))  # fmt: skip
    except (OSError, StopIteration):
        pass
    info = {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    if hasattr(os, "getloadavg"):  # a busy machine explains noisy CPU numbers
        info["loadavg_at_start"] = os.getloadavg()
    return info
