"""Fixtures shared by all tests (helpers that tests import live in workflow_helpers.py)."""

from __future__ import annotations

import os
import sys
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


@pytest.fixture
def in_workdir(tmp_path: Path, monkeypatch):
    """A user's working directory as the current one (where plug-in modules are imported
    from); the modules a test imports from it are forgotten afterwards (each writes its own)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        sys.modules.pop(name, None)
