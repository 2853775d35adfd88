"""Restarts inside a Slurm training job, without a cluster: the supervisor's decisions (which
nodes the next job step gets, which are lost, when it stops), the batch script and sbatch
options the login node writes for it, and what the login node and rank 0 make of its events
(the terminal, the bad-node ledger, the ranks of the last step, the segments, the report).
The supervisor itself runs against the real Slurm test cluster in
tests/slurm/test_restarts_in_job.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from ddpflow.cluster import in_job, supervise
from ddpflow.cluster.executor import make_executor
from ddpflow.config import ConfigError
from ddpflow.paths import RunPaths
from ddpflow.report.segments import segments_blocks
from test_nodes import slurm_run


def test_the_next_step_keeps_the_healthy_nodes_and_takes_a_spare_for_the_lost_one():
    held = ["node1", "node3", "node4"]  # node2 left the job (--no-kill)
    used = ["node1", "node2"]
    assert supervise.choose(held, used, {"node2"}, [2]) == ["node1", "node3"]
    # a dead rank on a healthy node: the same nodes again
    assert supervise.choose(["node1", "node2", "node3"], used, set(), [2]) == used
    # no spare left: the largest count the run accepts that the healthy nodes fill
    assert supervise.choose(["node1"], used, {"node2"}, [2, 1]) == ["node1"]
    assert supervise.choose(["node1"], used, {"node2"}, [2]) == []


def test_a_node_is_lost_when_it_left_the_job_or_slurm_holds_it_out_of_service():
    states = {"node1": "MIXED", "node2": "DOWN+NOT_RESPONDING", "node3": "IDLE*"}
    lost = supervise.lost_nodes(["node1", "node2", "node3"], ["node1", "node3"], states)
    assert lost == {
        "node2": "DOWN+NOT_RESPONDING in Slurm, taken out of the job",
        "node3": "IDLE* in Slurm",
    }
    assert supervise.lost_nodes(["node1"], ["node1"], {"node1": "ALLOCATED"}) == {}


def test_the_supervisor_stops_when_restarts_are_spent_or_a_crash_repeats_at_its_step():
    plan = {"restarts": 3}
    assert supervise.stop_reason(0, plan, 40, [], {}) is None
    repeats = supervise.stop_reason(1, plan, 40, [40], {})
    assert (
        repeats
        == "the failure repeats at step 40, as in the step before: a restart does not cure it"
    )
    assert "before its first step" in supervise.stop_reason(1, plan, None, [None], {})
    # a node lost at the same step is a new failure, not a repeated crash
    assert supervise.stop_reason(1, plan, 40, [40], {"node2": "DOWN"}) is None
    spent = supervise.stop_reason(3, plan, 50, [40, 45, 48], {})
    assert spent == "its 3 restarts inside the job (machine.restarts_in_job) are spent"


def test_the_plan_holds_the_node_counts_the_run_accepts(tmp_path):
    run = slurm_run(3, min_nodes=1, spare_nodes=1)
    paths = RunPaths.for_run(tmp_path / "results", run)
    plan = in_job.plan(run, paths)
    assert (plan.nodes, plan.spares, plan.restarts, plan.counts) == (3, 1, 3, (3, 2, 1))
    assert plan.no_kill and plan.events == (tmp_path / "results/work/cnn/restarts.jsonl").resolve()
    # neither a spare nor fewer nodes: a lost node ends the job as before (no --no-kill)
    assert not in_job.plan(slurm_run(2), paths).no_kill
    assert in_job.plan(slurm_run(2, restarts_in_job=0), paths) is None
    local = {**slurm_run(2), "launcher": "local"}
    assert in_job.plan(local, paths) is None


def test_spares_without_restarts_are_refused():
    refused = "machine.spare_nodes is 1 but machine.restarts_in_job is 0"
    with pytest.raises(ConfigError, match=refused):
        slurm_run(2, spare_nodes=1, restarts_in_job=0)


def test_the_batch_script_runs_the_supervisor_on_nodes_plus_spares(tmp_path):
    run = slurm_run(2, spare_nodes=1)
    paths = RunPaths.for_run(tmp_path / "results", run)
    plan = in_job.plan(run, paths)
    folder = tmp_path / "job"
    folder.mkdir()
    executor = make_executor("slurm", run["machine"], folder, "ddpflow-train-cnn", supervised=plan)
    assert executor._num_tasks() == 2  # the ranks of machine.nodes, not of the spares
    script = executor._make_submission_file_text("python -u -m submitit.core._submit F", "u")
    assert "#SBATCH --nodes=3\n" in script and "#SBATCH --no-kill\n" in script
    (line,) = [x for x in script.splitlines() if "ddpflow_supervise.py" in x]
    assert line.endswith("--kill-on-bad-exit=1 python -u -m submitit.core._submit F")
    assert f"--plan {folder.resolve()}/ddpflow_in_job.json -- srun --unbuffered" in line
    written = json.loads((folder / "ddpflow_in_job.json").read_text())
    assert written["counts"] == [2] and written["job_folder"] == str(folder.resolve())
    copy = (folder / "ddpflow_supervise.py").read_text()
    assert copy == Path(supervise.__file__).read_text()
    assert "from ddpflow" not in copy and "import ddpflow" not in copy  # stdlib only


class _Job:
    job_id, num_tasks = "7", 4

    class paths:
        folder = Path("/nonexistent")


def _events(path: Path, *events: dict) -> None:
    with open(path, "a") as out:
        for event in events:
            out.write(json.dumps({"job": "7", "time": 100.0, **event}) + "\n")


def test_the_login_node_tells_each_event_and_records_lost_nodes_at_once(tmp_path, caplog):
    run = slurm_run(2, min_nodes=1)
    paths = RunPaths.for_run(tmp_path / "results", run)
    plan = in_job.plan(run, paths)
    Path(paths.work).mkdir(parents=True)
    ledger = tmp_path / "results/work/bad_nodes.json"
    feed = in_job.Feed(plan, "cnn", ledger, _Job())
    lost = {"node2": "DOWN in Slurm, taken out of the job"}
    _events(
        plan.events,
        {"event": "start", "restart": 0, "nodes": ["node1", "node2"], "world_size": 2},
        {"event": "start", "job": "6", "restart": 0, "nodes": ["x"], "world_size": 9},
        {"event": "failed", "restart": 0, "rc": 137, "lost": lost, "reached": 39},
    )
    with caplog.at_level(logging.INFO):
        feed.poll()
    (entry,) = json.loads(ledger.read_text())["nodes"]
    assert (entry["node"], entry["job_id"], entry["reason"]) == (
        "node2",
        "7",
        "lost in job 7: DOWN in Slurm, taken out of the job",
    )
    assert "the ranks of job 7 failed (exit code 137) after step 39: node2" in caplog.text
    _events(
        plan.events,
        {"event": "start", "restart": 1, "nodes": ["node1"], "world_size": 1},
        {"event": "resumed", "restart": 1, "seconds_to_next_step": 4.25},
    )
    with caplog.at_level(logging.INFO):
        feed.poll()
    assert "restart 1 inside job 7 on node1, 1 rank, from the newest checkpoint" in caplog.text
    assert "training again 4.2s after the failure" in caplog.text
    # the job's result: the one rank of its last step
    assert feed.final_job(_Job()).num_tasks == 1
    _events(plan.events, {"event": "gave_up", "rc": 1, "why": "its 3 restarts ... are spent"})
    feed.poll()
    assert feed.gave_up == "its 3 restarts ... are spent"
    # a rerun that reattaches to the job reads its events again: the node is counted once
    in_job.Feed(plan, "cnn", ledger, _Job()).poll()
    (entry,) = json.loads(ledger.read_text())["nodes"]
    assert entry["failures"] == 1


def test_rank_zero_notes_each_restart_in_its_segment_and_the_report_shows_it(tmp_path):
    events = tmp_path / "restarts.jsonl"
    lost = {"node2": "DOWN in Slurm, taken out of the job"}
    _events(
        events,
        {"event": "failed", "restart": 0, "rc": 137, "lost": lost, "reached": 39},
        {"event": "resumed", "restart": 1, "seconds_to_next_step": 2.64},
        {"event": "failed", "restart": 1, "rc": 1, "lost": {}, "reached": 70},
        {"event": "resumed", "restart": 2, "seconds_to_next_step": 3.5},
    )
    first = {
        "world_size": 2,
        "hosts": ["node1", "node2"],
        "attempt": 1,
        "start_step": 0,
        "end_step": 20,
    }
    segments = [first]
    for restart, hosts, span in (
        (1, ["node1", "node3"], (20, 60)),
        (2, ["node1", "node3"], (60, 90)),
    ):
        segment = {
            **first,
            "hosts": hosts,
            "attempt": restart + 1,
            "start_step": span[0],
            "end_step": span[1],
        }
        in_job.note_restart(segment, {"DDPFLOW_RESTART_IN_JOB": str(restart), "SLURM_JOB_ID": "7"})
        segments.append(segment)
    in_job.note_restart(first, {"DDPFLOW_RESTART_IN_JOB": "0", "SLURM_JOB_ID": "7"})
    assert "restart_in_job" not in first  # the job's first step is no restart
    in_job.annotate(segments, events)
    assert segments[1]["restart_in_job"]["after"] == {
        "lost": lost,
        "rc": 137,
        "reached": 39,
        "failed_at": 100.0,
        "seconds_to_next_step": 2.64,
    }
    _, table, _ = segments_blocks([("r", None, {"train": {"segments": segments}})])
    assert table[1][-1] == "Restart"
    assert [row[-1] for row in table[2]] == [
        "–",
        "in job 7 after node2 lost (DOWN in Slurm, taken out of the job); 2.6 s to its first step",
        "in job 7 after a rank failure (exit code 1); 3.5 s to its first step",
    ]


def test_a_slurm_query_that_fails_after_a_step_blames_no_node(tmp_path, monkeypatch):
    """scontrol unanswered (slurmctld restarting): the supervisor stops without calling every
    node lost (they would go into the ledger)."""
    monkeypatch.setattr(supervise, "job_now", lambda job_id: ("", []))
    plan = {
        "restarts": 3,
        "counts": [2],
        "ranks_per_node": 1,
        "events": str(tmp_path / "ev"),
        "reached": str(tmp_path / "reached"),
        "job_folder": str(tmp_path),
    }
    supervisor = supervise.Supervisor(plan, ["srun", "python"], "7")
    assert supervisor.after_failure(137, ["node1", "node2"], 0) == 137
    failed, gave_up = in_job.read_events(tmp_path / "ev")
    assert failed["lost"] == {} and gave_up["why"] == "Slurm did not say which nodes the job holds"
