"""Fine-tuning through the real workflow: run `ft` starts from run `base`'s model.pt
(model.weights: run:base) on an image folder of 4 classes with a few images each, its
backbone frozen; `scratch` is the same run from random weights. The backbone of ft's model.pt
is base's bitwise, its head has 4 classes and it clearly beats scratch; editing base
re-plans both trainings. Then each wrong weights file is refused before any rank starts,
naming the cause and the fix (no weights are downloaded: torchvision's cache is a folder of
this test's own)."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from ddpflow.data.sources import make_synthetic
from PIL import Image
from workflow_helpers import jobs_planned, snakemake, write_config

pytestmark = pytest.mark.e2e

BASE = {"name": "base", "data": {"source": "synthetic"}, "train": {"epochs": 4}}
NEW_DATA = {
    "source": "image_folder",
    "root": "few",
    "channels": 1,
    "image_size": [8, 8],
    "val_fraction": 0.25,
    "test_fraction": 0.45,
    "max_train_samples": 8,
}
SMALL = {"global_batch_size": 4, "micro_batch_size": 2, "epochs": 6}
CONFIG = {
    "train": {"progress": False},
    "runs": [
        BASE,
        {
            "name": "ft",
            "data": NEW_DATA,
            "model": {"weights": "run:base"},
            "train": {**SMALL, "freeze": "backbone", "optimizer": {"lr": 0.1}},
        },  # fmt: skip
        {"name": "scratch", "data": NEW_DATA, "train": {**SMALL, "optimizer": {"lr": 0.1}}},
    ],
}


def write_few(root: Path, per_class: int = 24) -> None:
    """Images of 4 of the synthetic source's 10 classes (its default prototypes: what base
    learns), as class folders of 8x8 grayscale PNGs."""
    raw = make_synthetic({"channels": 1, "height": 8, "width": 8, "num_classes": 10,
                          "train_size": 10, "test_size": 400, "noise": 0.5}, seed=0)  # fmt: skip
    images, labels = raw.test_x, raw.test_y
    for label in range(4):
        folder = root / "train" / f"kind_{label}"
        folder.mkdir(parents=True)
        for i, image in enumerate(images[labels == label][:per_class]):
            Image.fromarray(image[0]).save(folder / f"{i:03d}.png")


def state(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("finetune")
    write_few(workdir / "few")
    configfile = write_config(workdir / "config.yaml", CONFIG)
    result = snakemake(workdir, configfile)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return workdir, configfile, result.stdout + result.stderr


def test_the_frozen_backbone_is_the_files_and_the_head_is_new(chain):
    workdir, _, output = chain
    base, ft = (state(workdir / f"results/runs/{r}/model.pt") for r in ("base", "ft"))
    head = [key for key in ft if ft[key].shape != base[key].shape]
    assert sorted(head) == ["15.bias", "15.weight"], head  # the CNN's last Linear
    assert ft["15.weight"].shape[0] == 4 and base["15.weight"].shape[0] == 10
    for key in base.keys() - set(head):  # weights and BatchNorm statistics alike
        assert torch.equal(ft[key], base[key]), key
    assert "head 15 re-initialised: 10 -> 4 classes" in output
    summary = json.loads((workdir / "results/runs/ft/train_summary.json").read_text())
    done = summary["fine_tuning"]
    assert done["weights"]["spec"] == "run:base" and done["freeze"] == "backbone"
    sha = hashlib.sha256((workdir / "results/runs/base/model.pt").read_bytes()).hexdigest()
    assert done["weights"]["sha256"] == sha
    assert "train split's mean and std" in done["normalisation"]


def test_fine_tuning_clearly_beats_training_from_scratch(chain):
    workdir, _, _ = chain
    accuracy = {
        run: json.loads((workdir / f"results/runs/{run}/eval_metrics.json").read_text())["accuracy"]
        for run in ("ft", "scratch")
    }
    assert accuracy["ft"] > 0.9 and accuracy["ft"] > accuracy["scratch"] + 0.2, accuracy
    report = (workdir / "results/report/report.md").read_text()
    assert "run:base" in report and "re-initialised" in report


def test_editing_the_source_run_retrains_both_and_nothing_else(chain):
    workdir, configfile, _ = chain
    assert jobs_planned(workdir, configfile) == set()
    edited = json.loads(json.dumps(CONFIG))
    edited["runs"][0]["train"]["optimizer"] = {"lr": 0.02}
    planned = snakemake(workdir, write_config(workdir / "edited.yaml", edited), "-n")
    text = planned.stdout + planned.stderr
    assert planned.returncode == 0, text[-3000:]
    trains = [line for line in text.splitlines() if line.strip().startswith("wildcards: run=")]
    assert {"run=base", "run=ft"} <= {w.split()[-1] for w in trains}, text[-3000:]
    assert "run=scratch" not in {w.split()[-1] for w in trains}


# -- refusals, before any rank starts ------------------------------------------------------


def _refused(workdir: Path, model: dict, env: dict | None = None, *targets: str) -> str:
    config = {"train": {"epochs": 1, "progress": False}, "model": model}
    configfile = write_config(workdir / "config.yaml", config)
    # targets after another option: --configfile takes every word that follows it
    result = snakemake(workdir, configfile, "--cores", "2", *targets, env=env)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert not (workdir / "logs/submitit").exists(), "a rank started"
    assert not (workdir / "results/runs/default/model.pt").exists()
    return output


def test_a_wrong_pin_and_another_architecture_are_refused_naming_the_keys(tmp_path):
    mlp = tmp_path / "mlp.pt"
    torch.save({"0.weight": torch.zeros(3, 64), "2.weight": torch.zeros(10, 3)}, mlp)
    found = hashlib.sha256(mlp.read_bytes()).hexdigest()
    output = _refused(tmp_path, {"weights": str(mlp), "weights_sha256": "0" * 64})
    assert f"has sha256 {found}, but model.weights_sha256 expects {'0' * 64}" in output
    output = _refused(tmp_path, {"weights": str(mlp)})
    assert "does not fit this model" in output and "missing: 1.bias" in output, output[-3000:]
    assert "unexpected: 2.weight" in output


def test_torchvision_weights_missing_or_damaged_are_refused_and_never_downloaded(tmp_path):
    home = tmp_path / "torch-home"
    env = {"TORCH_HOME": str(home)}
    cached = home / "hub/checkpoints/resnet18-f37072fd.pth"
    model = {"name": "resnet18", "weights": "IMAGENET1K_V1"}
    output = _refused(tmp_path, model, env)
    assert "https://download.pytorch.org/models/resnet18-f37072fd.pth" in output
    assert f"at {cached}" in output and "snakemake fetch_weights" in output
    # fetch_weights from a mirror that serves a damaged file: refused, nothing written
    served = tmp_path / "mirror"
    served.mkdir()
    (served / cached.name).write_bytes(b"not the weights")
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        mirror = {**env, "DDPFLOW_WEIGHTS_MIRROR": f"http://127.0.0.1:{server.server_port}"}
        output = _refused(tmp_path, model, mirror, "fetch_weights")
    finally:
        server.shutdown()
    assert "the download from" in output and "is damaged" in output, output[-3000:]
    assert not cached.exists()
    # a damaged file in the cache (its sha256 is not the one its name starts with)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(np.arange(1000, dtype=np.uint8).tobytes())
    output = _refused(tmp_path, model, env)
    assert f"{cached} is damaged" in output and "does not start with the f37072fd" in output
