"""The workflow's shared Slurm status (ddpflow.cluster.poll): one query per interval for all
of its jobs, whatever the number of processes waiting for them.

The coordination tests run several real processes against a stand-in `sacct` on PATH that
counts its calls (the one thing measured here is how often ddpflow calls it); the real test
cluster runs concurrent runs in tests/slurm/test_sweep_slurm.py."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import submitit
from ddpflow.cluster import nodes, poll

FAKE_SACCT = """#!/bin/sh
# stand-in sacct: counts its calls, answers RUNNING (or $FAKE_SACCT_STATE) for each job id
echo "$$" >> "$FAKE_SACCT_CALLS"
ids=""
while [ $# -gt 0 ]; do [ "$1" = "-j" ] && ids="$2"; shift; done
for id in $(echo "$ids" | tr ',' ' '); do
  echo "$id|${FAKE_SACCT_STATE:-RUNNING}|node1|2026-11-24T10:00:00|Unknown"
done
sleep 0.05
"""


@pytest.fixture
def fake_sacct(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text(FAKE_SACCT)
    (bin_dir / "sacct").chmod(0o755)
    calls = tmp_path / "sacct_calls"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SACCT_CALLS", str(calls))
    return calls


def _calls(calls: Path) -> int:
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def _waiter(folder: str, job_id: str, seconds: float, every_s: float, out: str) -> None:
    """One rule process: registers its job and reads the shared answer every 50 ms."""
    status = poll.SharedStatus(folder, every_s=every_s)
    status.register(job_id)
    seen, end = set(), time.monotonic() + seconds
    while time.monotonic() < end:
        seen.add(len(status.instances(job_id)))
        time.sleep(0.05)
    status.unregister(job_id)
    Path(out).write_text(json.dumps(sorted(seen)))


def _run_waiters(tmp_path: Path, count: int, seconds: float = 3.0, every_s: float = 0.5):
    folder = tmp_path / f"status-{count}"
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters, like rule processes
    procs = [ctx.Process(target=_waiter, args=(str(folder), str(100 + i), seconds, every_s,
                                               str(tmp_path / f"seen-{count}-{i}")))
             for i in range(count)]  # fmt: skip
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    seen = [json.loads((tmp_path / f"seen-{count}-{i}").read_text()) for i in range(count)]
    return folder, seen


def test_one_query_per_interval_whatever_the_number_of_waiting_processes(tmp_path, fake_sacct):
    folder, seen = _run_waiters(tmp_path, 1)
    one = _calls(fake_sacct)
    fake_sacct.unlink()
    folder8, seen8 = _run_waiters(tmp_path, 8)
    eight = _calls(fake_sacct)
    # 3 s at one query per 0.5 s: about 6 (process start-up staggers the first ones)
    assert 3 <= one <= 8 and 3 <= eight <= 8, (one, eight)
    assert eight <= one + 2, f"8 processes made {eight} queries, 1 made {one}"
    assert poll.query_count(folder8) == eight  # the folder's own log counts the same calls
    assert all(1 in s for s in seen + seen8), "every process got its own job's state"
    assert not list((folder8 / "jobs").iterdir()), "each process unregistered on its way out"


def test_one_query_asks_for_every_registered_job(tmp_path, fake_sacct):
    status = poll.SharedStatus(tmp_path / "s", every_s=60)
    for job_id in ("7", "8", "12"):
        status.register(job_id)
    data = status.current()
    assert sorted(data["jobs"]) == ["12", "7", "8"] and _calls(fake_sacct) == 1
    assert status.instances("8")[0].state == "RUNNING"
    status.current()
    assert _calls(fake_sacct) == 1, "a fresh answer is read, not asked again"


def test_stale_registrations_are_dropped_by_the_querying_process(tmp_path, fake_sacct):
    status = poll.SharedStatus(tmp_path / "s", every_s=0.5, stale_s=5)
    status.register("41")  # a process killed without unregistering
    old = time.time() - 60
    os.utime(next((tmp_path / "s" / "jobs").iterdir()), (old, old))
    assert status.registered() == set()
    status.current()
    assert not list((tmp_path / "s" / "jobs").iterdir()), "the stale entry was removed"
    assert _calls(fake_sacct) == 0, "no live job: nothing to ask"


def test_submitit_reads_the_shared_answer(tmp_path, fake_sacct, monkeypatch):
    monkeypatch.setenv("FAKE_SACCT_STATE", "FAILED")
    status = poll.SharedStatus(tmp_path / "s", every_s=0.5)
    job = submitit.SlurmJob(folder=tmp_path / "job", job_id="9", tasks=range(2))
    with poll.attached(job, status):
        assert job.done(), "every task reads FAILED from the shared answer"
        assert job.state == "FAILED" and job.task(1).state == "FAILED"
    assert _calls(fake_sacct) == 1
    assert "9" not in submitit.SlurmJob.watcher._info_dict, "submitit's own watcher asked nobody"


def test_the_node_failure_watch_reads_the_shared_runs(tmp_path, fake_sacct, monkeypatch):
    status = poll.SharedStatus(tmp_path / "s", every_s=0.0)
    status.register("5")
    watch = nodes.NodeFailureWatch("5", every_s=0, source=lambda: status.instances("5"))
    assert not watch()
    monkeypatch.setenv("FAKE_SACCT_STATE", "NODE_FAIL")
    (tmp_path / "bin" / "sacct").write_text(FAKE_SACCT.replace(
        'sleep 0.05', 'echo "5|PENDING|None assigned|Unknown|Unknown"'))  # fmt: skip
    assert watch(), "a new run after a NODE_FAIL run: Slurm requeued the job"


# ---------------------------------------------------------------- the real test cluster
