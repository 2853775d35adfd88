"""Fixtures shared by all tests (helpers that tests import live in workflow_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A fresh working directory, like a user's clone of the workflow."""
    directory = tmp_path / "work"
    directory.mkdir()
    return directory
