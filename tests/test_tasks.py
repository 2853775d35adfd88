"""Tasks (ddpflow.task): what each stages from real npz files, what is refused and where, the
fingerprints (classification's are those of the runs trained before tasks existed), and your
own task (config/examples/my_task.py) through staging and an evaluation. The tasks at 1, 2
and 4 real gloo ranks are in test_world_size.py; through the workflow in test_tasks_e2e.py."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ddpflow import config as ddpconfig
from ddpflow.cluster.distenv import discover
from ddpflow.config.schema import ConfigError
from ddpflow.data.raw import DataError
from ddpflow.data.staged import load_split
from ddpflow.data.staging import stage_dataset
from ddpflow.task import TaskError, get_task
from ddpflow.training import evaluate
from ddpflow.training.rankdata import Split
from workflow_helpers import REPO, make_run

GOLDEN = Path(__file__).parent / "golden" / "fingerprints.json"


def _images(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """8x8 images with a random subset of their 4 quadrants lit, and which ones (bool [n, 4])."""
    rng = np.random.default_rng(seed)
    lit = rng.random((n, 4)) < 0.5
    x = rng.integers(0, 100, (n, 8, 8))
    for q in range(4):
        r, c = divmod(q, 2)
        x[lit[:, q], 4 * r : 4 * r + 4, 4 * c : 4 * c + 4] += 120
    return x.astype(np.uint8), lit


def _staged(tmp_path, task: str, task_kwargs=None, **arrays):
    np.savez(tmp_path / "d.npz", **arrays)
    extra = {"task_kwargs": task_kwargs} if task_kwargs else {}
    run = make_run(task=task, data={"source": "npz", "path": str(tmp_path / "d.npz")}, **extra)
    return run, stage_dataset(run["data"], tmp_path / "staged", seed=0)


def test_multilabel_stages_label_vectors_with_their_names_and_counts(tmp_path):
    x, lit = _images(200)
    names = np.array(["top left", "top right", "bottom left", "bottom right"])
    run, manifest = _staged(tmp_path, "multilabel", train_images=x, train_labels=lit,
                            class_names=names)  # fmt: skip
    assert run["data"]["task"] == "multilabel" and manifest["task"] == "multilabel"
    assert manifest["class_names"] == names.tolist() and manifest["num_classes"] == 4
    assert "class_counts" not in manifest
    _, y, _ = load_split(tmp_path / "staged", "train")
    assert y.dtype == torch.uint8 and y.shape == (manifest["sizes"]["train"], 4)
    assert manifest["label_counts"]["train"] == y.sum(dim=0).tolist()
    assert sum(manifest["sizes"].values()) == 200  # a seeded random split, nothing lost


def test_regression_stages_float_targets_with_the_train_statistics(tmp_path):
    x, _ = _images(300)
    y = x.reshape(300, -1).mean(axis=1).astype(np.float64) / 7.0 + 1000.0  # far from 0
    run, manifest = _staged(tmp_path, "regression", train_images=x, train_labels=y)
    assert manifest["class_names"] == ["target"] and manifest["num_classes"] == 1
    _, staged, _ = load_split(tmp_path / "staged", "train")
    assert staged.dtype == torch.float32 and staged.shape == (manifest["sizes"]["train"], 1)
    assert manifest["target_mean"] == pytest.approx([staged.double().mean().item()], rel=1e-12)
    assert manifest["target_std"] == pytest.approx([staged.double().std(unbiased=False).item()])


@pytest.mark.parametrize(
    ("task", "labels", "expected"),
    [
        ("multilabel", np.arange(40) % 4,
         r"task multilabel: data.path .*train_labels holds one class per sample; it needs a "
         r"0/1 vector per sample \[n, K\].*task: classification"),
        ("multilabel", np.full((40, 3), 2),
         r"task multilabel: .*holds 2 at sample 0, label 0; every entry is 0 or 1"),
        ("multilabel", np.zeros((40, 3), np.float32), r"has dtype float32; give 0/1 as uint8"),
        ("regression", np.where(np.arange(40) == 7, np.nan, 1.0),
         r"task regression: .*holds 1 NaN or infinite values \(the first at sample 7\)"),
        ("regression", np.array(["a"] * 40), r"task regression: .*it needs numbers"),
    ],
)  # fmt: skip
def test_targets_that_do_not_fit_the_task_are_refused_naming_it(tmp_path, task, labels, expected):
    x, _ = _images(40)
    with pytest.raises(DataError, match=expected):
        _staged(tmp_path, task, train_images=x, train_labels=labels)
    assert not (tmp_path / "staged").exists()


def test_names_must_match_the_label_count(tmp_path):
    x, lit = _images(40)
    with pytest.raises(DataError, match="4 labels per sample but 2 class_names"):
        _staged(tmp_path, "multilabel", train_images=x, train_labels=lit,
                class_names=np.array(["a", "b"]))  # fmt: skip


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"task": "regression", "data": {"source": "image_folder", "root": "x"}},
         r"task 'regression' on data.source image_folder, which holds class folders"),
        ({"task": "multilabel", "data": {"source": "synthetic"}},
         r"task 'multilabel' on data.source synthetic, which holds one "
         r"class per image \(the built-in synthetic\)"),
        ({"task": "segmentation"}, r"task 'segmentation': not a task; use one of classification"),
        ({"task": "multilabel", "task_kwargs": {"threshold": 1.5}},
         r"task_kwargs.threshold 1.5: a probability strictly between 0 and 1"),
        ({"task": "regression", "task_kwargs": {"loss": "l1"}},
         r"task_kwargs.loss 'l1': one of mse, huber"),
        ({"task": "regression", "task_kwargs": {"treshold": 0.5}},
         r"task_kwargs \['treshold'\]: task regression takes loss and huber_delta"),
    ],
)  # fmt: skip
def test_a_task_that_cannot_run_is_refused_while_the_config_is_read(config, expected):
    config.setdefault("data", {"source": "npz", "path": "x.npz"})
    with pytest.raises(ConfigError, match=expected):
        ddpconfig.load(None, config)


def test_classification_keeps_the_fingerprints_of_the_runs_trained_before_tasks():
    """The shipped configs' staged-data ids, stage params, training and evaluation
    fingerprints, as the main before tasks computed them (tests/golden/fingerprints.json):
    a finished run plans nothing after the upgrade."""
    golden = json.loads(GOLDEN.read_text())
    now = {}
    for key in golden:
        path, name = key.rsplit(":", 1)
        config = ddpconfig.load(REPO / path, {"launcher": "slurm"})
        run = next(r for r in ddpconfig.resolve_runs(config) if r["name"] == name)
        now[key] = json.loads(json.dumps({
            "training": ddpconfig.training_fingerprint(run),
            "evaluation": ddpconfig.evaluation_fingerprint(run),
            "dataset_id": run["dataset_id"],
            "stage_params": ddpconfig.stage_params(run["data"]),
        }, default=str))  # fmt: skip
    assert now == golden


def test_what_of_a_task_redoes_what():
    def outcome(**top):
        run = make_run(data={"source": "npz", "path": "x.npz"}, **top)
        return (run["dataset_id"], ddpconfig.training_fingerprint(run),
                ddpconfig.evaluation_fingerprint(run))  # fmt: skip

    plain = outcome()
    multilabel = outcome(task="multilabel")
    assert multilabel[0] != plain[0]  # restaged: the targets are staged another way
    other = outcome(task="multilabel", task_kwargs={"threshold": 0.3})
    assert other[:2] == multilabel[:2] and other[2] != multilabel[2]  # re-evaluated only
    mse, huber = (
        outcome(task="regression"),
        outcome(task="regression", task_kwargs={"loss": "huber"}),
    )
    assert huber[0] == mse[0] and huber[1] != mse[1]  # retrained, not restaged
    assert outcome(task="classification") == plain


@pytest.fixture
def my_task(tmp_path, monkeypatch):
    """config/examples/my_task.py in a working directory, as the docs say to put it."""
    shutil.copy(REPO / "config/examples/my_task.py", tmp_path / "my_task.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_task", None)


def test_your_own_task_stages_and_scores_through_its_sums(my_task):
    x, lit = _images(240)
    labels = lit.sum(axis=1)  # 0..4 quadrants lit: 5 classes
    np.savez("d.npz", train_images=x, train_labels=labels)
    run = make_run(task="my_task:top_k", task_kwargs={"k": 2},
                   data={"source": "npz", "path": "d.npz"})  # fmt: skip
    assert run["data"]["task_kwargs"] == {"k": 2}  # a plug-in task's kwargs stage its data
    assert "task_sha256" in ddpconfig.training_fingerprint(run)
    manifest = stage_dataset(run["data"], my_task / "staged", seed=0)
    assert manifest["task"] == "top_k" and manifest["target_dtype"] == "int64"
    _, y, _ = load_split(my_task / "staged", "test")
    task = get_task("my_task:top_k", {"k": 2})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 5))
    images = torch.from_numpy(x[: len(y), None])  # any images: [n, 1, 8, 8]
    norm = (torch.tensor(0.3).view(1, 1, 1, 1), torch.tensor(0.3).view(1, 1, 1, 1))
    scoring = evaluate.Scoring(task, manifest, norm, batch_size=7)
    result = evaluate.evaluate_split(model, Split(images, y), scoring, discover({}))
    with torch.no_grad():
        outputs = model(evaluate.normalize(images, *norm))
    top2 = (outputs.topk(2, dim=1).indices == y[:, None]).any(dim=1).float().mean().item()
    assert result["samples_evaluated"] == len(y)
    assert result["top_k_accuracy"] == pytest.approx(top2)
    assert task.validation(result)["val_top_k_accuracy"] == result["top_k_accuracy"]


def test_a_plug_in_task_that_breaks_its_protocol_is_named(my_task):
    Path("bad_task.py").write_text("def make():\n    return object()\n")
    with pytest.raises(TaskError, match=r"task 'bad_task:make': the function returned a "
                       r"object without name, selection, stage_targets"):  # fmt: skip
        get_task("bad_task:make")
    sys.modules.pop("bad_task", None)
