"""Restarts inside the allocation, login side: what a Slurm training job asks for and how
the login node follows its restarts (the job side: ddpflow.cluster.supervise).

With machine.restarts_in_job > 0 (the default, 3) the training job's batch script runs the
supervisor in front of submitit's srun. machine.spare_nodes: K asks for nodes + K nodes; with
spares, or machine.min_nodes below machine.nodes, the job is submitted with sbatch's
--no-kill, so that Slurm takes a failed node away from the job instead of ending it. The
login node follows the supervisor's events file: a line in the terminal for each failure,
restart and first step after it, the lost nodes into the bad-node ledger at once (so other
runs' jobs avoid them), the result of the ranks of the last step, and the supervisor's reason
first in the rule's error when it gives up. Imports no torch.

    in_job = plan(run, paths)                    # None: the job's batch script runs srun itself
    executor = Executor(folder, in_job, python=python)
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import submitit

from ddpflow.cluster import nodes
from ddpflow.cluster import supervise as supervisor_module
from ddpflow.cluster.placement import accepts
from ddpflow.config.machine import ranks_per_node
from ddpflow.paths import REACHED, RESTART_EVENTS, RunPaths
from ddpflow.words import counted

log = logging.getLogger(__name__)

SUPERVISOR = "ddpflow_supervise.py"  # the supervisor's copy in the job folder
PLAN = "ddpflow_in_job.json"
# how long a failed rank's result may stand before the login node ends a supervised job
# itself: the supervisor moves a failed step's results aside within seconds when it restarts
FEED_GRACE_S = 60.0


@dataclass(frozen=True, slots=True)
class InJob:
    """What a training job's supervisor does: the ranks' node count (nodes) and spares,
    the restarts it may make, the node counts the run accepts (largest first: nodes, then
    fewer down to machine.min_nodes), the ranks per node, its events file and the REACHED
    file of the run's checkpoints."""

    nodes: int
    spares: int
    restarts: int
    counts: tuple[int, ...]
    ranks_per_node: int
    events: Path
    reached: Path

    @property
    def no_kill(self) -> bool:
        """Whether a lost node has a successor in the job (a spare, or fewer nodes): then
        Slurm must keep the job alive when it takes a node away (--no-kill)."""
        return self.spares > 0 or len(self.counts) > 1

    def as_plan(self, job_folder: Path) -> dict:
        return {
            "restarts": self.restarts,
            "counts": list(self.counts),
            "ranks_per_node": self.ranks_per_node,
            "events": str(self.events),
            "reached": str(self.reached),
            "job_folder": str(job_folder),
        }


def plan(run: dict, paths: RunPaths) -> InJob | None:
    """The run's training job's restarts inside the allocation (None: under the local
    launcher, or with machine.restarts_in_job 0)."""
    machine = run["machine"]
    if run["launcher"] != "slurm" or not machine.get("restarts_in_job", 0):
        return None
    wanted = machine["nodes"]
    fewest = min(machine["min_nodes"] or wanted, wanted)
    counts = [wanted] + [c for c in range(wanted - 1, fewest - 1, -1) if accepts(run, c) is None]
    work = Path(paths.work).resolve()
    return InJob(
        nodes=wanted,
        spares=machine.get("spare_nodes", 0),
        restarts=machine["restarts_in_job"],
        counts=tuple(counts),
        ranks_per_node=ranks_per_node(machine),
        events=work / RESTART_EVENTS,
        reached=work / REACHED,
    )


def slurm_parameters(params: dict, in_job: InJob) -> dict:
    """submitit's parameters for a supervised job: nodes + spares, --no-kill where a lost
    node has a successor."""
    params = {**params, "nodes": in_job.nodes + in_job.spares}
    if in_job.no_kill:
        params["additional_parameters"] = {**params["additional_parameters"], "no-kill": True}
    return params


class Executor(submitit.SlurmExecutor):
    """submitit's Slurm executor whose batch script runs the supervisor in front of srun,
    and whose job has the ranks of `nodes` nodes (not of the spares)."""

    def __init__(self, folder, in_job: InJob, **kwargs):
        super().__init__(folder, **kwargs)
        self.in_job = in_job

    def _num_tasks(self) -> int:
        return self.in_job.nodes * self.in_job.ranks_per_node

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return supervised(
            super()._make_submission_file_text(command, uid), Path(self.folder), self.in_job
        )


def supervised(script: str, folder: Path, in_job: InJob) -> str:
    """The batch script with its srun line run by the supervisor (copied into the job's
    folder with its plan), under the login node's Python where the node has it, else the
    node's python3."""
    folder = folder.resolve()
    shutil.copyfile(supervisor_module.__file__, folder / SUPERVISOR)
    (folder / PLAN).write_text(json.dumps(in_job.as_plan(folder), indent=1) + "\n")
    lines = script.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith("srun ")]
    python = shlex.quote(sys.executable)
    lines[at] = (
        f"DDPFLOW_PY=$(command -v {python} || command -v python3)\n"
        f'"$DDPFLOW_PY" {shlex.quote(str(folder / SUPERVISOR))} '
        f"--plan {shlex.quote(str(folder / PLAN))} -- {lines[at]}"
    )
    return "\n".join(lines) + "\n"


class Feed:
    """The login node's view of a supervised job: its events as they come (a terminal line
    each; lost nodes into the ledger at once), the ranks of its last step, why it gave up."""

    def __init__(self, in_job: InJob, run_name: str, ledger: Path | None, job):
        self.in_job, self.run_name, self.ledger = in_job, run_name, ledger
        self.job_id = str(job.job_id)  # the events file holds every job of the run
        self.offset = 0
        self.world_size = job.num_tasks
        self.gave_up: str | None = None

    def poll(self) -> None:
        """Read and tell the events written since the last poll."""
        try:
            with open(self.in_job.events, encoding="utf-8") as events:
                events.seek(self.offset)
                text = events.read()
        except OSError:
            return
        complete = text[: text.rfind("\n") + 1]  # a line being written waits for the next poll
        self.offset += len(complete.encode())
        for line in complete.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("job") == self.job_id:
                self.tell(event)

    def tell(self, event: dict) -> None:
        kind, run = event.get("event"), self.run_name
        if kind == "start":
            self.world_size = event["world_size"]
            if event.get("restart"):
                log.warning(
                    "run %r: restart %d inside job %s on %s, %s%s, from the newest checkpoint",
                    run,
                    event["restart"],
                    event["job"],
                    ",".join(event["nodes"]),
                    counted(event["world_size"], "rank"),
                    _spares(event),
                )
        elif kind == "failed":
            self.record_lost(event)
        elif kind == "resumed":
            log.warning(
                "run %r: training again %.1fs after the failure (its first optimizer step)",
                run,
                event["seconds_to_next_step"],
            )
        elif kind == "gave_up":
            self.gave_up = event["why"]
            log.error(
                "run %r: job %s does not restart its ranks: %s", run, event["job"], event["why"]
            )

    def record_lost(self, event: dict) -> None:
        lost = event.get("lost") or {}
        said = ", ".join(f"{n} ({why})" for n, why in lost.items()) or "no node lost"
        log.error(
            "run %r: the ranks of job %s failed (exit code %s) after step %s: %s",
            self.run_name,
            event["job"],
            event["rc"],
            event.get("reached"),
            said,
        )
        if self.ledger is None:
            return
        # a rerun that reattaches reads the job's events again: a node is counted once a job
        known = {(e["node"], e.get("job_id")) for e in nodes.read_ledger(self.ledger)}
        failed = [
            {"node": n, "reason": f"lost in job {event['job']}: {why}"}
            for n, why in lost.items()
            if (n, str(event["job"])) not in known
        ]
        if failed:
            try:
                nodes.add_to_ledger(self.ledger, self.run_name, event["job"], failed)
            except OSError as err:
                log.error("could not record the lost nodes in %s: %s", self.ledger, err)

    def final_job(self, job):
        """The job as its last step ran it: the ranks of fewer nodes after a shrink."""
        self.poll()
        if self.world_size == job.num_tasks:
            return job
        return submitit.SlurmJob(job.paths.folder, job.job_id, tasks=range(self.world_size))


def _spares(event: dict) -> str:
    spares = event.get("spares_in") or []
    return f" (spare {', '.join(spares)} in)" if spares else ""


def note_restart(segment: dict, environ=None) -> None:
    """Rank side: a segment that a supervised job's restarted step trains names its job and
    restart (annotate() adds what happened before it)."""
    environ = os.environ if environ is None else environ
    restart = int(environ.get(supervisor_module.ATTEMPT_ENV) or 0)
    if restart:
        segment["restart_in_job"] = {"job": environ.get("SLURM_JOB_ID", ""), "restart": restart}


def read_events(path: Path) -> list[dict]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return events


def annotate(segments: list[dict], events_path: Path) -> None:
    """Rank 0, at the end: each restarted segment gets what its supervisor saw: the failure
    before it (lost nodes, exit code, the step reached, when) and the seconds from that
    failure to its first optimizer step."""
    events = read_events(events_path)
    for segment in segments:
        restart = segment.get("restart_in_job")
        if not restart or "after" in restart:
            continue
        job, number = restart["job"], restart["restart"]
        mine = [e for e in events if e.get("job") == job]
        after = {}
        for event in (e for e in mine if e["event"] == "failed" and e["restart"] == number - 1):
            after = {key: event.get(key) for key in ("lost", "rc", "reached")}
            after["failed_at"] = event["time"]
        for event in (e for e in mine if e["event"] == "resumed" and e["restart"] == number):
            after["seconds_to_next_step"] = event["seconds_to_next_step"]
        restart["after"] = after
