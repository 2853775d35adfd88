"""What every benchmark in bench/ does around its measurement: the machine it ran on, the
software, when it started, the load before and after, the JSON it writes (bench/results/
and docs/gen_performance.py read it) and the Markdown table it prints.

    report = harness.head("what is measured", conditions={...})
    ...                                          # measure, fill report
    return harness.write(report, args.out, wall_since=start)

A result's head always has the same keys ("benchmark", "started", "machine", "provenance",
and "conditions" where the benchmark states them), so the performance page reads every file
alike. Torch is imported only to list the GPUs, and not at all with machine(devices=False)
(the login-node benchmarks).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import time
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from ddpflow import runtime

OUT = Path(__file__).resolve().parent / "out"  # bench/run's default; results/ holds copies


def parser(doc: str, out: str | None, *, worker: bool = False) -> argparse.ArgumentParser:
    """The benchmark's options: its docstring's first paragraph as the description, --out
    (default bench/out/`out`; none when `out` is None) and, for a benchmark with ranks, the
    hidden --worker option its rank processes get (workers.launch)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    default = OUT / out if out else None
    p.add_argument("--out", type=Path, default=default, help=f"the JSON (default {default})")
    if worker:
        p.add_argument("--worker", type=json.loads, default=None, help=argparse.SUPPRESS)
    return p


def now() -> str:
    """The UTC time to the second, ISO 8601: a result's "started"."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages: a busy machine explains noisy numbers."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    models = (ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
    return next(models, platform.processor())


def machine(*, devices: bool = True, **extra) -> dict:
    """What a measurement depends on: host, CPU model and count, platform, Python, torch and
    its GPUs, the load at start. devices=False: torch's installed version, no import, no GPU
    listed (login-node benchmarks)."""
    if devices:
        import torch

        version = torch.__version__
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    else:
        version, gpus = metadata.version("torch"), []
    info = {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": version,
        "cuda_devices": gpus,
    }
    if (load := loadavg()) is not None:
        info["loadavg_at_start"] = load
    return {**info, **extra}


def head(benchmark: str, *, devices: bool = True, **fields) -> dict:
    """A result's first keys: what it measures, when, on which machine, with which code and
    versions; `fields` (conditions, ...) follow in the order given."""
    return {
        "benchmark": benchmark,
        "started": now(),
        "machine": machine(devices=devices),
        "provenance": runtime.provenance(),
        **fields,
    }


def write(report: dict, out: Path | str, *, wall_since: float | None = None, indent=2) -> int:
    """Write `report` as JSON to `out` (its folder made), with "wall_s" since the
    perf_counter() reading `wall_since` when given; say where and how long it took. Returns 0
    (main's exit status)."""
    out = Path(out)
    if wall_since is not None:
        report["wall_s"] = time.perf_counter() - wall_since
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=indent) + "\n")
    took = f" ({report['wall_s']:.0f} s)" if "wall_s" in report else ""
    print(f"wrote {out}{took}", flush=True)
    return 0


def markdown_table(
    header: Iterable[object], rows: Iterable[Iterable[object]], *, rule: str = "---"
) -> str:
    """A Markdown table: one header row, its rule ("--:" aligns numbers right), a row per
    item (cells as str())."""
    header = [str(h) for h in header]
    lines = ["| " + " | ".join(header) + " |", "|" + f"{rule}|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
