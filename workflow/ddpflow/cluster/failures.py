"""Why did a distributed job fail? Name the culprit rank, its host and its cause.

When one rank of a DDP job dies, every other rank fails too: its next collective finds the
peer gone ("Connection closed by peer", a gloo/NCCL timeout). Those survivors write the loudest
errors, so reading the logs alone blames them. The cause has to come from the evidence that
each kind of death leaves behind:

* a rank that raised: submitit's result pickle, ("error", traceback text), for any exception
  class (not only names ending in Error); a BaseException such as KeyboardInterrupt is not
  pickled by submitit and only shows as a traceback in the rank's log;
* a rank that was killed (SIGKILL, out-of-memory killer, lost node): no result and no
  traceback. Under Slurm, srun says which tasks died and how ("srun: error: node2: tasks 2-3:
  Killed") in the job's batch stderr, which submitit shares with task 0 (`<jobid>_0_log.err`).
  submitit's local executor keeps no per-task exit status, so locally the signal is unknown;
* a rank that hung: it was still running when the launcher cancelled the job (submitit's
  local runner then interrupts it: a KeyboardInterrupt traceback shows where it was stuck).

Everything here is a pure function of file contents (plus whether the launcher cancelled the
job), so it is tested on files captured from real failures (tests/golden/failures/).
"""

from __future__ import annotations

import pickle
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

from ddpflow.words import counted

TAIL_LINES = 15
MAX_CAUSE_CHARS = 500

# What a rank reports when it only lost its peers (gloo, NCCL, the c10d store)
PEER_LOSS = re.compile(
    r"Connection closed by peer|Connection reset|remote worker crash|Broken pipe|"
    r"communicator was aborted|NCCL error|recvBytes|ProcessGroup.*abort|"
    r"Timed out waiting \d+ms|Watchdog caught collective operation timeout|"
    r"Application timeout caused pair closure"
)
TRACEBACK_HEADER = "Traceback (most recent call last):"
TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")  # torch prefixes tracebacks once dist is up
LOG_HOST = re.compile(r"\[rank (\d+) (\S+)\]")  # ddpflow.runtime.setup_logging's prefix
SUBMITIT_HOST = re.compile(r"JobEnvironment\(.*?hostname=([^,\s)]+)")  # submitit's first line
FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
# srun (Slurm >= 20): "srun: error: node2: tasks 2-3: Killed", "...: task 1: Exited with exit
# code 1", "...: task 0: Segmentation fault (core dumped)", "...: task 3: Out Of Memory"
SRUN_TASKS = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.+?)\s*$")
# slurmstepd: "*** STEP 3.0 ON node1 CANCELLED AT 2026-...T09:05:40 ***", "*** JOB 7 ON node1
# CANCELLED AT ... DUE TO TIME LIMIT ***"; "Detected 1 oom_kill event in StepId=7.0 ..."
STEP_CANCELLED = re.compile(r"^slurmstepd(?:-\S+)?: error: \*\*\* (?:STEP|JOB) .* CANCELLED AT")
STEP_NOTE = re.compile(r"^slurmstepd(?:-\S+)?: error: (.*(?:oom[-_]kill|DUE TO).*)$", re.I)
_KINDS = ("raised", "died", "stopped", "peer_loss")
SIGNAL_NAMES = {
    signal.strsignal(s): s.name for s in signal.Signals if signal.strsignal(s) is not None
}


@dataclass
class RankFiles:
    """What one rank left behind (file contents, not paths, so tests can build it directly)."""

    rank: int
    stderr: str = ""
    stdout: str = ""
    result: tuple | None = None  # submitit's result pickle, None if the rank wrote none
    log: str = ""  # the stderr file's path, shown to the user


@dataclass
class SrunReport:
    """One "srun: error: HOST: tasks N-M: STATUS" line, in the order srun printed it."""

    host: str
    tasks: list[int]
    status: str
    after_cancel: bool  # printed after slurmstepd cancelled the step: a consequence


@dataclass
class Verdict:
    """One rank's part in the failure."""

    rank: int
    host: str
    kind: str  # ok | raised | peer_loss | died | stopped
    cause: str = ""
    log: str = ""
    tail: str = ""


@dataclass
class Diagnosis:
    culprits: list[Verdict]
    collateral: list[Verdict]
    slurm_lines: list[str] = field(default_factory=list)
    only_peer_loss: bool = False  # no rank is known to have started it


def read_rank(rank: int, stderr: Path, stdout: Path, result_pickle: Path) -> RankFiles:
    """Read one rank's files (any of them may be missing: a killed rank writes no result)."""
    return RankFiles(rank, _read(stderr), _read(stdout), read_result(result_pickle), str(stderr))


def read_result(path: Path) -> tuple | None:
    """submitit's result pickle: ("error", traceback text) or ("success", value). None when
    absent; ("unreadable", reason) when it cannot be loaded (torn, or a value whose class
    cannot be imported here): then the rank's log has to tell what happened."""
    try:
        with open(path, "rb") as handle:
            return pickle.load(handle)
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - a half-written or foreign pickle is still evidence
        return ("unreadable", f"{type(exc).__name__}: {exc}")


def final_exception(traceback_text: str) -> str | None:
    """'module.Type: first line of message' of the exception a traceback ends with (the last
    one of a chain). Any class name: the line after the frames, not a name pattern."""
    lines = [TORCH_RANK_PREFIX.sub("", line) for line in traceback_text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith(TRACEBACK_HEADER)]
    if not starts:
        return None
    for line in lines[starts[-1] + 1 :]:
        if line.strip() and not line[0].isspace():
            return line.strip()[:MAX_CAUSE_CHARS]
    return None


def last_frame(traceback_text: str) -> str | None:
    """'file:line in function: code' of the innermost frame of the last traceback: where a
    hung rank was when it was interrupted."""
    lines = [TORCH_RANK_PREFIX.sub("", line) for line in traceback_text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith(TRACEBACK_HEADER)]
    if not starts:
        return None
    found = None
    body = lines[starts[-1] + 1 :]
    for index, line in enumerate(body):
        if line and not line[0].isspace():
            break
        if match := FRAME.match(line):
            code = body[index + 1].strip() if index + 1 < len(body) else ""
            found = f"{match[1]}:{match[2]} in {match[3]}" + (f": {code}" if code else "")
    return found


def host_of(files: RankFiles, srun: list[SrunReport]) -> str:
    """The rank's host: ddpflow's log prefix, else submitit's start-up line, else srun."""
    if match := LOG_HOST.search(files.stderr):
        return match[2]
    if match := SUBMITIT_HOST.search(files.stdout):
        return match[1]
    return next((r.host for r in srun if files.rank in r.tasks), "?")


def srun_reports(batch_log: str) -> list[SrunReport]:
    """srun's per-task verdicts from the batch stderr, marking those printed after the step
    was cancelled (kill-on-bad-exit or scancel: consequences, not causes)."""
    reports, cancelled = [], False
    for line in batch_log.splitlines():
        if STEP_CANCELLED.match(line):
            cancelled = True
        elif match := SRUN_TASKS.match(line):
            reports.append(SrunReport(match[1], _task_ids(match[2]), match[3], cancelled))
    return reports


def slurm_lines(batch_log: str) -> list[str]:
    """Slurm's own lines about the step (srun verdicts, cancellation, OOM), for the message."""
    keep = (SRUN_TASKS, STEP_CANCELLED, STEP_NOTE)
    return [line.strip() for line in batch_log.splitlines() if any(p.match(line) for p in keep)]


def srun_cause(status: str) -> str:
    """Say what srun's status means: a signal name, or an exit code."""
    name = SIGNAL_NAMES.get(status.removesuffix(" (core dumped)"))
    if name == "SIGKILL":
        return f"killed by SIGKILL (srun: {status}; out of memory, kill -9 or a lost node)"
    if name:
        return f"killed by {name} (srun: {status})"
    if code := re.match(r"exited with exit code (\d+)", status, re.I):
        return f"exited with exit code {code[1]} without a Python traceback"
    return f"srun: {status}"


def classify(files: RankFiles, srun: list[SrunReport], cancelled: bool) -> Verdict:
    """One rank's verdict from its result pickle, its log, srun's report and whether the
    launcher cancelled the job."""
    verdict = Verdict(files.rank, host_of(files, srun), "ok", log=files.log, tail=_tail(files))
    result = files.result
    outcome = result[0] if result else None
    if outcome == "success":
        return verdict
    if result and outcome == "error":
        verdict.cause = final_exception(str(result[1])) or "raised (see its log)"
    else:  # no (readable) result: the log's traceback, if the rank got to print one
        verdict.cause = final_exception(files.stderr) or ""
    if verdict.cause:
        verdict.kind = "peer_loss" if PEER_LOSS.search(verdict.cause) else "raised"
        if cancelled and outcome is None and verdict.cause.startswith("KeyboardInterrupt"):
            verdict.kind = "stopped"  # submitit's local runner interrupts what is left running
            where = last_frame(files.stderr)
            verdict.cause = "still running when the launcher cancelled the job (hung?)" + (
                f"; it was at {where}" if where else ""
            )
        return verdict
    return _silent(verdict, srun, cancelled)


def _silent(verdict: Verdict, srun: list[SrunReport], cancelled: bool) -> Verdict:
    """A rank with neither a result nor a traceback: it was killed, or stopped with the job."""
    report = next((r for r in srun if verdict.rank in r.tasks), None)
    if report is not None:
        verdict.kind = "stopped" if report.after_cancel else "died"
        verdict.cause = srun_cause(report.status) + (
            " after Slurm cancelled the step" if report.after_cancel else ""
        )
    elif cancelled:
        verdict.kind = "died"
        verdict.cause = (
            "ended without a result or a traceback: killed by a signal, or stuck until the "
            "launcher cancelled the job"
        )
    else:
        verdict.kind = "died"
        verdict.cause = (
            "died without a result or a traceback: killed by a signal (kill -9, the "
            "out-of-memory killer) or crashed in native code (submitit keeps no exit status)"
        )
    return verdict


def diagnose(ranks: list[RankFiles], cancelled: bool = False, batch_log: str | None = None):
    """Culprits first (ranks that raised, then ranks that died, in srun's order; if none, ranks
    stopped while still running), then the collateral ranks that only lost their peers.
    batch_log: Slurm's batch stderr; by default task 0's stderr, where submitit puts it."""
    if batch_log is None:
        batch_log = ranks[0].stderr if ranks else ""
    srun = srun_reports(batch_log)
    verdicts = [classify(files, srun, cancelled) for files in ranks]
    by_kind = {kind: [v for v in verdicts if v.kind == kind] for kind in _KINDS}
    order = {rank: i for i, r in enumerate(srun) for rank in r.tasks if not r.after_cancel}
    by_kind["died"].sort(key=lambda v: (order.get(v.rank, len(order)), v.rank))
    culprits = by_kind["raised"] + by_kind["died"] or by_kind["stopped"] or by_kind["peer_loss"]
    blamed = {v.rank for v in culprits}
    collateral = [v for v in verdicts if v.kind != "ok" and v.rank not in blamed]
    only_peer_loss = bool(culprits) and all(v.kind == "peer_loss" for v in culprits)
    return Diagnosis(culprits, collateral, slurm_lines(batch_log), only_peer_loss)


def render(job_name: str, job_id: str, num_tasks: int, folder, diagnosis: Diagnosis) -> str:
    """The rule's error: header, one line per culprit, the collateral ranks, Slurm's lines,
    then the first culprit's log tail."""
    lines = [f"{job_name} failed (job {job_id}, {counted(num_tasks, 'rank')}, logs in {folder})"]
    lines += [f"  rank {v.rank} on {v.host}: {v.cause}" for v in diagnosis.culprits]
    if diagnosis.collateral:
        ranks = [v.rank for v in diagnosis.collateral]
        lines.append(f"  ranks {ranks} then lost their peers (collateral)")
    if diagnosis.only_peer_loss:
        lines.append(
            "  every failing rank only reports a lost peer: the rank that started it left no "
            "trace (killed on another node? look at the scheduler's logs)"
        )
    if not diagnosis.culprits:
        lines.append("  no rank reported a failure; submitit still reports the job as failed")
    if diagnosis.slurm_lines:
        lines.append("  Slurm says:")
        lines += [f"    {line}" for line in diagnosis.slurm_lines]
    if diagnosis.culprits:
        first = diagnosis.culprits[0]
        lines.append(f"--- rank {first.rank}: last lines of {first.log} ---")
        lines.append(first.tail)
    return "\n".join(lines)


def explain(job_name, job_id, folder, ranks: list[RankFiles], cancelled: bool = False) -> str:
    """diagnose + render: what LaunchError says."""
    return render(job_name, job_id, len(ranks), folder, diagnose(ranks, cancelled))


def _task_ids(spec: str) -> list[int]:
    """'2-3' -> [2, 3]; '0,2-3' -> [0, 2, 3]: srun's task list."""
    ids: list[int] = []
    for part in spec.split(","):
        low, _, high = part.partition("-")
        ids += range(int(low), int(high or low) + 1)
    return ids


def _tail(files: RankFiles) -> str:
    return "\n".join(files.stderr.splitlines()[-TAIL_LINES:])


def _read(path: Path) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def first_failed_rank(job) -> tuple[int, bool] | None:
    """(rank, whether it only lost a peer) of a rank that has written an error result
    (submitit's result pickle), if any; a rank that raised itself comes before one that
    lost its peer. A killed rank writes nothing: the peer that noticed is said to have lost
    it. A pickle being written right now reads as unreadable and is looked at next poll."""
    found = []
    for index in range(job.num_tasks):
        outcome = read_result(job.task(index).paths.result_pickle)
        if outcome is not None and outcome[0] == "error":
            cause = final_exception(str(outcome[1])) or ""
            found.append((index, bool(PEER_LOSS.search(cause))))
    return min(found, key=lambda item: item[1]) if found else None


def first_failure(job) -> str | None:
    """The launcher's first line about a failed job: "rank 2 failed", or, where the first
    rank to report only lost its peer (a killed rank writes nothing), that it lost a peer."""
    first = first_failed_rank(job)
    if first is None:
        return None
    rank, lost_a_peer = first
    what = "lost a peer (the rank that failed is named below)" if lost_a_peer else "failed"
    return f"rank {rank} of job {job.job_id} {what}"
