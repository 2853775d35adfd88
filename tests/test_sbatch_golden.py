"""The sbatch script a 4-node x 8-GPU run submits, pinned as a golden file; plus what a rank
of that job sees (environment cleaning on submit, rank discovery inside).

The golden file tests/golden/sbatch_4x8gpu.sh is reviewed by eye; when a deliberate change
alters it, regenerate with `UPDATE_GOLDEN=1 pytest tests/test_sbatch_golden.py` and review the
diff. The essentials are asserted explicitly too, so a careless regeneration cannot drop them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import submitit
import torch
from ddpflow import config as ddpconfig
from ddpflow import runtime
from ddpflow.cluster.distenv import discover
from ddpflow.cluster.executor import clean_slurm_environment, make_executor, slurm_parameters
from submitit.slurm.slurm import _make_sbatch_string

GOLDEN = Path(__file__).resolve().parent / "golden" / "sbatch_4x8gpu.sh"
# Fixed paths: the script must not depend on where the tests run.
FOLDER = "/scratch/proj/ddpflow/logs/submitit/big/train"
COMMAND = f"/opt/ddpflow/.venv/bin/python -u -m submitit.core._submit {FOLDER}"
MACHINE = {
    "nodes": 4,
    "gpus_per_node": 8,
    "cpus_per_task": 12,
    "mem_gb": 480,
    "time_min": 720,
    "partition": "gpu",
    "account": "proj",
    "qos": "high",
    "constraint": "a100",
    "sbatch_extra": {"exclusive": True},
    "setup": ["module load cuda/12.4"],
}


@pytest.fixture
def machine() -> dict:
    """The machine section as the workflow resolves it (schema defaults filled in)."""
    cfg = ddpconfig.validate({"launcher": "slurm", "machine": MACHINE, "runs": [{"name": "big"}]})
    return ddpconfig.resolve_runs(cfg)[0]["machine"]


@pytest.fixture
def sbatch(machine) -> str:
    return _make_sbatch_string(
        command=COMMAND,
        folder=FOLDER,
        **slurm_parameters(machine, "ddpflow-train-big", folder=FOLDER),
    )


def test_sbatch_matches_golden(sbatch):
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(sbatch)
    assert GOLDEN.is_file(), f"{GOLDEN} missing: run with UPDATE_GOLDEN=1 and review it"
    assert sbatch == GOLDEN.read_text(), (
        "the generated sbatch script changed; if that is intended, rerun with UPDATE_GOLDEN=1 "
        f"and review `git diff {GOLDEN.relative_to(GOLDEN.parents[2])}`"
    )


def directives(sbatch: str) -> dict[str, str | bool]:
    """#SBATCH --key=value lines as {key: value} (True for a bare flag)."""
    out: dict[str, str | bool] = {}
    for line in sbatch.splitlines():
        if line.startswith("#SBATCH --"):
            key, eq, value = line.removeprefix("#SBATCH --").partition("=")
            out[key] = value if eq else True
    return out


def test_sbatch_essentials(sbatch):
    flags = directives(sbatch)
    assert flags["nodes"] == "4"
    assert flags["ntasks-per-node"] == "8"  # one rank per GPU
    assert flags["gpus-per-node"] == "8"
    assert flags["cpus-per-task"] == "12"
    assert flags["mem"] == "491520M"  # per node
    assert flags["time"] == "720"
    assert flags["signal"] == "USR2@120"  # not USR1: NCCL catches it; 120 s to checkpoint
    expected = {"partition": "gpu", "account": "proj", "qos": "high", "constraint": "a100"}
    assert {k: flags[k] for k in expected} == expected
    assert flags["exclusive"] is True
    assert f"{FOLDER}/%j_0_log.err" == flags["error"]
    [srun] = [line for line in sbatch.splitlines() if line.startswith("srun ")]
    # srun does not inherit --cpus-per-task since Slurm 22.05; one dead rank ends the step
    assert "--cpus-per-task=12" in srun.split()
    assert "--kill-on-bad-exit=1" in srun.split()
    assert srun.endswith(COMMAND)
    assert sbatch.index("module load cuda/12.4") < sbatch.index("srun ")
    # before the node loads the job's pickle: the folder must be the user's alone
    refusal = f'if [ ! -O {FOLDER} ] || [ -n "$(find {FOLDER} -maxdepth 0 -perm /022)" ]'
    assert sbatch.index(refusal) < sbatch.index("module load cuda/12.4")


def test_executor_writes_the_same_script(machine, sbatch, monkeypatch):
    """launch.make_executor (what the train rule uses) produces exactly the golden script."""
    # SlurmExecutor refuses to start where no `srun` is installed (CI): pretend there is one.
    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 2))
    executor = make_executor("slurm", machine, FOLDER, "ddpflow-train-big")
    assert executor._make_submission_file_text(COMMAND, "uid") == sbatch


def test_clean_slurm_environment_hides_and_restores(monkeypatch):
    outer = {
        "SLURM_JOB_ID": "77",
        "SLURM_NTASKS": "4",
        "SLURM_MEM_PER_CPU": "500",
        "SBATCH_PARTITION": "debug",
        "SRUN_CPUS_PER_TASK": "2",
        "SALLOC_ACCOUNT": "x",
        "SLURMD_NODENAME": "node1",
        "SUBMITIT_FOLDER": "/outer",
        "MASTER_ADDR": "node1",
        "RANK": "3",
    }
    for key, value in outer.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SLURMISH_BUT_NOT", "kept")  # only the exact prefixes are hidden
    with clean_slurm_environment():
        assert not [k for k in os.environ if k.startswith(("SLURM_", "SBATCH_", "SRUN_"))]
        assert not {"SALLOC_ACCOUNT", "SLURMD_NODENAME", "SUBMITIT_FOLDER"} & set(os.environ)
        assert not {"MASTER_ADDR", "RANK"} & set(os.environ)
        assert os.environ["SLURMISH_BUT_NOT"] == "kept"
    assert {k: os.environ[k] for k in outer} == outer
    with pytest.raises(RuntimeError), clean_slurm_environment():
        raise RuntimeError("submission failed")
    assert {k: os.environ[k] for k in outer} == outer  # restored on errors too


def test_rank_of_the_4x8_job_discovers_itself(monkeypatch):
    """What srun gives rank 13 of that job (second node, sixth GPU)."""
    env = {
        "SLURM_PROCID": "13",
        "SLURM_NTASKS": "32",
        "SLURM_LOCALID": "5",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu[01-04]",
        "SLURM_JOB_ID": "4242",
    }
    dist = discover(env)
    assert (dist.rank, dist.world_size, dist.local_rank) == (13, 32, 5)
    assert (dist.node_rank, dist.num_nodes, dist.local_world_size) == (1, 4, 8)
    assert dist.master_addr == "gpu01" and dist.launcher == "slurm" and not dist.is_master
    # --gpus-per-node=8 shows every rank all 8 GPUs: the rank picks its own by local rank
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert runtime.select_device(8, dist.local_rank) == torch.device("cuda", 5)
    assert chosen == [5]
