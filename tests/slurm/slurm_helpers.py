"""Helpers the Slurm tests share: job ids from submitit's log folder, sacct polled to a
terminal state (sacct lags squeue by a few seconds). Every wait is bounded."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def job_ids(folder: Path) -> list[str]:
    """The Slurm job ids submitit logged into folder (<jobid>_<task>_log.out)."""
    return sorted({p.name.split("_")[0] for p in Path(folder).glob("*_0_log.out")})


def sacct_state(job_id: str, timeout: float = 60) -> str:
    """The job's terminal state ("CANCELLED by 0" -> CANCELLED); fails after `timeout`. A job
    that Slurm resized (a node taken away under --no-kill) has a RESIZING record before its
    last: the last one is its state."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.splitlines()
        state = out[-1].split()[0] if out and out[-1].strip() else ""
        if state in TERMINAL:
            return state
        time.sleep(1)
    pytest.fail(f"job {job_id} not terminal after {timeout}s (last sacct state {state!r})")


def job_story(job_id: str, folder: Path | None = None, tail: int = 1500) -> str:
    """What to print when a job ended in an unexpected state: every step's state and exit
    code from sacct, and the end of each task's submitit logs."""
    steps = subprocess.run(
        ["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,State,ExitCode,DerivedExitCode,Elapsed"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    story = [f"sacct -j {job_id}:\n{steps}"]
    for log in sorted(Path(folder).glob(f"{job_id}_*_log.*")) if folder else []:
        story.append(f"--- {log.name}:\n{log.read_text(errors='replace')[-tail:]}")
    return "\n".join(story)
