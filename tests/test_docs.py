"""The documentation: the README's shape, the site's strict build, the generated performance
page, and no dated narrative in the pages."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REGENERATE = "python docs/gen_performance.py"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_performance", DOCS / "gen_performance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_performance_page_is_current():
    generated = _load_generator().generate()
    committed = (DOCS / "performance.md").read_text()
    assert committed == generated, (
        f"docs/performance.md is stale against bench/results/**/*.json: run `{REGENERATE}` "
        "and commit docs/performance.md"
    )


def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        reason = "mkdocs or mkdocs-material is not installed (pip install -r envs/docs.txt)"
        if os.environ.get("DDPFLOW_REQUIRE_DOCS") == "1":
            pytest.fail(f"DDPFLOW_REQUIRE_DOCS=1 but {reason}")
        pytest.skip(reason)
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (site / "index.html").exists()
    assert (site / "performance" / "index.html").exists()


def test_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
    assert blocks, "README.md has no fenced code block"
    first = [line.strip() for line in blocks[0].strip().splitlines()]
    assert first == ["make run", "make test"], f"the first code block is {first}"


DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b")
NARRATIVE = re.compile(
    r"this session|this machine (?:was|ran)|my tests|\(issue \d+\)|measured on \d", re.I
)


def test_pages_have_no_dated_narrative():
    pages = [p for p in DOCS.rglob("*.md") if p.name != "performance.md"]
    assert pages
    found = []
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for pattern in (DATED, NARRATIVE):
                match = pattern.search(line)
                if match:
                    rel = page.relative_to(ROOT)
                    found.append(f"{rel}:{number}: {match.group(0)!r}")
    assert not found, (
        "dated narrative outside docs/performance.md (measured figures belong there, "
        "generated from bench/results):\n" + "\n".join(found)
    )
