"""The same training entry under other launchers: torchrun (2 local processes), and the
scaling-study config (world sizes 1 and 2 in one report)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from workflow_helpers import BIN, REPO, snakemake, write_config

pytestmark = pytest.mark.e2e


def _ddpflow(env: dict, *args: str) -> subprocess.CompletedProcess:
    """`python -m ddpflow ARGS` as a user types it."""
    command = [str(BIN / "python"), "-m", "ddpflow", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def test_torchrun_two_processes(workdir):
    config = write_config(
        workdir / "config.yaml",
        {
            "results_dir": str(workdir / "results"),
            "train": {"epochs": 3, "progress": False},
            "runs": [{"name": "tr"}],
        },
    )
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    stage = _ddpflow(env, "stage", "--config", str(config))
    assert stage.returncode == 0, stage.stderr
    for command in ("train", "evaluate"):
        result = subprocess.run(
            [
                str(BIN / "torchrun"),
                "--nproc-per-node",
                "2",
                "-m",
                "ddpflow",
                command,
                "tr",  # positional: torchrun would take `--run` for its own --run-path
                "--config",
                str(config),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            cwd=workdir,
        )
        assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((workdir / "results/runs/tr/eval_metrics.json").read_text())
    assert metrics["train"]["launcher"] == "torchrun"
    assert metrics["world_size"] == 2 and metrics["train"]["world_size"] == 2
    assert metrics["samples_evaluated"] == metrics["test_size"]
    assert metrics["accuracy"] > 0.9
    report = _ddpflow(env, "report", "--config", str(config))
    assert report.returncode == 0, report.stderr
    assert (workdir / "results/report/report.html").stat().st_size > 0
    assert "tr" in (workdir / "results/report/summary.json").read_text()


def test_cli_help_lists_every_command():
    done = _ddpflow(dict(os.environ), "--help")
    assert done.returncode == 0
    for command in ("stage", "train", "evaluate", "report"):
        assert f"    {command}" in done.stdout, done.stdout
    both = _ddpflow(dict(os.environ), "train", "a", "--run", "b")
    assert both.returncode == 2 and "two run names" in both.stderr


def test_scaling_config_reports_speedup(workdir):
    overlay = write_config(workdir / "quick.yaml", {"train": {"epochs": 2, "progress": False}})
    result = snakemake(
        workdir, REPO / "config/config.yaml", str(REPO / "config/scaling.yaml"), str(overlay)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((workdir / "results/report/summary.json").read_text())
    rows = {row["run"]: row for row in summary["runs"]}
    assert rows["ranks1"]["world_size"] == 1 and rows["ranks2"]["world_size"] == 2
    assert rows["ranks1"]["speedup"] == pytest.approx(1.0)
    assert rows["ranks2"]["speedup"] > 0 and rows["ranks2"]["efficiency"] > 0
    assert (workdir / "results/report/plots/scaling.png").stat().st_size > 1000
