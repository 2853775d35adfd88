"""Dataset sources: each returns raw uint8 NCHW arrays, before splitting and staging.

Sources: scikit-learn's 8x8 digits (ships offline), torchvision's MNIST / FashionMNIST /
CIFAR-10 / CIFAR-100 read from their own on-disk files, and a seeded synthetic set.
torchvision is imported lazily so that importing ddpflow stays cheap (the Snakefile and every
Slurm task import it).
"""

from __future__ import annotations

import gzip
import logging
import os
import shutil
from pathlib import Path

import numpy as np

from ddpflow.data.raw import DataError, RawSource
from ddpflow.plugins import is_plugin
from ddpflow.runtime import atomic_writer

log = logging.getLogger(__name__)

# config name -> torchvision.datasets class name
TORCHVISION_SOURCES = {
    "mnist": "MNIST",
    "fashion_mnist": "FashionMNIST",
    "cifar10": "CIFAR10",
    "cifar100": "CIFAR100",
}


def load_source(data_cfg: dict, seed: int) -> RawSource:
    """Dispatch on data_cfg["source"]."""
    source = data_cfg["source"]
    if source == "digits":
        return load_digits()
    if source == "synthetic":
        return make_synthetic(data_cfg["synthetic"], seed)
    if source in TORCHVISION_SOURCES:
        return load_torchvision(source, Path(data_cfg["root"]), bool(data_cfg["download"]))
    if source == "image_folder" and data_cfg.get("labels_csv"):
        from ddpflow.data.labels_table import load_labelled_folder
        from ddpflow.task import run_task

        return load_labelled_folder(data_cfg, run_task(data_cfg))
    if source == "image_folder":
        from ddpflow.data.image_folder import load_image_folder

        return load_image_folder(data_cfg)
    if source == "npz":
        from ddpflow.data.npz import load_npz

        return load_npz(data_cfg)
    if is_plugin(source):
        from ddpflow.data.plugin_data import load_plugin

        return load_plugin(data_cfg)
    known = ", ".join(["digits", "synthetic", *TORCHVISION_SOURCES, "image_folder", "npz"])
    raise DataError(f"data.source: unknown source {source!r}; use one of {known}")


def load_digits() -> RawSource:
    """scikit-learn's 1,797 real 8x8 digits, values 0..16 scaled to uint8 by round(x * 255 / 16).

    Rounding (not x*255//16) keeps 16 -> 255 and spaces the 17 levels evenly; there is no
    official test split, so staging carves one (test_fraction).

    The file is read straight from scikit-learn's package folder, as its load_digits does
    (np.loadtxt of data/digits.csv.gz: 64 pixels then the label per row), without importing
    scikit-learn, whose import is most of a second of every staging (tested equal); where
    the file is not found, through scikit-learn.
    """
    raw = _sklearn_digits_csv()
    if raw is not None:
        pixels, labels = raw[:, :-1].reshape(-1, 8, 8), raw[:, -1].astype(np.int64)
        names = [str(k) for k in range(10)]
    else:
        from sklearn.datasets import load_digits as sk_load_digits

        bunch = sk_load_digits()
        pixels, labels = bunch.images, bunch.target.astype(np.int64)
        names = [str(name) for name in bunch.target_names]
    images = np.rint(pixels * (255.0 / 16.0)).astype(np.uint8)[:, None, :, :]
    return RawSource(images, labels, None, None, names)


def _sklearn_digits_csv() -> np.ndarray | None:
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # finds the package, imports nothing
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        return None
    raw = np.loadtxt(path, delimiter=",")
    return raw if raw.ndim == 2 and raw.shape[1] == 65 else None


def make_synthetic(cfg: dict, seed: int) -> RawSource:
    """Learnable class-conditional images: one random prototype per class plus Gaussian noise.

    Prototypes and noise come from the seed alone, so train and test share prototypes (the task
    is learnable) and the same seed gives the same bytes. test_size is generated directly.
    """
    shape = (cfg["channels"], cfg["height"], cfg["width"])
    num_classes = cfg["num_classes"]
    rng = np.random.default_rng([seed, 0x5EED])
    prototypes = rng.uniform(0.0, 1.0, size=(num_classes, *shape))
    splits = [
        _sample_from_prototypes(rng, prototypes, cfg[key], cfg["noise"])
        for key in ("train_size", "test_size")
    ]
    names = [f"class_{k}" for k in range(num_classes)]
    return RawSource(*splits[0], *splits[1], names)


def _sample_from_prototypes(
    rng, prototypes: np.ndarray, n: int, noise: float
) -> tuple[np.ndarray, np.ndarray]:
    # Balanced labels (n // K or n // K + 1 per class) in a seeded order.
    labels = rng.permutation(np.arange(n) % len(prototypes)).astype(np.int64)
    x = prototypes[labels] + noise * rng.standard_normal((n, *prototypes.shape[1:]))
    return np.rint(np.clip(x, 0.0, 1.0) * 255.0).astype(np.uint8), labels


def load_torchvision(source: str, root: Path, download: bool) -> RawSource:
    """Read train and test through torchvision's own dataset class (its on-disk layout)."""
    import torchvision.datasets as tvd

    cls = getattr(tvd, TORCHVISION_SOURCES[source])
    if not download:
        _prepare_offline(cls, source, root)
    try:
        train = cls(root=str(root), train=True, download=download)
        test = cls(root=str(root), train=False, download=download)
    except Exception as exc:  # torchvision raises RuntimeError/URLError/OSError
        hint = "check network access" if download else "check the files listed above"
        raise DataError(f"torchvision {cls.__name__} under {root} failed ({exc}); {hint}") from exc
    train_x, train_y = _tv_arrays(train)
    test_x, test_y = _tv_arrays(test)
    return RawSource(train_x, train_y, test_x, test_y, [str(c) for c in train.classes])


def _tv_arrays(ds) -> tuple[np.ndarray, np.ndarray]:
    data = ds.data.numpy() if hasattr(ds.data, "numpy") else np.asarray(ds.data)
    # MNIST-like: [N, H, W]; CIFAR: [N, H, W, C] (torchvision transposed it to HWC).
    data = data[:, None] if data.ndim == 3 else data.transpose(0, 3, 1, 2)
    targets = ds.targets.numpy() if hasattr(ds.targets, "numpy") else np.asarray(ds.targets)
    return np.ascontiguousarray(data, dtype=np.uint8), targets.astype(np.int64)


def expected_files(cls, root: Path) -> list[tuple[Path, str | None]]:
    """(path, md5 or None) of every file torchvision's `cls` reads, from its own attributes."""
    if hasattr(cls, "resources"):  # MNIST family: reads the uncompressed idx files, no md5
        raw = root / cls.__name__ / "raw"
        return [
            (raw / os.path.splitext(os.path.basename(url))[0], None) for url, _ in cls.resources
        ]
    folder = root / cls.base_folder  # CIFAR: every batch and the meta file are md5-checked
    listed = [*cls.train_list, *cls.test_list, [cls.meta["filename"], cls.meta["md5"]]]
    return [(folder / name, md5) for name, md5 in listed]


def _prepare_offline(cls, source: str, root: Path) -> None:
    """Check the files torchvision will read; gunzip MNIST .gz files it would not read itself."""
    from torchvision.datasets.utils import check_integrity

    files = expected_files(cls, root)
    if hasattr(cls, "resources"):
        if _mnist_legacy_present(cls, root):
            return
        for path, _ in files:
            _gunzip_if_needed(path)
    missing = [p.name for p, _ in files if not p.is_file()]
    corrupt = [p.name for p, md5 in files if p.is_file() and not check_integrity(str(p), md5)]
    if missing or corrupt:
        raise DataError(_missing_message(cls, source, root, files, missing, corrupt))


def _mnist_legacy_present(cls, root: Path) -> bool:
    # Old torchvision cached MNIST as processed/{training,test}.pt; it still reads those.
    processed = root / cls.__name__ / "processed"
    return all((processed / f).is_file() for f in (cls.training_file, cls.test_file))


def _gunzip_if_needed(path: Path) -> None:
    # torchvision's MNIST reads only the uncompressed files; with download=True it would
    # extract an existing .gz itself, so doing the same offline is what the user expects.
    gz = path.with_name(path.name + ".gz")
    if path.is_file() or not gz.is_file():
        return
    log.info("extracting %s -> %s", gz, path)
    with gzip.open(gz, "rb") as src, atomic_writer(path) as dst:
        shutil.copyfileobj(src, dst)


def _missing_message(cls, source, root, files, missing, corrupt) -> str:
    folder = files[0][0].parent
    status = {
        **dict.fromkeys(missing, "  <- missing"),
        **dict.fromkeys(corrupt, "  <- md5 mismatch"),
    }
    lines = [f"data.source={source}: torchvision's {cls.__name__} needs these files in {folder}:"]
    lines += [f"  {p.name}{status.get(p.name, '')}" for p, _ in files]
    if hasattr(cls, "resources"):
        lines.append("(the official *-ubyte.gz files are accepted too and extracted in place)")
    else:
        lines.append(f"(extract the official {cls.filename} in {root}: tar xzf {cls.filename})")
    lines.append(f"or set data.download: true to let torchvision fetch them into {root}")
    return "\n".join(lines)
