"""Fault injection for tests and fire drills (never active unless DDPFLOW_FAULT is set).

DDPFLOW_FAULT="<kind>:<rank>[,<rank>...]:<epoch>:<step>" makes those ranks fail at that
(0-based) epoch and micro-step: kind `raise` (a Python exception), `kill` (SIGKILL itself,
like an OOM kill or a lost node) or `hang` (stop making progress, like a stuck NCCL call). Optional
DDPFLOW_FAULT_ONCE=<file>: fire only if the file does not exist yet, and create it, so that
a resumed attempt runs clean.

DDPFLOW_SLOW="<rank>[,<rank>...]:<seconds>" makes those ranks sleep that long before every
micro-step: a straggler (a slow node, a throttled GPU) for the monitor's detection to find.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """Raised by the `raise` fault."""


def parse(spec: str | None) -> tuple[str, tuple[int, ...], int, int] | None:
    """'kill:2,3:1:5' -> ('kill', (2, 3), 1, 5): several ranks fail at once (a whole node)."""
    if not spec:
        return None
    kind, ranks, epoch, step = spec.split(":")
    if kind not in ("raise", "kill", "hang"):
        raise ValueError(f"DDPFLOW_FAULT: unknown kind {kind!r} (raise, kill, hang)")
    return kind, tuple(int(r) for r in ranks.split(",")), int(epoch), int(step)


def maybe_inject(rank: int, epoch: int, step: int) -> None:
    fault = parse(os.environ.get("DDPFLOW_FAULT"))
    if fault is None or rank not in fault[1] or fault[2:] != (epoch, step):
        return
    if not _first_time():
        return
    kind = fault[0]
    log.error("injecting fault %r on rank %d at epoch %d step %d", kind, rank, epoch, step)
    if kind == "raise":
        raise InjectedFault(f"injected fault on rank {rank} at epoch {epoch} step {step}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # hang
        time.sleep(60)


_slow_cache: tuple[str | None, float] = (None, 0.0)


def slow_seconds(rank: int) -> float:
    """The pause DDPFLOW_SLOW gives this rank before each micro-step (0: none)."""
    global _slow_cache
    spec = os.environ.get("DDPFLOW_SLOW")
    if spec != _slow_cache[0]:
        seconds = 0.0
        if spec:
            ranks, value = spec.split(":")
            if rank in {int(r) for r in ranks.split(",")}:
                seconds = float(value)
        _slow_cache = (spec, seconds)
    return _slow_cache[1]


def _first_time() -> bool:
    marker = os.environ.get("DDPFLOW_FAULT_ONCE")
    if not marker:
        return True
    try:
        Path(marker).touch(exist_ok=False)
    except FileExistsError:
        return False
    return True
