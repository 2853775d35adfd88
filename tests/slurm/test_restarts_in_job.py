"""Restarts inside the allocation on the real Slurm cluster (4 nodes: conftest.four_node_cluster).

One 2-node training with one spare node (machine.spare_nodes: 1, so its job holds 3 nodes),
while another user's job holds the fourth node and a third waits for two more (a new job of
ours would queue behind it): a rank killed on a healthy node restarts in place, then a node
dies (its slurmd stops, Slurm holds it DOWN, its rank is killed as in test_node_failure.py)
and the spare takes its place. The same job finishes: one training job in sacct, its metrics
equal to an uninterrupted run's, the terminal, the ledger, the segments and the report say
what happened. With the restarts spent, the job ends as without them and the rule fails."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from slurm_helpers import job_story, sacct_state
from test_node_failure import QUICK, node_dead
from test_workflow_slurm import CLUSTER_MACHINE, FAST_POLL
from workflow_helpers import REPO, snakemake, snakemake_command, write_config

pytestmark = pytest.mark.slurm

MACHINE = {**CLUSTER_MACHINE, "cpu_ranks_per_node": 1}
SCIENCE = {
    "epochs": 30,
    "progress": False,
    "global_batch_size": 64,
    "micro_batch_size": 32,
    "checkpoint": {"every_steps": 0, "every_epochs": 1},
}
# rank 1 kills itself once, at the second epoch's third micro-step; every micro-step is a
# little slower, so that the node can be lost while the ranks train
FAULT = "kill:1:1:2"
SLOW = "0,1:0.02"


def _events(workdir: Path) -> list[dict]:
    path = workdir / "results/work/rs/restarts.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_for(workdir: Path, proc: subprocess.Popen, kind: str, restart: int) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if any(e["event"] == kind and e.get("restart") == restart for e in _events(workdir)):
            return
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        time.sleep(0.2)
    raise AssertionError(f"no {kind} event of restart {restart}: {_events(workdir)}")


def _wait_for_a_checkpoint_of(workdir: Path, proc: subprocess.Popen, restart: int) -> None:
    """Until the step of `restart` wrote a checkpoint (its segment is then in the newest)."""
    (started,) = [
        e["time"] for e in _events(workdir) if e["event"] == "start" and e["restart"] == restart
    ]
    newest = workdir / "results/work/rs/checkpoints/newest.json"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if newest.exists() and newest.stat().st_mtime > started:
            return
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        time.sleep(0.2)
    raise AssertionError(f"restart {restart} wrote no checkpoint")


def _other_users_jobs(partition: str) -> list[str]:
    """A job holding node4, and one waiting for two nodes (it would run before any job that
    ddpflow submitted after it)."""
    ids = []
    for args in (["-N1", "-w", "node4"], ["-N2"]):
        out = subprocess.run(
            [
                "sbatch",
                "--parsable",
                "-p",
                partition,
                "-J",
                "other-user",
                "--mem=100",
                *args,
                "--wrap",
                "sleep 600",
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        ids.append(out.stdout.strip().split(";")[0])
    return ids


def _uninterrupted(tmp_path: Path) -> dict:
    """The same science at 2 ranks, on this machine, with nothing interrupted."""
    workdir = tmp_path / "uninterrupted"
    workdir.mkdir()
    configfile = write_config(
        workdir / "config.yaml",
        {
            "train": SCIENCE,
            "machine": {"nodes": 1, "cpu_ranks_per_node": 2},
            "runs": [{"name": "rs"}],
        },
    )
    result = snakemake(workdir, configfile, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return json.loads((workdir / "results/runs/rs/eval_metrics.json").read_text())


def test_a_spare_takes_a_lost_nodes_place_in_the_same_job(four_node_cluster, tmp_path):
    workdir = tmp_path / "slurm"
    workdir.mkdir()
    configfile = write_config(
        workdir / "config.yaml",
        {"train": SCIENCE, "machine": {**MACHINE, "spare_nodes": 1}, "runs": [{"name": "rs"}]},
    )
    others = _other_users_jobs(four_node_cluster.partition)
    env = {
        **QUICK,
        "DDPFLOW_FAULT": FAULT,
        "DDPFLOW_FAULT_ONCE": str(tmp_path / "fired"),
        "DDPFLOW_SLOW": SLOW,
    }
    cmd, env = snakemake_command(
        workdir, configfile, "--profile", str(REPO / "profiles/slurm"), *FAST_POLL, env=env
    )
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=workdir
    )
    try:
        _wait_for(workdir, proc, "resumed", 1)  # the killed rank's restart trains again
        _wait_for_a_checkpoint_of(workdir, proc, 1)
        with node_dead(four_node_cluster, "node2"):
            _wait_for(workdir, proc, "resumed", 2)  # the spare's
            output, _ = proc.communicate(timeout=480)
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["scancel", *others], timeout=30)
    folder = workdir / "logs/submitit/rs/train"
    (job_id,) = sorted({p.name.split("_")[0] for p in folder.glob("*_0_log.out")})
    assert proc.returncode == 0, output[-5000:] + job_story(job_id, folder)
    trained = subprocess.run(
        ["sacct", "-X", "-n", "-P", "--name", "ddpflow-train-rs", "-o", "JobID"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert sorted(set(trained.stdout.split())) == [job_id], trained.stdout  # one training job
    assert sacct_state(job_id) == "COMPLETED", job_story(job_id, folder)

    starts = [e for e in _events(workdir) if e["event"] == "start"]
    assert [(e["restart"], e["nodes"]) for e in starts] == [
        (0, ["node1", "node2"]),
        (1, ["node1", "node2"]),  # a dead rank on a healthy node: in place
        (2, ["node1", "node3"]),  # node2 lost: the spare node3 in its place
    ]
    failed = [e for e in _events(workdir) if e["event"] == "failed"]
    assert [sorted(e["lost"]) for e in failed] == [[], ["node2"]]
    resumed = [e["seconds_to_next_step"] for e in _events(workdir) if e["event"] == "resumed"]
    assert len(resumed) == 2 and all(0 < s < 60 for s in resumed)

    # the same training as the uninterrupted run's, bit for bit
    remote = json.loads((workdir / "results/runs/rs/eval_metrics.json").read_text())
    local = _uninterrupted(tmp_path)
    assert remote["accuracy"] == local["accuracy"]
    assert remote["confusion_matrix"] == local["confusion_matrix"]
    lines = [
        [json.loads(x)["train_loss"] for x in (d / "results/runs/rs/train_metrics.jsonl").open()]
        for d in (workdir, tmp_path / "uninterrupted")
    ]
    assert lines[0] == lines[1]

    # what the user sees: the terminal, the ledger, the segments and the report
    assert f"restart 1 inside job {job_id} on node1,node2, 2 ranks" in output, output[-5000:]
    assert f"restart 2 inside job {job_id} on node1,node3, 2 ranks (spare node3 in)" in output
    assert "training again" in output and "after the failure" in output
    (entry,) = json.loads((workdir / "results/work/bad_nodes.json").read_text())["nodes"]
    assert (entry["node"], entry["job_id"]) == ("node2", job_id)
    # Slurm shows the node DOWN, or already IDLE (not yet noticed unresponsive): either way
    # it left the job
    assert entry["reason"].startswith(f"lost in job {job_id}: ")
    assert entry["reason"].endswith("in Slurm, taken out of the job")
    segments = remote["train"]["segments"]
    assert [s["hosts"] for s in segments] == [["node1", "node2"]] * 2 + [["node1", "node3"]]
    after = segments[2]["restart_in_job"]["after"]
    assert sorted(after["lost"]) == ["node2"] and after["seconds_to_next_step"] > 0
    assert all(s["world_size"] == 2 for s in segments)
    report = (workdir / "results/report/report.md").read_text()
    assert f"in job {job_id} after node2 lost (" in report
    assert f"in job {job_id} after a rank failure (exit code" in report


def test_spent_restarts_end_the_job_as_without_them(four_node_cluster, tmp_path):
    machine = {**MACHINE, "restarts_in_job": 1}
    configfile = write_config(
        tmp_path / "config.yaml",
        {"train": {**SCIENCE, "epochs": 3}, "machine": machine, "runs": [{"name": "rs"}]},
    )
    result = snakemake(
        tmp_path,
        configfile,
        "--profile",
        str(REPO / "profiles/slurm"),
        *FAST_POLL,
        "--retries",
        "0",
        env={**QUICK, "DDPFLOW_FAULT": FAULT},
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    folder = tmp_path / "logs/submitit/rs/train"
    (job_id,) = sorted({p.name.split("_")[0] for p in folder.glob("*_0_log.out")})
    said = "its 1 restart inside the job (machine.restarts_in_job) is spent"
    assert f"ddpflow-train-rs (job {job_id}) did not restart: {said}" in output, output[-4000:]
    assert "rank 1 on node2: killed by SIGKILL" in output, output[-4000:]
    events = [e["event"] for e in _events(tmp_path)]
    assert events == ["start", "failed", "start", "resumed", "failed", "gave_up"]
    assert sacct_state(job_id) in ("FAILED", "CANCELLED")
    failed = json.loads((tmp_path / "results/work/rs/failed.json").read_text())
    assert said in json.dumps(failed)
