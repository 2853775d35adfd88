"""ddpflow.cluster.failures on files captured from real failed jobs (tests/golden/failures/): the
culprit rank, its host and its cause come first, the ranks that only lost their peers are
listed after it as collateral.

Each case folder is what submitit left behind (per-rank logs and result pickles) plus
case.json; message.txt pins the whole LaunchError text. When a deliberate change alters it,
regenerate with `UPDATE_GOLDEN=1 pytest tests/test_failures.py` and review the diff; the
essentials are asserted explicitly too (CASES), so a careless regeneration cannot drop them.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
from ddpflow.cluster import failures

GOLDEN = Path(__file__).resolve().parent / "golden" / "failures"

# case -> culprits in order (rank, host, how the cause starts) and the collateral ranks
CASES = {
    "local_raise_injected": {
        "culprits": [
            (1, "vm", "ddpflow.faults.InjectedFault: injected fault on rank 1 at epoch 1 step 2")
        ],
        "collateral": [0],
    },
    "local_raise_odd_class": {
        "culprits": [
            (
                1,
                "vm",
                "ddpflow.checkpoint.CheckpointMismatch: /home/user/run/checkpoints/"
                "ckpt-000000021.pt was written under a different config (hash 9f1c2e77d0ab",
            )
        ],
        "collateral": [0],
    },
    "local_kill_rank2_of_4": {
        "culprits": [(2, "vm", "died without a result or a traceback: killed by a signal")],
        "collateral": [0, 1, 3],
    },
    "local_hang_rank1": {
        "culprits": [(1, "vm", "still running when the launcher cancelled the job (hung?)")],
        "collateral": [0],
    },
    "slurm_kill_rank2": {
        "culprits": [(2, "node2", "killed by SIGKILL (srun: Killed")],
        "collateral": [0, 1, 3],
    },
    "slurm_kill_node2": {
        "culprits": [
            (2, "node2", "killed by SIGKILL (srun: Killed"),
            (3, "node2", "killed by SIGKILL (srun: Killed"),
        ],
        "collateral": [0, 1],
    },
}


def load_case(name: str) -> tuple[dict, list[failures.RankFiles]]:
    """The case's facts and its ranks' files, with log paths as the user saw them."""
    folder = GOLDEN / name
    meta = json.loads((folder / "case.json").read_text())
    ranks = []
    for rank in range(meta["num_tasks"]):
        stem = f"{meta['job_id']}_{rank}"
        files = failures.read_rank(
            rank,
            folder / f"{stem}_log.err",
            folder / f"{stem}_log.out",
            folder / f"{stem}_result.pkl",
        )
        files.log = f"{meta['folder']}/{stem}_log.err"
        ranks.append(files)
    return meta, ranks


def message_of(name: str) -> str:
    meta, ranks = load_case(name)
    return failures.explain(
        meta["job_name"], meta["job_id"], meta["folder"], ranks, meta["cancelled_by_launcher"]
    )


def message_problems(name: str, message: str) -> list[str]:
    """What the message gets wrong for a case (also run against the old parser by hand)."""
    case, problems = CASES[name], []
    lines = message.splitlines()
    culprit_at = []
    for rank, host, cause in case["culprits"]:
        prefix = f"  rank {rank} on {host}: {cause}"
        found = [i for i, line in enumerate(lines) if line.startswith(prefix)]
        culprit_at.append(found[0] if found else None)
        if not found:
            problems.append(f"no line starting with {prefix!r}")
    collateral = f"  ranks {case['collateral']} then lost their peers (collateral)"
    if collateral not in lines:
        problems.append(f"no line {collateral!r}")
    elif any(i is not None and i > lines.index(collateral) for i in culprit_at):
        problems.append("a culprit is listed after the collateral ranks")
    if [i for i in culprit_at if i is not None] != sorted(i for i in culprit_at if i is not None):
        problems.append("culprits out of order")
    for rank in case["collateral"]:
        if any(line.startswith(f"  rank {rank} on ") for line in lines):
            problems.append(f"collateral rank {rank} is named as a culprit")
    return problems


@pytest.mark.parametrize("name", sorted(CASES))
def test_culprit_host_cause_and_collateral(name):
    meta, ranks = load_case(name)
    diagnosis = failures.diagnose(ranks, meta["cancelled_by_launcher"])
    culprits = [(v.rank, v.host) for v in diagnosis.culprits]
    assert culprits == [(rank, host) for rank, host, _ in CASES[name]["culprits"]]
    for verdict, (_, _, cause) in zip(diagnosis.culprits, CASES[name]["culprits"], strict=True):
        assert verdict.cause.startswith(cause), verdict.cause
    assert [v.rank for v in diagnosis.collateral] == CASES[name]["collateral"]
    assert all(v.kind in ("peer_loss", "stopped") for v in diagnosis.collateral)
    assert message_problems(name, message_of(name)) == []


@pytest.mark.parametrize("name", sorted(CASES))
def test_message_matches_golden(name):
    message = message_of(name)
    golden = GOLDEN / name / "message.txt"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.write_text(message + "\n")
    assert golden.is_file(), f"{golden} missing: run with UPDATE_GOLDEN=1 and review it"
    assert message + "\n" == golden.read_text()


def test_first_line_and_first_culprits_log_tail_stay():
    meta, _ = load_case("local_kill_rank2_of_4")
    lines = message_of("local_kill_rank2_of_4").splitlines()
    assert lines[0] == (f"ddpflow-train-cnn failed (job 11204, 4 ranks, logs in {meta['folder']})")
    assert f"--- rank 2: last lines of {meta['folder']}/11204_2_log.err ---" in lines
    assert lines[-1].endswith("injecting fault 'kill' on rank 2 at epoch 0 step 3")


def test_odd_exception_class_comes_from_the_result_pickle():
    """CheckpointMismatch does not end in Error/Exception: the type is the traceback's last
    line, read from submitit's result pickle, not matched by name."""
    _, ranks = load_case("local_raise_odd_class")
    assert ranks[1].result[0] == "error"
    ranks[1].stderr = ""  # the pickle alone is enough
    verdict = failures.classify(ranks[1], [], cancelled=False)
    assert verdict.kind == "raised"
    assert verdict.cause.startswith("ddpflow.checkpoint.CheckpointMismatch: ")


def test_hung_rank_says_where_it_was_stuck():
    message = message_of("local_hang_rank1")
    assert "it was at /home/user/ddpflow/workflow/ddpflow/faults.py:48 in maybe_inject" in message
    assert "time.sleep(60)" in message


def test_slurm_lines_are_quoted_in_order():
    message = message_of("slurm_kill_rank2")
    quoted = message.split("  Slurm says:\n")[1].split("\n---")[0].splitlines()
    assert [line.strip() for line in quoted] == [
        "srun: error: node2: task 2: Killed",
        "slurmstepd-node1: error: *** STEP 5.0 ON node1 CANCELLED AT 2026-11-22T09:12:28 ***",
        "srun: error: node1: tasks 0-1: Terminated",
        "srun: error: node2: task 3: Exited with exit code 1",
    ]


def test_srun_reports_after_the_cancellation_are_consequences():
    _, ranks = load_case("slurm_kill_rank2")
    reports = failures.srun_reports(ranks[0].stderr)
    assert [(r.host, r.tasks, r.status, r.after_cancel) for r in reports] == [
        ("node2", [2], "Killed", False),
        ("node1", [0, 1], "Terminated", True),
        ("node2", [3], "Exited with exit code 1", True),
    ]


def test_killed_slurm_rank_without_log_line_gets_host_from_srun():
    files = failures.RankFiles(rank=5)
    reports = failures.srun_reports("srun: error: gpu-017: tasks 4,5-7: Killed\n")
    assert reports[0].tasks == [4, 5, 6, 7]
    verdict = failures.classify(files, reports, cancelled=False)
    assert (verdict.host, verdict.kind) == ("gpu-017", "died")
    assert verdict.cause.startswith("killed by SIGKILL")


@pytest.mark.parametrize(
    ("status", "cause"),
    [
        ("Segmentation fault (core dumped)", "killed by SIGSEGV"),
        ("Exited with exit code 3", "exited with exit code 3 without a Python traceback"),
        ("Out Of Memory", "srun: Out Of Memory"),
    ],
)
def test_srun_status_becomes_a_cause(status, cause):
    assert failures.srun_cause(status).startswith(cause)


def test_final_exception_of_a_chain_is_the_raised_one():
    text = (
        "Traceback (most recent call last):\n"
        '  File "a.py", line 1, in f\n'
        "KeyError: 'x'\n\n"
        "During handling of the above exception, another exception occurred:\n\n"
        "Traceback (most recent call last):\n"
        '  File "a.py", line 3, in f\n'
        "    raise Boom('bad\\nthing')\n"
        "mypkg.Boom: bad\n"
        "thing\n"
    )
    assert failures.final_exception(text) == "mypkg.Boom: bad"
    assert failures.final_exception("no traceback here") is None


def test_missing_and_unreadable_result_pickles(tmp_path):
    assert failures.read_result(tmp_path / "absent.pkl") is None
    (tmp_path / "torn.pkl").write_bytes(pickle.dumps(("error", "x"))[:5])
    assert failures.read_result(tmp_path / "torn.pkl")[0] == "unreadable"


def test_the_first_failure_line_names_a_rank_that_lost_its_peer_as_such(tmp_path):
    """A killed rank writes no result; the peer that noticed wrote a peer-loss error: the
    launcher's first line says that rank lost a peer, not that it failed. A rank that raised
    itself is named before one that lost its peer."""
    from types import SimpleNamespace

    from ddpflow.cluster.failures import first_failed_rank

    def job(results: dict):
        tasks = []
        for rank in range(3):
            path = tmp_path / f"{len(results)}-{rank}.pkl"
            if rank in results:
                path.write_bytes(pickle.dumps(("error", results[rank])))
            tasks.append(SimpleNamespace(paths=SimpleNamespace(result_pickle=path)))
        return SimpleNamespace(num_tasks=3, task=lambda i: tasks[i])

    lost = "Traceback (most recent call last):\nRuntimeError: Connection closed by peer [::1]:5"
    own = "Traceback (most recent call last):\nValueError: a bad batch"
    assert first_failed_rank(job({})) is None
    assert first_failed_rank(job({0: lost})) == (0, True)
    assert first_failed_rank(job({0: lost, 2: own})) == (2, False)


def test_the_cancel_of_a_slurm_job_backs_off_its_squeue_polls(monkeypatch):
    """After Ctrl-C the launcher waits for the cancelled job to leave the queue: on Slurm
    each look is an squeue RPC, so the wait grows from 0.2 s to 2 s (7 looks, not 25, in
    the first 5 s); a local job is looked at every 0.2 s (no RPC)."""
    import submitit
    from ddpflow.cluster import launch

    class Queued(submitit.SlurmJob):
        def __init__(self):  # no folder, no watcher: only what cancel_and_wait reads
            self._job_id = "88"
            self._cancel_at_deletion = False

        def cancel(self, check: bool = True) -> None:
            pass

    slept: list[float] = []
    clock = [0.0]

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock[0] += seconds

    monkeypatch.setattr(launch.time, "sleep", sleep)
    monkeypatch.setattr(launch.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(launch, "slurm_job_alive", lambda job_id: clock[0] < 5.0)
    launch.cancel_and_wait(Queued())
    assert slept[:3] == pytest.approx([0.2, 0.3, 0.45]) and max(slept) == 2.0
    assert len(slept) <= 8


def test_a_slurm_jobs_time_is_said_as_pending_and_running(monkeypatch):
    """The wait's last line splits a Slurm job's time at the first look that found it out of
    the queue (the state the shared watcher holds: no query of its own); a local job has no
    queue."""
    import submitit
    from ddpflow.cluster import poll

    class Watched(submitit.SlurmJob):
        def __init__(self):
            self._job_id, self._cancel_at_deletion, self.states = "7", False, []

        @property
        def state(self) -> str:
            return self.states.pop(0)

    clock = [100.0]
    monkeypatch.setattr(poll.time, "monotonic", lambda: clock[0])
    job = Watched()
    job.states = ["PENDING", "RUNNING"]
    queued = poll.QueueTime(job, start=100.0)
    for advance in (3.0, 2.5):
        clock[0] += advance
        queued.look()
    clock[0] += 10.0
    queued.look()  # found running before: not asked again
    assert queued.said() == "15.5s (5.5s pending, 10.0s running)"
    local = poll.QueueTime(object(), start=clock[0] - 4.0)
    local.look()
    assert local.said() == "4.0s"
