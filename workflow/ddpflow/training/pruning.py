"""Median pruning of a sweep's runs (opt-in: `sweep.prune: {after_epochs: N}`).

At the end of each epoch from `after_epochs` on (not the last: a run that got there is
finished anyway), rank 0 reads the validation accuracy every peer of the sweep recorded for
that epoch in its work folder's metrics.jsonl (ddpflow.paths.LIVE_METRICS, one line per
epoch that its rank 0 appends; on a cluster a shared filesystem), takes the median over the
runs that reached the epoch, this one included, and prunes this run if its accuracy is
strictly below it. The decision is broadcast from rank 0 with one collective (every rank
stops after the same epoch: no rank waits in a collective the others left) and becomes part
of the epoch's record, so it is in the checkpoint written right after it: a resumed run
never decides an epoch of its checkpoint again.

Which peers count:
- a run prunes only when at least `min_runs` runs (default 3: this one and 2 others) reached
  the epoch: with fewer the median is just the other run's value, and the first runs of a
  sweep would be judged by one another alone;
- a peer's records count only if they belong to its current config: its fingerprint.json
  (written by the train rule before it submits) equals the fingerprint of this run with the
  peer's swept values. After an edit of the sweep's base config, the records of the old
  config are ignored until the peer is retrained (which deletes them).
Pruning therefore depends on the order in which runs reach an epoch: the same run may be
pruned when it trains after good peers and kept when it trains first.

Imports no torch at module level: the train rule (login node) formats the pruned line.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpflow import paths
from ddpflow.cluster.distenv import DistEnv
from ddpflow.config import training_fingerprint
from ddpflow.config.typed import RunSpec, RunView
from ddpflow.task import Selection, get_task, run_task
from ddpflow.words import counted

log = logging.getLogger(__name__)

ACCURACY = get_task().selection  # classification's
DEFAULT_MIN_RUNS = 3  # this run and 2 others must have reached the epoch


def prune_settings(run: RunView) -> Mapping[str, Any] | None:
    """The run's `sweep.prune` block, or None where pruning is off (no sweep, or no prune)."""
    sweep = run.get("sweep") or {}
    return sweep.get("prune") or None


def decide(
    own: float, others: list[float], epoch: int, min_runs: int, selection: Selection = ACCURACY
) -> dict | None:
    """The median rule at one epoch: {"epoch", <the selection metric>, "median", "runs",
    "prune"} over this run's validation metric and the others' (non-finite values do not
    count); prune where it is worse than the median in the metric's direction (below it for
    accuracy, above it for an MSE). None when fewer than min_runs runs (this one included)
    reached the epoch."""
    values = [own, *(v for v in others if math.isfinite(v))]
    if not math.isfinite(own) or len(values) < min_runs:
        return None
    median = float(statistics.median(values))
    prune = selection.worse_than(own, median)
    runs = len(values)
    return {"epoch": epoch, selection.metric: own, "median": median, "runs": runs, "prune": prune}


def accuracy_at(metrics: Path, epoch: int, key: str = "val_accuracy") -> float | None:
    """The validation metric `key` recorded for `epoch` in a metrics.jsonl (the last such
    line; a line still being written does not parse and is skipped), or None."""
    try:
        lines = Path(metrics).read_text(errors="replace").splitlines()
    except OSError:
        return None
    found = None
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("epoch") == epoch:
            value = record.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                found = float(value)
    return found


def _set_dotted(config: dict, key: str, value) -> None:
    *parents, last = key.split(".")
    for part in parents:
        config = config.setdefault(part, {})
    config[last] = value


def records_are_current(run: dict, peer_work: Path) -> bool:
    """Whether a peer's work folder holds records of its current config: its
    fingerprint.json equals this run's fingerprint with the peer's swept values in it."""
    try:
        theirs = json.loads((Path(peer_work) / paths.FINGERPRINT).read_text())
    except (OSError, ValueError):
        return False
    peer = copy.deepcopy({k: v for k, v in run.items() if k != "sweep"})
    keys = run["sweep"].get("keys") or run["sweep"].get("values", {})
    for key in keys:
        if key in theirs:
            _set_dotted(peer, key, theirs[key])
    if any(key.startswith("data.") for key in keys) and "dataset_id" in theirs:
        # a swept data key gives the peer a dataset of its own: its id is not recomputed
        # here (that reads an image folder's listing), the peer's own is taken
        peer["dataset_id"] = theirs["dataset_id"]
    try:
        expected = json.loads(json.dumps(training_fingerprint(peer)))
    except (KeyError, TypeError, ValueError):  # a swept value this run's sections cannot take
        return False
    return expected == theirs


def peer_accuracies(
    run: dict, work: str | Path, epoch: int, key: str = "val_accuracy"
) -> dict[str, float]:
    """Each other peer's validation metric `key` at `epoch`, for those that reached it with
    records of their current config. Work folders are siblings: results/work/<run>."""
    results = Path(work).resolve().parent.parent
    found = {}
    for name in run["sweep"]["peers"]:
        peer_work = paths.work_dir(results, name)
        if name == run["name"] or not records_are_current(run, peer_work):
            continue
        value = accuracy_at(peer_work / paths.LIVE_METRICS, epoch, key)
        if value is not None:
            found[name] = value
    return found


def pruned_line(name: str, pruned: dict, selection: Selection = ACCURACY) -> str:
    """What the terminal and the rank log say of a pruned run."""
    label = selection.label.replace("validation", "val")
    where = "below" if selection.higher_is_better else "above"
    return (
        f"run {name!r} PRUNED after epoch {pruned['epoch']}: {label} "
        f"{pruned[selection.metric]:.4f} is {where} the median {pruned['median']:.4f} of the "
        f"{pruned['runs']} runs of its sweep that reached epoch {pruned['epoch']}; it stops "
        "here and keeps its last model (not a failure: a rerun does not retrain it)"
    )


class MedianPruner:
    """The per-epoch pruning check of one run's training (every rank holds one)."""

    def __init__(self, run: RunSpec, work: str | Path, env: DistEnv, device):
        self.run, self.work, self.env, self.device = run, work, env, device
        self.settings = prune_settings(run)
        self.selection = run_task(run).selection

    def due(self, epoch: int) -> bool:
        """Whether epoch's end is a pruning point (the same answer on every rank)."""
        if self.settings is None:
            return False
        return self.settings["after_epochs"] <= epoch < self.run.train.epochs

    def on_epoch(self, record: dict) -> dict | None:
        """Collective where due: adds record["pruned"] on every rank if rank 0 decided to
        prune (the training loop then stops after this epoch); returns it."""
        epoch = record["epoch"]
        if not self.due(epoch):
            return None
        pruned = None
        if self.env.is_master:
            try:
                pruned = self._decide(epoch, record[self.selection.metric])
            except Exception as exc:  # noqa: BLE001 - an optimisation: never fails a run,
                # and rank 0 must reach the broadcast the other ranks wait in
                why = f"{type(exc).__name__}: {exc}"
                log.warning("pruning at epoch %d skipped: %s", epoch, why)
        pruned = agree(pruned, self.env, self.device, self.selection.metric)
        if pruned is not None:
            record["pruned"] = pruned
        return pruned

    def _decide(self, epoch: int, own: float) -> dict | None:
        """Rank 0: the pruning record if this run is pruned now, else None (logged)."""
        selection = self.selection
        assert self.settings is not None  # due(epoch) held: pruning is configured
        # the peers' records are compared by fingerprint, made from the dict
        peers = peer_accuracies(self.run.resolved, self.work, epoch, selection.metric)
        min_runs = self.settings.get("min_runs", DEFAULT_MIN_RUNS)
        decision = decide(own, list(peers.values()), epoch, min_runs, selection)
        seen = ", ".join(f"{name} {value:.4f}" for name, value in sorted(peers.items()))
        if decision is None:
            others = counted(len(peers), "other run")
            reached = f"{others} of the sweep reached it ({seen or 'none'})"
            needs = f"pruning needs {min_runs} runs in all"
            log.info("pruning at epoch %d: %s, %s: continuing", epoch, reached, needs)
            return None
        if not decision.pop("prune"):
            figure = f"{selection.label.replace('validation', 'val')} {own:.4f}"
            median = f"median {decision['median']:.4f} of {decision['runs']} runs ({seen})"
            log.info("pruning at epoch %d: %s, %s: continuing", epoch, figure, median)
            return None
        log.warning("%s (others: %s)", pruned_line(self.run.name, decision, selection), seen)
        return decision


def agree(pruned: dict | None, env: DistEnv, device, metric: str = "val_accuracy") -> dict | None:
    """Collective: rank 0's decision on every rank, by one broadcast of 5 numbers (on the
    device: nccl broadcasts GPU tensors only)."""
    if env.world_size == 1:
        return pruned
    import torch
    import torch.distributed as dist

    fields = ("epoch", metric, "median", "runs")
    values = [1.0, *(float(pruned[f]) for f in fields)] if pruned else [0.0] * 5
    message = torch.tensor(values, dtype=torch.float64, device=device)
    dist.broadcast(message, src=0)
    if env.is_master or message[0].item() == 0.0:
        return pruned
    epoch, value, median, runs = message[1:].tolist()
    return {"epoch": int(epoch), metric: value, "median": median, "runs": int(runs)}
