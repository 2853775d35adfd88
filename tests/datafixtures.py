"""Tiny datasets in torchvision's own on-disk formats, read by the real loaders (download=False).

No dataset can be downloaded here, in CI or on the GPU machine, so tests write a few hundred
class-dependent images in the exact layouts torchvision 0.29 reads:

- MNIST / FashionMNIST: `root/<Name>/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`,
  uncompressed big-endian idx files. torchvision checks only that they exist (the md5s in
  `resources` are of the .gz downloads), so the real loader reads them unchanged.
- CIFAR-10 / CIFAR-100: pickled dicts in `root/cifar-10-batches-py/` (data_batch_1..5,
  test_batch, batches.meta) or `root/cifar-100-python/` (train, test, meta). torchvision
  md5-checks every one of them against the official files' md5s, which no fixture can match.
  `write_cifar` returns the md5s of what it wrote and `trust_cifar_fixture` puts exactly those
  into the torchvision class attributes (pytest's monkeypatch, undone after the test): the
  real md5 check still runs, so a corrupted or missing fixture file is still rejected.
  Because the patch lives in the test process, CIFAR fixtures work only in-process; a
  subprocess (e.g. a whole Snakemake run) should use the MNIST-like fixtures instead.

Images are one seeded random prototype per class plus noise, so a tiny model learns them.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from pathlib import Path

import numpy as np
from PIL import Image

CIFAR10_NAMES = [
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
]


def class_images(n: int, shape: tuple, num_classes: int, seed: int, split_seed: int):
    """(uint8 [n, *shape], int64 [n]): balanced labels, prototype per class (from seed) + noise."""
    prototypes = np.random.default_rng([seed, 0]).uniform(0, 1, size=(num_classes, *shape))
    rng = np.random.default_rng([seed, 1, split_seed])
    labels = rng.permutation(np.arange(n) % num_classes).astype(np.int64)
    x = prototypes[labels] + 0.25 * rng.standard_normal((n, *shape))
    return np.rint(np.clip(x, 0, 1) * 255).astype(np.uint8), labels


def _write_idx(path: Path, array: np.ndarray) -> None:
    # idx: 2 zero bytes, type 0x08 (ubyte), ndim, then big-endian uint32 dims, then the data.
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, np.uint8).tobytes())


def write_mnist_like(
    root, name: str = "FashionMNIST", n_train: int = 200, n_test: int = 50, seed: int = 0
) -> Path:
    """Write root/<name>/raw/*-ubyte (28x28, 10 classes); return the raw folder."""
    raw = Path(root) / name / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, n, split_seed in (("train", n_train, 0), ("t10k", n_test, 1)):
        images, labels = class_images(n, (28, 28), 10, seed, split_seed)
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels.astype(np.uint8))
    return raw


def write_cifar(
    root, kind: str = "cifar10", n_train: int = 200, n_test: int = 50, seed: int = 0
) -> dict[str, str]:
    """Write a CIFAR-10/100 python-pickle folder under root; return {file name: md5}."""
    is10 = kind == "cifar10"
    folder = Path(root) / ("cifar-10-batches-py" if is10 else "cifar-100-python")
    folder.mkdir(parents=True, exist_ok=True)
    num_classes = 10 if is10 else 100
    train = class_images(n_train, (3, 32, 32), num_classes, seed, 0)
    test = class_images(n_test, (3, 32, 32), num_classes, seed, 1)
    if is10:
        batches = {
            f"data_batch_{i + 1}": _cifar_batch(*part, "labels")
            for i, part in enumerate(zip(*(np.array_split(a, 5) for a in train), strict=True))
        }
        batches["test_batch"] = _cifar_batch(*test, "labels")
        batches["batches.meta"] = {"label_names": CIFAR10_NAMES, "num_cases_per_batch": 10000}
    else:
        batches = {
            "train": _cifar_batch(*train, "fine_labels"),
            "test": _cifar_batch(*test, "fine_labels"),
            "meta": {
                "fine_label_names": [f"fine_{i:02d}" for i in range(100)],
                "coarse_label_names": [f"coarse_{i:02d}" for i in range(20)],
            },
        }
    md5s = {}
    for name, obj in batches.items():
        data = pickle.dumps(obj, protocol=2)  # the official files are Python 2 pickles
        (folder / name).write_bytes(data)
        md5s[name] = hashlib.md5(data).hexdigest()
    return md5s


def _cifar_batch(images: np.ndarray, labels: np.ndarray, key: str) -> dict:
    # Official layout: data is uint8 [N, 3072] (CHW flattened), labels a list of ints.
    batch = {
        "batch_label": "fixture",
        key: labels.tolist(),
        "data": images.reshape(len(images), -1),
        "filenames": [f"img_{i}.png" for i in range(len(images))],
    }
    if key == "fine_labels":
        batch["coarse_labels"] = (labels // 5).tolist()
    return batch


def trust_cifar_fixture(monkeypatch, kind: str, md5s: dict[str, str]) -> None:
    """Make torchvision's CIFAR md5 check expect the fixture's md5s (undone after the test)."""
    import torchvision.datasets as tvd

    cls = tvd.CIFAR10 if kind == "cifar10" else tvd.CIFAR100
    monkeypatch.setattr(cls, "train_list", [[n, md5s[n]] for n, _ in cls.train_list])
    monkeypatch.setattr(cls, "test_list", [[n, md5s[n]] for n, _ in cls.test_list])
    monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": md5s[cls.meta["filename"]]})


COLOURS = {"blue": (20, 40, 220), "green": (30, 200, 40), "red": (220, 30, 30)}


def image_of(colour, rng, size=(40, 30)) -> Image.Image:
    """A noisy image of one dominant colour (learnable: the class is the colour)."""
    base = np.array(colour, dtype=np.int16)
    noise = rng.integers(-40, 40, size=(size[1], size[0], 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def make_folder(root, per_class=(20, 6), rng_seed=0):
    """root/train/<colour>/*.png|jpg (and root/test/...), in every mode Pillow converts."""
    rng = np.random.default_rng(rng_seed)
    modes = ["RGB", "P", "RGBA", "RGB"]
    for split, count in zip(("train", "test"), per_class, strict=True):
        for name, colour in COLOURS.items() if count else ():  # 0: no test/ folder
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                image = image_of(colour, rng, size=(40 + i % 3 * 8, 30 + i % 2 * 10))
                mode = modes[i % len(modes)]
                ext = "jpg" if mode == "RGB" and i % 2 else "png"
                image.convert(mode).save(folder / f"{i:03d}.{ext}")
    return root


# (width, height) of a folder of mixed sizes, as a user's: against image_size [32, 32], the
# 2nd and 5th are too narrow or too low (2 of every 5 images are small)
MIXED_SIZES = [(40, 36), (28, 40), (32, 32), (44, 38), (36, 30)]


def make_mixed_folder(root, per_class=(10, 5), sizes=MIXED_SIZES, rng_seed=0):
    """root/train/<colour>/* (and root/test/...): PNG and JPEG, every 3rd image grayscale
    (its colour then shows as brightness), sides cycling through `sizes`."""
    rng = np.random.default_rng(rng_seed)
    for split, count in zip(("train", "test"), per_class, strict=True):
        for name, colour in COLOURS.items() if count else ():
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                image = image_of(colour, rng, size=sizes[i % len(sizes)])
                image = image.convert("L") if i % 3 == 2 else image
                image.save(folder / f"{i:03d}.{'jpg' if i % 2 else 'png'}")
    return root
