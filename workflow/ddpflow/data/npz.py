"""Your own arrays in a .npz file, read into the same uint8 NCHW arrays as the built-in
sources, then staged as they are (held whole while staged).

    data: {source: npz, path: my_arrays.npz}

Every problem is a DataError naming the key and the fix, raised while staging, before any
training job is submitted.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ddpflow.data.raw import (
    DataError,
    RawSource,
    check_labels,
    one_class_per_sample,
)
from ddpflow.task import run_task, task_targets

NPZ_KEYS = ("train_images", "train_labels", "test_images", "test_labels", "class_names")


def load_npz(cfg: dict) -> RawSource:
    """Arrays in data.path: train_images (uint8, [N, H, W], [N, H, W, C] or [N, C, H, W] with
    C 1 or 3), train_labels (integers 0..K-1, [N] or [N, 1]); optional test_images +
    test_labels and class_names (else "0".."K-1")."""
    if not cfg["path"]:
        raise DataError("data.path is required for data.source npz: the .npz file to read")
    path = Path(cfg["path"])
    if not path.is_file():
        raise DataError(f"data.path {path}: no such file")
    try:
        arrays = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise DataError(f"data.path {path}: not a readable .npz file ({err})") from err
    with arrays:
        keys = set(arrays.files)
        missing = [k for k in ("train_images", "train_labels") if k not in keys]
        if missing:
            raise DataError(
                f"data.path {path}: missing {', '.join(missing)} (has: "
                f"{', '.join(sorted(keys)) or 'nothing'}); the keys are "
                f"{', '.join(NPZ_KEYS)}"
            )
        if ("test_images" in keys) != ("test_labels" in keys):
            raise DataError(
                f"data.path {path}: test_images and test_labels come together; "
                "give both or neither (then the test split is carved out)"
            )
        train_x = npz_images(arrays, "train_images", path)
        names = [str(n) for n in arrays["class_names"]] if "class_names" in keys else None
        task = run_task(cfg)
        if task.stages_targets:  # the task stages the targets (ddpflow.task)
            return _task_npz(task, arrays, keys, path, train_x, names)
        train_y = _npz_labels(arrays, "train_labels", path, len(train_x))
        test_x = test_y = None
        if "test_images" in keys:
            test_x = npz_images(arrays, "test_images", path)
            test_y = _npz_labels(arrays, "test_labels", path, len(test_x))
            if test_x.shape[1:] != train_x.shape[1:]:
                raise DataError(
                    f"data.path {path}: test_images are {list(test_x.shape[1:])} "
                    f"but train_images {list(train_x.shape[1:])} (C, H, W)"
                )
    top = int(max(train_y.max(), test_y.max() if test_y is not None else 0))
    names = names or [str(k) for k in range(top + 1)]
    if top >= len(names):
        raise DataError(
            f"data.path {path}: label {top} but only {len(names)} class_names; "
            "labels are 0..K-1 for K class names"
        )
    return RawSource(train_x, train_y, test_x, test_y, names)


def _task_npz(task, arrays, keys, path: Path, train_x, names) -> RawSource:
    where = f"data.path {path}: train_labels"
    train_y, names = task_targets(task, arrays["train_labels"], names, where, len(train_x))
    test_x = test_y = None
    if "test_images" in keys:
        test_x = npz_images(arrays, "test_images", path)
        where = f"data.path {path}: test_labels"
        test_y, _ = task_targets(task, arrays["test_labels"], names, where, len(test_x))
        if test_x.shape[1:] != train_x.shape[1:] or test_y.shape[1:] != train_y.shape[1:]:
            raise DataError(
                f"data.path {path}: test_images/test_labels are {list(test_x.shape[1:])}/"
                f"{list(test_y.shape[1:])} per sample but train_images/train_labels "
                f"{list(train_x.shape[1:])}/{list(train_y.shape[1:])}"
            )
    return RawSource(train_x, train_y, test_x, test_y, names)


def npz_images(arrays, key: str, path: Path) -> np.ndarray:
    """arrays[key] (an opened npz) as uint8 images [N, C, H, W], checked (a DataError names
    path and key): the decoder of the npz source and of snakemake predict's npz inputs."""
    x = arrays[key]
    if x.dtype != np.uint8:
        raise DataError(
            f"data.path {path}: {key} has dtype {x.dtype}; expected uint8 pixel "
            "values 0..255 (scale and convert: (x * 255).round().astype('uint8'))"
        )
    if x.ndim == 3:
        return np.ascontiguousarray(x[:, None])
    if x.ndim == 4 and x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))  # NHWC
    if x.ndim == 4 and x.shape[1] in (1, 3):
        return np.ascontiguousarray(x)  # NCHW
    raise DataError(
        f"data.path {path}: {key} has shape {list(x.shape)}; expected [N, H, W], "
        "[N, H, W, C] or [N, C, H, W] with C 1 or 3"
    )


def _npz_labels(arrays, key: str, path: Path, n: int) -> np.ndarray:
    y = one_class_per_sample(arrays[key], f"data.path {path}: {key}")
    if len(y) != n:
        images = key.replace("labels", "images")
        raise DataError(f"data.path {path}: {key} has {len(y)} entries but {images} has {n}")
    return check_labels(y, f"data.path {path}: {key}")
