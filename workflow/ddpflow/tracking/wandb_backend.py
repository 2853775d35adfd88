"""Log a RunRecord to Weights & Biases: offline (a run folder under results/wandb, to upload
from a machine with internet: `wandb sync <folder>`) or online.

    entry = log_run(record, "offline", "ddpflow", None, "results/wandb", previous)

An offline run cannot be changed once written: a retrained run is a new W&B run whose
config names the one it supersedes (ddpflow.supersedes), and tracking.json lists it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ddpflow.tracking.mlflow_backend import TrackerUnreachable

log = logging.getLogger(__name__)


def _log(wandb, run, record) -> None:
    """Every epoch's figures as one step each, the final figures in the summary, the run's
    files as one artifact."""
    steps: dict[int, dict] = {}
    for key, value, step in record.metrics:
        steps.setdefault(step, {})[key] = value
    for step in sorted(steps):
        run.log({**steps[step], "epoch": step}, step=step)
    for key, value in record.final.items():
        run.summary[key] = value
    artifact = wandb.Artifact(f"{record.name}-files", type="ddpflow-run")
    for path in record.artifacts:
        name = f"plots/{path.name}" if path.parent.name == "plots" else path.name
        artifact.add_file(str(path), name=name)
    run.log_artifact(artifact)


def _init(wandb, record, mode: str, project: str, entity, root: Path, previous):
    """A new W&B run holding the run's config (and the run it supersedes); a failure names
    the destination and the cause."""
    config = {**record.config, "ddpflow": {"identity": record.identity, **record.tags}}
    if previous and previous.get("run_id"):
        config["ddpflow"]["supersedes"] = previous["run_id"]
    try:
        return wandb.init(
            project=project,
            entity=entity,
            name=record.name,
            mode=mode,
            dir=str(root),
            config=config,
            tags=[f"{k}={v}"[:64] for k, v in record.tags.items()],
            reinit="create_new",
        )
    except Exception as exc:  # name the destination and the cause
        first = (str(exc).strip().splitlines() or [""])[0][:500]
        raise TrackerUnreachable(
            f"W&B ({mode}, project {project!r}) failed: {type(exc).__name__}: {first}"
        ) from exc


def log_run(record, mode: str, project: str, entity: str | None, root, previous=None) -> dict:
    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ["WANDB_DIR"] = str(root)
    if mode == "offline":
        os.environ["WANDB_MODE"] = "offline"
    import wandb

    run = _init(wandb, record, mode, project, entity, root, previous)
    try:
        _log(wandb, run, record)
        run_id, url = run.id, run.url
        run_dir = Path(run.dir).parent  # <root>/wandb/offline-run-<time>-<id>
    finally:
        run.finish()
    entry = {
        "mode": mode,
        "project": project,
        "entity": entity,
        "run_id": run_id,
        "identity": record.identity,
        "logged_now": True,
        "superseded": [previous["run_id"]] if previous and previous.get("run_id") else [],
    }
    if mode == "offline":
        entry.update(dir=str(run_dir), url=None, sync=f"wandb sync {run_dir}")
    else:
        entry.update(url=url)
    log.info(
        "W&B %s: run %r logged as %s (%s)",
        mode,
        record.name,
        run_id,
        entry.get("url") or entry.get("sync"),
    )
    return entry
