"""Live progress of a training job where the user looks: each epoch line rank 0 appends to
the run's metrics.jsonl, printed in the terminal and the train rule's log as the launcher polls
the job, with the time left and the stragglers of the epoch.

    on_poll = EpochProgress(run, Path(paths.work) / LIVE_METRICS, stream)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ddpflow.monitoring.rankstats import stragglers
from ddpflow.task import run_task

log = logging.getLogger("ddpflow.pipeline")  # the rule's progress lines, as they always were


class EpochProgress:
    """Live progress in the rule's log and the terminal: each epoch line rank 0 appends to
    the run's metrics.jsonl in the work folder (a shared filesystem on a cluster), with an
    estimate of the time left, printed as the launcher polls the job."""

    def __init__(self, run: dict, metrics: Path, stream=None):
        self.run, self.metrics = run, metrics
        self.stream = stream  # ddpflow.tracking.live.LiveStream, or None
        # epochs already there are an earlier attempt's (a resumed attempt rewrites the file
        # with its history first): only later epochs are news
        self.last_epoch = max((r["epoch"] for r in self._records()), default=0)
        self.epoch_seconds: list[float] = []
        self.stragglers: set[int] = set()

    def _records(self) -> list[dict]:
        try:
            lines = self.metrics.read_text(errors="replace").splitlines()
        except OSError:
            return []
        records = []
        for line in lines:
            try:  # a line being written fails to parse: it is read at the next poll
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("epoch"), int):
                records.append(record)
        return records

    def __call__(self) -> None:
        for record in self._records():
            if record["epoch"] > self.last_epoch:
                self.last_epoch = record["epoch"]
                if self.stream is not None:
                    self.stream(record)  # to MLflow as it lands; never raises
                try:
                    self._log(record)
                except (KeyError, TypeError, ValueError):
                    continue

    def _log(self, record: dict) -> None:
        epochs, epoch = self.run["train"]["epochs"], record["epoch"]
        self.epoch_seconds.append(record["seconds"]["epoch"])
        mean = sum(self.epoch_seconds) / len(self.epoch_seconds)
        eta = mean * (epochs - epoch)
        selection = run_task(self.run).selection
        log.info(
            "run %r epoch %d/%d: train loss %.4f, %s %.4f, %.0f %s/s, %.1f s per epoch%s",
            self.run["name"],
            epoch,
            epochs,
            record["train_loss"],
            selection.label.replace("validation", "val"),
            record[selection.metric],
            record.get("tokens_per_s", record["samples_per_s"]),
            "tokens" if "tokens_per_s" in record else "samples",
            record["seconds"]["epoch"],
            f", about {eta:.0f} s left" if epoch < epochs else "",
        )
        margin = self.run["train"]["monitor"]["straggler_margin"]
        flagged = stragglers(record.get("ranks") or [], margin)
        for f in flagged:
            if f["rank"] not in self.stragglers:
                log.warning(
                    "run %r epoch %d: rank %d on %s is a straggler, the others wait for it (%s)",
                    self.run["name"],
                    epoch,
                    f["rank"],
                    f["host"],
                    f["reason"],
                )
        self.stragglers = {f["rank"] for f in flagged}
