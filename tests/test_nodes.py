"""Failed nodes without a cluster: parsing what Slurm prints about them (captured on the test
cluster, tests/golden/slurm/nodefail_* and drain_node.txt), the bad-node ledger, the node
count of the next job (nodes, min_nodes, healthy set) and what the user sees."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from ddpflow import pipeline
from ddpflow.cluster import executor, nodes, placement
from ddpflow.cluster.slurm_parse import Node, parse_job_instances, parse_node_events, parse_nodes
from ddpflow.config import ConfigError
from ddpflow.report import render
from workflow_helpers import make_run

GOLDEN = Path(__file__).resolve().parent / "golden" / "slurm"


def golden(name: str) -> str:
    return (GOLDEN / name).read_text()


def node(name: str, state: str = "IDLE", reason: str = "") -> Node:
    return Node(name, ("debug",), 4, 8000, 0, "(null)", state, reason)


# a global batch that 1 to 4 ranks split evenly (the schema's default of 2 micro-batches
# allows 1 or 2 ranks only)
SPLITTABLE = {"global_batch_size": 384, "micro_batch_size": 32}


def slurm_run(nodes_: int = 2, min_nodes: int | None = None, **machine) -> dict:
    machine = {"nodes": nodes_, "min_nodes": min_nodes, "cpu_ranks_per_node": 1, **machine}
    return make_run(launcher="slurm", machine=machine, train=SPLITTABLE,
                    runs=[{"name": "cnn"}])  # fmt: skip


# ---------------------------------------------------------------- parsing


def test_sacct_shows_the_node_fail_run_and_the_requeued_one():
    runs = parse_job_instances(golden("nodefail_sacct.txt"))
    assert [(r.job_id, r.state, r.nodes) for r in runs] == [
        ("4", "NODE_FAIL", ("node1", "node2")),
        ("4", "CANCELLED", ()),  # "CANCELLED by 0", pending: "None assigned"
    ]
    assert runs[0].start == "2026-11-23T20:19:55" and runs[0].end == "2026-11-23T20:20:08"


def test_scontrol_node_states_tell_healthy_from_down_and_drained():
    states = {n.name: n for n in parse_nodes(golden("nodefail_nodes.txt"))}
    assert not states["node1"].unhealthy
    assert states["node2"].unhealthy and states["node2"].state == "DOWN"
    assert states["node2"].reason == "lost power"  # "[root@time]" dropped
    (drained,) = parse_nodes(golden("drain_node.txt"))
    assert drained.state == "IDLE+DRAIN" and drained.unhealthy and drained.reason == "maintenance"
    for state in ("DOWN+NOT_RESPONDING", "MIXED+DRAIN", "FAIL", "down*", "IDLE+DRAIN"):
        assert node("n", state).unhealthy, state
    for state in ("IDLE", "MIXED", "ALLOCATED", "IDLE+COMPLETING", "MIXED+PLANNED"):
        assert not node("n", state).unhealthy, state


def test_a_down_node_of_a_node_fail_run_is_blamed():
    lost = [r for r in parse_job_instances(golden("nodefail_sacct.txt")) if r.state == "NODE_FAIL"]
    blamed = nodes.blame_nodes("4", lost, golden("nodefail_nodes.txt"))
    assert blamed == [
        {"node": "node2", "reason": "NODE_FAIL in job 4 (node DOWN: lost power)", "state": "DOWN"}
    ]


def test_a_node_back_in_service_is_named_by_accounting_events():
    """ReturnToService=2 with a live slurmd: the node was DOWN for 36 ms, so scontrol shows
    every node idle; slurmdbd's node events still name it."""
    lost = [r for r in parse_job_instances(golden("nodefail_back_sacct.txt"))
            if r.state == "NODE_FAIL"]  # fmt: skip
    assert nodes.blame_nodes("1", lost, golden("testbed_nodes.txt")) == []
    events = parse_node_events(golden("nodefail_events.txt"))
    assert [e.node for e in events] == ["node2", "node2"]
    (blamed,) = nodes.blame_from_events("1", lost, golden("nodefail_events.txt"))
    assert blamed["node"] == "node2" and blamed["reason"].startswith("NODE_FAIL in job 1")
    assert "back in service" in blamed["reason"]  # the second event is another job's


def test_failed_nodes_asks_sacct_then_scontrol(monkeypatch):
    answers = {"sacct": golden("nodefail_sacct.txt"), "scontrol": golden("nodefail_nodes.txt")}
    asked = []

    def query(cmd):
        asked.append(cmd)
        return answers.get(cmd[0], "")

    monkeypatch.setattr(nodes, "_query", query)
    assert [f["node"] for f in nodes.failed_nodes("4")] == ["node2"]
    assert asked[0][:3] == ["sacct", "-D", "-X"] and asked[1][-1] == "node1,node2"


def test_a_lost_node_is_found_in_the_events_before_accounting_shows_node_fail(monkeypatch):
    """The job's log has Slurm's "DUE TO NODE FAILURE" line, the node is back in service
    and slurmdbd still shows the run as running (it lagged under load, seen in CI): the
    node events name the node all the same; without the line nothing is blamed."""
    answers = {
        "sacct": "1|RUNNING|node[1-2]|2026-11-23T20:17:31|Unknown\n",
        "scontrol": golden("testbed_nodes.txt"),
        "sacctmgr": golden("nodefail_events.txt"),
    }
    monkeypatch.setattr(nodes, "_query", lambda cmd: answers.get(cmd[0], ""))
    (blamed,) = nodes.failed_nodes("1", said=True)
    assert blamed["node"] == "node2" and "back in service" in blamed["reason"]
    assert nodes.failed_nodes("1") == []


def test_a_job_that_failed_on_healthy_nodes_blames_none(monkeypatch):
    answers = {"sacct": "7|FAILED|node[1-2]|2026-11-23T20:00:00|2026-11-23T20:01:00\n",
               "scontrol": golden("testbed_nodes.txt")}  # fmt: skip
    monkeypatch.setattr(nodes, "_query", lambda cmd: answers.get(cmd[0], ""))
    assert nodes.failed_nodes("7") == []


def test_the_watch_sees_a_requeue_after_node_fail_only(monkeypatch):
    job = {"Restarts": "0"}
    sacct = {"text": "5|RUNNING|node[1-2]|2026-11-23T20:00:00|Unknown\n"}

    def query(cmd):
        if cmd[0] == "scontrol":
            return f"JobId=5 JobName=x JobState=PENDING Requeue=1 Restarts={job['Restarts']} X=1"
        return sacct["text"]

    monkeypatch.setattr(nodes, "_query", query)
    watch = nodes.NodeFailureWatch("5", every_s=0)
    assert not watch()
    job["Restarts"] = "1"  # a time-limit requeue: the earlier run is REQUEUED
    sacct["text"] = ("5|REQUEUED|node[1-2]|2026-11-23T20:00:00|2026-11-23T20:05:00\n"
                     "5|RUNNING|node[1-2]|2026-11-23T20:05:12|Unknown\n")  # fmt: skip
    assert not watch()
    job["Restarts"] = "2"
    assert not watch(), "sacct lags (no third line yet): look again later"
    sacct["text"] += "5|NODE_FAIL|node[1-2]|2026-11-23T20:05:12|2026-11-23T20:06:00\n"
    sacct["text"] += "5|PENDING|None assigned|Unknown|Unknown\n"
    assert watch()


# ---------------------------------------------------------------- the ledger


def test_ledger_records_one_entry_per_node_and_clears(tmp_path):
    ledger = tmp_path / "work" / "bad_nodes.json"
    assert nodes.read_ledger(ledger) == []
    failed = [{"node": "node2", "reason": "NODE_FAIL in job 4", "state": "DOWN"}]
    (entry,) = nodes.add_to_ledger(ledger, "cnn", "4", failed)
    assert {k: entry[k] for k in ("node", "reason", "job_id", "run", "failures")} == {
        "node": "node2", "reason": "NODE_FAIL in job 4", "job_id": "4", "run": "cnn",
        "failures": 1,
    }  # fmt: skip
    assert entry["time"].endswith("Z")
    nodes.add_to_ledger(ledger, "mlp", "9", [{**failed[0], "reason": "NODE_FAIL in job 9"}])
    (again,) = nodes.read_ledger(ledger)
    assert again["job_id"] == "9" and again["run"] == "mlp" and again["failures"] == 2
    assert json.loads(ledger.read_text())["nodes"][0]["node"] == "node2"
    assert [e["node"] for e in pipeline.clean_bad_nodes(str(ledger))] == ["node2"]
    assert not ledger.exists() and pipeline.clean_bad_nodes(str(ledger)) == []


def test_an_unreadable_ledger_is_ignored_with_a_warning(tmp_path, caplog):
    ledger = tmp_path / "bad_nodes.json"
    ledger.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert nodes.read_ledger(ledger) == []
    assert "unreadable bad-node ledger" in caplog.text


def test_after_failure_records_and_names_the_node(tmp_path, monkeypatch):
    failed = [{"node": "node2", "reason": "NODE_FAIL in job 4 (node DOWN: x)", "state": "DOWN"}]
    monkeypatch.setattr(nodes, "failed_nodes", lambda job_id, patience_s, said=False: failed)
    ledger = tmp_path / "bad_nodes.json"
    line = nodes.after_failure("4", ledger, "cnn", False, "...DUE TO NODE FAILURE...")
    assert line.startswith("node failure: node2 (NODE_FAIL in job 4")
    assert "clean_bad_nodes" in line and str(ledger) in line
    assert nodes.read_ledger(ledger)[0]["run"] == "cnn"


class StandInJob:
    """What after_success uses of a submitit SlurmJob: its id and cancel()."""

    def __init__(self, job_id: str):
        self.job_id, self.cancels = job_id, 0

    def cancel(self, check: bool = True) -> None:
        self.cancels += 1


def test_a_job_that_finished_although_a_node_failed_records_it_and_cancels_the_requeue(
    tmp_path, monkeypatch, caplog
):
    """The ranks finished within KillWait after Slurm ended the run as NODE_FAIL (seen at 8
    nodes): the results stand, the node goes into the ledger, Slurm's requeue is cancelled."""
    answers = {"sacct": golden("nodefail_sacct.txt"), "scontrol": golden("nodefail_nodes.txt")}
    monkeypatch.setattr(nodes, "_query", lambda cmd: answers.get(cmd[0], ""))
    queue = iter(["PENDING", ""])  # Slurm's requeue of job 4, gone once cancelled
    monkeypatch.setattr(nodes, "squeue_state", lambda job_id: next(queue))
    monkeypatch.setattr(nodes.time, "sleep", lambda s: None)
    log_file = tmp_path / "4_0_log.err"
    cancelled = "*** JOB 4 ON node1 CANCELLED AT 2026-11-23T20:20:08 DUE TO NODE FAILURE ***"
    log_file.write_text(f"slurmstepd-node1: error: {cancelled}\n")
    job, ledger = StandInJob("4"), tmp_path / "bad_nodes.json"
    with caplog.at_level(logging.WARNING):
        nodes.after_success(job, ledger, "cnn", log_file)
    (entry,) = nodes.read_ledger(ledger)
    assert (entry["node"], entry["job_id"], entry["run"]) == ("node2", "4", "cnn")
    assert job.cancels == 1 and next(queue, "asked once more") == "asked once more"
    assert "job 4 finished its work, but node failure: node2 (NODE_FAIL in job 4" in caplog.text


def test_a_job_that_finished_as_usual_asks_slurm_nothing(tmp_path, monkeypatch):
    def query(*args):
        raise AssertionError("no Slurm query after a usual end")

    monkeypatch.setattr(nodes, "_query", query)
    monkeypatch.setattr(nodes, "squeue_state", query)
    log_file = tmp_path / "5_0_log.err"
    log_file.write_text("INFO submitit: Job completed successfully\n")
    nodes.after_success(StandInJob("5"), tmp_path / "bad_nodes.json", "cnn", log_file)
    nodes.after_success(StandInJob("5"), tmp_path / "bad_nodes.json", "cnn", tmp_path / "none")
    assert not (tmp_path / "bad_nodes.json").exists()


# ---------------------------------------------------------------- how many nodes


def test_all_nodes_healthy_runs_as_configured():
    run = slurm_run(2)
    decision = placement.decide(run, [node("node1"), node("node2")], [], "ledger")
    assert (decision.nodes, decision.exclude) == (2, ())
    assert placement.on_nodes(run, 2) is run


def test_ledger_node_is_excluded_and_without_min_nodes_the_run_fails_before_submitting():
    run = slurm_run(2)
    ledger = [{"node": "node2", "reason": "NODE_FAIL in job 4", "job_id": "4"}]
    with pytest.raises(ConfigError) as err:
        placement.decide(run, [node("node1"), node("node2")], ledger, "results/work/bad_nodes.json")
    text = str(err.value)
    assert "machine.nodes is 2 (machine.min_nodes is null)" in text
    assert "1 healthy node: node1" in text and "node2 (NODE_FAIL in job 4" in text
    assert "results/work/bad_nodes.json" in text and "snakemake clean_bad_nodes" in text
    assert "Nothing was submitted" in text and "machine.min_nodes: 1" in text


def test_with_min_nodes_the_run_shrinks_to_the_healthy_nodes():
    run = slurm_run(3, min_nodes=2)
    ledger = [{"node": "node2", "reason": "NODE_FAIL in job 4"}]
    members = [node("node1"), node("node2"), node("node3"), node("node4", "DOWN", "dead")]
    decision = placement.decide(run, members, ledger, "l")
    assert decision.nodes == 2 and decision.exclude == ("node2",)
    assert decision.down == ("node4 (DOWN: dead in Slurm)",)
    placed = placement.on_nodes(run, decision.nodes)
    assert placed["machine"]["nodes"] == 2 and placed["world_size"] == 2
    assert run["machine"]["nodes"] == 3 and run["world_size"] == 3, "the user's run is kept"


def test_enough_healthy_nodes_only_excludes():
    run = slurm_run(2, min_nodes=1)
    ledger = [{"node": "node2", "reason": "r"}, {"node": "elsewhere", "reason": "r"}]
    members = [node("node1"), node("node2"), node("node3")]
    decision = placement.decide(run, members, ledger, "l")
    assert (decision.nodes, decision.exclude) == (2, ("node2",))  # not another partition's


def test_fewer_than_min_nodes_fails_before_submitting():
    run = slurm_run(3, min_nodes=2)
    members = [node("node1"), node("node2", "IDLE+DRAIN", "maint"), node("node3", "DOWN")]
    with pytest.raises(ConfigError, match=r"machine.min_nodes 2 but the partition has 1 healthy"):
        placement.decide(run, members, [], "l")


def test_a_node_count_the_run_does_not_fit_is_skipped(monkeypatch):
    run = slurm_run(4, min_nodes=1)
    monkeypatch.setattr(placement, "accepts", lambda run, count: "odd" if count == 3 else None)
    members = [node(f"node{i}") for i in range(1, 5)]
    decision = placement.decide(run, members, [{"node": "node4", "reason": "r"}], "l")
    assert decision.nodes == 2


def test_the_terminal_line_names_exclusion_and_shrink(caplog):
    run = slurm_run(2, min_nodes=1)
    ledger = [{"node": "node2", "reason": "NODE_FAIL in job 12"}]
    decision = placement.decide(run, [node("node1"), node("node2")], ledger, "/x/bad_nodes.json")
    with caplog.at_level(logging.WARNING):
        placement.announce(run, decision, ledger, "/x/bad_nodes.json")
    assert caplog.messages == [
        "run 'cnn': excluding node2 (NODE_FAIL in job 12, ledger /x/bad_nodes.json); "
        "running on 1 node of 2 (machine.min_nodes: 1)"
    ]


def test_min_nodes_above_nodes_is_a_config_error():
    with pytest.raises(ConfigError, match=r"machine.min_nodes is 3 but machine.nodes is 2.*"
                                          r"at most 2"):  # fmt: skip
        slurm_run(2, min_nodes=3)
    with pytest.raises(ConfigError, match="min_nodes"):
        slurm_run(2, min_nodes=0)
    assert slurm_run(2)["machine"]["min_nodes"] is None


def test_exclude_reaches_sbatch_next_to_the_users_own():
    run = slurm_run(2, sbatch_extra={"exclude": "node9"})
    params = executor.slurm_parameters(run["machine"], "job", ("node2",))
    assert params["additional_parameters"]["exclude"] == "node9,node2"
    plain = executor.slurm_parameters(slurm_run(2)["machine"], "job")
    assert "exclude" not in plain["additional_parameters"]


def test_the_report_has_a_bad_nodes_section_only_when_there_are_some():
    entry = {"node": "node2", "reason": "NODE_FAIL in job 4", "job_id": "4", "run": "cnn",
             "time": "2026-11-23T20:20:08Z"}  # fmt: skip
    text = render.to_markdown("r", render.document([], [], {}, "now", bad_nodes=[entry]))
    assert "## Bad nodes" in text and "node2" in text and "clean\\_bad\\_nodes" in text
    assert "Bad nodes" not in render.to_markdown("r", render.document([], [], {}, "now"))


def test_fewer_nodes_share_the_global_batch_unevenly():
    """global 128 / micro 32 = 4 micro-batches per step: with a node excluded, 3 ranks share
    them (2 + 1 + 1) rather than the job shrinking to 2."""
    machine = {"nodes": 4, "min_nodes": 1, "cpu_ranks_per_node": 1}
    run = make_run(launcher="slurm", machine=machine, runs=[{"name": "cnn"}],
                   train={"global_batch_size": 128, "micro_batch_size": 32})  # fmt: skip
    members = [node(f"node{i}") for i in range(1, 5)]
    decision = placement.decide(run, members, [{"node": "node4", "reason": "r"}], "l")
    assert decision.nodes == 3  # 4 micro-batches on 3 ranks: the first takes two
    assert placement.on_nodes(run, 3)["world_size"] == 3
