"""Token data for task: language_model: staging a text corpus or a tokenizer's token files
into the staged format, and reading a split's tokens back as blocks by memory map.

    data: {source: text, path: corpus/}          # bytes: 256 tokens + end-of-document (256)
    data: {source: tokens, path: tok/, vocab_size: 50257}   # train.bin, val.bin[, test.bin]

A staged token dataset holds `<split>.tokens.npy` (uint16, or uint32 for a vocabulary over
65536) for train, val and test, and `manifest.json` (kind "tokens": the token count of each
split, the vocabulary, the block size, the source files, the sha256 and size of every file).

text: every file under data.path (recursively, in sorted order of the relative path; hidden
files and folders skipped) read as bytes, one end-of-document token between two files, the
stream cut into contiguous chunks: train, then val (data.val_fraction), then test
(data.test_fraction); data.tokenizer bpe or a tokenizer.json: the same stream and cuts
through that tokenizer (ddpflow.data.subword), its tokenizer.json staged with the ids (the
manifest's "tokenizer": kind, file, sha256, end-of-document id). tokens:
train.bin/val.bin/test.bin (uint16, nanoGPT's prepare scripts) or .npy (uint16/uint32, 1-D)
as they are; without a test file, test is the last data.test_fraction of train.

Samples: a split's windows of block_size + 1 tokens, read by memory map (never loaded
whole): ddpflow.data.windows.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ddpflow.data import byte_level
from ddpflow.data.raw import DataError
from ddpflow.data.staged import FORMAT_VERSION, MANIFEST, SPLITS, check_file
from ddpflow.data.subword import stage_subword
from ddpflow.data.windows import scored_blocks, train_blocks
from ddpflow.runtime import atomic_write_json, fsync_dir, replace_dir, sha256_file
from ddpflow.task.lm import LanguageModel
from ddpflow.words import counted

log = logging.getLogger(__name__)

EOD = 256  # text: the end-of-document token between two files
TEXT_VOCAB = 257
CHUNK = 1 << 22  # tokens copied and checked at a time (memory stays bounded)


def stage_tokens(data_cfg: dict, out_dir, seed: int, threads: int = 1) -> dict:
    """Stage data_cfg (source text or tokens) into out_dir, atomically; the manifest.
    threads: the CPUs a subword tokenizer encodes on (ddpflow.data.subword)."""
    from ddpflow.config.fingerprint import LATER_DATA_DEFAULTS

    # the stage rule's params leave a key at its default out (config.fingerprint)
    data_cfg = {**LATER_DATA_DEFAULTS, **data_cfg}
    out_dir, source = Path(out_dir), data_cfg["source"]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-", dir=out_dir.parent))
    try:
        made: dict = {"kind": byte_level.BYTES} if source == "text" else {}
        if source == "text" and data_cfg["tokenizer"] != byte_level.BYTES:
            corpus = text_files(Path(data_cfg["path"]))
            counts, vocab, made = stage_subword(data_cfg, corpus, tmp, threads)
            sources = _text_listing(data_cfg)
        elif source == "text":
            counts, sources, vocab = _stage_text(data_cfg, tmp), _text_listing(data_cfg), TEXT_VOCAB
        else:
            vocab = int(data_cfg["vocab_size"])
            counts, sources = _stage_token_files(data_cfg, tmp, vocab)
        _check_block_size(counts, int(data_cfg["block_size"]))
        names = [f"{split}.tokens.npy" for split in SPLITS]
        if "file" in made:  # the tokenizer.json the ids were encoded with
            names.append(made["file"])
        files = {}
        for name in names:
            files[name] = {"sha256": sha256_file(tmp / name), "bytes": (tmp / name).stat().st_size}
        manifest = _manifest(data_cfg, seed, counts, vocab, sources, files)
        if made:  # text: the tokenizer that wrote the ids (ddpflow.data.tokenizer)
            manifest["tokenizer"] = made
        atomic_write_json(tmp / MANIFEST, manifest)  # fsynced with the directory below
        fsync_dir(tmp)
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _manifest(data_cfg, seed, counts, vocab, sources, files) -> dict:
    block = int(data_cfg["block_size"])
    return {
        "format_version": FORMAT_VERSION,
        "kind": "tokens",
        "task": LanguageModel.name,  # the task that reads token data
        "source": data_cfg["source"],
        "vocab_size": vocab,
        "num_classes": vocab,  # the model's output width
        "class_names": [],
        "block_size": block,
        "shape": [block],  # a model's input: block_size token ids
        "dtype": _dtype(vocab).name,
        "tokens": counts,
        # samples per split: training blocks, and the blocks that score every position
        "sizes": {
            s: train_blocks(n, block) if s == "train" else scored_blocks(n, block)
            for s, n in counts.items()
        },
        "source_files": sources,
        "seed": seed,
        "files": files,
        "data_cfg": data_cfg,
    }


def describe_tokens(manifest: dict) -> str:
    """The staged tokens in words, for the terminal."""
    counts = ", ".join(f"{split} {n:,}" for split, n in manifest["tokens"].items())
    return (
        f"{counts} tokens, vocabulary {manifest['vocab_size']:,}, block_size "
        f"{manifest['block_size']}"
    )


_dtype = byte_level.token_dtype


def _check_block_size(counts: dict, block: int) -> None:
    for split, n in counts.items():
        if n < block + 1:
            raise DataError(
                f"data.block_size {block}: the {split} split has {n:,} tokens, fewer than one "
                f"block of block_size + 1 = {block + 1}; lower data.block_size, give more "
                "text, or raise data.val_fraction/data.test_fraction"
            )


def text_files(path: Path) -> list[Path]:
    """data.path's files (itself if a file), sorted by relative path; hidden ones skipped."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(
            f"data.path {path}: no such file or folder; give a text file or a folder of text files"
        )
    found = []
    for folder, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(folder, n) for n in names if not n.startswith(".")]
    found.sort(key=lambda p: p.relative_to(path).as_posix())
    if not found:
        raise DataError(f"data.path {path}: the folder holds no file; put text files in it")
    empty = [p for p in found if p.stat().st_size == 0]
    if empty:
        raise DataError(
            f"data.path {path}: {counted(len(empty), 'empty file')}, e.g. {empty[0]}; an "
            "empty document teaches nothing: remove it"
        )
    return found


def _text_listing(data_cfg: dict) -> list[dict]:
    root = Path(data_cfg["path"])
    return [
        {
            "file": p.relative_to(root).as_posix() if root.is_dir() else p.name,
            "bytes": p.stat().st_size,
        }
        for p in text_files(root)
    ]


def _stage_text(data_cfg: dict, out: Path) -> dict:
    files = text_files(Path(data_cfg["path"]))
    total = sum(p.stat().st_size for p in files) + len(files) - 1
    n_val = round(total * data_cfg["val_fraction"])
    n_test = round(total * data_cfg["test_fraction"])
    counts = {"train": total - n_val - n_test, "val": n_val, "test": n_test}
    writer = _SplitWriter(out, counts, np.dtype(np.uint16))
    for index, path in enumerate(files):
        if index:
            writer.write(np.array([EOD], dtype=np.uint16))
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                writer.write(np.frombuffer(chunk, dtype=np.uint8).astype(np.uint16))
    writer.close()
    return counts


class _SplitWriter:
    """One stream of tokens written into the splits' files in order (train, val, test)."""

    def __init__(self, out: Path, counts: dict, dtype: np.dtype):
        self.arrays = [
            (np.lib.format.open_memmap(out / f"{s}.tokens.npy", "w+", dtype, (n,)), n)
            for s, n in counts.items()
        ]
        self.split, self.at = 0, 0

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            array, n = self.arrays[self.split]
            take = min(n - self.at, len(tokens))
            array[self.at : self.at + take] = tokens[:take]
            tokens, self.at = tokens[take:], self.at + take
            if self.at == n and self.split < len(self.arrays) - 1:
                self.split, self.at = self.split + 1, 0

    def close(self) -> None:
        for array, _ in self.arrays:
            array.flush()
            del array
        self.arrays = []


def token_file(folder: Path, split: str) -> Path | None:
    for suffix in (".bin", ".npy"):
        if (folder / f"{split}{suffix}").is_file():
            return folder / f"{split}{suffix}"
    return None


def open_token_file(path: Path) -> np.ndarray:
    """A token file by memory map: .bin uint16 (nanoGPT's), .npy uint16/uint32 1-D."""
    if path.suffix == ".bin":
        if path.stat().st_size % 2:
            raise DataError(
                f"{path}: {path.stat().st_size} bytes, not a whole number of uint16 "
                "tokens; .bin files hold uint16 (write uint32 ids as .npy)"
            )
        return np.memmap(path, dtype=np.uint16, mode="r")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"{path} is not a readable .npy file ({exc})") from exc
    if array.ndim != 1 or array.dtype not in (np.uint16, np.uint32):
        raise DataError(
            f"{path} holds {array.dtype}{list(array.shape)}; a token file is 1-D uint16 or uint32"
        )
    return array


def _stage_token_files(data_cfg: dict, out: Path, vocab: int) -> tuple[dict, list[dict]]:
    folder = Path(data_cfg["path"])
    if not folder.is_dir():
        raise DataError(
            f"data.path {folder}: not a folder; data.source tokens reads "
            "train.bin and val.bin (or .npy) from a folder"
        )
    found = {s: token_file(folder, s) for s in SPLITS}
    for split in ("train", "val"):
        if found[split] is None:
            raise DataError(
                f"data.path {folder}: no {split}.bin or {split}.npy; data.source "
                "tokens needs train and val token files"
            )
    arrays = {s: open_token_file(p) for s, p in found.items() if p is not None}
    for split, array in arrays.items():
        if len(array) == 0:
            raise DataError(f"{found[split]} holds no token; give the split its tokens")
        _check_ids(array, vocab, found[split])
    if "test" not in arrays:  # carved from the end of train
        n_test = round(len(arrays["train"]) * data_cfg["test_fraction"])
        arrays["test"] = arrays["train"][len(arrays["train"]) - n_test :]
        arrays["train"] = arrays["train"][: len(arrays["train"]) - n_test]
    dtype, counts = _dtype(vocab), {}
    for split in SPLITS:
        array = arrays[split]
        counts[split] = len(array)
        staged = np.lib.format.open_memmap(out / f"{split}.tokens.npy", "w+", dtype, (len(array),))
        for start in range(0, len(array), CHUNK):
            staged[start : start + CHUNK] = array[start : start + CHUNK]
        staged.flush()
        del staged
    sources = [
        {"file": p.name, "split": s, "bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for s, p in found.items()
        if p is not None
    ]
    return counts, sources


def _check_ids(array: np.ndarray, vocab: int, path) -> None:
    for start in range(0, len(array), CHUNK):
        chunk = array[start : start + CHUNK]
        bad = np.flatnonzero(chunk >= vocab)
        if len(bad):
            at = start + int(bad[0])
            raise DataError(
                f"{path}: token id {int(chunk[bad[0]])} at position {at:,} is not below "
                f"data.vocab_size {vocab}; set data.vocab_size to your tokenizer's vocabulary "
                "size, or fix the file"
            )


def open_tokens(staged_dir, split: str, manifest: dict, verify: bool) -> np.ndarray:
    """A staged split's tokens by memory map (uint16/uint32 [n]), checked first."""
    path = check_file(Path(staged_dir), manifest, f"{split}.tokens.npy", verify)
    tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    n = manifest["tokens"][split]
    if tokens.shape != (n,) or tokens.dtype != np.dtype(manifest["dtype"]):
        raise DataError(
            f"{path} holds {tokens.dtype}{list(tokens.shape)}, the manifest says "
            f"{manifest['dtype']}[{n}]; delete {staged_dir} and restage"
        )
    return tokens
