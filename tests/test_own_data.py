"""Your own data (issue 12, sources part): an image folder and a .npz file, staged into the
same format as the built-in sources, every bad input refused with the file named; end to end,
the workflow trains on an image folder and restages when an image is added."""

from __future__ import annotations

import json
import shutil
import unicodedata

import numpy as np
import pytest
from datafixtures import image_of, make_folder, make_mixed_folder
from ddpflow import config as ddpconfig
from ddpflow.data.raw import DataError
from ddpflow.data.staged import load_split
from ddpflow.data.staging import stage_dataset
from PIL import Image
from workflow_helpers import REPO, jobs_planned, make_run, snakemake, write_config


def _data(**over) -> dict:
    config = ddpconfig.load(None, {"data": {"source": "image_folder", "image_size": [16, 16],
                                            **over}})  # fmt: skip
    return config["data"]


def test_an_image_folder_stages_like_a_built_in_source(tmp_path):
    root = make_folder(tmp_path / "images")
    (root / "train/red/notes.txt").write_text("not an image")
    manifest = stage_dataset(_data(root=str(root)), tmp_path / "staged", seed=0)
    assert manifest["class_names"] == ["blue", "green", "red"]  # sorted, as ImageFolder
    assert manifest["shape"] == [3, 16, 16]
    assert (
        manifest["sizes"]["test"] == 18
        and manifest["sizes"]["train"] + manifest["sizes"]["val"] == 60
    )
    assert manifest["source_notes"] == {
        "skipped_corrupt": 0, "skipped_files": [], "ignored_files": 1, "on_small": "upscale",
        "image_size": [16, 16], "upscaled_small": 0, "skipped_small": 0, "small_per_split": {},
        "small_files": [],
    }  # fmt: skip
    images, labels, _ = load_split(tmp_path / "staged", "test")
    means = images.float().mean(dim=(2, 3))  # per image and channel
    dominant = means.argmax(dim=1)  # blue -> channel 2, green -> 1, red -> 0
    assert (dominant == torch_tensor([2, 1, 0])[labels]).all()


def torch_tensor(values):
    import torch

    return torch.tensor(values)


def test_an_image_folder_staged_in_threads_gives_the_same_bytes(tmp_path):
    """Staging decodes a shard at a time, in threads (the stage rule's): the thread count
    changes nothing in the staged bytes."""
    root = make_folder(tmp_path / "images", per_class=(30, 10))
    one = stage_dataset(_data(root=str(root)), tmp_path / "one", 0, threads=1, shard_bytes=768 * 7)
    two = stage_dataset(_data(root=str(root)), tmp_path / "two", 0, threads=2, shard_bytes=768 * 7)
    assert one["files"] == two["files"] and len(one["shards"]["train"]) == 12
    assert one["sizes"] == {"train": 81, "val": 9, "test": 30}


def test_grayscale_conversion(tmp_path):
    root = make_folder(tmp_path / "images", per_class=(6, 0))
    manifest = stage_dataset(_data(root=str(root), channels=1), tmp_path / "staged", seed=0)
    assert manifest["shape"] == [1, 16, 16] and manifest["sizes"]["test"] > 0  # carved out


@pytest.mark.parametrize(
    "damage, expected",
    [
        ("corrupt", r"train/green/bad.png: not a readable image(.|\n)*data.on_corrupt: skip"),
        ("empty_class", r"train/violet: class 'violet' has no images"),
        ("test_classes", r"test/violet: class 'violet' is in test/ but not in train/"),
        ("no_train", r"no train/ folder"),
    ],
)
def test_bad_image_folders_name_the_file(tmp_path, damage, expected):
    root = make_folder(tmp_path / "images", per_class=(4, 2))
    if damage == "corrupt":
        (root / "train/green/bad.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    elif damage == "empty_class":
        (root / "train/violet").mkdir()
        (root / "train/violet/readme.md").write_text("todo")
    elif damage == "test_classes":
        (root / "test/violet").mkdir()
        image_of((120, 0, 200), np.random.default_rng(0)).save(root / "test/violet/a.png")
    elif damage == "no_train":
        (root / "train").rename(root / "training")
    with pytest.raises(DataError, match=expected):
        stage_dataset(_data(root=str(root)), tmp_path / "staged", seed=0)
    assert not (tmp_path / "staged").exists()  # nothing half-staged


def five_problems(root):
    """A folder with five different problems (and what a macOS or Windows copy leaves)."""
    make_folder(root, per_class=(4, 2))
    jpeg = root / "train/red/cut.jpg"
    image_of((200, 0, 0), np.random.default_rng(1)).save(jpeg, quality=90)
    jpeg.write_bytes(jpeg.read_bytes()[:200])  # truncated by a failed copy
    (root / "train/blue/zero.png").write_bytes(b"")
    (root / "train/violet").mkdir()
    (root / "train/green/notes.txt").write_text("a,b\n")
    (root / "train/green/.DS_Store").write_bytes(b"\0")  # a file manager's: silently ignored
    (root / "test/blue/Thumbs.db").write_bytes(b"\0")
    (root / "test/white").mkdir()
    image_of((255, 255, 255), np.random.default_rng(0)).save(root / "test/white/a.png")
    return root


FIVE_PROBLEMS = [
    "4 problems, nothing was staged",
    "train/red/cut.jpg: not a readable image (",
    "train/blue/zero.png: not a readable image (an empty file (0 bytes))",
    "train/violet: class 'violet' has no images",
    "test/white: class 'white' is in test/ but not in train/",
    "1 file is not an image by its extension and left out: ",
    "train/green/notes.txt",
]


@pytest.mark.parametrize("threads", [1, 2])
def test_every_problem_of_a_folder_is_named_in_one_staging_run(tmp_path, threads):
    """Five different problems, one run: a truncated JPEG, a zero-byte image, an empty class
    folder, a file that is not an image, a class in test/ only. All named, nothing staged;
    the images are read the staging's way (in its processes) to find the unreadable ones."""
    root = five_problems(tmp_path / "images")
    with pytest.raises(DataError) as err:
        stage_dataset(_data(root=str(root)), tmp_path / "staged", seed=0, threads=threads)
    text = str(err.value)
    assert all(line in text for line in FIVE_PROBLEMS), text
    assert ".DS_Store" not in text and "Thumbs.db" not in text
    assert text.count("cut.jpg") == 1 and text.count("zero.png") == 1  # each named once
    assert not (tmp_path / "staged").exists()
    assert not list(tmp_path.glob(".staged.staging-*"))  # nor half-written


def test_unreadable_images_found_while_staging_are_named_together(tmp_path):
    """No problem in the listing: the images are decoded while staged, and every unreadable
    one is named at the end (not the first alone), with the total beyond the first 20."""
    root = make_folder(tmp_path / "images", per_class=(6, 2))
    for i in range(23):
        (root / f"train/{('red', 'green', 'blue')[i % 3]}/bad{i}.png").write_bytes(b"\x89PNG x")
    with pytest.raises(DataError) as err:
        stage_dataset(_data(root=str(root)), tmp_path / "staged", seed=0)
    text = str(err.value)
    assert "23 problems" in text and "... and 3 more (23 in all)" in text, text
    assert text.count(": not a readable image (") == 20


def test_a_class_folder_in_nfd_and_nfc_is_one_class(tmp_path):
    """A folder copied from macOS names 'Café' in NFD; typed elsewhere it is NFC: one class."""
    root = make_folder(tmp_path / "images", per_class=(4, 2))
    (root / "train/red").rename(root / "train" / unicodedata.normalize("NFD", "Café"))
    (root / "test/red").rename(root / "test" / unicodedata.normalize("NFC", "Café"))
    manifest = stage_dataset(_data(root=str(root)), tmp_path / "staged", seed=0)
    assert manifest["class_names"] == ["Café", "blue", "green"]
    assert unicodedata.is_normalized("NFC", manifest["class_names"][0])
    assert manifest["class_counts"]["test"] == [2, 2, 2]


def test_classes_keep_the_order_of_their_folder_names_on_disk(tmp_path):
    """Labels follow train/'s folder names as ImageFolder sorts them: 'é' in NFD (e + U+0301)
    sorts before 'f', in NFC (U+00E9) after it. A macOS copy keeps the labels it was staged
    with before names were compared in NFC."""
    root = make_folder(tmp_path / "images", per_class=(4, 2))
    for split in ("train", "test"):
        (root / split / "red").rename(root / split / unicodedata.normalize("NFD", "é"))
        (root / split / "green").rename(root / split / "f")
    manifest = stage_dataset(_data(root=str(root)), tmp_path / "staged", seed=0)
    assert manifest["class_names"] == ["blue", "é", "f"]
    images, labels, _ = load_split(tmp_path / "staged", "test")
    red = images.float().mean(dim=(2, 3)).argmax(dim=1) == 0  # the former red images
    assert (labels[red] == 1).all() and int(red.sum()) == 2


def test_names_that_print_alike_are_refused_with_their_code_points(tmp_path):
    """Two folders of one split naming one class (NFD and NFC), and a class of test/ whose
    name only looks like train/'s (a Cyrillic 'а'): named with their code points."""
    root = make_folder(tmp_path / "images", per_class=(4, 2))
    nfd = root / "train" / unicodedata.normalize("NFD", "blué")
    (root / "train/blue").rename(nfd)
    shutil.copytree(nfd, root / "train" / unicodedata.normalize("NFC", "blué"))
    (root / "test/blue").rename(root / "test/blué")
    (root / "test/green").rename(root / "test/gr\u0435en")  # Cyrillic ie
    with pytest.raises(DataError) as err:
        stage_dataset(_data(root=str(root)), tmp_path / "staged", seed=0)
    text = str(err.value)
    points = "U+0062 U+006C U+0075 U+00E9 and U+0062 U+006C U+0075 U+0065 U+0301"
    assert f"the same class name as 'blue\u0301' (code points {points}); merge" in text, text
    cyrillic = "class 'gr\u0435en' (U+0067 U+0072 U+0435 U+0065 U+006E) is in test/ but not"
    assert cyrillic in text
    assert "no folder for class 'green' of train/" in text


def test_files_beside_the_class_folders_are_named_and_left_out(tmp_path, caplog):
    """A stray image in train/ itself, a README beside the class folders: staged without them,
    each named in a warning (file managers' .DS_Store and Thumbs.db are not)."""
    root = make_folder(tmp_path / "images", per_class=(4, 2))
    image_of((1, 2, 3), np.random.default_rng(0)).save(root / "train/stray.png")
    (root / "test/README.md").write_text("my images")
    (root / "train/.DS_Store").write_bytes(b"\0")
    (root / "train/Thumbs.db").write_bytes(b"\0")
    with caplog.at_level("WARNING"):
        manifest = stage_dataset(_data(root=str(root)), tmp_path / "staged", seed=0)
    assert sum(manifest["sizes"].values()) == 18
    told = [r.getMessage() for r in caplog.records if "beside the class folders" in r.getMessage()]
    assert len(told) == 1 and told[0].startswith("image_folder: 2 files are beside")
    assert "test/README.md" in told[0] and "train/stray.png" in told[0]
    assert "Thumbs.db" not in caplog.text and ".DS_Store" not in caplog.text


def test_a_folder_of_empty_class_folders_stops_at_once(tmp_path):
    """No image at all in train/: nothing to read, the listing's problems are said at once
    (not a later, vaguer 'the train split is empty')."""
    for name in ("a", "b"):
        (tmp_path / "images/train" / name).mkdir(parents=True)
    with pytest.raises(DataError, match=r"2 problems, nothing was staged(.|\n)*train/a: class "
                                        r"'a' has no images(.|\n)*train/b: class 'b'"):  # fmt: skip
        stage_dataset(_data(root=str(tmp_path / "images")), tmp_path / "staged", seed=0)


def test_small_images_under_on_small_error_are_named_with_the_unreadable_ones(tmp_path):
    """data.on_small: error and a corrupt image: both in the one error."""
    root = make_mixed_folder(tmp_path / "images")
    (root / "train/green/bad.png").write_bytes(b"garbage")
    with pytest.raises(DataError) as err:
        stage_dataset(_data(root=str(root), image_size=[32, 32], on_small="error"),
                      tmp_path / "staged", seed=0)  # fmt: skip
    text = str(err.value)
    assert "2 problems" in text and "train/green/bad.png: not a readable image" in text, text
    assert "18 images smaller than data.image_size [32, 32]" in text


def test_a_class_without_a_test_sample_is_warned_at_staging(tmp_path, caplog):
    """A class with one image and no test/ folder: the stratified split gives it no test
    sample; staging says so (class, split, counts)."""
    root = make_folder(tmp_path / "images", per_class=(10, 0))
    (root / "train/white").mkdir()
    image_of((255, 255, 255), np.random.default_rng(0)).save(root / "train/white/only.png")
    with caplog.at_level("WARNING"):
        manifest = stage_dataset(_data(root=str(root)), tmp_path / "staged", seed=0)
    white = manifest["class_names"].index("white")
    assert manifest["class_counts"]["test"][white] == 0
    assert "class 'white' has no sample in the test split (train 1, val 0, test 0)" in caplog.text
    assert "its test accuracy is n/a; add samples of it or raise data.test_fraction" in caplog.text


def test_classes_without_a_sample_are_warned_once_per_split(tmp_path, caplog):
    """Many classes without a sample in a split: one warning, 20 named, then the total; a split
    with no sample at all is said as such, not class by class."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, size=(60, 4, 4), dtype=np.uint8)
    labels = np.repeat(np.arange(30), 2)  # 30 classes of 2 images, 1 test image of each
    test_labels = np.arange(30)[rng.permutation(30)][:5]  # 5 of them in the test split
    arrays = {"train_images": images, "train_labels": labels,
              "test_images": images[:5], "test_labels": test_labels}  # fmt: skip
    data = ddpconfig.load(None, {"data": _npz(tmp_path / "d.npz", **arrays)})["data"]
    with caplog.at_level("WARNING"):
        manifest = stage_dataset(data, tmp_path / "staged", seed=0)
    assert manifest["sizes"] == {"train": 54, "val": 6, "test": 5}
    told = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    test = [line for line in told if "the test split" in line]
    assert len(test) == 1 and test[0].startswith("data: 25 classes have no sample in the test")
    assert test[0].count(" (train ") == 20
    assert " and 5 more; their test accuracy is n/a; add samples of them" in test[0]
    assert "test_fraction" not in test[0]  # the npz's own test split: no fraction to raise
    val = [line for line in told if "the val split" in line]
    assert len(val) == 1 and val[0].startswith("data: 24 classes have no sample in the val")
    tiny = make_folder(tmp_path / "tiny", per_class=(1, 1))  # 3 train images: no val split
    caplog.clear()
    with caplog.at_level("WARNING"):
        stage_dataset(_data(root=str(tiny)), tmp_path / "tiny_staged", seed=0)
    assert [r.getMessage() for r in caplog.records] == [
        "data: the val split is empty; add samples or raise data.val_fraction"
    ]


def test_corrupt_images_can_be_skipped_and_are_counted(tmp_path):
    root = make_folder(tmp_path / "images", per_class=(4, 2))
    (root / "train/green/bad.png").write_bytes(b"garbage")
    manifest = stage_dataset(_data(root=str(root), on_corrupt="skip"), tmp_path / "s", seed=0)
    assert manifest["source_notes"]["skipped_corrupt"] == 1
    assert manifest["source_notes"]["skipped_files"][0].endswith("train/green/bad.png")


# -- images smaller than image_size (data.on_small) ------------------------------------------
# make_mixed_folder: 10 train and 5 test images per class, 2 of every 5 smaller than 32x32,
# so 12 of 30 in train/ (train and val splits) and 6 of 15 in test/; PNG, JPEG, grayscale


@pytest.mark.parametrize(
    "on_small, sizes, counts",
    [
        ("upscale", {"train": 27, "val": 3, "test": 15}, {"upscaled_small": 18,
                                                          "skipped_small": 0}),
        ("skip", {"train": 17, "val": 1, "test": 9}, {"upscaled_small": 0, "skipped_small": 18}),
    ],
)  # fmt: skip
def test_small_images_are_upscaled_or_skipped_and_counted(tmp_path, caplog, on_small, sizes,
                                                          counts):  # fmt: skip
    root = make_mixed_folder(tmp_path / "images")
    data = _data(root=str(root), image_size=[32, 32], on_small=on_small)
    with caplog.at_level("INFO"):
        manifest = stage_dataset(data, tmp_path / "one", seed=0, threads=1)
    assert manifest["shape"] == [3, 32, 32] and manifest["sizes"] == sizes
    notes = manifest["source_notes"]
    assert {k: notes[k] for k in counts} == counts and notes["on_small"] == on_small
    assert sum(notes["small_per_split"].values()) == 18 and notes["small_per_split"]["test"] == 6
    assert len(notes["small_files"]) == 18 and notes["small_files"][0].endswith("001.jpg (28x40)")
    done = "upscaled" if on_small == "upscale" else "skipped"
    told = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert len(told) == 1 and f"18 of 45 images were smaller than 32x32 and were {done}" in told[0]
    two = stage_dataset(data, tmp_path / "two", seed=0, threads=2)  # decoded in 2 processes
    assert two["files"] == manifest["files"]


def test_small_images_are_refused_under_on_small_error(tmp_path):
    root = make_mixed_folder(tmp_path / "images")
    data = _data(root=str(root), image_size=[32, 32], on_small="error")
    expected = (r"18 images smaller than data.image_size \[32, 32\] \(width x height "
                r"shown\): .*train/blue/001.jpg \(28x40\).* and 13 more; set data.on_small: "
                r"upscale")  # fmt: skip
    with pytest.raises(DataError, match=expected):
        stage_dataset(data, tmp_path / "staged", seed=0)
    assert not (tmp_path / "staged").exists()


def test_an_upscaled_image_is_resized_up_then_centre_cropped(tmp_path):
    """The same resampling as the down path: the shorter side to 32 (16x24 -> 32x48, bilinear),
    then the centre crop; a dark left half stays the left half, nothing is padded."""
    root = tmp_path / "images"
    pixels = np.full((24, 16), 250, np.uint8)  # 16 wide, 24 high
    pixels[:, :8] = 10
    for folder in ("train/a", "train/b", "test/a", "test/b"):
        (root / folder).mkdir(parents=True)
        Image.fromarray(pixels).save(root / folder / "x.png")
    data = _data(root=str(root), image_size=[32, 32], channels=1)  # 2 train images: no val
    manifest = stage_dataset(data, tmp_path / "staged", seed=0)
    assert manifest["source_notes"]["upscaled_small"] == 4
    images, _, _ = load_split(tmp_path / "staged", "train")
    assert images.shape == (2, 1, 32, 32)
    assert (images[:, :, :, :15] < 20).all() and (images[:, :, :, 17:] > 240).all()


def test_most_of_a_split_upscaled_warns_once_with_a_smaller_size(tmp_path, caplog):
    root = make_mixed_folder(tmp_path / "images")
    with caplog.at_level("INFO"):
        stage_dataset(_data(root=str(root), image_size=[38, 38]), tmp_path / "staged", seed=0)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert ("more than half of the images of a split were smaller than 38x38 and were upscaled "
            "(train 22 of 27, val 2 of 3, test 12 of 15)") in warnings[0]  # fmt: skip
    # the median image fits 32x32: 3 of the 5 sizes do
    assert "consider a smaller data.image_size, e.g. [32, 32]" in warnings[0]


def test_a_split_left_empty_by_skipping_is_refused(tmp_path):
    root = make_mixed_folder(tmp_path / "images")
    with pytest.raises(DataError, match=r"all 27 images of the train split were skipped"):
        stage_dataset(_data(root=str(root), image_size=[48, 48], on_small="skip"),
                      tmp_path / "staged", seed=0)  # fmt: skip
    assert not (tmp_path / "staged").exists()


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return {"source": "npz", "path": str(path)}


def test_npz_in_either_layout(tmp_path):
    rng = np.random.default_rng(0)
    nhwc = rng.integers(0, 255, size=(50, 12, 12, 3), dtype=np.uint8)
    labels = np.arange(50) % 5
    for name, images in (("nhwc", nhwc), ("nchw", nhwc.transpose(0, 3, 1, 2))):
        data = ddpconfig.load(None, {"data": _npz(tmp_path / f"{name}.npz", train_images=images,
                                                  train_labels=labels)})["data"]  # fmt: skip
        manifest = stage_dataset(data, tmp_path / name, seed=0)
        assert manifest["shape"] == [3, 12, 12] and manifest["num_classes"] == 5
    a, _, _ = load_split(tmp_path / "nhwc", "train")
    b, _, _ = load_split(tmp_path / "nchw", "train")
    assert (a == b).all()


@pytest.mark.parametrize(
    "arrays, expected",
    [
        ({"train_images": np.zeros((4, 8, 8), np.uint8)}, r"missing train_labels"),
        ({"train_images": np.zeros((4, 8, 8), np.uint8), "train_labels": np.zeros(3, int)},
         r"train_labels has 3 entries but train_images has 4"),
        ({"train_images": np.zeros((4, 8, 8), np.float32), "train_labels": np.zeros(4, int)},
         r"train_images has dtype float32; expected uint8"),
        ({"train_images": np.zeros((4, 8, 8), np.uint8), "train_labels": np.arange(4),
          "class_names": np.array(["a", "b"])}, r"label 3 but only 2 class_names"),
        ({"train_images": np.zeros((4, 8, 8), np.uint8), "train_labels": np.zeros(4, int),
          "test_images": np.zeros((2, 8, 8), np.uint8)}, r"test_images and test_labels come"),
        ({"train_images": np.zeros((4, 8, 8), np.uint8), "train_labels": np.ones((4, 3), int)},
         r"train_labels: labels have shape \[4, 3\]; a label is one integer class 0..K-1 per "
         r"sample under task: classification \(for several labels per sample set task: "
         r"multilabel; for float or vector targets task: regression\)$"),
        ({"train_images": np.zeros((4, 8, 8), np.uint8), "train_labels": np.zeros(4, int),
          "test_images": np.zeros((2, 8, 8), np.uint8), "test_labels": np.eye(2, dtype=int)},
         r"test_labels: labels have shape \[2, 2\]; .* task: regression\); they look one-hot: "
         r"give labels.argmax\(axis=1\)"),
    ],
)  # fmt: skip
def test_bad_npz_files_name_the_key(tmp_path, arrays, expected):
    data = ddpconfig.load(None, {"data": _npz(tmp_path / "d.npz", **arrays)})["data"]
    with pytest.raises(DataError, match=expected):
        stage_dataset(data, tmp_path / "staged", seed=0)


def test_labels_in_a_column_are_one_class_per_sample(tmp_path, in_workdir):
    """Labels [n, 1] (Keras's layout), in an npz or from a plug-in: the same staged labels as
    [n]; only more than one value per sample is refused."""
    images, labels = np.zeros((12, 8, 8), np.uint8), np.arange(12) % 3
    staged = {}
    for name, y in (("flat", labels), ("column", labels[:, None])):
        data = ddpconfig.load(None, {"data": _npz(tmp_path / f"{name}.npz", train_images=images,
                                                  train_labels=y)})["data"]  # fmt: skip
        staged[name] = stage_dataset(data, tmp_path / name, seed=0)["files"]
    assert staged["flat"] == staged["column"]
    (in_workdir / "column.py").write_text(
        "import numpy as np\n\ndef data():\n"
        "    return np.zeros((12, 1, 8, 8), np.uint8), (np.arange(12) % 3)[:, None]\n"
    )
    manifest = stage_dataset(_plugin_data("column:data"), in_workdir / "p", seed=0)
    assert manifest["class_counts"]["train"] == [3, 3, 3]


def test_the_dataset_id_follows_the_files_not_only_the_config(tmp_path):
    root = make_folder(tmp_path / "images", per_class=(4, 2))
    data = _data(root=str(root))
    before = ddpconfig.dataset_id(data)
    assert before == ddpconfig.dataset_id(data)  # stable
    image_of((220, 30, 30), np.random.default_rng(1)).save(root / "train/red/new.png")
    assert ddpconfig.dataset_id(data) != before
    # the built-in sources keep their ids (keys added since are not part of them): the
    # default's id is the one ddpflow has always given it, so an upgrade restages nothing
    digits = ddpconfig.load(None, {})["data"]
    assert ddpconfig.dataset_id(digits) == "digits-53539ea563"


def test_on_small_is_in_the_dataset_id_only_where_it_can_act(tmp_path):
    """upscale (the default) leaves the dataset id, the stage rule's params and the training
    fingerprint as they were before data.on_small existed: a folder without small images
    restages and retrains nothing after the upgrade. skip and error get ids of their own
    (the reasons: ddpflow/config/fingerprint.py, above data_keys)."""
    root = make_folder(tmp_path / "images", per_class=(4, 2))
    old = _data(root=str(root))
    # as a ddpflow without on_small (and labels_csv, block_size, vocab_size, tokenizer,
    # tokenizer_sha256) resolved it
    later_keys = ("on_small", "labels_csv", "block_size", "vocab_size", "tokenizer")
    for later in (*later_keys, "tokenizer_sha256"):
        del old[later]
    old_keys = {k: v for k, v in old.items() if k not in ddpconfig.DATA_RUNTIME_KEYS}
    old_id = (
        "image_folder-"
        + ddpconfig.config_hash({**old_keys, "files": ddpconfig.own_data_listing(old)})[:10]
    )
    ids = {mode: ddpconfig.dataset_id(_data(root=str(root), on_small=mode))
           for mode in ("upscale", "skip", "error")}  # fmt: skip
    assert ids["upscale"] == old_id and len(set(ids.values())) == 3
    assert ddpconfig.stage_params(_data(root=str(root))) == old_keys
    assert ddpconfig.stage_params(_data(root=str(root), on_small="skip"))["on_small"] == "skip"
    folder = {"source": "image_folder", "root": str(root), "image_size": [16, 16]}
    fingerprints = {
        mode: ddpconfig.training_fingerprint(make_run(data={**folder, "on_small": mode}))
        for mode in ("upscale", "skip")
    }
    assert "data.on_small" not in fingerprints["upscale"]
    assert fingerprints["skip"]["data.on_small"] == "skip"
    # the built-in sources and npz never resize an image: the key is never theirs
    digits = ddpconfig.load(None, {"data": {"on_small": "skip"}})["data"]
    assert ddpconfig.dataset_id(digits) == "digits-53539ea563"
    assert "on_small" not in ddpconfig.stage_params(digits)


@pytest.mark.e2e
def test_the_workflow_trains_on_an_image_folder_and_restages_on_a_new_image(workdir):
    root = make_folder(workdir / "my_images", per_class=(40, 10))
    config = {
        "data": {"source": "image_folder", "root": "my_images", "image_size": [16, 16]},
        "train": {"epochs": 4, "progress": False},
        "runs": [{"name": "colours"}],
    }
    configfile = write_config(workdir / "config.yaml", config)
    result = snakemake(workdir, configfile)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((workdir / "results/runs/colours/eval_metrics.json").read_text())
    assert metrics["class_names"] == ["blue", "green", "red"]
    assert metrics["samples_evaluated"] == 30 and metrics["accuracy"] > 0.9
    report = (workdir / "results/report/report.md").read_text()
    assert "folder (train 108, val 12, test 30); 0 corrupt images skipped" in report
    assert jobs_planned(workdir, configfile) == set()
    image_of((30, 200, 40), np.random.default_rng(7)).save(root / "train/green/extra.png")
    assert {"stage", "train", "evaluate", "report"} <= jobs_planned(workdir, configfile)
    # five problems more: the stage rule names them all in the terminal and stops, once
    five_problems(root)
    failed = snakemake(workdir, configfile)
    assert failed.returncode != 0
    assert all(line in failed.stderr for line in FIVE_PROBLEMS), failed.stderr[-3000:]
    logs = list((workdir / "logs/stage").glob("*.log"))  # Snakemake echoes the failed log
    assert sum(log.read_text().count("nothing was staged") for log in logs) == 1
    assert (workdir / "results/runs/colours/eval_metrics.json").is_file()


@pytest.mark.e2e
def test_a_class_without_a_test_sample_is_warned_and_reported_as_na(workdir):
    """An image folder without test/ in which one class has one image: the stratified split
    leaves it no test sample. Staging says so in the terminal, training and evaluation run,
    and the report is written with the class at zero support, n/a."""
    root = make_folder(workdir / "my_images", per_class=(20, 0))
    (root / "train/white").mkdir()
    image_of((255, 255, 255), np.random.default_rng(0)).save(root / "train/white/only.png")
    config = {
        "data": {"source": "image_folder", "root": "my_images", "image_size": [16, 16]},
        "train": {"epochs": 1, "progress": False, "global_batch_size": 32, "micro_batch_size": 16},
        "runs": [{"name": "one"}],
    }
    result = snakemake(workdir, write_config(workdir / "config.yaml", config))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "class 'white' has no sample in the test split (train 1, val 0, test 0)" in output
    report = (workdir / "results/report/report.md").read_text()
    assert "| white | n/a (0 samples) |" in report, report


@pytest.mark.e2e
def test_the_workflow_trains_on_a_folder_with_small_images(workdir):
    """A user's folder of mixed sizes (28x40 to 44x38, PNG and JPEG, some grayscale) at
    image_size [32, 32]: the default upscales the small ones, says so once, and trains; skip
    is another dataset, and writing the default out changes nothing."""
    make_mixed_folder(workdir / "my_images", per_class=(40, 10))
    data = {"source": "image_folder", "root": "my_images", "image_size": [32, 32]}
    # about 105 training images: 3 steps of 32 per epoch (2 ranks x 16)
    train = {"epochs": 4, "progress": False, "global_batch_size": 32, "micro_batch_size": 16}
    config = {"data": data, "train": train, "runs": [{"name": "mixed"}]}
    configfile = write_config(workdir / "config.yaml", config)
    result = snakemake(workdir, configfile)
    assert result.returncode == 0, result.stderr[-3000:]
    told = [line for line in result.stderr.splitlines() if "were smaller than" in line]
    assert (
        len(told) == 1 and "60 of 150 images were smaller than 32x32 and were upscaled" in told[0]
    )
    metrics = json.loads((workdir / "results/runs/mixed/eval_metrics.json").read_text())
    # measured 2026-11-23: 30 of 30
    assert metrics["samples_evaluated"] == 30 and metrics["accuracy"] > 0.9
    report = (workdir / "results/report/report.md").read_text()
    assert "60 images smaller than data.image\\_size \\[32, 32\\] upscaled" in report
    written_out = {**config, "data": {**data, "on_small": "upscale"}}
    assert jobs_planned(workdir, write_config(workdir / "upscale.yaml", written_out)) == set()
    skip = {**config, "data": {**data, "on_small": "skip"}}
    assert {"stage", "train"} <= jobs_planned(workdir, write_config(workdir / "skip.yaml", skip))


# -- a plug-in source: "module:function" from the working directory -------------------------


def _plugin_data(spec: str, **over) -> dict:
    return ddpconfig.load(None, {"data": {"source": spec, **over}})["data"]


def test_the_example_plugin_stages_from_the_working_directory(in_workdir):
    shutil.copy(REPO / "config/examples/my_data.py", in_workdir / "my_data.py")
    data = _plugin_data("my_data:shapes", kwargs={"count": 60, "size": 16}, channels=1)
    manifest = stage_dataset(data, in_workdir / "staged", seed=0)
    assert manifest["class_names"] == ["circle", "square", "triangle"]
    assert manifest["shape"] == [1, 16, 16] and manifest["sizes"]["test"] == 15
    assert ddpconfig.dataset_id(data).startswith("my_data_shapes-")
    before = ddpconfig.dataset_id(data)
    path = in_workdir / "my_data.py"
    path.write_text(path.read_text().replace("randint(60, 100)", "randint(50, 100)"))
    assert ddpconfig.dataset_id(data) != before  # editing the plug-in restages


ARRAYS_PLUGIN = """
import numpy as np
import torch

def arrays():
    x = np.zeros((12, 1, 8, 8), np.uint8)
    return {"train": (x, np.arange(12) % 3)}

class Floats(torch.utils.data.Dataset):
    def __len__(self):
        return 9
    def __getitem__(self, i):
        return torch.full((3, 8, 8), i / 8), torch.tensor(i % 3)

def floats():
    return Floats()
"""


def test_plugins_may_return_arrays_or_a_torch_dataset_of_tensors(in_workdir):
    (in_workdir / "mine.py").write_text(ARRAYS_PLUGIN)
    manifest = stage_dataset(_plugin_data("mine:arrays"), in_workdir / "a", seed=0)
    assert manifest["shape"] == [1, 8, 8] and manifest["num_classes"] == 3
    manifest = stage_dataset(_plugin_data("mine:floats"), in_workdir / "f", seed=0)
    assert manifest["shape"] == [3, 8, 8]
    images, _, _ = load_split(in_workdir / "f", "train")
    assert int(images.max()) <= 255 and int(images.max()) > 0  # 0..1 floats scaled to uint8


BAD_PLUGINS = """
import numpy as np

def raises():
    raise FileNotFoundError("/data/missing.csv")

def number():
    return 5

def mixed():
    return [(np.zeros((1, 8, 8), np.uint8), 0), (np.zeros((1, 9, 9), np.uint8), 1)]

def beyond():
    return {"train": [(np.zeros((1, 8, 8), np.uint8), 3)], "class_names": ["a", "b"]}

def bright():
    return [(np.full((1, 8, 8), 2.0), 0)]

def not_pairs():
    return [np.zeros((1, 8, 8), np.uint8)]

def vectors():
    return [(np.zeros((1, 8, 8), np.uint8), np.array([1, 0, 1])) for _ in range(4)]

def vector_arrays():
    return np.zeros((4, 1, 8, 8), np.uint8), np.zeros((4, 3), np.int64)
"""


@pytest.mark.parametrize(
    "function, expected",
    [
        ("raises", r"'bad:raises': the function raised FileNotFoundError: /data/missing.csv"),
        ("number", r"got a int; expected a map-style Dataset"),
        ("mixed", r"item 1 has shape \[1, 9, 9\], item 0 \[1, 8, 8\]"),
        ("beyond", r"label 3 but only 2 class_names"),
        ("bright", r"pixels of dtype float64 \(range 2.0..2.0\); expected uint8 0..255 or floats"),
        ("not_pairs", r"item 0 is a ndarray; expected an \(image, label\) pair"),
        ("missing", r"has no function 'missing'"),
        ("vectors", r"item 0's label has shape \[3\] \(3 values\); a label is one integer"),
        ("vector_arrays", r"labels have shape \[4, 3\]; a label is one integer class"),
    ],
)
def test_a_bad_plugin_source_names_the_cause(in_workdir, function, expected):
    (in_workdir / "bad.py").write_text(BAD_PLUGINS)
    with pytest.raises(DataError, match=expected):
        stage_dataset(_plugin_data(f"bad:{function}"), in_workdir / "staged", seed=0)
    with pytest.raises(DataError, match=r"cannot import 'nowhere'.*working directory"):
        stage_dataset(_plugin_data("nowhere:data"), in_workdir / "staged", seed=0)


SMALL_PLUGIN = """
from PIL import Image

def mixed():
    sizes = [(40, 36), (28, 40), (32, 32), (44, 38), (36, 30)]  # 2 of 5 smaller than 32x32
    return [(Image.new("RGB", sizes[i % 5], (80 * (i % 3), 0, 0)), i % 3) for i in range(30)]
"""


@pytest.mark.parametrize("on_small, staged", [("upscale", 30), ("skip", 18), ("error", None)])
def test_a_plugins_small_pil_images_follow_on_small(in_workdir, on_small, staged):
    (in_workdir / "small.py").write_text(SMALL_PLUGIN)
    data = _plugin_data("small:mixed", image_size=[32, 32], on_small=on_small)
    if staged is None:
        with pytest.raises(DataError, match=r"train item 1: 28x40 is smaller than data.image_size "
                                            r"\[32, 32\]; set data.on_small: upscale"):  # fmt: skip
            stage_dataset(data, in_workdir / "staged", seed=0)
        return
    manifest = stage_dataset(data, in_workdir / "staged", seed=0)
    assert sum(manifest["sizes"].values()) == staged and manifest["shape"] == [3, 32, 32]
    notes = manifest["source_notes"]
    assert notes[f"{'upscaled' if on_small == 'upscale' else 'skipped'}_small"] == 12


@pytest.mark.e2e
def test_the_workflow_trains_on_the_example_plugin(workdir):
    shutil.copy(REPO / "config/examples/my_data.py", workdir / "my_data.py")
    config = {
        "data": {"source": "my_data:shapes", "kwargs": {"count": 600, "size": 24}, "channels": 1},
        "train": {"epochs": 6, "progress": False},
        "runs": [{"name": "shapes"}],
    }
    result = snakemake(workdir, write_config(workdir / "config.yaml", config))
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((workdir / "results/runs/shapes/eval_metrics.json").read_text())
    # measured 2026-11-23: 150 of 150
    assert metrics["samples_evaluated"] == 150 and metrics["accuracy"] > 0.9
