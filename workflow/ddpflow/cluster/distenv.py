"""Rank discovery and process-group set-up: one function for every launcher.

The same training code runs under:
  srun python -m ddpflow train ...            SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID / ...
  torchrun --nproc-per-node 2 -m ddpflow ...   RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / ...
  submitit (Slurm executor)                    srun underneath, so the SLURM_* variables
  submitit (local executor)                    SUBMITIT_LOCAL_* variables
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpflow.cluster import rendezvous

log = logging.getLogger(__name__)

PORT_BASE, PORT_SPAN = 20000, 20000


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    job_id: str
    launcher: str  # slurm | torchrun | submitit-local | single
    restart_count: int = 0
    # train.tensor_parallel (ddpflow.training.tensor_parallel.data_view): rank and world_size
    # are then the data-parallel ones, tensor_rank the place in the tensor group, and mesh
    # the (data, tensor) DeviceMesh whose data group the collectives of the data run over
    tensor_rank: int = 0
    tensor_parallel: int = 1
    mesh: Any = None

    @property
    def is_master(self) -> bool:
        return self.rank == 0 and self.tensor_rank == 0

    @property
    def global_rank(self) -> int:
        """The process's rank in the job (a tensor group's ranks are consecutive)."""
        return self.rank * self.tensor_parallel + self.tensor_rank

    @property
    def processes(self) -> int:
        """Every process of the job: the world size, times the tensor-parallel degree."""
        return self.world_size * self.tensor_parallel

    @property
    def group(self):
        """The process group of the data-parallel ranks (None: the whole world)."""
        return None if self.mesh is None else self.mesh["data"].get_group()


def discover(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Turn the launcher's environment variables into a DistEnv (no side effects)."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "LOCAL_RANK" in env):
        return _from_torchrun(env)
    if env.get("SUBMITIT_EXECUTOR") == "local" and "SUBMITIT_LOCAL_GLOBALID" in env:
        return _from_submitit_local(env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _from_slurm(env)
    return DistEnv(0, 1, 0, 1, 0, 1, "127.0.0.1", int(env.get("MASTER_PORT", 29500)), "0", "single")


def _from_torchrun(env: Mapping[str, str]) -> DistEnv:
    world = int(env["WORLD_SIZE"])
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    return DistEnv(
        rank=int(env["RANK"]),
        world_size=world,
        local_rank=int(env["LOCAL_RANK"]),
        local_world_size=local_world,
        node_rank=int(env.get("GROUP_RANK", int(env["RANK"]) // local_world)),
        num_nodes=max(1, world // local_world),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", 29500)),
        job_id=env.get("TORCHELASTIC_RUN_ID", "torchrun"),
        launcher="torchrun",
        restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
    )


def _from_submitit_local(env: Mapping[str, str]) -> DistEnv:
    world = int(env["SUBMITIT_LOCAL_NTASKS"])
    job_id = env.get("SUBMITIT_LOCAL_JOB_ID", "0")
    return DistEnv(
        rank=int(env["SUBMITIT_LOCAL_GLOBALID"]),
        world_size=world,
        local_rank=int(env["SUBMITIT_LOCAL_LOCALID"]),
        local_world_size=world,
        node_rank=0,
        num_nodes=1,
        master_addr="127.0.0.1",
        master_port=int(env.get("MASTER_PORT", derive_port(job_id))),
        job_id=job_id,
        launcher="submitit-local",
    )


def _from_slurm(env: Mapping[str, str]) -> DistEnv:
    world = int(env["SLURM_NTASKS"])
    nodes = expand_nodelist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
    num_nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or len(nodes) or 1)
    job_id = env.get("SLURM_JOB_ID", "0")
    return DistEnv(
        rank=int(env["SLURM_PROCID"]),
        world_size=world,
        local_rank=int(env.get("SLURM_LOCALID", 0)),
        local_world_size=_tasks_on_this_node(env, world, num_nodes),
        node_rank=int(env.get("SLURM_NODEID", 0)),
        num_nodes=num_nodes,
        master_addr=env.get("MASTER_ADDR") or (nodes[0] if nodes else "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT") or derive_port(job_id)),
        job_id=job_id,
        launcher="slurm",
        restart_count=int(env.get("SLURM_RESTART_COUNT", 0)),
    )


def _tasks_on_this_node(env: Mapping[str, str], world: int, num_nodes: int) -> int:
    # SLURM_TASKS_PER_NODE looks like "2(x3),1"; the node's own count is SLURM_NTASKS_PER_NODE
    # when given, else the even share (what ddpflow always requests).
    if env.get("SLURM_NTASKS_PER_NODE"):
        return int(env["SLURM_NTASKS_PER_NODE"])
    return max(1, world // max(1, num_nodes))


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list: 'gpu[01-03,07],x1' -> gpu01 gpu02 gpu03 gpu07 x1."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_one(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    return [item for item in [*items, current] if item]


def _expand_one(item: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if not match:
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    out = []
    for part in match.group(1).split(","):
        lo, _, hi = part.partition("-")
        width = len(lo)  # keep zero padding: gpu[01-03] -> gpu01
        for number in range(int(lo), int(hi or lo) + 1):
            out.extend(_expand_one(f"{head}{number:0{width}d}{tail}"))
    return out


def derive_port(job_id: str) -> int:
    """A port from the job id: two jobs sharing a node get different ports unless their ids
    differ by a multiple of PORT_SPAN. `init_process_group` avoids even that when a shared
    rendezvous directory is given (rank 0 binds a free port and publishes it)."""
    digits = re.sub(r"\D", "", str(job_id)) or "0"
    return PORT_BASE + int(digits) % PORT_SPAN


def init_process_group(
    env: DistEnv,
    backend: str,
    timeout_s: float,
    rendezvous_dir: str | Path | None = None,
    interface: str | None = None,
) -> None:
    """Initialise torch.distributed for `env` (no-op for world size 1). Rank 0's store
    listens on the address the other ranks use (or `interface`'s: machine.network_interface),
    never on a wildcard (ddpflow.cluster.rendezvous)."""
    import torch.distributed as dist

    if env.world_size == 1 or dist.is_initialized():
        return
    rendezvous.use_interface(interface)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _make_store(env, timeout, rendezvous_dir, interface)
    dist.init_process_group(
        backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
    )
    log.info(
        "process group up: backend=%s world=%d master=%s", backend, env.world_size, env.master_addr
    )


def _make_store(env: DistEnv, timeout: datetime.timedelta, rendezvous_dir, interface=None):
    import torch.distributed as dist

    if rendezvous_dir is None:  # srun, torchrun: MASTER_ADDR:MASTER_PORT (or the job-id port)
        # torchrun's agent already serves the store on MASTER_PORT: every rank is its client
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        if env.is_master and not agent_store:
            address = rendezvous.listen_address(env.master_addr, interface)
            return rendezvous.master_store(address, env.master_port, env.world_size, timeout)
        return dist.TCPStore(
            env.master_addr, env.master_port, env.world_size, False, timeout=timeout
        )
    # Rank 0 lets the OS pick a free port and publishes it (and the address it listens on)
    # in the job's private work folder: two jobs on one node can never collide, and a
    # requeued attempt, and each step a job's supervisor restarts (cluster.supervise), gets
    # its own file.
    step = os.environ.get("DDPFLOW_RESTART_IN_JOB")
    attempt = f"{env.restart_count}-{step}" if step else str(env.restart_count)
    port_file = Path(rendezvous_dir) / f"rendezvous-{env.job_id}-{attempt}.port"
    if env.is_master:
        address = rendezvous.listen_address(env.master_addr, interface)
        store = rendezvous.master_store(address, 0, env.world_size, timeout, wait_for_workers=False)
        rendezvous.publish(port_file, address, store.port)
        return store
    port, published = rendezvous.read_published(port_file, timeout.total_seconds())
    host = published or env.master_addr
    return dist.TCPStore(host, port, env.world_size, False, timeout=timeout)


def barrier(env: DistEnv) -> None:
    """Wait for every rank (nothing to wait for in a single-process run)."""
    if env.processes > 1:
        import torch.distributed as dist

        dist.barrier()


# the store key every rank adds 1 to once its process group is destroyed
LEFT_KEY = "ddpflow/left"


def leave_together(env: DistEnv, wait: bool = True, timeout_s: float = 10.0) -> None:
    """Destroy the process group, then (wait: the rank's work succeeded, so every rank
    gets here) wait up to timeout_s until every rank has destroyed its own before this
    process may exit; a failed rank leaves at once (the others may be stuck in a collective:
    fail-fast must not wait for them). A rank that exited while another still tore its gloo
    group down (rank 0's exit also ends the TCPStore the others use) aborted that rank at
    exit ("terminate called without an active exception") on the Slurm test cluster, a
    barrier before the teardown notwithstanding: the race is in the teardown itself."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    store = None
    if wait and env.processes > 1:
        try:
            store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError, AttributeError):
            store = None
    dist.destroy_process_group()
    if store is None:
        return
    deadline = time.monotonic() + timeout_s
    try:
        store.add(LEFT_KEY, 1)
        while store.add(LEFT_KEY, 0) < env.processes and time.monotonic() < deadline:
            time.sleep(0.02)
    except (RuntimeError, OSError):  # the store's host (rank 0) saw everyone leave and left
        return


TEXT_BYTES = 256  # a host name is at most 255 bytes (and 64 on Linux)


def all_gather_text(text: str, world_size: int, device) -> list[str]:
    """Every rank's `text` (up to 255 UTF-8 bytes: a host name), in rank order: one
    all_gather of a uint8 tensor, nothing pickled on the wire (all_gather_object unpickles
    what the other ranks send). `device`: the rank's (NCCL gathers GPU tensors only)."""
    if world_size == 1:
        return [text]
    import torch
    import torch.distributed as dist

    data = text.encode()[: TEXT_BYTES - 1]
    mine = torch.zeros(TEXT_BYTES, dtype=torch.uint8)
    mine[0] = len(data)
    if data:  # torch.frombuffer refuses an empty buffer
        mine[1 : 1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    rows = [bytes(t.cpu().tolist()) for t in gathered]
    return [row[1 : 1 + row[0]].decode(errors="replace") for row in rows]


def any_rank(world_size: int, flag: bool) -> bool:
    """True on every rank if `flag` is true on any (a MAX all-reduce; world 1: the flag).
    Every rank must call it at the same point: it is a collective."""
    if world_size == 1:
        return flag
    import torch
    import torch.distributed as dist

    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
