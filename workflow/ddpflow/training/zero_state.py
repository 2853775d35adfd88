"""ZeRO's optimizer state gathered on rank 0 for a checkpoint, its tensors sent as tensors.

torch's ZeroRedundancyOptimizer.consolidate_state_dict pickles each rank's state and builds
the byte tensor from a Python bytearray, element by element: a rank sending a ViT-B/16's
AdamW shard (0.32 GB) peaked 3 GB higher for it (bench/memory_estimate.py). Here each rank's
state dict travels as a skeleton (its structure, the tensors' shapes, dtypes and strides:
small, in broadcast_object_list) and its tensors one by one with point-to-point send/recv to rank 0,
which keeps them on the CPU. The result is what consolidate_state_dict leaves, so torch's own
state_dict() on rank 0 builds the whole state from it, as before.

    consolidate(optimizer)          # collective; then optimizer.state_dict() on rank 0
    release(optimizer)              # after the checkpoint is written
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_TENSOR = "__ddpflow_tensor__"


def consolidate(optimizer) -> None:
    """Collective: every rank's local optimizer state onto rank 0 of the optimizer's group,
    in the list torch's ZeroRedundancyOptimizer.state_dict() reads (_all_state_dicts)."""
    group, rank = optimizer.process_group, optimizer.rank
    # as torch's consolidation does first: the exposed param_groups (the schedule's lr) into
    # the local optimizer whose state dict is sent
    optimizer._sync_param_groups(optimizer.param_groups, optimizer.optim.param_groups)
    gathered: list[dict] = []
    for source in range(optimizer.world_size):
        global_source = dist.get_global_rank(group, source)
        local = optimizer.optim.state_dict() if rank == source else None
        skeleton, tensors = _split(local) if local is not None else (None, [])
        box = [skeleton]
        dist.broadcast_object_list(box, src=global_source, group=group)
        if source == 0:  # rank 0's own, on the CPU (a copy only from a GPU), as torch keeps it
            if rank == 0:
                gathered.append(_fill(box[0], [t.detach().cpu() for t in tensors]))
            continue
        if rank == source:
            for tensor in tensors:
                dist.send(tensor.contiguous(), dst=dist.get_global_rank(group, 0), group=group)
        elif rank == 0:
            received = []
            for shape, dtype, stride in _specs(box[0]):
                buffer = torch.empty(shape, dtype=dtype, device=optimizer._default_device)
                dist.recv(buffer, src=global_source, group=group)
                # in the sender's layout (a channels_last weight's state is channels_last:
                # the fused optimizer pairs elements by memory order), as pickling keeps it
                kept = torch.empty_strided(shape, stride, dtype=dtype)
                received.append(kept.copy_(buffer))
            gathered.append(_fill(box[0], received))
    if rank == 0:
        optimizer._all_state_dicts = gathered


def release(optimizer) -> None:
    """Drop rank 0's gathered state (torch keeps it until the next consolidation)."""
    optimizer._all_state_dicts = []


def _split(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """(the structure with each tensor replaced by a marker, the tensors in order)."""
    tensors: list[torch.Tensor] = []

    def walk(value):
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            dtype = str(value.dtype).removeprefix("torch.")
            return (_TENSOR, tuple(value.shape), dtype, tuple(value.stride()))
        if isinstance(value, dict):
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(walk(item) for item in value)
        return value

    return walk(state), tensors


def _specs(skeleton: Any) -> list[tuple[tuple[int, ...], torch.dtype, tuple[int, ...]]]:
    """The shapes, dtypes and strides of the markers in skeleton, in _split's order."""
    found: list[tuple[tuple[int, ...], torch.dtype, tuple[int, ...]]] = []

    def walk(value):
        if isinstance(value, tuple) and len(value) == 4 and value[0] == _TENSOR:
            found.append((value[1], getattr(torch, value[2]), value[3]))
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)

    walk(skeleton)
    return found


def _fill(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """_split's inverse: the markers replaced by the tensors, in order."""
    queue = iter(tensors)

    def walk(value):
        if isinstance(value, tuple) and len(value) == 4 and value[0] == _TENSOR:
            return next(queue)
        if isinstance(value, dict):
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(walk(item) for item in value)
        return value

    return walk(skeleton)
