"""train.compile: the DDP module under torch.compile (TorchInductor on CPU), 2 real gloo ranks.

Compiled kernels round differently from eager ones, so the weights are compared to an eager
run within a tolerance; a compiled run resumed from a mid-epoch checkpoint must equal the
uninterrupted compiled run bitwise (2 ranks: the gradient sums are order-free; the 3-rank
bucket-order priming of Loop.prime_ddp is exercised in tests/test_resume_exact.py, eager).
Compiling takes tens of seconds per rank on this machine's CPUs.
"""

from __future__ import annotations

import io
import shutil

import pytest
import torch
from ddpflow.config.typed import RunSpec
from ddpflow.training.loop import Loop, fit
from ddpflow.training.models import build_model
from distributed_helpers import make_data, run_group
from workflow_helpers import make_run

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("c++") is None, reason="TorchInductor on CPU needs a C++ compiler"
    ),
]

CPU = torch.device("cpu")
AT_STEP = 5  # mid-epoch: 4 steps per epoch of 2 micro-batches of 8 per rank


def _loop(env, compiled: bool) -> Loop:
    run = make_run(
        model={"name": "mlp", "mlp_hidden": [32]},
        train={"epochs": 2, "global_batch_size": 32, "micro_batch_size": 8, "progress": False,
               "compile": compiled},
        machine={"cpu_ranks_per_node": 2},
    )  # fmt: skip
    data = make_data(128, 32)
    torch.manual_seed(0)
    return Loop(
        RunSpec.from_run(run),
        data,
        env,
        CPU,
        build_model(run["model"], data.shape, data.num_classes),
    )


def _weights(loop: Loop) -> dict:
    return {k: v.clone() for k, v in loop.model.state_dict().items()}


def _uninterrupted(env) -> dict:
    from torch._dynamo.utils import counters

    eager = _loop(env, compiled=False)
    fit(eager, lambda record: None)
    compiled, saved = _loop(env, compiled=True), {}

    def on_step(loop):
        if loop.scheduler.last_epoch == AT_STEP:
            buffer = io.BytesIO()
            torch.save({**loop.state_dict(), "rng": torch.get_rng_state()}, buffer)
            saved["checkpoint"] = buffer.getvalue()

    compiled.watch_steps(on_step)
    fit(compiled, lambda record: None)
    return {
        "eager": _weights(eager),
        "compiled": _weights(compiled),
        "graphs": counters["frames"]["ok"],
        "val": [r["val_accuracy"] for r in compiled.history],
        "checkpoint": saved["checkpoint"],
    }


def _resumed(env, checkpoints: list) -> dict:
    loop = _loop(env, compiled=True)
    state = torch.load(io.BytesIO(checkpoints[env.rank]), map_location=CPU, weights_only=True)
    loop.load_state_dict(state)
    torch.set_rng_state(state["rng"])
    assert loop.epoch_step > 0, "the checkpoint should be mid-epoch"
    fit(loop, lambda record: None)
    return {"compiled": _weights(loop)}


def test_compiled_training_matches_eager_and_resumes_exactly(tmp_path):
    clean = run_group(2, _uninterrupted, (), tmp_path / "clean")
    assert all(rank["graphs"] > 0 for rank in clean), "nothing was compiled"
    for key, eager in clean[0]["eager"].items():
        assert torch.allclose(clean[0]["compiled"][key], eager, rtol=1e-4, atol=1e-5), key
    # DDP keeps the ranks' compiled weights identical, as eager
    for key, value in clean[0]["compiled"].items():
        assert torch.equal(value, clean[1]["compiled"][key]), key
    checkpoints = [rank["checkpoint"] for rank in clean]
    resumed = run_group(2, _resumed, (checkpoints,), tmp_path / "resumed")
    for rank in range(2):
        for key, value in clean[rank]["compiled"].items():
            assert torch.equal(value, resumed[rank]["compiled"][key]), f"rank {rank}: {key}"
