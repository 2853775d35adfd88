"""Cluster efficiency from sacct (issue 14): parsing and advice, on sacct output captured from
the real Slurm test cluster (tests/slurm: the default run, 2 nodes x 2 ranks, mem_gb 1,
time_min 10). tests/slurm/test_workflow_slurm.py checks the same through a live cluster."""

from __future__ import annotations

import pytest
from ddpflow.monitoring.efficiency import cpu_seconds, mebibytes, parse

# sacct -j 1 --parsable2 --noheader --format=<efficiency.FIELDS>, Slurm 22.05, 2026-11-23
CAPTURED = """\
1|ddpflow-train-cnn|COMPLETED|14|10|00:25.489|4||2G|node[1-2]|2|
1.batch|batch|COMPLETED|14||00:00.015|2|12228K||node1|1|1
1.0|python|COMPLETED|14||00:25.473|4|720532K||node[1-2]|2|4
"""


def test_the_captured_training_job():
    (job,) = parse(CAPTURED).values()
    assert job["job_id"] == "1" and job["state"] == "COMPLETED" and job["nodes"] == 2
    assert job["elapsed_s"] == 14 and job["limit_s"] == 600 and job["cpus"] == 4
    assert job["cpu_efficiency"] == pytest.approx(25.489 / (14 * 4))
    # the largest task's RSS (step 1.0: 4 tasks on 2 nodes) x 2 tasks per node, against
    # the job's 2G over 2 nodes
    assert job["mem_used_mib"] == pytest.approx(720532 / 1024 * 2)
    assert job["mem_asked_mib"] == 1024
    assert job["time_used"] == pytest.approx(14 / 600)
    assert job["advice"] == []  # a 10-minute limit is not worth shortening; memory is used


@pytest.mark.parametrize(
    "text, seconds",
    [("00:25.489", 25.489), ("01:02:03", 3723), ("2-00:00:01", 172801), ("12:34", 754)],
)
def test_cpu_seconds(text, seconds):
    assert cpu_seconds(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text, mib", [("720532K", 720532 / 1024), ("2G", 2048), ("1000Mn", 1000), ("0", 0.0)]
)
def test_mebibytes(text, mib):
    assert mebibytes(text) == pytest.approx(mib)


def test_a_job_that_asked_far_more_than_it_used_gets_advice_naming_the_keys():
    # a 2-hour, 32 GB, 8-CPU request for 5 minutes of one busy core and 1 GB
    text = (
        "7|ddpflow-train-big|COMPLETED|300|120|05:00.000|8||32G|node1|1|\n"
        "7.0|python|COMPLETED|300||05:00.000|8|1048576K||node1|1|1\n"
    )
    job = parse(text)["7"]
    assert job["cpu_efficiency"] == pytest.approx(300 / (300 * 8))
    assert job["mem_efficiency"] == pytest.approx(1024 / 32768)
    advice = " ".join(job["advice"])
    assert "machine.time_min: 10" in advice
    assert "machine.mem_gb: 2" in advice
    assert "machine.cpus_per_task" in advice


def test_timeout_and_out_of_memory_say_what_to_raise():
    text = (
        "8|a|TIMEOUT|600|10|10:00.000|1||1G|node1|1|\n"
        "9|b|OUT_OF_MEMORY|60|10|00:50.000|1||1000Mc|node2|1|\n"
        "9.0|python|OUT_OF_MEMORY|60||00:50.000|1|1024000K||node2|1|1\n"
    )
    jobs = parse(text)
    assert "raise machine.time_min" in jobs["8"]["advice"][0]
    assert "raise machine.mem_gb" in " ".join(jobs["9"]["advice"])
    assert jobs["9"]["mem_asked_mib"] == 1000  # per CPU (older Slurm's suffix c) x 1 CPU
    assert jobs["8"]["cpu_efficiency"] == pytest.approx(1.0)
    assert jobs["8"]["mem_used_mib"] is None  # no step line: memory unknown, not 0
