"""A resumed run is bitwise identical to an uninterrupted one at 3 ranks (real gloo groups).

With 2 ranks every float all-reduce is order-free (a + b == b + a); from 3 ranks on it is
not, so anything that sums gradients in another order after a restart shows up here. The
cause this guards against: DDP rebuilds its gradient buckets once, after the first
synchronised backward (static_graph: the second), and gloo's ring all-reduce adds an
element's per-rank values in an order that depends on its offset in the bucket, so a fresh
DDP in a resumed run summed gradients differently from the run it continues
(Loop.prime_ddp). One process group trains every case uninterrupted and writes, mid-epoch,
the checkpoint Checkpointer would write (Loop.state_dict plus every rank's RNG state); a
second, fresh group loads it and finishes. Two groups in all: ranks are slow to start.
"""

from __future__ import annotations

import io

import pytest
import torch
from ddpflow.config.typed import RunSpec
from ddpflow.training.loop import Loop, fit
from ddpflow.training.models import build_model, place
from distributed_helpers import make_data, run_group
from workflow_helpers import make_run

# slow: real process groups or subprocesses for seconds each; make test-fast leaves it out
pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
WORLD = 3
# name -> (model, train overrides, step of the checkpoint); 5 steps per epoch (120 samples, a
# global batch of 24 in micro-batches of 8: one per rank), 2 epochs; every checkpoint is
# mid-epoch
CASES = {
    "cnn": ({"name": "cnn", "cnn_channels": 16}, {}, 7),  # BatchNorm buffers
    "cnn_static_graph": (
        {"name": "cnn", "cnn_channels": 16},
        {"ddp": {"static_graph": True}},
        7,
    ),
    # 2 micro-batches per rank and step (global 48): 2 steps per epoch, 24 samples sit out
    "cnn_grad_accum": ({"name": "cnn", "cnn_channels": 16}, {"global_batch_size": 48}, 3),
    "mlp_adamw": (
        {"name": "mlp", "mlp_hidden": [64, 64]},
        {"optimizer": {"name": "adamw", "lr": 0.002}},
        3,
    ),
    # ZeRO: the optimizer state is sharded; a checkpoint holds it whole, consolidated
    "cnn_zero": ({"name": "cnn", "cnn_channels": 16}, {"strategy": "zero"}, 7),
    "mlp_adamw_zero": (
        {"name": "mlp", "mlp_hidden": [64, 64]},
        {"optimizer": {"name": "adamw", "lr": 0.002}, "strategy": "zero"},
        3,
    ),
    # augmentation (random crop + flip) drawn from (seed, epoch, step, micro-batch) alone
    "cnn_augment": (
        {"name": "cnn", "cnn_channels": 16},
        {"augment": {"enabled": True, "crop_padding": 2}},
        7,
    ),
    # the layouts and precisions of CPU ranks (the cases above: fp32, channels_last)
    "cnn_nchw": ({"name": "cnn", "cnn_channels": 16}, {"channels_last": False}, 7),
    "cnn_bf16": ({"name": "cnn", "cnn_channels": 16}, {"precision": "bf16"}, 7),
    # checkpoints before DDP rebuilt its buckets (static graph: rebuilt one step later)
    "cnn_first_step": ({"name": "cnn", "cnn_channels": 16}, {}, 1),
    "cnn_static_graph_first_step": (
        {"name": "cnn", "cnn_channels": 16},
        {"ddp": {"static_graph": True}},
        1,
    ),
}


def _run(case: str) -> dict:
    model, train, _ = CASES[case]
    return make_run(
        model=model,
        train={
            "epochs": 2,
            "global_batch_size": 24,
            "micro_batch_size": 8,
            "progress": False,
            **train,
        },  # fmt: skip
        machine={"cpu_ranks_per_node": WORLD},
    )


def _loop(env, case: str) -> Loop:
    run, data = _run(case), make_data(120, 30)
    torch.manual_seed(run["train"]["seed"])  # as TrainTask.work
    model = build_model(run["model"], data.shape, data.num_classes)
    return Loop(
        RunSpec.from_run(run), data, env, CPU, place(model, CPU, run["train"]["channels_last"])
    )


def _result(loop: Loop) -> dict:
    strip = ("seconds", "samples_per_s")
    return {
        "state": {k: v.clone() for k, v in loop.model.state_dict().items()},
        "momentum": _optimizer_state(loop),
        "history": [{k: v for k, v in r.items() if k not in strip} for r in loop.history],
    }


def _optimizer_state(loop: Loop) -> list[torch.Tensor]:
    """This rank's optimizer state in parameter order (ZeRO: the shard its local optimizer
    holds; a loaded state may list its entries in another order than the one built by
    stepping)."""
    optimizer = loop.optimizer.optim if loop.sharded_optimizer else loop.optimizer
    return [
        tensor.clone()
        for group in optimizer.param_groups
        for param in group["params"]
        for _, tensor in sorted(optimizer.state.get(param, {}).items())
    ]


def _uninterrupted(env) -> dict:
    """Train every case to the end; at the case's step, serialize what Checkpointer.save
    writes (rank 0's Loop.state_dict and all ranks' RNG states)."""
    import torch.distributed as dist

    out = {}
    for case, (_, _, at_step) in CASES.items():
        loop = _loop(env, case)
        saved = {}

        def on_step(lp, at_step=at_step, saved=saved):
            if lp.scheduler.last_epoch == at_step:
                rng: list = [None] * env.world_size
                dist.all_gather_object(rng, {"cpu": torch.get_rng_state()})
                lp.gather_state()
                if env.rank == 0:
                    buffer = io.BytesIO()
                    torch.save({**lp.state_dict(), "rng": rng}, buffer)
                    saved["checkpoint"] = buffer.getvalue()

        loop.watch_steps(on_step)
        fit(loop, lambda record: None)
        out[case] = {**_result(loop), "checkpoint": saved["checkpoint"] if env.rank == 0 else None}
    return out


def _resumed(env, checkpoints: dict) -> dict:
    """Fresh processes, fresh DDP: load the checkpoint as Checkpointer.restore does, finish."""
    out = {}
    for case, blob in checkpoints.items():
        loop = _loop(env, case.removesuffix("_from_ddp"))
        state = torch.load(io.BytesIO(blob), map_location=CPU, weights_only=True)
        loop.load_state_dict(state)
        torch.set_rng_state(state["rng"][env.rank]["cpu"])
        # loading (and priming DDP) changed nothing but the position and the weights
        loaded = loop.model.state_dict()
        unchanged = all(torch.equal(loaded[k], v) for k, v in state["model"].items())
        unchanged &= all(p.grad is None for p in loop.model.parameters())
        position = (state["epoch"], state["epoch_step"])
        fit(loop, lambda record: None)
        out[case] = {**_result(loop), "load_unchanged": unchanged, "position": position}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    clean = run_group(WORLD, _uninterrupted, (), tmp_path_factory.mktemp("clean"))
    checkpoints = {case: clean[0][case]["checkpoint"] for case in CASES}
    # a ddp run's checkpoint resumed under zero (strategy retrains nothing: same weights)
    checkpoints["cnn_zero_from_ddp"] = checkpoints["cnn"]
    resumed = run_group(WORLD, _resumed, (checkpoints,), tmp_path_factory.mktemp("resumed"))
    return clean, resumed


@pytest.mark.parametrize("case", list(CASES))
def test_resume_at_three_ranks_is_bitwise_identical(runs, case):
    clean, resumed = runs
    for rank in range(WORLD):
        expected, got = clean[rank][case], resumed[rank][case]
        assert got["load_unchanged"], "loading the checkpoint changed the model or left grads"
        assert got["position"][1] > 0, "the checkpoint should be mid-epoch"
        assert expected["state"].keys() == got["state"].keys()
        for key, value in expected["state"].items():
            assert torch.equal(value, got["state"][key]), f"rank {rank}: {key} differs"
        assert len(expected["momentum"]) > 0
        pairs = zip(expected["momentum"], got["momentum"], strict=True)
        assert all(torch.equal(a, b) for a, b in pairs), f"rank {rank}: optimizer state differs"
    # the metrics rank 0 writes; other ranks' train_loss is their own shard's and a checkpoint
    # holds rank 0's (nothing reads theirs)
    assert resumed[0][case]["history"] == clean[0][case]["history"], "losses/accuracy differ"


@pytest.mark.parametrize("model", ["cnn", "mlp_adamw"])
def test_zero_trains_the_same_weights_as_ddp(runs, model):
    """ZeRO stage 1 changes where the optimizer state lives, not the arithmetic: each element
    is updated by the same fused kernel, on its owner rank instead of on every rank."""
    clean, _ = runs
    for rank in range(WORLD):
        ddp, zero = clean[rank][model]["state"], clean[rank][f"{model}_zero"]["state"]
        for key, value in ddp.items():
            assert torch.equal(value, zero[key]), f"rank {rank}: {key} differs"
    assert clean[0][model]["history"] == clean[0][f"{model}_zero"]["history"]


def test_a_ddp_checkpoint_resumes_under_zero(runs):
    clean, resumed = runs
    for rank in range(WORLD):
        expected, got = clean[rank]["cnn"]["state"], resumed[rank]["cnn_zero_from_ddp"]["state"]
        assert all(torch.equal(value, got[key]) for key, value in expected.items()), rank


def test_augmentation_changes_what_is_trained(runs):
    """The augmented case above trains other weights than the same case without it (so its
    exact resume is not that of an unaugmented run)."""
    clean, _ = runs
    plain, augmented = clean[0]["cnn"]["state"], clean[0]["cnn_augment"]["state"]
    assert any(not torch.equal(plain[key], augmented[key]) for key in plain)
