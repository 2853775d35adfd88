"""train.norm_batch_size on real gloo groups: BatchNorm's batch is the science, the micro-batch
the machine's (ddpflow.training.norm_groups, ddpflow.checks.norm_batch).

One rank computing micro-batches of 32 and two ranks each computing a half of every
normalisation batch of 32 (micro-batch 16, a normalisation group of 2) train the same model,
with augmentation on (its draws are the whole normalisation batch's, sliced): weights and
running statistics within float rounding, the same validation loss per epoch. So do one rank
and three ranks sharing a step's four micro-batches unevenly (2 + 1 + 1). Two ranks that
normalise each micro-batch of 16 on its own (norm_batch_size 16) train another model, by
orders of magnitude more than the rounding: the check can fail.
"""

from __future__ import annotations

import pytest
import torch
from ddpflow.config.typed import RunSpec
from ddpflow.training.loop import Loop, fit
from ddpflow.training.models import build_model
from ddpflow.training.schedule import grouped, norm_batch_part
from distributed_helpers import make_data, run_group
from workflow_helpers import make_run

ROUNDING = 1e-6  # seen: up to 1.2e-7 on the weights and running statistics


def _train(env, micro: int, norm: int) -> dict:
    data = make_data(128, 48)
    run = make_run(
        model={"name": "cnn", "cnn_channels": 8},
        train={"epochs": 2, "global_batch_size": 64, "micro_batch_size": micro,
               "norm_batch_size": norm, "progress": False, "augment": {"enabled": True}},
        machine={"cpu_ranks_per_node": env.world_size},
    )  # fmt: skip
    torch.manual_seed(run["train"]["seed"])
    model = build_model(run["model"], data.shape, data.num_classes)
    loop = Loop(RunSpec.from_run(run), data, env, torch.device("cpu"), model)
    fit(loop, lambda record: None)
    state = {k: v.clone() for k, v in loop.full_model_state().items()}
    history = [r["val_loss"] for r in loop.history]
    return {"state": state, "val": history, "group": loop.norm_group, "accum": loop.accum}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    def group(world, micro, norm):
        return run_group(world, _train, (micro, norm), tmp_path_factory.mktemp("rdzv"))

    return {
        "one": group(1, 32, 32)[0],
        "pairs": group(2, 16, 32),
        "halves": group(2, 16, 16)[0],
        "one_of_16": group(1, 16, 16)[0],
        "three": group(3, 16, 16),  # 4 micro-batches a step: 2 + 1 + 1
    }


def _largest_difference(a: dict, b: dict) -> float:
    return max(
        float((a[k] - b[k]).abs().max()) for k in a if a[k].dtype.is_floating_point
    )  # fmt: skip


@pytest.mark.slow
def test_two_ranks_holding_halves_train_what_one_rank_trains(trained):
    one, pairs = trained["one"], trained["pairs"]
    assert (one["group"], pairs[0]["group"]) == (1, 2)
    for rank in pairs:  # every rank holds the same model
        assert _largest_difference(rank["state"], one["state"]) < ROUNDING
        assert rank["val"] == pytest.approx(one["val"], rel=1e-6)
    tracked = {k: int(v) for k, v in pairs[0]["state"].items() if "batches_tracked" in k}
    assert set(tracked.values()) == {8}  # 2 normalisation batches x 2 steps x 2 epochs


@pytest.mark.slow
def test_normalising_each_half_alone_is_another_science(trained):
    assert trained["halves"]["group"] == 1
    assert _largest_difference(trained["halves"]["state"], trained["one"]["state"]) > 1e3 * ROUNDING


@pytest.mark.slow
def test_three_ranks_sharing_four_micro_batches_unevenly_train_what_one_rank_trains(trained):
    """The first rank takes two micro-batches a step, the others one; each micro-batch weighs
    the same in the step's gradient, so the model is one rank's within float rounding."""
    one, three = trained["one_of_16"], trained["three"]
    assert [rank["accum"] for rank in three] == [2, 1, 1]
    for rank in three:
        assert _largest_difference(rank["state"], one["state"]) < ROUNDING
        assert rank["val"] == pytest.approx(one["val"], rel=1e-6)


def test_a_group_computes_the_parts_of_one_normalisation_batch_at_once():
    """4 ranks in pairs, 2 accumulation steps: rank r's i-th micro-batch is part r % 2 of
    normalisation batch (r // 2) * 2 + i, so a pair's ranks normalise together step by step."""
    assert [norm_batch_part(j, 2, 2) for j in range(8)] == [
        (0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1),
    ]  # fmt: skip
    batches = torch.arange(16).view(1, 8, 2)  # one step of 8 micro-batches of 2
    assert grouped(batches, 2, 2)[0, :, 0].tolist() == [0, 4, 2, 6, 8, 12, 10, 14]
    assert torch.equal(grouped(batches, 4, 1), batches)
