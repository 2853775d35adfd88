"""Make the docs' pictures of the report from the current code: docs/img/report.png (the
default job's report) and docs/img/sweep.png (the sweep view of docs/sweeps.md's worked
example), each a fresh workflow run in a temporary folder, its report.html rendered by
headless Chromium. docs/img/pictures.json records the sha256 of the code that draws the
report when the pictures were made: tests/test_docs.py fails once that code changes and the
pictures were not made again, so the README never shows a report the product no longer
writes.

    python docs/make_pictures.py          # make pictures: ~3 minutes on 2 cores
    python docs/make_pictures.py --check  # exit 1 if the pictures are older than the code
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
IMG = ROOT / "docs" / "img"
RECORD = IMG / "pictures.json"
# the code whose output the pictures show: the report's modules that read, lay out and draw
# it (not outcome.py, which records failures)
DRAWN_BY = sorted(
    str(p.relative_to(ROOT))
    for p in (ROOT / "workflow" / "ddpflow" / "report").glob("*.py")
    if p.name not in ("outcome.py", "__init__.py")
)
# the worked example of docs/sweeps.md
SWEEP = {
    "train": {"epochs": 4},
    "sweep": {"grid": {"train.optimizer.lr": [0.1, 0.05, 0.02], "model.name": ["cnn", "mlp"]}},
}
PICTURES = {"report.png": ({}, (1100, 1400)), "sweep.png": (SWEEP, (1280, 1000))}


def code_hashes() -> dict[str, str]:
    return {name: hashlib.sha256((ROOT / name).read_bytes()).hexdigest() for name in DRAWN_BY}


def stale() -> list[str]:
    """The files that draw the report and changed since the pictures were made."""
    made = json.loads(RECORD.read_text())["drawn_by"] if RECORD.is_file() else {}
    now = code_hashes()
    return sorted(name for name in set(now) | set(made) if now.get(name) != made.get(name))


def _config(overrides: dict) -> dict:
    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    for key, value in overrides.items():
        config[key] = {**config.get(key, {}), **value} if key in config else value
    config["train"]["progress"] = False
    return config


def _report(workdir: Path, overrides: dict) -> Path:
    configfile = workdir / "config.yaml"
    configfile.write_text(yaml.safe_dump(_config(overrides)))
    snakemake = Path(sys.executable).parent / "snakemake"
    command = [str(snakemake), "--snakefile", str(ROOT / "Snakefile"), "--directory",
               str(workdir), "--cores", "2", "--configfile", str(configfile)]  # fmt: skip
    subprocess.run(command, check=True, cwd=workdir, capture_output=True, text=True)
    return workdir / "results" / "report" / "report.html"


def _screenshot(page: Path, picture: Path, size: tuple[int, int]) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("make_pictures: no chromium on the PATH (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--disable-background-networking", "--disable-component-update", "--no-first-run",
             "--disable-sync", f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
             f"--screenshot={picture}", page.as_uri()],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the pictures are stale")
    args = parser.parse_args(argv)
    if args.check:
        changed = stale()
        for name in changed:
            print(f"{name} changed since docs/img was made: run python docs/make_pictures.py")
        return 1 if changed else 0
    for name, (overrides, size) in PICTURES.items():
        with tempfile.TemporaryDirectory() as workdir:
            _screenshot(_report(Path(workdir), overrides), IMG / name, size)
            print(f"wrote {IMG / name}")
    RECORD.write_text(json.dumps({"drawn_by": code_hashes()}, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
