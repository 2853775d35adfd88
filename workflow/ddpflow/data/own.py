"""Your own data: an image folder (torchvision's ImageFolder layout) or arrays in a .npz file,
read into the same uint8 NCHW arrays as the built-in sources, then staged as they are.

    data: {source: image_folder, root: my_images, image_size: [32, 32], channels: 3}
    data: {source: npz, path: my_arrays.npz}

Every problem is a DataError naming the file or key and the fix, raised while staging, before
any training job is submitted. An image folder is decoded a shard at a time while it is
staged (memory bounded whatever its size); npz and plug-in data are held whole while staged.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ddpflow.data.raw import DataError, RawSource

log = logging.getLogger(__name__)
SHOWN = 5  # file names listed in a message before "and N more"


def load_image_folder(cfg: dict) -> RawSource:
    """root/train/<class>/<image> (and root/test/<class>/<image> if present): classes sorted by
    name, as ImageFolder does. Only the listing is read here; the images are decoded while
    they are staged, a shard at a time (ImageFiles.read): converted to cfg["channels"],
    resized so that the shorter side fits image_size, then centre-cropped to it; an image
    smaller than image_size is upscaled, skipped or refused (data.on_small)."""
    from PIL import Image

    root = Path(cfg["root"])
    if cfg["image_size"] is None:
        raise DataError(
            "data.image_size is required for data.source image_folder: the size "
            "[height, width] every image is resized to, e.g. [32, 32]"
        )
    train_dir = root / "train"
    if not train_dir.is_dir():
        raise DataError(
            f"data.root {root}: no train/ folder; image_folder expects "
            f"{root}/train/<class>/<image> (and optionally {root}/test/...)"
        )
    extensions = {ext.lower() for ext in Image.registered_extensions()}
    classes = _classes(train_dir)
    notes = {"skipped_corrupt": [], "ignored_files": 0, "small": SmallImages(cfg)}
    train_files, train_y = _list_split(train_dir, classes, extensions, notes)
    test_x = test_y = None
    test_dir = root / "test"
    if test_dir.is_dir():
        test_classes = _classes(test_dir)
        if test_classes != classes:
            only_train = sorted(set(classes) - set(test_classes))
            only_test = sorted(set(test_classes) - set(classes))
            raise DataError(
                f"data.root {root}: train/ and test/ have different classes (only "
                f"in train: {only_train or 'none'}; only in test: "
                f"{only_test or 'none'}); give both the same class folders"
            )
        test_files, test_y = _list_split(test_dir, classes, extensions, notes)
        test_x = ImageFiles(test_files, cfg, notes)
    if notes["ignored_files"]:
        log.info("image_folder: %d files that are not images were ignored", notes["ignored_files"])
    return RawSource(ImageFiles(train_files, cfg, notes), train_y, test_x, test_y, classes, notes)


def _classes(split_dir: Path) -> list[str]:
    classes = sorted(
        d.name for d in split_dir.iterdir() if d.is_dir() and not d.name.startswith(".")
    )
    if not classes:
        raise DataError(
            f"{split_dir}: no class folders; put each class's images in {split_dir}/<class name>/"
        )
    return classes


def _list_split(split_dir, classes, extensions, notes) -> tuple[list[Path], np.ndarray]:
    files, labels = [], []
    for label, name in enumerate(classes):
        found = 0
        for path in sorted(p for p in (split_dir / name).rglob("*") if p.is_file()):
            if path.name.startswith(".") or path.suffix.lower() not in extensions:
                notes["ignored_files"] += 1
                continue
            files.append(path)
            labels.append(label)
            found += 1
        if not found:
            raise DataError(
                f"{split_dir / name}: class {name!r} has no images; add some or remove the folder"
            )
    return files, np.asarray(labels, dtype=np.int64)


DECODE_CHUNK = 256  # images per task of the staging processes


def _decode_all(paths: list[Path], height: int, width: int, mode: str, upscale: bool) -> list:
    """Each image as (pixels fitted to height x width in mode, or None, (width, height)); a
    small one is fitted only if upscale, else (None, size); one that does not decode,
    (None, detail), a string: it crosses processes."""
    from PIL import Image, UnidentifiedImageError

    results = []
    for path in paths:
        try:
            with Image.open(path) as image:
                image.load()
                size = image.size
                if (image.height < height or image.width < width) and not upscale:
                    results.append((None, size))  # skipped or refused: not worth converting
                    continue
                converted = image.convert("RGBA" if image.mode == "P" else image.mode)
                results.append((_fit(converted.convert(mode), height, width), size))
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
            results.append((None, str(err)))
    return results


class ImageFiles:
    """The image files of one split, decoded on demand: staging reads a shard at a time, in
    `data.stage_threads` processes (decoding is mostly Python holding the GIL)."""

    def __init__(self, files: list[Path], cfg: dict, notes: dict):
        self.files, self.cfg, self.notes = files, cfg, notes
        self.small: SmallImages = notes["small"]
        self.height, self.width = cfg["image_size"]
        self.mode = "L" if cfg["channels"] == 1 else "RGB"

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.files), self.cfg["channels"], self.height, self.width)

    def __len__(self) -> int:
        return len(self.files)

    def read(self, indices, pool=None, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
        """(uint8 [k, C, H, W] of the images kept, mask of those over indices); the images
        smaller than image_size are counted under `split`."""
        paths = [self.files[i] for i in np.asarray(indices).tolist()]
        fit = (self.height, self.width, self.mode, self.small.on_small == "upscale")
        if pool is None:
            results = _decode_all(paths, *fit)
        else:  # in order (map keeps it): the staged bytes do not depend on the process count
            chunks = [paths[i : i + DECODE_CHUNK] for i in range(0, len(paths), DECODE_CHUNK)]
            parts = pool.map(_decode_all, chunks, *([value] * len(chunks) for value in fit))
            results = [result for part in parts for result in part]
        keep = np.array([pixels is not None for pixels, _ in results], dtype=bool)
        for path, (_, detail) in zip(paths, results, strict=True):
            if isinstance(detail, tuple):
                self.small.count(split, str(path), detail)
            elif self.cfg["on_corrupt"] == "error":
                raise DataError(
                    f"{path}: not a readable image ({detail}); replace or delete "
                    f"it, or set data.on_corrupt: skip to skip such files "
                    f"(they are counted in the manifest)"
                )
            else:
                self.notes["skipped_corrupt"].append(str(path))
        out = np.empty((int(keep.sum()), *self.shape[1:]), np.uint8)  # the shard, NCHW
        for row, pixels in enumerate(pixels for pixels, _ in results if pixels is not None):
            out[row] = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
        return out, keep

    def finish(self) -> None:
        """After every split was read: what could only be told then."""
        self.small.tell()
        skipped = self.notes["skipped_corrupt"]
        if skipped:
            log.warning(
                "image_folder: %d corrupt images skipped (data.on_corrupt: skip): %s",
                len(skipped),
                _names(skipped),
            )


class SmallImages:
    """The images smaller than data.image_size, per split: counted while staging reads them,
    told once when it is done (data.on_small: upscale or skip), or refused (error)."""

    def __init__(self, cfg: dict, where: str = "image_folder"):
        from ddpflow.config import on_small

        self.on_small, self.where = on_small(cfg), where
        self.height, self.width = cfg["image_size"]
        self.small: dict[str, list[str]] = {}  # split -> "path (WxH)" of each small image
        self.fits: dict[str, list[float]] = {}  # split -> min(h / H, w / W) of each image

    def count(self, split: str, name: str, size: tuple[int, int]) -> bool:
        """Count an image of size (width, height) read for split; whether it is small."""
        width, height = size
        fit = min(height / self.height, width / self.width)
        self.fits.setdefault(split, []).append(fit)
        if fit < 1:
            self.small.setdefault(split, []).append(f"{name} ({width}x{height})")
        return fit < 1

    def names(self) -> list[str]:
        return [name for names in self.small.values() for name in names]

    def tell(self) -> None:
        """Refuse them (error), or say once how many were upscaled or skipped, and warn for
        each split where they were more than half: a smaller image_size would suit it."""
        names = self.names()
        if names and self.on_small == "error":
            raise DataError(
                f"{len(names)} image(s) smaller than data.image_size [{self.height}, "
                f"{self.width}] (width x height shown): {_names(names)}; set data.on_small: "
                "upscale to resize them up (or skip to leave them out; both are counted in "
                "the manifest), lower data.image_size, or remove them"
            )
        if not names:
            return
        seen = sum(len(fits) for fits in self.fits.values())
        log.info(
            "%s: %s of %s images were smaller than %s and were %s (data.on_small: %s): %s",
            self.where, f"{len(names):,}", f"{seen:,}", self._size(), self._done(),
            self.on_small, _names(names),
        )  # fmt: skip
        mostly = [split for split, fits in self.fits.items()
                  if len(self.small.get(split, [])) * 2 > len(fits)]  # fmt: skip
        if mostly:
            log.warning(self._mostly_small(mostly))

    def _mostly_small(self, splits: list[str]) -> str:
        """One warning for the splits where more than half of the images were small."""
        counts = [f"{split} {len(self.small[split]):,} of {len(self.fits[split]):,}"
                  for split in splits]  # fmt: skip
        # at least half of these images reach image_size scaled by their median fit
        factor = float(np.median([fit for split in splits for fit in self.fits[split]]))
        size = [max(4, int(self.height * factor)), max(4, int(self.width * factor))]
        upscaled = self.on_small == "upscale"
        return (
            f"{self.where}: more than half of the images of a split were smaller than "
            f"{self._size()} and were {self._done()} ({', '.join(counts)})"
            f"{'; upscaling adds pixels, not detail' if upscaled else ''}: consider a smaller "
            f"data.image_size, e.g. {size}, which at least half of them reach"
            f"{'' if upscaled else ', or data.on_small: upscale'}"
        )

    def _size(self) -> str:
        square = self.height == self.width
        return f"{self.width}x{self.height}" + ("" if square else " (width x height)")

    def _done(self) -> str:
        return "upscaled" if self.on_small == "upscale" else "skipped"

    def manifest(self) -> dict:
        """The counts for the manifest and the report's provenance."""
        names = self.names()
        return {
            "on_small": self.on_small,
            "image_size": [self.height, self.width],
            "upscaled_small": len(names) if self.on_small == "upscale" else 0,
            "skipped_small": len(names) if self.on_small == "skip" else 0,
            "small_per_split": {split: len(found) for split, found in self.small.items()},
            "small_files": names[:100],
        }


def manifest_notes(notes: dict) -> dict:
    """What a reader of your own data skipped, ignored or upscaled, for the manifest."""
    out = {}
    if "skipped_corrupt" in notes:  # an image folder
        out.update(
            skipped_corrupt=len(notes["skipped_corrupt"]),
            skipped_files=notes["skipped_corrupt"][:100],
            ignored_files=notes["ignored_files"],
        )
    if notes.get("small") is not None:
        out.update(notes["small"].manifest())
    return out


def _fit(image, height: int, width: int) -> np.ndarray:
    """Resize (bilinear, antialiased) so the image covers height x width, then centre-crop:
    down, or up for an image smaller than that (data.on_small: upscale)."""
    from PIL import Image

    scale = max(height / image.height, width / image.width)
    size = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
    if size != image.size:
        image = image.resize(size, Image.Resampling.BILINEAR)
    left, top = (image.width - width) // 2, (image.height - height) // 2
    return np.asarray(image.crop((left, top, left + width, top + height)), dtype=np.uint8)


def _names(items: list[str]) -> str:
    more = f" and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more


NPZ_KEYS = ("train_images", "train_labels", "test_images", "test_labels", "class_names")


def load_npz(cfg: dict) -> RawSource:
    """Arrays in data.path: train_images (uint8, [N, H, W], [N, H, W, C] or [N, C, H, W] with
    C 1 or 3), train_labels (integers 0..K-1); optional test_images + test_labels and
    class_names (else "0".."K-1")."""
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
        train_x = _npz_images(arrays, "train_images", path)
        train_y = _npz_labels(arrays, "train_labels", path, len(train_x))
        test_x = test_y = None
        if "test_images" in keys:
            test_x = _npz_images(arrays, "test_images", path)
            test_y = _npz_labels(arrays, "test_labels", path, len(test_x))
            if test_x.shape[1:] != train_x.shape[1:]:
                raise DataError(
                    f"data.path {path}: test_images are {list(test_x.shape[1:])} "
                    f"but train_images {list(train_x.shape[1:])} (C, H, W)"
                )
        names = [str(n) for n in arrays["class_names"]] if "class_names" in keys else None
    top = int(max(train_y.max(), test_y.max() if test_y is not None else 0))
    names = names or [str(k) for k in range(top + 1)]
    if top >= len(names):
        raise DataError(
            f"data.path {path}: label {top} but only {len(names)} class_names; "
            "labels are 0..K-1 for K class names"
        )
    return RawSource(train_x, train_y, test_x, test_y, names)


def _npz_images(arrays, key: str, path: Path) -> np.ndarray:
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
    y = arrays[key]
    if y.ndim != 1:
        raise DataError(f"data.path {path}: {key} must be 1-D, got shape {list(y.shape)}")
    if len(y) != n:
        images = key.replace("labels", "images")
        raise DataError(f"data.path {path}: {key} has {len(y)} entries but {images} has {n}")
    return _labels(y, f"data.path {path}: {key}")


def load_plugin(cfg: dict) -> RawSource:
    """data.source "package.module:function", called with data.kwargs. It returns the train
    data, or a dict {"train": ..., "test": ... (optional), "class_names": [...] (optional)};
    each is a map-style Dataset of (image, label) pairs (a PIL image, or a uint8 or 0..1
    float tensor/array [C, H, W] or [H, W]) or a pair (images, labels) of arrays."""
    from ddpflow.plugins import import_factory

    spec, kwargs = cfg["source"], dict(cfg["kwargs"])
    factory = import_factory(spec, "data.source", DataError)
    try:
        out = factory(**kwargs)
    except Exception as err:
        raise DataError(
            f"data.source {spec!r}: the function raised {type(err).__name__}: {err} (called "
            f"with data.kwargs {kwargs})"
        ) from err
    parts = out if isinstance(out, dict) else {"train": out}
    if parts.get("train") is None:
        raise DataError(
            f"data.source {spec!r}: returned a dict without 'train' (keys: "
            f"{sorted(parts)}); return {{'train': ..., 'test': ...}} or the train data"
        )
    # PIL images are fitted to image_size: the small ones as data.on_small says
    small = SmallImages(cfg, f"data.source {spec!r}") if cfg["image_size"] is not None else None
    train_x, train_y = _plugin_split(parts["train"], f"data.source {spec!r} train", cfg, small)
    test_x = test_y = None
    if parts.get("test") is not None:
        where = f"data.source {spec!r} test"
        test_x, test_y = _plugin_split(parts["test"], where, cfg, small, "test")
        if test_x.shape[1:] != train_x.shape[1:]:
            raise DataError(
                f"data.source {spec!r}: test images are {list(test_x.shape[1:])}, "
                f"train images {list(train_x.shape[1:])} (C, H, W)"
            )
    top = int(max(train_y.max(), test_y.max() if test_y is not None else 0))
    names = [str(n) for n in parts.get("class_names") or range(top + 1)]
    if top >= len(names):
        raise DataError(
            f"data.source {spec!r}: label {top} but only {len(names)} class_names; "
            "labels are 0..K-1 for K class names"
        )
    if small is not None:
        small.tell()
    notes = {"small": small} if small is not None else None
    return RawSource(train_x, train_y, test_x, test_y, names, notes)


def _plugin_split(data, where: str, cfg: dict, small=None, part="train") -> tuple[np.ndarray, ...]:
    arrays = isinstance(data, (tuple, list)) and len(data) == 2
    if arrays and all(isinstance(a, np.ndarray) or hasattr(a, "detach") for a in data):
        images, labels = (_as_numpy(a) for a in data)
        if images.ndim in (3, 4) and labels.ndim == 1:
            if len(images) != len(labels):
                raise DataError(f"{where}: {len(images)} images but {len(labels)} labels")
            x = np.stack([_pixels(img, f"{where} image {i}", cfg) for i, img in enumerate(images)])
            return x, _labels(labels, where)
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise DataError(
            f"{where}: got a {type(data).__name__}; expected a map-style Dataset of "
            "(image, label) pairs or a pair (images, labels) of arrays"
        )
    if len(data) == 0:
        raise DataError(f"{where}: the dataset is empty")
    images, labels = [], []
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
        labels.append(_as_numpy(item[1]).reshape(-1)[:1])
    if not images:
        raise DataError(
            f"{where}: all {len(data)} images were smaller than data.image_size and skipped "
            "(data.on_small: skip); lower data.image_size or set data.on_small: upscale"
        )
    return np.stack(images), _labels(np.concatenate(labels), where)


def _as_numpy(value) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    return np.asarray(value)


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
            pixels = _fit(image, height, width)
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


def _labels(labels: np.ndarray, where: str) -> np.ndarray:
    if not np.issubdtype(labels.dtype, np.integer) or (len(labels) and labels.min() < 0):
        raise DataError(
            f"{where}: labels must be integers 0..K-1 (got {labels.dtype}, "
            f"min {labels.min() if len(labels) else '-'})"
        )
    return labels.astype(np.int64)
