"""Dataset staging and loading: one sharded, checksummed format shared by train and evaluate.

A staged directory holds, per split in (train, val, test), its images in fixed-size shards
`{split}_images-NNNNN.npy` (uint8 NCHW, as many images as fit in 64 MiB) and its labels in
`{split}_labels.npy` (int64), plus `manifest.json` (format version, source, classes, shape,
split sizes and class counts, the shards of each split, train mean/std in 0..1 units, seed,
data config, and the sha256 and byte size of every file).

    manifest = stage_dataset(cfg["data"], "results/staged/x", seed=0, threads=4)
    images, labels, manifest = load_split("results/staged/x", "train")     # in memory
    images, labels, manifest = open_split("results/staged/x", "train")     # read on demand

Staging streams (a shard at a time: memory stays bounded whatever the dataset's size), is
deterministic (same config and seed -> same bytes, whatever the thread count) and atomic:
everything is written to a temporary sibling directory, fsynced, then renamed into place.
Verification hashes one file at a time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ddpflow.data.own import manifest_notes
from ddpflow.data.raw import DataError, RawSource
from ddpflow.data.sources import load_source

if TYPE_CHECKING:
    import torch

__all__ = ["DataError", "FORMAT_VERSION", "SPLITS", "StagedImages", "load_split", "open_split",
           "stage_dataset", "verify_staged"]  # fmt: skip

log = logging.getLogger(__name__)

# 2: images in fixed-size shards (format 1, one images file per split, is still read)
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
SHARD_BYTES = 64 << 20  # images per shard: as many as fit in 64 MiB
LEVELS = np.arange(256, dtype=np.int64)
SPLITS = ("train", "val", "test")
MANIFEST = "manifest.json"


def stage_dataset(
    data_cfg: dict, out_dir, seed: int, threads: int = 1, shard_bytes: int = SHARD_BYTES
) -> dict:
    """Stage data_cfg["source"] into out_dir (atomically) and return the manifest.

    Streaming: images go to fixed-size shards as they are read (an image folder is decoded a
    shard at a time, by `threads` threads), so memory stays bounded by a few shards whatever
    the dataset's size."""
    out_dir = Path(out_dir)
    raw = load_source(data_cfg, seed)
    plan = split_indices(raw, data_cfg, seed)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-", dir=out_dir.parent))
    try:
        written = _write_splits(tmp, raw, plan, threads, shard_bytes)
        finish = getattr(raw.train_x, "finish", None)
        if finish is not None:  # an image folder: what it could only tell after reading
            finish()
        _refuse_emptied(plan, written)
        manifest = _base_manifest(raw, written, data_cfg, seed)
        _write_json(tmp / MANIFEST, manifest)
        _fsync_dir(tmp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest  # pipeline.stage_data logs it, with the time taken


def _refuse_emptied(plan: dict, written: dict) -> None:
    """A split whose every image was skipped (too small, or corrupt) would fail later, in a
    training job, with a less helpful message."""
    for split, (_, indices) in plan.items():
        if len(indices) and not len(written["labels"][split]):
            raise DataError(
                f"data: all {len(indices)} images of the {split} split were skipped (data."
                "on_small: skip or data.on_corrupt: skip; named in the lines above); lower "
                "data.image_size or set data.on_small: upscale"
            )


def split_indices(raw: RawSource, data_cfg: dict, seed: int) -> dict:
    """{split: (pool, indices)}: which samples of raw's train or test pool each split holds;
    seeded, stratified; test is official or carved from all data.

    Each step draws from its own seed stream, so e.g. changing max_train_samples does not
    reshuffle val or test. Only labels are read: an image folder is not decoded here.
    """
    y = raw.train_y
    base = np.arange(len(y))
    if raw.test_x is None:
        rest, test = stratified_split(y, round(data_cfg["test_fraction"] * len(y)), _rng(seed, 1))
        test_plan = ("train", test)
        base, y = rest, y[rest]
    else:
        test_plan = ("test", np.arange(len(raw.test_y)))
    train, val = stratified_split(y, round(data_cfg["val_fraction"] * len(y)), _rng(seed, 2))
    cap = data_cfg.get("max_train_samples")
    if cap is not None and cap < len(train):
        _, keep = stratified_split(y[train], cap, _rng(seed, 3))
        train = train[keep]
    if len(train) == 0:
        raise DataError("data: the train split is empty; lower val_fraction/test_fraction")
    return {"train": ("train", base[train]), "val": ("train", base[val]), "test": test_plan}


def make_splits(raw: RawSource, data_cfg: dict, seed: int) -> dict:
    """{split: (images, labels)} in memory (sources held as arrays): see split_indices."""
    pools = {"train": (raw.train_x, raw.train_y), "test": (raw.test_x, raw.test_y)}
    return {
        split: (pools[pool][0][idx], pools[pool][1][idx])
        for split, (pool, idx) in split_indices(raw, data_cfg, seed).items()
    }


def stratified_split(labels: np.ndarray, n_take: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(keep, take) sorted index arrays; take has n_take items, in proportion to each class.

    Every class gets floor or ceil of its share (largest remainders get the ceil), like
    scikit-learn's StratifiedShuffleSplit, but without its >= 2-per-class requirement.
    """
    classes, counts = np.unique(labels, return_counts=True)
    quota = counts * (n_take / max(len(labels), 1))
    per_class = np.floor(quota).astype(np.int64)
    leftover = n_take - int(per_class.sum())
    per_class[np.argsort(-(quota - per_class), kind="stable")[:leftover]] += 1
    pairs = zip(classes, per_class, strict=True)
    take = [rng.permutation(np.flatnonzero(labels == c))[:k] for c, k in pairs]
    take = np.sort(np.concatenate(take)) if take else np.zeros(0, np.int64)
    keep = np.setdiff1d(np.arange(len(labels)), take)
    return keep, take


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def _base_manifest(raw: RawSource, written: dict, data_cfg: dict, seed: int) -> dict:
    num_classes = len(raw.class_names)
    total, squares, count = written["train_sums"]
    mean = total / max(count, 1)
    std = np.sqrt(np.maximum(squares / max(count, 1) - mean * mean, 0.0))
    labels = written["labels"]
    return {
        "format_version": FORMAT_VERSION,
        "source": data_cfg["source"],
        "num_classes": num_classes,
        "class_names": raw.class_names,
        "shape": list(written["shape"]),
        "sizes": {name: len(y) for name, y in labels.items()},
        "class_counts": {
            name: np.bincount(y, minlength=num_classes).tolist() for name, y in labels.items()
        },
        "mean": (mean / 255.0).tolist(),
        "std": (std / 255.0).tolist(),
        "seed": seed,
        "shards": written["shards"],
        "files": written["files"],
        **({"source_notes": manifest_notes(raw.notes)} if raw.notes else {}),
        "data_cfg": data_cfg,
    }


def channel_stats(images: np.ndarray, chunk: int = 4096) -> tuple[list[float], list[float]]:
    """Per-channel mean and std (population) in 0..1 units, from exact integer sums.

    Chunked so that CIFAR-sized uint8 arrays are never copied whole into float64.
    """
    total = np.zeros(images.shape[1], np.int64)
    squares = np.zeros(images.shape[1], np.int64)
    for start in range(0, len(images), chunk):
        part = images[start : start + chunk].astype(np.int64)
        total += part.sum(axis=(0, 2, 3))
        squares += (part * part).sum(axis=(0, 2, 3))
    count = len(images) * images.shape[2] * images.shape[3]
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean * mean, 0.0))
    return (mean / 255.0).tolist(), (std / 255.0).tolist()


def _write_splits(directory: Path, raw: RawSource, plan: dict, threads: int, shard_bytes: int):
    """Write every split's images as fixed-size shards and its labels as one file, a shard at
    a time; return what the manifest records (shards, files, labels, train pixel sums)."""
    pools = {"train": (raw.train_x, raw.train_y), "test": (raw.test_x, raw.test_y)}
    shape = tuple(int(d) for d in raw.train_x.shape[1:])
    per_shard = max(1, shard_bytes // int(np.prod(shape)))
    written = {"shape": shape, "shards": {}, "files": {}, "labels": {}}
    sums = [np.zeros(shape[0], np.int64), np.zeros(shape[0], np.int64), 0]
    # processes, not threads: most of decoding an image is Python holding the GIL (with 2
    # threads staging was slower than with 1; bench/data.py)
    pool = ProcessPoolExecutor(threads, mp_context=_fork()) if threads > 1 else None
    try:
        for split, (source, indices) in plan.items():
            images, labels = pools[source]
            shards, kept = [], []
            for number, start in enumerate(range(0, max(len(indices), 1), per_shard)):
                chunk = indices[start : start + per_shard]
                if isinstance(images, np.ndarray):
                    x, keep = images[chunk], None
                else:  # read (decoded) now: an image folder
                    x, keep = images.read(chunk, pool, split)
                kept.append(labels[chunk] if keep is None else labels[chunk][keep])
                if split == "train":  # exact integer sums from a histogram per channel
                    for channel in range(shape[0]):
                        counts = np.bincount(x[:, channel].ravel(), minlength=256)
                        sums[0][channel] += int(counts @ LEVELS)
                        sums[1][channel] += int(counts @ (LEVELS * LEVELS))
                    sums[2] += x.shape[0] * shape[1] * shape[2]
                name = f"{split}_images-{number:05d}.npy"
                written["files"][name] = _save(directory / name, x)
                shards.append({"file": name, "count": int(x.shape[0])})
            written["shards"][split] = shards
            y = np.concatenate(kept).astype(np.int64) if kept else np.zeros(0, np.int64)
            written["labels"][split] = y
            written["files"][f"{split}_labels.npy"] = _save(directory / f"{split}_labels.npy", y)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    written["train_sums"] = tuple(sums)
    return written


def _fork():
    # fork: the workers inherit the source (file list, config) instead of importing it anew
    return multiprocessing.get_context("fork")


def _save(path: Path, array: np.ndarray) -> dict:
    with open(path, "wb") as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def _write_json(path: Path, obj: dict) -> None:
    # default=str: data_cfg may carry Path objects; sort_keys keeps the bytes deterministic.
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(new: Path, target: Path) -> None:
    """Rename the complete `new` over `target`, keeping the old copy until the swap is done.

    rename(2) cannot replace a non-empty directory, so the old one is first renamed aside. A
    crash between the two renames leaves target absent but both copies on disk as siblings.
    """
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, old / target.name)
    try:
        os.replace(new, target)
    except BaseException:
        if old is not None:
            os.replace(old / target.name, target)
            old.rmdir()
        raise
    _fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(staged_dir) -> dict:
    """The manifest of a staged directory, with clear errors for every way it can be wrong."""
    staged_dir = Path(staged_dir)
    path = staged_dir / MANIFEST
    if not staged_dir.is_dir():
        raise DataError(f"staged dataset {staged_dir} does not exist; run the stage rule first")
    if not path.is_file():
        raise DataError(f"{path} is missing: {staged_dir} is not a staged dataset; restage it")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{path} is unreadable ({exc}); delete {staged_dir} and restage") from exc
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version not in READABLE_VERSIONS:
        raise DataError(
            f"{path}: format_version {version!r}, this ddpflow reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}; "
            f"delete {staged_dir} and restage"
        )
    return manifest


def _check_file(staged_dir: Path, manifest: dict, name: str, verify: bool) -> Path:
    path = staged_dir / name
    entry = manifest.get("files", {}).get(name)
    if entry is None:
        raise DataError(f"{staged_dir / MANIFEST} does not list {name}; restage {staged_dir}")
    if not path.is_file():
        raise DataError(f"{path} is missing; delete {staged_dir} and restage")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise DataError(
            f"{path} has {size} bytes, the manifest says {entry['bytes']} (truncated or "
            f"overwritten); delete {staged_dir} and restage"
        )
    if verify and sha256_file(path) != entry["sha256"]:
        raise DataError(f"{path}: sha256 mismatch (corrupt); delete {staged_dir} and restage")
    return path


def budget_bytes(run: dict) -> int:
    """Per rank: data.loading.memory_budget_gb, or half the node's memory over its ranks."""
    from ddpflow.config import ranks_per_node  # here: config imports nothing of data

    budget = run["data"]["loading"]["memory_budget_gb"]
    if budget == "auto":
        machine = run["machine"]
        return int(machine["mem_gb"] * 2**30 / 2 / ranks_per_node(machine))
    return int(budget * 2**30)


def choose_in_memory(run: dict, nbytes: int) -> tuple[bool, str]:
    """(in memory?, why) for splits of nbytes images."""
    wanted = run["data"]["loading"]["in_memory"]
    size = _binary_size(nbytes)
    if wanted is True:
        return True, f"{size}, data.loading.in_memory: true"
    if wanted is False:
        return False, f"{size}, data.loading.in_memory: false"
    budget = budget_bytes(run)
    fits = nbytes <= budget
    relation = "fits" if fits else "exceeds"
    return fits, f"{size} {relation} the budget of {_binary_size(budget)} per rank"


def _binary_size(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


def shard_files(manifest: dict, split: str) -> list[tuple[str, int]]:
    """(file name, images) of each shard of a split, in order."""
    if "shards" in manifest:
        return [(shard["file"], shard["count"]) for shard in manifest["shards"][split]]
    return [(f"{split}_images.npy", manifest["sizes"][split])]  # format 1: one file


def verify_staged(staged_dir) -> dict:
    """Re-hash every file of every split against the manifest, one file at a time (a large
    dataset is never read into memory whole); return the manifest."""
    staged_dir = Path(staged_dir)
    manifest = read_manifest(staged_dir)
    for split in SPLITS:
        open_split(staged_dir, split, verify=True, manifest=manifest)
    return manifest


class StagedImages:
    """A staged split's images, read from its shards on demand (uint8 [N, C, H, W]).

    Reads are positional (pread) into fresh arrays: nothing is memory-mapped, so a rank's
    resident memory holds the batches it asked for, not the pages of every shard it touched
    (mapped pages count as the process's own). The descriptors survive a fork (DataLoader
    workers) and positional reads share no file offset."""

    def __init__(self, paths: list[tuple[Path, int, int]], shape: tuple[int, ...]):
        self.paths = paths  # (file, first data byte, images) per shard
        self.sample_shape = tuple(shape)
        self.sample_bytes = int(np.prod(shape))
        counts = [count for _, _, count in paths]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._fds: list[int] | None = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self.sample_shape)

    @property
    def nbytes(self) -> int:
        return len(self) * self.sample_bytes

    def _descriptors(self) -> list[int]:
        if self._fds is None:
            self._fds = [os.open(path, os.O_RDONLY) for path, _, _ in self.paths]
        return self._fds

    def close(self) -> None:
        for fd in self._fds or ():
            os.close(fd)
        self._fds = None

    def __getstate__(self):  # pickled to a spawned worker: it opens its own descriptors
        return {**self.__dict__, "_fds": None}

    def _pread(self, shard: int, first: int, out: np.ndarray) -> None:
        view = memoryview(out).cast("B")
        offset = self.paths[shard][1] + first * self.sample_bytes
        done = 0
        while done < len(view):  # pread may return less than asked
            got = os.preadv(self._descriptors()[shard], [view[done:]], offset + done)
            if got <= 0:
                raise DataError(f"{self.paths[shard][0]}: unexpected end of file; restage it")
            done += got

    def read(self, start: int, stop: int) -> np.ndarray:
        """Images start..stop-1 (contiguous), one read per shard they span."""
        stop = min(stop, len(self))
        out = np.empty((max(stop - start, 0), *self.sample_shape), np.uint8)
        position = start
        while position < stop:
            shard = int(np.searchsorted(self.starts, position, side="right")) - 1
            end = min(stop, int(self.starts[shard + 1]))
            first = position - int(self.starts[shard])
            self._pread(shard, first, out[position - start : end - start])
            position = end
        return out

    def gather(self, indices) -> np.ndarray:
        """Images at `indices`, in that order (a training batch)."""
        indices = np.asarray(indices, dtype=np.int64)
        out = np.empty((len(indices), *self.sample_shape), np.uint8)
        shards = np.searchsorted(self.starts, indices, side="right") - 1
        for row, (index, shard) in enumerate(zip(indices.tolist(), shards.tolist(), strict=True)):
            self._pread(shard, index - int(self.starts[shard]), out[row : row + 1])
        return out

    def load(self) -> np.ndarray:
        """The whole split in one array (read shard by shard into it: no second copy)."""
        return self.read(0, len(self))


def open_split(
    staged_dir, split: str, verify: bool = True, manifest: dict | None = None
) -> tuple[StagedImages, np.ndarray, dict]:
    """(images read on demand, labels int64 [N], manifest) of one staged split; each shard's
    size, .npy header (shape, dtype) and, with verify, sha256 checked against the manifest."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    staged_dir = Path(staged_dir)
    manifest = manifest or read_manifest(staged_dir)
    shape = tuple(manifest["shape"])
    shards = []
    for name, count in shard_files(manifest, split):
        path = _check_file(staged_dir, manifest, name, verify)
        shards.append((path, _data_offset(staged_dir, path, (count, *shape), np.uint8), count))
    path = _check_file(staged_dir, manifest, f"{split}_labels.npy", verify)
    try:
        labels = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"{path} is unreadable ({exc}); delete {staged_dir} and restage") from exc
    images = StagedImages(shards, shape)
    n = manifest["sizes"][split]
    if len(images) != n or labels.shape != (n,) or labels.dtype != np.int64:
        raise DataError(
            f"{staged_dir}: the {split} split holds {len(images)} images and "
            f"{labels.dtype}{list(labels.shape)} labels, the manifest says {n} and "
            f"int64[{n}]; delete {staged_dir} and restage"
        )
    return images, labels, manifest


def _data_offset(staged_dir: Path, path: Path, shape: tuple, dtype) -> int:
    """Where a .npy file's array starts, after checking its header against the manifest
    (sizes and checksums can match a manifest that itself was hand-edited)."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = getattr(np.lib.format, f"read_array_header_{version[0]}_0")
            found, fortran, found_dtype = read_header(f)
            offset = f.tell()
    except (OSError, ValueError) as exc:
        raise DataError(f"{path} is unreadable ({exc}); delete {staged_dir} and restage") from exc
    if tuple(found) != tuple(shape) or found_dtype != np.dtype(dtype) or fortran:
        raise DataError(
            f"{path} holds {found_dtype}{list(found)}, the manifest says "
            f"{np.dtype(dtype)}{list(shape)}; delete {staged_dir} and restage"
        )
    return offset


def load_split(
    staged_dir, split: str, verify: bool = True
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(images uint8 [N, C, H, W], labels int64 [N], manifest) of one staged split, in memory.

    verify=False skips the sha256 (the byte sizes are still checked), for callers that
    verified once already, e.g. every rank after rank 0 checked.
    """
    images, labels, manifest = open_split(staged_dir, split, verify)
    try:
        array = images.load()
    finally:
        images.close()
    import torch  # here, not at the top: the rules' processes read manifests without torch

    return torch.from_numpy(array), torch.from_numpy(labels), manifest
