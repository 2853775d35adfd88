"""A rank's start-up, as train_summary.json's "startup" records it: the rendezvous (the store
and the process group), when the group was up and when the first optimizer step was done
(epoch seconds, so that a benchmark can set them against the job's submission), and each
checkpoint save's seconds. bench/slurm_scale.py reads it at 1 to 16 nodes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# one rank task per process: this process's start-up so far
STARTUP: dict[str, float] = {}


def timed_rendezvous(init: Callable[[], Any]) -> None:
    """init() (distenv.init_process_group), timed."""
    started = time.perf_counter()
    init()
    STARTUP["rendezvous_s"] = time.perf_counter() - started
    STARTUP["group_up_at"] = time.time()


def noting_the_first_step(on_step: Callable[[Any], None]) -> Callable[[Any], None]:
    """on_step, which first notes when this rank finished its first optimizer step."""

    def noted(loop: Any) -> None:
        STARTUP.setdefault("first_step_at", time.time())
        on_step(loop)

    return noted


def record(checkpoint_save_s: list[float]) -> dict[str, Any]:
    """train_summary.json's "startup"."""
    return {**STARTUP, "checkpoint_save_s": list(checkpoint_save_s)}
