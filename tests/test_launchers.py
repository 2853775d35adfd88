"""The same training entry under other launchers: torchrun (2 local processes), and the
scaling-study config (world sizes 1 and 2 in one report)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml
from ddpflow.config.schema import deep_merge
from workflow_helpers import BIN, REPO, snakemake, write_config

pytestmark = pytest.mark.e2e


def _ddpflow(env: dict, *args: str, cwd=None) -> subprocess.CompletedProcess:
    """`python -m ddpflow ARGS` as a user types it."""
    command = [str(BIN / "python"), "-m", "ddpflow", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=cwd)


def _env() -> dict:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


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
    summary = json.loads((workdir / "results/report/summary.json").read_text())
    (row,) = summary["runs"]
    assert (row["run"], row["world_size"], row["accuracy"]) == ("tr", 2, metrics["accuracy"])
    assert row["samples_evaluated"] == metrics["test_size"] and not summary["unfinished"]


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
    one, two = rows["ranks1"], rows["ranks2"]
    assert one["speedup"] == pytest.approx(1.0)
    rate = two["train_samples_per_s"] / one["train_samples_per_s"]
    assert two["speedup"] == pytest.approx(rate) and two["efficiency"] == pytest.approx(rate / 2)
    assert one["scaling_group"] == two["scaling_group"] == 1  # one science at 1 and 2 ranks
    assert (workdir / "results/report/plots/scaling.png").stat().st_size > 1000
    # `python -m ddpflow report` writes what the report rule wrote, for the same config, the
    # bad-node ledger's section included (the rule reads the ledger beside the work folders)
    ledger = {"nodes": [{"node": "node7", "reason": "NODE_FAIL", "job_id": "9", "run": "ranks2",
                         "time": "2026-01-01T00:00:00+00:00"}]}  # fmt: skip
    (workdir / "results/work/bad_nodes.json").write_text(json.dumps(ledger))
    # and a run whose records the report cannot read (its path is named the same way by both);
    # its old mtime kept: no rerun trigger for evaluate
    cut = workdir / "results/runs/ranks2/eval_metrics.json"
    stat = cut.stat()
    cut.write_text(cut.read_text()[:100])
    os.utime(cut, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    rerun = snakemake(workdir, REPO / "config/config.yaml", str(REPO / "config/scaling.yaml"),
                      str(overlay), "--forcerun", "report")  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    rule = {name: (workdir / "results/report" / name).read_text() for name in REPORTED}
    assert "node7" in rule["report.md"]
    unfinished = json.loads(rule["summary.json"])["unfinished"]
    assert [u["run"] for u in unfinished] == ["ranks2"]
    assert "eval_metrics results/runs/ranks2/eval_metrics.json: not JSON" in unfinished[0]["cause"]
    merged = {}
    for part in (REPO / "config/config.yaml", REPO / "config/scaling.yaml", overlay):
        merged = deep_merge(merged, yaml.safe_load(part.read_text()))
    config = write_config(workdir / "merged.yaml", merged)
    done = _ddpflow(_env(), "report", "--config", str(config), cwd=workdir)
    assert done.returncode == 0, done.stderr
    cli = {name: (workdir / "results/report" / name).read_text() for name in REPORTED}
    assert _without_time(cli) == _without_time(rule)


REPORTED = ("summary.json", "summary.csv", "report.md")


def _without_time(texts: dict[str, str]) -> dict:
    """The report files less the time they were generated at (summary.json as data)."""
    timeless = {}
    for name, text in texts.items():
        if name.endswith(".json"):
            timeless[name] = {k: v for k, v in json.loads(text).items() if k != "generated"}
        else:
            timeless[name] = [line for line in text.splitlines() if "Generated" not in line]
    return timeless
