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


def _fingerprints(run: dict) -> dict:
    return json.loads(json.dumps({
        "training": ddpconfig.training_fingerprint(run),
        "evaluation": ddpconfig.evaluation_fingerprint(run),
        "dataset_id": run["dataset_id"],
        "stage_params": ddpconfig.stage_params(run["data"]),
    }, default=str))  # fmt: skip


def test_classification_keeps_the_fingerprints_of_the_runs_trained_before_tasks():
    """The shipped configs' and own data's staged-data ids, stage params, training and
    evaluation fingerprints, as the main before tasks computed them (tests/golden/
    fingerprints.json): a finished run plans nothing after the upgrade."""
    golden = json.loads(GOLDEN.read_text())
    now = {}
    for key in golden["shipped"]:
        path, name = key.rsplit(":", 1)
        config = ddpconfig.load(REPO / path, {"launcher": "slurm"})
        run = next(r for r in ddpconfig.resolve_runs(config) if r["name"] == name)
        now[key] = _fingerprints(run)
    assert now == golden["shipped"]
    for data in golden["own_data"]:  # files that do not exist: a listing of "missing"
        run = make_run(data=json.loads(data))
        assert _fingerprints(run) == golden["own_data"][data], data


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


# --- an image folder with a labels table (data.labels_csv) ---------------------------------


def _labelled_folder(tmp_path, rows: int = 30) -> tuple[Path, list[str]]:
    """my_images/train/NNN.png (and 6 under test/): each image's red and blue halves on or
    off, which a table of labels (red, blue) or targets (brightness) describes."""
    from PIL import Image

    rng = np.random.default_rng(0)
    lines = []
    for i in range(rows + 6):
        split = "test" if i >= rows else "train"
        red, blue = rng.random(2) < 0.5
        pixels = rng.integers(0, 60, (24, 24, 3), dtype=np.uint8)
        pixels[:, :12, 0] += np.uint8(180 * red)
        pixels[:, 12:, 2] += np.uint8(180 * blue)
        (tmp_path / "my_images" / split).mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(tmp_path / "my_images" / split / f"{i:03d}.png")
        lines.append((f"{split}/{i:03d}.png", int(red), int(blue), float(pixels.mean())))
    return tmp_path / "my_images", lines


def _table(path: Path, header: str, rows) -> Path:
    path.write_text(header + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))
    return path


def _folder_run(tmp_path, task: str, table: Path) -> dict:
    data = {"source": "image_folder", "root": str(tmp_path / "my_images"),
            "image_size": [16, 16], "labels_csv": str(table)}  # fmt: skip
    return make_run(task=task, data=data)


def test_an_image_folder_with_a_labels_table_stages_labels_or_targets(tmp_path):
    root, lines = _labelled_folder(tmp_path)
    labels = _table(tmp_path / "labels.csv", "path,red,blue", [r[:3] for r in lines])
    run = _folder_run(tmp_path, "multilabel", labels)
    manifest = stage_dataset(run["data"], tmp_path / "tags", seed=0)
    assert manifest["class_names"] == ["red", "blue"] and manifest["sizes"]["test"] == 6
    _, y, _ = load_split(tmp_path / "tags", "test")  # the official test split, in order
    assert y.tolist() == [[r[1], r[2]] for r in lines[-6:]]
    targets = _table(tmp_path / "targets.csv", "path,brightness", [(r[0], r[3]) for r in lines])
    run = _folder_run(tmp_path, "regression", targets)
    manifest = stage_dataset(run["data"], tmp_path / "values", seed=0)
    _, y, _ = load_split(tmp_path / "values", "test")
    assert y[:, 0].tolist() == pytest.approx([r[3] for r in lines[-6:]])
    before = run["dataset_id"]
    _table(targets, "path,brightness", [(r[0], r[3] + 1) for r in lines])  # edited targets
    assert _folder_run(tmp_path, "regression", targets)["dataset_id"] != before


def test_every_problem_of_a_labels_table_is_named_at_once(tmp_path):
    _, lines = _labelled_folder(tmp_path, rows=4)
    rows = [r[:3] for r in lines] + [("train/missing.png", 1, 0), (lines[0][0], 0, 0),
                                     ("train/new.png", "x", 1), ("train/002.png", 1)]  # fmt: skip
    table = _table(tmp_path / "labels.csv", "path,red,blue", rows)
    with pytest.raises(DataError) as err:
        stage_dataset(_folder_run(tmp_path, "multilabel", table)["data"], tmp_path / "s", 0)
    text = str(err.value)
    assert "4 problems, nothing was staged" in text
    assert "labels.csv:12: " in text and "missing.png does not exist" in text
    assert f"labels.csv:13: {lines[0][0]} again (first on line 2)" in text
    assert "labels.csv:14: a value that is not a number" in text
    assert "labels.csv:15: 2 columns, the header has 3" in text


def test_a_labels_table_under_classification_is_refused_at_parse(tmp_path):
    with pytest.raises(ConfigError, match=r"data.labels_csv 'l.csv' gives an image folder's "
                       r"targets under task multilabel or regression \(here: task "
                       r"classification"):  # fmt: skip
        make_run(data={"source": "image_folder", "root": "x", "labels_csv": "l.csv"})


def test_each_task_says_what_a_prediction_is():
    """The form a prediction takes (a later `snakemake predict` writes it): a class name and
    its probability with the top classes; the labels over the threshold; a target's value."""
    outputs = torch.tensor([[2.0, 0.0, -1.0], [-3.0, 1.0, 4.0]])
    names = {"class_names": ["a", "b", "c"]}
    first, second = get_task("classification").predictions(outputs, names)
    assert first["prediction"] == "a" and second["prediction"] == "c"
    assert first["score"] == pytest.approx(outputs[0].softmax(0)[0].item())
    assert [name for name, _ in first["top_k"]] == ["a", "b", "c"]
    tags = get_task("multilabel", {"threshold": 0.6}).predictions(outputs, names)
    assert [t["prediction"] for t in tags] == [["a"], ["b", "c"]]  # sigmoid(0) = 0.5 < 0.6
    assert tags[0]["score"] == pytest.approx(0.5)  # the least certain label: p 0.5
    stats = {"target_mean": [10.0], "target_std": [2.0]}
    values = get_task("regression").predictions(torch.tensor([[1.5], [-0.5]]), stats)
    assert [v["prediction"] for v in values] == [13.0, 9.0]
