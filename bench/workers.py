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

PEERS_SITE = Path(__file__).resolve().parent / ".peers-site"  # bench/install-peers


def peers_env() -> dict:
    """This environment with bench/.peers-site (Lightning) first on PYTHONPATH: given to the
    Lightning processes alone, so ddpflow and the raw loop never import it."""
    path = os.pathsep.join(p for p in (str(PEERS_SITE), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def lightning_version() -> str | None:
    """Lightning's version as the Lightning processes see it, None when it cannot be imported
    (bench/install-peers not run, or failed)."""
    code = "import lightning; print(lightning.__version__)"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=peers_env()
    )
    return proc.stdout.strip() if proc.returncode == 0 else None


def spawn_ranks(script: str, cfg: dict, timeout_s: float, env: dict | None = None):
    """Run cfg["world_size"] workers of `script`; return the JSON rank 0 wrote to
    cfg["result_file"]. A worker that fails or outlives timeout_s fails the benchmark."""
    procs = [
        subprocess.Popen(
            [sys.executable, script, "--worker", json.dumps({**cfg, "rank": rank})], env=env
        )
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
