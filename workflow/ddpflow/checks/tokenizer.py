"""data.tokenizer and the keys that go with it (data.vocab_size, data.tokenizer_sha256),
checked when the config is read, before anything is staged or submitted: each refusal names
the key and the fix (docs/language-models.md, "Tokenizers")."""

from __future__ import annotations

import functools
from pathlib import Path

from ddpflow.config.schema import ConfigError
from ddpflow.data import byte_level
from ddpflow.data.byte_level import check_fits, check_pinned
from ddpflow.errors import DataError


def check_tokenizer(data: dict, where: str) -> None:
    """A run's data section: the tokenizer applies (text), bytes keeps its 257 ids, bpe has a
    vocabulary that holds the bytes and the end-of-document token, a tokenizer.json exists,
    is the pinned file, is a byte-level BPE and fits data.vocab_size."""
    spec, vocab = data.get("tokenizer", byte_level.BYTES), data.get("vocab_size")
    kind, pinned = byte_level.kind(spec), data.get("tokenizer_sha256")
    if data["source"] != "text":
        if kind != byte_level.BYTES or pinned:
            raise ConfigError(
                f"{where}: data.tokenizer {spec} is set for data.source {data['source']}; it "
                "tokenizes data.source text (token files hold ids already): remove it"
            )
        return
    if pinned and kind != "file":
        raise ConfigError(
            f"{where}: data.tokenizer_sha256 pins a tokenizer.json file, and data.tokenizer is "
            f"{spec}; give data.tokenizer the file's path, or remove data.tokenizer_sha256"
        )
    if kind == byte_level.BYTES and vocab not in (None, byte_level.BYTE_EOD + 1):
        raise ConfigError(
            f"{where}: data.vocab_size {vocab}: data.tokenizer bytes has 257 tokens (256 "
            "bytes and the end-of-document token); remove data.vocab_size, or set "
            "data.tokenizer: bpe to train a tokenizer of that many ids"
        )
    if kind == byte_level.BPE and (vocab is None or vocab < byte_level.MIN_BPE_VOCAB):
        said = "is required" if vocab is None else f"{vocab} is too small"
        raise ConfigError(
            f"{where}: data.vocab_size {said} for data.tokenizer bpe: the ids it trains, at "
            f"least {byte_level.MIN_BPE_VOCAB} (256 bytes and the end-of-document token), "
            "e.g. 4096"
        )
    if kind == "file":
        _check_file(Path(spec).expanduser(), pinned, vocab, where)


def _check_file(path: Path, pinned: str | None, vocab: int | None, where: str) -> None:
    try:
        check_pinned(path, pinned)
        found = _read(str(path), path.stat().st_mtime_ns, path.stat().st_size)
        if vocab is not None:
            check_fits(found, vocab, str(path))
    except DataError as err:
        raise ConfigError(f"{where}: {err}") from err


@functools.cache
def _read(path: str, mtime_ns: int, size: int) -> byte_level.ByteLevelBPE:
    """A tokenizer.json read and checked once per version of the file (every run names it)."""
    return byte_level.ByteLevelBPE.from_file(path)
