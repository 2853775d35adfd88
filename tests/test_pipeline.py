"""pipeline.run_rule: a user-fixable error (ddpflow.errors.UserError and its subclasses) is
reported in one block without a traceback, anything else keeps its traceback."""

from __future__ import annotations

import pytest
from ddpflow import pipeline
from ddpflow.config import ConfigError
from ddpflow.data import DataError
from ddpflow.errors import ReportInputError
from ddpflow.launch import LaunchError


@pytest.mark.parametrize("error", [ConfigError, DataError, LaunchError, ReportInputError])
def test_user_errors_are_one_block_without_traceback(tmp_path, error):
    def rule():
        raise error("train.batch_size: 0 is less than the minimum of 1")

    log_file = tmp_path / "rule.log"
    with pytest.raises(SystemExit) as exit_info:
        pipeline.run_rule(rule, str(log_file))
    assert exit_info.value.code == 1
    text = log_file.read_text()
    assert "rule failed:\ntrain.batch_size: 0 is less than the minimum of 1" in text
    assert "Traceback" not in text


def test_other_errors_keep_their_traceback(tmp_path):
    def rule():
        raise ValueError("a bug, not the user's config")

    log_file = tmp_path / "rule.log"
    with pytest.raises(ValueError, match="a bug"):
        pipeline.run_rule(rule, str(log_file))
    text = log_file.read_text()
    assert "Traceback (most recent call last)" in text and "a bug" in text


def test_a_failed_job_forgets_its_record_so_a_retry_submits_anew(tmp_path):
    """Snakemake retries a failed rule (profiles/slurm: retries: 1): the retry must submit a
    new job, not reattach to the failed one and read its failure again. Real local job: the
    ranks fail because the staged data do not exist."""
    from ddpflow import launch
    from ddpflow.paths import RunPaths
    from ddpflow.tasks import TrainTask
    from workflow_helpers import make_run

    run = make_run(train={"progress": False}, results_dir=str(tmp_path / "results"))
    paths = RunPaths.for_run(run["results_dir"], run)
    record = tmp_path / "train-job.json"
    with pytest.raises(launch.LaunchError, match="does not exist"):
        launch.launch(
            TrainTask(run, paths), "local", run["machine"], tmp_path / "logs", "t", record, "f"
        )
    assert not record.exists()
