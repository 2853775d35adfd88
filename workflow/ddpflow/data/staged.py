"""The staged format, and reading it: one sharded, checksummed format shared by train and
evaluate (ddpflow.data.staging writes it).

A staged directory holds, per split in (train, val, test), its images in fixed-size shards
`{split}_images-NNNNN.npy` (uint8 NCHW, as many images as fit in 64 MiB) and its labels in
`{split}_labels.npy` (int64), plus `manifest.json` (format version, source, classes, shape,
split sizes and class counts, the shards of each split, train mean/std in 0..1 units, seed,
data config, and the sha256 and byte size of every file).

    images, labels, manifest = load_split("results/staged/x", "train")     # in memory
    images, labels, manifest = open_split("results/staged/x", "train")     # read on demand

Verification hashes one file at a time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ddpflow.data.raw import DataError
from ddpflow.runtime import sha256_file
from ddpflow.task import manifest_task

if TYPE_CHECKING:
    import torch

    from ddpflow.config.typed import RunView

__all__ = ["DataError", "FORMAT_VERSION", "SPLITS", "StagedImages", "choose_in_memory",
           "load_split", "open_split", "read_manifest", "verify_staged"]  # fmt: skip

# 2: images in fixed-size shards (format 1, one images file per split, is still read)
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
SPLITS = ("train", "val", "test")
MANIFEST = "manifest.json"


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


def check_file(staged_dir: Path, manifest: dict, name: str, verify: bool) -> Path:
    """The staged file `name`, checked against the manifest's size (and sha256 if verify): a
    DataError names the file and the fix (restage)."""
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


def budget_bytes(run: RunView) -> int:
    """Per rank: data.loading.memory_budget_gb, or half the node's memory over its ranks."""
    from ddpflow.config import ranks_per_node  # here: config imports nothing of data

    budget = run["data"]["loading"]["memory_budget_gb"]
    if budget == "auto":
        machine = run["machine"]
        return int(machine["mem_gb"] * 2**30 / 2 / ranks_per_node(machine))
    return int(budget * 2**30)


def choose_in_memory(run: RunView, nbytes: int) -> tuple[bool, str]:
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
    if manifest.get("kind") == "tokens":  # a language model's tokens (ddpflow.data.text)
        for name in manifest["files"]:
            check_file(staged_dir, manifest, name, verify=True)
        return manifest
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
        view = out.data.cast("B")  # the array's buffer (memoryview(out)), as bytes
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
        path = check_file(staged_dir, manifest, name, verify)
        shards.append((path, _data_offset(staged_dir, path, (count, *shape), np.uint8), count))
    path = check_file(staged_dir, manifest, f"{split}_labels.npy", verify)
    try:
        labels = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"{path} is unreadable ({exc}); delete {staged_dir} and restage") from exc
    images = StagedImages(shards, shape)
    n = manifest["sizes"][split]
    dtype, shape = target_layout(manifest, n)
    if len(images) != n or labels.shape != shape or labels.dtype != dtype:
        raise DataError(
            f"{staged_dir}: the {split} split holds {len(images)} images and "
            f"{labels.dtype}{list(labels.shape)} labels, the manifest says {n} and "
            f"{np.dtype(dtype)}{list(shape)}; delete {staged_dir} and restage"
        )
    return images, labels, manifest


def target_layout(manifest: dict, n: int) -> tuple[np.dtype, tuple[int, ...]]:
    """The dtype and shape of a split's staged targets, as the manifest's task says
    (Task.target_layout: int64 [n] for classification, every manifest without a task; a
    plug-in task's as its manifest records them, target_dtype and target_shape)."""
    return manifest_task(manifest).target_layout(manifest, n)


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
