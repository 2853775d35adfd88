"""What every data source returns (RawSource), the error every data problem raises
(DataError, ddpflow.errors) and the labels checks (check_labels, one_class_per_sample: the
classification task's, ddpflow.task.classification): the vocabulary the built-in sources,
the user's own data and staging share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ddpflow.errors import DataError

# classification's label rules, which the sources check their labels by before staging
from ddpflow.task.classification import ONE_CLASS, check_labels, one_class_per_sample

__all__ = [
    "ONE_CLASS",
    "DataError",
    "LazyImages",
    "RawSource",
    "check_labels",
    "one_class_per_sample",
]


class LazyImages(Protocol):
    """Images decoded as they are staged, a shard at a time (image_folder's ImageFiles)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def __len__(self) -> int: ...

    def read(
        self, indices: Any, pool: Any = None, split: str = "train"
    ) -> tuple[np.ndarray, np.ndarray]:
        """(uint8 [k, C, H, W] of the images kept, mask of those kept over indices)."""
        ...


@dataclass(frozen=True)
class RawSource:
    """Arrays straight from a source. test_* are None when it has no official test split."""

    train_x: np.ndarray | LazyImages  # uint8 [N, C, H, W]
    train_y: np.ndarray  # int64 [N]
    test_x: np.ndarray | LazyImages | None
    test_y: np.ndarray | None
    class_names: list[str]
    notes: dict | None = None  # what a reader skipped or ignored, for the manifest
