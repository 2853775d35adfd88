"""Writing the staged format: a source split into train/val/test and written as checksummed
shards plus a manifest (ddpflow.data.staged describes the format and reads it back).

    manifest = stage_dataset(cfg["data"], "results/staged/x", seed=0, threads=4)

Staging streams (a shard at a time: memory stays bounded whatever the dataset's size), is
deterministic (same config and seed -> same bytes, whatever the thread count) and atomic:
everything is written to a temporary sibling directory, fsynced, then renamed into place.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ddpflow.config.fingerprint import TOKEN_SOURCES
from ddpflow.data.raw import DataError, RawSource
from ddpflow.data.sources import load_source
from ddpflow.data.staged import FORMAT_VERSION, MANIFEST
from ddpflow.runtime import fsync_dir, replace_dir, sha256_file
from ddpflow.task import run_task

log = logging.getLogger(__name__)

__all__ = ["SHARD_BYTES", "split_indices", "stage_dataset", "stratified_split"]

SHARD_BYTES = 64 << 20  # images per shard: as many as fit in 64 MiB
SHOWN = 20  # classes named in a warning, then the total
LEVELS = np.arange(256, dtype=np.int64)


def stage_dataset(
    data_cfg: dict, out_dir, seed: int, threads: int = 1, shard_bytes: int = SHARD_BYTES
) -> dict:
    """Stage data_cfg["source"] into out_dir (atomically) and return the manifest.

    Streaming: images go to fixed-size shards as they are read (an image folder is decoded a
    shard at a time, by `threads` threads), so memory stays bounded by a few shards whatever
    the dataset's size."""
    out_dir = Path(out_dir)
    if data_cfg["source"] in TOKEN_SOURCES:  # the token data of a task that reads tokens
        from ddpflow.data.text import stage_tokens

        return stage_tokens(data_cfg, out_dir, seed, threads)
    raw = load_source(data_cfg, seed)
    task = run_task(data_cfg)
    plan = split_indices(raw, data_cfg, seed, task.strata(raw.train_y))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-", dir=out_dir.parent))
    try:
        written = _write_splits(tmp, raw, plan, threads, shard_bytes)
        finish = getattr(raw.train_x, "finish", None)
        if finish is not None:  # an image folder: what it could only tell after reading
            finish()
        _refuse_emptied(plan, written)
        manifest = _base_manifest(raw, written, data_cfg, seed, task)
        if "class_counts" in manifest:
            _warn_empty_classes(manifest, carved=raw.test_x is None)
        _write_json(tmp / MANIFEST, manifest)
        fsync_dir(tmp)
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest  # pipeline.stage_data logs it, with the time taken


def _warn_empty_classes(manifest: dict, carved: bool) -> None:
    """A class with no sample in a split (one image: a stratified split gives it no test
    sample; a test split without it): one warning per split, naming the classes (up to
    SHOWN, then the total) with their counts per split, which the manifest's class_counts
    record. The report shows their test accuracy as n/a. carved: the test split is carved
    from train (as val always is), so a larger fraction can give it samples."""
    counts, names = manifest["class_counts"], manifest["class_names"]
    for split, in_split in counts.items():
        missing = [k for k, count in enumerate(in_split) if count == 0]
        if not missing:
            continue
        one = len(missing) == 1
        it, its = ("it", "its") if one else ("them", "their")
        fix = f"add samples of {it}"
        if split == "val" or (split == "test" and carved):
            fix += f" or raise data.{split}_fraction"
        why = {"train": f"the model never learns {it}; add samples of {it}",
               "val": f"validation does not measure {it}; {fix}",
               "test": f"{its} test accuracy is n/a; {fix}"}[split]  # fmt: skip
        if not sum(in_split):  # too few samples for the fraction: no class has one
            log.warning("data: the %s split is empty; %s", split, fix.replace(" of them", ""))
            continue
        per_split = [", ".join(f"{s} {counts[s][k]}" for s in counts) for k in missing[:SHOWN]]
        if one:
            log.warning("data: class %r has no sample in the %s split (%s): %s",
                        names[missing[0]], split, per_split[0], why)  # fmt: skip
            continue
        shown = [f"{names[k]!r} ({c})" for k, c in zip(missing, per_split, strict=False)]
        more = f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else ""
        log.warning(
            "data: %d classes have no sample in the %s split: %s%s; %s",
            len(missing), split, ", ".join(shown), more, why,
        )  # fmt: skip


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


_LABELS = object()  # split_indices's default strata: raw.train_y


def split_indices(raw: RawSource, data_cfg: dict, seed: int, strata=_LABELS) -> dict:
    """{split: (pool, indices)}: which samples of raw's train or test pool each split holds;
    seeded, stratified by `strata` (the class labels by default; None: a seeded random split,
    for targets without classes); test is official or carved from all data.

    Each step draws from its own seed stream, so e.g. changing max_train_samples does not
    reshuffle val or test. Only labels are read: an image folder is not decoded here.
    """
    y = raw.train_y if strata is _LABELS else strata
    if y is None:  # no strata: every sample its own stratum is a seeded random split
        y = np.zeros(len(raw.train_y), np.int64)
    base = np.arange(len(y))
    if raw.test_x is None:
        rest, test = stratified_split(y, round(data_cfg["test_fraction"] * len(y)), _rng(seed, 1))
        test_plan = ("train", test)
        base, y = rest, y[rest]
    else:
        assert raw.test_y is not None  # an official test split comes with its labels
        test_plan = ("test", np.arange(len(raw.test_y)))
    train, val = stratified_split(y, round(data_cfg["val_fraction"] * len(y)), _rng(seed, 2))
    cap = data_cfg.get("max_train_samples")
    if cap is not None and cap < len(train):
        _, keep = stratified_split(y[train], cap, _rng(seed, 3))
        train = train[keep]
    if len(train) == 0:
        raise DataError("data: the train split is empty; lower val_fraction/test_fraction")
    return {"train": ("train", base[train]), "val": ("train", base[val]), "test": test_plan}


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
    parts = [rng.permutation(np.flatnonzero(labels == c))[:k] for c, k in pairs]
    take = np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
    keep = np.setdiff1d(np.arange(len(labels)), take)
    return keep, take


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def _base_manifest(raw: RawSource, written: dict, data_cfg: dict, seed: int, task) -> dict:
    num_classes = len(raw.class_names)
    total, squares, count = written["train_sums"]
    mean = total / max(count, 1)
    std = np.sqrt(np.maximum(squares / max(count, 1) - mean * mean, 0.0))
    labels = written["labels"]
    # the task's record of its targets (classification's: the manifest written before tasks)
    targets = task.manifest_record(labels, raw.class_names)
    return {
        "format_version": FORMAT_VERSION,
        "source": data_cfg["source"],
        "num_classes": num_classes,
        "class_names": raw.class_names,
        "shape": list(written["shape"]),
        "sizes": {name: len(y) for name, y in labels.items()},
        **targets,
        "mean": (mean / 255.0).tolist(),
        "std": (std / 255.0).tolist(),
        "seed": seed,
        "shards": written["shards"],
        "files": written["files"],
        **({"source_notes": manifest_notes(raw.notes)} if raw.notes else {}),
        "data_cfg": data_cfg,
    }


def manifest_notes(notes: dict) -> dict:
    """What a reader of your own data skipped, ignored or upscaled, for the manifest."""
    out: dict[str, Any] = {}
    if "skipped_corrupt" in notes:  # an image folder
        out.update(
            skipped_corrupt=len(notes["skipped_corrupt"]),
            skipped_files=notes["skipped_corrupt"][:100],
            ignored_files=notes["ignored_files"],
        )
    if notes.get("small") is not None:
        out.update(notes["small"].manifest())
    return out


def _write_splits(directory: Path, raw: RawSource, plan: dict, threads: int, shard_bytes: int):
    """Write every split's images as fixed-size shards and its labels as one file, a shard at
    a time; return what the manifest records (shards, files, labels, train pixel sums)."""
    pools = {"train": (raw.train_x, raw.train_y), "test": (raw.test_x, raw.test_y)}
    shape = tuple(int(d) for d in raw.train_x.shape[1:])
    per_shard = max(1, shard_bytes // int(np.prod(shape)))
    written: dict[str, Any] = {"shape": shape, "shards": {}, "files": {}, "labels": {}}
    # the train split's per-channel pixel sums and sums of squares, and its pixel count
    sums: list[Any] = [np.zeros(shape[0], np.int64), np.zeros(shape[0], np.int64), 0]
    # processes, not threads: most of decoding an image is Python holding the GIL (with 2
    # threads staging was slower than with 1; bench/data.py)
    pool = ProcessPoolExecutor(threads, mp_context=_fork()) if threads > 1 else None
    try:
        for split, (source, indices) in plan.items():
            images, labels = pools[source]
            assert images is not None and labels is not None  # test: planned where raw has it
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
            # classification's int64 labels [n]; another task's targets as it staged them
            y = np.concatenate(kept) if kept else labels[:0]
            y = y.astype(np.int64) if y.ndim == 1 and y.dtype.kind in "iu" else y
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
