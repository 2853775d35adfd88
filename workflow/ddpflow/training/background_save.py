"""Checkpoints that do not stop training (train.checkpoint.async): the state is copied off the
training tensors (into pinned host memory on a GPU), the training goes on, and the copy is
written by a background thread, committed atomically as a synchronous checkpoint is once
complete. At most one save is in flight: the next one, a stop signal and the job's end wait
for it. A crash while one is written leaves the checkpoint before it the newest: the .pt is
renamed into place only once whole, and its sha256 sidecar only after that.

    saves = BackgroundSaves()
    saves.start(lambda: write(snapshot(state)))   # returns at once
    saves.wait()                                    # before the next, a stop, the end
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


class BackgroundSaves:
    """One checkpoint write in flight at most, in a thread; its failure is raised by the
    next wait() (the training then fails as it would have at a synchronous save)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.waited_s: list[float] = []  # what each wait() blocked the training for

    def start(self, name: str, write: Callable[[], None]) -> None:
        """Run write() in the background (after any save in flight finished)."""
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as err:  # noqa: BLE001 - handed to the training thread
                why = f"{type(err).__name__}: {err}"
                log.warning("checkpoint %s was not written: %s", name, why)
                self._error = err

        # not a daemon: an interpreter ending with an exception still finishes the write
        self._thread = threading.Thread(target=run, name=f"checkpoint {name}")
        self._thread.start()

    def wait(self, raise_errors: bool = True) -> None:
        """Block until the save in flight is written; raise its error (if raise_errors)."""
        if self._thread is not None:
            started = time.perf_counter()
            self._thread.join()
            self.waited_s.append(time.perf_counter() - started)
            self._thread = None
        error, self._error = self._error, None
        if error is not None and raise_errors:
            raise RuntimeError(f"a background checkpoint failed: {error}") from error


def snapshot(value: Any) -> Any:
    """value with every tensor copied off the training's (to the CPU; pinned memory from a
    GPU, copied without blocking, synchronised once at the end) and its containers rebuilt:
    what the training changes next cannot reach the copy."""
    cuda = [False]
    copied = _copy(value, cuda)
    if cuda[0]:
        torch.cuda.synchronize()
    return copied


def _copy(value: Any, cuda: list[bool]) -> Any:
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        if tensor.device.type == "cuda":
            cuda[0] = True
            pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            return pinned.copy_(tensor, non_blocking=True)
        return tensor.clone()
    if isinstance(value, dict):
        return type(value)((key, _copy(item, cuda)) for key, item in value.items())
    if isinstance(value, list | tuple):
        return type(value)(_copy(item, cuda) for item in value)
    return value
