"""train.freeze, train.unfreeze_at_epoch and train.optimizer.lr_mult on a real gloo group of
2 ranks, through the Loop the ranks train with: under ddp, zero and fsdp a frozen backbone
(weights and BatchNorm statistics) ends bitwise as it started and holds no optimizer state;
unfreezing rebuilds the optimizer over every parameter, and a checkpoint written at that
epoch boundary resumes to the uninterrupted run's weights bitwise; lr_mult's longest prefix
sets each group's lr."""

from __future__ import annotations

import io

import pytest
import torch
from ddpflow.config.typed import RunSpec
from ddpflow.training import weights
from ddpflow.training.loop import Loop, fit
from ddpflow.training.models import build_model, place
from distributed_helpers import make_data, run_group
from workflow_helpers import make_run

CPU = torch.device("cpu")
HEAD = "15"  # the CNN's last Linear
TRAIN = {"epochs": 3, "global_batch_size": 24, "micro_batch_size": 6, "progress": False}


def _loop(env, **train) -> Loop:
    run = make_run(
        model={"name": "cnn", "cnn_channels": 8},
        train={**TRAIN, **train},
        machine={"cpu_ranks_per_node": env.world_size},
    )
    data = make_data(96, 24)
    torch.manual_seed(run["train"]["seed"])
    model = place(build_model(run["model"], data.shape, data.num_classes), CPU, False)
    return Loop(RunSpec.from_run(run), data, env, CPU, model)


def _full_state(loop: Loop) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    state = loop.model.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in state.items()}


def _held(loop: Loop) -> int:
    """Parameter tensors the optimizer holds (ZeRO: every rank's groups list all of them)."""
    return sum(len(group["params"]) for group in loop.optimizer.param_groups)


def _frozen_cases(env) -> dict:
    out = {}
    for strategy in ("ddp", "zero", "fsdp"):
        loop = _loop(env, strategy=strategy, freeze="backbone")
        before = _full_state(loop)
        fit(loop, lambda record: None)
        after = _full_state(loop)
        changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
        out[strategy] = {"changed": changed, "held": _held(loop), "frozen": len(loop.frozen)}
    return out


def _unfreeze_and_resume(env) -> dict:
    """Uninterrupted (unfreeze at epoch 2), with rank 0's checkpoint at the end of epoch 1;
    then a fresh Loop resumed from it."""
    import torch.distributed as dist

    out = {}
    for strategy in ("ddp", "zero"):
        loop, saved = _loop(env, strategy=strategy, freeze="backbone", unfreeze_at_epoch=2), {}

        def on_epoch(record, loop=loop, saved=saved):
            if record["epoch"] == 1:
                loop.gather_state()
                if env.rank == 0:
                    buffer = io.BytesIO()
                    torch.save(loop.state_dict(), buffer)
                    saved["blob"] = buffer.getvalue()
                loop.release_gathered_state()
                blob = [saved.get("blob")]
                dist.broadcast_object_list(blob, src=0)
                saved["blob"] = blob[0]
                saved["held"] = _held(loop)

        fit(loop, on_epoch)
        resumed = _loop(env, strategy=strategy, freeze="backbone", unfreeze_at_epoch=2)
        resumed.load_state_dict(torch.load(io.BytesIO(saved["blob"]), weights_only=True))
        fit(resumed, lambda record: None)
        a, b = _full_state(loop), _full_state(resumed)
        out[strategy] = {
            "held_at_boundary": saved["held"],
            "held_resumed": _held(resumed),
            "same": all(torch.equal(a[k], b[k]) for k in a),
            "frozen_after": len(loop.frozen),
        }
    return out


def _lr_mult(env) -> dict:
    loop = _loop(env, optimizer={"lr_mult": {"": 0.0, HEAD: 1.0}}, epochs=1)
    before = _full_state(loop)
    fit(loop, lambda record: None)
    after = _full_state(loop)
    groups = sorted((g["lr_mult"], g["initial_lr"]) for g in loop.optimizer.param_groups)
    params = [name for name, _ in loop.model.named_parameters()]
    moved = sorted(k for k in params if not torch.equal(before[k], after[k]))
    return {"groups": groups, "lr": loop.lr, "moved": moved}


def _all(env) -> dict:
    return {
        "frozen": _frozen_cases(env),
        "unfreeze": _unfreeze_and_resume(env),
        "lr_mult": _lr_mult(env),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_group(2, _all, (), tmp_path_factory.mktemp("freeze"))


@pytest.mark.parametrize("strategy", ["ddp", "zero", "fsdp"])
def test_a_frozen_backbone_ends_bitwise_as_it_started(results, strategy):
    for rank in results:
        found = rank["frozen"][strategy]
        # only the head trained: BatchNorm running statistics and counters did not move
        assert found["changed"] == [f"{HEAD}.bias", f"{HEAD}.weight"], found
        assert found["held"] == 2 and found["frozen"] == 12, found  # 2 of 14 tensors train


@pytest.mark.parametrize("strategy", ["ddp", "zero"])
def test_unfreezing_rebuilds_the_optimizer_and_resumes_at_the_boundary_bitwise(results, strategy):
    for rank in results:
        found = rank["unfreeze"][strategy]
        assert found["held_at_boundary"] == 14 and found["held_resumed"] == 14, found
        assert found["frozen_after"] == 0 and found["same"], found


def test_lr_mult_longest_prefix_wins(results):
    found = results[0]["lr_mult"]
    assert found["groups"] == [(0.0, 0.0), (1.0, found["lr"])]
    assert found["moved"] == [f"{HEAD}.bias", f"{HEAD}.weight"]  # lr 0: the rest stays


def test_strict_loading_names_the_keys_and_reinitialises_only_the_head(tmp_path):
    ten = build_model({"name": "cnn", "cnn_channels": 8}, [1, 8, 8], 10)
    path = tmp_path / "ten.pt"
    torch.save({f"module.{k}": v for k, v in ten.state_dict().items()}, path)  # DDP's prefix
    four = build_model({"name": "cnn", "cnn_channels": 8}, [1, 8, 8], 4)
    loaded = weights.load_weights(four, {"spec": "ten.pt", "path": str(path)}, 4)
    assert loaded["head"] == f"head {HEAD} re-initialised: 10 -> 4 classes"
    assert torch.equal(four.state_dict()["0.weight"], ten.state_dict()["0.weight"])
    from safetensors.torch import save_file

    as_safetensors = tmp_path / "ten.safetensors"
    save_file(ten.state_dict(), str(as_safetensors))
    again = build_model({"name": "cnn", "cnn_channels": 8}, [1, 8, 8], 10)
    assert (
        weights.load_weights(again, {"spec": "s", "path": str(as_safetensors)}, 10)["head"] is None
    )
    assert all(torch.equal(again.state_dict()[k], v) for k, v in ten.state_dict().items())
    wide = build_model({"name": "cnn", "cnn_channels": 16}, [1, 8, 8], 10)
    with pytest.raises(weights.WeightsError, match="of another shape: 0.weight"):
        weights.load_weights(wide, {"spec": "ten.pt", "path": str(path)}, 10)
    with pytest.raises(weights.WeightsError, match="train.freeze: no parameter is named lay"):
        weights.frozen_names(four, ["lay"])
