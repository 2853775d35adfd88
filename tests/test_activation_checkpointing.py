"""train.activation_checkpointing: blocks recompute their forward in the backward.

It must change memory, not results: the same weights and BatchNorm statistics, bitwise, as
training without it (one process, and 2 real gloo ranks under ddp and fsdp), while the
tensors autograd keeps from the forward shrink.
"""

from __future__ import annotations

import pytest
import torch
from ddpflow import config as ddpconfig
from ddpflow.cluster.distenv import DistEnv
from ddpflow.config.typed import RunSpec
from ddpflow.training import sharding
from ddpflow.training.loop import Loop, fit
from ddpflow.training.models import build_model
from distributed_helpers import make_data, run_group
from workflow_helpers import make_run

# slow: real process groups or subprocesses for seconds each; make test-fast leaves it out
pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
SINGLE = DistEnv(0, 1, 0, 1, 0, 1, "127.0.0.1", 29500, "0", "single")
# torchvision's ResNet-18 (8 BasicBlocks) with the small-image stem: BatchNorm in every block
RESNET = {"name": "resnet18"}


def _trained(env, model_cfg: dict, strategy: str, checkpointing: bool) -> dict:
    run = make_run(
        model=model_cfg,
        train={"epochs": 1, "global_batch_size": 8 * env.world_size, "micro_batch_size": 8,
               "progress": False, "strategy": strategy,
               "activation_checkpointing": checkpointing},
        machine={"cpu_ranks_per_node": env.world_size},
    )  # fmt: skip
    data = make_data(48, 8)
    torch.manual_seed(0)
    loop = Loop(RunSpec.from_run(run), data, env, CPU, build_model(run["model"], data.shape, 4))
    fit(loop, lambda record: None)
    return {k: v.clone() for k, v in loop.full_model_state().items()}


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


def test_one_process_trains_the_same_weights_and_statistics():
    plain = _trained(SINGLE, RESNET, "ddp", False)
    _assert_equal(plain, _trained(SINGLE, RESNET, "ddp", True))
    assert int(plain["bn1.num_batches_tracked"]) == 6  # counted once per step, not twice


def _both(env) -> dict:
    cnn = {"name": "cnn", "cnn_channels": 8}
    return {
        strategy: (_trained(env, cnn, strategy, False), _trained(env, cnn, strategy, True))
        for strategy in ("ddp", "fsdp")
    }


def test_two_ranks_train_the_same_weights_under_ddp_and_fsdp(tmp_path):
    results = run_group(2, _both, (), tmp_path)
    for strategy in ("ddp", "fsdp"):
        plain, checkpointed = results[0][strategy]
        _assert_equal(plain, checkpointed)


def _saved_bytes(model: torch.nn.Module) -> int:
    """Bytes of the tensors autograd keeps between one forward and its backward."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(torch.randn(16, 3, 32, 32)).sum()
    loss.backward()
    return total


def test_the_forward_keeps_less_for_the_backward():
    torch.manual_seed(0)
    plain = _saved_bytes(build_model(RESNET, [3, 32, 32], 10))
    model = build_model(RESNET, [3, 32, 32], 10)
    assert sharding.checkpoint_activations(model) == 8
    checkpointed = _saved_bytes(model)
    assert checkpointed < 0.5 * plain, (checkpointed, plain)


def test_it_is_refused_with_compile():
    with pytest.raises(ddpconfig.ConfigError, match="activation_checkpointing with train.compile"):
        ddpconfig.load(None, {"train": {"activation_checkpointing": True, "compile": True}})
