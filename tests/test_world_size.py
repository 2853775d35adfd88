"""The world size is a machine setting: the same training at 1, 2 and 4 real gloo ranks, and a
checkpoint written at 4 ranks continued at 2 and at 1, under ddp, zero and fsdp.

Every step computes the same micro-batches with the same random draws (augmentation,
dropout) at any world size, and the gradient is their mean; what may differ is the order in
which floats are summed (DDP's all-reduce, the accumulation of micro-batch gradients), so
losses and weights agree to within fp32 rounding grown over the run (TOLERANCE, measured
here). BatchNorm's running statistics are every micro-batch's of each step, folded in in
the global order on every rank (ddpflow.training.batchnorm): they and the validation
metrics agree to the training's own rounding. tests/test_batchnorm_stats.py checks 1 against
2 ranks where training is bitwise equal.
"""

from __future__ import annotations

import pytest
import torch
from ddpflow.config.typed import RunSpec
from ddpflow.training import evaluate
from ddpflow.training.checkpoint import Checkpointer
from ddpflow.training.loop import Loop, fit
from ddpflow.training.models import build_model, mlp, place
from distributed_helpers import make_data, make_task_data, run_group
from torch import nn
from workflow_helpers import make_run

# slow: real process groups or subprocesses for seconds each; make test-fast leaves it out
pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
# 128 samples, a global batch of 32 in micro-batches of 8: 4 steps per epoch, 4 micro-batches
# per step (world 1: 4 accumulation steps per rank, 2: 2, 4: 1), 3 epochs
TRAIN = {"epochs": 3, "global_batch_size": 32, "micro_batch_size": 8, "progress": False}
# measured on the 2-core Xeon CI machine (torch 2.14.1, fp32): per-step losses at 2 and 4
# ranks within 1.7e-7 (relative) of 1 rank's, final weights within 3e-8 (absolute) after 12
# steps; resumed 4 -> 2 and 4 -> 1 within 6e-8 of the uninterrupted 4-rank run. The bounds
# leave about 10x room for another CPU's summation kernels.
LOSS_RTOL, WEIGHT_ATOL, WEIGHT_RTOL = 2e-6, 1e-6, 1e-5
CASES = {
    # BatchNorm, and random crop + flip drawn per micro-batch
    "cnn_augment": ({"name": "cnn", "cnn_channels": 8},
                    {"augment": {"enabled": True, "crop_padding": 1}}),
    # dropout: drawn from the torch RNG, which every micro-batch seeds from its own index
    "mlp_dropout": ({"name": "mlp", "mlp_hidden": [32]}, {}),
}  # fmt: skip
STRATEGIES = ("ddp", "zero", "fsdp")
# the other tasks on the same groups (ddpflow.task): an MLP on make_task_data's targets
TASKS = ("multilabel", "regression")
CHECKPOINT_STEP = 5  # epoch 2, after its first step: mid-epoch


def _run(env, model: dict, train: dict) -> dict:
    return make_run(
        model=model, train={**TRAIN, **train}, machine={"cpu_ranks_per_node": env.world_size}
    )


def _model(run: dict, data: dict) -> nn.Module:
    torch.manual_seed(run["train"]["seed"])  # as TrainTask.work
    if run["model"]["name"] == "mlp":  # the built-in MLP with a dropout layer
        net = mlp(64, run["model"]["mlp_hidden"], data.num_classes)
        return nn.Sequential(*list(net)[:3], nn.Dropout(0.3), *list(net)[3:])
    model = build_model(run["model"], data.shape, data.num_classes)
    return place(model, CPU, run["train"]["channels_last"] and run["train"]["strategy"] != "fsdp")


def _task_run(env, task: str) -> dict:
    return make_run(
        task=task, data={"source": "npz", "path": "targets.npz"}, train=TRAIN,
        model={"name": "mlp", "mlp_hidden": [32]},
        machine={"cpu_ranks_per_node": env.world_size},
    )  # fmt: skip


def _train_case(env, case: str) -> dict:
    if case in TASKS:
        run, data = _task_run(env, case), make_task_data(case, 128, 32)
    else:
        model_cfg, train = CASES[case]
        run, data = _run(env, model_cfg, train), make_data(128, 32)
    loop = Loop(RunSpec.from_run(run), data, env, CPU, _model(run, data))
    losses = []

    def on_step(lp):  # the whole step's mean loss, over every rank's micro-batches
        losses.append(float(lp.global_step_losses()[lp.epoch_step - 1]) / lp.micro_per_step)

    loop.watch_steps(on_step)
    fit(loop, lambda record: None)
    history = [r["train_loss"] for r in loop.history]
    return {"losses": losses, **_weights(loop), "history": history, "val": _val(loop)}


def _weights(loop: Loop) -> dict:
    """The whole model's parameters and buffers (collective under fsdp; rank 0 has them)."""
    state = loop.full_model_state()
    params = {name for name, _ in loop.model.named_parameters()}
    return {
        "params": {k: v.detach().clone() for k, v in state.items() if k in params},
        "buffers": {k: v.detach().clone().float() for k, v in state.items() if k not in params},
    }


def _strategy_run(env, strategy: str) -> dict:
    return _run(env, {"name": "cnn", "cnn_channels": 8}, {"strategy": strategy})


def _with_checkpoint(env, work_root: str) -> dict:
    """Each strategy trained uninterrupted, writing (with the real Checkpointer) a mid-epoch
    checkpoint on the way into work_root/<strategy>."""
    out = {}
    for strategy in STRATEGIES:
        run, data = _strategy_run(env, strategy), make_data(128, 32)
        loop = Loop(RunSpec.from_run(run), data, env, CPU, _model(run, data))
        ckpt = Checkpointer(RunSpec.from_run(run), f"{work_root}/{strategy}", env)

        def on_step(lp, ckpt=ckpt):
            if lp.scheduler.last_epoch == CHECKPOINT_STEP:
                ckpt.save(lp, "test")

        loop.watch_steps(on_step)
        fit(loop, lambda record: None)
        out[strategy] = {**_weights(loop), "val": _val(loop)}
    return out


def _val(loop: Loop) -> dict:
    """The last epoch's validation metrics (of the model rank 0 saves)."""
    return {k: v for k, v in loop.history[-1].items() if k.startswith("val_")}


def _resumed(env, work_root: str) -> dict:
    """At another world size: the same Checkpointer restores each strategy's checkpoint."""
    out = {}
    for strategy in STRATEGIES:
        run, data = _strategy_run(env, strategy), make_data(128, 32)
        loop = Loop(RunSpec.from_run(run), data, env, CPU, _model(run, data))
        state = Checkpointer(RunSpec.from_run(run), f"{work_root}/{strategy}", env).restore(loop)
        position = (state["world_size"], loop.epoch, loop.epoch_step, loop.scheduler.last_epoch)
        fit(loop, lambda record: None)
        out[strategy] = {**_weights(loop), "position": position, "val": _val(loop)}
    return out


def _task_scores(env) -> dict:
    """Each task's metric state of one fixed model over the val split, summed over the ranks:
    the same totals at any world size (counts exactly, float64 sums to rounding)."""
    out = {}
    for task in TASKS:
        run, data = _task_run(env, task), make_task_data(task, 128, 61)  # 61: uneven shards
        model = _model(run, data)
        scoring = data.scoring(batch_size=5)
        out[task] = evaluate.evaluate_split(model, data.val, scoring, env)
    return out


def _task_checkpoints(env, work_root: str, resume: bool) -> dict:
    """Each task trained with a mid-epoch checkpoint (resume=False), or continued from it."""
    out = {}
    for task in TASKS:
        run, data = _task_run(env, task), make_task_data(task, 128, 32)
        loop = Loop(RunSpec.from_run(run), data, env, CPU, _model(run, data))
        ckpt = Checkpointer(RunSpec.from_run(run), f"{work_root}/{task}", env)
        if resume:
            state = ckpt.restore(loop)
            out[f"{task} position"] = (state["world_size"], loop.epoch, loop.epoch_step)
        else:
            loop.watch_steps(
                lambda lp, ckpt=ckpt: (
                    ckpt.save(lp, "test") if lp.scheduler.last_epoch == CHECKPOINT_STEP else None
                )
            )
        fit(loop, lambda record: None)
        out[task] = {**_weights(loop), "history": loop.history[-1]}
    return out


def _at_world_size(env, work_root: str) -> dict:
    cases = {case: _train_case(env, case) for case in (*CASES, *TASKS)}
    scores = _task_scores(env)
    if env.world_size == 4:
        tasks = _task_checkpoints(env, f"{work_root}/tasks", resume=False)
        strategies = _with_checkpoint(env, f"{work_root}/at4")
        return {"cases": cases, "strategies": strategies, "scores": scores, "tasks": tasks}
    tasks = _task_checkpoints(env, f"{work_root}/tasks", resume=env.world_size == 2)
    strategies = _resumed(env, f"{work_root}/at4")
    out = {"cases": cases, "strategies": strategies, "scores": scores, "tasks": tasks}
    if env.world_size == 1:  # and the other way: checkpoints written on one rank
        out["uninterrupted"] = _with_checkpoint(env, f"{work_root}/at1")
    return out


def _from_one_rank(env, work_root: str) -> dict:
    return _resumed(env, f"{work_root}/at1")


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """One group per world size, 4 first: it writes the checkpoints 2 and 1 continue; the
    1-rank group writes checkpoints too, which a last 2-rank group continues."""
    work_root = str(tmp_path_factory.mktemp("work"))
    out = {
        world: run_group(world, _at_world_size, (work_root,), tmp_path_factory.mktemp("rdzv"))[0]
        for world in (4, 2, 1)
    }
    rdzv = tmp_path_factory.mktemp("rdzv")
    out["1 -> 2"] = run_group(2, _from_one_rank, (work_root,), rdzv)[0]
    return out


def _assert_close_weights(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL,
                                   msg=lambda m, k=key: f"{what}: {k}: {m}")  # fmt: skip


@pytest.mark.parametrize("case", [*CASES, *TASKS])
def test_per_step_losses_agree_at_one_two_and_four_ranks(worlds, case):
    reference = worlds[1]["cases"][case]
    assert len(reference["losses"]) == 12  # 4 steps x 3 epochs, the same at every size
    for world in (2, 4):
        got = worlds[world]["cases"][case]
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(reference["losses"]),
            rtol=LOSS_RTOL, atol=0.0,
        )  # fmt: skip
        torch.testing.assert_close(
            torch.tensor(got["history"]), torch.tensor(reference["history"]), rtol=LOSS_RTOL,
            atol=0.0,
        )  # fmt: skip
        _assert_close_weights(got["params"], reference["params"], f"{case} at {world} ranks")


def test_the_losses_are_not_trivially_equal(worlds):
    """Guards the test above: the cases learn, and the two cases train differently."""
    losses = worlds[1]["cases"]["cnn_augment"]["losses"]
    assert losses[-1] < 0.9 * losses[0], losses
    assert losses != worlds[1]["cases"]["mlp_dropout"]["losses"]


def test_batchnorm_running_statistics_are_every_micro_batchs(worlds):
    """Every rank's running statistics fold in every micro-batch of each step in the global
    order (not rank 0's half or quarter of them): at 1, 2 and 4 ranks they, and the
    validation metrics of the model rank 0 saves, agree to the training's own rounding
    (measured: buffers within 1.2e-7, val_loss within 1e-7 relative)."""
    cases = {w: worlds[w]["cases"]["cnn_augment"] for w in (1, 2, 4)}
    four = cases[4]
    assert [k for k in four["buffers"] if k.endswith("running_mean")]
    for world in (1, 2):
        for key, value in four["buffers"].items():
            torch.testing.assert_close(cases[world]["buffers"][key], value, msg=key)
        for key, value in four["val"].items():
            assert cases[world]["val"][key] == pytest.approx(value, rel=1e-6), (world, key)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", [2, 1])
def test_a_checkpoint_written_at_four_ranks_continues_at_another_size(worlds, strategy, world):
    resumed = worlds[world]["strategies"][strategy]
    written_on, epoch, epoch_step, step = resumed["position"]
    assert (written_on, epoch, epoch_step, step) == (4, 1, 1, CHECKPOINT_STEP)
    expected = worlds[4]["strategies"][strategy]
    _assert_close_weights(resumed["params"], expected["params"], f"{strategy} 4 -> {world}")
    # the evaluated model: its BatchNorm statistics are every rank's, whatever the size
    _assert_close_weights(resumed["buffers"], expected["buffers"], f"{strategy} 4 -> {world}")
    for key, value in expected["val"].items():
        assert resumed["val"][key] == pytest.approx(value, rel=1e-6), (strategy, key)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_checkpoint_written_on_one_rank_continues_on_two(worlds, strategy):
    """fsdp trains unsharded on one rank, with the fused optimizer kernel that FSDP's
    DTensors refuse: its checkpoint (DCP, like every fsdp checkpoint) must still continue
    sharded at 2 ranks, under the 2-rank run's own kernels."""
    resumed = worlds["1 -> 2"][strategy]
    assert resumed["position"] == (1, 1, 1, CHECKPOINT_STEP)
    expected = worlds[1]["uninterrupted"][strategy]
    _assert_close_weights(resumed["params"], expected["params"], f"{strategy} 1 -> 2")


@pytest.mark.parametrize("task", TASKS)
def test_a_tasks_metric_sums_are_the_same_at_one_two_and_four_ranks(worlds, task):
    """Every sample of the val split (61: shards of 16, 15, 15, 15 at 4 ranks) scored once;
    the integer counts equal, the float64 sums equal to rounding, at 1, 2 and 4 ranks. (A
    sample's float32 output may differ in its last bit with the batch it is computed in,
    which the shards cut differently: float32 rounding, measured up to 1e-9 relative in the
    metrics, hence 1e-7; the sums themselves are float64.)"""
    one = worlds[1]["scores"][task]
    assert one["samples_evaluated"] == 61
    counts = ("true_positives", "false_positives", "false_negatives", "exact_matches")
    sums = ("f1_micro", "f1_macro", "exact_match") if task == "multilabel" else ("mse", "mae", "r2")
    for world in (2, 4):
        got = worlds[world]["scores"][task]
        assert got["samples_evaluated"] == 61
        if task == "multilabel":
            assert {k: got[k] for k in counts} == {k: one[k] for k in counts}
        else:
            assert got["predicted_vs_true"]["counts"] == one["predicted_vs_true"]["counts"]
        for key in (*sums, "loss"):
            assert got[key] == pytest.approx(one[key], rel=1e-7), (task, world, key)
    if task == "multilabel":  # the model is untrained: neither all right nor all wrong
        assert sum(one["true_positives"]) > 0 and sum(one["false_positives"]) > 0
    else:
        assert one["r2"] is not None and one["mse"] > 0


@pytest.mark.parametrize("task", TASKS)
def test_a_tasks_checkpoint_written_at_four_ranks_continues_at_two(worlds, task):
    assert worlds[2]["tasks"][f"{task} position"] == (4, 1, 1)
    expected, resumed = worlds[4]["tasks"][task], worlds[2]["tasks"][task]
    _assert_close_weights(resumed["params"], expected["params"], f"{task} 4 -> 2")
    for key, value in expected["history"].items():
        if key.startswith("val_"):
            assert resumed["history"][key] == pytest.approx(value, rel=1e-5), key
