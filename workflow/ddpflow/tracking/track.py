"""The track rule's function: log one run to every tracker `tracking:` enables and write
results/runs/<run>/tracking.json (run id and URL per tracker; the report shows them).

Nothing is logged twice: a tracker whose last entry (kept in the work folder too, which
Snakemake's removal of a rerun job's outputs does not touch) records this destination and
this run identity (model + evaluation, record.identity) is not called again; MLflow is
also asked itself (mlflow_backend). A tracker that cannot be reached fails the rule, naming
the URI and the cause, after the others were logged; the failure is kept in the work
folder (tracking_failed.json) for the report, which still calls the run finished.
"""

from __future__ import annotations

import json
import logging
import socket
import tempfile
import time
from pathlib import Path

from ddpflow.errors import UserError
from ddpflow.paths import LIVE_TRACKING, TRACKING_FAILED, TRACKING_FILE
from ddpflow.runtime import atomic_write_json

log = logging.getLogger(__name__)


def enabled_trackers(tracking: dict) -> list[str]:
    out = []
    if (tracking.get("mlflow") or {}).get("uri"):
        out.append("mlflow")
    if (tracking.get("wandb") or {}).get("mode", "off") not in ("off", False, None):
        out.append("wandb")
    return out


def destination(name: str, tracking: dict) -> dict:
    """Where a tracker logs to: another destination is logged to afresh."""
    if name == "mlflow":
        return {"uri": tracking["mlflow"]["uri"], "experiment": tracking["mlflow"]["experiment"]}
    wandb = tracking["wandb"]
    return {"mode": wandb["mode"], "project": wandb["project"], "entity": wandb["entity"]}


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_failure(work: str | Path) -> dict | None:
    """The last track rule's failure of this run, or None (ddpflow.report.outcome)."""
    record = read_json(Path(work) / TRACKING_FAILED)
    return record if "cause" in record else None


def _same(entry: dict | None, name: str, tracking: dict, identity: dict) -> bool:
    if not entry or entry.get("identity") != identity:
        return False
    return all(entry.get(k) == v for k, v in destination(name, tracking).items())


def track_run(run: dict, paths, tracking: dict, out: str, results_dir: str, log_file=None):
    """Log the run to each enabled tracker; write `out` (tracking.json) and its work copy."""
    from ddpflow.tracking.record import collect

    work = Path(paths.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / TRACKING_FAILED).unlink(missing_ok=True)
    previous = read_json(work / TRACKING_FILE).get("trackers", {})
    trackers = dict(previous)
    failures = []
    with tempfile.TemporaryDirectory(prefix="ddpflow-track-") as tmp:
        record = collect(run, paths, tmp)
        for name in enabled_trackers(tracking):
            old = previous.get(name)
            if _same(old, name, tracking, record.identity):
                log.info(
                    "%s: run %r already logged as %s: nothing logged",
                    name,
                    run["name"],
                    old["run_id"],
                )
                trackers[name] = {**old, "logged_now": False}
                continue
            try:
                trackers[name] = _log(name, record, tracking, results_dir, old, run, work)
            except UserError as exc:
                log.error("%s", exc)
                failures.append((name, str(exc)))
    result = {"run": run["name"], "identity": record.identity, "trackers": trackers}
    atomic_write_json(work / TRACKING_FILE, result)  # what was logged, even on a failure
    if failures:
        cause = "; ".join(message for _, message in failures)
        atomic_write_json(
            work / TRACKING_FAILED,
            {
                "stage": "track",
                "trackers": [name for name, _ in failures],
                "cause": cause,
                "log": log_file,
                "host": socket.gethostname(),
                "time": time.time(),
            },
        )
        raise UserError(f"run {run['name']!r}: tracking failed: {cause}")
    atomic_write_json(out, result)
    return result


def _log(name, record, tracking: dict, results_dir: str, old: dict | None, run: dict, work) -> dict:
    where = destination(name, tracking)
    if name == "mlflow":
        from ddpflow.tracking import live, mlflow_backend

        # the run the train rule streamed this training's epochs to, if any: completed
        state = live.live_state(work)
        streamed = state if state.get("training") == live.training_key(run) else None
        entry = mlflow_backend.log_run(record, where["uri"], where["experiment"], streamed)
        if streamed and entry["run_id"] == streamed["run_id"]:
            entry["streamed_epochs"] = streamed["epochs"]
            # ended: the next training opens its own
            (Path(work) / LIVE_TRACKING).unlink(missing_ok=True)
        return entry
    from ddpflow.tracking import wandb_backend

    same_place = old and all(old.get(k) == v for k, v in where.items())
    return wandb_backend.log_run(
        record,
        where["mode"],
        where["project"],
        where["entity"],
        Path(results_dir) / "wandb",
        old if same_place else None,
    )
