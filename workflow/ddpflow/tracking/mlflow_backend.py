"""Log a RunRecord to MLflow: a tracking server (http://, https://) or a sqlite database
(sqlite:///path, no server). MLflow's file store (a folder, file:) is deprecated since 3.x
and refused by ddpflow.config.

    entry = log_run(record, "http://mlflow.site:5000", "ddpflow")
    # {"uri", "experiment", "experiment_id", "run_id", "url", "identity", "superseded"}

Idempotent through the tracker itself: a run of this experiment tagged with the same
ddpflow.run and ddpflow.identity is the one returned, nothing is logged again; every other
run of the same ddpflow.run is tagged ddpflow.superseded=true (a retrained run).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

from ddpflow.errors import UserError
from ddpflow.words import counted

log = logging.getLogger(__name__)

IDENTITY_TAG = "ddpflow.identity"
RUN_TAG = "ddpflow.run"
SUPERSEDED_TAG = "ddpflow.superseded"
LIVE_TAG = "ddpflow.live"  # a run the train rule streamed epochs to (ddpflow.tracking.live)
TRAINING_TAG = "ddpflow.training"  # the training it streamed (live.training_key)


class TrackerUnreachable(UserError):
    """The tracker could not be reached or refused the run: the message names URI and cause."""


def probe(uri: str, timeout: float = 10.0) -> None:
    """A server that does not answer fails in seconds, naming the URI (MLflow's own client
    retries for minutes first)."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        return
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname, port), timeout=timeout).close()
    except OSError as exc:
        raise TrackerUnreachable(
            f"MLflow tracking server {uri} cannot be reached: {type(exc).__name__}: {exc}"
        ) from None


def run_url(uri: str, experiment_id: str, run_id: str) -> str | None:
    """The run's page in the MLflow UI (a server), or None (sqlite: `mlflow ui` shows it)."""
    if urlparse(uri).scheme in ("http", "https"):
        return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
    return None


def experiment_id_of(client, uri: str, name: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    artifacts = None
    if uri.startswith("sqlite:///"):  # beside the database, not ./mlruns of the cwd
        db = Path(uri.removeprefix("sqlite:///")).resolve()
        artifacts = (db.parent / f"{db.stem}-artifacts").as_uri()
    return client.create_experiment(name, artifact_location=artifacts)


def _log(client, run_id: str, record, streamed=()) -> None:
    """Params, metrics (less the epochs streamed already), artifacts."""
    from mlflow.entities import Metric, Param

    now = int(time.time() * 1000)
    metrics = [
        Metric(key, value, now, step) for key, value, step in record.metrics if step not in streamed
    ]
    metrics += [Metric(key, value, now, 0) for key, value in record.final.items()]
    params = [Param(key, value) for key, value in sorted(record.params.items())]
    # log_batch: at most 1000 metrics, 100 params, 100 tags per call
    for start in range(0, len(params), 100):
        client.log_batch(run_id, params=params[start : start + 100])
    for start in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[start : start + 1000])
    for path in record.artifacts:
        client.log_artifact(run_id, str(path), "plots" if path.parent.name == "plots" else None)


def _live_run(client, live: dict | None, uri: str, experiment: str) -> str | None:
    """The streamed run to complete: this destination's, still running."""
    if not live or live.get("uri") != uri or live.get("experiment") != experiment:
        return None
    try:
        found = client.get_run(live["run_id"])
    except Exception:  # noqa: BLE001 - deleted, or another database: open a new run
        return None
    return live["run_id"] if found.info.status == "RUNNING" else None


def log_run(record, uri: str, experiment: str, live: dict | None = None) -> dict:
    """Log the run (or find it logged already); returns its tracking.json entry. live: the
    state of the run the train rule streamed this training's epochs to (ddpflow.tracking.live),
    which is completed rather than a new one opened."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
    probe(uri)
    try:
        return _log_run(record, uri, experiment, live)
    except TrackerUnreachable:
        raise
    except Exception as exc:  # any client failure: name the URI and cause
        first = (str(exc).strip().splitlines() or [""])[0][:500]
        raise TrackerUnreachable(
            f"MLflow at {uri} (experiment {experiment!r}) failed: {type(exc).__name__}: {first}"
        ) from exc


def _log_new(client, experiment_id, record, identity: str, live, uri: str, experiment: str) -> str:
    """A new MLflow run for this result (or the live run its epochs were streamed to while
    it trained), with every figure, param, tag and artifact; FAILED if logging breaks."""
    named = {RUN_TAG: record.name, IDENTITY_TAG: identity, "mlflow.runName": record.name}
    tags = {**record.tags, **named}
    adopted = _live_run(client, live, uri, experiment)
    if adopted:  # the run its epochs were streamed to while it trained
        run_id, streamed = adopted, set(live["epochs"])
        for key, value in tags.items():
            client.set_tag(run_id, key, value)
    else:
        run_id, streamed = client.create_run(experiment_id, tags=tags).info.run_id, set()
    try:
        _log(client, run_id, record, streamed)
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")
    points = counted(len(record.metrics) + len(record.final), "metric point")
    params = counted(len(record.params), "param")
    artifacts = counted(len(record.artifacts), "artifact")
    logged = f"{points}, {params}, {artifacts}"
    log.info("MLflow %s: run %r logged as %s (%s)", uri, record.name, run_id, logged)
    return run_id


def _supersede(client, mine, run_id: str, uri: str) -> list[str]:
    """Tag the run's earlier MLflow runs (older results) as superseded by run_id."""
    superseded = []
    for old in mine:
        if old.info.run_id != run_id and old.data.tags.get(SUPERSEDED_TAG) != "true":
            client.set_tag(old.info.run_id, SUPERSEDED_TAG, "true")
            client.set_tag(old.info.run_id, "ddpflow.superseded_by", run_id)
            superseded.append(old.info.run_id)
    if superseded:
        log.info("MLflow %s: tagged %s=true on %s", uri, SUPERSEDED_TAG, ", ".join(superseded))
    return superseded


def _log_run(record, uri: str, experiment: str, live: dict | None) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment_id = experiment_id_of(client, uri, experiment)
    identity = json.dumps(record.identity, sort_keys=True)
    mine = client.search_runs(
        [experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{record.name}'", max_results=1000
    )
    same = [
        r for r in mine if r.data.tags.get(IDENTITY_TAG) == identity and r.info.status == "FINISHED"
    ]
    if same:
        run_id = same[0].info.run_id
        log.info("MLflow %s: run %r already logged as %s: nothing logged", uri, record.name, run_id)
    else:
        run_id = _log_new(client, experiment_id, record, identity, live, uri, experiment)
    superseded = _supersede(client, mine, run_id, uri)
    return {
        "uri": uri,
        "experiment": experiment,
        "experiment_id": experiment_id,
        "run_id": run_id,
        "url": run_url(uri, experiment_id, run_id),
        # no server: the UI on this machine shows it (sqlite:///<relative> from this folder)
        "view": None
        if run_url(uri, experiment_id, run_id)
        else f"mlflow ui --backend-store-uri {uri}",
        "identity": record.identity,
        "superseded": superseded,
        "logged_now": not same,
    }
