"""Stopping Snakemake stops ddpflow's jobs: its signals are forwarded to the running rules.

Snakemake runs every ddpflow rule as a local `script:` process and, when it is stopped, does
not signal them: SIGINT (to Snakemake alone, e.g. `kill -INT`) and SIGTERM both make it wait
for the running jobs, so a training or evaluation runs on to its end (hours, on a cluster).
Ctrl-C in a terminal reaches the rule processes only because they share its process group.
`forward_stop_signals()`, called from the workflow's `onstart` hook (after Snakemake set its
own handlers), adds one step in front of Snakemake's handlers: send SIGTERM to the running
rule scripts, which cancel their local or Slurm job (ddpflow.cluster.launch) and exit; then
Snakemake handles the signal as always. Imports no torch.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import threading
from pathlib import Path

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
SCRIPT_MARK = "/.snakemake/scripts/"


def _children_map() -> dict[int, list[int]]:
    """parent PID -> child PIDs, from /proc/<pid>/stat (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # the command name (field 2) may hold spaces and parentheses: split after it
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return children


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def rule_scripts(root: int | None = None) -> list[int]:
    """PIDs of the rule scripts Snakemake runs (`python .snakemake/scripts/tmpXXXX.train.py`),
    found among the descendants of `root` (this process); their own children are not
    searched (the ranks are the launcher's to stop)."""
    children = _children_map()
    found, stack = [], list(children.get(root or os.getpid(), []))
    while stack:
        pid = stack.pop()
        if SCRIPT_MARK in _cmdline(pid):
            found.append(pid)
        else:
            stack += children.get(pid, [])  # the shell Snakemake starts the script through
    return found


def forward_stop_signals() -> None:
    """In front of the current handlers of SIGINT, SIGTERM and SIGHUP: SIGTERM to the running
    rule scripts, then the previous handler. Main thread only (as every signal handler).
    A signal Snakemake was started ignoring stays ignored (SIGHUP under `nohup`; SIGINT in a
    background job of a non-interactive shell): Snakemake goes on after it, so stopping the
    rules would only have it retry them."""
    for signum in STOP_SIGNALS:
        previous = signal.getsignal(signum)
        if previous == signal.SIG_IGN:
            continue

        def handler(num, frame, previous=previous):
            for pid in rule_scripts():
                with contextlib.suppress(OSError):  # ended meanwhile
                    os.kill(pid, signal.SIGTERM)
            if callable(previous):
                previous(num, frame)
            elif previous == signal.SIG_DFL:
                if num == signal.SIGINT:
                    raise KeyboardInterrupt
                signal.signal(num, signal.SIG_DFL)
                os.kill(os.getpid(), num)

        signal.signal(signum, handler)


def wait_for_rule_scripts(timeout_s: float = 90.0, poll_s: float = 0.2) -> list[int]:
    """Until the rule scripts still running have ended (a stopped train rule is cancelling its
    Slurm job: seconds, while Snakemake's error hook would already report it), at most
    timeout_s; returns those still running then. So the hook reads what each rule recorded
    (interrupted, or its failure), not the state before."""
    import time

    deadline = time.monotonic() + timeout_s
    running = rule_scripts()
    while running and time.monotonic() < deadline:
        time.sleep(poll_s)
        running = rule_scripts()
    return running


@contextlib.contextmanager
def controller_output(launcher: str, folder):
    """submitit's local executor starts a controller process that inherits this process's
    stdout and stderr, and a Ctrl-C or a cancel (its SIGINT) makes it print a
    KeyboardInterrupt traceback there, in the user's terminal: its output goes to
    <folder>/controller.log instead (the ranks write logs of their own)."""
    if launcher != "local":
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(Path(folder) / "controller.log", "ab") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)


@contextlib.contextmanager
def ignore_stop_signals():
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def terminate_as_interrupt():
    """Snakemake stops a running rule with SIGTERM: treat it like Ctrl-C so we cancel the job."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_promptly() -> int:
    """Let Snakemake's process exit as soon as the workflow ends (the onsuccess and onerror
    hooks, when no job is left to schedule); returns the timers cancelled.

    - Its job scheduler's rate limiter (on by default, 100 jobs/1 s) starts a non-daemon
      threading.Timer of its timespan after each pass, and the process waits for the last
      one before it exits: a second after the last job of every workflow. Cancelled here.
    - The interpreter's last collection scans every object the process holds (Snakemake's
      and its plug-ins' modules); frozen first, they are not scanned."""
    timers = [
        thread
        for thread in threading.enumerate()
        if isinstance(thread, threading.Timer)
        and getattr(thread.function, "__module__", "") == "snakemake.scheduling.job_scheduler"
    ]
    for timer in timers:
        timer.cancel()
    gc.freeze()
    return len(timers)


# a local job still running this long after its cancel's SIGINT has its ranks killed
LOCAL_SIGINT_GRACE_S = 5.0


def terminate_local(job) -> bool:
    """SIGKILL to the ranks of a local job whose cancel (a SIGINT to submitit's runner) did
    nothing; True once done. A Snakemake started in the background of a non-interactive
    shell (`nohup snakemake ... &` in a script) passes SIGINT down ignored to everything it
    starts, and submitit's ranks ignore SIGTERM: a hung rank would outlive the job's end."""
    process = getattr(job, "_process", None)
    if process is None or process.poll() is not None:
        return True
    ranks = _children_map().get(process.pid, [])
    what = f"job {job.job_id} ignored its SIGINT for {LOCAL_SIGINT_GRACE_S:.0f} s"
    log.warning("%s: killing its ranks (PIDs %s)", what, ", ".join(map(str, ranks)))
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return True
