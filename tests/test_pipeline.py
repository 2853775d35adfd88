"""pipeline.run_rule: a user-fixable error (ddpflow.errors.UserError and its subclasses) is
reported in one block without a traceback, anything else keeps its traceback."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys

import pytest
from ddpflow import pipeline
from ddpflow.cluster.launch import LaunchError
from ddpflow.config import ConfigError
from ddpflow.data.staged import DataError
from ddpflow.errors import ReportInputError
from workflow_helpers import REPO


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
    from ddpflow.cluster import launch
    from ddpflow.paths import RunPaths
    from ddpflow.training.entry import TrainTask
    from workflow_helpers import make_run

    run = make_run(train={"progress": False}, results_dir=str(tmp_path / "results"))
    paths = RunPaths.for_run(run["results_dir"], run)
    record = tmp_path / "train-job.json"
    with pytest.raises(launch.LaunchError, match="does not exist"):
        request = launch.JobRequest("local", run["machine"], tmp_path / "logs", "t")
        launch.launch(TrainTask(run, paths), request, launch.JobWatch(record, "f"))
    assert not record.exists()


def test_epoch_progress_logs_each_new_epoch_once(tmp_path, caplog):
    import json

    from ddpflow.progress import EpochProgress
    from workflow_helpers import make_run

    def line(epoch):
        record = {"epoch": epoch, "train_loss": 0.5, "val_accuracy": 0.9,
                  "samples_per_s": 1000.0, "seconds": {"epoch": 2.0}}  # fmt: skip
        return json.dumps(record) + "\n"

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(line(1))  # an earlier attempt's epoch: not news
    run = make_run(train={"epochs": 4})
    progress = EpochProgress(run, metrics)
    with caplog.at_level("INFO", logger="ddpflow.pipeline"):
        progress()
        with open(metrics, "a") as handle:
            handle.write(line(2) + line(3)[:20])  # epoch 3 half written
        progress()
        with open(metrics, "a") as handle:
            handle.write(line(3)[20:])
        progress()
        progress()
    lines = [r.message for r in caplog.records if "epoch" in r.message]
    assert len(lines) == 2, lines
    assert lines[0].startswith("run 'default' epoch 2/4: train loss 0.5000, val accuracy 0.9000")
    assert "about 4 s left" in lines[0] and "about 2 s left" in lines[1]


def test_progress_in_a_log_file_is_whole_lines(caplog):
    """Rank 0's progress where stderr is a file: log lines, never a bar's carriage returns;
    a resumed epoch's rate counts only the steps run since."""
    from ddpflow.training.progress_bar import LineProgress

    progress = LineProgress(total=10, desc="epoch 2", interval=0.0)
    with caplog.at_level(logging.INFO, logger="ddpflow.training.progress_bar"):
        progress.update(4)  # resumed at step 4
        progress.update(1)
        progress.update(5)  # the last step: the epoch's own line follows, not this one
        progress.close()
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("epoch 2: step 5/10 (50%), ") and "step/s" in line, line
    assert "\r" not in line


def test_the_train_rule_checks_a_built_in_model_without_importing_torch():
    """The train rule's checks before submission (batch fits, model, how the data is read)
    import no torch for a built-in model: torch's import is ~1.2 s of every train rule on
    the CI machine, paid again by every rank (a regression of this cost ddpflow its end-to-end
    race against a Lightning script: bench/end_to_end.py)."""
    code = (
        "import sys\n"
        "from ddpflow import config, pipeline\n"
        "run = config.resolve_runs(config.load(None, {}))[0]\n"
        "manifest = {'shape': [1, 8, 8], 'num_classes': 10,\n"
        "            'sizes': {'train': 1294, 'val': 144, 'test': 359}}\n"
        "config.check_batch_fits(run, manifest['sizes']['train'])\n"
        "pipeline._check_user_model(run, manifest)\n"
        "pipeline._say_how_data_is_read(run, manifest)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchvision'))[:3])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


def test_python_m_ddpflow_report_imports_no_torch(tmp_path):
    """`python -m ddpflow report` builds the report in one process without torch (the
    ranks' commands import it when they run): a second saved on every report."""
    shutil.copytree(REPO / "config", tmp_path / "config")
    code = (
        "import sys\n"
        "sys.argv = ['ddpflow', 'report']\n"
        "from ddpflow.__main__ import main\n"
        "assert main() == 0\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchvision'))[:3])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout
    assert (tmp_path / "results/report/report.html").is_file()


def test_a_global_batch_that_leaves_much_of_a_small_split_out_is_warned_about(caplog):
    """An epoch is whole global batches: 105 samples in steps of 64 leave 41 out of each
    epoch; the warning names a smaller global batch the 2 ranks can split (32 = 2 x 16)."""
    from ddpflow.config import warn_what_sits_out
    from workflow_helpers import make_run

    caplog.set_level(logging.WARNING, logger="ddpflow.checks.batch")
    warn_what_sits_out(make_run(train={"micro_batch_size": 16}), 105)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "global_batch_size 64 leaves 41 of the 105 training samples out" in warning
    assert "a smaller global batch (e.g. 32)" in warning
    caplog.clear()
    warn_what_sits_out(make_run(), 105)  # micro 32 x 2 ranks: no smaller global batch splits
    assert "a smaller global and micro batch" in caplog.records[0].getMessage()
    caplog.clear()
    warn_what_sits_out(make_run(), 1294)  # the digits: 14 of 1294 sit out, no warning
    assert caplog.records == []
