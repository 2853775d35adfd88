"""Epochs streamed to MLflow while the ranks train, so that its UI shows the curves grow.

The train rule already polls rank 0's epoch lines (results/work/<run>/metrics.jsonl) on the
login node for its progress lines (ddpflow.pipeline.EpochProgress); with tracking.mlflow.uri
set, each new epoch line is also logged, as step metrics, to an MLflow run opened at the
first epoch (status RUNNING, tag ddpflow.live=true). The track rule later adopts that run:
it adds the params, the epochs it lacks, the final figures, the artifacts and the tags, and
ends it (mlflow_backend), so a run streamed live is still one tracker run with one point
per epoch. Streaming never fails the training: a tracker that cannot be reached is said
once in the rule's log, and the track rule logs the whole run after evaluation.

    stream = LiveStream(run, tracking, work)   # None where tracking.mlflow.uri is unset
    stream(epoch_line)                         # at each new epoch line
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from ddpflow.config.fingerprint import config_hash, training_fingerprint
from ddpflow.paths import LIVE_TRACKING
from ddpflow.runtime import atomic_write_json

log = logging.getLogger(__name__)


def training_key(run: dict) -> str:
    """Which training a live run streams: the run's training fingerprint, hashed."""
    return config_hash(training_fingerprint(run))


def live_state(work: str | Path) -> dict:
    """The live run's state ({} where none): uri, experiment, training, run_id, epochs."""
    try:
        state = json.loads((Path(work) / LIVE_TRACKING).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


class LiveStream:
    def __init__(self, run: dict, tracking: dict, work: str | Path):
        self.name = run["name"]
        self.uri = tracking["mlflow"]["uri"]
        self.experiment = tracking["mlflow"]["experiment"]
        self.training = training_key(run)
        self.state_file = Path(work) / LIVE_TRACKING
        self.stopped = False
        self.client: Any = None  # MlflowClient, made on first use (mlflow is optional)

    @classmethod
    def for_run(cls, run: dict, tracking: dict | None, work) -> LiveStream | None:
        if not tracking or not (tracking.get("mlflow") or {}).get("uri"):
            return None
        return cls(run, tracking, work)

    def __call__(self, line: dict) -> None:
        if self.stopped:
            return
        try:
            self._log(line)
        except Exception as exc:  # noqa: BLE001 - streaming must never fail the training
            self.stopped = True
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            log.warning(
                "run %r: streaming epochs to MLflow at %s stopped (%s: %s); the track rule "
                "logs the whole run once it is evaluated",
                self.name,
                self.uri,
                type(exc).__name__,
                first,
            )

    def _state(self) -> dict:
        state = live_state(self.state_file.parent)
        same = {"uri": self.uri, "experiment": self.experiment, "training": self.training}
        if state and all(state.get(k) == v for k, v in same.items()):
            return state
        from ddpflow.tracking import mlflow_backend

        mlflow_backend.probe(self.uri)
        client = self._client()
        experiment_id = mlflow_backend.experiment_id_of(client, self.uri, self.experiment)
        tags = {
            mlflow_backend.RUN_TAG: self.name,
            mlflow_backend.LIVE_TAG: "true",
            mlflow_backend.TRAINING_TAG: self.training,
        }
        created = client.create_run(experiment_id, tags=tags, run_name=self.name)
        state = {
            **same,
            "experiment_id": experiment_id,
            "run_id": created.info.run_id,
            "epochs": [],
        }
        atomic_write_json(self.state_file, state)
        log.info(
            "run %r: streaming its epochs to MLflow %s, run %s",
            self.name,
            self.uri,
            created.info.run_id,
        )
        return state

    def _client(self):
        if self.client is None:
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=self.uri)
        return self.client

    def _log(self, line: dict) -> None:
        from mlflow.entities import Metric

        from ddpflow.tracking.record import epoch_metrics

        state = self._state()
        if line["epoch"] in state["epochs"]:
            return
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v, step in epoch_metrics([line])]
        self._client().log_batch(state["run_id"], metrics=metrics)
        state["epochs"] = sorted({*state["epochs"], line["epoch"]})
        atomic_write_json(self.state_file, state)
