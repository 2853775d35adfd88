"""Shared by the bench scripts: start a benchmark's ranks as fresh processes and collect
rank 0's result. Each rank runs `python <script> --worker <json config with its rank>`; the
driver gives the config a free port on 127.0.0.1, a temporary folder ("work") and the file
rank 0 answers in ("result_file"). Lightning's ranks alone get bench/.peers-site."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

PEERS_SITE = Path(__file__).resolve().parent / ".peers-site"  # bench/install-peers
WORKER_TIMEOUT_S = 1800


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(script: str, cfg: dict, timeout_s: float = WORKER_TIMEOUT_S, env: dict | None = None):
    """cfg["world_size"] fresh workers of `script` with a free port and a temporary folder of
    their own; the JSON rank 0 answered (answer())."""
    with tempfile.TemporaryDirectory(prefix="ddpflow-bench-") as tmp:
        cfg = {**cfg, "port": free_port(), "result_file": f"{tmp}/result.json", "work": tmp}
        return spawn_ranks(script, cfg, timeout_s, env)


def answer(cfg: dict, result) -> int:
    """A worker's result back to the driver: rank 0 writes it. Returns 0 (the worker's exit)."""
    if cfg["rank"] == 0:
        Path(cfg["result_file"]).write_text(json.dumps(result))
    return 0


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
