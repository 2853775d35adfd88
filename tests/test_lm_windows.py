"""A language model's windows (docs/language-models.md, ddpflow.data.windows): fresh block
boundaries each epoch (train.fresh_windows) and sliding-window evaluation (eval.stride).

Real parts: token splits of Python's own source, staged as bytes; gpt trained and scored on
real gloo groups of 2 ranks and 1. Fresh windows: the offset a function of (seed, epoch)
alone, the blocks really shifted, the same per-step losses at 1 and 2 ranks, and a checkpoint
written mid-epoch at 2 ranks continued at 1 to the uninterrupted run's weights. Stride: every
position scored exactly once at any stride, the same token counts and loss at 1 and 2 ranks
(uneven shards, partial batches), stride block_size scoring what non-overlapping windows
score. The keys at their defaults leave both fingerprints as they were; bad values are
refused naming the key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from ddpflow.config import ConfigError
from ddpflow.config.fingerprint import evaluation_fingerprint, training_fingerprint
from ddpflow.config.typed import RunSpec
from ddpflow.data import windows
from ddpflow.data.staged import read_manifest
from ddpflow.data.staging import stage_dataset
from ddpflow.training import evaluate
from ddpflow.training.checkpoint import Checkpointer
from ddpflow.training.loop import Loop, fit
from ddpflow.training.models import build_model
from ddpflow.training.rankdata import load_data
from ddpflow.training.schedule import window_offset
from distributed_helpers import run_group
from workflow_helpers import make_run

CPU = torch.device("cpu")
JSON = Path(json.__file__).parent
GPT = {"name": "gpt", "kwargs": {"n_layer": 2, "n_head": 2, "n_embd": 32}}
BLOCK = 16
TRAIN = {
    "epochs": 2,
    "global_batch_size": 16,
    "micro_batch_size": 4,
    "progress": False,
    "fresh_windows": True,
    "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.1},
}
CHECKPOINT_STEP = 17  # mid-epoch 2 (15 steps per epoch)
STRIDES = (None, BLOCK, 5, 1)  # None: non-overlapping (eval.stride's default)
# fp32 summation order is all that differs between world sizes (tests/test_language_model.py
# measures it): per-step losses within 1.2e-7 relative, weights within ~5e-6
LOSS_RTOL, WEIGHT_ATOL = 2e-6, 5e-5


def _run(corpus, world: int = 1, **eval_) -> dict:
    return make_run(
        task="language_model",
        data={"source": "text", "path": str(corpus), "block_size": BLOCK},
        model=GPT,
        train=TRAIN,
        eval=eval_,
        machine={"cpu_ranks_per_node": world},
    )


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    root = tmp_path_factory.mktemp("windows")
    corpus = root / "corpus"
    corpus.mkdir()
    shutil.copy(JSON / "tool.py", corpus / "a.py")
    shutil.copy(JSON / "scanner.py", corpus / "b.py")
    stage_dataset(_run(corpus)["data"], root / "staged", seed=0)
    return {"root": root, "corpus": corpus, "staged": str(root / "staged")}


def test_the_offset_is_a_function_of_seed_and_epoch_alone():
    draws = [window_offset(0, epoch, BLOCK) for epoch in range(200)]
    assert draws == [window_offset(0, epoch, BLOCK) for epoch in range(200)]  # no hidden state
    assert all(0 <= d < BLOCK for d in draws) and len(set(draws)) == BLOCK  # all reached
    assert draws != [window_offset(1, epoch, BLOCK) for epoch in range(200)]  # the seed counts


def test_fresh_blocks_shift_by_the_offset_and_keep_their_count():
    tokens = np.arange(1000, dtype=np.uint16)
    fixed = windows.TokenBlocks(tokens, BLOCK, scored=False, device=CPU)
    fresh = windows.TokenBlocks(tokens, BLOCK, scored=False, device=CPU, fresh=True)
    assert len(fixed) == 999 // BLOCK == 62 and len(fresh) == (1000 - BLOCK) // BLOCK == 61
    every = np.arange(len(fresh))
    for offset in range(BLOCK):  # every offset leaves every block whole
        got = fresh.gather(every, offset)
        assert np.array_equal(got, offset + every[:, None] * BLOCK + np.arange(BLOCK + 1))
    feed = windows.TokenFeed(fresh, lambda epoch: window_offset(7, epoch, BLOCK))
    batches = torch.tensor([[3, 0], [60, 1]])  # two micro-batches of two block indices
    for epoch in (0, 1, 2):
        offset = window_offset(7, epoch, BLOCK)
        got = [x[:, 0].tolist() for x in feed.epoch(batches, 0, epoch)]
        assert got == [[3 * BLOCK + offset, offset], [60 * BLOCK + offset, BLOCK + offset]]
    assert len({window_offset(7, epoch, BLOCK) for epoch in (0, 1, 2)}) > 1
    with pytest.raises(AssertionError):  # offsets over blocks that leave no room
        windows.TokenFeed(fixed, lambda epoch: 1)


@pytest.mark.parametrize("n,stride", [(200, 16), (200, 5), (200, 1), (17, 3), (40, 15), (33, 8)])
def test_every_position_is_scored_once_at_any_stride(n, stride):
    tokens = np.arange(n, dtype=np.uint16)
    split = windows.TokenBlocks(tokens, BLOCK, scored=True, device=CPU).windows(stride)
    assert len(split) == windows.scored_windows(n, BLOCK, stride)
    _, targets = windows.split_tokens(split.rows(0, len(split)), split.context())
    scored = targets[targets != windows.PAD]  # a token's id is its position
    assert sorted(scored.tolist()) == list(range(1, n))
    assert targets[0].ne(windows.PAD).sum() == min(BLOCK, n - 1)  # the first scores all
    for row in targets[1:]:  # the others their last `stride`, with B - stride of context
        kept = row.ne(windows.PAD).nonzero().flatten()
        assert kept.min() >= BLOCK - stride and len(kept) <= stride
    if stride == BLOCK:  # non-overlapping: the staged windows exactly
        plain = windows.TokenBlocks(tokens, BLOCK, scored=True, device=CPU)
        assert torch.equal(split.rows(0, len(split)), plain.rows(0, len(plain)))
        assert len(plain) == windows.scored_blocks(n, BLOCK)


def _loop(env, staged: str, corpus) -> Loop:
    spec = RunSpec.from_run(_run(corpus, env.world_size))
    data = load_data(spec, staged, env, CPU, splits=("train", "val"))
    torch.manual_seed(spec.train.seed)  # as TrainTask.work
    return Loop(spec, data, env, CPU, build_model(GPT, data.shape, data.num_classes))


def _fit(loop: Loop, save_at=None) -> list[float]:
    losses: list[float] = []

    def on_step(lp):  # the whole step's mean loss over every rank's micro-batches
        losses.append(float(lp.global_step_losses()[lp.epoch_step - 1]) / lp.micro_per_step)
        if save_at is not None and lp.scheduler.last_epoch == CHECKPOINT_STEP:
            save_at.save(lp, "t")

    loop.watch_steps(on_step)
    fit(loop, lambda record: None)
    return losses


def _weights(loop: Loop) -> dict:
    return {k: v.detach().clone() for k, v in loop.full_model_state().items()}


def _strided_scores(loop: Loop, weights: str) -> dict:
    """The same weights (the 2-rank run's) scored on val at each stride, batches of 7."""
    loop.model.load_state_dict(torch.load(weights))
    data = loop.data
    return {
        stride: evaluate.evaluate_split(
            loop.model, data.val, data.scoring(7, stride=stride), loop.env
        )
        for stride in STRIDES
    }


def _at_world(env, staged: str, corpus, work: str) -> dict:
    loop = _loop(env, staged, corpus)
    if env.world_size == 2:  # trains through, writing the checkpoint 1 rank continues
        ckpt = Checkpointer(loop.run, f"{work}/w2", env)
        out = {"losses": _fit(loop, ckpt), "weights": _weights(loop)}
        if env.is_master:
            torch.save(_weights(loop), f"{work}/w2.pt")
        torch.distributed.barrier()
    else:
        out = {"losses": _fit(loop)}
        resumed = _loop(env, staged, corpus)
        state = Checkpointer(resumed.run, f"{work}/w2", env).restore(resumed)
        out["resumed_from"] = (state["world_size"], resumed.epoch, resumed.epoch_step)
        fit(resumed, lambda record: None)
        out["resumed"] = _weights(resumed)
    out["scores"] = _strided_scores(loop, f"{work}/w2.pt")
    return out


@pytest.fixture(scope="module")
def worlds(staged, tmp_path_factory):
    work = str(tmp_path_factory.mktemp("work"))
    args = (staged["staged"], staged["corpus"], work)
    return {
        world: run_group(world, _at_world, args, tmp_path_factory.mktemp("rdzv"))[0]
        for world in (2, 1)  # 1 rank continues 2's checkpoint
    }


@pytest.mark.slow
def test_fresh_windows_train_the_same_at_1_and_2_ranks_and_resume_at_another(worlds):
    one, two = worlds[1]["losses"], worlds[2]["losses"]
    assert len(one) == 30 and one[-1] < one[0] * 0.8  # 2 epochs of 15 steps; it learns
    np.testing.assert_allclose(two, one, rtol=LOSS_RTOL)
    assert worlds[1]["resumed_from"] == (2, 1, 2)  # epoch 2, after its second step
    for key, value in worlds[1]["resumed"].items():
        torch.testing.assert_close(value, worlds[2]["weights"][key], atol=WEIGHT_ATOL, rtol=1e-4)


@pytest.mark.slow
def test_strided_evaluation_counts_every_token_once_at_1_and_2_ranks(worlds, staged):
    n = read_manifest(staged["staged"])["tokens"]["val"]
    one, two = worlds[1]["scores"], worlds[2]["scores"]
    for stride in STRIDES:
        windows_ = windows.scored_windows(n, BLOCK, stride or BLOCK)
        for got in (one[stride], two[stride]):
            assert got["tokens"] == n - 1 and got["samples_evaluated"] == windows_, stride
        assert two[stride]["loss"] == pytest.approx(one[stride]["loss"], rel=1e-6)
    assert one[BLOCK]["loss"] == one[None]["loss"]  # stride block_size: non-overlapping
    # other windows scored: each token with at least block_size - stride tokens of context
    # (what that is worth on a trained model: bench/lm_windows.py)
    assert len({one[stride]["loss"] for stride in (None, 5, 1)}) == 3


def test_the_keys_at_their_defaults_leave_the_fingerprints_as_they_were(staged):
    run = _run(staged["corpus"])
    before = json.loads(json.dumps(run))  # a run resolved before the keys existed
    del before["eval"]["stride"], before["train"]["fresh_windows"]
    fixed = {**run, "train": {**run["train"], "fresh_windows": False}}
    assert training_fingerprint(fixed) == training_fingerprint(before)
    assert training_fingerprint(run)["train.fresh_windows"] is True  # it retrains
    for stride in (None, BLOCK):  # null and block_size score the same windows
        evaluated = {**run, "eval": {**run["eval"], "stride": stride}}
        assert evaluation_fingerprint(evaluated) == evaluation_fingerprint(before)
    strided = _run(staged["corpus"], stride=4)
    assert evaluation_fingerprint(strided)["eval.stride"] == 4  # it scores again
    assert training_fingerprint(strided) == training_fingerprint(run)  # it does not retrain


def test_bad_strides_and_keys_on_image_data_are_refused_naming_the_key(staged):
    corpus = staged["corpus"]
    for stride, message in (
        (17, r"eval.stride 17 is outside \[1, data.block_size 16\].*at most 16"),
        (0, r"eval.stride"),
    ):
        with pytest.raises(ConfigError, match=message):
            _run(corpus, stride=stride)
    with pytest.raises(ConfigError, match="eval.stride 8 slides a language model's"):
        make_run(eval={"stride": 8})
    with pytest.raises(ConfigError, match="train.fresh_windows moves a language model's"):
        make_run(train={"fresh_windows": True})
