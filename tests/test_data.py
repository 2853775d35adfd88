"""Unit tests of dataset staging and loading (ddpflow.data.staging, .staged, .sources).

Real digits from scikit-learn; MNIST-like and CIFAR from tiny files in torchvision's own
on-disk formats (tests/datafixtures.py) read by the real torchvision loaders; synthetic.
"""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest
import torch
from datafixtures import class_images, trust_cifar_fixture, write_cifar, write_mnist_like
from ddpflow.data import staged as ddata
from ddpflow.data import staging
from ddpflow.data.staged import DataError, load_split, verify_staged
from ddpflow.data.staging import stage_dataset

N_TRAIN, N_TEST = 200, 50


def make_cfg(source: str, root, **overrides) -> dict:
    cfg = {
        "source": source,
        "root": str(root),
        "download": False,
        "val_fraction": 0.1,
        "test_fraction": 0.2,
        "max_train_samples": None,
        "synthetic": {
            "channels": 1,
            "height": 8,
            "width": 8,
            "num_classes": 10,
            "train_size": 400,
            "test_size": 100,
            "noise": 0.5,
        },
    }
    cfg.update(overrides)
    return cfg


def write_fixture(source: str, root, monkeypatch) -> None:
    if source in ("mnist", "fashion_mnist"):
        write_mnist_like(root, "MNIST" if source == "mnist" else "FashionMNIST", N_TRAIN, N_TEST)
    else:
        trust_cifar_fixture(monkeypatch, source, write_cifar(root, source, N_TRAIN, N_TEST))


def load_all(staged) -> dict:
    return {s: load_split(staged, s)[:2] for s in ddata.SPLITS}


def row_set(images) -> set[bytes]:
    return {row.tobytes() for row in images.numpy()}


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits") / "staged"
    stage_dataset(make_cfg("digits", out.parent / "raw"), out, seed=0)
    return out


def test_digits_round_trip(digits_dir):
    manifest = verify_staged(digits_dir)
    assert manifest["format_version"] == ddata.FORMAT_VERSION
    assert manifest["shape"] == [1, 8, 8] and manifest["num_classes"] == 10
    assert sum(manifest["sizes"].values()) == 1797
    assert manifest["sizes"]["test"] == round(0.2 * 1797)
    assert set(manifest["files"]) == {
        f"{s}_{k}.npy" for s in ddata.SPLITS for k in ("images-00000", "labels")
    }
    images, labels, _ = load_split(digits_dir, "train")
    assert images.dtype == torch.uint8 and labels.dtype == torch.int64
    assert images.shape == (len(labels), 1, 8, 8)
    assert int(images.max()) == 255 and int(images.min()) == 0
    mean = images.double().mean().item() / 255
    assert manifest["mean"][0] == pytest.approx(mean)
    assert manifest["std"][0] == pytest.approx(images.double().std(correction=0).item() / 255)


def test_digits_stratified(digits_dir):
    manifest = json.loads((digits_dir / "manifest.json").read_text())
    counts = {s: np.array(c) for s, c in manifest["class_counts"].items()}
    total = sum(counts.values())
    for split, c in counts.items():
        expected = total * manifest["sizes"][split] / total.sum()
        assert np.all(np.abs(c - expected) <= 1), split


@pytest.mark.parametrize("source", ["mnist", "fashion_mnist", "cifar10", "cifar100"])
def test_torchvision_sources_round_trip(source, tmp_path, monkeypatch):
    write_fixture(source, tmp_path / "raw", monkeypatch)
    manifest = stage_dataset(make_cfg(source, tmp_path / "raw"), tmp_path / "staged", seed=1)
    shape = (1, 28, 28) if "mnist" in source else (3, 32, 32)
    num_classes = 100 if source == "cifar100" else 10
    assert manifest["shape"] == list(shape) and manifest["num_classes"] == num_classes
    assert len(manifest["class_names"]) == num_classes
    assert manifest["sizes"] == {"train": 180, "val": 20, "test": N_TEST}
    splits = load_all(tmp_path / "staged")
    # The official test split passes through torchvision unchanged (layout: NCHW).
    test_x, test_y = class_images(N_TEST, shape[1:] if shape[0] == 1 else shape, num_classes, 0, 1)
    assert np.array_equal(splits["test"][0].numpy(), test_x.reshape(N_TEST, *shape))
    assert np.array_equal(splits["test"][1].numpy(), test_y)
    # val is carved from train: disjoint, and together exactly the fixture's train set.
    train_x, _ = class_images(N_TRAIN, shape[1:] if shape[0] == 1 else shape, num_classes, 0, 0)
    train_rows, val_rows = row_set(splits["train"][0]), row_set(splits["val"][0])
    assert not train_rows & val_rows
    assert train_rows | val_rows == {r.tobytes() for r in train_x.reshape(N_TRAIN, *shape)}


def test_synthetic_shape_sizes_and_learnable(tmp_path):
    synth = {**make_cfg("synthetic", tmp_path)["synthetic"], "channels": 3, "height": 6, "width": 5}
    cfg = make_cfg("synthetic", tmp_path, synthetic=synth)
    manifest = stage_dataset(cfg, tmp_path / "staged", seed=3)
    assert manifest["shape"] == [3, 6, 5]
    assert manifest["sizes"] == {"train": 360, "val": 40, "test": 100}
    splits = load_all(tmp_path / "staged")
    assert not row_set(splits["train"][0]) & row_set(splits["val"][0])
    # Nearest class mean on the train split must classify the test split well above chance.
    x, y = (t.numpy() for t in splits["train"])
    means = np.stack([x[y == k].reshape((y == k).sum(), -1).mean(0) for k in range(10)])
    tx, ty = (t.numpy() for t in splits["test"])
    dist = ((tx.reshape(len(tx), 1, -1) - means[None]) ** 2).sum(-1)
    assert (dist.argmin(1) == ty).mean() > 0.8


def test_deterministic_bytes(tmp_path):
    cfg = make_cfg("synthetic", tmp_path)
    a = stage_dataset(cfg, tmp_path / "a", seed=7)
    b = stage_dataset(cfg, tmp_path / "b", seed=7)
    c = stage_dataset(cfg, tmp_path / "c", seed=8)
    assert a["files"] == b["files"]
    assert (tmp_path / "a/manifest.json").read_bytes() == (
        tmp_path / "b/manifest.json"
    ).read_bytes()
    train = "train_images-00000.npy"
    assert a["files"][train]["sha256"] != c["files"][train]["sha256"]


def test_max_train_samples_caps_train_only(tmp_path):
    full = stage_dataset(make_cfg("digits", tmp_path), tmp_path / "full", seed=0)
    capped = stage_dataset(make_cfg("digits", tmp_path, max_train_samples=100), tmp_path / "cap", 0)
    assert capped["sizes"]["train"] == 100
    assert np.all(np.array(capped["class_counts"]["train"]) >= 9)  # stratified: 10 per class
    for name in ("val_images-00000.npy", "test_images-00000.npy"):
        assert capped["files"][name] == full["files"][name]
    train, _ = load_split(tmp_path / "full", "train")[:2]
    assert row_set(load_split(tmp_path / "cap", "train")[0]) <= row_set(train)


@pytest.mark.parametrize(
    ("source", "folder", "name"),
    [
        ("mnist", "MNIST/raw", "train-images-idx3-ubyte"),
        ("fashion_mnist", "FashionMNIST/raw", "t10k-labels-idx1-ubyte"),
        ("cifar10", "cifar-10-batches-py", "data_batch_1"),
        ("cifar100", "cifar-100-python", "meta"),
    ],
)
def test_missing_source_files_name_the_path(source, folder, name, tmp_path):
    with pytest.raises(DataError) as err:
        stage_dataset(make_cfg(source, tmp_path / "raw"), tmp_path / "staged", seed=0)
    msg = str(err.value)
    assert str(tmp_path / "raw" / folder) in msg and name in msg
    assert "data.download: true" in msg
    assert not (tmp_path / "staged").exists()


def test_corrupt_cifar_source_rejected_by_md5(tmp_path, monkeypatch):
    write_fixture("cifar10", tmp_path, monkeypatch)
    with open(tmp_path / "cifar-10-batches-py" / "test_batch", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(DataError, match="test_batch  <- md5 mismatch"):
        stage_dataset(make_cfg("cifar10", tmp_path), tmp_path / "staged", seed=0)


def test_mnist_gz_files_are_extracted(tmp_path):
    raw = write_mnist_like(tmp_path, "MNIST", N_TRAIN, N_TEST)
    for path in list(raw.iterdir()):
        with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
            dst.write(src.read())
        path.unlink()
    manifest = stage_dataset(make_cfg("mnist", tmp_path), tmp_path / "staged", seed=0)
    assert manifest["sizes"]["test"] == N_TEST


def flip_byte(path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupted_staged_file_detected(tmp_path):
    stage_dataset(make_cfg("synthetic", tmp_path), tmp_path / "s", seed=0)
    flip_byte(tmp_path / "s" / "val_images-00000.npy")
    with pytest.raises(DataError, match="val_images-00000.npy: sha256 mismatch"):
        load_split(tmp_path / "s", "val")
    with pytest.raises(DataError, match="sha256 mismatch"):
        verify_staged(tmp_path / "s")
    load_split(tmp_path / "s", "train")  # other splits stay usable
    load_split(tmp_path / "s", "val", verify=False)  # same size: only the hash can tell


def test_truncated_staged_file_detected(tmp_path):
    stage_dataset(make_cfg("synthetic", tmp_path), tmp_path / "s", seed=0)
    path = tmp_path / "s" / "test_labels.npy"
    os.truncate(path, path.stat().st_size - 8)
    with pytest.raises(DataError, match="truncated"):
        load_split(tmp_path / "s", "test", verify=False)  # the size check needs no hashing
    with pytest.raises(DataError, match="truncated"):
        verify_staged(tmp_path / "s")


def test_load_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_split(tmp_path / "nope", "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="manifest.json is missing"):
        load_split(tmp_path / "empty", "train")
    stage_dataset(make_cfg("synthetic", tmp_path), tmp_path / "s", seed=0)
    with pytest.raises(DataError, match="unknown split 'dev'"):
        load_split(tmp_path / "s", "dev")
    manifest_path = tmp_path / "s" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(DataError, match="format_version 99"):
        load_split(tmp_path / "s", "train")
    (tmp_path / "s" / "train_images-00000.npy").unlink()
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="train_images-00000.npy is missing"):
        verify_staged(tmp_path / "s")


def test_unknown_source(tmp_path):
    with pytest.raises(DataError, match="data.source: unknown source 'svhn'"):
        stage_dataset(make_cfg("svhn", tmp_path), tmp_path / "s", seed=0)


def fail_on_manifest(monkeypatch) -> None:
    def boom(path, obj):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(staging, "_write_json", boom)


def test_failed_stage_leaves_no_out_dir(tmp_path, monkeypatch):
    fail_on_manifest(monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        stage_dataset(make_cfg("synthetic", tmp_path), tmp_path / "s", seed=0)
    assert list(tmp_path.iterdir()) == []  # no out_dir, no temporary sibling


def test_failed_restage_keeps_previous(tmp_path, monkeypatch):
    good = stage_dataset(make_cfg("synthetic", tmp_path), tmp_path / "s", seed=0)
    fail_on_manifest(monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        stage_dataset(make_cfg("synthetic", tmp_path), tmp_path / "s", seed=1)
    assert verify_staged(tmp_path / "s") == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_restage_replaces_cleanly(tmp_path):
    stage_dataset(make_cfg("synthetic", tmp_path), tmp_path / "s", seed=0)
    (tmp_path / "s" / "stale.txt").write_text("from an older run")
    new = stage_dataset(make_cfg("synthetic", tmp_path), tmp_path / "s", seed=1)
    assert verify_staged(tmp_path / "s") == new and new["seed"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
    assert not (tmp_path / "s" / "stale.txt").exists()


def test_small_shards_hold_the_same_data_and_are_checked_one_by_one(tmp_path):
    """A dataset over many shards reads back exactly like one shard, by whole split, by
    contiguous range across shard boundaries and by gathered indices (a training batch);
    a corrupt shard is named, the others stay readable."""
    cfg = make_cfg("digits", tmp_path)
    whole = stage_dataset(cfg, tmp_path / "one", seed=0)
    sharded = stage_dataset(cfg, tmp_path / "many", seed=0, shard_bytes=64 * 100)  # 100 images
    assert len(whole["shards"]["train"]) == 1
    assert [s["count"] for s in sharded["shards"]["train"]] == [100] * 12 + [94]
    for key in ("sizes", "class_counts", "mean", "std"):
        assert sharded[key] == whole[key]
    expected = load_split(tmp_path / "one", "train")[0].numpy()
    assert np.array_equal(load_split(tmp_path / "many", "train")[0].numpy(), expected)
    images, labels, _ = ddata.open_split(tmp_path / "many", "train")
    assert images.shape == expected.shape and labels.dtype == np.int64
    assert np.array_equal(images.read(95, 310), expected[95:310])  # spans three shards
    order = np.random.default_rng(0).permutation(len(expected))[:300]
    assert np.array_equal(images.gather(order), expected[order])
    images.close()
    flip_byte(tmp_path / "many" / "train_images-00007.npy")
    with pytest.raises(DataError, match="train_images-00007.npy: sha256 mismatch"):
        verify_staged(tmp_path / "many")
    load_split(tmp_path / "many", "val")


def test_a_hand_edited_manifest_is_caught_by_the_shard_header(tmp_path):
    stage_dataset(make_cfg("digits", tmp_path), tmp_path / "s", seed=0, shard_bytes=64 * 500)
    path = tmp_path / "s" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["shards"]["train"][0]["count"] = 499  # sizes and sums still match the files
    manifest["shards"]["train"][1]["count"] = 501
    path.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"train_images-00000.npy holds uint8\[500, 1, 8, 8\]"):
        load_split(tmp_path / "s", "train", verify=False)


def test_format_1_staged_data_is_still_read(tmp_path):
    """A directory staged by an earlier ddpflow (one images file per split) trains as it is:
    upgrading does not restage or retrain."""
    stage_dataset(make_cfg("digits", tmp_path), tmp_path / "s", seed=0)
    staged = tmp_path / "s"
    manifest = json.loads((staged / "manifest.json").read_text())
    for split in ddata.SPLITS:
        os.rename(staged / f"{split}_images-00000.npy", staged / f"{split}_images.npy")
        manifest["files"][f"{split}_images.npy"] = manifest["files"].pop(
            f"{split}_images-00000.npy"
        )
    del manifest["shards"]
    manifest["format_version"] = 1
    (staged / "manifest.json").write_text(json.dumps(manifest))
    assert verify_staged(staged)["format_version"] == 1
    assert load_split(staged, "test")[0].shape == (359, 1, 8, 8)


def test_digits_read_without_scikit_learn_equal_its_load_digits():
    """ddpflow reads scikit-learn's digits file itself (no sklearn import at staging): the
    same images, labels and class names as sklearn.datasets.load_digits."""
    from ddpflow.data.sources import _sklearn_digits_csv, load_digits
    from sklearn.datasets import load_digits as sk_load_digits

    assert _sklearn_digits_csv() is not None  # the fast path is the one taken here
    ours, theirs = load_digits(), sk_load_digits()
    expected = np.rint(theirs.images * (255.0 / 16.0)).astype(np.uint8)[:, None]
    assert np.array_equal(ours.train_x, expected)
    assert np.array_equal(ours.train_y, theirs.target) and ours.train_y.dtype == np.int64
    assert ours.class_names == [str(n) for n in theirs.target_names]
