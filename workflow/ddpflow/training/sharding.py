"""Fully sharded training (train.strategy: fsdp, and hsdp on a 2-D mesh): FSDP2's
fully_shard per block and on the root, and its checkpoints, written with
torch.distributed.checkpoint (DCP); and activation checkpointing of the same blocks
(train.activation_checkpointing).

Each rank holds 1/N of every parameter, its gradient and its optimizer state; a block's
parameters are all-gathered for its forward and backward and freed after, and gradients are
reduce-scattered. A checkpoint is a DCP directory (ckpt-<step>.dcp/: each rank writes its
own shards, rank 0 the metadata) next to rank 0's ckpt-<step>.pt with everything else (the
position, RNG states, metrics so far) and the sha256 of every file of the directory. The .pt
is written last: it is the commit, and a checkpoint whose files do not match it is skipped
like a corrupt one. Works on CPU with gloo and on GPUs with NCCL.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ddpflow.config.machine import hsdp_mesh
from ddpflow.training import tensor_parallel

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

    from ddpflow.config.typed import TrainFsdpSpec

log = logging.getLogger(__name__)

# torchvision's repeated blocks (ResNet, ViT, ConvNeXt, MobileNet, EfficientNet, Swin, ...)
# and torch's transformer layers: each becomes one FSDP unit (one all-gather per forward)
BLOCK_TYPES = {
    "BasicBlock",
    "Bottleneck",
    "EncoderBlock",
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
    "CNBlock",
    "InvertedResidual",
    "MBConv",
    "FusedMBConv",
    "SwinTransformerBlock",
    "SwinTransformerBlockV2",
    "ResBottleneckBlock",
    "GPTBlock",
}


def units(model: nn.Module) -> list[nn.Module]:
    """The modules to shard one by one before the root: the model's repeated blocks, or,
    for a model without any (a Sequential of layers), each direct child with parameters."""
    blocks = [m for m in model.modules() if type(m).__name__ in BLOCK_TYPES]
    if blocks:
        return blocks
    return [child for child in model.children() if any(True for _ in child.parameters())]


def checkpoint_activations(model: nn.Module) -> int:
    """Recompute each block's activations in the backward instead of keeping them (torch's
    non-reentrant activation checkpointing): memory for one block's activations at a time,
    at the cost of a second forward. The forward is wrapped in place (parameter names and
    the state dict stay as they are). BatchNorm layers are recomputed without updating their
    running statistics a second time, so a run trains bitwise the model it trains without.
    Returns the number of blocks wrapped."""
    import functools

    from torch.utils.checkpoint import checkpoint

    blocks = units(model)
    for block in blocks:
        norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        contexts = functools.partial(_recompute_contexts, norms)
        block.forward = functools.partial(
            checkpoint, block.forward, use_reentrant=False, context_fn=contexts
        )
    return len(blocks)


def _recompute_contexts(norms: list):
    return contextlib.nullcontext(), _frozen_statistics(norms)


@contextlib.contextmanager
def _frozen_statistics(norms: list):
    """During a recomputed forward: BatchNorm momentum 0 (running statistics unchanged,
    exactly: r * 1 + b * 0) and its batch counter restored after."""
    counters = [m.num_batches_tracked.clone() if m.track_running_stats else None for m in norms]
    saved = [(m.momentum, counter) for m, counter in zip(norms, counters, strict=True)]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, (momentum, tracked) in zip(norms, saved, strict=True):
            m.momentum = momentum
            if tracked is not None:
                m.num_batches_tracked.copy_(tracked)


def mesh_shape(strategy: str, world: int, shard_size: int) -> tuple[int, ...]:
    """fsdp: (world,), one shard group. hsdp: (replicas, shard_size), ranks r*shard_size to
    (r+1)*shard_size-1 in replica r's shard group (the ranks of a node, as srun numbers
    them: a node's ranks are consecutive), the same shards replicated across groups."""
    if strategy != "hsdp":
        return (world,)
    mesh = hsdp_mesh(world, shard_size)
    if mesh is None:
        raise ValueError(
            f"train.hsdp.shard_size {shard_size} does not divide the world size {world}: "
            "set train.hsdp.shard_size to a divisor of every world size the run may get, "
            "or null (the ranks of a node)"
        )
    return mesh


def shard(
    model: nn.Module,
    device: torch.device,
    cfg: TrainFsdpSpec,
    precision: str,
    mesh_dims: tuple[int, ...] | None = None,
    data_mesh=None,
) -> nn.Module:
    """fully_shard every unit, then the root (in place; returns the model), as train.fsdp
    and train.precision say, on a 1-D mesh of the world (fsdp) or a 2-D replicate x shard
    mesh (hsdp: FSDP2 shards along the second dimension and all-reduces gradients along
    the first). data_mesh: the data dimension of tensor parallelism's mesh, which fsdp
    shards over instead (tensor_parallel: the 2-D data x tensor layout)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    dims = mesh_dims or (dist.get_world_size(),)
    names = ("replicate", "shard") if len(dims) == 2 else ("shard",)
    mesh = data_mesh or init_device_mesh(device.type, dims, mesh_dim_names=names)
    kwargs: dict = {"mesh": mesh, "reshard_after_forward": cfg.reshard_after_forward}
    if device.type == "cuda" and precision == "bf16":
        reduce = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.reduce_dtype]
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for unit in units(model):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module):
    """Accumulation micro-steps: keep gradients unreduced (FSDP's no_sync)."""
    sharded = cast("FSDPModule", model)  # shard() made it one (strategy fsdp only)
    sharded.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        sharded.set_requires_gradient_sync(True)


def full_model_state(model: nn.Module) -> dict:
    """Collective: the whole, unsharded state dict on rank 0 (CPU tensors, plain keys: what
    model.pt holds and the evaluate job loads); an empty dict on the other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    degree = tensor_parallel.degree_of(model)
    state = get_model_state_dict(model, options=options)
    return tensor_parallel.whole_state(state, degree) if degree > 1 else state


def dcp_dir(pt: Path) -> Path:
    """ckpt-000000012.pt -> ckpt-000000012.dcp (the sharded state's directory)."""
    return pt.with_suffix(".dcp")


def save(model: nn.Module, optimizer, pt: Path, is_master: bool, world_size: int = 2):
    """Collective: write model and optimizer shards to pt's DCP directory; rank 0 returns the
    file checksums for its .pt (the other ranks None). A directory left by a crash at this
    step is replaced. On one rank (strategy fsdp trains unsharded there) the same format,
    written without a process group: any world size reshards it."""
    import torch.distributed.checkpoint as dcp

    directory, state = _prepared_state(model, optimizer, pt, is_master, world_size)
    distributed = world_size > 1
    with _single_process_quiet(distributed):
        dcp.save(state, checkpoint_id=directory)
    if distributed:
        dist.barrier()  # every rank's files are complete before rank 0 hashes them
    if not is_master:
        return None
    return {"dir": directory.name, "files": _hashes(directory)}


def save_in_background(
    model: nn.Module, optimizer, pt: Path, is_master: bool, world_size: int, group=None
):
    """save()'s shards with the writing left to the background (train.checkpoint.async): the
    shards are copied to host memory now; the returned finish() writes them (DCP's
    async_save over `group`, a process group of the checkpoints' own, so that its
    collectives never meet the training's) and, on rank 0, returns the checksums for the
    .pt once every rank's files are complete (None on the others)."""
    import torch.distributed.checkpoint as dcp

    from ddpflow.training.background_save import snapshot

    directory, state = _prepared_state(model, optimizer, pt, is_master, world_size)
    if world_size > 1:
        # the shards are staged to host memory before async_save returns; rank 0's future
        # resolves once every rank's write result reached it and the metadata is written
        future = cast(Any, dcp.async_save(state, checkpoint_id=directory, process_group=group))

        def write() -> None:
            future.result()
    else:
        copied = snapshot(state)

        def write() -> None:
            with _single_process_quiet(False):
                dcp.save(copied, checkpoint_id=directory)

    def finish() -> dict | None:
        write()
        return {"dir": directory.name, "files": _hashes(directory)} if is_master else None

    return finish


def _prepared_state(model: nn.Module, optimizer, pt: Path, is_master: bool, world_size: int):
    """(pt's DCP directory, the state to write there): a crashed attempt's directory at this
    step removed, every rank holding rank 0's buffers."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    directory = dcp_dir(pt)
    if is_master and directory.exists():
        shutil.rmtree(directory)
    # Buffers (BatchNorm statistics) are not sharded: DCP saves one copy of a tensor that
    # is not a DTensor, from whichever rank balances the writes. Only rank 0's statistics
    # matter (training uses batch statistics; validation and model.pt take rank 0's, as
    # with DDP), so every rank takes rank 0's first: the copy saved is rank 0's.
    if world_size > 1:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
        dist.barrier()  # rank 0 removed a crashed attempt's directory before anyone writes
    state = dict(zip(("model", "optimizer"), get_state_dict(model, optimizer), strict=True))
    if (degree := tensor_parallel.degree_of(model)) > 1:  # qkv whole, in gpt's row order
        state = tensor_parallel.whole_state(state, degree)
    return directory, state


def _hashes(directory: Path) -> dict[str, str]:
    files = {}
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        files[path.name] = digest.hexdigest()
    return files


def verify(pt: Path, sharded: dict) -> str | None:
    """None if pt's DCP directory holds exactly the files its .pt lists, with their
    checksums; else what is wrong (the checkpoint is then skipped)."""
    directory = pt.with_name(sharded["dir"])
    if not directory.is_dir():
        return f"its sharded state {directory.name}/ is missing"
    found = _hashes(directory)
    if found != sharded["files"]:
        bad = sorted(set(found) ^ set(sharded["files"])) or sorted(
            name for name in found if found[name] != sharded["files"][name]
        )
        return f"its sharded state {directory.name}/ does not match its checksums ({bad})"
    return None


def load(model: nn.Module, optimizer, pt: Path, sharded: dict) -> None:
    """Collective: each rank reads its shards of the model and optimizer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    degree = tensor_parallel.degree_of(model)
    into = tensor_parallel.whole_state(state, degree) if degree > 1 else state
    with _single_process_quiet(dist.is_initialized()):
        dcp.load(into, checkpoint_id=pt.with_name(sharded["dir"]))
    if degree > 1:  # each rank's share of the whole qkv tensors it read
        state = tensor_parallel.split_state(into, state, degree)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


@contextlib.contextmanager
def _single_process_quiet(distributed: bool):
    """DCP warns that it assumes a single process when there is no process group: on one
    rank that is the intent (a 1-rank run of strategy fsdp), so the warning is dropped."""
    if distributed:
        yield
        return
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield
