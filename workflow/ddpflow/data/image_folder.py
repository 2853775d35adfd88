"""Your own images in folders (torchvision's ImageFolder layout), read into the same uint8
NCHW arrays as the built-in sources, then staged as they are.

    data: {source: image_folder, root: my_images, image_size: [32, 32], channels: 3}

Every problem is a DataError naming the file and the fix, raised while staging, before any
training job is submitted. An image folder is decoded a shard at a time while it is staged
(memory bounded whatever its size).
"""

from __future__ import annotations

import logging
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np

from ddpflow.data.folder_problems import IGNORED_NAMES, FolderProblems, code_points, shown_name
from ddpflow.data.image_size import SmallImages, fit_image, some_names
from ddpflow.data.raw import DataError, RawSource
from ddpflow.words import counted

log = logging.getLogger(__name__)


def load_image_folder(cfg: dict) -> RawSource:
    """root/train/<class>/<image> (and root/test/<class>/<image> if present): classes sorted by
    name, as ImageFolder does. Only the listing is read here; the images are decoded while
    they are staged, a shard at a time (ImageFiles.read): converted to cfg["channels"],
    resized so that the shorter side fits image_size, then centre-cropped to it; an image
    smaller than image_size is upscaled, skipped or refused (data.on_small). Every problem of
    the listing (empty class folders, classes in one split only, empty files) is gathered,
    with the unreadable images of the whole folder, into one DataError (FolderProblems),
    raised once every image was read (ImageFiles.finish)."""
    from PIL import Image

    root = _checked_root(cfg)
    train_dir, test_dir = root / "train", root / "test"
    extensions = {ext.lower() for ext in Image.registered_extensions()}
    problems = FolderProblems(root, cfg)
    notes: dict[str, Any] = {"skipped_corrupt": [], "ignored_files": 0, "small": SmallImages(cfg),
             "problems": problems}  # fmt: skip
    folders = {"train": _classes(train_dir, problems)}
    if test_dir.is_dir():
        folders["test"] = _classes(test_dir, problems)
    # labels in the order of train/'s folder names (ImageFolder's), whatever their form: NFC
    # names would sort a macOS copy's NFD names differently, and relabel a folder staged before
    classes = sorted(folders["train"], key=lambda name: folders["train"][name].name)
    listed = {
        split: _list_split(found, classes, extensions, notes, problems)
        for split, found in folders.items()
    }
    if "test" in folders:
        problems.compare_classes(folders["train"], folders["test"])
    if problems:
        # reading every image can only add unreadable (or, under on_small: error, small)
        # ones: it is done where it can, the staging's way, so that this run names them too
        reading_adds = cfg["on_corrupt"] == "error" or notes["small"].on_small == "error"
        if not (reading_adds and len(listed["train"][1])):
            problems.raise_if_any()
        log.info(
            "image_folder: %s in the listing of %s; reading every image (to name the "
            "unreadable ones too) before stopping", counted(len(problems.lines), "problem"),
            root,
        )  # fmt: skip
    train_files, train_y = listed["train"]
    test_x: ImageFiles | None = None
    test_y: np.ndarray | None = None
    if "test" in listed:
        test_x, test_y = ImageFiles(listed["test"][0], cfg, notes), listed["test"][1]
    return RawSource(ImageFiles(train_files, cfg, notes), train_y, test_x, test_y, classes, notes)


def checked_size(cfg: dict) -> None:
    if cfg["image_size"] is None:
        raise DataError(
            "data.image_size is required for data.source image_folder: the size "
            "[height, width] every image is resized to, e.g. [32, 32]"
        )


def _checked_root(cfg: dict) -> Path:
    root = Path(cfg["root"])
    checked_size(cfg)
    if not (root / "train").is_dir():
        raise DataError(
            f"data.root {root}: no train/ folder; image_folder expects "
            f"{root}/train/<class>/<image> (and optionally {root}/test/...)"
        )
    return root


def _classes(split_dir: Path, problems: FolderProblems) -> dict[str, Path]:
    """{class name: its folder}: names in Unicode NFC, so that a folder copied from macOS
    (NFD) names the same class as one typed elsewhere (NFC). A file beside the class folders
    is left out, named."""
    found: dict[str, Path] = {}
    for entry in sorted(split_dir.iterdir()):
        if entry.name.startswith(".") or entry.name in IGNORED_NAMES:
            continue
        if not entry.is_dir():
            problems.outside.append(str(entry))
            continue
        name = unicodedata.normalize("NFC", entry.name)
        if name in found:
            other = found[name].name
            points = f"{code_points(entry.name)} and {code_points(other)}"
            problems.add(
                f"{entry}: the same class name as {other!r} (code points {points}); "
                "merge the two folders"
            )
            continue
        found[name] = entry
    if not found:
        problems.add(
            f"{split_dir}: no class folders; put each class's images in {split_dir}/<class name>/"
        )
    return found


def _list_split(
    found: dict[str, Path], classes, extensions, notes, problems
) -> tuple[list, np.ndarray]:
    files, labels = [], []
    for label, name in enumerate(classes):
        if name not in found:
            continue  # a class of train/ missing from test/: FolderProblems.compare_classes
        images = 0
        for path in sorted(p for p in found[name].rglob("*") if p.is_file()):
            if path.name.startswith(".") or path.name in IGNORED_NAMES:
                continue  # .DS_Store, Thumbs.db: what file managers leave behind
            if path.suffix.lower() not in extensions:
                notes["ignored_files"] += 1
                problems.not_images.append(str(path))
                continue
            if path.stat().st_size == 0:
                problems.unreadable(path, "an empty file (0 bytes)")
            files.append(path)
            labels.append(label)
            images += 1
        if not images:
            problems.empty.add(name)
            problems.add(
                f"{found[name]}: class {shown_name(name)} has no images; add some or remove "
                "the folder"
            )
    return files, np.asarray(labels, dtype=np.int64)


DECODE_CHUNK = 256  # images per task of the staging processes


# an image's decoding: (its pixels or None, its (width, height) or why it did not decode)
Decoded = tuple[np.ndarray | None, tuple[int, int] | str]


def decode_all(
    paths: list[Path], height: int, width: int, mode: str, upscale: bool
) -> list[Decoded]:
    """Each image as (pixels fitted to height x width in mode, or None, (width, height)); a
    small one is fitted only if upscale, else (None, size); one that does not decode,
    (None, detail), a string: it crosses processes."""
    from PIL import Image, UnidentifiedImageError

    results: list[Decoded] = []
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
            results = decode_all(paths, *fit)
        else:  # in order (map keeps it): the staged bytes do not depend on the process count
            chunks = [paths[i : i + DECODE_CHUNK] for i in range(0, len(paths), DECODE_CHUNK)]
            parts = pool.map(decode_all, chunks, *([value] * len(chunks) for value in fit))
            results = [result for part in parts for result in part]
        keep = np.array([pixels is not None for pixels, _ in results], dtype=bool)
        for path, (_, detail) in zip(paths, results, strict=True):
            if isinstance(detail, tuple):
                self.small.count(split, str(path), detail)
            elif self.cfg["on_corrupt"] == "error":  # all of them named once read (finish)
                self.notes["problems"].unreadable(path, detail)
            else:
                self.notes["skipped_corrupt"].append(str(path))
        out = np.empty((int(keep.sum()), *self.shape[1:]), np.uint8)  # the shard, NCHW
        for row, pixels in enumerate(pixels for pixels, _ in results if pixels is not None):
            out[row] = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
        return out, keep

    def finish(self) -> None:
        """After every split was read: what could only be told then. Every problem of the
        folder (its listing's, the unreadable and the small images) in one DataError."""
        problems: FolderProblems = self.notes["problems"]
        refusal = self.small.refusal()
        if problems and refusal:
            problems.add(refusal)
        problems.raise_if_any()
        self.small.tell()
        for line in problems.left_out():
            log.warning("image_folder: %s", line)
        skipped = self.notes["skipped_corrupt"]
        if skipped:
            log.warning(
                "image_folder: %d corrupt images skipped (data.on_corrupt: skip): %s",
                len(skipped),
                some_names(skipped),
            )
