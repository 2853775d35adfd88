"""bench/throughput.py runs end to end in a tiny configuration and writes complete JSON.

Speed is measured by the benchmarks and never asserted here: only that the numbers exist.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

from workflow_helpers import REPO


def test_throughput_tiny_run_writes_complete_json(tmp_path):
    out = tmp_path / "throughput.json"
    cmd = [
        sys.executable,
        str(REPO / "bench" / "throughput.py"),
        "--cases",
        "mlp",
        "--world-sizes",
        "1",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--samples-scale",
        "0.01",
        "--out",
        str(out),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "speedup" in result.stdout

    report = json.loads(out.read_text())
    assert {"hostname", "cpu_model", "cpu_count"} <= set(report["machine"])
    assert {"torch", "python"} <= set(report["provenance"]["versions"])
    assert report["conditions"]["repeats"] == 1
    assert report["conditions"]["warmup_epochs"] == 0
    (row,) = report["runs"]
    assert (row["name"], row["world_size"], row["batch"], row["threads"]) == ("mlp", 1, 32, 1)
    assert row["samples"] % row["batch"] == 0
    for loop in ("raw", "ddpflow"):
        assert len(row[loop]["all"]) == 1
        assert math.isfinite(row[loop]["samples_per_s"])
    assert set(row["ddpflow"]["phase_seconds_per_step"]) >= {"data", "forward", "optimizer"}
    assert math.isfinite(row["speedup"])
    assert row["train_flops_per_sample"] > 0
