"""train.tensor_parallel: N, Megatron-style tensor parallelism for model gpt, with DTensor's
parallelize_module on a 2-D mesh ("data", "tensor") of (world / N, N) ranks.

Within each GPTBlock the attention's qkv and the MLP's first layer are split column-wise
(each rank computes N-th of the heads and of the hidden units), attn.proj and the MLP's
second layer row-wise (each rank's partial product is summed over the tensor group): two
all-reduces per block in the forward (after attn.proj and mlp.2) and two in the backward
(the input gradients of qkv and mlp.0). qkv's rows are q, k and v stacked: parallelize
regroups them per rank first (by_rank), so that a rank's contiguous N-th holds the same
heads of q, k and v. Embeddings, norms and the tied output layer stay whole on every rank,
with the same gradients (the activations around them are whole and the same), as DTensors
replicated over the tensor group: every parameter is a DTensor, which AdamW's multi-tensor
kernel steps together.

The N ranks of a tensor group are consecutive (srun's numbering puts them on one node) and
compute the same micro-batches: to the data, the loop and the evaluation they are one
data-parallel rank (data_view). Across the data dimension the strategy applies: ddp
all-reduces the gradients over each data group after the step's last micro-batch
(GradientSync; DDP itself takes no DTensor parameters), fsdp shards every block over it
(FSDP2's fully_shard on the data mesh: the 2-D data x tensor layout of torchtitan).

Checkpoints are DCP's (sharding.save), with qkv's tensors (and their optimizer state) whole
in gpt's own row order (whole_state): the same keys and shapes as a run without tensor
parallelism, so a run resumes at another degree and world size, tensor_parallel 1 included,
and a whole ddp state resumes split (load_whole). model.pt holds the whole model
(sharding.full_model_state), which evaluation, prediction and generation load as any gpt's."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ddpflow.cluster.distenv import DistEnv

if TYPE_CHECKING:
    from ddpflow.training.gpt import GPT

log = logging.getLogger(__name__)

MESH_NAMES = ("data", "tensor")


def mesh(device: torch.device, world: int, tensor: int):
    """The 2-D DeviceMesh (data, tensor): rank r is in tensor group r // tensor (the
    consecutive ranks r - r % tensor, ..., a node's) and data group r % tensor."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world // tensor, tensor), mesh_dim_names=MESH_NAMES)


def data_view(env: DistEnv, device_mesh) -> DistEnv:
    """The rank as the data sees it: its data-parallel rank and the data group's size, its
    collectives over the data group (env.group, of env.mesh); env.tensor_rank its place in
    its tensor group. is_master stays global rank 0 alone (data and tensor rank 0)."""
    tensor = device_mesh["tensor"].size()
    return dataclasses.replace(
        env,
        rank=device_mesh["data"].get_local_rank(),
        world_size=device_mesh["data"].size(),
        local_world_size=max(1, env.local_world_size // tensor),
        tensor_rank=device_mesh["tensor"].get_local_rank(),
        tensor_parallel=tensor,
        mesh=device_mesh,
    )


def _plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(),
    }


def parallelize(model: nn.Module, tensor_mesh) -> int:
    """Split every GPTBlock's projections over tensor_mesh (in place); returns the blocks.
    Every rank holds the same initial weights (placed_model seeds them alike), so each
    takes its slice of its own copy: nothing is sent. qkv's rows are first regrouped per
    rank (by_rank), so that a contiguous N-th is whole heads of q, k and v."""
    from torch.distributed.tensor.parallel import parallelize_module

    from ddpflow.training.gpt import GPT, GPTBlock

    if not isinstance(model, GPT):
        raise ValueError(
            f"train.tensor_parallel splits model gpt's blocks; {type(model).__name__} has "
            "none: set train.tensor_parallel: 1"
        )
    degree = tensor_mesh.size()
    with torch.no_grad():
        for block in model.blocks:
            assert isinstance(block, GPTBlock)
            for param in block.attn.qkv.parameters():
                param.copy_(by_rank(param, degree))
            parallelize_module(block, tensor_mesh, _plan())
    _replicate_the_rest(model, tensor_mesh)
    return len(model.blocks)


def _replicate_the_rest(model: GPT, tensor_mesh) -> None:
    """The parameters left whole (embeddings, norms, the tied output layer) as DTensors
    replicated over the tensor group, each module taking and giving plain tensors: every
    parameter is then a DTensor, which torch's multi-tensor optimizer kernels (foreach)
    step together. The tie of the output layer to the token embedding is kept."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def partition(name, module, mesh):
        for key, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                whole = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
                module.register_parameter(key, nn.Parameter(whole, param.requires_grad))

    def inputs(module, args, mesh):
        return tuple(
            DTensor.from_local(a, mesh, [Replicate()], run_check=False)
            if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
            else a
            for a in args
        )

    def outputs(module, output, mesh):
        return output.to_local() if isinstance(output, DTensor) else output

    # the logits are then a view (to_local's), which FSDP2 warns about at every forward of
    # its root: an in-place op on them would skip its hooks. Nothing writes to the logits
    # (the loss, evaluation and sampling read them), and a copy would double their memory
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

    split = {id(module) for block in model.blocks for module in _split(block)}
    for name, module in model.named_modules():
        if id(module) in split or not any(True for _ in module.parameters(recurse=False)):
            continue
        if name == "head":  # tied: the embedding's replicated weight, set before
            module.weight = model.wte.weight
        distribute_module(module, tensor_mesh, partition, inputs, outputs)


def _split(block) -> list[nn.Module]:
    return [block.get_submodule(name) for name in _plan()]


def by_rank(qkv: torch.Tensor, degree: int) -> torch.Tensor:
    """qkv's rows [q; k; v] regrouped as [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], where _r are
    tensor rank r's heads (a copy; inverse: in_parts)."""
    parts = qkv.reshape(3, degree, qkv.shape[0] // (3 * degree), *qkv.shape[1:])
    return parts.transpose(0, 1).reshape(qkv.shape)


def in_parts(qkv: torch.Tensor, degree: int) -> torch.Tensor:
    """by_rank's inverse: the rows back as [q; k; v] (how a gpt holds them)."""
    groups = qkv.reshape(degree, 3, qkv.shape[0] // (3 * degree), *qkv.shape[1:])
    return groups.transpose(0, 1).reshape(qkv.shape)


QKV = ("attn.qkv.weight", "attn.qkv.bias")


def whole_state(state: dict, degree: int) -> dict:
    """Collective: a copy of a (nested) model or optimizer state dict as DCP's
    get_state_dict gives it (keys are parameter names) in which qkv's tensors, and their
    optimizer state, are whole on every rank with their rows as a gpt holds them ([q; k;
    v]): checkpoints and model.pt hold the layout of a run without tensor parallelism (the
    same keys and shapes), which any degree reads (split_state). The other tensors stay as
    they are (DCP saves their shards). Every rank walks the same keys in the same order."""
    # under fsdp too a whole qkv takes two all-gathers (data, then tensor), which DTensor
    # warns about on every rank at every save: they gather, nothing is summed
    quiet = logging.getLogger("torch.distributed.tensor._redistribute")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return _walk(state, state, lambda value, _: in_parts(_full(value), degree))
    finally:
        quiet.setLevel(level)


def split_state(loaded: dict, like: dict, degree: int) -> dict:
    """whole_state's inverse for a state loaded into whole qkv tensors: each regrouped per
    rank (by_rank) and cut into this rank's share as its counterpart in `like` (the rank's
    own state dict) is placed (no communication: every rank holds the whole)."""
    from torch.distributed.tensor import DTensor

    def share(value: torch.Tensor, template) -> torch.Tensor:
        if not isinstance(template, DTensor):
            return value
        return _share(by_rank(value, degree), template)

    return _walk(loaded, like, share)


def _share(whole: torch.Tensor, like) -> torch.Tensor:
    """This rank's share of `whole`, placed as the DTensor `like` (no communication: every
    rank holds the same whole tensor)."""
    from torch.distributed.tensor import distribute_tensor

    placed = whole.to(like.device)
    return distribute_tensor(placed, like.device_mesh, like.placements, src_data_rank=None)


def _walk(state: dict, like: dict, change, inside: bool = False) -> dict:
    """A copy of the nested state with change(tensor, its counterpart in like) applied to
    every tensor under a qkv parameter's name (not its optimizer step count, a scalar)."""
    result: dict = {}
    for key, value in state.items():
        under = inside or (isinstance(key, str) and key.endswith(QKV))
        if isinstance(value, dict):
            result[key] = _walk(value, like[key], change, under)
        elif under and isinstance(value, torch.Tensor) and value.dim() > 0:
            result[key] = change(value, like[key])
        else:
            result[key] = value
    return result


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class GradientSync(nn.Module):
    """Strategy ddp with tensor_parallel: the model's forward, and its gradients averaged
    over the data group by sync() after the step's last micro-batch (one flat all-reduce per
    dtype, of each DTensor's local shard and each whole tensor). no_sync() is DDP's name for
    what needs nothing here: gradients accumulate until sync() is called."""

    def __init__(self, model: nn.Module, group, size: int):
        super().__init__()
        self.module, self.group, self.size = model, group, size

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        yield

    @torch.no_grad()
    def sync(self) -> None:
        if self.size == 1:
            return
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [_local(p.grad) for p in self.module.parameters() if p.grad is not None]
        for dtype in sorted({g.dtype for g in grads}, key=str):
            same = [g for g in grads if g.dtype == dtype]
            flat = _flatten_dense_tensors(same)
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.size)
            for grad, mean in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
                grad.copy_(mean)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def arrange(run, env: DistEnv, device: torch.device, hosts: list[str]):
    """(env, hosts) as the training sees them: at train.tensor_parallel N > 1 the data view
    of the rank on a fresh (data, tensor) mesh; the hosts stay every rank's (a data rank
    r's tensor group is ranks r * N to r * N + N - 1, on one node); unchanged at 1."""
    tensor = run.train.tensor_parallel
    if tensor == 1:
        return env, hosts
    if env.world_size % tensor:
        raise ValueError(
            f"train.tensor_parallel {tensor} does not divide the world size {env.world_size}: "
            "set it to a divisor of the ranks of a node"
        )
    view = data_view(env, mesh(device, env.world_size, tensor))
    spread = [r for r in range(0, len(hosts), tensor) if len(set(hosts[r : r + tensor])) > 1]
    if spread and view.is_master:  # correct, but its all-reduces cross the slower network
        first = hosts[spread[0] : spread[0] + tensor]
        where = f"ranks {spread[0]}-{spread[0] + tensor - 1} on {', '.join(sorted(set(first)))}"
        log.warning(
            "tensor parallel: %d tensor groups span nodes (%s): Slurm did not number a node's "
            "ranks consecutively (a cyclic task distribution?); launch with srun "
            "--distribution=block",
            len(spread),
            where,
        )
    if view.is_master:
        what = "each block's projections split over consecutive ranks of a node"
        log.info("tensor parallel: %d data x %d tensor ranks (%s)", view.world_size, tensor, what)
    return view, hosts


def degree_of(model: nn.Module) -> int:
    """The tensor-parallel degree a model was split with (parallelize): 1 if it was not."""
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        if name.endswith(QKV[0]) and isinstance(param, DTensor):
            names = param.device_mesh.mesh_dim_names or ()
            return param.device_mesh["tensor"].size() if "tensor" in names else 1
    return 1


@torch.no_grad()
def load_whole(model: nn.Module, optimizer, model_state: dict, optimizer_state: dict) -> None:
    """A checkpoint that holds the whole model and optimizer state (strategy ddp at
    tensor_parallel 1) into a split model: each rank takes its share of every tensor (qkv's
    rows regrouped per rank first), and of the optimizer state of the same shape."""
    from torch.distributed.tensor import DTensor

    degree, names = degree_of(model), {id(p): n for n, p in model.named_parameters()}

    def share(name: str, like: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        if not isinstance(like, DTensor):
            return whole
        return _share(by_rank(whole, degree) if name.endswith(QKV) else whole, like)

    own = model.state_dict()
    model.load_state_dict({k: share(k, own[k], v) for k, v in model_state.items()})
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, values in optimizer_state["state"].items():
        param = params[index]
        state[index] = {
            key: share(names[id(param)], param, value)
            if isinstance(value, torch.Tensor) and value.shape == param.shape
            else value
            for key, value in values.items()
        }
    optimizer.load_state_dict({**optimizer_state, "state": state})
