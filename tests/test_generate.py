"""`snakemake generate`'s parts on real small objects: the GPT's KV cache gives the logits of
the whole context, and generation with it the tokens of recomputing the context at every
step (past block_size too); seeded sampling (a prompt's draws from (generate.seed, its
index) alone, temperature 0 greedy); the prompts read, cropped and refused naming the key;
rank 0's merge (each prompt exactly once, in order); the generate section in no fingerprint.
The workflow itself (2 ranks and 1 give the same generations.jsonl) is run in
tests/test_language_model_e2e.py, on the model trained there."""

from __future__ import annotations

import json

import pytest
import torch
from ddpflow import config as ddpconfig
from ddpflow.config import ConfigError
from ddpflow.config.fingerprint import dataset_id, evaluation_fingerprint, training_fingerprint
from ddpflow.data.codec import IdCodec, codec_for
from ddpflow.generate import (
    check_can_generate,
    encode_prompts,
    generate_run_names,
    prompt_seed,
    read_prompts,
)
from ddpflow.training.generate_ranks import merge
from ddpflow.training.gpt import GPT, generate
from torch import nn

BLOCK = 16
SETTINGS = {"prompts": None, "runs": [], "max_new_tokens": 5, "temperature": 1.0}
SETTINGS.update(top_k=40, seed=0)


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(61, BLOCK, n_layer=2, n_head=2, n_embd=32).eval()


@torch.no_grad()
def test_the_kv_cache_gives_the_logits_of_the_whole_context(model):
    """A prompt read at once, then one token, then several: each call's logits are those of
    the full forward at the same positions (what training computes)."""
    idx = torch.randint(0, 61, (2, BLOCK))
    full = model(idx)
    cache = model.new_cache(batch=2)
    parts = [model(idx[:, a:b], cache=cache) for a, b in ((0, 5), (5, 6), (6, 11), (11, BLOCK))]
    assert cache.length == BLOCK
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="the cache holds 16 positions"):
        model(idx[:, :1], cache=cache)  # the learned positions end at block_size


@pytest.mark.parametrize("temperature, top_k", [(0.0, None), (1.0, 5), (0.8, None)])
def test_generation_with_the_cache_is_the_recompute_of_the_whole_context(model, temperature, top_k):
    """Greedy and sampled, into and past block_size (where the context slides): the same
    tokens with the cache as recomputing the last block_size tokens at every step."""
    prompt = [3, 1, 4, 1, 5]
    new = 2 * BLOCK  # past the block: the last block_size tokens are read anew each step
    args = (model, prompt, new, BLOCK, 7, temperature, top_k)
    cached, recomputed = generate(*args), generate(*args, cache=False)
    assert cached == recomputed and len(cached) == new
    assert not model.training  # left in the mode it was in


def test_a_model_without_a_cache_generates_by_recomputing(model):
    """A plug-in language model (no new_cache, no cache argument) reads the whole context."""

    class Plain(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, idx):
            return self.inner(idx)

    args = ([2, 7], 20, BLOCK, 3, 1.0, 10)
    assert generate(Plain(model), *args) == generate(model, *args, cache=False)


def test_sampling_is_a_function_of_the_seed_and_temperature_zero_is_greedy(model):
    prompt = [9, 8, 7]
    once, again = (generate(model, prompt, 12, BLOCK, seed=5) for _ in range(2))
    assert once == again
    assert generate(model, prompt, 12, BLOCK, seed=6) != once
    greedy = generate(model, prompt, 12, BLOCK, seed=5, temperature=0.0)
    assert greedy == generate(model, prompt, 12, BLOCK, seed=99, temperature=0.0)
    assert greedy == generate(model, prompt, 12, BLOCK, seed=5, temperature=1.0, top_k=1)
    with torch.no_grad():  # the first greedy token is the most likely after the prompt
        assert greedy[0] == int(model(torch.tensor([prompt]))[0, -1].argmax())
    with pytest.raises(ValueError, match="the prompt is empty"):
        generate(model, [], 3, BLOCK, seed=0)


def test_a_prompts_seed_depends_on_the_seed_and_its_index_only():
    seeds = [prompt_seed(0, i) for i in range(100)]
    assert seeds == [prompt_seed(0, i) for i in range(100)] and len(set(seeds)) == 100
    assert prompt_seed(1, 0) != seeds[0] and min(seeds) >= 0 and max(seeds) < 2**63


def _settings(**given) -> dict:
    return {**SETTINGS, **given}


def test_the_prompts_are_read_one_per_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes("def load(\r\n  indented \nünïcode\n".encode())
    assert read_prompts(_settings(prompts=str(path))) == ["def load(", "  indented ", "ünïcode"]
    path.write_text("no final line break")
    assert read_prompts(_settings(prompts=str(path))) == ["no final line break"]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "generate.prompts is not set: set it to a text file with one prompt per line"),
        ("missing", "generate.prompts {path}: no such file"),
        ("folder", "generate.prompts {path}: a folder, not a file"),
        (b"", "generate.prompts {path} is empty: write one prompt per line"),
        (b"a\n\nb\n\n", "generate.prompts {path}: lines 2, 4 are empty; a prompt needs"),
        (b"\xff\xfe", "generate.prompts {path}: not UTF-8 text"),
    ],
)
def test_bad_prompts_are_refused_naming_the_key(tmp_path, content, message):
    path = tmp_path / "prompts.txt"
    if content == "folder":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    given = None if content is None else str(path)
    with pytest.raises(ConfigError, match=message.format(path=path).replace("(", r"\(")):
        read_prompts(_settings(prompts=given))


def test_a_long_prompt_keeps_its_last_block_size_tokens_and_ids_are_checked():
    manifest = {"source": "text", "block_size": 4, "vocab_size": 257}
    prompts = encode_prompts(["abcdef", "ab"], _settings(seed=3), manifest, "staged")
    assert [p["tokens"] for p in prompts] == [list(b"cdef"), list(b"ab")]
    assert [p["cropped"] for p in prompts] == [2, 0]
    assert [p["seed"] for p in prompts] == [prompt_seed(3, 0), prompt_seed(3, 1)]
    ids = {"source": "tokens", "block_size": 4, "vocab_size": 10}
    assert encode_prompts([" 1 2  9"], SETTINGS, ids, "staged")[0]["tokens"] == [1, 2, 9]
    with pytest.raises(ConfigError, match=r"line 2: token id 10 is outside the vocabulary"):
        encode_prompts(["1", "10"], SETTINGS, ids, "staged")
    with pytest.raises(ConfigError, match="line 1: the run's data is token ids"):
        encode_prompts(["def"], SETTINGS, ids, "staged")


def test_prompts_are_encoded_with_the_runs_tokenizer(tmp_path):
    """Bytes, a byte-level BPE staged as its tokenizer.json (ddpflow.data.tokenizer: the seam
    samples decode with too) and token ids written as numbers."""
    from ddpflow.data.byte_level import train_bpe

    text = "ünïcode\tand bytes"
    plain = {"source": "text", "block_size": 8, "vocab_size": 257}
    codec = codec_for(plain, tmp_path)
    assert codec.encode(text) == list(text.encode()) and codec.decode(codec.encode(text)) == text
    assert codec.decode([104, 256, 105]) == "h\ni"  # the end of a document: a line break
    spec = train_bpe(["def load(fp):\n    return fp.read()\n"] * 50, 300)
    (tmp_path / "tokenizer.json").write_text(spec)
    files = {"tokenizer.json": {"bytes": (tmp_path / "tokenizer.json").stat().st_size}}
    entry = {"kind": "bpe", "file": "tokenizer.json", "eod": 0}
    bpe = codec_for({**plain, "vocab_size": 300, "tokenizer": entry, "files": files}, tmp_path)
    ids = bpe.encode("def load(fp):")
    assert len(ids) < len("def load(fp):") and bpe.decode(ids) == "def load(fp):"
    manifest = {**plain, "block_size": 2, "tokenizer": entry, "files": files}
    (prompt,) = encode_prompts(["def load(fp):"], SETTINGS, manifest, tmp_path)
    assert prompt["tokens"] == ids[-2:] and prompt["cropped"] == len(ids) - 2  # BPE tokens
    assert IdCodec(50).decode([1, 22, 3]) == "1 22 3"


def test_only_language_models_generate_and_generate_runs_are_checked():
    check_can_generate({"name": "lm", "task": "language_model"})
    with pytest.raises(ConfigError, match="run 'cnn' has task 'classification'"):
        check_can_generate({"name": "cnn", "task": "classification"})
    assert generate_run_names(SETTINGS, ["a", "b"]) == ["a", "b"]
    assert generate_run_names(_settings(runs=["b"]), ["a", "b"]) == ["b"]
    with pytest.raises(ConfigError, match=r"generate.runs names \['x'\]"):
        generate_run_names(_settings(runs=["x"]), ["a", "b"])


@pytest.mark.parametrize(
    "given, message",
    [
        ({"temperature": -0.5}, "generate.temperature: -0.5 is less than the minimum of 0"),
        ({"top_k": 0}, "generate.top_k: 0 is less than the minimum of 1"),
        ({"max_new_tokens": 0}, "generate.max_new_tokens: 0 is less than the minimum of 1"),
        ({"temprature": 1}, "temprature"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(given, message):
    with pytest.raises(ConfigError, match=message):
        ddpconfig.load(None, {"generate": given})


def test_the_generate_section_is_in_no_fingerprint():
    """A run's identity with and without a generate section: the same (nothing retrains,
    re-evaluates or restages after it is added or edited)."""
    data = {"source": "text", "path": "corpus"}
    lm = {"task": "language_model", "data": data, "model": {"name": "gpt"}}
    generate_section = {"prompts": "p.txt", "temperature": 0.5, "top_k": 3, "seed": 4}
    plain = ddpconfig.resolve_runs(ddpconfig.load(None, lm))[0]
    given = ddpconfig.resolve_runs(ddpconfig.load(None, {**lm, "generate": generate_section}))[0]
    assert "generate" not in given
    assert training_fingerprint(given) == training_fingerprint(plain)
    assert evaluation_fingerprint(given) == evaluation_fingerprint(plain)
    assert dataset_id(given["data"]) == dataset_id(plain["data"])


def test_the_merge_writes_each_prompt_once_in_order(tmp_path):
    line = {"prompt": "p", "completion": "c", "tokens": [1], "seed": 1, "cropped": 0}
    out = {"generations": tmp_path / "generations.jsonl"}

    def write(parts):
        for rank, indices in enumerate(parts):
            rows = [{"index": i, **line, "prompt": f"p{i}"} for i in indices]
            (tmp_path / f"part-{rank}.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in rows)
            )

    write([[0, 1], [2]])
    summary = merge(tmp_path, 2, 3, out, ["h"], 0.0)
    lines = [json.loads(text) for text in out["generations"].read_text().splitlines()]
    assert [row["prompt"] for row in lines] == ["p0", "p1", "p2"] and "index" not in lines[0]
    assert summary["prompts"] == 3 and summary["tokens"] == 3 and summary["world_size"] == 2
    write([[0, 1], [1, 2]])
    with pytest.raises(RuntimeError, match="prompt 1 was continued twice"):
        merge(tmp_path, 2, 3, out, ["h"], 0.0)
    write([[0], [2]])
    with pytest.raises(RuntimeError, match="1 prompt not continued"):
        merge(tmp_path, 2, 3, out, ["h"], 0.0)
