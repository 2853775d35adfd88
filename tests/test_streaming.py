"""Issue 12, loading: the in-memory and streamed paths give every rank the same samples, so a
run trains to bitwise the same weights on either; augmentation is deterministic per (seed,
epoch, micro-batch, rank); node-local copies are made once per node, verified and reused;
none of the loading keys retrains or restages anything."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from datafixtures import make_folder
from ddpflow.config.typed import TrainAugmentSpec
from ddpflow.data import feed
from ddpflow.data import staged as ddata
from workflow_helpers import jobs_planned, make_run, snakemake, write_config

AUGMENT = {"enabled": True, "crop_padding": 2, "horizontal_flip": True}
AUGMENTED = TrainAugmentSpec.from_dict(AUGMENT)


def test_augmentation_is_a_padded_crop_then_a_flip_drawn_from_seed_epoch_step_micro_batch():
    from ddpflow.training.schedule import micro_batch_seed

    x = torch.randint(0, 256, (64, 3, 8, 10), dtype=torch.uint8)
    out = feed.augment(x, AUGMENTED, micro_batch_seed(0, 1, 2, 3))
    assert torch.equal(out, feed.augment(x, AUGMENTED, micro_batch_seed(0, 1, 2, 3)))  # again
    assert out.stride() == (240, 80, 10, 1)  # plain NCHW: the convolutions see no layout change
    for other in ((1, 1, 2, 3), (0, 2, 2, 3), (0, 1, 3, 3), (0, 1, 2, 4)):
        assert not torch.equal(out, feed.augment(x, AUGMENTED, micro_batch_seed(*other))), other
    # each sample is a crop of the zero-padded image, flipped or not: torchvision's
    # RandomCrop(padding=2) then RandomHorizontalFlip, one sample at a time
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    flipped = 0
    for i in range(64):
        crops = [
            padded[i, :, top : top + 8, left : left + 10] for top in range(5) for left in range(5)
        ]
        plain = any(torch.equal(out[i], c) for c in crops)
        mirrored = any(torch.equal(out[i], c.flip(-1)) for c in crops)
        assert plain or mirrored, i
        flipped += mirrored and not plain
    assert 16 < flipped < 48  # about half
    off = dataclasses.replace(AUGMENTED, enabled=False)
    assert feed.augment(x, off, micro_batch_seed(0, 1, 2, 3)) is x


def test_auto_keeps_data_in_memory_when_it_fits_the_budget():
    run = make_run(machine={"mem_gb": 8, "cpu_ranks_per_node": 2})
    assert ddata.budget_bytes(run) == 2 * 2**30  # half of 8 GiB over 2 ranks
    assert ddata.choose_in_memory(run, 2 * 2**30)[0] is True
    fits, why = ddata.choose_in_memory(run, 2 * 2**30 + 1)
    assert fits is False and "exceeds the budget of 2.00 GiB per rank" in why
    run = make_run(data={"loading": {"memory_budget_gb": 0.5}})
    assert ddata.choose_in_memory(run, 2**29 + 1)[0] is False
    run = make_run(data={"loading": {"in_memory": True, "memory_budget_gb": 0.001}})
    assert ddata.choose_in_memory(run, 2**30)[0] is True


def _config(in_memory, **loading) -> dict:
    return {
        "data": {
            "source": "image_folder",
            "root": "images",
            "image_size": [16, 16],
            "loading": {"in_memory": in_memory, **loading},
        },
        "train": {"epochs": 4, "progress": False, "augment": AUGMENT},
        "runs": [{"name": "cnn"}],
    }


def _rank0_log(workdir) -> str:
    return "".join(p.read_text() for p in (workdir / "logs/submitit/cnn/train").glob("*_0_log.err"))


def _weights(workdir) -> dict:
    return torch.load(workdir / "results/runs/cnn/model.pt", weights_only=True)["state_dict"]


@pytest.mark.e2e
def test_streamed_and_in_memory_train_the_same_weights_and_loading_edits_redo_nothing(tmp_path):
    """The same image folder trained by Snakemake twice, with augmentation: in memory, and
    streamed by 2 DataLoader workers per rank. Bitwise the same weights and metrics; then
    every loading key edited: nothing to do."""
    results = {}
    for in_memory in (True, False):
        workdir = tmp_path / f"in_memory_{in_memory}"
        make_folder(workdir / "images", per_class=(40, 10))
        configfile = write_config(workdir / "config.yaml", _config(in_memory, workers=2))
        result = snakemake(workdir, configfile)
        assert result.returncode == 0, result.stderr[-3000:]
        log = _rank0_log(workdir)
        assert ("streamed from" in log) is (not in_memory), log[-2000:]
        metrics = json.loads((workdir / "results/runs/cnn/eval_metrics.json").read_text())
        report = (workdir / "results/report/report.md").read_text()
        assert ("data streamed" in report) is (not in_memory)
        results[in_memory] = (workdir, configfile, metrics)
    memory, streamed = _weights(results[True][0]), _weights(results[False][0])
    assert all(torch.equal(memory[key], streamed[key]) for key in memory)
    assert results[True][2]["accuracy"] == results[False][2]["accuracy"] >= 0.9
    assert results[True][2]["samples_evaluated"] == 30
    summary = json.loads((results[False][0] / "results/runs/cnn/train_summary.json").read_text())
    assert summary["data_in_memory"] is False
    # edit every loading key (and the stage threads): nothing restages or retrains
    workdir, configfile, _ = results[False]
    edited = _config(True, workers=0, prefetch=1, memory_budget_gb=0.1,
                     node_local_dir=str(tmp_path / "local"))  # fmt: skip
    edited["data"]["stage_threads"] = 1
    write_config(configfile, edited)
    assert jobs_planned(workdir, configfile) == set()


@pytest.mark.e2e
def test_node_local_copy_is_made_verified_reused_and_replaced_when_damaged(workdir, tmp_path):
    """data.loading.node_local_dir with a $VARIABLE: the local launcher's node copies the
    staged data there before training; a retrain reuses it; a damaged copy is made again."""
    make_folder(workdir / "images", per_class=(30, 6))
    config = _config("auto", node_local_dir="$DDPFLOW_TEST_SCRATCH/ddpflow")
    configfile = write_config(workdir / "config.yaml", config)
    env = {"DDPFLOW_TEST_SCRATCH": str(tmp_path / "scratch")}
    assert snakemake(workdir, configfile, env=env).returncode == 0
    staged = next((workdir / "results/staged").iterdir())
    copy = tmp_path / "scratch/ddpflow" / staged.name
    assert (copy / ".verified").read_bytes() == (staged / "manifest.json").read_bytes()
    assert "copied to " + str(copy) in _rank0_log(workdir)
    first = _weights(workdir)

    (workdir / "results/runs/cnn/model.pt").unlink()
    result = snakemake(workdir, configfile, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reused the verified copy" in _rank0_log(workdir)

    shard = copy / "train_images-00000.npy"
    damaged = bytearray(shard.read_bytes())
    damaged[-1] ^= 0xFF
    shard.write_bytes(bytes(damaged))
    (workdir / "results/runs/cnn/model.pt").unlink()
    result = snakemake(workdir, configfile, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    log = _rank0_log(workdir)
    assert "is damaged" in log and "sha256 mismatch" in log, log[-2000:]
    again = _weights(workdir)
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert np.array_equal(np.load(shard), np.load(staged / "train_images-00000.npy"))


def test_augmentation_settings_retrain_only_when_it_is_on():
    from ddpflow.config import training_fingerprint

    base = training_fingerprint(make_run())
    assert not any(key.startswith("train.augment") for key in base)  # as before it existed
    assert training_fingerprint(make_run(train={"augment": {"crop_padding": 2}})) == base
    on = training_fingerprint(make_run(train={"augment": {"enabled": True}}))
    assert on["train.augment.enabled"] is True and on["train.augment.crop_padding"] == 4
    loading = {"in_memory": False, "workers": 0, "node_local_dir": "/x"}
    assert training_fingerprint(make_run(data={"loading": loading, "stage_threads": 1})) == base
