"""The tutorials' own scenarios, shipped as configs, run end to end on tiny fixture data in
torchvision's on-disk formats (the real datasets cannot be downloaded here)."""

from __future__ import annotations

import json
import shutil

import pytest
from datafixtures import trust_cifar_fixture, write_cifar, write_mnist_like
from ddpflow import config as ddpconfig
from ddpflow.data.staging import stage_dataset
from workflow_helpers import REPO, snakemake, write_config

pytestmark = pytest.mark.e2e
TUTORIALS = REPO / "config/tutorials"


def test_fashion_mnist_mlp_tutorial(workdir):
    write_mnist_like(workdir / "data/raw", "FashionMNIST", n_train=300, n_test=101)
    overlay = write_config(workdir / "quick.yaml", {"train": {"epochs": 3, "progress": False}})
    result = snakemake(workdir, TUTORIALS / "fashion_mnist_mlp.yaml", str(overlay))
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((workdir / "results/runs/fashion_mnist_mlp/eval_metrics.json").read_text())
    assert metrics["samples_evaluated"] == metrics["test_size"] == 101
    # what ran is the tutorial's scenario (batch 100 per rank on 2 ranks, Adam lr 0.01), only
    # shortened
    ran = metrics["provenance"]["config"]
    assert ran["model"]["name"] == "mlp" and ran["train"]["micro_batch_size"] == 100
    assert ran["train"]["global_batch_size"] == 200
    assert ran["train"]["optimizer"]["name"] == "adam" and ran["train"]["optimizer"]["lr"] == 0.01
    assert ran["train"]["epochs"] == 3
    assert metrics["accuracy"] > 0.5  # learnable fixture, 10 classes: chance is 0.1


def test_cifar10_resnet34_tutorial(workdir, monkeypatch):
    """CIFAR's loader checks md5s that no fixture can match; the fixture is trusted in this
    process only, so the data is staged here and Snakemake runs training and evaluation."""
    trust_cifar_fixture(
        monkeypatch, "cifar10", write_cifar(workdir / "data/raw", "cifar10", n_train=96, n_test=37)
    )
    quick = {
        "train": {"epochs": 1, "global_batch_size": 32, "micro_batch_size": 16, "progress": False},
        "machine": {
            "nodes": 1,
            "gpus_per_node": 0,
            "cpu_ranks_per_node": 2,
            "mem_gb": 4,
            "time_min": 30,
        },
    }
    overlay = write_config(workdir / "quick.yaml", quick)
    monkeypatch.chdir(workdir)
    cfg = ddpconfig.load(TUTORIALS / "cifar10_resnet34.yaml", quick)
    run = ddpconfig.resolve_runs(cfg)[0]
    stage_dataset(run["data"], workdir / "results/staged" / run["dataset_id"], seed=0)
    shutil.rmtree(workdir / "data/raw")  # Snakemake must not need the raw files any more

    result = snakemake(workdir, TUTORIALS / "cifar10_resnet34.yaml", str(overlay))
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((workdir / "results/runs/cifar10_resnet34/eval_metrics.json").read_text())
    assert metrics["samples_evaluated"] == metrics["test_size"] == 37
    assert metrics["world_size"] == 2
    ran = metrics["provenance"]["config"]
    assert ran["model"]["name"] == "resnet34" and ran["train"]["optimizer"]["name"] == "adamw"
