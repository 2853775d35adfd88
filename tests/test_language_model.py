"""task: language_model (docs/language-models.md): token data staged and verified (text from
Python's own json package, nanoGPT-style token files written here), the gpt model on real
gloo groups of 1, 2 and 4 ranks (the same per-step losses; every scored position counted
exactly once at any world size; a checkpoint written mid-epoch at 4 ranks continued at 2
to the uninterrupted run's weights; zero, fsdp, bf16 and activation checkpointing), and the
refusals, each naming the key or file, before anything runs."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ddpflow.config import ConfigError
from ddpflow.config.typed import RunSpec
from ddpflow.data import text, windows
from ddpflow.data.staged import DataError, read_manifest, verify_staged
from ddpflow.data.staging import stage_dataset
from ddpflow.data.tokenizer import ByteTokenizer
from ddpflow.training import evaluate
from ddpflow.training.checkpoint import Checkpointer
from ddpflow.training.gpt import text_samples
from ddpflow.training.loop import Loop, fit
from ddpflow.training.models import ModelError, build_model, check_model
from ddpflow.training.rankdata import load_data
from distributed_helpers import run_group
from workflow_helpers import make_run

CPU = torch.device("cpu")
JSON = Path(json.__file__).parent  # text that ships with Python
GPT = {"name": "gpt", "kwargs": {"n_layer": 2, "n_head": 2, "n_embd": 32}}
BLOCK = 16
# a global batch of 16 blocks in micro-batches of 4: 4 micro-batches per step at any world
# size (1 rank: 4 accumulation steps, 2: 2, 4: 1)
TRAIN = {
    "epochs": 2,
    "global_batch_size": 16,
    "micro_batch_size": 4,
    "progress": False,
    "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.1},
}
CHECKPOINT_STEP = 17  # mid-epoch 2 (15 steps per epoch: 252 blocks of the train split)
# fp32 summation order (all-reduce, accumulation) is all that differs between world sizes.
# Measured on the 2-core CI machine (torch 2.14.1): per-step losses at 2 ranks within 1.2e-7
# (relative) of 1 rank's; weights at 4 ranks within 4.3e-6 of 1 rank's after 30 steps; the
# 4 -> 2 resume within 7.5e-7 of the uninterrupted run. About 10x room.
LOSS_RTOL, WEIGHT_ATOL = 2e-6, 5e-5


def _corpus(root: Path) -> Path:
    """Two of Python's own source files, one in a subfolder (read in sorted order)."""
    corpus = root / "corpus"
    (corpus / "sub").mkdir(parents=True)
    shutil.copy(JSON / "tool.py", corpus / "a.py")
    shutil.copy(JSON / "scanner.py", corpus / "sub" / "b.py")
    return corpus


def _run(corpus, world: int = 1, train=None, **data) -> dict:
    return make_run(
        task="language_model",
        data={"source": "text", "path": str(corpus), "block_size": BLOCK, **data},
        model=GPT,
        train={**TRAIN, **(train or {})},
        machine={"cpu_ranks_per_node": world},
    )


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm")
    corpus = _corpus(root)
    run = _run(corpus)
    stage_dataset(run["data"], root / "staged", seed=0)
    return {"root": root, "corpus": corpus, "staged": str(root / "staged")}


def test_text_is_staged_as_bytes_with_end_of_document_tokens_in_contiguous_splits(staged):
    manifest = verify_staged(staged["staged"])
    a, b = (
        (staged["corpus"] / "a.py").read_bytes(),
        (staged["corpus"] / "sub" / "b.py").read_bytes(),
    )
    stream = np.concatenate([np.frombuffer(a, np.uint8), [text.EOD], np.frombuffer(b, np.uint8)])
    splits = [np.load(Path(staged["staged"]) / f"{s}.tokens.npy") for s in ("train", "val", "test")]
    assert np.array_equal(np.concatenate(splits), stream)  # train, then val, then test
    assert [len(s) for s in splits] == [manifest["tokens"][s] for s in ("train", "val", "test")]
    assert manifest["tokens"]["val"] == round(len(stream) * 0.1)  # data.val_fraction
    assert manifest["vocab_size"] == 257 and manifest["dtype"] == "uint16"
    assert [f["file"] for f in manifest["source_files"]] == ["a.py", "sub/b.py"]
    # blocks of block_size + 1 from offset 0; the scored split's last one padded
    train = windows.TokenBlocks(splits[0], BLOCK, scored=False, device=CPU)
    assert len(train) == (len(splits[0]) - 1) // BLOCK
    got = train.gather([0, len(train) - 1])
    assert np.array_equal(got[1], splits[0][(len(train) - 1) * BLOCK :][: BLOCK + 1])
    assert np.array_equal(got[0], splits[0][: BLOCK + 1])
    test = windows.TokenBlocks(splits[2], BLOCK, scored=True, device=CPU)
    last = test.rows(len(test) - 1, len(test))[0].numpy()
    tail = splits[2][(len(test) - 1) * BLOCK :]
    assert np.array_equal(last[: len(tail)], tail) and (last[len(tail) :] == windows.PAD).all()
    # a damaged byte is found by its sha256
    damaged = Path(staged["root"]) / "damaged"
    shutil.copytree(staged["staged"], damaged)
    with open(damaged / "val.tokens.npy", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x07")
    with pytest.raises(DataError, match="sha256 mismatch"):
        verify_staged(damaged)


def test_token_files_are_staged_checked_and_test_carved_from_train(tmp_path):
    """nanoGPT's train.bin/val.bin (uint16) as they are, test carved from train's end; .npy
    uint32 for a vocabulary over 65536; ids at or above vocab_size named with file and
    position."""
    rng = np.random.default_rng(0)
    folder = tmp_path / "tok"
    folder.mkdir()
    train, val = (
        rng.integers(0, 500, 1000, dtype=np.uint16),
        rng.integers(0, 500, 200, dtype=np.uint16),
    )
    train.tofile(folder / "train.bin")
    val.tofile(folder / "val.bin")
    run = make_run(
        task="language_model",
        model=GPT,
        data={"source": "tokens", "path": str(folder), "vocab_size": 500, "block_size": 8},
    )
    manifest = stage_dataset(run["data"], tmp_path / "staged", seed=0)
    assert manifest["tokens"] == {"train": 800, "val": 200, "test": 200}
    got = {s: np.load(tmp_path / "staged" / f"{s}.tokens.npy") for s in ("train", "val", "test")}
    assert np.array_equal(np.concatenate([got["train"], got["test"]]), train)
    assert np.array_equal(got["val"], val)
    verify_staged(tmp_path / "staged")

    wide = tmp_path / "wide"
    wide.mkdir()
    for split, n in (("train", 300), ("val", 100), ("test", 100)):
        np.save(wide / f"{split}.npy", rng.integers(0, 70000, n, dtype=np.uint32))
    run = make_run(
        task="language_model",
        model=GPT,
        data={"source": "tokens", "path": str(wide), "vocab_size": 70000, "block_size": 8},
    )
    manifest = stage_dataset(run["data"], tmp_path / "wide-staged", seed=0)
    assert manifest["dtype"] == "uint32" and manifest["tokens"]["test"] == 100

    val[123] = 500  # one id too many
    val.tofile(folder / "val.bin")
    with pytest.raises(
        DataError, match=r"val.bin: token id 500 at position 123 .*data.vocab_size 500"
    ):
        stage_dataset(run["data"] | {"path": str(folder), "vocab_size": 500}, tmp_path / "x", 0)
    assert not (tmp_path / "x").exists()


def test_bad_token_data_is_refused_naming_the_key_or_file(tmp_path, staged):
    corpus = staged["corpus"]
    with pytest.raises(DataError, match=r"data.block_size 1000: the val split has 576 tokens"):
        stage_dataset(_run(corpus, block_size=1000)["data"], tmp_path / "s", seed=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no file"):
        stage_dataset(_run(tmp_path / "empty")["data"], tmp_path / "s", seed=0)
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "blank.txt").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty file.*blank.txt"):
        stage_dataset(_run(tmp_path / "one")["data"], tmp_path / "s", seed=0)
    assert not (tmp_path / "s").exists()
    refusals = {
        "task language_model on data.source digits": dict(task="language_model", model=GPT),
        "data.source text holds tokens, which task classification": dict(
            data={"source": "text", "path": str(corpus)}
        ),
        "data.vocab_size is required for data.source tokens": dict(
            task="language_model", model=GPT, data={"source": "tokens", "path": "tok"}
        ),
        "model.name 'cnn' is an image model": dict(
            task="language_model", data={"source": "text", "path": str(corpus)}
        ),
        "data.block_size 32 is set for data.source digits": dict(data={"block_size": 32}),
        "model.name gpt is a language model": dict(model={"name": "gpt"}),
        "data.max_train_samples 100 caps images": dict(
            task="language_model",
            model=GPT,
            data={"source": "text", "path": str(corpus), "max_train_samples": 100},
        ),
    }
    for message, sections in refusals.items():
        with pytest.raises(ConfigError, match=message):
            make_run(**sections)


def test_gpt_takes_ids_and_gives_logits_per_position_with_tied_weights():
    model = build_model(GPT, [BLOCK], 257)
    assert model.head.weight is model.wte.weight
    out = model(torch.randint(0, 257, (3, BLOCK)))
    assert out.shape == (3, BLOCK, 257)
    # causal: a later token never changes an earlier position's logits
    x = torch.randint(0, 257, (1, BLOCK))
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % 257
    model.eval()
    assert torch.equal(model(x)[0, :-1], model(y)[0, :-1])
    assert check_model(GPT, [BLOCK], 257) == sum(p.numel() for p in model.parameters())
    # samples of an untrained byte model: any byte, control characters shown as U+FFFD
    val = SimpleNamespace(inputs=SimpleNamespace(tokens=np.arange(65, 65 + 40)))
    data = SimpleNamespace(
        manifest={"source": "text", "block_size": BLOCK}, val=val, tokenizer=ByteTokenizer()
    )
    made = text_samples(model, data, seed=3, every_rank=False, is_master=True)
    assert made["prompt"] == "ABCDEFGHIJKLMNOP"  # the validation split's first block_size
    again = text_samples(model, data, seed=3, every_rank=False, is_master=True)
    assert made == again and [s["seed"] for s in made["samples"]] == [3, 4, 5]
    shown = "".join(s["text"] for s in made["samples"])
    assert all(c.isprintable() or c in "\n\t" for c in shown) and "\ufffd" in shown


def _loop(env, staged: str, corpus, strategy="ddp", **train) -> Loop:
    run = _run(corpus, env.world_size, {"strategy": strategy, **train})
    spec = RunSpec.from_run(run)
    data = load_data(spec, staged, env, CPU, splits=("train", "val", "test"))
    torch.manual_seed(run["train"]["seed"])  # as TrainTask.work
    return Loop(spec, data, env, CPU, build_model(run["model"], data.shape, data.num_classes))


def _losses(loop: Loop) -> list[float]:
    losses: list[float] = []

    def on_step(lp):  # the whole step's mean loss over every rank's micro-batches
        losses.append(float(lp.global_step_losses()[lp.epoch_step - 1]) / lp.micro_per_step)

    loop.watch_steps(on_step)
    fit(loop, lambda record: None)
    return losses


def _weights(loop: Loop) -> dict:
    return {k: v.detach().clone() for k, v in loop.full_model_state().items()}


def _scores(loop: Loop) -> dict:
    """Each scored split's metrics, of the trained model, at eval batch sizes that leave
    uneven shards and a partial last batch."""
    data = loop.data
    return {
        (split, size): evaluate.evaluate_split(
            loop.model, data.split(split), data.scoring(size), loop.env
        )
        for split in ("val", "test")
        for size in (3, 64)
    }


def _at_world(env, staged: str, corpus, work: str) -> dict:
    loop = _loop(env, staged, corpus)
    ckpt = Checkpointer(loop.run, f"{work}/w{env.world_size}", env)
    if env.world_size == 4:  # the mid-epoch checkpoint 2 ranks continue
        loop.watch_steps(
            lambda lp: ckpt.save(lp, "t") if lp.scheduler.last_epoch == CHECKPOINT_STEP else None
        )
        fit(loop, lambda record: None)
        out = {"losses": None}
    else:
        out = {"losses": _losses(loop)}
    out.update(weights=_weights(loop), scores=_scores(loop), history=loop.history)
    if env.world_size == 2:
        resumed = _loop(env, staged, corpus)
        state = Checkpointer(resumed.run, f"{work}/w4", env).restore(resumed)
        out["resumed_from"] = (state["world_size"], resumed.epoch, resumed.epoch_step)
        fit(resumed, lambda record: None)
        out["resumed"] = _weights(resumed)
        for strategy, train in (
            ("zero", {}),
            ("fsdp", {}),
            ("ddp", {"activation_checkpointing": True}),
        ):
            out[f"{strategy}{sorted(train)}"] = _losses(
                _loop(env, staged, corpus, strategy, **train)
            )
        bf16 = _loop(env, staged, corpus, precision="bf16")
        out["bf16"] = _losses(bf16)
    return out


@pytest.fixture(scope="module")
def worlds(staged, tmp_path_factory):
    work = str(tmp_path_factory.mktemp("work"))
    return {
        world: run_group(
            world,
            _at_world,
            (staged["staged"], staged["corpus"], work),
            tmp_path_factory.mktemp("rdzv"),
        )[0]
        for world in (4, 2, 1)
    }


@pytest.mark.slow
def test_the_same_losses_at_1_2_and_4_ranks(worlds):
    one, two = worlds[1]["losses"], worlds[2]["losses"]
    assert len(one) == 30 and one[-1] < one[0] * 0.7  # 2 epochs of 15 steps; it learns
    np.testing.assert_allclose(two, one, rtol=LOSS_RTOL)
    for world in (2, 4):
        for key, value in worlds[world]["weights"].items():
            torch.testing.assert_close(
                value, worlds[1]["weights"][key], atol=WEIGHT_ATOL, rtol=1e-4
            )


@pytest.mark.slow
def test_every_position_is_scored_once_at_any_world_size(worlds, staged):
    manifest = read_manifest(staged["staged"])
    for world in (1, 2, 4):
        for (split, size), got in worlds[world]["scores"].items():
            assert got["tokens"] == manifest["tokens"][split] - 1, (world, split, size)
            assert got["samples_evaluated"] == math.ceil((manifest["tokens"][split] - 1) / BLOCK)
            assert got["perplexity"] == pytest.approx(math.exp(got["loss"]))
            # the same model (1 rank's weights equal 2's to fp32 rounding): the same score
            reference = worlds[1]["scores"][(split, 64)]
            assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    # at one world size, the batch does not change the token-weighted loss (float64 sums)
    scores = worlds[2]["scores"]
    assert scores[("test", 3)]["loss"] == pytest.approx(scores[("test", 64)]["loss"], rel=1e-6)
    history = worlds[1]["history"]
    assert history[-1]["val_perplexity"] < history[0]["val_perplexity"] < 257  # a uniform guess


@pytest.mark.slow
def test_a_checkpoint_from_4_ranks_mid_epoch_continues_at_2(worlds):
    assert worlds[2]["resumed_from"] == (4, 1, 2)  # epoch 2, after its second step
    for key, value in worlds[2]["resumed"].items():
        torch.testing.assert_close(value, worlds[4]["weights"][key], atol=WEIGHT_ATOL, rtol=1e-4)


@pytest.mark.slow
def test_zero_fsdp_activation_checkpointing_and_bf16_train_the_same_model(worlds):
    ddp = worlds[2]["losses"]
    # zero shards the optimizer state only and recomputed activations are the same values:
    # bitwise ddp's; fsdp sums its gradients another way (within 1.1e-7 measured)
    assert worlds[2]["zero[]"] == ddp
    assert worlds[2]["ddp['activation_checkpointing']"] == ddp
    np.testing.assert_allclose(worlds[2]["fsdp[]"], ddp, rtol=LOSS_RTOL)
    bf16 = worlds[2]["bf16"]  # autocast on the CPU: its matmuls in bf16
    assert bf16 != ddp and all(math.isfinite(x) for x in bf16)
    np.testing.assert_allclose(bf16, ddp, rtol=0.01)


def test_your_own_language_model_is_called_with_vocab_size_and_block_size(tmp_path, monkeypatch):
    (tmp_path / "my_lm.py").write_text(
        "from torch import nn\n"
        "def build(vocab_size, block_size, width=8):\n"
        "    return nn.Sequential(nn.Embedding(vocab_size, width), nn.Linear(width, vocab_size))\n"
        "def broken(vocab_size, block_size):\n"
        "    return nn.Embedding(vocab_size, 3)  # 3 logits, not vocab_size\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model({"name": "my_lm:build", "kwargs": {"width": 4}}, [BLOCK], 257)
    assert model(torch.zeros(2, BLOCK, dtype=torch.int64)).shape == (2, BLOCK, 257)
    assert check_model({"name": "my_lm:build", "kwargs": {}}, [BLOCK], 257) > 0
    with pytest.raises(ModelError, match=r"expected logits of shape \(2, 16, 257\)"):
        check_model({"name": "my_lm:broken", "kwargs": {}}, [BLOCK], 257)
    with pytest.raises(ModelError, match="called with vocab_size 257, block_size 16"):
        build_model({"name": "my_lm:build", "kwargs": {"depth": 2}}, [BLOCK], 257)
