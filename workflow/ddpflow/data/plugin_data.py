"""Your own data from your code: data.source "package.module:function" (a plug-in, ddpflow.
plugins), its Dataset or arrays read into the same uint8 NCHW arrays as the built-in
sources, then staged as they are (held whole while staged).

Every problem is a DataError naming the function and the fix, raised while staging, before
any training job is submitted.
"""

from __future__ import annotations

from typing import overload

import numpy as np

from ddpflow.data.image_size import SmallImages, fit_image
from ddpflow.data.raw import (
    ONE_CLASS,
    DataError,
    RawSource,
    check_labels,
    one_class_per_sample,
)
from ddpflow.plugins import call_plugin
from ddpflow.task import run_task, task_targets


def load_plugin(cfg: dict) -> RawSource:
    """data.source "package.module:function", called with data.kwargs. It returns the train
    data, or a dict {"train": ..., "test": ... (optional), "class_names": [...] (optional)};
    each is a map-style Dataset of (image, label) pairs (a PIL image, or a uint8 or 0..1
    float tensor/array [C, H, W] or [H, W]) or a pair (images, labels) of arrays. Under a
    task other than classification a label is the sample's target, which the task checks."""
    spec = cfg["source"]
    parts = _call_plugin(spec, cfg)
    # PIL images are fitted to image_size: the small ones as data.on_small says
    small = SmallImages(cfg, f"data.source {spec!r}") if cfg["image_size"] is not None else None
    task = run_task(cfg)
    own = task.stages_targets  # the task stages the targets (ddpflow.task)
    names = parts.get("class_names")
    names = [str(n) for n in names] if names is not None else None
    where = f"data.source {spec!r} train"
    train_x, train_y = _plugin_split(parts["train"], where, cfg, small, "train", own)
    if own:
        train_y, names = task_targets(task, train_y, names, f"{where} targets", len(train_x))
    test_x = test_y = None
    if parts.get("test") is not None:
        where = f"data.source {spec!r} test"
        test_x, test_y = _plugin_split(parts["test"], where, cfg, small, "test", own)
        if own:
            test_y, _ = task_targets(task, test_y, names, f"{where} targets", len(test_x))
        _same_shapes(spec, train_x, train_y, test_x, test_y)
    if not own:
        names = _class_names(spec, train_y, test_y, names)
    assert names is not None  # the task's names, or _class_names's
    if small is not None:
        small.tell()
    notes = {"small": small} if small is not None else None
    return RawSource(train_x, train_y, test_x, test_y, names, notes)


def _call_plugin(spec: str, cfg: dict) -> dict:
    """The plug-in's return as {"train": ..., "test": ..., "class_names": ...}."""
    kwargs = dict(cfg["kwargs"])
    out = call_plugin(spec, "data.source", DataError, kwargs=kwargs, given=f"data.kwargs {kwargs}")
    parts = out if isinstance(out, dict) else {"train": out}
    if parts.get("train") is None:
        raise DataError(
            f"data.source {spec!r}: returned a dict without 'train' (keys: "
            f"{sorted(parts)}); return {{'train': ..., 'test': ...}} or the train data"
        )
    return parts


def _same_shapes(spec: str, train_x, train_y, test_x, test_y) -> None:
    if test_x.shape[1:] != train_x.shape[1:]:
        raise DataError(
            f"data.source {spec!r}: test images are {list(test_x.shape[1:])}, "
            f"train images {list(train_x.shape[1:])} (C, H, W)"
        )
    if test_y.shape[1:] != train_y.shape[1:]:
        raise DataError(
            f"data.source {spec!r}: test targets are {list(test_y.shape[1:])} per "
            f"sample, train targets {list(train_y.shape[1:])}"
        )


def _class_names(spec: str, train_y, test_y, names) -> list[str]:
    top = int(max(train_y.max(), test_y.max() if test_y is not None else 0))
    names = names or [str(n) for n in range(top + 1)]
    if top >= len(names):
        raise DataError(
            f"data.source {spec!r}: label {top} but only {len(names)} class_names; "
            "labels are 0..K-1 for K class names"
        )
    return names


def _plugin_split(
    data, where: str, cfg: dict, small=None, part="train", targets=False
) -> tuple[np.ndarray, ...]:
    """(images uint8 [n, C, H, W], labels): int64 class labels, checked; targets=True: the
    targets as given, for the task to check (task_targets)."""
    pair = isinstance(data, (tuple, list)) and len(data) == 2
    if pair and all(isinstance(a, np.ndarray) or hasattr(a, "detach") for a in data):
        images, labels = (_as_numpy(a) for a in data)
        if images.ndim in (3, 4):
            return _arrays(images, labels, where, cfg, targets)
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise DataError(
            f"{where}: got a {type(data).__name__}; expected a map-style Dataset of "
            "(image, label) pairs or a pair (images, labels) of arrays"
        )
    if len(data) == 0:
        raise DataError(f"{where}: the dataset is empty")
    images, labels = _items(data, where, cfg, small, part, targets)
    if not images:
        raise DataError(
            f"{where}: all {len(data)} images were smaller than data.image_size and skipped "
            "(data.on_small: skip); lower data.image_size or set data.on_small: upscale"
        )
    if targets:
        return np.stack(images), _stacked(labels, where)
    return np.stack(images), check_labels(np.concatenate(labels), where)


def _arrays(images, labels, where: str, cfg: dict, targets: bool):
    """A pair (images, labels) of arrays."""
    if not targets:
        labels = one_class_per_sample(labels, where)
        if len(images) != len(labels):
            raise DataError(f"{where}: {len(images)} images but {len(labels)} labels")
    x = np.stack([_pixels(img, f"{where} image {i}", cfg) for i, img in enumerate(images)])
    return x, (labels if targets else check_labels(labels, where))


def _items(data, where: str, cfg: dict, small, part: str, targets: bool):
    """A Dataset's (image, label) pairs: the images kept (on_small) and their labels."""
    images: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    for i in range(len(data)):
        item = data[i]
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise DataError(
                f"{where}: item {i} is a {type(item).__name__}; expected an (image, label) pair"
            )
        pixels = _pixels(item[0], f"{where} item {i}", cfg, small, part)
        if pixels is None:  # smaller than image_size, skipped (data.on_small: skip)
            continue
        if images and pixels.shape != images[0].shape:
            raise DataError(
                f"{where}: item {i} has shape {list(pixels.shape)}, item 0 "
                f"{list(images[0].shape)} (C, H, W); return images of one size, "
                "or PIL images with data.image_size set"
            )
        images.append(pixels)
        label = _as_numpy(item[1])
        if not targets and label.size != 1:  # never cut to its first value
            raise DataError(
                f"{where}: item {i}'s label has shape {list(label.shape)} ({label.size} "
                f"values); {ONE_CLASS}"
            )
        labels.append(label if targets else label.reshape(1))
    return images, labels


def _stacked(labels: list[np.ndarray], where: str) -> np.ndarray:
    shapes = {label.shape for label in labels}
    if len(shapes) > 1:
        shown = sorted(map(list, shapes))
        raise DataError(f"{where}: targets of several shapes ({shown}); give one shape")
    return np.stack(labels)


def _as_numpy(value) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    return np.asarray(value)


@overload
def _pixels(image, where: str, cfg: dict) -> np.ndarray: ...  # without small: never None


@overload
def _pixels(
    image, where: str, cfg: dict, small: SmallImages | None, part: str
) -> np.ndarray | None: ...


def _pixels(image, where: str, cfg: dict, small=None, part="train") -> np.ndarray | None:
    """One image as uint8 [C, H, W]; None for a PIL image smaller than data.image_size under
    data.on_small: skip (counted in small, under part)."""
    if hasattr(image, "convert") and hasattr(image, "size"):  # a PIL image
        mode = "L" if cfg["channels"] == 1 else "RGB"
        image = image.convert("RGBA" if image.mode == "P" else image.mode).convert(mode)
        if cfg["image_size"] is not None:
            height, width = cfg["image_size"]
            if small.count(part, where, image.size) and small.on_small != "upscale":
                if small.on_small == "error":
                    raise DataError(
                        f"{where}: {image.width}x{image.height} is smaller than data.image_size "
                        f"[{height}, {width}]; set data.on_small: upscale to resize such images "
                        "up or skip to leave them out, or lower data.image_size"
                    )
                return None
            pixels = fit_image(image, height, width)
        else:
            pixels = np.asarray(image, dtype=np.uint8)
        return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
    x = _as_numpy(image)
    if x.ndim == 2:
        x = x[None]
    if x.ndim != 3 or x.shape[0] not in (1, 3):
        raise DataError(
            f"{where}: an image of shape {list(x.shape)}; expected [C, H, W] with "
            "C 1 or 3, [H, W], or a PIL image"
        )
    if x.dtype == np.uint8:
        return x
    if np.issubdtype(x.dtype, np.floating) and x.size and x.min() >= 0.0 and x.max() <= 1.0:
        return np.rint(x * 255.0).astype(np.uint8)
    raise DataError(
        f"{where}: pixels of dtype {x.dtype} (range {x.min()}..{x.max()}); "
        "expected uint8 0..255 or floats 0..1"
    )
