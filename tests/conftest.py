"""Fixtures shared by all tests (helpers that tests import live in workflow_helpers.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip, with the reason, where torch sees no CUDA device (CI has none);
    DDPFLOW_REQUIRE_GPU=1 (the GPU machine) turns that skip into a failure."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    reason = "needs a CUDA device: torch.cuda.is_available() is False on this machine"
    if os.environ.get("DDPFLOW_REQUIRE_GPU") == "1":
        raise pytest.UsageError(f"DDPFLOW_REQUIRE_GPU=1 but {reason}")
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A fresh working directory, like a user's clone of the workflow."""
    directory = tmp_path / "work"
    directory.mkdir()
    return directory
