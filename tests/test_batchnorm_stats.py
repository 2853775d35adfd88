"""BatchNorm running statistics are the same science at any world size
(ddpflow.training.batchnorm): each step folds in every micro-batch's statistics in the global
order, as one rank computing them all would.

On one rank the fold is checked against torch's own BatchNorm (momentum and momentum=None,
within float rounding); on real gloo groups, the Loop at 1 and 2 ranks with two micro-batches
a step (where training is bitwise equal) gives the same buffers and validation metrics, for
a classification and a regression CNN, with activation checkpointing and with frozen
(fine-tuned) BatchNorm layers, and read mid-epoch (a checkpoint's state_dict) while steps
wait for their gather. Gathered every few steps at 2 ranks, the statistics are bitwise one
rank's; an exception mid-step puts the layers' own buffers back. 2 and 4 ranks under ddp,
zero and fsdp and a 4 -> 2 resume: tests/test_world_size.py.
"""

from __future__ import annotations

import pytest
import torch
from ddpflow.cluster.distenv import DistEnv
from ddpflow.config.typed import RunSpec
from ddpflow.training import sharding
from ddpflow.training.batchnorm import ExactStatistics, only_batchnorm_buffers
from ddpflow.training.faults import InjectedFault
from ddpflow.training.loop import Loop, fit
from ddpflow.training.models import build_model, mlp
from distributed_helpers import make_data, make_task_data, run_group
from torch import nn
from workflow_helpers import make_run

CPU = torch.device("cpu")
SINGLE = DistEnv(0, 1, 0, 1, 0, 1, "127.0.0.1", 29500, "0", "single")
# 128 samples in steps of 32 and micro-batches of 16: two micro-batches a step (1 rank
# accumulates both, 2 ranks one each), 2 epochs
TRAIN = {"epochs": 2, "global_batch_size": 32, "micro_batch_size": 16, "progress": False}
CASES = {
    "classification": ("classification", {}),
    "regression": ("regression", {}),
    "checkpointed": ("classification", {"activation_checkpointing": True}),
    "frozen": ("classification", {"freeze": ["0", "1"]}),  # the first conv and its BatchNorm
}
METRIC_RTOL = 1e-6
MID_EPOCH_STEP = 3  # of 4 in the first epoch: a checkpoint's read between two steps


def _net(momentum: float | None) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 6 * 6, 8), nn.BatchNorm1d(8, momentum=momentum),
    )  # fmt: skip


def _statistics(model: nn.Module) -> dict:
    return _statistics_of(model.state_dict())


def _statistics_of(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items() if "running" in k or "tracked" in k}


@pytest.mark.parametrize("momentum", [0.1, None])
def test_one_rank_folds_the_micro_batches_as_torch_does(momentum):
    plain, exact = _net(momentum), _net(momentum)
    folder = ExactStatistics(exact, micro_per_step=4, world_size=1, device=CPU)
    batches = torch.randn(3, 4, 8, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    for step in batches:
        folder.begin_step()
        for micro, x in enumerate(step):
            # the forward itself is torch's: normalised by the micro-batch's own statistics
            assert torch.equal(exact(x), plain(x))
            folder.record(micro)
        folder.end_step()
    expected, got = _statistics(plain), _statistics(exact)
    for key, value in expected.items():
        if key.endswith("num_batches_tracked"):
            assert int(got[key]) == int(value) == 12, key
        else:  # torch's CPU kernel folds in float64, this fold in float32
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7)
    assert isinstance(exact[1].momentum, type(momentum)) and exact[1].momentum == momentum


def test_frozen_batchnorm_and_model_without_one_are_left_alone():
    model = _net(0.1)
    model[1].eval()  # a frozen layer (weights.keep_frozen_statistics)
    before = _statistics(model)
    folder = ExactStatistics(model, micro_per_step=1, world_size=1, device=CPU)
    folder.begin_step()
    model(torch.randn(8, 1, 8, 8))
    folder.record(0)
    folder.end_step()
    after = _statistics(model)
    assert all(torch.equal(after[k], before[k]) for k in before if k.startswith("1."))
    assert int(after["5.num_batches_tracked"]) == 1
    plain = ExactStatistics(mlp(64, [8], 2), micro_per_step=2, world_size=1, device=CPU)
    plain.begin_step(), plain.record(0), plain.end_step()  # nothing to do, no error


def test_ddp_needs_no_buffer_broadcast_only_for_batchnorm_buffers():
    assert only_batchnorm_buffers(_net(0.1)) and only_batchnorm_buffers(mlp(64, [8], 2))
    other = _net(0.1)
    other.register_buffer("mask", torch.ones(3))
    assert not only_batchnorm_buffers(other)


def test_activation_checkpointing_records_each_micro_batch_once():
    """The recomputed forward runs with momentum 0 in the backward: the statistics are the
    ones of the model trained without checkpointing, bitwise."""
    out = []
    for checkpointed in (False, True):
        model = _net(None)
        if checkpointed:
            sharding.checkpoint_activations(model)
        folder = ExactStatistics(model, micro_per_step=2, world_size=1, device=CPU)
        folder.begin_step()
        for micro in range(2):
            x = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(micro))
            model(x).sum().backward()
            folder.record(micro)
        folder.end_step()
        out.append(_statistics(model))
    assert all(torch.equal(out[0][k], out[1][k]) for k in out[0])
    assert int(out[1]["1.num_batches_tracked"]) == 2


def _train(env, case: str) -> dict:
    task, train = CASES[case]
    data = make_task_data(task, 128, 48) if task == "regression" else make_data(128, 48)
    run = make_run(
        task=task, data={"source": "npz", "path": "x.npz"} if task == "regression" else {},
        model={"name": "cnn", "cnn_channels": 8}, train={**TRAIN, **train},
        machine={"cpu_ranks_per_node": env.world_size},
    )  # fmt: skip
    torch.manual_seed(run["train"]["seed"])
    model = build_model(run["model"], data.shape, data.num_classes)
    loop = Loop(RunSpec.from_run(run), data, env, CPU, model)
    mid_epoch: dict = {}

    def on_step(lp: Loop) -> None:  # what a checkpoint between two steps holds
        if lp.scheduler.last_epoch == MID_EPOCH_STEP:
            mid_epoch.update(_statistics_of(lp.state_dict()["model"]))

    loop.watch_steps(on_step)
    fit(loop, lambda record: None)
    state = loop.full_model_state()
    names = {name for name, _ in loop.model.named_parameters()}
    return {
        "mid_epoch": mid_epoch,
        "buffers": {k: v.clone() for k, v in state.items() if k not in names},
        "params": {k: v.clone() for k, v in state.items() if k in names},
        "val": [{k: v for k, v in r.items() if k.startswith("val_")} for r in loop.history],
    }


def _cases(env) -> dict:
    return {case: _train(env, case) for case in CASES}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict:
    return {
        world: run_group(world, _cases, (), tmp_path_factory.mktemp("rdzv")) for world in (1, 2)
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_one_and_two_ranks_evaluate_the_same_model(worlds, case):
    one, twos = worlds[1][0][case], [by_case[case] for by_case in worlds[2]]
    for rank, two in enumerate(twos):  # every rank holds the statistics, not only rank 0
        for key, value in one["params"].items():  # training: bitwise equal
            assert torch.equal(two["params"][key], value), (case, rank, key)
        for key, value in one["buffers"].items():
            torch.testing.assert_close(two["buffers"][key], value, msg=f"{case} {key}")
        assert one["mid_epoch"].keys() == two["mid_epoch"].keys() != set()
        for key, value in one["mid_epoch"].items():
            torch.testing.assert_close(two["mid_epoch"][key], value, msg=f"{case} {key}")
    for epoch, record in enumerate(one["val"]):
        assert record and record.keys() == twos[0]["val"][epoch].keys()
        for key, value in record.items():
            assert twos[0]["val"][epoch][key] == pytest.approx(value, rel=METRIC_RTOL), key
    tracked = {k: int(v) for k, v in one["buffers"].items() if k.endswith("batches_tracked")}
    if case == "frozen":  # the frozen layer kept its initial statistics
        assert tracked.pop("1.num_batches_tracked") == 0
        assert torch.equal(one["buffers"]["1.running_var"], torch.ones(8))
    assert set(tracked.values()) == {16}  # 2 micro-batches x 4 steps x 2 epochs


def test_an_exception_mid_step_puts_the_buffers_back(monkeypatch):
    """A step that raises between its micro-batches (here the fault injection, at the second
    of two) leaves the layers' own buffers and momentum in place, not the step's scratch."""
    monkeypatch.setenv("DDPFLOW_FAULT", "raise:0:0:1")
    run = make_run(model={"name": "cnn", "cnn_channels": 8}, train=TRAIN)
    data = make_data(128, 48)
    torch.manual_seed(0)
    model = build_model(run["model"], data.shape, data.num_classes)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    own = [(m.running_mean, m.running_var, m.momentum) for m in norms]
    before = _statistics(model)
    loop = Loop(RunSpec.from_run(run), data, SINGLE, CPU, model)
    with pytest.raises(InjectedFault):
        loop.train_epoch()
    assert norms and [(m.running_mean, m.running_var, m.momentum) for m in norms] == own
    after = _statistics(model)  # no step finished: nothing folded in
    assert all(torch.equal(after[k], before[k]) for k in before)


def _gathered_every_few_steps(env, momentum: float | None, steps: int, per_gather: int) -> dict:
    """`steps` steps of 4 micro-batches, this rank's share of each (its contiguous block),
    gathered every `per_gather` steps (None: ExactStatistics' default) and settled."""
    model = _net(momentum)
    folder = ExactStatistics(model, 4, env.world_size, CPU, steps_per_gather=per_gather)
    batches = torch.randn(steps, 4, 8, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    a = 4 // env.world_size
    for step in batches:
        folder.begin_step()
        for micro in range(env.rank * a, (env.rank + 1) * a):
            model(step[micro])
            folder.record(micro)
        folder.end_step()
    folder.settle()
    folder.settle()  # idempotent: nothing pending, no collective
    return _statistics(model)


@pytest.mark.slow
@pytest.mark.parametrize("momentum", [0.1, None])
def test_a_gather_every_few_steps_folds_as_one_rank_does_every_step(tmp_path, momentum):
    """7 steps gathered in threes (3, 3, then 1 at settle) at 2 ranks: bitwise the statistics
    one rank folds step by step, on both ranks (the same micro-batches in the same order)."""
    (one,) = run_group(1, _gathered_every_few_steps, (momentum, 7, None), tmp_path)
    twos = run_group(2, _gathered_every_few_steps, (momentum, 7, 3), tmp_path)
    for two in twos:
        assert two.keys() == one.keys()
        assert all(torch.equal(two[k], one[k]) for k in one), momentum
    assert int(one["1.num_batches_tracked"]) == 28
