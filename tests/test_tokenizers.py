"""data.tokenizer (docs/language-models.md, "Tokenizers"): a byte-level BPE trained at staging
on the train split only (a word of val alone stays in pieces), the same tokenizer.json bytes
in other processes and thread counts, pieces streamed in small units encoding to the ids of
whole documents, a given tokenizer.json staged as bpe's ids, bits per byte from exact byte
counts, the refusals before anything runs, the fingerprints of runs before the key; and
through the workflow: bpe 512 at 2 ranks, then the same bits per byte at 1 rank."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ddpflow.config import ConfigError
from ddpflow.config.fingerprint import dataset_id, stage_params, training_fingerprint
from ddpflow.data import subword, tokenizer
from ddpflow.data.staged import DataError, read_manifest, verify_staged
from ddpflow.data.staging import stage_dataset
from ddpflow.task.lm import PAD, LanguageModel
from workflow_helpers import jobs_planned, make_run, snakemake, write_config

JSON = Path(json.__file__).parent  # text that ships with Python
GPT = {"name": "gpt", "kwargs": {"n_layer": 1, "n_head": 2, "n_embd": 32}}
# train 80%, val 10%, test 10% of the stream (data.val_fraction, data.test_fraction 0.1)
TRAIN_LINE = "the quick brown fox jumps over the lazy dog qwertyuiop\n"
VAL_WORD = "zxcvbnmlkjh"  # none of its letter pairs is in the train text


def _lm(path, **data) -> dict:
    return make_run(
        task="language_model",
        data={"source": "text", "path": str(path), "block_size": 8, **data},
        model=GPT,
    )


def _parts() -> tuple[str, str, str]:
    train = TRAIN_LINE * 160  # 8,800 bytes
    fill = len(train) // 8
    val = (f"{VAL_WORD} asdf\n" * fill)[:fill]
    test = ("over the dog\n" * fill)[:fill]
    return train, val, test


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A one-file corpus whose val words are not in train, staged with bpe 300."""
    root = tmp_path_factory.mktemp("bpe")
    (root / "corpus").mkdir()
    (root / "corpus" / "a.txt").write_text("".join(_parts()))
    run = _lm(root / "corpus", tokenizer="bpe", vocab_size=300, test_fraction=0.1)
    manifest = stage_dataset(run["data"], root / "staged", seed=0, threads=2)
    return {"root": root, "manifest": manifest, "staged": root / "staged"}


def test_bpe_is_trained_on_the_train_split_only_and_staged_with_its_sha256(bpe):
    manifest, staged = bpe["manifest"], bpe["staged"]
    entry = manifest["tokenizer"]
    sha = hashlib.sha256((staged / "tokenizer.json").read_bytes()).hexdigest()
    assert entry["kind"] == "bpe" and entry["sha256"] == sha and entry["eod"] == 0
    assert manifest["files"]["tokenizer.json"]["sha256"] == sha
    verify_staged(staged)
    tok = tokenizer.load(staged, verify=True)
    # the model's width; the train text had merges for fewer ids (its ids are all below)
    assert manifest["vocab_size"] == 300 and entry["vocab"] == tok.vocab_size <= 300
    assert len(tok.encode(" qwertyuiop")) == 1  # a train word: one token
    assert len(tok.encode(VAL_WORD)) == len(VAL_WORD)  # val's only: one token per byte
    train, val, test = _parts()
    ids = {s: np.load(staged / f"{s}.tokens.npy") for s in ("train", "val", "test")}
    assert [tok.decode(ids[s].tolist()) for s in ids] == [train, val, test]  # the same cuts
    # bits per byte's denominator: each id's bytes sum to the text's UTF-8 bytes
    assert tok.token_bytes()[ids["val"]].sum() == len(val.encode())


def test_bpe_training_is_deterministic_across_processes_and_threads(bpe):
    """tokenizers' maps are seeded per process: other processes, 1 or 2 threads, the whole
    train text at once instead of staging's pieces: the same tokenizer.json bytes."""
    staged = (bpe["staged"] / "tokenizer.json").read_bytes()
    code = (
        "import sys; from ddpflow.data.byte_level import train_bpe; "
        "sys.stdout.write(train_bpe(iter([sys.stdin.read()]), 300))"
    )
    for threads in ("1", "2"):
        env = {**os.environ, "RAYON_NUM_THREADS": threads}
        command = [sys.executable, "-c", code]
        done = subprocess.run(
            command, input=_parts()[0], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.encode() == staged


def test_pieces_stream_in_small_units_and_encode_to_the_whole_documents_ids(
    tmp_path, monkeypatch, bpe
):
    corpus = tmp_path / "corpus"
    shutil.copytree(JSON, corpus, ignore=shutil.ignore_patterns("__pycache__"))
    given = str(bpe["staged"] / "tokenizer.json")  # a tokenizer.json of yours
    whole = stage_dataset(_lm(corpus, tokenizer=given)["data"], tmp_path / "whole", seed=0)
    assert whole["tokenizer"]["kind"] == "file" and whole["tokenizer"]["from"] == given
    monkeypatch.setattr(subword, "UNIT", 256)  # default: every file here is one piece
    monkeypatch.setattr(subword, "BATCH_PER_THREAD", 1000)
    small = stage_dataset(_lm(corpus, tokenizer=given)["data"], tmp_path / "small", seed=0)
    assert small["tokens"] == whole["tokens"]
    for split in ("train", "val", "test"):
        a, b = (np.load(tmp_path / f"{d}/{split}.tokens.npy") for d in ("whole", "small"))
        assert np.array_equal(a, b), split
    # a long line without a line start is cut at a character's start: memory stays bounded
    monkeypatch.setattr(subword, "LONG_LINE", 1000)
    text = "déjà vu " * 400 + "\nnext line\n" + "  indented\n" * 100
    (tmp_path / "long.txt").write_text(text)
    size = len(text.encode())
    found = list(subword.pieces(subword.Segment(0, tmp_path / "long.txt", 0, size), "bpe"))
    assert "".join(found) == text and max(len(p.encode()) for p in found) < 1000 + 256
    assert len(found) >= 4 and all(len(p.encode()) >= 1000 - 3 for p in found[:3])
    assert found[-1] == "next line\n" + "  indented\n" * 100  # no line start among them
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    segment = subword.Segment(0, tmp_path / "latin1.txt", 0, 5)
    with pytest.raises(DataError, match=r"latin1.txt is not UTF-8 text \(byte 3\)"):
        list(subword.pieces(segment, "bpe"))


def test_bits_per_byte_sums_the_bytes_of_the_scored_targets():
    task = LanguageModel()
    table = np.array([1, 1, 3, 5], dtype=np.int64)  # bytes per id; id 0 the end of a document
    state = task.new_state({"token_bytes": table}, "cpu")
    targets = torch.tensor([[2, 3, 0, PAD], [1, 2, PAD, PAD]])
    logits = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(0))
    task.update(state, logits, targets)
    got = task.metrics(state, {})
    assert got["tokens"] == 5 and got["bytes"] == 3 + 5 + 1 + 1 + 3
    nats = got["loss"] * got["tokens"]
    assert got["bits_per_byte"] == pytest.approx(nats / (math.log(2) * 13), rel=1e-12)
    # bytes: one byte per token, so bits per byte is the loss in bits per token
    state = task.new_state({"token_bytes": tokenizer.ByteTokenizer().token_bytes()}, "cpu")
    task.update(state, torch.randn(1, 3, 257), torch.tensor([[65, 256, PAD]]))
    got = task.metrics(state, {})
    assert got["bits_per_byte"] == pytest.approx(got["loss"] / math.log(2), rel=1e-12)
    assert "bits_per_byte" not in task.metrics(task.new_state({}, "cpu"), {})  # token files


def test_bad_tokenizer_settings_are_refused_naming_the_key(tmp_path, bpe):
    corpus, given = bpe["root"] / "corpus", bpe["staged"] / "tokenizer.json"
    sha = hashlib.sha256(given.read_bytes()).hexdigest()
    ids = bpe["manifest"]["tokenizer"]["vocab"]
    from tokenizers import Tokenizer, models

    wordpiece = tmp_path / "wordpiece.json"
    wordpiece.write_text(Tokenizer(models.WordPiece({"[UNK]": 0}, unk_token="[UNK]")).to_str())
    refusals = {
        "data.vocab_size is required for data.tokenizer bpe": dict(tokenizer="bpe"),
        r"data.vocab_size 256 is too small for data.tokenizer bpe.*at least 257": dict(
            tokenizer="bpe", vocab_size=256
        ),
        r"data.tokenizer .*missing.json: no such file": dict(
            tokenizer=str(tmp_path / "missing.json")
        ),
        r"data.tokenizer_sha256 0{64} does not match .*its sha256 is " + sha: dict(
            tokenizer=str(given), tokenizer_sha256="0" * 64
        ),
        rf"data.vocab_size {ids - 1}: data.tokenizer .* has {ids} ids; set data.vocab_size": (
            dict(tokenizer=str(given), vocab_size=ids - 1)
        ),
        "a WordPiece model; ddpflow reads byte-level BPE": dict(tokenizer=str(wordpiece)),
        "data.tokenizer_sha256 pins a tokenizer.json file, and data.tokenizer is bpe": dict(
            tokenizer="bpe", vocab_size=300, tokenizer_sha256=sha
        ),
        "data.vocab_size 300: data.tokenizer bytes has 257 tokens": dict(vocab_size=300),
    }
    for message, data in refusals.items():
        with pytest.raises(ConfigError, match=message):
            _lm(corpus, **data)
    with pytest.raises(ConfigError, match="data.tokenizer bpe is set for data.source tokens"):
        tokens = {"source": "tokens", "path": "t", "vocab_size": 300, "tokenizer": "bpe"}
        make_run(task="language_model", model=GPT, data=tokens)
    _lm(corpus, tokenizer=str(given), tokenizer_sha256=sha.upper())  # the pinned file: fine


def test_runs_before_the_key_keep_their_ids_and_pinning_retrains_nothing(bpe, tmp_path):
    run = _lm(bpe["root"] / "corpus")
    before = {k: v for k, v in run["data"].items() if not k.startswith("tokenizer")}
    assert run["data"]["tokenizer"] == "bytes"  # the default, left out of every identity
    assert dataset_id(before) == run["dataset_id"] == dataset_id(run["data"])
    assert stage_params(before) == stage_params(run["data"])
    assert not [k for k in training_fingerprint(run) if "tokenizer" in k]
    given = tmp_path / "tokenizer.json"
    shutil.copy(bpe["staged"] / "tokenizer.json", given)
    mine = _lm(bpe["root"] / "corpus", tokenizer=str(given))
    sha = hashlib.sha256(given.read_bytes()).hexdigest()
    pinned = _lm(bpe["root"] / "corpus", tokenizer=str(given), tokenizer_sha256=sha)
    assert training_fingerprint(pinned) == training_fingerprint(mine)
    assert stage_params(pinned["data"]) == stage_params(mine["data"])
    given.write_text(given.read_text().replace("Ġqwertyuiop", "Ġqwertyuiox"))
    edited = _lm(bpe["root"] / "corpus", tokenizer=str(given))  # another file: restaged
    assert edited["dataset_id"] != mine["dataset_id"] != run["dataset_id"]


@pytest.mark.e2e
def test_bpe_512_trains_at_2_ranks_and_scores_the_same_bits_per_byte_at_1(workdir):
    shutil.copytree(JSON, workdir / "corpus", ignore=shutil.ignore_patterns("__pycache__"))
    config = {
        "task": "language_model",
        "data": {"source": "text", "path": "corpus", "block_size": 32, "tokenizer": "bpe",
                 "vocab_size": 512},
        "model": GPT,
        "train": {"epochs": 1, "global_batch_size": 32, "micro_batch_size": 16,
                  "optimizer": {"name": "adamw", "lr": 0.003}},
        "runs": [{"name": "lm", "machine": {"cpu_ranks_per_node": 2}}],
    }  # fmt: skip
    done = snakemake(workdir, write_config(workdir / "config.yaml", config))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    staged = next((workdir / "results/staged").glob("text-*"))
    manifest = read_manifest(staged)
    sha = hashlib.sha256((staged / "tokenizer.json").read_bytes()).hexdigest()
    assert manifest["tokenizer"]["sha256"] == sha and manifest["vocab_size"] == 512
    two = json.loads((workdir / "results/runs/lm/eval_metrics.json").read_text())
    assert two["world_size"] == 2 and two["bits_per_byte"] > 0
    test = np.load(staged / "test.tokens.npy")
    scored = tokenizer.load(staged).token_bytes()[test[1:]].sum()  # every target once
    assert two["bytes"] == scored and two["tokens"] == len(test) - 1
    assert two["bits_per_byte"] == pytest.approx(
        two["loss"] * two["tokens"] / (math.log(2) * scored), rel=1e-12
    )
    report = (workdir / "results/report/report.md").read_text()
    assert "Test bits per byte" in report and f"bpe (sha256 {sha[:8]})" in report
    # another machine retrains nothing; its evaluate job scores the model at 1 rank
    config["runs"][0]["machine"]["cpu_ranks_per_node"] = 1
    one_rank = write_config(workdir / "config.yaml", config)
    assert jobs_planned(workdir, one_rank) == set()
    done = snakemake(workdir, one_rank, "--forcerun", "evaluate")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    one = json.loads((workdir / "results/runs/lm/eval_metrics.json").read_text())
    assert one["world_size"] == 1 and one["evaluated_by"] == "evaluate job"
    assert one["bytes"] == two["bytes"] and one["tokens"] == two["tokens"]
    assert one["bits_per_byte"] == pytest.approx(two["bits_per_byte"], rel=1e-6)
