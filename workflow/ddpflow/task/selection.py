"""The validation metric that selects a task's best run (a sweep's pick, median pruning,
the report's best run): an epoch record key and its direction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Selection:
    """The validation metric that selects: the epoch record key, its direction, its label."""

    metric: str  # "val_accuracy", "val_mse", ...
    higher_is_better: bool
    label: str  # "validation accuracy"

    def record(self) -> dict:
        return {
            "metric": self.metric,
            "higher_is_better": self.higher_is_better,
            "label": self.label,
        }

    def key(self, value: float) -> float:
        """A sort key: smaller is better (sorted(..., key=selection.key) puts the best first)."""
        return -value if self.higher_is_better else value

    def worse_than(self, value: float, reference: float) -> bool:
        return value < reference if self.higher_is_better else value > reference
