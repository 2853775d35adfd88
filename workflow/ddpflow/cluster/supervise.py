"""Restarts inside a Slurm training job: the supervisor its batch script runs instead of srun.

A training job with machine.restarts_in_job > 0 runs this file (copied into the job's private
folder by ddpflow.cluster.in_job, run with the login node's Python or the node's python3; it
imports only the standard library, so an image-based job needs nothing of ddpflow outside
its image). It starts the ranks as one job step on `nodes` of the job's nodes and, when the
step fails:
- a node gone from the job (sbatch --no-kill keeps the job alive when Slurm takes a node
  away) or held DOWN, DRAINED, FAILED or NOT_RESPONDING is lost: a spare node of the same
  allocation takes its place (the world size stays, so the run stays bit for bit the
  uninterrupted one); with no spare left, fewer nodes if the login node allowed them
  (machine.min_nodes: the counts the run's checks accept);
- a rank that died on a healthy node restarts in place;
- the ranks resume from the newest checkpoint, as after any failure.
It stops, with the step's exit code (the rule's retry takes over, as without it), when the
restarts are spent, when a failure repeats at the step the one before failed at (a crash
that a restart does not cure), when too few healthy nodes are left, or when Slurm ends the
job (a requeue at the time limit or a preemption, a cancel).

Every decision is one JSON line in the events file (the run's work folder), which the login
node follows (the terminal, the bad-node ledger) and rank 0 records in the run's segments:
start, failed (nodes lost, exit code, step reached), resumed (seconds from the failure to
the first step after it), gave_up, done.

    python ddpflow_supervise.py --plan plan.json -- srun --unbuffered ... python -m ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# Slurm node states (scontrol's State=, '+'-joined flags) that take a node out of service
BAD_STATES = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "REBOOT", "POWER")
POLL_S = 0.1  # how often the step's progress (the REACHED file) is looked at
QUERY_TIMEOUT_S = 30.0
ATTEMPT_ENV = "DDPFLOW_RESTART_IN_JOB"  # the step's restart number (0: the first step)


def say(text: str) -> None:
    """A line in the job's batch log (rank 0's stderr file)."""
    print(f"ddpflow supervisor: {text}", file=sys.stderr, flush=True)


def scontrol(*args: str) -> str:
    """scontrol's output ("" where it fails: the caller treats that as nothing known)."""
    try:
        out = subprocess.run(
            ["scontrol", *args], capture_output=True, text=True, timeout=QUERY_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        say(f"scontrol {' '.join(args)} failed: {err}")
        return ""
    return out.stdout if out.returncode == 0 else ""


def fields(oneliner: str) -> dict[str, str]:
    """'JobId=12 JobState=RUNNING NodeList=node[1,3]' -> {"JobId": "12", ...} (values hold no
    spaces in the keys read here)."""
    found = {}
    for word in oneliner.split():
        key, sep, value = word.partition("=")
        if sep and key not in found:
            found[key] = value
    return found


def hostnames(nodelist: str) -> list[str]:
    """Slurm's compressed list expanded by Slurm itself ('node[1,3]' -> node1 node3)."""
    if not nodelist or nodelist == "(null)":
        return []
    return scontrol("show", "hostnames", nodelist).split()


def job_now(job_id: str) -> tuple[str, list[str]]:
    """(JobState, the nodes the job holds now): with --no-kill a lost node leaves NodeList,
    while SLURM_JOB_NODELIST keeps the list the job started with."""
    info = fields(scontrol("--oneliner", "show", "job", job_id))
    return info.get("JobState", ""), hostnames(info.get("NodeList", ""))


def node_states(names: list[str]) -> dict[str, str]:
    """Each node's State (e.g. IDLE, MIXED, DOWN+NOT_RESPONDING)."""
    states: dict[str, str] = {}
    if not names:
        return states
    for line in scontrol("--oneliner", "show", "node", ",".join(names)).splitlines():
        info = fields(line)
        if "NodeName" in info:
            states[info["NodeName"]] = info.get("State", "")
    return states


def out_of_service(state: str) -> bool:
    return any(bad in state.replace("*", "+NOT_RESPONDING").split("+") for bad in BAD_STATES)


def lost_nodes(used: list[str], held: list[str], states: dict[str, str]) -> dict[str, str]:
    """The nodes of the failed step that are lost, each with why: gone from the job, or out
    of service in Slurm."""
    lost = {}
    for node in used:
        if node not in held:
            lost[node] = f"{states.get(node) or 'gone'} in Slurm, taken out of the job"
        elif out_of_service(states.get(node, "")):
            lost[node] = f"{states[node]} in Slurm"
    return lost


def choose(held: list[str], used: list[str], bad: set[str], counts: list[int]) -> list[str]:
    """The nodes of the next step: the previous step's healthy nodes first (ranks keep their
    places), then spares in the job's order; the largest node count in `counts` (those the
    run accepts, largest first) that the healthy nodes fill; [] where none fits."""
    healthy = [n for n in held if n not in bad]
    ordered = [n for n in used if n in healthy] + [n for n in healthy if n not in used]
    for count in counts:
        if count <= len(ordered):
            return ordered[:count]
    return []


def stop_reason(restarts_done: int, plan: dict, reached, failed_before: list, lost) -> str | None:
    """Why the job must not restart again (None: restart). A failure with no node lost that
    comes at the step the one before came at is a crash a restart does not cure."""
    if restarts_done >= plan["restarts"]:
        spent = counted(plan["restarts"], "restart")
        verb = "is" if plan["restarts"] == 1 else "are"
        return f"its {spent} inside the job (machine.restarts_in_job) {verb} spent"
    if not lost and failed_before and failed_before[-1] == reached:
        where = "before its first step" if reached is None else f"at step {reached}"
        return f"the failure repeats {where}, as in the step before: a restart does not cure it"
    return None


def counted(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def read_reached(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def stamp(path: Path) -> tuple[int, str] | None:
    """The REACHED file's (mtime, content): it changes at every optimizer step."""
    try:
        return path.stat().st_mtime_ns, path.read_text()
    except OSError:
        return None


class Supervisor:
    """One training job's steps (see the module doc); plan: what the login node decided
    (nodes, restarts, the node counts the run accepts, the ranks per node, the files)."""

    def __init__(self, plan: dict, command: list[str], job_id: str):
        self.plan, self.command, self.job_id = plan, command, job_id
        self.events, self.reached = Path(plan["events"]), Path(plan["reached"])
        self.bad: set[str] = set()
        self.held: list[str] = []  # the job's nodes (Slurm takes a lost one away: --no-kill)
        self.failed_at: list = []  # the step reached at each failure
        self.failure_time: float | None = None

    def event(self, kind: str, **data) -> None:
        record = {"event": kind, "job": self.job_id, "time": time.time(), **data}
        with open(self.events, "a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")

    def srun(self, nodes: list[str]) -> list[str]:
        """The job's srun command on exactly these nodes (flags after `srun` override the
        allocation's shape)."""
        per_node = self.plan["ranks_per_node"]
        shape = [
            f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes) * per_node}",
            f"--ntasks-per-node={per_node}",
            f"--nodelist={','.join(nodes)}",
        ]
        return [self.command[0], *shape, *self.command[1:]]

    def run_step(self, nodes: list[str], restart: int) -> int:
        """One job step; notes the first optimizer step after a failure (resumed)."""
        env = {**os.environ, ATTEMPT_ENV: str(restart)}
        before = stamp(self.reached)
        step = subprocess.Popen(self.srun(nodes), env=env)
        while True:
            try:
                return step.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                pass
            if self.failure_time is not None and stamp(self.reached) != before:
                seconds = time.time() - self.failure_time
                self.event(
                    "resumed",
                    restart=restart,
                    seconds_to_next_step=round(seconds, 2),
                )
                say(f"restart {restart}: its first optimizer step {seconds:.1f}s after the failure")
                self.failure_time = None

    def run(self) -> int:
        used: list[str] = []
        restart = 0
        # the job's nodes as it started (`scontrol show hostnames` asks slurmctld nothing: no
        # query per job while nothing failed); after a failure, as Slurm holds them then
        self.held = hostnames(os.environ.get("SLURM_JOB_NODELIST", "")) or job_now(self.job_id)[1]
        while True:
            held = self.held
            nodes = choose(held, used, self.bad, self.plan["counts"])
            if not nodes:
                return self.give_up(
                    1, f"too few healthy nodes left: {held or 'none'} held, lost {sorted(self.bad)}"
                )
            spares = [n for n in nodes if used and n not in used]
            self.event(
                "start",
                restart=restart,
                nodes=nodes,
                spares_in=spares,
                world_size=len(nodes) * self.plan["ranks_per_node"],
            )
            say(
                f"job step {restart}: ranks on {','.join(nodes)}"
                + (f" (spare {','.join(spares)} in)" if spares else "")
            )
            code = self.run_step(nodes, restart)
            if code == 0:
                self.event("done", restart=restart)
                return 0
            stop = self.after_failure(code, nodes, restart)
            if stop is not None:
                return code
            used, restart = nodes, restart + 1

    def after_failure(self, code: int, nodes: list[str], restart: int) -> int | None:
        """Record the failed step; the exit code to end with, or None to restart."""
        self.failure_time = time.time()
        state, held = job_now(self.job_id)
        if state and state not in ("RUNNING", "COMPLETING"):
            say(f"job step {restart} ended ({code}) and the job is {state}: no restart")
            self.event("ended", restart=restart, rc=code, job_state=state)
            return code
        if not held:  # Slurm did not answer: no node is blamed on a failed query
            self.event("failed", restart=restart, rc=code, nodes=nodes, lost={}, reached=None)
            return self.give_up(code, "Slurm did not say which nodes the job holds")
        self.held = held
        reached = read_reached(self.reached)
        lost = lost_nodes(nodes, held, node_states(nodes))
        self.bad |= set(lost)
        self.event("failed", restart=restart, rc=code, nodes=nodes, lost=lost, reached=reached)
        said = ", ".join(f"{n} ({why})" for n, why in lost.items()) or "no node lost"
        say(f"job step {restart} failed ({code}) after optimizer step {reached}: {said}")
        why = stop_reason(restart, self.plan, reached, self.failed_at, lost)
        self.failed_at.append(reached)
        if why is not None:
            return self.give_up(code, why)
        self.keep_results(restart)
        return None

    def give_up(self, code: int, why: str) -> int:
        self.event("gave_up", rc=code, why=why)
        say(f"not restarting: {why}")
        return code

    def keep_results(self, restart: int) -> None:
        """The failed step's result files move aside (restart-<n>/ in the job folder): the
        next step's ranks write their own, and the login node reads only those."""
        folder = Path(self.plan["job_folder"])
        aside = folder / f"restart-{restart}"
        aside.mkdir(mode=0o700, exist_ok=True)
        for result in folder.glob(f"{self.job_id}_*_result.pkl"):
            result.rename(aside / result.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="the login node's plan (JSON file)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- srun ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    plan = json.loads(Path(args.plan).read_text())
    return Supervisor(plan, command, os.environ.get("SLURM_JOB_ID", "0")).run()


if __name__ == "__main__":
    sys.exit(main())
