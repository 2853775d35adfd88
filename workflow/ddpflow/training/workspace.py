"""A run's work folder (results/work/<run>/): which checkpoints a new training may resume,
what is set aside, and what is cleaned up after success. Imports no torch.

The rule is simple: a checkpoint is resumed only by an interrupted attempt of the identical
config. The train rule calls `prepare()` before it submits anything:
- the previous training finished and published its outputs (FINISHED exists), and Snakemake
  runs the rule again (the model was deleted, or is out of date): train from scratch; the
  finished training's checkpoints are removed (they are the published model's state);
- the config the checkpoints belong to (FINGERPRINT) differs from this one: log the changed
  keys, set the checkpoints aside (checkpoints.old-<time>/, never deleted silently: see
  `clean()`), train from scratch;
- otherwise an interrupted attempt of this config: the ranks resume from its newest checkpoint.
After success `finish()` keeps at most `keep_after_success` checkpoints, removes rendezvous
files and marks the training finished.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from ddpflow import paths
from ddpflow.cluster import private
from ddpflow.config import describe_changes, training_fingerprint
from ddpflow.runtime import atomic_write_json

log = logging.getLogger(__name__)


# beside the checkpoints: the newest one's position, what the login node says as it resumes
NEWEST = "newest.json"


def checkpoint_dir(work: str | Path) -> Path:
    return Path(work) / paths.CHECKPOINTS


def candidates(directory: Path) -> list[Path]:
    """Checkpoints, newest first."""
    return sorted(Path(directory).glob("ckpt-*.pt"), reverse=True)


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def remove_checkpoint(path: Path) -> None:
    """A checkpoint's file, its checksum and, for sharded training, its DCP directory."""
    path.unlink(missing_ok=True)
    sidecar(path).unlink(missing_ok=True)
    shutil.rmtree(path.with_suffix(".dcp"), ignore_errors=True)


def set_aside(directory: Path, reason: str) -> Path | None:
    """Move existing checkpoints out of the way (start over without losing them)."""
    if not candidates(directory):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = directory.with_name(f"{paths.SET_ASIDE_PREFIX}{stamp}")
    suffix = 1
    while target.exists():  # two edits within one second
        target = directory.with_name(f"{paths.SET_ASIDE_PREFIX}{stamp}-{suffix}")
        suffix += 1
    directory.rename(target)
    log.info(
        "%s: old checkpoints set aside in %s; snakemake clean_work removes them", reason, target
    )
    return target


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def prepare(run: dict, work: str | Path) -> str:
    """Decide, before submitting, whether the ranks may resume; returns what was decided
    ("fresh", "resume", "retrain: <why>") and logs it in one line."""
    work = private.make(work, "work folder")  # 0700: checkpoints and the rendezvous files
    ckpts = checkpoint_dir(work)
    new = training_fingerprint(run)
    old = _read_json(work / paths.FINGERPRINT)
    finished = _read_json(work / paths.FINISHED)
    if finished is not None:
        # a finished training's state: only its own config's is deleted (it is the model
        # being redone); another config's is set aside like any other
        old = finished.get("fingerprint", old)
        (work / paths.FINISHED).unlink()
        changes = describe_changes(old or {}, new)
        redo = "the previous training finished; its outputs are being redone"
        decision = f"retrain: {changes or redo}"
    elif candidates(ckpts) and old is not None and old != new:
        decision = f"retrain: {describe_changes(old, new)}"
    elif candidates(ckpts):
        decision = f"resume: an interrupted attempt of this config left {ckpts}"
        decision += _newest_position(ckpts, run["world_size"])
    else:
        decision = "fresh"
    if decision.startswith("retrain"):
        log.info("run %r: %s: training from scratch", run["name"], decision[len("retrain: ") :])
        # the epoch lines of the training not continued: the live progress would take them
        # for this one's and print none of its first epochs
        (work / paths.LIVE_METRICS).unlink(missing_ok=True)
        if finished is not None and not changes:
            shutil.rmtree(ckpts, ignore_errors=True)
        else:
            set_aside(ckpts, f"run {run['name']!r}")
    elif decision.startswith("resume"):
        log.info("run %r: %s; resuming from its newest checkpoint", run["name"], decision[8:])
    atomic_write_json(work / paths.FINGERPRINT, new)
    return decision


def _newest_position(ckpts: Path, world_size: int) -> str:
    """' (epoch 3 step 41, written on 4 ranks; continuing on 2)': the newest checkpoint's
    place, from the small file the ranks write beside it (empty if there is none)."""
    newest = _read_json(ckpts / NEWEST)
    if not newest or not (ckpts / newest.get("checkpoint", "")).is_file():
        return ""
    written, epochs, step = newest["world_size"], newest["epoch"], newest["step"]
    other = f"; continuing on {world_size}" if written != world_size else ""
    ranks = f"{written} rank{'s' if written != 1 else ''}"
    # as the checkpoint's own log line counts: "end of epoch 53" is "after epoch 53"
    where = f"after epoch {epochs}, step {step}"
    if newest.get("epoch_step"):  # mid-epoch: in the epoch after the finished ones
        where = f"in epoch {epochs + 1} at step {step}"
    return f" (newest {where}, written on {ranks}{other})"


def finish(run: dict, work: str | Path) -> None:
    """After the training's outputs are published: keep at most the newest
    `train.checkpoint.keep_after_success` checkpoints, drop rendezvous files, and mark the
    training finished (a later run of the rule then trains from scratch)."""
    work = Path(work)
    keep = run["train"]["checkpoint"]["keep_after_success"]
    for old in candidates(checkpoint_dir(work))[keep:]:
        remove_checkpoint(old)
    remove_rendezvous_files(work)
    atomic_write_json(
        work / paths.FINISHED,
        {"fingerprint": training_fingerprint(run), "finished": time.time()},
    )


def remove_rendezvous_files(work: str | Path) -> None:
    for port_file in Path(work).glob("rendezvous-*.port"):
        port_file.unlink(missing_ok=True)


def clean(work: str | Path, everything: bool = False) -> list[Path]:
    """What `snakemake clean_work` removes from one run's work folder: set-aside checkpoints,
    stale rendezvous files and, once the training finished, its remaining checkpoints. The
    checkpoints of an unfinished (interrupted) training stay: a rerun resumes from them.
    everything=True removes the whole folder. Returns what was removed."""
    work = Path(work)
    if not work.exists():
        return []
    if everything:
        shutil.rmtree(work)
        return [work]
    removed = sorted(work.glob(f"{paths.SET_ASIDE_PREFIX}*")) + sorted(work.glob("rendezvous-*"))
    if (work / paths.FINISHED).exists() and checkpoint_dir(work).exists():
        removed.append(checkpoint_dir(work))
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return removed


# an attempt's monitoring (TensorBoard events, each rank's system series, profiler traces),
# in the work folder until the training finishes: a stopped or failed retrain never touches
# the finished run's (ddpflow.monitoring.sampler writes them; publish_monitor moves them)
MONITOR = "monitor"
MONITORED = ("tensorboard", "system", "profile")


def monitor_dir(work: str | Path) -> Path:
    return Path(work) / MONITOR


def publish_monitor(work: str | Path, run_dir: str | Path) -> None:
    """After a finished training (rank 0, every rank's monitor closed): the attempt's
    folders replace the run's, each by a rename; a folder the attempt did not write (its
    monitor off) goes, since it described the previous model."""
    for name in MONITORED:
        made, shown = monitor_dir(work) / name, Path(run_dir) / name
        old = shown.with_name(f".replaced-{name}")
        shutil.rmtree(old, ignore_errors=True)
        if shown.exists():
            shown.rename(old)
        if made.exists():
            shutil.move(str(made), str(shown))  # a rename on one filesystem
        shutil.rmtree(old, ignore_errors=True)
