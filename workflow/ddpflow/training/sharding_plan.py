"""A world's sharding built in one process: torch's fake process group (the `fake` backend,
as torchtitan's `comm.mode: fake_backend`) stands in for every other rank, and the model is
built on the meta device (shapes, no storage), then sharded with FSDP2's fully_shard exactly
as ddpflow.training.sharding.shard does on a real rank. Collectives on a fake group return
garbage, so only the layout is read from it: the units, the mesh, each parameter's placement
and every rank's shard of it (DTensor's own chunking, Shard.local_shard_size_and_offset).

The ranks of one mesh are symmetric: each holds the same padded shard of every parameter
(FSDP2 pads dim 0 to a multiple of the shard count) and computes the same number of
micro-batches; only which rows and which micro-batches differ. So the model is sharded once,
as rank 0, and the other ranks' rows come from the same chunking.

    layout = shard_layout(model_cfg, shape, outputs, MeshSpec.for_strategy("fsdp", 128, 8))
    reads = resharding_reads(layout.sizes, old_mesh, new_mesh)   # after a resume at another size
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import typing

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ddpflow.config.machine import SHARDED_STRATEGIES
from ddpflow.training import sharding
from ddpflow.training.models import build_model


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """A device mesh's shape and dimension names: (world,) named ("shard",) for fsdp;
    (replicas, shard size) named ("replicate", "shard") for hsdp, as
    ddpflow.training.sharding.mesh_shape lays it out."""

    shape: tuple[int, ...]
    names: tuple[str, ...]

    @classmethod
    def for_strategy(
        cls, strategy: str, nodes: int, per_node: int, shard_size: int | None = None
    ) -> MeshSpec:
        """shard_size: hsdp's ranks per shard group (None: a node's ranks)."""
        if strategy not in SHARDED_STRATEGIES:
            raise ValueError(f"no device mesh for train.strategy {strategy!r}: it shards nothing")
        dims = sharding.mesh_shape(strategy, nodes * per_node, shard_size or per_node)
        return cls(dims, ("replicate", "shard") if len(dims) == 2 else ("shard",))

    @property
    def world(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """What fully_shard made of the model at one mesh, read on rank 0."""

    mesh: MeshSpec
    units: list[dict]  # {"name", "parameters"} in the order they are sharded; the root last
    sizes: dict[str, tuple[int, int, int]]  # parameter -> (dim-0 rows, bytes per row, dtype)
    placements: dict[str, str]  # parameter -> its DTensor placements, as torch prints them
    rank0_bytes: int  # parameter bytes rank 0 holds (its shards: the padded size)
    full_bytes: int  # the whole model's parameter bytes


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0):
    """A process group of `world` ranks in this process, this process rank `rank`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is initialised already: plan in a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def shard_layout(model_cfg: dict, shape: list[int], outputs: int, mesh: MeshSpec) -> ShardLayout:
    """The model built on the meta device and fully_shard-ed on a fake group of mesh.world
    ranks (as rank 0), as ddpflow.training.sharding.shard shards it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with fake_world(mesh.world), torch.device("meta"):
        model = build_model(model_cfg, shape, outputs)
        full = {n: (p.shape, p.element_size()) for n, p in model.named_parameters()}
        device_mesh = init_device_mesh("cpu", mesh.shape, mesh_dim_names=mesh.names)
        units = _units(model)
        for unit in sharding.units(model):
            fully_shard(unit, mesh=device_mesh)
        fully_shard(model, mesh=device_mesh)
        # fully_shard made every parameter a DTensor (its placements and local shard)
        params = {n: typing.cast(DTensor, p) for n, p in model.named_parameters()}
        placements = {n: str(tuple(p.placements)) for n, p in params.items()}
        held = sum(p.to_local().numel() * p.element_size() for p in params.values())
    sizes = {
        n: (s[0] if len(s) else 1, math.prod(s[1:]) * size, size) for n, (s, size) in full.items()
    }
    whole = sum(math.prod(s) * size for s, size in full.values())
    return ShardLayout(mesh, units, sizes, placements, held, whole)


def _units(model: nn.Module) -> list[dict]:
    """The FSDP units (sharding.units) by module name, each with its parameter count; the
    root unit holds what no block holds (embeddings, the last norm, the head)."""
    names = {id(m): n for n, m in model.named_modules()}
    blocks = sharding.units(model)
    inside = {id(p) for block in blocks for p in block.parameters()}
    rows = [
        {"name": names[id(b)], "parameters": sum(p.numel() for p in b.parameters())} for b in blocks
    ]
    rest = sum(p.numel() for p in model.parameters() if id(p) not in inside)
    return [*rows, {"name": "(root)", "parameters": rest}]


def rank_rows(rows: int, mesh: MeshSpec, rank: int) -> tuple[int, int]:
    """(first row, row count) of a dim-0-sharded parameter of `rows` rows on `rank`: DTensor's
    chunking (torch.chunk's: ceil(rows / shards) each, the last ranks short or empty)."""
    from torch.distributed.tensor.placement_types import Shard

    coordinate = _coordinate(rank, mesh.shape)
    shard_dim = mesh.names.index("shard")
    size, offset = Shard.local_shard_size_and_offset(
        rows, mesh.shape[shard_dim], coordinate[shard_dim]
    )
    return int(offset), int(size)


def _coordinate(rank: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for extent in reversed(shape):
        rank, here = divmod(rank, extent)
        out.append(here)
    return out[::-1]


def resharding_reads(
    sizes: dict[str, tuple[int, int, int]], old: MeshSpec, new: MeshSpec
) -> list[dict]:
    """After a resume at `new`, from a checkpoint written at `old`: for each new rank, the
    old ranks whose DCP files (__<rank>_0.distcp: each old rank's shards) hold rows of its
    shards, and the parameter bytes it reads. A 1-D mesh (fsdp): shard k is rank k's; on
    hsdp's 2-D mesh the numbers are shard indices (shard k is held by one rank of every
    replica group, and DCP writes it once)."""
    readers: list[set[int]] = [set() for _ in range(new.world)]
    nbytes = [0] * new.world
    old_shards = old.shape[old.names.index("shard")]
    for rows, row_bytes, _ in sizes.values():
        chunk = math.ceil(rows / old_shards)  # old rank k holds rows [k * chunk, ...)
        for r in range(new.world):
            start, count = rank_rows(rows, new, r)
            if count == 0:
                continue
            nbytes[r] += count * row_bytes
            readers[r].update(range(start // chunk, (start + count - 1) // chunk + 1))
    return [
        {"rank": r, "reads_from": sorted(readers[r]), "bytes": nbytes[r]} for r in range(new.world)
    ]


def micro_batch_shares(micro_batches: int, world: int) -> list[list[int]]:
    """Each rank's micro-batches of one optimizer step (their indices j), as
    ddpflow.training.schedule.rank_micro_batches picks them: the same for every step and
    epoch (the samples inside are (seed, epoch, step, j)'s, whichever rank computes them)."""
    from ddpflow.training.schedule import rank_micro_batches

    indices = torch.arange(micro_batches).view(1, micro_batches, 1)
    return [rank_micro_batches(indices, world, r).flatten().tolist() for r in range(world)]
