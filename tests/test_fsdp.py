"""train.strategy: fsdp on real gloo process groups (3 ranks: sums of 3 are order-sensitive).

One group trains the CNN fully sharded with the real Checkpointer writing DCP checkpoints
(each rank its shards, rank 0 the .pt that commits them), keeps a copy of a mid-epoch one,
and scores an uneven split with the sharded model; a second, fresh group resumes from the
copy through Checkpointer.restore and must finish with bitwise the same weights; a third
finds the newest checkpoint's shard corrupted and falls back to the one before.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from ddpflow import config as ddpconfig
from ddpflow.checks import values as checks_values
from ddpflow.cluster.distenv import discover
from ddpflow.config.typed import RunSpec
from ddpflow.training import evaluate, sharding
from ddpflow.training.checkpoint import Checkpointer
from ddpflow.training.loop import Loop, fit
from ddpflow.training.models import build_model
from distributed_helpers import make_data, run_group
from torch import nn
from workflow_helpers import make_run

# slow: real process groups or subprocesses for seconds each; make test-fast leaves it out
pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
WORLD = 3
# 2 steps per epoch (120 samples, a global batch of 48: 2 micro-batches of 8 per rank and
# step, accumulated; 24 samples sit out each epoch); step 3 is mid-epoch 2
SAVE_AT = 3


def _run() -> dict:
    return make_run(
        model={"name": "cnn", "cnn_channels": 8},
        train={"epochs": 3, "global_batch_size": 48, "micro_batch_size": 8, "progress": False,
               "strategy": "fsdp",
               "optimizer": {"name": "adamw", "lr": 0.003},
               "checkpoint": {"every_steps": 1, "every_epochs": 0, "keep": 50}},
        machine={"cpu_ranks_per_node": WORLD},
    )  # fmt: skip


def _loop(env) -> Loop:
    run, data = _run(), make_data(120, 31)
    torch.manual_seed(0)
    return Loop(RunSpec.from_run(run), data, env, CPU, build_model(run["model"], data.shape, 4))


def _trained(env, work: str) -> dict:
    import torch.distributed as dist

    loop = _loop(env)
    local = sum(p.to_local().numel() for p in loop.model.parameters())
    total = sum(p.numel() for p in loop.model.parameters())
    ckpt = Checkpointer(RunSpec.from_run(_run()), work, env)
    ckpt.restore(loop)
    loop.watch_steps(ckpt.on_step)
    fit(loop, lambda record: ckpt.on_epoch(loop))
    dist.barrier()
    # the sharded model scores an uneven split (31 samples, 3 ranks, batch 4: 3 forwards on
    # two ranks, 3 on the third whose shard has 10) exactly as one process scores it whole
    result = evaluate.evaluate_split(loop.model, loop.data.val, loop.data.scoring(4), env)
    return {
        "weights": loop.full_model_state(),
        "history": [{k: v for k, v in r.items() if k != "seconds" and k != "samples_per_s"}
                    for r in loop.history],
        "local": local, "total": total, "eval": result,
    }  # fmt: skip


def _keep_only(work: Path, steps: list[int], target: Path) -> None:
    """A copy of work's checkpoint folder holding only the checkpoints of these steps."""
    source = work / "checkpoints"
    (target / "checkpoints").mkdir(parents=True)
    for step in steps:
        for path in source.glob(f"ckpt-{step:09d}.*"):
            copy = shutil.copytree if path.is_dir() else shutil.copy2
            copy(path, target / "checkpoints" / path.name)


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    base = tmp_path_factory.mktemp("fsdp")
    clean = run_group(WORLD, _trained, (str(base / "clean"),), base / "rv1")
    _keep_only(base / "clean", [SAVE_AT], base / "resume")
    _keep_only(base / "clean", [SAVE_AT, SAVE_AT + 1], base / "corrupt")
    newest = base / "corrupt/checkpoints" / f"ckpt-{SAVE_AT + 1:09d}.dcp" / "__1_0.distcp"
    newest.write_bytes(newest.read_bytes()[:-8])  # rank 1's shard truncated
    resumed = run_group(WORLD, _trained, (str(base / "resume"),), base / "rv2")
    fallback = run_group(WORLD, _trained, (str(base / "corrupt"),), base / "rv3")
    return base, clean, resumed, fallback


def test_each_rank_holds_a_third_of_the_parameters(groups):
    """FSDP2 shards each parameter by rows (dim 0): a rank holds ceil(rows / 3) of them."""
    _, clean, _, _ = groups
    model = build_model(_run()["model"], [1, 8, 8], 4)
    bound = sum(math.ceil(p.shape[0] / WORLD) * p[0].numel() for p in model.parameters())
    total = clean[0]["total"]
    assert total == sum(p.numel() for p in model.parameters())
    assert sum(rank["local"] for rank in clean) == total  # every element on one rank
    assert all(rank["local"] <= bound < 0.4 * total for rank in clean), (bound, total)


def test_a_checkpoint_is_shards_plus_the_pt_that_commits_them(groups):
    base = groups[0]
    directory = base / "clean/checkpoints" / f"ckpt-{SAVE_AT:09d}.dcp"
    names = sorted(p.name for p in directory.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    state = torch.load(directory.with_suffix(".pt"), weights_only=True)
    assert "model" not in state and "optimizer" not in state
    assert sorted(state["sharded"]["files"]) == names and state["step"] == SAVE_AT
    assert state["epoch"] == 1 and state["epoch_step"] == 1  # mid-epoch, after one step


def test_fsdp_resumes_bitwise_from_a_mid_epoch_checkpoint(groups):
    _, clean, resumed, _ = groups
    expected, got = clean[0]["weights"], resumed[0]["weights"]
    assert expected and expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(value, got[key]), f"{key} differs after resume"
    assert resumed[0]["history"] == clean[0]["history"]
    assert clean[1]["weights"] == {}  # the whole model is gathered on rank 0 only


def test_a_corrupt_shard_falls_back_to_the_checkpoint_before(groups):
    _, clean, _, fallback = groups
    for key, value in clean[0]["weights"].items():
        assert torch.equal(value, fallback[0]["weights"][key]), key


def test_the_sharded_model_scores_an_uneven_split_exactly(groups):
    _, clean, _, _ = groups
    data = make_data(120, 31)
    run = _run()
    model = build_model(run["model"], data.shape, 4)
    model.load_state_dict(clean[0]["weights"])
    whole = evaluate.evaluate_split(model, data.val, data.scoring(4), discover({}))
    for rank in clean:
        assert rank["eval"]["confusion_matrix"] == whole["confusion_matrix"]
        assert rank["eval"]["samples_evaluated"] == 31


def test_units_are_the_models_blocks():
    import torchvision

    resnet = torchvision.models.resnet18(num_classes=10)
    assert len(sharding.units(resnet)) == 8  # 4 stages x 2 BasicBlocks
    vit = torchvision.models.VisionTransformer(32, 16, 2, 2, 16, 32)  # 2 encoder layers
    assert [type(u).__name__ for u in sharding.units(vit)] == ["EncoderBlock"] * 2
    cnn = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    assert sharding.units(cnn) == [cnn[0], cnn[3]]  # children with parameters


@pytest.mark.parametrize(
    "train, machine, message",
    [
        ({"precision": "fp16"}, {"gpus_per_node": 1}, "use train.precision: bf16"),
        ({"compile": True}, {}, "train.compile: true is not supported yet"),
        ({"fsdp": {"cpu_offload": True}}, {}, "train.fsdp.cpu_offload is true but the run"),
    ],
)
def test_combinations_fsdp_cannot_run_are_refused(train, machine, message, monkeypatch):
    monkeypatch.setattr(checks_values, "local_gpu_count", lambda: 8)  # where looked up
    with pytest.raises(ddpconfig.ConfigError, match=message):
        ddpconfig.load(None, {"train": {"strategy": "fsdp", **train}, "machine": machine})


def test_fsdp_is_in_the_fingerprint_and_ddp_zero_are_not():
    def fingerprint(**train):
        return ddpconfig.training_fingerprint(make_run(train=train))

    assert fingerprint(strategy="ddp") == fingerprint(strategy="zero")
    fsdp = fingerprint(strategy="fsdp")
    assert fsdp["train.strategy"] == "fsdp" and fsdp["train.fsdp.reduce_dtype"] == "fp32"


def test_ddp_settings_under_fsdp_are_named_as_ignored():
    run = make_run(train={"strategy": "fsdp", "ddp": {"comm_hook": "bf16_compress"}})
    (warning,) = ddpconfig.run_warnings(run, "local")
    assert "train.ddp.comm_hook set, but strategy fsdp" in warning and "ignored" in warning
    assert ddpconfig.run_warnings(make_run(train={"strategy": "fsdp"}), "local") == []
