"""train.tensor_parallel, checked before anything is submitted (no torch): the settings it
does not combine with, each refused naming the keys and the fix; and what a rank holds of
the split model, for ddpflow.checks.memory.

    check_tensor_parallel("runs ('lm')", run)   # raises ConfigError
    check_tensor_group("runs ('lm')", train, machine)
    rank_figures(run, figures)                    # the figures of one rank's tensor share

The split (ddpflow.training.tensor_parallel): in each GPT block, attn.qkv and mlp.0 are
split column-wise (weights and biases), attn.proj and mlp.2 row-wise (weights; their biases
stay whole).
"""

from __future__ import annotations

import math

from ddpflow.checks.model_kwargs import GPT_DEFAULTS
from ddpflow.config.machine import ranks_per_node, tensor_parallel_degree
from ddpflow.config.schema import ConfigError

# the strategies that act across the tensor groups (zero and hsdp: not yet)
WITH_TENSOR_PARALLEL = ("ddp", "fsdp")
# bytes of a parameter element: the ranks hold fp32 parameters (autocast casts in compute)
PARAMETER_BYTES = 4


def check_tensor_parallel(where: str, run: dict) -> None:
    """Refuse, naming the keys and the fix, what train.tensor_parallel > 1 does not combine
    with: a model other than gpt, a degree that does not divide its heads or a node's
    ranks, strategies zero and hsdp, fp16 on GPUs, train.compile."""
    train, tensor = run["train"], tensor_parallel_degree(run["train"])
    if tensor == 1:
        return
    key = f"train.tensor_parallel {tensor}"
    if run["model"]["name"] != "gpt":
        raise ConfigError(
            f"{where}: {key} splits model gpt's attention and MLP projections, but model.name "
            f"is {run['model']['name']!r}; set train.tensor_parallel: 1, or model.name: gpt"
        )
    _check_heads(where, tensor, run["model"]["kwargs"])
    check_tensor_group(where, train, run["machine"])
    if train["strategy"] not in WITH_TENSOR_PARALLEL:
        raise ConfigError(
            f"{where}: train.strategy {train['strategy']} with {key} is not supported yet "
            f"(supported: {', '.join(WITH_TENSOR_PARALLEL)}); set train.strategy: ddp or fsdp, "
            "or train.tensor_parallel: 1"
        )
    if run["machine"]["gpus_per_node"] and train["precision"] == "fp16":
        raise ConfigError(
            f"{where}: train.precision fp16 with {key}: fp16's gradient scaler is not built "
            "for split (DTensor) gradients here; use train.precision: bf16, or "
            "train.tensor_parallel: 1"
        )
    if train["compile"]:
        raise ConfigError(
            f"{where}: train.compile: true with {key} is not supported yet; set "
            "train.compile: false, or train.tensor_parallel: 1"
        )


def _check_heads(where: str, tensor: int, kwargs: dict) -> None:
    """Each rank of a group computes n_head / tensor_parallel whole heads (an n_head that
    is not a whole number >= 1 is model_kwargs' refusal)."""
    heads = kwargs.get("n_head", GPT_DEFAULTS["n_head"])
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or heads % tensor == 0:
        return
    given = "" if "n_head" in kwargs else " (gpt's default)"
    what = f"model.kwargs.n_head {heads}{given}: each rank of a tensor group computes whole heads"
    _refuse_degree(where, tensor, heads, what, "model.kwargs.n_head")


def _refuse_degree(where: str, tensor: int, count: int, what: str, key: str) -> None:
    """The degree does not divide `count` (what: it, named, and why it must)."""
    divisors = ", ".join(str(d) for d in range(1, count + 1) if count % d == 0)
    raise ConfigError(
        f"{where}: train.tensor_parallel {tensor} does not divide {what}; set "
        f"train.tensor_parallel to a divisor of {count} ({divisors}), or {key} to a multiple "
        f"of {tensor}"
    )


def check_tensor_group(where: str, train: dict, machine: dict) -> None:
    """A tensor group's ranks are consecutive ranks of one node: the degree must divide the
    ranks of a node (machine.gpus_per_node, or machine.cpu_ranks_per_node without GPUs)."""
    tensor, per_node = tensor_parallel_degree(train), ranks_per_node(machine)
    if per_node % tensor == 0:
        return
    rank_key = "machine.gpus_per_node" if machine["gpus_per_node"] else "machine.cpu_ranks_per_node"
    what = f"the {per_node} ranks of a node ({rank_key} {per_node})"
    what += ": a tensor group's ranks are on one node"
    _refuse_degree(where, tensor, per_node, what, rank_key)


def split_parameters(kwargs: dict) -> tuple[int, int]:
    """(elements, blocks) of gpt's parameters that tensor parallelism splits: in each of
    n_layer blocks the weights of attn.qkv (3E x E), attn.proj (E x E), mlp.0 (4E x E) and
    mlp.2 (E x 4E), and with bias the column-wise layers' biases (qkv's 3E, mlp.0's 4E)."""
    given = {**GPT_DEFAULTS, **kwargs}
    embd, biases = given["n_embd"], 7 * given["n_embd"] if given["bias"] else 0
    return given["n_layer"] * (12 * embd * embd + biases), given["n_layer"]


def rank_figures(run: dict, figures: dict) -> dict:
    """The measured figures (ddpflow.training.footprint's, of the whole model) as one rank
    of a tensor group holds them: the split parameters (split_parameters), their gradients
    and the optimizer state in proportion, and the largest FSDP unit (a GPT block) 1/N each.
    Not divided: the embeddings, the layer norms, the row-wise layers' biases, and the
    activations (measured for the whole model: the attention's and the MLP's hidden ones
    are 1/N on a rank, the residual stream and the logits are not; the estimate keeps them
    whole, an overestimate). The figures as they are where train.tensor_parallel is 1."""
    tensor = tensor_parallel_degree(run["train"])
    if tensor == 1 or run["model"]["name"] != "gpt":
        return figures
    elements, blocks = split_parameters(run["model"]["kwargs"])
    saved = elements * PARAMETER_BYTES * (tensor - 1) // tensor  # what the other ranks hold
    share = saved / figures["parameters"] if figures["parameters"] else 0.0
    return {
        **figures,
        "parameters": figures["parameters"] - saved,
        "gradients": figures["gradients"] - saved,
        "optimizer": figures["optimizer"] - math.floor(figures["optimizer"] * share),
        "largest_unit": figures["largest_unit"] - saved // blocks,
    }


def tensor_parallel_warnings(where: str, run: dict) -> list[str]:
    """train.tensor_parallel on CPU ranks: legal (the tests run it), rarely what is meant."""
    tensor = tensor_parallel_degree(run["train"])
    if tensor == 1 or run["machine"]["gpus_per_node"]:
        return []
    return [
        f"{where}: train.tensor_parallel {tensor} on CPU ranks (machine.gpus_per_node 0): "
        "every block's four all-reduces per step go through gloo, so a step is several times "
        "slower than at tensor_parallel 1 (bench/tensor_parallel.py); it divides the memory "
        "of each block's projections, not the time. Keep it where the model does not fit a "
        "rank, else set train.tensor_parallel: 1"
    ]
