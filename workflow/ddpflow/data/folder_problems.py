"""Everything wrong with an image folder, said once: staging gathers the problems of the
listing (class folders without images, a class in one split only, two folders that name one
class, empty files) and the images that do not decode, then stops with one DataError that
lists them all (up to SHOWN, with the total), so that one run names what to fix.

    problems = FolderProblems(root, cfg)
    problems.add("my_images/train/bird: class 'bird' has no images; ...")
    problems.unreadable(path, "image file is truncated")
    problems.raise_if_any(ignored_names)
"""

from __future__ import annotations

from pathlib import Path

from ddpflow.data.raw import DataError

SHOWN = 20  # problems listed by name; the rest are counted
# files a file manager leaves in folders: neither images nor a problem
IGNORED_NAMES = frozenset({"Thumbs.db", "desktop.ini"})


class FolderProblems:
    """The problems of one image folder, in the order found."""

    def __init__(self, root: Path, cfg: dict):
        self.root, self.on_corrupt = root, cfg["on_corrupt"]
        self.lines: list[str] = []
        self.unreadable_count = 0
        self.empty: set[str] = set()  # class folders without images (named once, not per split)

    def __bool__(self) -> bool:
        return bool(self.lines)

    def add(self, line: str) -> None:
        self.lines.append(line)

    def unreadable(self, path, detail: str) -> None:
        """An image that cannot be read: a problem under data.on_corrupt: error (the
        default); with skip, staging leaves it out and counts it instead."""
        if self.on_corrupt == "error":
            self.lines.append(f"{path}: not a readable image ({detail})")
            self.unreadable_count += 1

    def compare_classes(self, train: dict[str, Path], test: dict[str, Path]) -> None:
        """train/ and test/ must name the same classes (compared in Unicode NFC)."""
        for name in sorted(set(test) - set(train)):
            self.add(
                f"{test[name]}: class {name!r} is in test/ but not in train/, so the model "
                "never learns it; add it to train/ or remove it from test/"
            )
        for name in sorted(set(train) - set(test) - self.empty):
            self.add(
                f"{self.root / 'test'}: no folder for class {name!r} of train/; add "
                f"test/{name}/ with images, or remove test/ to carve the test split from "
                "train/ (data.test_fraction)"
            )

    def raise_if_any(self, ignored: list[str]) -> None:
        if self.lines:
            raise DataError(self.message(ignored))

    def message(self, ignored: list[str]) -> str:
        count = len(self.lines)
        plural = "s" if count > 1 else ""
        lines = [
            f"data.root {self.root}: {count} problem{plural}, nothing was staged; fix them "
            "and rerun:"
        ]
        lines += [f"  - {line}" for line in self.lines[:SHOWN]]
        if count > SHOWN:
            lines.append(f"  ... and {count - SHOWN} more ({count} in all)")
        if self.unreadable_count:
            lines.append("  (or set data.on_corrupt: skip to leave unreadable images out)")
        if ignored:
            lines.append(f"  also: {ignored_line(ignored)}")
        return "\n".join(lines)


def ignored_line(ignored: list[str]) -> str:
    """The files that are not images (by their extension), named."""
    shown = ", ".join(ignored[:SHOWN])
    more = f", ... ({len(ignored)} in all)" if len(ignored) > SHOWN else ""
    kind = "file is" if len(ignored) == 1 else "files are"
    return (
        f"{len(ignored)} {kind} not an image by its extension and left out: {shown}{more} "
        "(an image in a format Pillow does not know: convert it, e.g. to PNG)"
    )
