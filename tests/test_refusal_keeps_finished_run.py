"""A refusal never deletes finished work (issue: nothing lost, nothing silent).

A finished run, then edits that only a rule could refuse before: a model that cannot be built,
a model that cannot take the data, a global batch larger than the staged split. Each is now
refused while Snakemake parses, before any job: the run's files stay byte-identical (same
bytes, same modification time), and reverting the edit plans nothing. Edits that fail late, in
the ranks of the train or evaluate job, get the run's previous outputs back (ddpflow.kept):
byte-identical; the report describes the edited config (the run did not finish, why, and
that its previous result is kept), and reverting plans only the report.

Real Snakemake, real submitit local jobs, 2 real gloo ranks, a real plug-in model.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
from test_rerun_loop import _start, _wait_for
from workflow_helpers import jobs_planned, snakemake, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# A model plug-in whose forward fails once a flag file exists, in training mode or in
# evaluation mode, on more samples than the login node's check uses (2): the same code (the
# same fingerprint) before and after, so only the ranks can fail it.
PLUGIN = """
import time
from pathlib import Path
from torch import nn


class Flaky(nn.Module):
    def __init__(self, shape, classes):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(shape[0] * shape[1] * shape[2], classes))

    def forward(self, x):
        flag = Path("FAIL_TRAIN" if self.training else "FAIL_EVAL")
        if flag.exists() and x.shape[0] > 2:
            raise RuntimeError(f"{flag} is set")
        if self.training and Path("SLOW_TRAIN").exists():  # time to stop it mid-training
            time.sleep(0.3)
        return self.net(x)


def build(input_shape, num_classes):
    return Flaky(input_shape, num_classes)
"""

BASE = {
    "model": {"name": "flaky:build"},
    # every rank samples its system use often enough to write its series in a short run
    "train": {"epochs": 2, "progress": False, "monitor": {"system_interval_s": 0.1}},
    "runs": [{"name": "r"}],
}
OUTPUTS = ("model.pt", "train_metrics.jsonl", "train_summary.json", "eval_metrics.json")


def _state(workdir: Path) -> dict[str, tuple[str, int]]:
    """sha256 and modification time (ns) of every file in the run's folder: its outputs,
    TensorBoard events, each rank's system series."""
    folder = workdir / "results/runs/r"
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    state = {
        str(p.relative_to(folder)): (
            hashlib.sha256(p.read_bytes()).hexdigest(),
            p.stat().st_mtime_ns,
        )
        for p in files
    }
    assert set(OUTPUTS) <= set(state) and any(k.startswith("tensorboard/") for k in state)
    assert any(k.startswith("system/rank-") for k in state), sorted(state)
    return state


def _edited(**sections) -> dict:
    config = json.loads(json.dumps(BASE))
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values}
    return config


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("kept")
    (workdir / "flaky.py").write_text(PLUGIN)
    configfile = write_config(workdir / "config.yaml", BASE)
    result = snakemake(workdir, configfile)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return workdir, configfile


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        ({"model": {"name": "resnet81"}}, "did you mean resnet18"),
        ({"model": {"name": "resnet50", "kwargs": {"widht": 2}}}, "widht"),
        ({"model": {"name": "flaky:missing"}}, "missing"),
        ({"train": {"global_batch_size": 4096}}, "staged training split has only"),
    ],
    ids=["unknown-model", "bad-kwargs", "missing-factory", "batch-too-large"],
)
def test_a_refusal_comes_before_any_job_and_touches_nothing(finished, edit, said):
    workdir, configfile = finished
    before = _state(workdir)
    edited = write_config(workdir / "edited.yaml", _edited(**edit))
    result = snakemake(workdir, edited)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "ddpflow: configuration error" in output and said in output, output[-3000:]
    assert "memory not estimated" not in output, output[-3000:]  # said once, as the refusal
    assert "Traceback" not in output
    assert "Select jobs to execute" not in output  # refused before any job
    assert _state(workdir) == before
    assert jobs_planned(workdir, configfile) == set()


@pytest.mark.parametrize("stage", ["TRAIN", "EVAL"])
def test_a_late_failure_gives_the_finished_run_back(finished, stage):
    """The ranks fail on an edited config (a retrain, or a re-evaluation): Snakemake removed
    the outputs to redo them; they come back byte-identical, the report written after the
    failure describes the edited config (the run did not finish: why, and that the previous
    result is kept), the edit is retried by the next run, and reverting it plans nothing."""
    workdir, configfile = finished
    before = _state(workdir)
    edit = (
        {"train": {"optimizer": {"lr": 0.02}}} if stage == "TRAIN" else {"eval": {"batch_size": 64}}
    )
    edited = write_config(workdir / "edited.yaml", _edited(**edit))
    flag = workdir / f"FAIL_{stage}"
    flag.touch()
    try:
        result = snakemake(workdir, edited)
    finally:
        flag.unlink()
    output = result.stdout + result.stderr
    assert result.returncode != 0 and f"FAIL_{stage} is set" in output, output[-3000:]
    rule = "train" if stage == "TRAIN" else "evaluate"
    assert f"run 'r': its {rule} rule failed; the run's previous" in output
    assert _state(workdir) == before
    assert not (workdir / "results/runs/r/.kept").exists()
    assert jobs_planned(workdir, edited) >= {rule}  # the edit is not forgotten
    # the report written after the failure is redone for the reverted config, nothing else;
    # it carries its true date (Snakemake's record says incomplete, not a date of 1970)
    assert (workdir / "results/report/report.md").stat().st_mtime > time.time() - 600
    assert jobs_planned(workdir, configfile) == {"report", "all"}
    report = _summary(workdir)
    assert report["runs"] == []
    (entry,) = report["unfinished"]
    assert entry["run"] == "r" and entry["stage"] == rule, entry
    assert f"FAIL_{stage} is set" in entry["cause"], entry
    assert "the previous config's result is kept in" in entry["cause"], entry


def _summary(workdir: Path) -> dict:
    return json.loads((workdir / "results/report/summary.json").read_text())


def test_a_failed_staging_reports_this_config(finished):
    """A run added with an unreadable data.path: its staging fails, and the report afterwards
    is this config's (the finished run, and the added one with the cause), not the last
    one's. (A path that does not exist is refused before anything runs.)"""
    workdir, configfile = finished
    before = _state(workdir)
    (workdir / "broken.npz").write_bytes(b"not an npz")
    own = {"name": "own", "data": {"source": "npz", "path": "broken.npz"}}
    added = {**BASE, "runs": [*BASE["runs"], own]}
    result = snakemake(workdir, write_config(workdir / "added.yaml", added))
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert (
        "ddpflow: run 'own' did not finish (stage failed: data.path broken.npz: not a "
        "readable .npz file" in output
    ), output[-3000:]
    assert "ddpflow: report of the 1 finished of 2 runs" in output, output[-3000:]
    report = _summary(workdir)
    assert [run["run"] for run in report["runs"]] == ["r"]
    (own,) = report["unfinished"]
    assert (own["run"], own["stage"]) == ("own", "stage") and own["log"].startswith("logs/stage/")
    assert _state(workdir) == before


def test_a_stopped_retrain_is_interrupted_and_gives_the_finished_run_back(finished):
    """Ctrl-C while the finished run retrains on an edited config: its outputs come back
    byte-identical, and the terminal and the report say it was interrupted, where, what is
    kept and the command that goes on (not 'failed ... fix the cause')."""
    workdir, configfile = finished
    before = _state(workdir)
    edited = write_config(workdir / "edited.yaml", _edited(train={"optimizer": {"lr": 0.03}}))
    (workdir / "SLOW_TRAIN").touch()
    started, ckpts = time.time(), workdir / "results/work/r/checkpoints"
    try:
        proc = _start(workdir, edited, "stopped.out")
        _wait_for(
            lambda: any(p.stat().st_mtime > started for p in ckpts.glob("ckpt-*.pt")),
            proc,
            "the retraining's first checkpoint",
        )
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal
        assert proc.wait(timeout=90) != 0
    finally:
        (workdir / "SLOW_TRAIN").unlink()
    output = (workdir / "stopped.out").read_text()
    assert "Traceback" not in output and "fix the cause" not in output, output[-3000:]
    assert "run 'r': its train rule was interrupted; the run's previous model.pt" in output
    assert "ddpflow: run 'r': train interrupted after epoch 1 of 2; its checkpoint (step " in output
    assert "is kept; the same command continues it: " in output
    assert _state(workdir) == before
    (entry,) = _summary(workdir)["unfinished"]
    assert entry["run"] == "r" and entry["interrupted"] and entry["stage"] == "train"
    assert jobs_planned(workdir, configfile) == {"report", "all"}  # reverted: nothing retrains
