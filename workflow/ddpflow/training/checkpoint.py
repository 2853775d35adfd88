"""Training checkpoints: atomic, checksummed, the last K kept, outside Snakemake's outputs.

A checkpoint holds everything an exact resume needs: model, optimizer, LR schedule and grad
scaler state, the global position in the data order (epoch and optimizer step: the order
and every random draw are functions of seed, epoch, step and micro-batch), the epoch's step
losses so far summed over the ranks, the per-epoch metrics so far, the world size and hosts
of each segment of the training, and a hash of the config it was written under (the
science: the world size is not in it). Nothing in it is per rank, so any world size that
divides the global batch continues it: bitwise at the same size, up to floating-point
summation order at another. It is loaded with `weights_only=True` (no pickled code runs on
load).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from ddpflow import paths
from ddpflow.cluster.distenv import DistEnv, any_rank, barrier
from ddpflow.config import config_hash, training_fingerprint
from ddpflow.config.typed import RunSpec
from ddpflow.runtime import (
    atomic_torch_save,
    atomic_write_bytes,
    atomic_write_json,
    safe_torch_load,
)
from ddpflow.training import sharding
from ddpflow.training.background_save import BackgroundSaves, snapshot
from ddpflow.training.workspace import (
    NEWEST,
    candidates,
    checkpoint_dir,
    remove_checkpoint,
    set_aside,
    sidecar,
)
from ddpflow.words import counted

log = logging.getLogger(__name__)
FORMAT = 2  # 2: global position (epoch_step), step losses, segments; 1: per-rank position
# the step an attempt has reached (ddpflow.paths.REACHED), in the checkpoints folder
REACHED = Path(paths.REACHED).name
_clock = time.monotonic  # train.checkpoint.every_minutes' clock


class CheckpointMismatch(RuntimeError):
    """The newest checkpoint was written under another config."""


def training_hash(run: dict) -> str:
    """What a checkpoint must agree with: every key that determines the trained model (the
    same keys as the train rule's params, ddpflow.config.training_fingerprint)."""
    return config_hash(training_fingerprint(run))


def save(state: dict, directory: Path, step: int, keep: int) -> Path:
    """Write ckpt-<step>.pt atomically, then its sha256 sidecar; prune to the newest `keep`.
    A crash or a full disk at any point leaves the previous checkpoints intact."""
    path = checkpoint_path(directory, step)
    digest = atomic_torch_save({**state, "format": FORMAT, "saved_at": time.time()}, path)
    atomic_write_bytes(sidecar(path), f"{digest}\n".encode())
    for old in candidates(directory)[keep:]:
        remove_checkpoint(old)
    # a sharded state whose .pt was never written (a crash between the two) is no checkpoint
    for orphan in directory.glob("ckpt-*.dcp"):
        if not orphan.with_suffix(".pt").exists():
            shutil.rmtree(orphan, ignore_errors=True)
    return path


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"ckpt-{step:09d}.pt"


def load_latest(directory: Path, expected_hash: str, map_location="cpu") -> dict | None:
    """The newest checkpoint that verifies; a corrupt or truncated one is skipped with a
    warning. CheckpointMismatch if the newest valid one belongs to another config."""
    for path in candidates(directory):
        state = _load_verified(path, map_location)
        if state is None:
            continue
        if state["config_hash"] != expected_hash:
            raise CheckpointMismatch(
                f"{path} was written under a different config (hash {state['config_hash'][:12]}"
                f", now {expected_hash[:12]}): the data, model or training settings changed. "
                "Restore the old config to resume, or set "
                "train.checkpoint.on_config_change: start_over (the default; old checkpoints "
                "are set aside)"
            )
        log.info("resuming from %s (written by attempt %d)", path.name, state["attempt"])
        return state
    return None


def _load_verified(path: Path, map_location) -> dict | None:
    try:
        data = path.read_bytes()
        expected = sidecar(path).read_text().strip()
    except OSError as exc:
        log.warning("skipping checkpoint %s: %s", path.name, exc)
        return None
    if hashlib.sha256(data).hexdigest() != expected:
        log.warning(
            "skipping checkpoint %s: checksum mismatch (corrupt or truncated); "
            "falling back to the one before",
            path.name,
        )
        return None
    import io

    state = safe_torch_load(io.BytesIO(data), map_location)
    if state.get("format") != FORMAT:
        log.warning("skipping checkpoint %s: format %s", path.name, state.get("format"))
        return None
    if "sharded" in state and (problem := sharding.verify(path, state["sharded"])):
        why = f"{problem}; falling back to the one before"
        log.warning("skipping checkpoint %s: %s", path.name, why)
        return None
    state["path"] = str(path)
    return state


class Preempted(Exception):
    """All ranks agreed to stop after the time-limit / preemption signal; state is saved."""


class Checkpointer:
    """When to save and how to resume one run's training (every rank holds one)."""

    # the SIGUSR2 handler stop_on_signal replaced (submitit's), handed the job at a stop
    submitit_handler: Callable[[int, FrameType | None], Any] | int | None

    def __init__(self, run: RunSpec, work: str | Path, env: DistEnv, stop_check_steps: int = 10):
        cfg = run.train.checkpoint
        self.every_steps, self.every_epochs, self.keep = cfg.every_steps, cfg.every_epochs, cfg.keep
        self.on_config_change = cfg.on_config_change
        self.epochs = run.train.epochs
        self.directory = checkpoint_dir(work)
        self.hash = training_hash(run.resolved)  # a fingerprint: made from the dict
        self.env, self.stop_check_steps = env, stop_check_steps
        self.stop_requested = False  # set from a signal handler
        self.watch_signal = env.launcher == "slurm"
        self.attempt = 1
        # each save as it stopped this rank: the gather and write, or with
        # train.checkpoint.async the copy (and any wait for the save before it)
        self.save_seconds: list[float] = []
        self.asynchronous, self.every_minutes = cfg.async_, cfg.every_minutes
        self.saves = BackgroundSaves()
        self._last_save = _clock()  # every_minutes counts from here
        self._group: Any = None  # the checkpoints' own process group (async sharded saves)
        self._reached: int | None = None  # rank 0's REACHED file, open while training

    def restore(self, loop) -> dict | None:
        """Load the newest valid checkpoint into loop (and this rank's RNG state).

        Collective, with the same collectives on every rank whatever it found: all ranks
        read, agree whether any saw another config's checkpoints, and only then does rank 0
        set them aside. (Rank 0 renaming the folder while a peer had yet to read it made the
        peer start fresh and skip the barrier rank 0 waited in: the ranks' collectives
        paired up wrongly and every rank timed out.)"""
        try:
            state = load_latest(self.directory, self.hash, map_location=loop.device)
            mismatch = None
        except CheckpointMismatch as exc:
            state, mismatch = None, exc
        if any_rank(self.env.processes, mismatch is not None):
            if self.on_config_change != "start_over":
                raise mismatch or CheckpointMismatch(
                    f"another rank found checkpoints of another config in {self.directory}"
                )
            if self.env.is_master:
                set_aside(self.directory, "the checkpoints belong to another config")
            barrier(self.env)
            state = None
        if state is None:
            return None
        loop.load_state_dict(state, Path(state["path"]))
        state["steps_redone"] = steps_redone(self.directory, state["step"])
        rng = state["rng"]
        if len(rng) == self.env.world_size:
            # RNG states are CPU byte tensors, also on a GPU rank, where map_location moved
            # every tensor of the checkpoint to the device (set_rng_state refuses those)
            torch.set_rng_state(rng[self.env.rank]["cpu"].cpu())
            if "cuda" in rng[self.env.rank] and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng[self.env.rank]["cuda"].cpu())
        return state

    def save(self, loop, reason: str) -> None:
        """Collective: gathers every rank's RNG state (and sharded state); rank 0 writes."""
        started = time.perf_counter()
        self._save(loop, reason)
        self.save_seconds.append(time.perf_counter() - started)

    def _save(self, loop, reason: str) -> None:
        self.saves.wait()  # at most one save in flight (its failure fails this one)
        rng = _gather_rng(self.env)
        loop.gather_state()
        step = loop.scheduler.last_epoch
        sharded = finish = None
        if loop.checkpoints_sharded:  # every rank writes its shards; rank 0's .pt commits them
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            path, env = checkpoint_path(self.directory, step), self.env
            shards = (loop.model, loop.optimizer, path, env.is_master, env.world_size)
            if self.asynchronous:
                finish = sharding.save_in_background(*shards, self._checkpoint_group())
            else:
                sharded = sharding.save(*shards)
        loop.close_segment(step)  # the steps this world size has trained, as far as saved
        state = None
        if self.env.is_master:
            own = {"rng": rng, "config_hash": self.hash, "attempt": self.attempt}
            state = {**loop.state_dict(), **own, "reason": reason}
            if sharded is not None:
                state["sharded"] = sharded
        if self.asynchronous and (state is not None or finish is not None):
            copied = snapshot(state)  # off the training's tensors before they change
            self.saves.start(f"at step {step}", lambda: self._commit(copied, step, reason, finish))
        elif state is not None:
            self._commit(state, step, reason, None)
        del state
        loop.release_gathered_state()
        self._last_save = _clock()

    def _commit(self, state: dict | None, step: int, reason: str, finish) -> None:
        """Write rank 0's .pt (after the shards, where finish writes them), its sidecar and
        the newest position: the checkpoint exists from here on."""
        sharded = finish() if finish is not None else None
        if state is None:  # a rank other than 0: its shards are written
            return
        if sharded is not None:
            state["sharded"] = sharded
        path = save(state, self.directory, step, self.keep)
        atomic_write_json(path.parent / NEWEST, position(state, path))
        how = ", written in the background" if self.asynchronous else ""
        log.info("checkpoint %s (%s%s)", path.name, reason, how)

    def _checkpoint_group(self):
        """A gloo group of every rank for the background saves' collectives (made once, by
        every rank at its first asynchronous save: a collective); None on one rank."""
        if self.env.processes > 1 and self._group is None:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")
        return self._group

    def on_step(self, loop) -> None:
        step = loop.scheduler.last_epoch
        if self.env.is_master:
            self._note_reached(step)
        if self.every_steps and step % self.every_steps == 0:
            self.save(loop, f"every {counted(self.every_steps, 'step')}")
        elif self.every_minutes and step % self.stop_check_steps == 0 and self._minutes_due():
            self.save(loop, f"every {self.every_minutes:g} minutes")
        # only Slurm sends the stop signal: elsewhere skip the agreement (a collective and a
        # host sync every stop_check_steps)
        if self.watch_signal and step % self.stop_check_steps == 0 and self.stop_agreed():
            self.save(loop, "stop signal")
            self.saves.wait()  # the checkpoint is on disk before the job is handed over
            raise Preempted(f"stopped at step {step} after a signal; checkpoint saved")

    def _note_reached(self, step: int) -> None:
        """Overwrite the REACHED file's fixed-width record with this step."""
        if self._reached is None:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._reached = os.open(self.directory / REACHED, os.O_WRONLY | os.O_CREAT, 0o600)
        os.pwrite(self._reached, f"{step:>12d}\n".encode(), 0)

    def close(self) -> None:
        """The end of this attempt's training: the save in flight written (its failure only
        logged: a finished training does not need it), the REACHED file closed."""
        self.saves.wait(raise_errors=False)
        if self._reached is not None:
            os.close(self._reached)
            self._reached = None

    def _minutes_due(self) -> bool:
        """train.checkpoint.every_minutes: true on every rank once any rank's clock says so
        (the ranks must save at one step)."""
        due = _clock() - self._last_save >= self.every_minutes * 60
        return any_rank(self.env.processes, due)

    def on_epoch(self, loop) -> None:
        every = self.every_epochs and loop.epoch % self.every_epochs == 0
        if loop.pruned is not None:  # its last epoch: a resumed attempt must not train on
            self.save(loop, f"end of epoch {loop.epoch}, pruned")
        elif loop.epoch == self.epochs or every:
            self.save(loop, f"end of epoch {loop.epoch}")

    def stop_agreed(self) -> bool:
        """True on every rank once any rank got the signal (ranks must stop at one step)."""
        return any_rank(self.env.processes, self.stop_requested)


def steps_redone(directory: Path, step: int) -> int | None:
    """The steps the interrupted attempt trained past the checkpoint at `step`, which a resume
    trains again: 0 after a stop signal (the ranks saved where they stopped), the steps since
    the checkpoint after a failure. None where nothing was noted (a run of an earlier
    ddpflow)."""
    try:
        reached = int((directory / REACHED).read_text().strip())
    except (OSError, ValueError):
        return None
    return max(0, reached - step)


def position(state: dict, path: Path) -> dict:
    """The newest checkpoint's place in the training, small enough for the login node to
    read before it submits (the .pt may be gigabytes)."""
    where = {key: state[key] for key in ("epoch", "epoch_step", "step", "world_size")}
    return {"checkpoint": path.name, **where}


def resumed_line(state: dict, world_size: int, tensor_parallel: int = 1) -> str:
    """'resumed at epoch 3 step 41 on 2 ranks; the checkpoint was written on 4' (and, where
    train.tensor_parallel changed, 'at tensor_parallel 2')."""
    where = f"epoch {state['epoch'] + 1} step {state['step']}"
    written, degree = state["world_size"], state.get("tensor_parallel", 1)
    ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
    if degree != tensor_parallel:
        ranks += f" at tensor_parallel {tensor_parallel}"
        written = f"{written} at tensor_parallel {degree}"
    redone = state.get("steps_redone")
    again = "" if redone is None else f"; {redone or 'no'} step{'s' * (redone != 1)} redone"
    if written == world_size:
        return f"resumed at {where} on {ranks}, the world size it was written on{again}"
    return f"resumed at {where} on {ranks}; the checkpoint was written on {written}{again}"


def _gather_rng(env: DistEnv, device: torch.device | None = None) -> list[dict]:
    """Every rank's RNG states (CPU, and CUDA where used), as tensors gathered from every
    rank: an all_gather of uint8 tensors, nothing pickled on the wire. The states are the
    same size on every rank (one torch build, one generator kind)."""
    local = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        local["cuda"] = torch.cuda.get_rng_state()
    if env.world_size == 1:
        return [local]
    import torch.distributed as dist

    if device is None:  # NCCL gathers GPU tensors only
        nccl = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    gathered: list[dict] = [{} for _ in range(env.world_size)]
    for key, state in local.items():
        mine = state.to(device)
        parts = [torch.empty_like(mine) for _ in range(env.world_size)]
        dist.all_gather(parts, mine, group=env.group)
        for rank, part in enumerate(parts):
            gathered[rank][key] = part.cpu()
    return gathered


@contextlib.contextmanager
def stop_on_signal(ckpt: Checkpointer):
    """Slurm sends USR2 before the time limit (and submitit's preemption path uses it too):
    only set a flag here; the ranks agree on a step, save, then hand over to submitit."""
    import signal

    previous = signal.getsignal(signal.SIGUSR2)

    def handler(signum, frame):
        log.warning(
            "received %s: saving a checkpoint at the next agreed step", signal.Signals(signum).name
        )
        ckpt.stop_requested = True

    signal.signal(signal.SIGUSR2, handler)
    ckpt.submitit_handler = previous
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR2, previous)


def hand_over_to_requeue(env: DistEnv, handler) -> None:
    """After the checkpoint: rank 0 lets submitit requeue the job (scontrol requeue, then it
    exits); the other ranks wait to be stopped by that requeue instead of failing the step.
    Without submitit (plain srun) the Preempted error ends the step; a rerun resumes."""
    import signal

    if env.is_master and callable(handler) and getattr(handler, "__self__", None) is not None:
        handler(signal.SIGUSR2, None)  # submitit: checkpoint() -> requeue -> sys.exit
    elif not env.is_master:
        time.sleep(120)
