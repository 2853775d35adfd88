"""Preflight communication check: before training, measure the allocated ranks' links and
fail the run, naming slow ranks and hosts, when bus bandwidth is below a threshold.

Two measurements, both with the run's own backend and devices:
  all_reduce   the collective DDP depends on; busbw as nccl-tests defines it;
  ping-pong    rank 0 <-> every other rank in turn, to tell WHICH rank/link is slow.
bus_bandwidth (nccl-tests' algbw/busbw) is also what bench/collectives.py reports.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from ddpflow.cluster.distenv import DistEnv
from ddpflow.config.typed import SectionView

log = logging.getLogger(__name__)


class SlowInterconnect(RuntimeError):
    """Bus bandwidth below machine.preflight.min_busbw_gbps."""


def bus_bandwidth(
    nbytes: float, seconds: float, world_size: int, collective: str
) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes/s) following nccl-tests' conventions.

    ``algbw = nbytes / seconds``, with ``nbytes`` the size of the (whole) tensor.
    ``busbw`` rescales it to the traffic each link must carry with an optimal
    algorithm, making it comparable across world sizes and with hardware peak:
    all_reduce ``* 2 (n - 1) / n``; all_gather, reduce_scatter and all_to_all
    ``* (n - 1) / n``; broadcast and reduce ``* 1``.
    """
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n = world_size
    # Keys are names with "_"/"-" removed so "all_reduce", "allreduce" and
    # "all-reduce" (nccl-tests' binary names) all match.
    factor = {
        "allreduce": 2 * (n - 1) / n,
        "allgather": (n - 1) / n,
        "reducescatter": (n - 1) / n,
        "alltoall": (n - 1) / n,
        "broadcast": 1.0,
        "reduce": 1.0,
    }.get(collective.lower().replace("_", "").replace("-", ""))
    if factor is None:
        raise ValueError(f"unknown collective {collective!r}")
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * factor


def _timed_all_reduce(tensor: torch.Tensor, iters: int, sync) -> float:
    dist.all_reduce(tensor)  # warm-up: connection set-up is not bandwidth
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    sync()
    return (time.perf_counter() - start) / iters


def _ping_pong(tensor: torch.Tensor, rank: int, peer: int, iters: int, sync) -> float:
    """Seconds per one-way transfer between rank 0 and `peer` (0 on uninvolved ranks)."""
    if rank not in (0, peer):
        return 0.0
    other = peer if rank == 0 else 0
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        if rank == 0:
            dist.send(tensor, other)
            dist.recv(tensor, other)
        else:
            dist.recv(tensor, other)
            dist.send(tensor, other)
    sync()
    return (time.perf_counter() - start) / (2 * iters)


def run_preflight(cfg: SectionView, env: DistEnv, device, hosts: list[str]) -> dict:
    """All ranks call this; returns the measurements (rank 0 decides and raises)."""
    if env.world_size == 1:
        return {}
    numel = max(1, int(cfg["megabytes"] * 1e6) // 4)
    tensor = torch.ones(numel, dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds = _timed_all_reduce(tensor, cfg["iters"], sync)
    _, busbw = bus_bandwidth(tensor.numel() * 4, seconds, env.world_size, "all_reduce")
    links = {}
    for peer in range(1, env.world_size):
        one_way = _ping_pong(tensor, env.rank, peer, cfg["iters"], sync)
        if env.rank == 0:
            links[peer] = tensor.numel() * 4 / one_way / 1e9
        dist.barrier()
    result = {"all_reduce_busbw_gbps": busbw, "link_gbps": links}
    if env.rank == 0:
        _judge(result, cfg["min_busbw_gbps"], hosts)
    return result


def _judge(result: dict, threshold: float, hosts: list[str]) -> None:
    busbw, links = result["all_reduce_busbw_gbps"], result["link_gbps"]
    log.info(
        "preflight: all_reduce busbw %.3f GB/s; rank 0 <-> rank links: %s",
        busbw,
        ", ".join(f"{r}@{hosts[r]} {g:.3f}" for r, g in links.items()),
    )
    if busbw >= threshold:
        return
    slow = [r for r, gbps in links.items() if gbps < threshold] or [min(links, key=links.get)]
    names = ", ".join(f"rank {r} on {hosts[r]} ({links[r]:.3f} GB/s)" for r in slow)
    links_text = "link" if len(slow) == 1 else "links"
    raise SlowInterconnect(
        f"preflight: all_reduce bus bandwidth {busbw:.3f} GB/s is below "
        f"machine.preflight.min_busbw_gbps={threshold}; slowest {links_text} from rank 0 "
        f"({hosts[0]}): {names}. Exclude those nodes (sbatch_extra: {{exclude: ...}}) or "
        "lower the threshold"
    )
