"""What every data source returns (RawSource), the error every data problem raises
(DataError) and the labels checks (check_labels, one_class_per_sample): the vocabulary the
built-in sources, the user's own data and staging share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ddpflow.errors import UserError


class DataError(UserError):
    """A dataset problem the user can fix; the message names the file or key and the fix."""


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


def check_labels(labels: np.ndarray, where: str) -> np.ndarray:
    """Labels as int64, or a DataError naming `where` if they are not integers 0..K-1."""
    if not np.issubdtype(labels.dtype, np.integer) or (len(labels) and labels.min() < 0):
        raise DataError(
            f"{where}: labels must be integers 0..K-1 (got {labels.dtype}, "
            f"min {labels.min() if len(labels) else '-'})"
        )
    return labels.astype(np.int64)


# what a label must be: more than one value per sample is refused, never cut to one of them
ONE_CLASS = (
    "a label is one integer class 0..K-1 per sample under task: classification (for several "
    "labels per sample set task: multilabel; for float or vector targets task: regression)"
)


def one_class_per_sample(labels: np.ndarray, where: str) -> np.ndarray:
    """Labels [n] as they are, a column [n, 1] as [n] (Keras's layout); any other shape, e.g.
    [n, 3] (three values per sample), a DataError naming it."""
    if labels.ndim == 2 and labels.shape[1] == 1:
        return labels[:, 0]
    if labels.ndim == 1:
        return labels
    one_hot = (
        labels.ndim == 2
        and labels.size
        and np.isin(labels, (0, 1)).all()
        and (labels.sum(axis=1) == 1).all()
    )
    hint = "; they look one-hot: give labels.argmax(axis=1)" if one_hot else ""
    raise DataError(f"{where}: labels have shape {list(labels.shape)}; {ONE_CLASS}{hint}")
