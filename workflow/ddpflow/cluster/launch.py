"""Submit a distributed task through submitit (local processes or Slurm) and wait for it.

The train and evaluate rules are Snakemake local rules that call `launch()`: one submitit job
with one task per rank. A failure becomes a LaunchError carrying the failing ranks' last log
lines; Ctrl-C / SIGTERM cancels the job so nothing is orphaned on the cluster.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit

from ddpflow.cluster import container, failures, in_job, nodes, poll, private
from ddpflow.cluster.executor import clean_slurm_environment, make_executor
from ddpflow.cluster.interrupts import (
    LOCAL_SIGINT_GRACE_S,
    controller_output,
    ignore_stop_signals,
    terminate_as_interrupt,
    terminate_local,
)
from ddpflow.config.machine import world_size
from ddpflow.errors import UserError
from ddpflow.runtime import atomic_write_json
from ddpflow.words import counted

log = logging.getLogger(__name__)


# a supervised job's first failed rank: what comes next is the supervisor's (cluster.supervise)
IN_JOB_NEXT = "the job's supervisor restarts the ranks or gives up (machine.restarts_in_job)"


class LaunchError(UserError, RuntimeError):
    """A distributed job failed; the message names the ranks and shows their log tails."""


class NodeLost(LaunchError):
    """Slurm requeued the job after a node failure; the job was cancelled."""


@dataclass(frozen=True, slots=True)
class JobRequest:
    """What a job asks for: the launcher (local or slurm), the run's machine section, the
    folder of its submitit files and logs, its name, the requeues it may take after a time
    limit, the nodes it must avoid, and its restarts inside the allocation (a training job's:
    ddpflow.cluster.in_job)."""

    launcher: str
    machine: Mapping[str, Any]
    folder: Path
    job_name: str
    max_requeues: int = 3
    exclude: tuple[str, ...] = ()
    in_job: in_job.InJob | None = None


@dataclass(frozen=True, slots=True)
class JobWatch:
    """How a job is followed: its record (a later Snakemake reattaches to the job it names, if
    the fingerprint of what it computes is the same), a callback at every status poll (live
    progress) and the bad-node ledger a Slurm job's node failures are written to."""

    record: Path | None = None
    fingerprint: str = ""
    on_poll: Callable[[], None] | None = None
    ledger: Path | None = None


def launch(task, request: JobRequest, watch: JobWatch | None = None) -> list:
    """Submit `task` with one process per rank (or reattach to the same job if a previous
    Snakemake was stopped while it ran), wait, and return every rank's result. watch.on_poll()
    runs at every status poll while the job runs and once at its end; a Slurm job that fails,
    or is requeued, because of a node records the node in watch.ledger (ddpflow.cluster.nodes)."""
    watch = watch or JobWatch()
    private.make_job_folder(request.folder)  # 0700: its pickles are code the node runs
    cancel = request.launcher == "local" or request.machine["cancel_on_interrupt"]
    job = None
    try:
        # SIGTERM (Snakemake, ddpflow.cluster.interrupts) or Ctrl-C from here on cancels the job
        with terminate_as_interrupt():
            size = world_size(dict(request.machine))
            job = reattach(watch.record, request.launcher, request.folder, watch.fingerprint, size)
            if job is None:
                job = submit(task, request, watch)
            results = _results(job, task, request, watch)
            private.seal_files(request.folder)  # the ranks' result pickles: 0600 too
    except KeyboardInterrupt:
        if job is not None:
            with ignore_stop_signals():  # a second Ctrl-C must not abandon the cancel
                _interrupted(job, cancel)
        raise
    if watch.record:
        Path(watch.record).unlink(missing_ok=True)
    return results


def _results(job, task, request: JobRequest, watch: JobWatch) -> list:
    """Wait for the job and return every rank's result. A failed job's record is forgotten;
    a Slurm job with a ledger is watched for node failures and blames the nodes it failed on.
    A Slurm job's state comes from the workflow's shared status (ddpflow.cluster.poll: one
    sacct per interval for all its jobs, beside the ledger; without one, the job's folder)."""
    job_name, record, on_poll, ledger = request.job_name, watch.record, watch.on_poll, watch.ledger
    run_name = getattr(task, "run", {}).get("name", job_name)
    if request.launcher != "slurm":  # a poll stats result files
        return _wait_and_blame(job, job_name, record, on_poll, 0.2, run_name)
    status = poll.status_for(ledger, job.paths.folder)
    feed = None if request.in_job is None else in_job.Feed(request.in_job, run_name, ledger, job)
    with poll.attached(job, status):
        lost = None  # the nodes the job runs on, watched for failures
        if ledger is not None:
            lost = nodes.NodeFailureWatch(job.job_id, every_s=0.0,
                                          source=lambda: status.instances(job.job_id))  # fmt: skip
        return _wait_and_blame(job, job_name, record, on_poll, 2.0, run_name, lost, ledger, feed)


def _wait_and_blame(
    job, job_name, record, on_poll, poll_s, run_name, watch=None, ledger=None, feed=None
):
    try:
        results = wait(job, job_name, poll_s, on_poll=on_poll, watch=watch, feed=feed)
    except LaunchError as err:
        # the job ended and failed: a retry or rerun must submit a new one, not
        # reattach to this one and read its failure again
        if record:
            Path(record).unlink(missing_ok=True)
        if watch is None:
            raise
        if feed is not None and feed.gave_up:
            said = f"{job_name} (job {job.job_id}) did not restart: {feed.gave_up}"
            err = LaunchError(f"{said}\n{err}")
        _blame_nodes(err, job, ledger, run_name)
        raise  # not reached: _blame_nodes always raises
    if watch is not None:  # every rank returned, yet Slurm may have requeued the job
        nodes.after_success(job, ledger, run_name, job.paths.stderr)
    return results


def _blame_nodes(err: LaunchError, job, ledger, run_name: str):
    """Re-raise a Slurm job's failure, first naming the nodes it failed on (if any), which
    are recorded in the bad-node ledger."""
    lost_node = isinstance(err, NodeLost) or "DUE TO NODE FAILURE" in str(err)
    try:
        first = nodes.after_failure(job.job_id, ledger, run_name, lost_node, str(err))
    except OSError as exc:  # the ledger could not be written: the job's failure still shows
        log.error("could not record the failed node in %s: %s", ledger, exc)
        first = ""
    if first or lost_node:
        nodes.cancel_requeued(job)
    if not first:
        raise err
    raise LaunchError(f"{first}\n{err}") from err


def submit(task, request: JobRequest, watch: JobWatch):
    """Submit one job with one task per rank and record its id and placement (for a later
    reattach)."""
    launcher, machine, folder = request.launcher, request.machine, request.folder
    job_name, exclude, record = request.job_name, request.exclude, watch.record
    executor = make_executor(
        launcher, dict(machine), folder, job_name, request.max_requeues, exclude, request.in_job
    )
    with clean_slurm_environment(), controller_output(launcher, folder):
        job = executor.submit(task)
    private.seal_files(folder)  # submitit's pickles: 0600 in the 0700 folder
    log.info(
        "submitted %s as %s job %s (%s%s); logs in %s",
        job_name,
        launcher,
        job.job_id,
        counted(job.num_tasks, "rank"),
        container.described(machine),
        folder,
    )
    if record:
        atomic_write_json(
            record,
            {
                "job_id": job.job_id,
                "launcher": launcher,
                "folder": str(folder),
                "fingerprint": watch.fingerprint,
                "num_tasks": job.num_tasks,
                "nodes": machine["nodes"],
                "exclude": list(exclude),
                "submitted": time.time(),
            },
        )
    return job


def cancel_outdated(record, fingerprint: str, num_tasks: int | None = None) -> None:
    """Cancel the Slurm job an earlier, stopped attempt left running (cancel_on_interrupt:
    false) if it was submitted for another config (or rank count): its result is not wanted
    any more, and it would keep writing into the run's work folder."""
    previous = read_record(record)
    if not previous or previous.get("launcher") != "slurm":
        return
    same = previous.get("fingerprint") == fingerprint and (
        num_tasks is None or previous.get("num_tasks") == num_tasks
    )
    if same or not slurm_job_alive(previous["job_id"]):
        return
    log.warning(
        "cancelling Slurm job %s: it was submitted for a config that has been edited since; "
        "submitting a new one",
        previous["job_id"],
    )
    folder = previous["folder"]  # every record names its job's folder (submit)
    cancel_and_wait(submitit.SlurmJob(folder=folder, job_id=previous["job_id"]))


def reattach(record, launcher: str, folder, fingerprint: str, num_tasks: int):
    """The job recorded by an earlier, interrupted attempt, if it is still alive (or finished
    with results) and was submitted for the same config; never a second job for one run."""
    previous = read_record(record) if record else None
    if not previous or launcher != "slurm" or previous.get("launcher") != "slurm":
        return None
    if previous.get("fingerprint") != fingerprint or previous.get("num_tasks") != num_tasks:
        # the config was edited while the job ran on (cancel_on_interrupt: false)
        cancel_outdated(record, fingerprint, num_tasks)
        return None
    job: submitit.SlurmJob[Any] = submitit.SlurmJob(folder, previous["job_id"], range(num_tasks))
    finished = all(job.task(i).paths.result_pickle.exists() for i in range(num_tasks))
    if not (finished or slurm_job_alive(previous["job_id"])):
        return None
    state = "has finished" if finished else "still runs"
    said = "reattaching to it instead of resuming (nothing new is submitted)"
    log.info("Slurm job %s, submitted for this config earlier, %s: %s", job.job_id, state, said)
    return job


def slurm_job_alive(job_id: str) -> bool:
    return bool(nodes.squeue_state(job_id))  # "" once it left the queue (or squeue failed)


def wait(
    job, job_name: str, poll_s: float, grace_s: float = 10.0, on_poll=None, watch=None, feed=None
) -> list:
    """Wait for every rank. Fail fast: once one rank has failed, the others get `grace_s` to
    write their own errors, then the job is cancelled (a hung or blocked rank would otherwise
    keep it alive until its time limit). watch(): True once Slurm requeued the job after a
    node failure (nodes.NodeFailureWatch): the job is cancelled, NodeLost raised. feed: a
    job that restarts its ranks itself (in_job.Feed): its failed step's results are moved
    aside for the next step, so a failure is acted on only once it stays (FEED_GRACE_S)."""
    start = time.monotonic()
    failed_at, cancelled, queued = None, False, poll.QueueTime(job, start)
    grace_s = grace_s if feed is None else max(grace_s, in_job.FEED_GRACE_S)
    while not job.done():
        queued.look()
        # the first failed rank's line (read once a poll: it reads every rank's result)
        first = failures.first_failure(job) if failed_at is None or feed else None
        if feed is not None:
            feed.poll()
            if failed_at is not None and first is None:
                failed_at = None  # the supervisor moved the failed step's results aside
        if watch is not None and watch():
            log.error("Slurm requeued job %s after a node failure: cancelling it", job.job_id)
            cancel_and_wait(job)
            raise NodeLost(
                f"{job_name} (job {job.job_id}): Slurm requeued the job after a node failure; "
                "ddpflow cancelled it (it would wait for the lost node)"
            )
        if failed_at is None and first is not None:
            failed_at = time.monotonic()
            took = failed_at - start
            then = "stopping the other ranks" if feed is None else IN_JOB_NEXT
            log.error("%s after %.1fs; %s", first, took, then)
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            # a local job's ranks must be gone before job.results(), which waits for them
            slurm = isinstance(job, submitit.SlurmJob)
            job.cancel(check=False) if slurm else cancel_and_wait(job)
            cancelled = True
            break
        if on_poll is not None:
            on_poll()
        time.sleep(poll_s)
    if on_poll is not None:
        on_poll()
    log.info("%s job %s ended after %s", job_name, job.job_id, queued.said())
    if feed is not None:  # the ranks of its last step (fewer after a shrink)
        job = feed.final_job(job)
    try:
        return job.results()
    except Exception as exc:  # every submitit failure becomes one clear error
        raise LaunchError(failure_message(job, job_name, cancelled)) from exc


def _interrupted(job, cancel: bool) -> None:
    if cancel:
        log.warning("interrupted: cancelling job %s", job.job_id)
        cancel_and_wait(job)
    else:
        log.warning(
            "interrupted: job %s keeps running (machine.cancel_on_interrupt is false); "
            "rerun the same command to reattach to it",
            job.job_id,
        )


def cancel_and_wait(job, timeout_s: float = 30.0) -> None:
    """Cancel only asks (submitit's local runner: SIGINT, then SIGKILL after ~1 s; Slurm:
    scancel): return once the ranks are really gone, so that nothing is left running; a
    local job that outlives its SIGINT has its ranks killed (interrupts.terminate_local)."""
    job.cancel(check=False)
    start = time.monotonic()
    deadline, delay, escalated = start + timeout_s, 0.2, isinstance(job, submitit.SlurmJob)
    # Slurm's: squeue is an RPC to slurmctld that admins count: back off to 2 s between them
    growth = 1.5 if isinstance(job, submitit.SlurmJob) else 1.0
    while _still_running(job) and time.monotonic() < deadline:
        if not escalated and time.monotonic() - start >= LOCAL_SIGINT_GRACE_S:
            escalated = terminate_local(job)
        time.sleep(delay)
        delay = min(2.0, delay * growth)
    if _still_running(job):
        log.error("job %s still runs %.0fs after the cancel", job.job_id, timeout_s)
    else:
        log.warning("job %s cancelled; nothing of it is running", job.job_id)


def _still_running(job) -> bool:
    if isinstance(job, submitit.SlurmJob):
        return slurm_job_alive(job.job_id)
    return not job.done()


def failure_message(job, job_name: str, cancelled: bool = False) -> str:
    """The LaunchError text: culprit ranks with host and cause, then the collateral ones
    (ddpflow.cluster.failures reads each rank's result pickle, log and srun's report)."""
    ranks = []
    for index in range(job.num_tasks):
        paths = job.task(index).paths
        ranks.append(failures.read_rank(index, paths.stderr, paths.stdout, paths.result_pickle))
    return failures.explain(job_name, job.job_id, job.paths.folder, ranks, cancelled)


def read_record(record: str | Path) -> dict | None:
    try:
        return json.loads(Path(record).read_text())
    except (OSError, ValueError):
        return None
