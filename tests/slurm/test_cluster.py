"""Real jobs on the real multi-node test cluster (no mocks).

Every wait is bounded: a broken cluster fails a test, it never hangs it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_helpers import sacct_state
from workflow_helpers import REPO

pytestmark = pytest.mark.slurm

HERE = Path(__file__).resolve().parent
VENV_PY = REPO / ".venv" / "bin" / "python"
PYTHON = str(VENV_PY) if os.path.exists(VENV_PY) else sys.executable  # never raises
SNAKEMAKE = str(Path(PYTHON).with_name("snakemake"))


def run(cmd: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert res.returncode == 0, f"{cmd} -> {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res


def test_srun_spans_two_nodes(slurm_cluster):
    out = run(["srun", "-N2", "-n4", "hostname"]).stdout.split()
    assert len(out) == 4
    assert set(out) == set(slurm_cluster.nodes[:2])


def test_sbatch_completes_in_sacct(slurm_cluster, tmp_path):
    log = tmp_path / "job.out"
    job_id = run(
        ["sbatch", "--parsable", "-p", slurm_cluster.partition, "-A", slurm_cluster.account]
        + ["-o", str(log), "--wrap", "echo hello from $(hostname)"]
    ).stdout.strip()
    assert sacct_state(job_id) == "COMPLETED"
    assert log.read_text().split()[-1] in slurm_cluster.nodes


def test_short_partition_time_limit(slurm_cluster):
    # `short` exists so that checks against a partition's MaxTime can be tested.
    # EnforcePartLimits is Slurm's default (NO): an over-long job is ACCEPTED and
    # then pends forever with reason PartitionTimeLimit -- what config checks prevent.
    limit = run(["sinfo", "-h", "-p", slurm_cluster.short_partition, "-o", "%l"]).stdout
    assert limit.split() == ["10:00"]
    job_id = run(
        ["sbatch", "--parsable", "-p", slurm_cluster.short_partition, "-t", "30"]
        + ["--wrap", "true"]
    ).stdout.strip()
    try:
        deadline = time.monotonic() + 20
        reason = ""
        while time.monotonic() < deadline and reason != "PartitionTimeLimit":
            reason = run(["squeue", "-h", "-j", job_id, "-o", "%r"]).stdout.strip()
            time.sleep(0.5)
        assert reason == "PartitionTimeLimit"
    finally:
        run(["scancel", job_id])


def test_gpus_per_node_sets_cuda_visible_devices(slurm_cluster):
    cmd = ["srun", "-N2", "--ntasks-per-node=1", "--gpus-per-node=2"]
    out = run([*cmd, "sh", "-c", 'echo "$(hostname) $CUDA_VISIBLE_DEVICES"']).stdout
    lines = sorted(out.splitlines())
    assert lines == [f"{node} 0,1" for node in slurm_cluster.nodes[:2]]


def test_gloo_allreduce_two_nodes_two_tasks(slurm_cluster):
    cmd = ["srun", "-N2", "--ntasks-per-node=2", "--cpus-per-task=1", "--mem-per-cpu=1000"]
    out = run([*cmd, PYTHON, str(HERE / "slurm_payloads.py")], timeout=240).stdout
    lines = [line for line in out.splitlines() if line.startswith("rank=")]
    assert len(lines) == 4, out
    assert all(line.endswith("sum=10") for line in lines), out
    assert {line.split("host=")[1].split()[0] for line in lines} == set(slurm_cluster.nodes[:2])


def _run_on_two_nodes(slurm_cluster, tmp_path, function, *args, limit_s: float = 180) -> list:
    """function(*args) as a submitit job of 2 nodes x 2 tasks; every task's result."""
    submitit = pytest.importorskip("submitit")
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit")
    executor.update_parameters(
        slurm_partition=slurm_cluster.partition,
        slurm_account=slurm_cluster.account,
        nodes=2,
        tasks_per_node=2,
        cpus_per_task=1,
        timeout_min=5,
        # The function is pickled by reference: the job must import slurm_payloads (and
        # distributed_helpers, one folder up).
        slurm_setup=[f"export PYTHONPATH={HERE}:{HERE.parent}${{PYTHONPATH:+:$PYTHONPATH}}"],
    )
    job = executor.submit(function, *args)
    deadline = time.monotonic() + limit_s
    while not job.done():
        if time.monotonic() > deadline:
            job.cancel(check=False)
            pytest.fail(f"submitit job {job.job_id} not done after {limit_s}s; see {tmp_path}")
        time.sleep(1)
    return job.results()  # result() asserts on multi-task jobs


def test_submitit_multinode(slurm_cluster, tmp_path):
    import slurm_payloads  # on sys.path via conftest.py

    results = _run_on_two_nodes(slurm_cluster, tmp_path, slurm_payloads.task_info)
    assert len(results) == 4
    assert sorted(r["SLURM_PROCID"] for r in results) == ["0", "1", "2", "3"]
    assert {r["hostname"] for r in results} == set(slurm_cluster.nodes[:2])


SNAKEFILE = """
rule where:
    output: "where.txt"
    shell: "hostname > {output}"
"""


def test_snakemake_slurm_executor(slurm_cluster, tmp_path):
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    resources = [
        f"slurm_partition={slurm_cluster.partition}",
        f"slurm_account={slurm_cluster.account}",  # the plugin's account guess fails here
        "runtime=5",
        "mem_mb=500",
    ]
    cmd = [SNAKEMAKE, "--executor", "slurm", "--default-resources", *resources]
    cmd += ["--slurm-init-seconds-before-status-checks", "2"]
    cmd += ["--seconds-between-status-checks", "5", "-j", "2"]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "where.txt").read_text().strip() in slurm_cluster.nodes


def test_no_rank_of_a_job_listens_on_a_wildcard_address(slurm_cluster, tmp_path):
    """2 nodes x 2 ranks in their own network namespaces (node1 10.250.0.11, ...): rank 0's
    store listens on node1's address only, every rank's gloo listener on its node's; none on
    0.0.0.0 or [::] (/proc/net/tcp of the node's namespace, by the rank's socket inodes)."""
    import slurm_payloads

    folder = tmp_path / "work"
    folder.mkdir(mode=0o700)
    results = _run_on_two_nodes(
        slurm_cluster, tmp_path, slurm_payloads.rendezvous_listeners, str(folder)
    )
    results = sorted(results, key=lambda r: r["rank"])
    nodes = slurm_cluster.nodes[:2]
    addresses = {node: socket.gethostbyname(node) for node in nodes}
    assert [r["host"] for r in results] == [nodes[0], nodes[0], nodes[1], nodes[1]]
    for result in results:
        assert result["sum"] == 4.0 and result["hosts"] == [r["host"] for r in results]
        assert result["listeners"], result
        for address, _ in result["listeners"]:
            assert address == addresses[result["host"]], result  # never 0.0.0.0 / ::
    (port_file,) = folder.glob("rendezvous-*.port")
    host, port, address = port_file.read_text().split()
    assert host == nodes[0] and address == addresses[nodes[0]]
    assert (address, int(port)) in results[0]["listeners"]
