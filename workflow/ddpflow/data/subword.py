"""Staging a text corpus through a subword tokenizer (data.tokenizer: bpe, or the path of a
tokenizer.json; ddpflow.data.byte_level), into the staged ids ddpflow.data.text describes.

The corpus is the byte tokenizer's stream (the files in order, one end-of-document token
between two), cut into train, val and test at the same places, each moved to the start of
the next UTF-8 character: so every tokenizer scores the same text and bits per byte compares
them. bpe is trained on the train split's text only (val and test are never read for it),
then every split is encoded.

Streaming, never the corpus in memory: each file is read UNIT bytes at a time and handed to
the tokenizer in pieces of about UNIT bytes, cut where a line starts (after a newline,
before a printable ASCII character). A byte-level BPE's pre-tokenizer (GPT-2's pattern)
splits there anyway, so a document's pieces encode to the ids of the whole document; a line
longer than LONG_LINE bytes is cut at a character start (that one cut may encode otherwise).
Pieces are encoded in batches by tokenizers' thread pool, sized to the stage job's CPUs, and
each split's ids are appended to its .npy file as they come.
"""

from __future__ import annotations

import io
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ddpflow.data import byte_level
from ddpflow.errors import DataError

log = logging.getLogger(__name__)

UNIT = 1 << 16  # bytes read at a time, and the size a piece is cut at
LONG_LINE = 1 << 22  # a piece with no line start in this many bytes is cut at a character
BATCH_PER_THREAD = 1 << 20  # characters encoded per batch and thread
LINE_START = re.compile(rb"\n(?=[\x21-\x7e])")  # a cut after the newline encodes alike
HEADER = 128  # bytes of a 1-D .npy header (numpy pads it to 64; any length fits in 128)


class Segment(NamedTuple):
    """A run of the stream inside one split: `length` bytes of `path` from `offset`, or
    (path None) the end-of-document token."""

    split: int  # 0 train, 1 val, 2 test
    path: Path | None
    offset: int
    length: int


def segments(files: list[Path], val_fraction: float, test_fraction: float) -> list[Segment]:
    """The stream's segments in order: the byte tokenizer's split sizes (data.val_fraction,
    data.test_fraction of the stream), each cut moved to a character start."""
    sizes = [p.stat().st_size for p in files]
    total = sum(sizes) + len(files) - 1
    n_val, n_test = round(total * val_fraction), round(total * test_fraction)
    cuts = [_char_start(files, sizes, c) for c in (total - n_val - n_test, total - n_test)]
    bounds = [(0, cuts[0]), (cuts[0], cuts[1]), (cuts[1], total)]
    out, at = [], 0
    for index, (path, size) in enumerate(zip(files, sizes, strict=True)):
        if index:  # the end-of-document token, in the split its position falls in
            out.append(Segment(sum(at >= c for c in cuts), None, 0, 1))
            at += 1
        for split, (lo, hi) in enumerate(bounds):
            start, stop = max(at, lo), min(at + size, hi)
            if start < stop:
                out.append(Segment(split, path, start - at, stop - start))
        at += size
    return out


def _char_start(files: list[Path], sizes: list[int], cut: int) -> int:
    """cut, moved past UTF-8 continuation bytes (to the next character's start)."""
    at = 0
    for path, size in zip(files, sizes, strict=True):
        if at < cut < at + size:
            with open(path, "rb") as f:
                f.seek(cut - at)
                after = f.read(4)
            skip = next((i for i, b in enumerate(after) if b & 0xC0 != 0x80), len(after))
            return cut + skip
        at += size + 1
    return cut


def pieces(segment: Segment, spec: str) -> Iterator[str]:
    """A segment's text in pieces of about UNIT bytes, cut at line starts (module doc)."""
    assert segment.path is not None
    buf, at, left = b"", segment.offset, segment.length  # at: the file offset of buf[0]
    safe = 0  # the last line start found in buf (0: none)
    with open(segment.path, "rb") as f:
        f.seek(segment.offset)
        while left:
            block = f.read(min(UNIT, left))
            if not block:
                raise DataError(f"{segment.path} became shorter while it was staged; stage again")
            found = list(LINE_START.finditer(buf[-1:] + block))
            if found:
                safe = len(buf) - min(len(buf), 1) + found[-1].end()
            buf, left = buf + block, left - len(block)
            cut = safe if safe and len(buf) >= UNIT else _long_line(buf)
            if left and cut:
                yield _text(buf[:cut], segment.path, at, spec)
                buf, at, safe = buf[cut:], at + cut, 0
    if buf:
        yield _text(buf, segment.path, at, spec)


def _long_line(buf: bytes) -> int:
    """Where a piece without a line start is cut: at its last character's start once it
    reaches LONG_LINE bytes (0: keep reading)."""
    if len(buf) < LONG_LINE:
        return 0
    end = len(buf) - 1
    while end > 0 and buf[end] & 0xC0 == 0x80:
        end -= 1
    return end or len(buf)  # no character start at all: not UTF-8, as decoding will say


def _text(raw: bytes, path: Path, at: int, spec: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"data.tokenizer {spec}: {path} is not UTF-8 text (byte {at + exc.start:,}); a "
            "subword tokenizer reads UTF-8: convert the file (iconv -t UTF-8) or use "
            "data.tokenizer: bytes"
        ) from None


class SplitFiles:
    """Each split's ids appended to its .npy file as they come; the header is written last,
    when the count is known."""

    def __init__(self, out: Path, dtype: np.dtype):
        self.dtype, self.counts = dtype, [0, 0, 0]
        self.paths = [out / f"{split}.tokens.npy" for split in ("train", "val", "test")]
        for path in self.paths:
            path.write_bytes(b"\0" * HEADER)

    def write(self, split: int, ids) -> None:
        array = np.asarray(ids, dtype=self.dtype)
        with open(self.paths[split], "ab") as f:
            f.write(array.tobytes())
        self.counts[split] += len(array)

    def close(self) -> dict:
        for path, n in zip(self.paths, self.counts, strict=True):
            header = io.BytesIO()
            fields = {"descr": np.lib.format.dtype_to_descr(self.dtype), "shape": (n,)}
            np.lib.format.write_array_header_1_0(header, {**fields, "fortran_order": False})
            assert len(header.getvalue()) == HEADER, len(header.getvalue())
            with open(path, "r+b") as f:
                f.write(header.getvalue())
        return dict(zip(("train", "val", "test"), self.counts, strict=True))


def encode(tok, found: list[Segment], out: SplitFiles, threads: int, spec: str) -> None:
    """Every segment's ids into out, in stream order, in batches encoded in parallel."""
    batch: list[tuple[int, str | None]] = []
    size, limit = 0, BATCH_PER_THREAD * threads
    for segment in found:
        texts = [None] if segment.path is None else pieces(segment, spec)
        for text in texts:
            batch.append((segment.split, text))
            size += len(text) if text else 1
            if size >= limit:
                _encode_batch(tok, batch, out)
                batch, size = [], 0
    _encode_batch(tok, batch, out)


def _encode_batch(tok, batch: list[tuple[int, str | None]], out: SplitFiles) -> None:
    encoded = iter(tok.encode_batch([text for _, text in batch if text is not None]))
    for split, text in batch:
        out.write(split, [tok.eod] if text is None else next(encoded))


def stage_subword(data_cfg: dict, files: list[Path], out: Path, threads: int):
    """Stage the corpus `files` into out with data_cfg's tokenizer: (token counts per
    split, the vocabulary, the manifest's "tokenizer" entry); tokenizer.json written in out."""
    spec = str(data_cfg["tokenizer"])
    # tokenizers' thread pool reads its size once, when it is first used
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, threads)))
    found = segments(files, data_cfg["val_fraction"], data_cfg["test_fraction"])
    if byte_level.kind(spec) == byte_level.BPE:
        vocab = int(data_cfg["vocab_size"])
        train = (text for s in found if s.split == 0 and s.path for text in pieces(s, spec))
        (out / byte_level.FILE).write_text(byte_level.train_bpe(train, vocab), encoding="utf-8")
    else:
        source = Path(spec).expanduser()
        byte_level.check_pinned(source, data_cfg.get("tokenizer_sha256"))
        (out / byte_level.FILE).write_bytes(source.read_bytes())
    tok = byte_level.ByteLevelBPE.from_file(out / byte_level.FILE, what=f"data.tokenizer {spec}")
    vocab = int(data_cfg.get("vocab_size") or tok.vocab_size)
    byte_level.check_fits(tok, vocab, spec)
    if tok.eod is None and len(files) > 1:
        raise DataError(
            f"data.tokenizer {spec}: no end-of-document token among its special tokens "
            f"({', '.join(byte_level.EOD_NAMES)}) to put between the {len(files)} files of "
            "data.path; add one to the tokenizer, or give data.path one file"
        )
    written = SplitFiles(out, byte_level.token_dtype(vocab))
    try:
        encode(tok, found, written, max(1, threads), spec)
    finally:
        counts = written.close()
    return counts, vocab, _entry(spec, out / byte_level.FILE, tok)


def _entry(spec: str, path: Path, tok) -> dict:
    import tokenizers

    entry = {
        "kind": byte_level.kind(spec),
        "file": byte_level.FILE,
        "sha256": byte_level.file_sha256(path),
        "vocab": tok.vocab_size,
        "eod": tok.eod,
        "tokenizers": tokenizers.__version__,
    }
    return entry if entry["kind"] == byte_level.BPE else {**entry, "from": spec}
