"""Survive failures on the real Slurm cluster: time limit and preemption requeue the job and
training resumes from its checkpoint; a SIGKILLed rank fails the whole job fast."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
from slurm_helpers import job_ids, sacct_state
from test_workflow_slurm import CLUSTER_MACHINE, FAST_POLL
from workflow_helpers import REPO, snakemake, snakemake_command, write_config

pytestmark = pytest.mark.slurm


def _config(workdir: Path, time_min: int) -> Path:
    return write_config(
        workdir / "config.yaml",
        {
            "train": {
                "epochs": 16,
                "progress": False,
                "global_batch_size": 128,  # one micro-batch of 32 per rank (2 nodes x 2)
                "micro_batch_size": 32,
                "checkpoint": {"every_steps": 0, "every_epochs": 1},
            },
            "machine": {**CLUSTER_MACHINE, "time_min": time_min},
            "runs": [{"name": "rq"}],
        },
    )


def _popen_workflow(workdir: Path, configfile: Path) -> subprocess.Popen:
    cmd, env = snakemake_command(
        workdir, configfile, "--profile", str(REPO / "profiles/slurm"), *FAST_POLL
    )
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=workdir
    )


def _wait_for_epoch(folder: Path, epoch: int, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        ids = job_ids(folder) if folder.exists() else []
        if ids:
            log = (folder / f"{ids[0]}_0_log.err").read_text(errors="replace")
            if f"epoch {epoch}/" in log:
                return ids[0]
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(1)
    raise AssertionError(f"epoch {epoch} never reached")


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster, tmp_path_factory):
    """The same run through the same profile, never interrupted: what a requeued one must
    equal bit for bit."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    proc = _popen_workflow(workdir, _config(workdir, 15))
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-4000:]
    return workdir


def _model_and_metrics(workdir: Path):
    model = torch.load(workdir / "results/runs/rq/model.pt", weights_only=True)["state_dict"]
    lines = (workdir / "results/runs/rq/train_metrics.jsonl").read_text().splitlines()
    strip = ("seconds", "samples_per_s", "model_tflops", "attempt", "ranks")  # timings
    return model, [{k: v for k, v in json.loads(x).items() if k not in strip} for x in lines]


@pytest.mark.parametrize(
    ("case", "time_min", "signals"),
    [
        # submitit counts an interrupt as a time-out when the job ran past its guaranteed walltime
        # (always with time_min <= 10) and as a preemption otherwise (time_min >= 13)
        ("timeout", 5, ["USR2"]),
        ("preemption", 15, ["SIGTERM", "USR2"]),  # what Slurm sends a preempted job
    ],
)
def test_interrupted_job_requeues_and_resumes(
    slurm_cluster, uninterrupted, tmp_path, case, time_min, signals
):
    """A time limit or a preemption loses no step: the ranks agree on a step at the signal,
    save, requeue; the resumed run redoes nothing and is bit for bit the uninterrupted one."""
    proc = _popen_workflow(tmp_path, _config(tmp_path, time_min))
    folder = tmp_path / "logs/submitit/rq/train"
    job_id = _wait_for_epoch(folder, 2, proc)
    for sig in signals:
        subprocess.run(["scancel", "--signal", sig, job_id], check=True, timeout=30)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-4000:]
    assert job_ids(folder) == [job_id], "a requeue keeps the job id"
    assert sacct_state(job_id) == "COMPLETED"
    rank0 = (folder / f"{job_id}_0_log.err").read_text(errors="replace")
    kind = "timed-out" if case == "timeout" else "preempted"
    assert f"this job is {kind}" in rank0
    assert "RESUMED from attempt" in rank0
    summary = json.loads((tmp_path / "results/runs/rq/train_summary.json").read_text())
    assert summary["attempts"] == 2
    first, second = summary["segments"]
    assert second["steps_redone"] == 0 and second["start_step"] == first["end_step"] > 0
    assert "resumed at epoch " in rank0 and "; no steps redone" in rank0
    model, lines = _model_and_metrics(tmp_path)
    expected_model, expected_lines = _model_and_metrics(uninterrupted)
    assert all(torch.equal(model[k], expected_model[k]) for k in expected_model)
    assert lines == expected_lines
    records = [
        json.loads(line)
        for line in (tmp_path / "results/runs/rq/train_metrics.jsonl").read_text().splitlines()
    ]
    assert [r["epoch"] for r in records] == list(range(1, 17))
    assert {r["attempt"] for r in records} == {1, 2}
    metrics = json.loads((tmp_path / "results/runs/rq/eval_metrics.json").read_text())
    assert metrics["accuracy"] > 0.9
    assert "attempts" in (tmp_path / "results/report/report.md").read_text().lower()


def test_killed_node_fails_the_job_fast_and_is_named(slurm_cluster, tmp_path):
    """Every rank on node2 SIGKILLed (a lost node, the OOM killer): the rule fails fast and
    names ranks 2 and 3 on node2 as killed, before the survivors that only lost their peers
    (they used to be blamed: 'rank 0 on node1: Connection reset by peer')."""
    configfile = _config(tmp_path, 15)
    started = time.monotonic()
    result = snakemake(
        tmp_path,
        configfile,
        "--profile",
        str(REPO / "profiles/slurm"),
        *FAST_POLL,
        "--retries",
        "0",
        env={"DDPFLOW_FAULT": "kill:2,3:1:2"},
        timeout=600,
    )
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "ddpflow-train-rq failed" in output, output[-3000:]
    culprits = output.index("rank 2 on node2: killed by SIGKILL")
    assert culprits < output.index("rank 3 on node2: killed by SIGKILL"), output[-3000:]
    assert culprits < output.index("ranks [0, 1] then lost their peers (collateral)")
    assert "srun: error: node2: tasks 2-3: Killed" in output
    job_id = job_ids(tmp_path / "logs/submitit/rq/train")[0]
    assert sacct_state(job_id) in ("FAILED", "CANCELLED")
    queue = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True)
    assert queue.stdout.strip() == "" or " CG " in queue.stdout
    print(f"kill -9 of node2's ranks: rule failed {elapsed:.0f}s after start")
