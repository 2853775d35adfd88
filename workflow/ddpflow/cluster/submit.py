"""Placing and submitting a run's distributed job from the login node: the run as its next
Slurm job runs it (placement.py: fewer nodes after node failures, the nodes to avoid), then
one submitit job (launch.py) whose ranks run a rank task (jobs.py), waited for with rank 0's
epoch lines in the terminal. The train, evaluate and predict rules submit through here.

    run_on, exclude = placed(run, paths, "train")
    summary = submit_and_wait(TrainJob, "train", run_on, paths, "logs", exclude)[0]
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from ddpflow import runtime
from ddpflow.cluster import container, in_job, launch, nodes, placement, private, software
from ddpflow.config.fingerprint import config_hash, evaluation_fingerprint, training_fingerprint
from ddpflow.errors import UserError
from ddpflow.paths import LIVE_METRICS, RunPaths
from ddpflow.progress import EpochProgress
from ddpflow.words import counted

log = logging.getLogger(__name__)


def job_record(paths: RunPaths, stage_name: str) -> Path:
    """Where the id of the stage's submitted job is kept (for a reattach after a stop)."""
    return Path(paths.work) / f"{stage_name}-job.json"


def placed(run: dict, paths: RunPaths, stage_name: str) -> tuple[dict, tuple[str, ...]]:
    """The run as its Slurm job runs it (machine.nodes may be fewer: ddpflow.cluster.placement) and
    the nodes the job avoids; a job an earlier attempt left running keeps its placement."""
    if run["launcher"] != "slurm":
        return run, ()
    previous = launch.read_record(job_record(paths, stage_name))
    if not (previous and previous.get("launcher") == "slurm"
            and launch.slurm_job_alive(previous["job_id"])):  # fmt: skip
        previous = None
    return placement.place(run, nodes.ledger_beside(paths.work), previous)


def submit_and_wait(
    task_cls,
    stage_name: str,
    run: dict,
    paths: RunPaths,
    logs_dir: str,
    exclude=(),
    stream=None,
    computes: dict | None = None,
) -> list:
    """Submit the stage's job for `run` (as placed: placed()) and wait for its ranks;
    computes: what else the job's result depends on (its fingerprint's other keys)."""
    folder = Path(logs_dir).resolve() / "submitit" / run["name"] / stage_name
    start = time.perf_counter()
    refuse_an_unsafe_torch(run)
    private.make(paths.work, "work folder")  # 0700: checkpoints and rendezvous files
    # what the job computes: a rerun reattaches to a job of the same fingerprint and
    # cancels one of an edited config (launch.reattach)
    fingerprint = training_fingerprint(run)
    if stage_name == "evaluate":
        fingerprint = {**fingerprint, **evaluation_fingerprint(run)}
    fingerprint = {**fingerprint, **(computes or {})}
    request = launch.JobRequest(
        run["launcher"],
        machine_for_job(run, paths, folder),
        folder,
        f"ddpflow-{stage_name}-{run['name']}",
        max_requeues=run["train"]["max_requeues"],
        exclude=tuple(exclude),
        # a training job restarts its ranks inside its allocation (machine.restarts_in_job)
        in_job=in_job.plan(run, paths) if stage_name == "train" else None,
    )
    progress = EpochProgress(run, Path(paths.work) / LIVE_METRICS, stream)
    watch = launch.JobWatch(
        record=Path(job_record(paths, stage_name)),
        fingerprint=config_hash(fingerprint),
        on_poll=progress if stage_name == "train" else None,
        ledger=nodes.ledger_beside(paths.work),
    )
    # the versions each rank checks its own against before it builds the model
    task = task_cls(run, paths, planned=software.planned_versions())
    results = launch.launch(task, request, watch)
    log.info(
        "%s of run %r: %s done in %.1fs",
        stage_name,
        run["name"],
        counted(len(results), "rank"),
        time.perf_counter() - start,
    )
    return results


def machine_for_job(run: dict, paths: RunPaths, folder: Path) -> dict:
    """The run's machine section as its job uses it: machine.container with every path the
    job reads and writes bound (ddpflow.cluster.container.job_binds), their mount points made
    in a Charliecloud directory image."""
    if container.of(run["machine"]) is None:
        return run["machine"]
    files = [getattr(paths, field.name) for field in dataclasses.fields(paths)]
    machine = container.bound(run["machine"], container.job_binds(run, files, folder))
    container.make_mount_points(machine)
    return machine


def refuse_an_unsafe_torch(run: dict) -> None:
    """The ranks load checkpoints and model.pt (weights_only): refused before anything is
    queued where this environment's torch has known weights_only bypasses (the ranks
    refuse too, in case machine.setup gives them another torch)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        problem = runtime.weights_only_problem(version("torch"))
    except PackageNotFoundError:
        return  # no torch here: the ranks' environment (machine.setup) decides, and checks
    if problem is not None:
        raise UserError(f"run {run['name']!r}: {problem}")
