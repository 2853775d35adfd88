"""The old path of ddpflow.training.summaries; remove once training/entry.py and pipeline.py
import ddpflow.training.summaries (no pickle or record holds this path)."""

from ddpflow.training.summaries import (
    describe,
    evaluation_record,
    fine_tuning_record,
    published,
    task_fields,
    train_summary,
)

__all__ = [
    "describe",
    "evaluation_record",
    "fine_tuning_record",
    "published",
    "task_fields",
    "train_summary",
]
