"""Dataset staging and loading: one compact, checksummed format shared by train and evaluate.

A staged directory holds, per split in (train, val, test), `{split}_images.npy` (uint8 NCHW)
and `{split}_labels.npy` (int64), plus `manifest.json` (format version, source, classes, shape,
split sizes and class counts, train mean/std in 0..1 units, seed, data config, and the sha256
and byte size of every file). Small enough to hold as tensors on the device, no DataLoader.

    manifest = stage_dataset(cfg["data"], "results/data", seed=0)
    images, labels, manifest = load_split("results/data", "train")

Staging is deterministic (same config and seed -> same bytes) and atomic: everything is written
to a temporary sibling directory, fsynced, then renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ddpflow.sources import DataError, RawSource, load_source

if TYPE_CHECKING:
    import torch

__all__ = ["DataError", "FORMAT_VERSION", "SPLITS", "load_split", "stage_dataset", "verify_staged"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SPLITS = ("train", "val", "test")
MANIFEST = "manifest.json"


def stage_dataset(data_cfg: dict, out_dir, seed: int) -> dict:
    """Stage data_cfg["source"] into out_dir (atomically) and return the manifest."""
    out_dir = Path(out_dir)
    raw = load_source(data_cfg, seed)
    splits = make_splits(raw, data_cfg, seed)
    manifest = _base_manifest(raw, splits, data_cfg, seed)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-", dir=out_dir.parent))
    try:
        manifest["files"] = _write_splits(tmp, splits)
        _write_json(tmp / MANIFEST, manifest)
        _fsync_dir(tmp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest  # pipeline.stage_data logs it, with the time taken


def make_splits(raw: RawSource, data_cfg: dict, seed: int) -> dict:
    """{split: (images, labels)}: seeded, stratified; test is official or carved from all data.

    Each step draws from its own seed stream, so e.g. changing max_train_samples does not
    reshuffle val or test.
    """
    x, y = raw.train_x, raw.train_y
    if raw.test_x is None:
        rest, test = stratified_split(y, round(data_cfg["test_fraction"] * len(y)), _rng(seed, 1))
        test_xy, (x, y) = (x[test], y[test]), (x[rest], y[rest])
    else:
        test_xy = (raw.test_x, raw.test_y)
    train, val = stratified_split(y, round(data_cfg["val_fraction"] * len(y)), _rng(seed, 2))
    cap = data_cfg.get("max_train_samples")
    if cap is not None and cap < len(train):
        _, keep = stratified_split(y[train], cap, _rng(seed, 3))
        train = train[keep]
    if len(train) == 0:
        raise DataError("data: the train split is empty; lower val_fraction/test_fraction")
    return {"train": (x[train], y[train]), "val": (x[val], y[val]), "test": test_xy}


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


def _base_manifest(raw: RawSource, splits: dict, data_cfg: dict, seed: int) -> dict:
    num_classes = len(raw.class_names)
    mean, std = channel_stats(splits["train"][0])
    return {
        "format_version": FORMAT_VERSION,
        "source": data_cfg["source"],
        "num_classes": num_classes,
        "class_names": raw.class_names,
        "shape": list(splits["train"][0].shape[1:]),
        "sizes": {name: len(y) for name, (_, y) in splits.items()},
        "class_counts": {
            name: np.bincount(y, minlength=num_classes).tolist() for name, (_, y) in splits.items()
        },
        "mean": mean,
        "std": std,
        "seed": seed,
        **(
            {
                "source_notes": {
                    "skipped_corrupt": len(raw.notes["skipped_corrupt"]),
                    "skipped_files": raw.notes["skipped_corrupt"][:100],
                    "ignored_files": raw.notes["ignored_files"],
                }
            }
            if raw.notes
            else {}
        ),
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


def _write_splits(directory: Path, splits: dict) -> dict:
    files = {}
    for name, (images, labels) in splits.items():
        for kind, array in (("images", images), ("labels", labels)):
            path = directory / f"{name}_{kind}.npy"
            with open(path, "wb") as f:
                np.save(f, np.ascontiguousarray(array), allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
            files[path.name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    return files


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
    if version != FORMAT_VERSION:
        raise DataError(
            f"{path}: format_version {version!r}, this ddpflow reads {FORMAT_VERSION}; "
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


def verify_staged(staged_dir) -> dict:
    """Re-hash every file of every split against the manifest; return the manifest."""
    staged_dir = Path(staged_dir)
    manifest = read_manifest(staged_dir)
    for split in SPLITS:
        for kind in ("images", "labels"):
            _check_file(staged_dir, manifest, f"{split}_{kind}.npy", verify=True)
    return manifest


def load_split(
    staged_dir, split: str, verify: bool = True
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(images uint8 [N, C, H, W], labels int64 [N], manifest) of one staged split.

    verify=False skips the sha256 (the byte sizes are still checked), for callers that
    verified once already, e.g. every rank after rank 0 checked.
    """
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    staged_dir = Path(staged_dir)
    manifest = read_manifest(staged_dir)
    arrays = []
    for kind in ("images", "labels"):
        path = _check_file(staged_dir, manifest, f"{split}_{kind}.npy", verify)
        try:
            arrays.append(np.load(path, allow_pickle=False))
        except (OSError, ValueError) as exc:
            raise DataError(
                f"{path} is unreadable ({exc}); delete {staged_dir} and restage"
            ) from exc
    images, labels = arrays
    _check_arrays(staged_dir, manifest, split, images, labels)
    import torch  # here, not at the top: the rules' processes read manifests without torch

    return torch.from_numpy(images), torch.from_numpy(labels), manifest


def _check_arrays(staged_dir, manifest, split, images, labels) -> None:
    # Sizes and checksums can match a manifest that itself was hand-edited: check content too.
    n = manifest["sizes"][split]
    expected = ((n, *manifest["shape"]), np.uint8, (n,), np.int64)
    if (images.shape, images.dtype, labels.shape, labels.dtype) != expected:
        raise DataError(
            f"{staged_dir}: {split} arrays are {images.dtype}{list(images.shape)} / "
            f"{labels.dtype}{list(labels.shape)}, the manifest says uint8"
            f"{[n, *manifest['shape']]} / int64[{n}]; delete {staged_dir} and restage"
        )
