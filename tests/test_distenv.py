"""ddpflow.cluster.distenv: rank discovery from each launcher's variables, host lists, ports, and a
real gloo process group set up through the rendezvous directory.

The discovery tests fake the environment (discover() takes the mapping); the last test
really starts two ranks.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
from ddpflow.cluster import distenv, rendezvous
from ddpflow.cluster.distenv import (
    PORT_BASE,
    PORT_SPAN,
    DistEnv,
    derive_port,
    discover,
    expand_nodelist,
)
from distributed_helpers import own_listeners, port_files, run_group, submitit_local_env

# --- realistic variable sets ---------------------------------------------------------


def srun_env(rank: int, **extra: str) -> dict[str, str]:
    """What srun gives task `rank` of `sbatch --nodes 2 --ntasks-per-node 4` (block layout)."""
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "ddpflow-train",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": "8",
        "SLURM_NPROCS": "8",
        "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % 4),
        "SLURM_NODEID": str(rank // 4),
        "SLURMD_NODENAME": f"gpu0{7 + rank // 4}",
        "HOME": "/home/user",
        "PATH": "/usr/bin:/bin",
    }
    env.update(extra)
    return env


def torchrun_env(rank: int, **extra: str) -> dict[str, str]:
    """torchrun --nnodes 2 --nproc-per-node 2 (c10d rendezvous), worker `rank`."""
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": "4",
        "LOCAL_RANK": str(rank % 2),
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": str(rank // 2),
        "GROUP_WORLD_SIZE": "2",
        "ROLE_RANK": str(rank),
        "MASTER_ADDR": "node-a.cluster",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_RUN_ID": "exp17",
        "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "OMP_NUM_THREADS": "1",
    }
    env.update(extra)
    return env


# --- srun -------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", range(8))
def test_srun_two_nodes_of_four_tasks(rank):
    env = discover(srun_env(rank))
    assert env == DistEnv(
        rank=rank,
        world_size=8,
        local_rank=rank % 4,
        local_world_size=4,
        node_rank=rank // 4,
        num_nodes=2,
        master_addr="gpu07",  # first host of the expanded list, the same on every rank
        master_port=derive_port("4242"),
        job_id="4242",
        launcher="slurm",
        restart_count=0,
    )
    assert env.is_master == (rank == 0)


def test_srun_master_is_first_host_of_a_compressed_nodelist():
    base = srun_env(0, SLURM_NTASKS="16", SLURM_NNODES="4", SLURM_JOB_NUM_NODES="4")
    for key in ("SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES", "SLURM_NTASKS_PER_NODE"):
        del base[key]
    base["SLURM_JOB_NODELIST"] = "gpu[01-03,07]"
    env = discover(base)
    assert env.master_addr == "gpu01"
    assert env.num_nodes == 4
    assert env.local_world_size == 4  # the even share when SLURM_NTASKS_PER_NODE is absent
    del base["SLURM_NNODES"], base["SLURM_JOB_NUM_NODES"]
    assert discover(base).num_nodes == 4  # counted from the host list


def test_srun_step_nodelist_wins_over_the_allocation():
    # a step on a subset of the allocation: rank 0 lives on the step's first node
    env = discover(srun_env(0, SLURM_JOB_NODELIST="gpu[01-08]", SLURM_STEP_NODELIST="gpu[05-06]"))
    assert env.master_addr == "gpu05"


def test_srun_port_comes_from_the_job_id_and_lies_in_range():
    for job_id in ("1", "4242", "19999", "20000", "987654321"):
        port = discover(srun_env(3, SLURM_JOB_ID=job_id)).master_port
        assert port == derive_port(job_id)
        assert PORT_BASE <= port < PORT_BASE + PORT_SPAN
        assert 1024 < port < 65536


def test_srun_explicit_master_variables_win():
    env = discover(srun_env(2, MASTER_ADDR="10.0.0.5", MASTER_PORT="31000"))
    assert (env.master_addr, env.master_port) == ("10.0.0.5", 31000)


def test_srun_restart_count_is_read():
    assert discover(srun_env(0)).restart_count == 0
    assert discover(srun_env(0, SLURM_RESTART_COUNT="2")).restart_count == 2


# --- torchrun, submitit local, plain ------------------------------------------------------


@pytest.mark.parametrize("rank", range(4))
def test_torchrun(rank):
    env = discover(torchrun_env(rank))
    assert env == DistEnv(
        rank=rank,
        world_size=4,
        local_rank=rank % 2,
        local_world_size=2,
        node_rank=rank // 2,
        num_nodes=2,
        master_addr="node-a.cluster",
        master_port=29400,
        job_id="exp17",
        launcher="torchrun",
        restart_count=1,
    )


def test_torchrun_without_group_rank_derives_the_node():
    raw = torchrun_env(3)
    del raw["GROUP_RANK"], raw["TORCHELASTIC_RUN_ID"]
    env = discover(raw)
    assert (env.node_rank, env.num_nodes, env.launcher) == (1, 2, "torchrun")


@pytest.mark.parametrize("rank", range(3))
def test_submitit_local(rank):
    raw = {**submitit_local_env(rank, 3, "31337"), "SUBMITIT_LOCAL_TIMEOUT_S": "3600"}
    env = discover(raw)
    assert env == DistEnv(
        rank=rank,
        world_size=3,
        local_rank=rank,
        local_world_size=3,
        node_rank=0,
        num_nodes=1,
        master_addr="127.0.0.1",
        master_port=derive_port("31337"),
        job_id="31337",
        launcher="submitit-local",
        restart_count=0,
    )


def test_plain_process_is_a_single_rank():
    env = discover({"HOME": "/home/user", "PATH": "/usr/bin"})
    assert (env.rank, env.world_size, env.local_rank, env.num_nodes) == (0, 1, 0, 1)
    assert env.launcher == "single" and env.is_master


def test_discover_reads_os_environ_by_default(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_")) or name in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
        ):
            monkeypatch.delenv(name)
    assert discover().launcher == "single"
    monkeypatch.setattr(os, "environ", {**os.environ, **submitit_local_env(1, 2, "77")})
    env = discover()
    assert (env.launcher, env.rank, env.world_size) == ("submitit-local", 1, 2)


# --- precedence when several launchers' variables are present -----------------------------


def test_submitit_local_inside_a_slurm_allocation_ignores_stale_slurm_variables():
    # `snakemake` run inside salloc/sbatch: the local executor's ranks inherit SLURM_* of the
    # outer job, which describe a different world (16 tasks, other hosts).
    raw = {**srun_env(5, SLURM_NTASKS="16"), **submitit_local_env(1, 2, "555")}
    env = discover(raw)
    assert env.launcher == "submitit-local"
    assert (env.rank, env.world_size, env.num_nodes) == (1, 2, 1)
    assert env.master_addr == "127.0.0.1"
    assert env.job_id == "555" and env.master_port == derive_port("555")


def test_torchrun_inside_srun_wins():
    # srun starts one torchrun per node: SLURM_PROCID is the node's index, not the rank
    raw = {**srun_env(1, SLURM_NTASKS="2", SLURM_PROCID="1"), **torchrun_env(3)}
    env = discover(raw)
    assert (env.launcher, env.rank, env.world_size) == ("torchrun", 3, 4)


def test_submitit_slurm_executor_uses_slurm_variables():
    # submitit's Slurm executor runs srun underneath and marks SUBMITIT_EXECUTOR=slurm
    env = discover(srun_env(6, SUBMITIT_EXECUTOR="slurm"))
    assert (env.launcher, env.rank, env.world_size) == ("slurm", 6, 8)


# --- host lists and ports -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[1-2]", ["node1", "node2"]),
        ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
        ("n[001-003]", ["n001", "n002", "n003"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("c1,gpu[3,5],c2", ["c1", "gpu3", "gpu5", "c2"]),
        ("node-a.cluster", ["node-a.cluster"]),
        ("", []),
        ("  ", []),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_derive_port_differs_for_consecutive_job_ids():
    ids = range(123_456, 123_456 + 500)
    ports = [derive_port(str(i)) for i in ids]
    assert len(set(ports)) == len(ports)
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    assert derive_port("12345_3") != derive_port("12345_4")  # array tasks
    assert derive_port("not-a-number") == PORT_BASE


# --- process group set-up -------------------------------------------------------------------


def test_init_process_group_is_a_no_op_for_one_rank():
    distenv.init_process_group(discover({}), "gloo", 10)
    assert not dist.is_initialized()


def test_non_master_fails_fast_when_rank_0_never_publishes(tmp_path):
    env = discover(submitit_local_env(1, 2, "808"))
    with pytest.raises(TimeoutError, match="rendezvous-808-0.port"):
        distenv.init_process_group(env, "gloo", 0.3, rendezvous_dir=tmp_path)
    assert not dist.is_initialized()


def _join_and_reduce(env):
    value = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(value)
    ranks = [None] * env.world_size
    dist.all_gather_object(ranks, (env.rank, env.launcher, env.job_id))
    return {
        "sum": value.item(),
        "gathered": ranks,
        "backend": dist.get_backend(),
        "world": dist.get_world_size(),
        "rank": dist.get_rank(),
    }


def test_two_ranks_meet_through_the_rendezvous_directory(tmp_path):
    results = run_group(2, _join_and_reduce, (), tmp_path)
    job_ids = {job for r in results for _, _, job in r["gathered"]}
    assert len(job_ids) == 1
    job_id = job_ids.pop()
    for rank, result in enumerate(results):
        assert result["rank"] == rank and result["world"] == 2
        assert result["backend"] == "gloo"
        assert result["sum"] == 3.0
        assert result["gathered"] == [(0, "submitit-local", job_id), (1, "submitit-local", job_id)]
    # rank 0 published the port it bound, for this job and attempt, atomically (no temp left)
    assert port_files(tmp_path) == [f"rendezvous-{job_id}-0.port"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rendezvous-{job_id}-0.port"]
    host, port, address = (tmp_path / f"rendezvous-{job_id}-0.port").read_text().split()
    assert host and 0 < int(port) < 65536 and address == "127.0.0.1"


# --- nothing open to other users: no wildcard listener, nothing pickled on the wire ---------


def _listeners_after_a_collective(env):
    dist.all_reduce(torch.ones(1))  # gloo's pairs are connected: every listener is up
    mine = f"{socket.gethostname()}-rank{env.rank}-\u00e9"  # any UTF-8
    hosts = distenv.all_gather_text(mine, env.world_size, torch.device("cpu"))
    some_empty = distenv.all_gather_text(mine if env.rank else "", env.world_size, "cpu")
    assert some_empty == ["", hosts[1]], some_empty
    dist.barrier()
    return {"listeners": own_listeners(), "hosts": hosts,
            "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}  # fmt: skip


def test_no_rank_listens_on_a_wildcard_address(tmp_path):
    # the detector sees a wildcard: torch's own TCPStore binds [::] whatever host it is given
    plain = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    assert any(a in ("0.0.0.0", "::") and p == plain.port for a, p in own_listeners())
    del plain
    for interface in (None, "lo"):  # the master's host name; machine.network_interface: lo
        folder = tmp_path / str(interface)
        results = run_group(2, _listeners_after_a_collective, (), folder, interface=interface)
        for rank, result in enumerate(results):
            assert result["listeners"], rank  # gloo listens on every rank
            wildcards = [a for a in result["listeners"] if a[0] in ("0.0.0.0", "::")]
            assert not wildcards, (interface, rank, result["listeners"])
            assert result["hosts"] == [f"{socket.gethostname()}-rank{r}-\u00e9" for r in (0, 1)]
            assert result["ifname"] == interface
        # rank 0's store listens on the address it published for the other ranks
        (port_file,) = folder.glob("rendezvous-*.port")
        _, port, address = port_file.read_text().split()
        assert (address, int(port)) in results[0]["listeners"]


def test_an_interface_that_is_not_here_is_named_with_those_that_are():
    assert rendezvous.interface_address("lo") == "127.0.0.1"
    with pytest.raises(rendezvous.NetworkError, match=r"machine.network_interface 'ib9'.*lo"):
        rendezvous.interface_address("ib9")
