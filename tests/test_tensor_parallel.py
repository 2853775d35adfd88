"""train.tensor_parallel on real gloo process groups (docs/strategies.md): the gpt trained at
4 ranks as 2 data x 2 tensor ranks, under ddp and fsdp, against the same run at 1 rank.

- per-step losses within 1e-5 (relative) of tensor_parallel 1's (ddp with activation
  checkpointing too);
- a rank holds half of each block's projections (qkv, attn.proj, mlp) and all of the rest;
- model.pt's weights are gpt's own layout (qkv rows [q; k; v]): they equal 1 rank's;
- a checkpoint written at tensor_parallel 2 mid-epoch resumes at 1 (1 rank; ddp and fsdp)
  to the uninterrupted run's weights, and one written at 1 (a whole ddp state) resumes at 2;
- every token is scored once by the in-run evaluation (data-parallel shards only)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from ddpflow.config.typed import RunSpec
from ddpflow.data.staging import stage_dataset
from ddpflow.training import evaluate, tensor_parallel
from ddpflow.training.checkpoint import Checkpointer
from ddpflow.training.loop import Loop, fit
from ddpflow.training.models import build_model
from ddpflow.training.rankdata import load_data
from distributed_helpers import run_group
from test_fsdp import _keep_only
from test_language_model import _corpus
from workflow_helpers import make_run

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
GPT = {"name": "gpt", "kwargs": {"n_layer": 2, "n_head": 2, "n_embd": 32}}
BLOCK = 16
SAVE_AT = 7  # mid-epoch (15 steps per epoch)
LOSS_RTOL = 1e-5  # the tolerance: fp32 sums of the same micro-batches in another order
WEIGHT_ATOL = 5e-5
SPLIT = ("attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight")
SPLIT += ("mlp.0.weight", "mlp.0.bias", "mlp.2.weight")


BACKGROUND = {"every_steps": 1, "every_epochs": 0, "keep": 50, "async": True}


def _run(corpus, ranks: int, tensor: int, strategy: str = "ddp", **train) -> dict:
    return make_run(
        task="language_model",
        data={"source": "text", "path": str(corpus), "block_size": BLOCK},
        model=GPT,
        train={
            "epochs": 1,
            "global_batch_size": 16,
            "micro_batch_size": 4,
            "progress": False,
            "strategy": strategy,
            "tensor_parallel": tensor,
            "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.1},
            "checkpoint": {"every_steps": 1, "every_epochs": 0, "keep": 50},
            **train,
        },
        machine={"cpu_ranks_per_node": ranks},
    )


def _train(env, staged: str, corpus, work: str, tensor: int, strategy="ddp", **train) -> dict:
    """Train (or resume from work's checkpoints) as TrainTask.work does: the data view of
    the rank at tensor_parallel > 1, the model seeded alike on every rank."""
    spec = RunSpec.from_run(_run(corpus, env.world_size, tensor, strategy, **train))
    env, hosts = tensor_parallel.arrange(spec, env, CPU, ["host"] * env.world_size)
    data = load_data(spec, staged, env, CPU, splits=("train", "val", "test"))
    torch.manual_seed(spec.train.seed)
    loop = Loop(spec, data, env, CPU, build_model(spec.resolved["model"], data.shape, 257))
    ckpt = Checkpointer(spec, work, env)
    resumed = ckpt.restore(loop)
    losses: list[float] = []

    def on_step(lp: Loop) -> None:  # collective: the step's mean loss over the data ranks
        losses.append(float(lp.global_step_losses()[lp.epoch_step - 1]) / lp.micro_per_step)
        ckpt.on_step(lp)

    loop.watch_steps(on_step)
    fit(loop, lambda record: None)
    ckpt.close()  # the last background write committed, as the training job's end does
    split = [p for n, p in loop.model.named_parameters() if n.endswith(SPLIT)]
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in split)
    test = evaluate.evaluate_split(loop.model, data.split("test"), data.scoring(5), env)
    kinds = {type(p).__name__ for p in loop.model.parameters()}
    kernel = [group.get("foreach") for group in loop.optimizer.param_groups]
    return {
        "background_saves": len(ckpt.saves.waited_s),  # 0 where synchronous
        "losses": losses,
        "weights": {k: v.detach().clone() for k, v in loop.full_model_state().items()},
        "split_local": local,
        "split_total": sum(p.numel() for p in split),
        "hosts": hosts,
        "view": (env.rank, env.world_size, env.tensor_rank, env.is_master),
        "resumed_at": None if resumed is None else resumed["step"],
        "test": test,
        "kinds": kinds,
        "kernel": kernel,
        "tied": loop.model.head.weight is loop.model.wte.weight,
    }


def _at_four(env, staged: str, corpus, base: Path) -> dict:
    warned: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warned.append  # type: ignore[method-assign]
    logging.getLogger(tensor_parallel.__name__).addHandler(handler)
    # a cyclic task distribution: each tensor group's two ranks on two hosts
    spec = RunSpec.from_run(_run(corpus, env.world_size, 2))
    tensor_parallel.arrange(spec, env, CPU, ["a", "b", "a", "b"])
    return {
        # its checkpoints written in the background (train.checkpoint.async), read at 1 rank
        "ddp": _train(env, staged, corpus, str(base / "tp2"), 2, checkpoint=BACKGROUND),
        "fsdp": _train(env, staged, corpus, str(base / "tp2-fsdp"), 2, "fsdp"),
        "from_one": _train(env, staged, corpus, str(base / "one-to-tp2"), 2),
        "recomputed": _train(
            env, staged, corpus, str(base / "tp2-ac"), 2, activation_checkpointing=True
        ),
        "spread": [record.getMessage() for record in warned],
    }


def _single():
    from ddpflow.cluster.distenv import discover

    return discover({})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("tp")
    corpus = _corpus(base)
    stage_dataset(_run(corpus, 1, 1)["data"], base / "staged", seed=0)
    staged = str(base / "staged")
    one = _train(_single(), staged, corpus, str(base / "one"), 1)
    _keep_only(base / "one", [SAVE_AT], base / "one-to-tp2")  # a whole (ddp) state

    four = run_group(4, _at_four, (staged, corpus, base), base / "rdzv")
    _keep_only(base / "tp2", [SAVE_AT], base / "tp2-to-one")
    back = _train(_single(), staged, corpus, str(base / "tp2-to-one"), 1)
    _keep_only(base / "tp2-fsdp", [SAVE_AT], base / "fsdp-to-one")
    fsdp_back = _train(_single(), staged, corpus, str(base / "fsdp-to-one"), 1, "fsdp")
    return {"one": one, "four": four, "back": back, "fsdp_back": fsdp_back}


def _close_weights(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), what
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, atol=WEIGHT_ATOL, rtol=1e-4, msg=what + key)


def test_tensor_parallel_2_at_4_ranks_matches_tensor_parallel_1(runs):
    one = runs["one"]["losses"]
    assert len(one) == 15 and one[-1] < one[0]
    for strategy in ("ddp", "fsdp", "recomputed"):  # recomputed: activation checkpointing
        got = runs["four"][0][strategy]
        np.testing.assert_allclose(got["losses"], one, rtol=LOSS_RTOL, err_msg=strategy)
        # model.pt's weights: gpt's own layout, equal to 1 rank's
        _close_weights(got["weights"], runs["one"]["weights"], f"{strategy}: ")


def test_a_rank_holds_half_of_each_blocks_projections_and_sees_its_data_rank(runs):
    ranks = [rank["ddp"] for rank in runs["four"]]
    total = ranks[0]["split_total"]
    assert all(rank["split_local"] * 2 == total for rank in ranks)
    # ranks 0, 1 are data rank 0 (tensor ranks 0, 1), ranks 2, 3 data rank 1
    # every parameter a DTensor (the whole ones replicated), so AdamW steps them with its
    # multi-tensor kernel; the output layer still tied to the token embedding
    assert all(r["kinds"] == {"DTensor"} and r["kernel"] == [True] and r["tied"] for r in ranks)
    views = [(0, 2, 0, True), (0, 2, 1, False), (1, 2, 0, False), (1, 2, 1, False)]
    assert [rank["view"] for rank in ranks] == views
    assert ranks[0]["hosts"] == ["host"] * 4  # every rank's
    # a tensor group spread over two hosts is named, by rank 0 only
    spread = [rank["spread"] for rank in runs["four"]]
    assert spread[1:] == [[], [], []] and len(spread[0]) == 1, spread
    assert "2 tensor groups span nodes (ranks 0-1 on a, b)" in spread[0][0]


def test_checkpoints_resume_at_another_degree(runs):
    back = runs["back"]  # written at tensor_parallel 2 (DCP, in the background), at 1 rank
    assert back["resumed_at"] == SAVE_AT and runs["four"][0]["ddp"]["background_saves"] > 0
    _close_weights(back["weights"], runs["four"][0]["ddp"]["weights"], "2 -> 1: ")
    np.testing.assert_allclose(back["losses"], runs["one"]["losses"][SAVE_AT:], rtol=LOSS_RTOL)
    fsdp_back = runs["fsdp_back"]  # fsdp at 2 data x 2 tensor ranks, resumed at 1 rank
    assert fsdp_back["resumed_at"] == SAVE_AT
    _close_weights(fsdp_back["weights"], runs["four"][0]["fsdp"]["weights"], "fsdp 2 -> 1: ")
    from_one = runs["four"][0]["from_one"]  # a whole ddp state, resumed at 2
    assert from_one["resumed_at"] == SAVE_AT
    _close_weights(from_one["weights"], runs["one"]["weights"], "1 -> 2: ")


def test_every_token_is_scored_once_by_the_data_ranks(runs):
    reference = runs["one"]["test"]
    for rank in runs["four"]:
        got = rank["ddp"]["test"]
        assert got["tokens"] == reference["tokens"]
        assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5)


def test_a_model_without_blocks_to_split_is_refused():
    with pytest.raises(ValueError, match="train.tensor_parallel splits model gpt"):
        tensor_parallel.parallelize(torch.nn.Linear(2, 2), None)


def test_qkv_rows_regroup_per_rank_and_back():
    qkv = torch.arange(24.0).reshape(12, 2)  # q, k, v of 4 rows each
    grouped = tensor_parallel.by_rank(qkv, 2)
    # rank 0: q rows 0-1, k rows 4-5, v rows 8-9; rank 1 the others
    assert grouped[:, 0].tolist() == [0, 2, 8, 10, 16, 18, 4, 6, 12, 14, 20, 22]
    assert torch.equal(tensor_parallel.in_parts(grouped, 2), qkv)
    assert torch.equal(tensor_parallel.by_rank(qkv, 1), qkv)


def test_the_data_view_is_unchanged_without_tensor_parallelism():
    spec = RunSpec.from_run(_run(Path("/nonexistent"), 1, 1))
    env = _single()
    assert tensor_parallel.arrange(spec, env, CPU, ["h"]) == (env, ["h"])
    assert env.processes == 1 and env.global_rank == 0 and env.group is None


def test_cpu_ranks_are_warned_and_a_resume_names_the_degree_it_was_written_at():
    from ddpflow.checks.values import run_warnings
    from ddpflow.training.checkpoint import resumed_line

    warned = run_warnings(_run(Path("corpus"), 2, 2), "local")
    assert any("train.tensor_parallel 2 on CPU ranks" in line for line in warned), warned
    assert not any("tensor_parallel" in line for line in run_warnings(_run("c", 2, 1), "local"))
    state = {"epoch": 1, "step": 30, "world_size": 4, "tensor_parallel": 2}
    assert resumed_line(state, 4, 1) == (
        "resumed at epoch 2 step 30 on 4 ranks at tensor_parallel 1; the checkpoint was "
        "written on 4 at tensor_parallel 2"
    )
    del state["tensor_parallel"]  # written before the key existed: degree 1
    assert resumed_line(state, 4) == (
        "resumed at epoch 2 step 30 on 4 ranks, the world size it was written on"
    )
