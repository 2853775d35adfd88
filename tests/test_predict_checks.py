"""`snakemake predict`'s refusals before any job: a run whose task cannot predict (a plug-in
task without predictions(): the shipped config/examples/my_task.py less that method; a
language model) and an
input image that does not decode are refused once, while Snakemake plans, naming the fix;
the ranks' own checks stay behind them. One real dry run proves the workflow stops there.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from datafixtures import make_folder
from ddpflow.config import ConfigError
from ddpflow.predict import DECODED, check_can_predict, check_decodes, list_input
from workflow_helpers import REPO, make_run, snakemake, write_config

MY_TASK = {"task": "no_predictions:top_k", "task_kwargs": {"k": 2}}
# the shipped plug-in task less its optional predictions(): the protocol's default, none
NO_PREDICTIONS = """from ddpflow.task.base import Task
from my_task import TopK


class NoPredictions(TopK):
    predictions = Task.predictions


def top_k(k=3):
    return NoPredictions(k)
"""


@pytest.fixture
def my_task(in_workdir: Path) -> Path:
    """The shipped plug-in task, copied where the docs say (the working directory), and a
    module of the same task without predictions()."""
    shutil.copy(REPO / "config/examples/my_task.py", in_workdir)
    (in_workdir / "no_predictions.py").write_text(NO_PREDICTIONS)
    np.savez(in_workdir / "arrays.npz", images=np.zeros((40, 8, 8, 1), np.uint8),
             labels=np.arange(40) % 4)  # fmt: skip
    return in_workdir


def test_a_task_without_predictions_is_refused_naming_the_method(my_task):
    run = make_run(**MY_TASK, data={"source": "npz", "path": "arrays.npz"})
    with pytest.raises(ConfigError) as info:
        check_can_predict(run)
    message = str(info.value)
    for part in ("run 'default'", "'no_predictions:top_k' (top_k)",
                 "does not say what a prediction", "optional: without it",
                 "predictions(self, outputs, manifest) -> list[dict]",
                 "trains, evaluates and reports", "predict.runs"):  # fmt: skip
        assert part in message, message
    check_can_predict(make_run())  # classification predicts
    data = {"source": "npz", "path": "arrays.npz"}
    check_can_predict(make_run(task="my_task:top_k", task_kwargs={"k": 2}, data=data))


def test_a_language_model_is_refused():
    run = {"name": "lm", "task": "language_model"}
    with pytest.raises(ConfigError, match="run 'lm' is a language model"):
        check_can_predict(run)


def test_snakemake_predict_refuses_the_plugin_task_before_any_job(my_task):
    config = write_config(my_task / "config.yaml", {
        **MY_TASK, "data": {"source": "npz", "path": "arrays.npz"},
        "predict": {"input": "arrays.npz"},
    })  # fmt: skip
    refused = snakemake(my_task, config, "-n", "predict")
    assert refused.returncode != 0
    assert "does not say what a prediction is" in refused.stderr, refused.stderr[-3000:]
    assert refused.stderr.count("does not say what a prediction is") == 1
    assert snakemake(my_task, config, "-n").returncode == 0  # training it is fine


def test_an_image_that_does_not_decode_is_named_once_and_a_good_folder_is_read_once(tmp_path):
    folder = make_folder(tmp_path / "new", per_class=(3, 0))
    predict = {"input": str(folder), "on_corrupt": "fail"}
    cache = tmp_path / "cache"
    good = list_input(predict)
    check_decodes(good, predict, cache)
    assert (cache / DECODED).is_file()
    (folder / "train/red/001.jpg").write_bytes(b"not an image")
    truncated = folder / "train/green/000.png"
    truncated.write_bytes(truncated.read_bytes()[:60])
    listing = list_input(predict)
    with pytest.raises(ConfigError) as info:
        check_decodes(listing, predict, cache)
    message = str(info.value)
    assert "2 inputs could not be read: train/green/000.png: " in message, message
    assert "; train/red/001.jpg: cannot identify image file" in message
    assert "predict.on_corrupt: skip" in message
    check_decodes(listing, {**predict, "on_corrupt": "skip"}, cache)  # the ranks skip them
