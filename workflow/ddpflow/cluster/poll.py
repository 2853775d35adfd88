"""One Slurm status query per interval for all the Slurm jobs of a workflow.

Every train/evaluate rule is its own process that waits for its own Slurm job. Left alone,
each would poll Slurm for its job (submitit's watcher runs sacct, the node-failure watch ran
`scontrol show job` every 15 s): N concurrent runs, N clients hammering slurmctld/slurmdbd.
Here they share one status folder per workflow (results/work/.slurm_status/):

    jobs/<job id>.<host>.<pid>   one registration per waiting process; its mtime is a heartbeat
    status.json                  the last query's answer for every registered job, and its time
    lock                         flock'ed by the one process that queries
    queries.log                  one JSON line per query made (time, pid, job count, exit code)

A process that finds status.json older than the interval tries the lock without blocking;
the winner re-reads the cache (another may just have refreshed it), runs ONE
`sacct -D -X -j id1,id2,...` for every registered job, and replaces status.json atomically.
The others read the answer they have (at most one interval old). Registrations are removed by
their process when it stops waiting, and by the querying process once their heartbeat is
older than `stale_s` (a killed process). `sacct -D` lists every run of a job, requeued ones
included: the node-failure watch (ddpflow.cluster.nodes.NodeFailureWatch) and submitit's job
state (SharedWatcher, plugged in as the job's watcher) both read it from the same answer.

Interval: DEFAULT_INTERVAL_S (15 s, the node-failure watch's period before), or
$DDPFLOW_SLURM_POLL_S. Imports no torch.

    status = status_for(ledger, job_folder)     # results/work/.slurm_status
    with attached(job, status):                 # job.done()/results() read the shared answer
        job.results()
    status.instances(job.job_id)                # (JobInstance, ...) from the last query
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import subprocess
import time
from pathlib import Path

import submitit
from submitit.slurm.slurm import SlurmInfoWatcher

from ddpflow.cluster.slurm_parse import JobInstance, parse_job_instances
from ddpflow.runtime import atomic_write_json

log = logging.getLogger(__name__)

INTERVAL_ENV = "DDPFLOW_SLURM_POLL_S"
DEFAULT_INTERVAL_S = 15.0
FOLDER = ".slurm_status"
SACCT_FIELDS = "JobID,State,NodeList,Start,End"
QUERY_TIMEOUT_S = 60.0
MAX_LOG_BYTES = 1 << 20  # queries.log is rotated once (to queries.log.1) past this size


def interval_s() -> float:
    """The polling interval: $DDPFLOW_SLURM_POLL_S (tests shorten it) or the default."""
    try:
        value = float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S))
    except ValueError:
        log.warning("ignoring %s=%r (not a number)", INTERVAL_ENV, os.environ[INTERVAL_ENV])
        return DEFAULT_INTERVAL_S
    return max(value, 0.5)


def sacct_command(job_ids) -> list[str]:
    """The one query: every run (-D) of every job, allocations only (-X), parsable."""
    ids = ",".join(sorted(set(map(str, job_ids)), key=lambda x: (len(x), x)))
    return ["sacct", "-D", "-X", "-n", "-P", "-j", ids, "-o", SACCT_FIELDS]


class SharedStatus:
    """The status folder of one workflow (see the module docstring)."""

    def __init__(self, folder: str | Path, every_s: float | None = None,
                 stale_s: float | None = None):  # fmt: skip
        self.folder = Path(folder)
        self.every_s = interval_s() if every_s is None else every_s
        # a waiting process beats every few seconds; silence this long means it is gone
        self.stale_s = max(5 * self.every_s, 60.0) if stale_s is None else stale_s
        self.jobs_dir = self.folder / "jobs"
        self.cache = self.folder / "status.json"
        self.lock = self.folder / "lock"
        self.log_file = self.folder / "queries.log"
        self.me = f"{socket.gethostname()}.{os.getpid()}"

    # ------------------------------------------------------------ registrations
    def _entry(self, job_id: str) -> Path:
        return self.jobs_dir / f"{job_id}.{self.me}"

    def register(self, job_id: str) -> None:
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        self._entry(str(job_id)).write_text(json.dumps({"job_id": str(job_id),
                                                        "since": time.time()}))  # fmt: skip

    def unregister(self, job_id: str) -> None:
        self._entry(str(job_id)).unlink(missing_ok=True)

    def heartbeat(self, job_id: str) -> None:
        try:
            os.utime(self._entry(str(job_id)))
        except FileNotFoundError:  # removed as stale while this process was stopped
            self.register(job_id)

    def registered(self, prune: bool = False) -> set[str]:
        """Job ids some live process waits for; prune: delete registrations gone stale."""
        ids, now = set(), time.time()
        for entry in self.jobs_dir.glob("*.*"):
            try:
                age = now - entry.stat().st_mtime
            except FileNotFoundError:
                continue
            if age > self.stale_s:
                if prune:
                    log.info("forgetting the stale status registration %s", entry.name)
                    entry.unlink(missing_ok=True)
                continue
            ids.add(entry.name.split(".", 1)[0])
        return ids

    # ------------------------------------------------------------ the shared answer
    def read(self) -> dict:
        try:
            data = json.loads(self.cache.read_text())
        except (OSError, ValueError):
            return {"time": 0.0, "jobs": {}}
        return data if isinstance(data, dict) and isinstance(data.get("jobs"), dict) else {
            "time": 0.0, "jobs": {}}  # fmt: skip

    def _fresh(self, data: dict) -> bool:
        return time.time() - float(data.get("time", 0.0)) < self.every_s

    def current(self) -> dict:
        """The last answer; refreshed first (by this process, or by one that holds the lock
        already) when it is older than the interval."""
        data = self.read()
        if self._fresh(data):
            return data
        with self._leadership() as leader:
            if not leader:
                return data  # another process is querying: its answer comes next interval
            data = self.read()
            if not self._fresh(data):
                data = self._refresh(data)
        return data

    @contextlib.contextmanager
    def _leadership(self):
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # releases the lock

    def _refresh(self, previous: dict) -> dict:
        """One query for every registered job; a failed query keeps the previous answer
        (with the new time, so that a broken sacct is not called by every process)."""
        ids = self.registered(prune=True)
        data = {"time": time.time(), "jobs": {}, "queries": previous.get("queries", 0)}
        if ids:
            ok, runs = self._query(ids)
            data["queries"] += 1
            old = previous.get("jobs", {})
            data["jobs"] = {i: runs[i] if ok and i in runs else old.get(i) for i in ids}
            data["jobs"] = {i: v for i, v in data["jobs"].items() if v is not None}
        atomic_write_json(self.cache, data)
        return data

    def _query(self, ids: set[str]) -> tuple[bool, dict]:
        cmd = sacct_command(ids)
        start = time.time()
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
            rc, out, err = res.returncode, res.stdout, res.stderr.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            rc, out, err = -1, "", str(exc)
        self._log_query(start, len(ids), rc)
        if rc != 0:
            log.warning("%s failed (%s); job states may lag", " ".join(cmd[:3]), err)
            return False, {}
        runs: dict[str, list] = {}
        for run in parse_job_instances(out):
            runs.setdefault(run.job_id, []).append([run.state, list(run.nodes), run.start,
                                                    run.end])  # fmt: skip
        return True, runs

    def _log_query(self, start: float, count: int, rc: int) -> None:
        with contextlib.suppress(OSError):
            if self.log_file.exists() and self.log_file.stat().st_size > MAX_LOG_BYTES:
                self.log_file.replace(self.log_file.with_suffix(".log.1"))
            line = json.dumps({"time": round(start, 3), "pid": os.getpid(), "jobs": count,
                               "rc": rc, "seconds": round(time.time() - start, 3)})  # fmt: skip
            with open(self.log_file, "a") as fh:
                fh.write(line + "\n")

    # ------------------------------------------------------------ what callers read
    def instances(self, job_id: str) -> tuple[JobInstance, ...]:
        """Every run of the job as of the last query (() before its first answer)."""
        runs = self.current()["jobs"].get(str(job_id)) or []
        return tuple(JobInstance(str(job_id), s, tuple(n), a, b) for s, n, a, b in runs)


def status_for(ledger: str | Path | None, job_folder: str | Path) -> SharedStatus:
    """The workflow's status folder, beside its bad-node ledger (results/work/); a launch
    without a ledger (a one-off job) keeps its own in the job's folder."""
    return SharedStatus((Path(ledger).parent if ledger is not None else Path(job_folder)) / FOLDER)


def query_count(folder: str | Path) -> int:
    """Queries made for the workflow's status folder so far (lines of queries.log)."""
    try:
        return len(Path(folder, "queries.log").read_text().splitlines())
    except OSError:
        return 0


class SharedWatcher(SlurmInfoWatcher):
    """submitit's watcher for a job (SlurmJob.watcher) that asks nobody: update() reads the
    workflow's shared answer (SharedStatus), which one process refreshes per interval."""

    def __init__(self, status: SharedStatus):
        super().__init__(delay_s=max(int(status.every_s), 1))
        self.status = status

    def update(self) -> None:
        for job_id in self._registered - self._finished:
            self.status.heartbeat(job_id)
        jobs = self.status.current()["jobs"]
        self._num_calls += 1
        for job_id in self._registered:
            runs = jobs.get(job_id)
            if runs:  # the last run is the job's current state (as plain sacct shows it)
                state, nodes, _, _ = runs[-1]
                self._info_dict[job_id] = {"JobID": job_id, "State": state,
                                           "NodeList": ",".join(nodes)}  # fmt: skip
        self._last_status_check = time.time()
        for job_id in self._registered - self._finished:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)


@contextlib.contextmanager
def attached(job, status: SharedStatus):
    """While inside: the job (and its per-task sub-jobs) read their state from the shared
    answer, and the job is registered in the status folder; unregistered on the way out."""
    watcher = SharedWatcher(status)
    job_id = str(job.job_id)
    status.register(job_id)
    for one in [job, *getattr(job, "_sub_jobs", [])]:
        one.watcher = watcher  # an instance attribute hides submitit's per-process class one
    watcher.register_job(job_id)
    try:
        yield watcher
    finally:
        status.unregister(job_id)


class QueueTime:
    """How long a Slurm job waited in the queue before its ranks started: read from the
    state submitit's watcher already holds (the workflow's shared sacct answer: no query of
    its own), so a job's time is said as pending and running, not all as running."""

    WAITING = ("PENDING", "UNKNOWN", "READY", "REQUEUED", "CONFIGURING")

    def __init__(self, job, start: float):
        self.job, self.start = job, start
        self.pending_s: float | None = None

    def look(self) -> None:
        slurm = isinstance(self.job, submitit.SlurmJob)
        if self.pending_s is None and slurm and self.job.state not in self.WAITING:
            self.pending_s = time.monotonic() - self.start
            log.info("job %s started after %.1fs in the queue", self.job.job_id, self.pending_s)

    def said(self) -> str:
        total = time.monotonic() - self.start
        if self.pending_s is None:
            return f"{total:.1f}s"
        return (
            f"{total:.1f}s ({self.pending_s:.1f}s pending, {total - self.pending_s:.1f}s running)"
        )
