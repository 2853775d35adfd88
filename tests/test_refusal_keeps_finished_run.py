"""A refusal never deletes finished work (issue: nothing lost, nothing silent).

A finished run, then edits that only a rule could refuse before: a model that cannot be built,
a model that cannot take the data, a global batch larger than the staged split. Each is now
refused while Snakemake parses, before any job: the run's files stay byte-identical (same
bytes, same modification time), and reverting the edit plans nothing. Edits that fail late, in
the ranks of the train or evaluate job, get the run's previous outputs back (ddpflow.kept):
byte-identical, the report still shows the run finished, and reverting plans nothing.

Real Snakemake, real submitit local jobs, 2 real gloo ranks, a real plug-in model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from workflow_helpers import jobs_planned, snakemake, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# A model plug-in whose forward fails once a flag file exists, in training mode or in
# evaluation mode, on more samples than the login node's check uses (2): the same code (the
# same fingerprint) before and after, so only the ranks can fail it.
PLUGIN = """
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
        return self.net(x)


def build(input_shape, num_classes):
    return Flaky(input_shape, num_classes)
"""

BASE = {
    "model": {"name": "flaky:build"},
    "train": {"epochs": 2, "progress": False},
    "runs": [{"name": "r"}],
}
OUTPUTS = ("model.pt", "train_metrics.jsonl", "train_summary.json", "eval_metrics.json")


def _state(workdir: Path) -> dict[str, tuple[str, int]]:
    """sha256 and modification time (ns) of the run's outputs."""
    folder = workdir / "results/runs/r"
    return {
        name: (
            hashlib.sha256((folder / name).read_bytes()).hexdigest(),
            (folder / name).stat().st_mtime_ns,
        )  # fmt: skip
        for name in OUTPUTS
    }


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
    assert "Traceback" not in output
    assert "Select jobs to execute" not in output  # refused before any job
    assert _state(workdir) == before
    assert jobs_planned(workdir, configfile) == set()


@pytest.mark.parametrize("stage", ["TRAIN", "EVAL"])
def test_a_late_failure_gives_the_finished_run_back(finished, stage):
    """The ranks fail on an edited config (a retrain, or a re-evaluation): Snakemake removed
    the outputs to redo them; they come back byte-identical, the report written after the
    failure shows the run finished, the edit is retried by the next run, and reverting it
    plans nothing."""
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
    assert jobs_planned(workdir, configfile) == set()
    report = json.loads((workdir / "results/report/summary.json").read_text())
    assert [run["run"] for run in report["runs"]] == ["r"] and not report["unfinished"]
