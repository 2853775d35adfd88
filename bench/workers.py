"""Start a benchmark's ranks as fresh processes and collect rank 0's result (shared by the
bench scripts; each runs `python <script> --worker <json config with its rank>`)."""

from __future__ import annotations

import json
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
