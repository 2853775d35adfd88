"""An image folder whose targets are in a table: data.labels_csv, for task multilabel or
regression (class folders hold one class per image).

    task: multilabel
    data: {source: image_folder, root: my_images, image_size: [32, 32],
           labels_csv: my_labels.csv}

    path,cat,dog,outdoor           # header: path, then one column per label or target
    train/0001.jpg,1,0,1           # the image's path under data.root
    test/0907.jpg,0,1,1            # under test/: the official test split (else carved)

The images are decoded while they are staged, as for class folders (ImageFiles); every
problem of the table and its images (a missing file, a row of the wrong width, a value that
is not a number, a repeated path, an unreadable image) is named in one DataError.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np

from ddpflow.data.folder_problems import FolderProblems
from ddpflow.data.image_folder import ImageFiles, checked_size
from ddpflow.data.image_size import SmallImages
from ddpflow.data.raw import DataError, RawSource
from ddpflow.task import Task, task_targets


def load_labelled_folder(cfg: dict, task: Task) -> RawSource:
    """The images data.labels_csv names under data.root, with their targets as `task`
    stages them; rows whose path starts with test/ are the test split."""
    from PIL import Image

    checked_size(cfg)
    root, table = Path(cfg["root"]), Path(cfg["labels_csv"])
    problems = FolderProblems(root, cfg)
    names, rows = _read_table(table, problems)
    extensions = {ext.lower() for ext in Image.registered_extensions()}
    splits: dict[str, tuple[list[Path], list[list[float]]]] = {"train": ([], []), "test": ([], [])}
    for line, (path, values) in rows:
        where = f"{table}:{line}"
        file = root / path
        if not file.is_file():
            problems.add(f"{where}: {file} does not exist")
        elif file.suffix.lower() not in extensions:
            problems.add(f"{where}: {file} is not an image by its extension")
        else:
            split = "test" if Path(path).parts[0] == "test" else "train"
            splits[split][0].append(file)
            splits[split][1].append(values)
    if not splits["train"][0]:
        problems.add(f"{table}: no image of the train split (a path not under test/)")
    problems.raise_if_any()
    notes: dict[str, Any] = {
        "skipped_corrupt": [],
        "ignored_files": 0,
        "small": SmallImages(cfg),
        "problems": problems,
    }
    parts = {}
    for split, (files, values) in splits.items():
        if files:
            targets, names = task_targets(
                task, _as_targets(values), names, f"data.labels_csv {table} ({split})", len(files)
            )
            parts[split] = (ImageFiles(files, cfg, notes), targets)
    test = parts.get("test", (None, None))
    return RawSource(parts["train"][0], parts["train"][1], test[0], test[1], names, notes)


def _read_table(table: Path, problems: FolderProblems):
    """(the label or target names, [(line, (path, values))]) of the table."""
    if not table.is_file():
        raise DataError(
            f"data.labels_csv {table}: no such file (a path relative to the "
            "directory snakemake runs in)"
        )
    with open(table, newline="", encoding="utf-8-sig") as f:
        lines = list(csv.reader(f))
    if not lines or [cell.strip() for cell in lines[0][:1]] != ["path"] or len(lines[0]) < 2:
        raise DataError(
            f"data.labels_csv {table}: the header is path, then one column per "
            f"label or target (got {lines[0] if lines else 'an empty file'})"
        )
    names = [cell.strip() for cell in lines[0][1:]]
    rows: list[tuple[int, tuple[str, list[float]]]] = []
    seen: dict[str, int] = {}
    for number, cells in enumerate(lines[1:], start=2):
        if not any(cell.strip() for cell in cells):
            continue
        where = f"{table}:{number}"
        if len(cells) != len(names) + 1:
            problems.add(f"{where}: {len(cells)} columns, the header has {len(names) + 1}")
            continue
        path = cells[0].strip()
        if path in seen:
            problems.add(f"{where}: {path} again (first on line {seen[path]})")
            continue
        seen[path] = number
        try:
            values = [float(cell) for cell in cells[1:]]
        except ValueError:
            problems.add(f"{where}: a value that is not a number: {cells[1:]}")
            continue
        rows.append((number, (path, values)))
    return names, rows


def _as_targets(values: list[list[float]]) -> np.ndarray:
    """The table's numbers: 0/1 everywhere is a label table (uint8), else floats."""
    array = np.asarray(values, dtype=np.float64)
    if array.size and np.isin(array, (0.0, 1.0)).all():
        return array.astype(np.uint8)
    return array
