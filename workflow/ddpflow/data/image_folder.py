"""Your own images in folders (torchvision's ImageFolder layout), read into the same uint8
NCHW arrays as the built-in sources, then staged as they are.

    data: {source: image_folder, root: my_images, image_size: [32, 32], channels: 3}

Every problem is a DataError naming the file and the fix, raised while staging, before any
training job is submitted. An image folder is decoded a shard at a time while it is staged
(memory bounded whatever its size).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ddpflow.data.image_size import SmallImages, fit_image, some_names
from ddpflow.data.raw import DataError, RawSource

log = logging.getLogger(__name__)


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
                results.append((fit_image(converted.convert(mode), height, width), size))
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
                some_names(skipped),
            )
