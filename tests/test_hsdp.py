"""train.strategy: hsdp on real gloo process groups: FSDP2 on a replicate x shard mesh.

Four ranks train the CNN (BatchNorm included) on a 2 x 2 mesh: each rank holds half of every
parameter (its shard group's half), writes DCP checkpoints, and its per-step losses match
fsdp at 2 ranks and plain training at 1 rank within float tolerance (the same micro-batches,
summed in another order). A mid-run checkpoint of the 2 x 2 run then resumes on other
meshes: 1 x 2 (two ranks, one shard group: fsdp's layout) and 4 x 1 (four replicas of
unsharded parameters), each finishing with the uninterrupted run's weights within float
tolerance."""

from __future__ import annotations

import math

import pytest
import torch
from ddpflow.config import fingerprint
from ddpflow.config.machine import hsdp_mesh
from ddpflow.config.typed import RunSpec
from ddpflow.training import sharding
from ddpflow.training.checkpoint import Checkpointer
from ddpflow.training.loop import Loop, fit
from ddpflow.training.models import build_model
from distributed_helpers import make_data, run_group
from test_fsdp import _keep_only
from workflow_helpers import make_run

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
# 128 samples, a global batch of 64 (micro-batch 8): 2 steps per epoch at every world size
# (8, 4 and 2 micro-batches per rank and step at 1, 2 and 4 ranks); step 3 is mid-epoch 2
SAVE_AT = 3
TOLERANCE = 2e-5  # relative: float sums of the same micro-batches in another order


def _run(strategy: str, world: int, shard_size: int | None, background: bool = False) -> dict:
    every_step = {"every_steps": 1, "every_epochs": 0, "keep": 50, "async": background}
    return make_run(
        model={"name": "cnn", "cnn_channels": 8},
        train={
            "epochs": 3,
            "global_batch_size": 64,
            "micro_batch_size": 8,
            "progress": False,
            "strategy": strategy,
            "hsdp": {"shard_size": shard_size},
            "optimizer": {"name": "adamw", "lr": 0.003},
            "checkpoint": every_step,
        },
        machine={"cpu_ranks_per_node": world},
    )


def _trained(env, work: str, strategy: str, shard_size: int | None, background=False) -> dict:
    run, data = _run(strategy, env.world_size, shard_size, background), make_data(128, 32)
    torch.manual_seed(0)
    spec = RunSpec.from_run(run)
    loop = Loop(spec, data, env, CPU, build_model(run["model"], data.shape, 4))
    params = list(loop.model.parameters())
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    mesh = getattr(params[0], "device_mesh", None)
    ckpt = Checkpointer(spec, work, env)
    ckpt.restore(loop)
    losses: list[list[float]] = []

    def on_step(loop: Loop) -> None:  # collective: every rank steps alike
        if loop.epoch_step == 1 or not losses:  # an epoch starts, or a resumed one goes on
            losses.append([])
        losses[-1].append(loop.global_step_losses()[loop.epoch_step - 1].item())
        ckpt.on_step(loop)

    loop.watch_steps(on_step)
    fit(loop, lambda record: ckpt.on_epoch(loop))
    ckpt.close()  # the last background write committed, as the training job's end does
    return {
        "background_saves": len(ckpt.saves.waited_s),  # writes waited for: 0 if synchronous
        "weights": loop.full_model_state(),
        "losses": losses,
        "local": local,
        "total": sum(p.numel() for p in params),
        "mesh": None if mesh is None else (tuple(mesh.shape), mesh.mesh_dim_names),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("hsdp")
    # its checkpoints written in the background (train.checkpoint.async: DCP's async_save
    # over the checkpoints' own gloo group), then resumed on two other meshes
    mesh_2x2 = run_group(4, _trained, (str(base / "hsdp"), "hsdp", 2, True), base / "rv1")
    fsdp = run_group(2, _trained, (str(base / "fsdp"), "fsdp", None), base / "rv2")
    one = _trained(_single(), str(base / "one"), "ddp", None)
    _keep_only(base / "hsdp", [SAVE_AT], base / "to-1x2")
    _keep_only(base / "hsdp", [SAVE_AT], base / "to-4x1")
    mesh_1x2 = run_group(2, _trained, (str(base / "to-1x2"), "hsdp", 2), base / "rv3")
    mesh_4x1 = run_group(4, _trained, (str(base / "to-4x1"), "hsdp", 1), base / "rv4")
    return {"base": base, "2x2": mesh_2x2, "fsdp": fsdp, "one": one,
            "1x2": mesh_1x2, "4x1": mesh_4x1}  # fmt: skip


def _single():
    from ddpflow.cluster.distenv import discover

    return discover({})


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = max(b.abs().max().item(), 1e-3)
    gap = (a - b).abs().max().item()
    assert gap <= TOLERANCE * scale, f"{what}: differs by {gap:.3g} (scale {scale:.3g})"


def test_the_mesh_is_replicate_by_shard_and_a_rank_holds_its_groups_share(runs):
    ranks = runs["2x2"]
    assert all(rank["mesh"] == ((2, 2), ("replicate", "shard")) for rank in ranks)
    model = build_model(_run("hsdp", 4, 2)["model"], [1, 8, 8], 4)
    bound = sum(math.ceil(p.shape[0] / 2) * p[0].numel() for p in model.parameters())
    total = ranks[0]["total"]
    # each shard group holds every element once; the two groups hold the same shards
    assert ranks[0]["local"] + ranks[1]["local"] == total
    assert [r["local"] for r in ranks[:2]] == [r["local"] for r in ranks[2:]]
    assert all(rank["local"] <= bound < 0.6 * total for rank in ranks), (bound, total)


def test_hsdp_losses_match_fsdp_and_one_rank(runs):
    hsdp = torch.tensor(runs["2x2"][0]["losses"])
    assert hsdp.shape == (3, 2)  # 3 epochs of 2 steps
    _close(hsdp, torch.tensor(runs["fsdp"][0]["losses"]), "hsdp 2x2 vs fsdp at 2 ranks")
    _close(hsdp, torch.tensor(runs["one"]["losses"]), "hsdp 2x2 vs 1 rank")


def test_a_checkpoint_resumes_on_another_mesh(runs):
    """The 2x2 mesh's checkpoints were written in the background (every step's save waited
    for the one before): resumed on 1x2 and 4x1, the same training."""
    assert runs["2x2"][0]["background_saves"] >= 6 and runs["1x2"][0]["background_saves"] == 0
    expected = runs["2x2"][0]["weights"]
    for mesh in ("1x2", "4x1"):
        got = runs[mesh][0]["weights"]
        assert got.keys() == expected.keys(), mesh
        for key, value in expected.items():
            _close(got[key].float(), value.float(), f"{key} after resume on {mesh}")
        # resumed after step 3 (mid-epoch 2): steps 4 to 6 trained on the new mesh
        losses = torch.tensor(sum(runs[mesh][0]["losses"], []))
        expected_losses = torch.tensor(runs["2x2"][0]["losses"]).flatten()[SAVE_AT:]
        _close(losses, expected_losses, f"losses on {mesh}")
    assert runs["4x1"][0]["mesh"] == ((4, 1), ("replicate", "shard"))


def test_the_mesh_is_the_shard_size_by_the_rest():
    assert sharding.mesh_shape("hsdp", 16, 8) == (2, 8)
    assert sharding.mesh_shape("hsdp", 4, 8) == (1, 4)  # a group larger than the world
    assert sharding.mesh_shape("fsdp", 16, 8) == (16,)
    assert hsdp_mesh(12, 8) is None
    with pytest.raises(ValueError, match="train.hsdp.shard_size 8 does not divide"):
        sharding.mesh_shape("hsdp", 12, 8)


def test_hsdp_is_fsdp_in_the_fingerprint():
    """hsdp is fsdp on another mesh: switching between them, or changing the shard size,
    retrains nothing."""
    fsdp = fingerprint.training_fingerprint(_run("fsdp", 2, None))
    assert fingerprint.training_fingerprint(_run("hsdp", 2, None)) == fsdp
    assert fingerprint.training_fingerprint(_run("hsdp", 4, 2)) == fsdp
    assert "train.hsdp.shard_size" not in fsdp


def test_a_shard_size_that_does_not_split_every_world_size_is_refused():
    """Checked before anything is submitted, at every node count machine.min_nodes allows:
    3 ranks per node, shard groups of 2 split 2 nodes (6 ranks) but not 3 (9)."""
    from ddpflow import config as ddpconfig

    machine = {"nodes": 3, "min_nodes": 2, "cpu_ranks_per_node": 3}
    train = {
        "strategy": "hsdp",
        "hsdp": {"shard_size": 2},
        "global_batch_size": 36,
        "micro_batch_size": 2,
    }  # 18 micro-batches: 6 and 9 ranks split them
    named = r"train.hsdp.shard_size 2 does not divide the world size 9 \(3 nodes x 3 ranks\)"
    with pytest.raises(ddpconfig.ConfigError, match=named):
        ddpconfig.load(None, {"launcher": "slurm", "train": train, "machine": machine})
    ok = {**train, "hsdp": {"shard_size": None}}  # a node's 3 ranks
    ddpconfig.load(None, {"launcher": "slurm", "train": ok, "machine": machine})


def test_a_shard_size_under_another_strategy_is_named_as_ignored():
    from ddpflow import config as ddpconfig

    run = make_run(train={"strategy": "fsdp", "hsdp": {"shard_size": 2}})
    (warning,) = ddpconfig.run_warnings(run, "slurm")
    assert "train.hsdp.shard_size set, but train.strategy is fsdp" in warning


def test_a_shard_size_larger_than_the_world_is_refused_not_clamped():
    """shard_size 3 at 2 ranks: refused before anything runs (the docs' promise), naming the
    world size and what fits; null (a node's ranks) is fine."""
    from ddpflow import config as ddpconfig

    train = {"strategy": "hsdp", "hsdp": {"shard_size": 3}}
    named = r"train.hsdp.shard_size 3 is more than the world size 2 \(1 nodes x 2 ranks\)"
    with pytest.raises(ddpconfig.ConfigError, match=named):
        ddpconfig.load(None, {"train": train})
    ddpconfig.load(None, {"train": {**train, "hsdp": {"shard_size": None}}})
