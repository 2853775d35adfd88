"""Your own model (issue 13, models part): torchvision models by name, plug-ins from a file in
the working directory, and the clear errors before anything is submitted."""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest
import torch
from ddpflow import config as ddpconfig
from ddpflow.config import ConfigError, check_runs, plugin_source_hash, training_fingerprint
from ddpflow.training.models import ModelError, build_model, check_model
from torch import nn
from workflow_helpers import REPO, make_run, snakemake, write_config

DIGITS = [1, 8, 8]  # the default data's staged shape


def test_a_torchvision_model_by_name_takes_the_datas_channels():
    model = build_model({"name": "mobilenet_v3_small", "kwargs": {}}, DIGITS, 10)
    first = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert first.in_channels == 1
    assert check_model({"name": "mobilenet_v3_small"}, DIGITS, 10) == sum(
        p.numel() for p in model.parameters()
    )


@pytest.mark.parametrize("small", [True, False])
def test_the_small_input_stem_of_torchvision_resnets(small):
    cfg = {"name": "resnext50_32x4d", "kwargs": {}, "small_input_stem": small}
    model = build_model(cfg, [3, 32, 32], 7)
    assert model.conv1.stride == ((1, 1) if small else (2, 2))
    assert isinstance(model.maxpool, nn.Identity) is small
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 7)


def test_kwargs_reach_torchvision():
    model = build_model({"name": "mobilenet_v3_small", "kwargs": {"dropout": 0.5}}, DIGITS, 10)
    assert [m.p for m in model.modules() if isinstance(m, nn.Dropout)] == [0.5]
    with pytest.raises(ModelError, match=r"kwargs \{'widht_per_group': 2\}.*unexpected keyword"):
        build_model({"name": "resnet50", "kwargs": {"widht_per_group": 2}}, DIGITS, 10)
    # a ViT takes the data's image size through its kwargs; without, it wants 224x224 images
    assert check_model({"name": "vit_b_16", "kwargs": {"image_size": 32}}, [3, 32, 32], 10) > 0
    with pytest.raises(ModelError, match=r"forward pass of the data's shape \[N, 1, 8, 8\]"):
        check_model({"name": "vit_b_16", "kwargs": {}}, DIGITS, 10)


def test_a_model_with_auxiliary_outputs_in_training_is_refused():
    # googlenet returns (logits, aux2, aux1) in training mode only: an eval-mode check would
    # pass it and training would fail on the cluster
    with pytest.raises(ModelError, match=r"in training mode.*GoogLeNetOutputs"):
        check_model({"name": "googlenet", "kwargs": {"init_weights": False}}, [3, 64, 64], 10)
    cfg = {"name": "googlenet", "kwargs": {"aux_logits": False, "init_weights": False}}
    assert check_model(cfg, [3, 64, 64], 10) > 0


def test_an_unknown_name_suggests_close_matches():
    with pytest.raises(ModelError) as err:
        build_model({"name": "mobilenet_v3_smal"}, DIGITS, 10)
    message = str(err.value)
    assert "'mobilenet_v3_smal'" in message and "did you mean mobilenet_v3_small" in message
    with pytest.raises(ModelError, match="did you mean resnet18, resnet152") as err:
        build_model({"name": "resnet81"}, DIGITS, 10)
    assert str(err.value).split("did you mean ")[1].count("resnet18") == 1


def test_a_plugin_from_a_file_in_the_working_directory(in_workdir):
    shutil.copy(REPO / "config/examples/my_model.py", in_workdir / "my_model.py")
    cfg = {"name": "my_model:build", "kwargs": {"width": 24, "dropout": 0.1}}
    model = build_model(cfg, DIGITS, 10)
    assert model[0].out_channels == 24 and model[0].in_channels == 1
    assert check_model(cfg, DIGITS, 10) == sum(p.numel() for p in model.parameters())


PLUGINS = {
    "raises": "def build(shape, n):\n    raise RuntimeError('no GPU here')\n",
    "not_module": "def build(shape, n):\n    return 'a model'\n",
    "wrong_width": "from torch import nn\ndef build(shape, n):\n"
    "    return nn.Sequential(nn.Flatten(), nn.Linear(64, n + 1))\n",
    "wrong_shape": "from torch import nn\ndef build(shape, n):\n"
    "    return nn.Sequential(nn.Flatten(), nn.Linear(784, n))\n",
}


@pytest.mark.parametrize(
    "module, expected",
    [
        ("raises", r"the factory raised RuntimeError: no GPU here \(called with input shape "
                   r"\[1, 8, 8\], 10 classes"),
        ("not_module", "the factory returned a str, not a torch.nn.Module"),
        ("wrong_width", r"returns \(2, 11\) for 2 samples; expected logits of shape \(2, 10\)"),
        ("wrong_shape", r"a forward pass of the data's shape \[N, 1, 8, 8\] failed"),
    ],
)  # fmt: skip
def test_a_bad_plugin_is_refused_with_the_cause(in_workdir, module, expected):
    (in_workdir / f"{module}.py").write_text(PLUGINS[module])
    with pytest.raises(ModelError, match=expected):
        check_model({"name": f"{module}:build"}, DIGITS, 10)


def test_an_import_path_that_does_not_resolve(in_workdir):
    with pytest.raises(ModelError, match=r"cannot import 'nowhere_model'.*working directory"):
        check_model({"name": "nowhere_model:build"}, DIGITS, 10)
    (in_workdir / "half.py").write_text("def other(shape, n):\n    pass\n")
    with pytest.raises(ModelError, match=r"has no function 'build'"):
        check_model({"name": "half:build"}, DIGITS, 10)
    with pytest.raises(ModelError, match=r"written 'package.module:function'"):
        check_model({"name": "half:"}, DIGITS, 10)


def test_editing_the_plugin_file_changes_the_training_fingerprint(in_workdir):
    path = in_workdir / "my_model.py"
    shutil.copy(REPO / "config/examples/my_model.py", path)
    run = make_run(model={"name": "my_model:build"})
    before = training_fingerprint(run)
    assert before["model.plugin_sha256"] == plugin_source_hash("my_model:build") != "unresolved"
    path.write_text(path.read_text().replace("nn.GELU()", "nn.ReLU()"))
    assert training_fingerprint(run)["model.plugin_sha256"] != before["model.plugin_sha256"]
    assert "model.plugin_sha256" not in training_fingerprint(make_run())  # built-in models


def test_the_fingerprint_holds_only_the_keys_that_shape_the_model():
    cnn = training_fingerprint(make_run(model={"name": "cnn", "mlp_hidden": [64]}))
    assert cnn == training_fingerprint(make_run(model={"name": "cnn", "mlp_hidden": [512]}))
    assert cnn != training_fingerprint(make_run(model={"name": "cnn", "cnn_channels": 8}))
    zoo = {"name": "resnet50", "kwargs": {"width_per_group": 32}}
    assert training_fingerprint(make_run(model=zoo))["model.kwargs.width_per_group"] == 32
    flat = training_fingerprint(make_run(model={**zoo, "small_input_stem": False}))
    assert flat["model.small_input_stem"] is False and "model.cnn_channels" not in flat


def test_kwargs_for_a_built_in_model_are_refused():
    with pytest.raises(ConfigError, match=r"model.kwargs \{'width': 8\} is set for the built"):
        check_runs(ddpconfig.load(None, {"model": {"name": "cnn", "kwargs": {"width": 8}}}))


# -- end to end: the real workflow in a user's working directory ---------------------------

ZOO_RUNS = {
    "train": {"progress": False},
    "runs": [
        {"name": "mine", "model": {"name": "my_model:build", "kwargs": {"width": 32}}},
        {"name": "shufflenet", "model": {"name": "shufflenet_v2_x0_5"}},
    ],
}


@pytest.mark.e2e
def test_a_plugin_and_a_torchvision_model_train_end_to_end(workdir):
    """A plug-in from a file in the working directory and a torchvision model by name, both
    trained by the real workflow (12 epochs of the default digits, 2 gloo ranks). Measured
    on 2026-11-23: my_model 0.989, shufflenet_v2_x0_5 0.749 test accuracy."""
    shutil.copy(REPO / "config/examples/my_model.py", workdir / "my_model.py")
    configfile = write_config(workdir / "config.yaml", ZOO_RUNS)
    result = snakemake(workdir, configfile)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "model 'my_model:build': 21,578 parameters" in output
    assert "model 'shufflenet_v2_x0_5': 351,610 parameters" in output

    mine = json.loads((workdir / "results/runs/mine/eval_metrics.json").read_text())
    zoo = json.loads((workdir / "results/runs/shufflenet/eval_metrics.json").read_text())
    assert mine["accuracy"] > 0.95 and zoo["accuracy"] > 0.6
    # the provenance is this run's config: no schema default naming a run "default"
    assert mine["provenance"]["config"]["name"] == "mine"
    assert "runs" not in mine["provenance"]["config"]
    plugin = mine["provenance"]["model_plugin"]
    assert plugin["file"] == str((workdir / "my_model.py").resolve())
    assert plugin["sha256"] == hashlib.sha256((workdir / "my_model.py").read_bytes()).hexdigest()
    summary = json.loads((workdir / "results/report/summary.json").read_text())
    models = {row["run"]: row["model"] for row in summary["runs"]}
    assert models == {"mine": "my_model:build", "shufflenet": "shufflenet_v2_x0_5"}

    # editing the plug-in's code retrains its run, and only its run
    path = workdir / "my_model.py"
    path.write_text(path.read_text().replace("nn.GELU()", "nn.ReLU()"))
    dry = snakemake(workdir, configfile, "-n")
    assert dry.returncode == 0, dry.stderr[-3000:]
    planned = re.findall(r"rule train:\n(?:    .*\n)*?    wildcards: run=(\w+)", dry.stdout)
    assert planned == ["mine"], dry.stdout[-3000:]
    assert "model.plugin_sha256" in dry.stdout


@pytest.mark.e2e
def test_a_bad_plugin_fails_before_any_job_is_submitted(workdir):
    (workdir / "flat.py").write_text(PLUGINS["wrong_shape"])
    configfile = write_config(
        workdir / "config.yaml", {"model": {"name": "flat:build"}, "runs": [{"name": "flat"}]}
    )
    result = snakemake(workdir, configfile)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "model.name 'flat:build': a forward pass of the data's shape [N, 1, 8, 8]" in output
    assert (workdir / "results/staged").exists()  # staging ran; no training job was submitted
    assert not list((workdir / "logs").rglob("*_submitted.pkl"))
    assert not (workdir / "results/runs/flat/model.pt").exists()


def test_a_model_whose_forward_fails_in_channels_last_is_refused_naming_the_fix(in_workdir):
    """A tutorial-style .view() of a convolution's output works in NCHW and fails in the
    channels_last layout that ddpflow gives convolutional models (on CPUs too, since they
    train faster that way): refused before submission, naming both fixes."""
    (in_workdir / "view_model.py").write_text(
        "from torch import nn\n\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self, channels, num_classes):\n"
        "        super().__init__()\n"
        "        self.conv = nn.Conv2d(channels, 4, 3, padding=1)\n"
        "        self.fc = nn.Linear(4 * 8 * 8, num_classes)\n\n"
        "    def forward(self, x):\n"
        "        return self.fc(self.conv(x).view(x.shape[0], -1))\n\n\n"
        "def build(input_shape, num_classes):\n"
        "    return Net(input_shape[0], num_classes)\n"
    )
    cfg = {"name": "view_model:build"}
    assert check_model(cfg, DIGITS, 10) > 0  # NCHW: fine
    with pytest.raises(ModelError) as err:
        check_model(cfg, DIGITS, 10, channels_last=True)
    message = str(err.value)
    assert "'view_model:build'" in message and "channels_last" in message
    assert ".reshape()" in message and "train.channels_last: false" in message
    # the shipped example plug-in and a torchvision model run in channels_last
    shutil.copy(REPO / "config/examples/my_model.py", in_workdir / "my_model.py")
    assert check_model({"name": "my_model:build"}, DIGITS, 10, channels_last=True) > 0
    assert check_model({"name": "resnet18"}, DIGITS, 10, channels_last=True) > 0
