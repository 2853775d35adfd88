"""Shared test helpers: where the repository is, and how to run the real Snakemake on it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml
from ddpflow import config as ddpconfig

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def snakemake_command(
    workdir: Path, configfile: Path | None, *args: str, env: dict | None = None
) -> tuple[list[str], dict]:
    """The command line and environment that run the repository's workflow in workdir."""
    cmd = [
        str(BIN / "snakemake"),
        "--snakefile",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        "--cores",
        "2",
    ]
    if configfile is not None:
        cmd += ["--configfile", str(configfile)]
    full_env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        **(env or {}),
    }
    return [*cmd, *args], full_env


def snakemake(
    workdir: Path,
    configfile: Path | None,
    *args: str,
    env: dict | None = None,
    timeout: int = 600,
    sigint=None,
) -> subprocess.CompletedProcess:
    """Run the repository's workflow in workdir (a fresh directory, like a user's clone);
    sigint: the SIGINT disposition it starts with (signal.SIG_DFL as from a terminal,
    SIG_IGN as from a non-interactive shell's `&`; None: this process's)."""
    cmd, full_env = snakemake_command(workdir, configfile, *args, env=env)
    preexec = None if sigint is None else (lambda: signal.signal(signal.SIGINT, sigint))
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=workdir,
        preexec_fn=preexec,
    )  # fmt: skip


def write_config(path: Path, overrides: dict, *, default_exports: bool = False) -> Path:
    """overrides as a config file. Without an `export` section of its own, the file asks for no
    exports (`export.formats: []`): an export is a job of its own per run (a Python start and a
    torch import), which ~100 workflow runs in the suite would pay for nothing they check.
    default_exports=True keeps the shipped default; tests that check exports ask for them."""
    if "export" not in overrides and not default_exports:
        overrides = {**overrides, "export": {"formats": []}}
    path.write_text(yaml.safe_dump(overrides, sort_keys=False))
    return path


def jobs_planned(workdir: Path, configfile: Path | None, *args: str) -> set[str]:
    """Rule names in the dry run's 'Job stats' table (empty when nothing is to be done)."""
    dry = snakemake(workdir, configfile, "-n", *args)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    lines = (dry.stdout + dry.stderr).splitlines()
    if "Job stats:" not in lines:
        return set()
    table = lines[lines.index("Job stats:") + 3 :]
    rows = table[: next(i for i, row in enumerate(table) if row.startswith("total"))]
    return {row.split()[0] for row in rows}


def make_run(**sections) -> dict:
    """A resolved run as the workflow builds it: schema defaults + these section overrides."""
    return ddpconfig.resolve_runs(ddpconfig.load(None, sections))[0]
