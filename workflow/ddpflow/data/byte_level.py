"""The tokenizers of a text corpus (data.tokenizer), as ddpflow.data.tokenizer hands them
out: ByteTokenizer (bytes: each UTF-8 byte is its own id, 0..255, the end of a document 256)
and ByteLevelBPE (bpe, or the path of a tokenizer.json: a byte-level BPE, GPT-2's kind, in
which every token stands for a fixed byte string). ByteLevelBPE decodes and counts bytes
from the file's vocabulary; Hugging Face `tokenizers` encodes and trains (train_bpe). No
torch and no staged data: the config checks read a given tokenizer.json through it.

Bytes per token (token_bytes) make bits per byte exact: a token's byte string, whose lengths
over a split's scored tokens sum to the UTF-8 bytes of the text they stand for; the
end-of-document token counts as one byte, as it does for the byte tokenizer, so bits per
byte compares across tokenizers.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ddpflow.errors import DataError

BYTES, BPE = "bytes", "bpe"  # data.tokenizer's names; anything else is a tokenizer.json path
FILE = "tokenizer.json"  # the staged tokenizer (bpe, or a copy of the given file)
SPECIAL = "<|endoftext|>"  # bpe's one special token (id 0): the end of a document
# a given tokenizer's end-of-document token: the first of its special tokens named so
EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
BYTE_EOD = 256  # the byte tokenizer's end-of-document id
EOD_TEXT = "\n"  # how decode writes an end-of-document token
MIN_BPE_VOCAB = 257  # 256 bytes and the end-of-document token


def kind(spec: str) -> str:
    """data.tokenizer as a kind: "bytes", "bpe" or "file" (a tokenizer.json path)."""
    return spec if spec in (BYTES, BPE) else "file"


def token_dtype(vocab: int) -> np.dtype:
    """The staged ids' type: uint16 up to 65536 ids, uint32 beyond."""
    return np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


@functools.cache
def byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character each byte is written as in a
    byte-level vocabulary (the same as tokenizers' pre_tokenizers.ByteLevel.alphabet())."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {b: chr(b) for b in printable}
    moved = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + n) for n, b in enumerate(moved)})
    return {c: b for b, c in chars.items()}


class ByteTokenizer:
    """data.tokenizer bytes: ids 0..255 are the bytes, 256 the end of a document."""

    eod = BYTE_EOD
    vocab_size = BYTE_EOD + 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        raw = b"".join(
            EOD_TEXT.encode() if t == BYTE_EOD else bytes([t]) for t in ids if 0 <= t <= BYTE_EOD
        )
        return raw.decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        return np.ones(self.vocab_size, dtype=np.int64)


class ByteLevelBPE:
    """A byte-level BPE tokenizer.json: decode and token_bytes from its vocabulary (each
    token's characters are bytes in GPT-2's alphabet), encode by Hugging Face `tokenizers`
    (imported when first needed: decoding needs only the file)."""

    def __init__(self, path: Path, pieces: list[bytes | None], eod: int | None):
        self.path, self.pieces, self.eod = Path(path), pieces, eod
        self.vocab_size = len(pieces)

    @classmethod
    def from_file(cls, path, what: str = "data.tokenizer") -> ByteLevelBPE:
        """The tokenizer.json at path, checked: a byte-level BPE, else a DataError naming
        `what` and the fix."""
        path = Path(path)
        try:
            spec = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise DataError(f"{what} {path}: not a readable tokenizer.json ({exc})") from exc
        return cls(path, *_pieces(spec, path, what))

    def encode(self, text: str) -> list[int]:
        return self.encoder.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids, encoded in parallel (tokenizers' thread pool)."""
        found = self.encoder.encode_batch_fast(texts, add_special_tokens=False)
        return [encoding.ids for encoding in found]

    def decode(self, ids: Iterable[int]) -> str:
        eod, n = self.eod, self.vocab_size
        raw = b"".join(
            EOD_TEXT.encode() if t == eod else self.pieces[t] or b"" for t in ids if 0 <= t < n
        )
        return raw.decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        lengths = [len(p) if p is not None else 0 for p in self.pieces]
        if self.eod is not None:
            lengths[self.eod] = 1
        return np.asarray(lengths, dtype=np.int64)

    @functools.cached_property
    def encoder(self):
        """The Hugging Face Tokenizer that encodes (no truncation, no padding, special tokens
        written in the text encoded as text)."""
        from tokenizers import Tokenizer

        encoder = Tokenizer.from_file(str(self.path))
        encoder.no_truncation()  # a staged document is encoded whole, in pieces
        encoder.no_padding()
        # "<|endoftext|>" written in a document is text, not the end of one
        encoder.encode_special_tokens = True
        return encoder


def _pieces(spec: dict, path: Path, what: str) -> tuple[list[bytes | None], int | None]:
    """Each id's byte string (None: an id the file does not use) and the end-of-document id
    (None without one) of a tokenizer.json's content."""
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or model.get("byte_fallback"):
        found = model.get("type") if isinstance(model, dict) else None
        said = "a BPE with byte fallback" if found == "BPE" else f"a {found or 'unknown'} model"
        raise DataError(
            f"{what} {path}: {said}; ddpflow reads byte-level BPE tokenizers (GPT-2's kind, "
            "or data.tokenizer: bpe)"
        )
    chars = byte_of_char()
    vocab, added = model.get("vocab") or {}, spec.get("added_tokens") or []
    size = 1 + max([*vocab.values(), *(a["id"] for a in added)], default=-1)
    pieces: list[bytes | None] = [None] * size
    for token, index in vocab.items():
        try:
            pieces[index] = bytes(chars[c] for c in token)
        except KeyError:
            raise DataError(
                f"{what} {path}: token {token!r} is not written in the byte-level alphabet; "
                "ddpflow reads byte-level BPE tokenizers (GPT-2's kind, or data.tokenizer: bpe)"
            ) from None
    for token in added:
        pieces[token["id"]] = token["content"].encode("utf-8")
    specials = {a["content"]: a["id"] for a in added if a.get("special")}
    eod = next((specials[name] for name in EOD_NAMES if name in specials), None)
    return pieces, eod


def train_bpe(texts: Iterable[str], vocab_size: int) -> str:
    """A byte-level BPE of vocab_size ids (id 0 the end of a document, then the 256 bytes,
    then the merges) trained on texts: its tokenizer.json content. Deterministic: the same
    texts give the same bytes (no continuing-subword prefix, whose lazily numbered pieces
    make tokenizers' training vary: huggingface/tokenizers#1794)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer.to_str()


def check_pinned(path: Path, sha256: str | None) -> None:
    """data.tokenizer's file exists and, when data.tokenizer_sha256 pins it, is that file."""
    if not path.is_file():
        raise DataError(
            f"data.tokenizer {path}: no such file; give the path of a tokenizer.json, or "
            "data.tokenizer: bpe (trained on the train split) or bytes"
        )
    if sha256 and file_sha256(path) != sha256.lower():
        raise DataError(
            f"data.tokenizer_sha256 {sha256} does not match data.tokenizer {path} (its sha256 "
            f"is {file_sha256(path)}): the file changed; put the file you meant back, or "
            "update data.tokenizer_sha256"
        )


def check_fits(tok: ByteLevelBPE, vocab: int, spec: str) -> None:
    """A tokenizer's ids fit data.vocab_size (the model's vocabulary)."""
    if tok.vocab_size > vocab:
        raise DataError(
            f"data.vocab_size {vocab}: data.tokenizer {spec} has {tok.vocab_size:,} ids; "
            f"set data.vocab_size to at least {tok.vocab_size} (or leave it null)"
        )
