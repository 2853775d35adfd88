"""Rank 0's progress within an epoch, where the user looks: a tqdm bar on a terminal, whole
log lines in a rank's log file.

    fit(loop, on_epoch, progress_bar(run, env))
"""

from __future__ import annotations

import logging
import sys
import time

from ddpflow.cluster.distenv import DistEnv
from ddpflow.config.typed import RunSpec

log = logging.getLogger(__name__)


def progress_bar(run: RunSpec, env: DistEnv):
    """Rank 0's progress within an epoch: a tqdm bar on a terminal; in a log file (a
    submitit or Slurm rank log is never a terminal) whole lines instead, since a bar's
    carriage returns would glue the next log line onto it."""
    if not (env.is_master and run.train.progress):
        return None

    def factory(loop):
        total = loop.micro_batches_per_epoch
        desc = f"epoch {loop.epoch + 1}"
        if not sys.stderr.isatty():
            return LineProgress(total, desc)
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="step", mininterval=2.0, leave=False)

    return factory


class LineProgress:
    """The tqdm calls the loop makes (update, close), as one log line at most every
    `interval` seconds: "epoch 2: step 120/400 (30%), 41.2 step/s, ~7 s left"."""

    def __init__(self, total: int, desc: str, interval: float = 10.0):
        self.total, self.desc, self.interval = total, desc, interval
        self.done = 0
        self.start = self.last = time.monotonic()
        # steps done when counting began (a resumed epoch starts mid-way)
        self.first: int | None = None

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.first is None:  # the loop's first call passes the steps already done
            self.first = n
            return
        now = time.monotonic()
        if now - self.last >= self.interval and self.done < self.total:
            self.last = now
            rate = (self.done - self.first) / max(now - self.start, 1e-9)
            left = (self.total - self.done) / rate if rate > 0 else float("nan")
            log.info(
                "%s: step %d/%d (%d%%), %.1f step/s, ~%.0f s left",
                self.desc,
                self.done,
                self.total,
                100 * self.done // max(self.total, 1),
                rate,
                left,
            )

    def close(self) -> None:
        pass
