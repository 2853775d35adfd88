"""Everything wrong with an image folder, said once: staging gathers the problems of the
listing (class folders without images, a class in one split only, two folders that name one
class, empty files) and the images that do not decode (or are too small under data.on_small:
error) while every image is read, then stops with one DataError that lists them all (up to
SHOWN, with the total), so that one run names what to fix. The files it leaves out (not
images, or beside the class folders) are named too: in that error, or in a warning.

    problems = FolderProblems(root, cfg)
    problems.add("my_images/train/bird: class 'bird' has no images; ...")
    problems.unreadable(path, "image file is truncated")
    problems.raise_if_any()
"""

from __future__ import annotations

from pathlib import Path

from ddpflow.data.raw import DataError
from ddpflow.words import counted

SHOWN = 20  # problems listed by name; the rest are counted
# files a file manager leaves in folders: neither images nor a problem
IGNORED_NAMES = frozenset({"Thumbs.db", "desktop.ini"})


class FolderProblems:
    """The problems of one image folder, in the order found, and the files it leaves out."""

    def __init__(self, root: Path, cfg: dict):
        self.root, self.on_corrupt = root, cfg["on_corrupt"]
        self.lines: list[str] = []
        self.unreadable_count = 0
        self.named: set[str] = set()  # unreadable files named already (an empty one, listed)
        self.empty: set[str] = set()  # class folders without images (named once, not per split)
        self.not_images: list[str] = []  # left out: not an image by its extension
        self.outside: list[str] = []  # left out: beside the class folders of a split

    def __bool__(self) -> bool:
        return bool(self.lines)

    def add(self, line: str) -> None:
        self.lines.append(line)

    def unreadable(self, path, detail: str) -> None:
        """An image that cannot be read: a problem under data.on_corrupt: error (the
        default); with skip, staging leaves it out and counts it instead."""
        if self.on_corrupt == "error" and str(path) not in self.named:
            self.named.add(str(path))
            self.lines.append(f"{path}: not a readable image ({detail})")
            self.unreadable_count += 1

    def compare_classes(self, train: dict[str, Path], test: dict[str, Path]) -> None:
        """train/ and test/ must name the same classes (compared in Unicode NFC)."""
        for name in sorted(set(test) - set(train)):
            self.add(
                f"{test[name]}: class {shown_name(name)} is in test/ but not in train/, so the "
                "model never learns it; add it to train/ or remove it from test/"
            )
        for name in sorted(set(train) - set(test) - self.empty):
            self.add(
                f"{self.root / 'test'}: no folder for class {shown_name(name)} of train/; add "
                f"test/{name}/ with images, or remove test/ to carve the test split from "
                "train/ (data.test_fraction)"
            )

    def raise_if_any(self) -> None:
        if self.lines:
            raise DataError(self.message())

    def message(self) -> str:
        count = len(self.lines)
        lines = [
            f"data.root {self.root}: {counted(count, 'problem')}, nothing was staged; fix "
            "them and rerun:"
        ]
        lines += [f"  - {line}" for line in self.lines[:SHOWN]]
        if count > SHOWN:
            lines.append(f"  ... and {count - SHOWN} more ({count} in all)")
        if self.unreadable_count:
            lines.append("  (or set data.on_corrupt: skip to leave unreadable images out)")
        lines += [f"  also: {line}" for line in self.left_out()]
        return "\n".join(lines)

    def left_out(self) -> list[str]:
        """The files that are not staged though they are not a problem, named."""
        out = []
        if self.not_images:
            out.append(
                f"{_named(self.not_images, 'file is', 'files are')} not an image by its "
                "extension and left out: "
                f"{_some(self.not_images)} (an image in a format Pillow does not know: "
                "convert it, e.g. to PNG)"
            )
        if self.outside:
            out.append(
                f"{_named(self.outside, 'file is', 'files are')} beside the class folders and "
                f"left out: {_some(self.outside)} (an image goes in its class's folder, "
                "train/<class>/ or test/<class>/)"
            )
        return out


def _named(items: list, singular: str, plural: str) -> str:
    return counted(len(items), singular, plural)


def _some(items: list[str]) -> str:
    more = f", ... ({len(items)} in all)" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more


def code_points(name: str) -> str:
    return " ".join(f"U+{ord(c):04X}" for c in name)


def shown_name(name: str) -> str:
    """A class name as printed, with its code points where it has characters beyond ASCII:
    two such names can print alike (a Latin and a Cyrillic 'a', a zero-width space)."""
    return repr(name) if name.isascii() else f"{name!r} ({code_points(name)})"
