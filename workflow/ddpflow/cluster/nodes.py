"""Nodes that failed under a run's Slurm job: the ledger, and how they are found.

The ledger results/work/bad_nodes.json holds one entry per node (node, reason, job_id, run,
time). The launcher adds a node when a job of the workflow ends because of it: sacct shows a
run of the job in NODE_FAIL, or the job failed and the node is DOWN, DRAINED or FAILED in
`scontrol show node`. Every later Slurm submission of the workflow (the rule's retry, a
rerun) excludes the ledger's nodes (ddpflow.cluster.placement). `snakemake clean_bad_nodes`
clears it.

What Slurm itself does (measured on tests/slurm's cluster, Slurm 22.05, JobRequeue=1): a node
set DOWN under a running batch job ends that run as NODE_FAIL and REQUEUES the job under the
same id; if the partition then lacks the nodes, the requeued job pends forever (reason
"ReqNodeNotAvail" / "Nodes required for job are DOWN"), and submitit reads it as pending.
ddpflow cannot submit with --no-requeue (that also refuses the `scontrol requeue` which
submitit's time-limit and preemption path needs), so the launcher watches for a requeue after
a NODE_FAIL (NodeFailureWatch), cancels the requeued job and fails the rule naming the node;
the retry resubmits without it. Imports no torch.

    failed = failed_nodes("12")              # [{"node": "node2", "reason": ..., ...}]
    add_to_ledger(ledger, "cnn", "12", failed)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

from ddpflow import paths
from ddpflow.cluster.slurm_parse import (
    JobInstance,
    parse_job_instances,
    parse_node_events,
    parse_nodes,
)
from ddpflow.runtime import atomic_write_json

log = logging.getLogger(__name__)

QUERY_TIMEOUT_S = 30.0
SACCT_FIELDS = "JobID,State,NodeList,Start,End"
# a node DOWN event starting this long after the failed run's end still counts as its cause
EVENT_SLACK_S = 30.0


def ledger_beside(work: str | Path) -> Path:
    """The workflow's ledger, from a run's work folder (results/work/<run>/)."""
    return Path(work).parent / paths.BAD_NODES


def shown(path: str | Path) -> str:
    """A path as the user knows it: relative to the working directory where it is inside."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def read_ledger(path: str | Path) -> list[dict]:
    """The ledger's entries ([] without a ledger, or an unreadable one: a warning says so)."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        entries = json.loads(path.read_text())["nodes"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("ignoring the unreadable bad-node ledger %s (%s)", path, err)
        return []
    return [e for e in entries if isinstance(e, dict) and isinstance(e.get("node"), str)]


@contextlib.contextmanager
def _locked(folder: Path):
    """Runs' train rules run side by side: one read-modify-write of the ledger at a time."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def add_to_ledger(path: str | Path, run: str, job_id: str, failed: list[dict]) -> list[dict]:
    """Record failed nodes (one entry per node: a node failing again gets the new job's
    reason and a count); returns the entries written for them."""
    path = Path(path)
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    with _locked(path.parent):
        entries = {e["node"]: e for e in read_ledger(path)}
        for item in failed:
            count = entries.get(item["node"], {}).get("failures", 0) + 1
            entries[item["node"]] = {**item, "job_id": str(job_id), "run": run, "time": now,
                                     "failures": count}  # fmt: skip
        atomic_write_json(path, {"nodes": sorted(entries.values(), key=lambda e: e["node"])})
    return [entries[item["node"]] for item in failed]


def clear_ledger(path: str | Path) -> list[dict]:
    """Forget every node (they were repaired); returns the entries removed."""
    path = Path(path)
    with _locked(path.parent):
        entries = read_ledger(path)
        path.unlink(missing_ok=True)
    return entries


def _query(cmd: list[str]) -> str:
    """stdout of a Slurm client command, "" where it fails: finding the failed node must
    never hide the job's own failure."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.warning("%s failed: %s", " ".join(cmd), err)
        return ""
    if res.returncode != 0:
        log.warning("%s failed: %s", " ".join(cmd), res.stderr.strip())
    return res.stdout


def job_instances(job_id: str) -> tuple[JobInstance, ...]:
    """Every run of the job, requeued ones included (sacct -D)."""
    cmd = ["sacct", "-D", "-X", "-n", "-P", "-j", str(job_id), "-o", SACCT_FIELDS]
    return parse_job_instances(_query(cmd))


def failed_nodes(job_id: str, patience_s: float = 0.0, said: bool = False) -> list[dict]:
    """The nodes job_id failed on: [{"node", "reason", "state"}], [] where none is to blame.
    patience_s: how long to wait for accounting to show the NODE_FAIL (sacct lags). said:
    the job's log has Slurm's "DUE TO NODE FAILURE" line, so a node was lost even where
    accounting shows no NODE_FAIL run yet (slurmdbd lagged past the patience under load):
    a node back in service is then looked for in the node events of all the job's runs."""
    deadline = time.monotonic() + patience_s
    while True:
        runs = job_instances(job_id)
        lost = [r for r in runs if r.state == "NODE_FAIL"]
        if lost or time.monotonic() >= deadline:
            break
        time.sleep(2.0)
    used = sorted({node for r in runs for node in r.nodes})
    if not used:
        return []
    found = blame_nodes(job_id, lost, _query(["scontrol", "--all", "--oneliner", "show", "node",
                                              ",".join(used)]))  # fmt: skip
    candidates = lost or (list(runs) if said else [])
    if candidates and not found:  # back in service already (ReturnToService): events know
        found = blame_from_events(job_id, candidates, _events(candidates))
    return found


def blame_nodes(job_id: str, lost: list[JobInstance], node_text: str) -> list[dict]:
    """The job's nodes that Slurm holds down, drained or failed now (scontrol show node)."""
    in_lost = {node for r in lost for node in r.nodes}
    out = []
    for node in parse_nodes(node_text):
        if not node.unhealthy:
            continue
        cause = f"NODE_FAIL in job {job_id}" if node.name in in_lost else f"job {job_id} failed"
        why = f"{node.state}: {node.reason}" if node.reason else node.state
        out.append({"node": node.name, "reason": f"{cause} (node {why})", "state": node.state})
    return out


def _events(lost: list[JobInstance]) -> str:
    names = ",".join(sorted({node for r in lost for node in r.nodes}))
    start = min(r.start for r in lost)
    cmd = ["sacctmgr", "-nP", "show", "event", f"Nodes={names}", f"Start={start}",
           "format=NodeName,TimeStart,TimeEnd,State,Reason"]  # fmt: skip
    return _query(cmd)


def _parse_time(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def blame_from_events(job_id: str, lost: list[JobInstance], event_text: str) -> list[dict]:
    """Nodes of a NODE_FAIL run that went DOWN (or FAIL) while it ran, from slurmdbd's node
    events: what names a node that was back in service before anyone looked."""
    out = {}
    for event in parse_node_events(event_text):
        began = _parse_time(event.start)
        if began is None or not {"DOWN", "FAIL"} & set(event.state.upper().split("+")):
            continue
        for run in lost:
            # a run accounting still shows running (End Unknown) has not ended yet
            start, end = _parse_time(run.start), _parse_time(run.end) or time.time()
            if event.node in run.nodes and start is not None and end is not None and (
                start <= began <= end + EVENT_SLACK_S
            ):  # fmt: skip
                why = f"{event.state}: {event.reason}" if event.reason else event.state
                out[event.node] = {
                    "node": event.node,
                    "reason": f"NODE_FAIL in job {job_id} (node {why} at {event.start}, back "
                    "in service since)",
                    "state": event.state,
                }
    return list(out.values())


class NodeFailureWatch:
    """While a Slurm job runs: True once Slurm requeued it after a node failure (the requeued
    job would wait for nodes that may never come back). Reads the job's runs (`sacct -D`:
    one line per run, requeued ones included) from `source()`, the workflow's shared status
    (ddpflow.cluster.poll: one query per interval for all its jobs), or by itself every
    `every_s` without a source. A new run after one in NODE_FAIL is a node-failure requeue;
    a time limit or preemption requeue also adds a run, with its earlier run REQUEUED."""

    def __init__(self, job_id: str, every_s: float = 15.0, source=None):
        self.job_id, self.every_s = str(job_id), every_s
        self.source = source or (lambda: job_instances(self.job_id))
        self.next_at = time.monotonic() + every_s
        self.restarts = 0

    def __call__(self) -> bool:
        if time.monotonic() < self.next_at:
            return False
        self.next_at = time.monotonic() + self.every_s
        runs = self.source()
        restarts = len(runs) - 1  # accounting shows a requeue once the new run is there
        if restarts <= self.restarts:
            return False
        self.restarts = restarts
        return any(r.state == "NODE_FAIL" for r in runs[:-1])


# squeue states of a job that may still run (again); NODE_FAIL: Slurm's requeue may follow
LIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
               "SUSPENDED", "RESIZING", "NODE_FAIL", "COMPLETING"}  # fmt: skip


def cancel_requeued(job, timeout_s: float = 30.0) -> None:
    """Slurm requeues a NODE_FAIL job (JobRequeue=1) a few seconds after the failure, under
    the same id: it would pend for the lost node, or rerun behind the retry's back into the
    same work folder. Cancel it, also when the requeue comes after a first cancel."""
    deadline, state = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        state = squeue_state(job.job_id)
        if state not in LIVE_STATES:
            return
        if state != "NODE_FAIL":
            job.cancel(check=False)
        time.sleep(2.0)
    if state == "COMPLETING":  # cancelled; Slurm winds it down once the lost node answers
        log.warning(
            "job %s, cancelled after its node failure, is still completing %.0fs later (Slurm "
            "waits for the lost node); should Slurm requeue it after all, scancel %s",
            job.job_id,
            timeout_s,
            job.job_id,
        )
        return
    log.error("job %s is still %s %.0fs after its node failure", job.job_id, state, timeout_s)


def squeue_state(job_id: str) -> str:
    """The job's state in squeue; "" once it left the queue (squeue then exits non-zero)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"],
                             capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def after_success(job, ledger: str | Path, run: str, batch_log: str | Path) -> None:
    """Called when every rank of a Slurm job returned: a node can still have failed under it.
    Slurm then ends the run as NODE_FAIL and signals the ranks, which ignore the SIGTERM
    (submitit bypasses it) and may finish their work within KillWait (seen at 8 nodes on
    tests/slurm's cluster); Slurm requeues the job all the same, and the requeued job would
    wait for the lost node or, once it is back, train again in the finished run's folder.
    The results stand; the node goes into the ledger and the requeued job is cancelled.
    batch_log: the job's own log (rank 0's stderr), where Slurm writes "... DUE TO NODE
    FAILURE"."""
    try:
        text = Path(batch_log).read_text(errors="replace")
    except OSError:
        text = ""
    if "DUE TO NODE FAILURE" not in text:
        return  # the usual end: no Slurm query
    failed = failed_nodes(job.job_id, patience_s=10.0, said=True)
    if failed:
        line = describe(add_to_ledger(ledger, run, job.job_id, failed), ledger)
        log.warning("run %r: job %s finished its work, but %s", run, job.job_id, line)
    cancel_requeued(job)


def describe(failed: list[dict], ledger: str | Path) -> str:
    """The first line of a failure caused by nodes: which, why, and what happens next."""
    names = ", ".join(f"{e['node']} ({e['reason']})" for e in failed)
    return (
        f"node failure: {names}; recorded in the bad-node ledger {shown(ledger)}: the rule's "
        "retry or a rerun submits without it (machine.min_nodes lets it run on fewer nodes); "
        "once repaired, `snakemake clean_bad_nodes` clears the ledger"
    )


def after_failure(job_id: str, ledger: str | Path, run: str, requeued: bool, text: str) -> str:
    """Called when a Slurm job failed: find the nodes to blame, record them, and return the
    line that goes first in the rule's error ("" where no node is to blame)."""
    said = "DUE TO NODE FAILURE" in text
    expected = requeued or said
    failed = failed_nodes(job_id, patience_s=10.0 if expected else 0.0, said=said)
    if not failed:
        if expected:
            log.warning("job %s lost a node, but Slurm names none down now: nothing excluded",
                        job_id)  # fmt: skip
        return ""
    entries = add_to_ledger(ledger, run, job_id, failed)
    log.error("run %r: %s", run, describe(entries, ledger))
    return describe(entries, ledger)
