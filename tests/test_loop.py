"""ddpflow.training.loop: the DistributedSampler contract, learning-rate rules, optimizers, and the
DDP loop itself (a real 2-rank gloo group for gradient accumulation with no_sync)."""

from __future__ import annotations

import pytest
import torch
from ddpflow.cluster.distenv import DistEnv
from ddpflow.config.typed import OptimizerSpec, RunSpec, TrainSpec
from ddpflow.training.build import make_optimizer
from ddpflow.training.divergence import Diverged
from ddpflow.training.loop import Loop, fit
from ddpflow.training.models import mlp
from ddpflow.training.schedule import (
    effective_lr,
    lr_schedule,
    micro_batch_seed,
    rank_micro_batches,
    step_micro_batches,
)
from distributed_helpers import make_data, run_group
from workflow_helpers import make_run

CPU = torch.device("cpu")
SINGLE = DistEnv(
    rank=0,
    world_size=1,
    local_rank=0,
    local_world_size=1,
    node_rank=0,
    num_nodes=1,
    master_addr="127.0.0.1",
    master_port=29500,
    job_id="0",
    launcher="single",
)


# --- the data order: the science's, the same at every world size ----------------------------


@pytest.mark.parametrize(("n", "global_batch", "micro"), [(64, 16, 4), (100, 32, 8), (37, 8, 8)])
def test_step_micro_batches_cut_one_shuffle_into_whole_steps(n, global_batch, micro):
    for seed, epoch in [(0, 0), (7, 3)]:
        batches = step_micro_batches(n, global_batch, micro, seed, epoch)
        steps = n // global_batch
        assert batches.shape == (steps, global_batch // micro, micro)
        seen = batches.flatten().tolist()
        assert len(set(seen)) == len(seen) == steps * global_batch  # no repeats, no padding
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        assert seen == order[: steps * global_batch].tolist()  # one shuffle, cut in order


def test_step_micro_batches_reshuffle_per_epoch_and_repeat_per_seed():
    first = step_micro_batches(1001, 32, 8, seed=0, epoch=0)
    assert torch.equal(first, step_micro_batches(1001, 32, 8, seed=0, epoch=0))
    assert not torch.equal(first, step_micro_batches(1001, 32, 8, seed=0, epoch=1))
    assert not torch.equal(first, step_micro_batches(1001, 32, 8, seed=1, epoch=0))
    # the samples left over by the cut differ per epoch: no sample always sits out
    left_over = [set(range(1001)) - set(step_micro_batches(1001, 32, 8, 0, e).flatten().tolist())
                 for e in range(4)]  # fmt: skip
    assert all(len(s) == 1001 % 32 for s in left_over) and len(set.union(*left_over)) > 1001 % 32


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_ranks_split_each_step_into_the_same_micro_batches_at_any_world_size(world):
    batches = step_micro_batches(200, 64, 8, seed=3, epoch=1)  # 3 steps of 8 micro-batches
    accum = 8 // world
    computed = {}  # (step, micro) -> indices, from every rank's own list
    for rank in range(world):
        mine = rank_micro_batches(batches, world, rank)
        assert mine.shape == (3 * accum, 8)
        for index, indices in enumerate(mine):
            step, within = divmod(index, accum)
            computed[(step, rank * accum + within)] = indices.tolist()
    assert computed == {(s, j): batches[s, j].tolist() for s in range(3) for j in range(8)}


def test_micro_batch_seeds_depend_on_the_micro_batch_alone():
    seeds = {micro_batch_seed(0, e, s, j) for e in range(2) for s in range(3) for j in range(4)}
    assert len(seeds) == 24
    assert micro_batch_seed(0, 1, 2, 3) == micro_batch_seed(0, 1, 2, 3)
    assert micro_batch_seed(0, 1, 2, 3) != micro_batch_seed(1, 1, 2, 3)


# --- learning rate and optimizers -------------------------------------------------------------


def test_effective_lr_scales_with_the_global_batch_not_the_world_size():
    train = make_run(
        train={"global_batch_size": 256, "micro_batch_size": 32, "base_batch_size": 64}
    )["train"]
    lr = train["optimizer"]["lr"]
    expected = {"none": lr, "linear": lr * 4.0, "sqrt": lr * 2.0}  # global 256 = 4 x 64
    for scaling, value in expected.items():
        assert effective_lr(TrainSpec.from_dict({**train, "lr_scaling": scaling})) == pytest.approx(
            value
        )
    at_base = {**train, "global_batch_size": 64, "lr_scaling": "linear"}
    assert effective_lr(TrainSpec.from_dict(at_base)) == pytest.approx(lr)


def test_lr_schedule_warmup_then_cosine_to_zero():
    f = lr_schedule("cosine", warmup_steps=4, total_steps=20)
    assert [f(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f(4) == pytest.approx(1.0)  # cosine starts at the full rate
    assert f(12) == pytest.approx(0.5)  # half-way through the cosine part
    assert f(20) == pytest.approx(0.0, abs=1e-12)
    assert f(30) == pytest.approx(0.0, abs=1e-12)  # clamped past the end
    after = [f(s) for s in range(4, 21)]
    assert after == sorted(after, reverse=True)


def test_lr_schedule_constant_and_no_warmup():
    constant = lr_schedule("constant", warmup_steps=2, total_steps=10)
    assert [constant(s) for s in range(5)] == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0])
    assert lr_schedule("cosine", warmup_steps=0, total_steps=10)(0) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("opt", "cls"),
    [
        ({"name": "sgd"}, torch.optim.SGD),
        ({"name": "sgd", "momentum": 0.0}, torch.optim.SGD),
        ({"name": "adam", "betas": [0.8, 0.99]}, torch.optim.Adam),
        ({"name": "adamw", "weight_decay": 0.05}, torch.optim.AdamW),
    ],
)
def test_make_optimizer(opt, cls):
    cfg = make_run(train={"optimizer": opt})["train"]["optimizer"]
    params = list(mlp(4, [3], 2).parameters())
    optimizer = make_optimizer(params, OptimizerSpec.from_dict(cfg), lr=0.123, device=CPU)
    assert type(optimizer) is cls
    group = optimizer.param_groups[0]
    assert group["lr"] == 0.123 and group["weight_decay"] == cfg["weight_decay"]
    assert group["fused"] is True  # one fused kernel for all parameters, on CPU too
    if cls is torch.optim.SGD:
        assert group["momentum"] == cfg["momentum"]
        assert group["nesterov"] == (cfg["momentum"] > 0)  # torch rejects nesterov without it
    else:
        assert group["betas"] == tuple(cfg["betas"])


# --- the loop on one rank ---------------------------------------------------------------------


def test_single_rank_loop_learns():
    torch.manual_seed(0)
    run = make_run(
        model={"name": "mlp", "mlp_hidden": [32]},
        train={
            "epochs": 4,
            "global_batch_size": 16,
            "micro_batch_size": 16,
            "progress": False,
            "lr_scaling": "none",
        },  # fmt: skip
        eval={"batch_size": 50},
        machine={"cpu_ranks_per_node": 1},
    )
    data = make_data(n_train=200, n_val=100)
    loop = Loop(RunSpec.from_run(run), data, SINGLE, CPU, mlp(64, [32], 4))
    assert loop.wrapped is loop.model  # one rank: no DDP wrapper
    records = []
    fit(loop, records.append)
    losses = [r["train_loss"] for r in records]
    assert len(records) == 4 and [r["epoch"] for r in records] == [1, 2, 3, 4]
    assert losses[-1] < 0.5 * losses[0], losses
    assert records[-1]["val_accuracy"] > 0.9
    assert records[-1]["step"] == loop.steps_per_epoch * 4 == (200 // 16) * 4
    assert all(r["samples"] == 192 and r["micro_steps"] == 12 for r in records)
    assert records[-1]["lr"] == pytest.approx(0.0, abs=1e-3 * loop.lr)  # cosine ran out


# --- divergence: a NaN/inf loss stops every rank at one step ----------------------------------


def _huge_lr_run(on_nonfinite: str, world: int = 1) -> dict:
    return make_run(
        model={"name": "mlp", "mlp_hidden": [32]},
        train={
            "epochs": 3,
            "global_batch_size": 16 * world,
            "micro_batch_size": 16,
            "progress": False,
            "warmup_epochs": 0,
            "optimizer": {"lr": 1e12},
            "on_nonfinite": on_nonfinite,
        },
        machine={"cpu_ranks_per_node": world},
    )


def test_a_huge_lr_stops_training_with_run_epoch_and_step():
    torch.manual_seed(0)
    loop = Loop(
        RunSpec.from_run(_huge_lr_run("fail")), make_data(200, 50), SINGLE, CPU, mlp(64, [32], 4)
    )
    with pytest.raises(Diverged) as info:
        fit(loop, lambda record: None)
    message = str(info.value)
    step = loop.scheduler.last_epoch
    assert step < loop.steps_per_epoch, "it should stop in the first epoch, not train on"
    assert (
        f"run 'default': the training loss became NaN or infinite at epoch 1, optimizer step {step}"
        in message
    )
    assert "Lower train.optimizer.lr" in message and "on_nonfinite: warn" in message
    assert loop.history == []  # no epoch record of a diverged epoch


def test_on_nonfinite_warn_trains_on_and_says_so_once(caplog):
    torch.manual_seed(0)
    loop = Loop(
        RunSpec.from_run(_huge_lr_run("warn")), make_data(200, 50), SINGLE, CPU, mlp(64, [32], 4)
    )
    with caplog.at_level("WARNING", logger="ddpflow.training.loop"):
        fit(loop, lambda record: None)
    assert len(loop.history) == 3
    warnings = [r.message for r in caplog.records if "NaN or infinite" in r.message]
    assert len(warnings) == 1 and "training on (train.on_nonfinite: warn)" in warnings[0]


def _poisoned_rank(env):
    """Rank 1 alone sees a non-finite loss (inputs divided by a zero std) from its first
    step; rank 0's loss stays finite, yet both must stop at the same step."""
    data = make_data(64, 16)
    if env.rank == 1:
        data.norm = (data.norm[0], torch.zeros_like(data.norm[1]))
    torch.manual_seed(0)
    run = _huge_lr_run("fail", world=2)
    run["train"]["optimizer"]["lr"] = 0.01
    loop = Loop(RunSpec.from_run(run), data, env, CPU, mlp(64, [32], 4))
    try:
        fit(loop, lambda record: None)
    except Diverged as exc:
        return {"step": loop.scheduler.last_epoch, "message": str(exc)}
    return {"step": None, "message": "trained on"}


@pytest.mark.slow
def test_a_rank_whose_loss_is_not_finite_stops_every_rank_at_that_step(tmp_path):
    ranks = run_group(2, _poisoned_rank, (), tmp_path)
    assert [r["step"] for r in ranks] == [1, 1], ranks
    assert all("optimizer step 1" in r["message"] for r in ranks)


# --- two real DDP ranks: accumulation with no_sync == one large batch ---------------------------

# (case, n_train, global batch, micro-batch) at 2 ranks; each pair sees the same samples per
# optimizer step with the same global batch, hence the same lr
ACCUMULATION_CASES = [
    ("one_step_accum", 32, 32, 8),  # 2 micro-batches per rank and step
    ("one_step_large", 32, 32, 16),
    ("two_steps_accum", 64, 32, 8),
    ("two_steps_large", 64, 32, 16),
]


def _one_epoch(env, data, global_batch, micro) -> tuple[torch.Tensor, int]:
    run = make_run(
        model={"name": "mlp", "mlp_hidden": [16]},
        train={
            "epochs": 1,
            "global_batch_size": global_batch,
            "micro_batch_size": micro,
            "progress": False,
        },  # fmt: skip
        machine={"cpu_ranks_per_node": env.world_size},
    )
    torch.manual_seed(0)  # the same initial weights on every rank and in every case
    loop = Loop(RunSpec.from_run(run), data, env, CPU, mlp(64, [16], 4))
    entered = []
    no_sync = loop.wrapped.no_sync if env.world_size > 1 else None
    if no_sync is not None:
        loop.wrapped.no_sync = lambda: (entered.append(1), no_sync())[1]
    loop.train_epoch()
    flat = torch.cat([p.detach().flatten() for p in loop.model.parameters()])
    return flat, loop.scheduler.last_epoch, len(entered)


def _accumulation_on_rank(env, datasets):
    out = {}
    for name, n, global_batch, micro in ACCUMULATION_CASES:
        flat, steps, no_sync_calls = _one_epoch(env, datasets[n], global_batch, micro)
        out[name] = {"params": flat, "steps": steps, "no_sync": no_sync_calls}
    return out


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    datasets = {n: make_data(n, 8, seed=n) for n in (32, 64)}
    ranks = run_group(2, _accumulation_on_rank, (datasets,), tmp_path_factory.mktemp("rdzv"))
    return ranks, datasets


@pytest.mark.slow
@pytest.mark.parametrize("steps", ["one_step", "two_steps"])
def test_accumulation_with_no_sync_equals_the_large_batch(ddp_results, steps):
    ranks, _ = ddp_results
    accum, large = (ranks[0][f"{steps}_{kind}"] for kind in ("accum", "large"))
    expected_steps = 1 if steps == "one_step" else 2
    assert accum["steps"] == large["steps"] == expected_steps
    # the all-reduce was skipped once per step
    assert accum["no_sync"] == expected_steps and large["no_sync"] == 0
    torch.testing.assert_close(accum["params"], large["params"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # ddp_results starts a process group of 2 ranks
@pytest.mark.parametrize("case", [c[0] for c in ACCUMULATION_CASES])
def test_ddp_ranks_end_with_identical_parameters(ddp_results, case):
    ranks, _ = ddp_results
    # the ranks trained on different shards: equal weights mean the gradients were averaged
    assert torch.equal(ranks[0][case]["params"], ranks[1][case]["params"])
    torch.manual_seed(0)
    initial = torch.cat([p.detach().flatten() for p in mlp(64, [16], 4).parameters()])
    assert not torch.allclose(ranks[0][case]["params"], initial)


@pytest.mark.slow
def test_two_ranks_equal_one_rank_with_the_whole_batch(ddp_results):
    """One step of 2 ranks x 16 samples is one step of 1 rank x 32 samples (same scaled lr)."""
    ranks, datasets = ddp_results
    single, steps, _ = _one_epoch(SINGLE, datasets[32], global_batch=32, micro=32)
    assert steps == 1
    torch.testing.assert_close(ranks[0]["one_step_large"]["params"], single, rtol=1e-5, atol=1e-6)


# --- channels_last on CPU ranks ---------------------------------------------------------------


def _small_cnn(env, epochs: int, **train) -> tuple[dict, torch.nn.Module]:
    """A run of the built-in CNN (8 channels) on this group's ranks, and its model placed as
    TrainTask places it."""
    from ddpflow.training.models import place, small_cnn

    run = make_run(
        model={"name": "cnn", "cnn_channels": 8},
        train={
            "epochs": epochs,
            "global_batch_size": 16 * env.world_size,
            "micro_batch_size": 16,
            "progress": False,
            **train,
        },  # fmt: skip
        machine={"cpu_ranks_per_node": env.world_size},
    )
    torch.manual_seed(0)
    return run, place(small_cnn(1, 8, 4), CPU, run["train"]["channels_last"])


def _cnn_epoch(env, data, channels_last: bool):
    import warnings

    run, model = _small_cnn(env, 1, channels_last=channels_last)
    conv = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)][-1]
    grads_nhwc = []
    conv.weight.register_post_accumulate_grad_hook(
        lambda p: grads_nhwc.append(p.grad.is_contiguous(memory_format=torch.channels_last))
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop = Loop(RunSpec.from_run(run), data, env, CPU, model)
        loop.train_epoch()
    return {
        "weight_nhwc": conv.weight.is_contiguous(memory_format=torch.channels_last),
        "grads_nhwc": grads_nhwc,
        "params": torch.cat([p.detach().flatten() for p in loop.model.parameters()]),
        "warnings": [str(w.message) for w in caught],
    }


def _both_layouts(env, data):
    return {layout: _cnn_epoch(env, data, layout) for layout in (True, False)}


@pytest.mark.slow
def test_channels_last_on_cpu_ranks_trains_the_same_model_in_nhwc(tmp_path):
    """oneDNN's NHWC convolutions on CPU ranks (faster, bench/README.md): the weights and
    their gradients stay NHWC through DDP's buckets (no grad-stride warning: the buckets
    follow the parameters' layout), the ranks agree, and the model is the NCHW one up to
    fp32 rounding; the MLP keeps its plain layout."""
    from ddpflow.training.models import place

    data = make_data(96, 8)
    ranks = run_group(2, _both_layouts, (data,), tmp_path)
    nhwc, nchw = ranks[0][True], ranks[0][False]
    assert nhwc["weight_nhwc"] and not nchw["weight_nhwc"]
    assert len(nhwc["grads_nhwc"]) == 3 and all(nhwc["grads_nhwc"])  # 96 samples / 32
    assert not [w for w in nhwc["warnings"] if "stride" in w], nhwc["warnings"]
    assert torch.equal(ranks[0][True]["params"], ranks[1][True]["params"])
    torch.testing.assert_close(nhwc["params"], nchw["params"], rtol=1e-4, atol=1e-5)
    assert all(p.is_contiguous() for p in place(mlp(64, [16], 4), CPU, True).parameters())


# --- bf16 autocast on CPU ranks ---------------------------------------------------------------


def _bf16_epochs(env, data, precision: str):
    run, model = _small_cnn(env, 4, precision=precision)
    conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    dtypes = set()
    conv.register_forward_hook(lambda m, i, out: dtypes.add(out.dtype) if m.training else None)
    loop = Loop(RunSpec.from_run(run), data, env, CPU, model)
    records = []
    fit(loop, records.append)
    return {
        "activations": dtypes,
        "params": {p.dtype for p in loop.model.parameters()},
        "flat": torch.cat([p.detach().flatten() for p in loop.model.parameters()]),
        "scaler": loop.scaler.is_enabled(),
        "val_accuracy": records[-1]["val_accuracy"],
    }


def _precisions(env, data):
    return {p: _bf16_epochs(env, data, p) for p in ("bf16", "fp16", "fp32")}


@pytest.mark.slow
def test_bf16_autocast_on_cpu_ranks_fp16_stays_fp32(tmp_path):
    """train.precision bf16 on CPU ranks: the convolutions compute in bf16 (autocast), the
    weights stay fp32, the ranks agree and the model learns as in fp32; fp16 is GPU only
    (CPU ranks train it in fp32, bitwise the fp32 run, no gradient scaler)."""
    data = make_data(320, 64)
    ranks = run_group(2, _precisions, (data,), tmp_path)
    bf16, fp16, fp32 = (ranks[0][p] for p in ("bf16", "fp16", "fp32"))
    assert bf16["activations"] == {torch.bfloat16} and bf16["params"] == {torch.float32}
    assert fp32["activations"] == fp16["activations"] == {torch.float32}
    assert not bf16["scaler"] and not fp16["scaler"]
    assert torch.equal(ranks[0]["bf16"]["flat"], ranks[1]["bf16"]["flat"])
    assert torch.equal(fp16["flat"], fp32["flat"])
    assert bf16["val_accuracy"] >= fp32["val_accuracy"] - 0.1 and bf16["val_accuracy"] > 0.8


def test_rank_zeros_progress_counts_its_micro_batches(caplog, monkeypatch):
    """train.progress (on by default): rank 0's progress within an epoch counts the
    micro-batches it computes, steps x accumulation (1 rank: 6 steps x 4)."""
    import functools
    import logging

    from ddpflow.training import progress_bar as tasks

    monkeypatch.setattr(tasks, "LineProgress", functools.partial(tasks.LineProgress, interval=0))
    run = make_run(
        model={"name": "mlp", "mlp_hidden": [16]},
        train={"epochs": 1, "global_batch_size": 32, "micro_batch_size": 8, "progress": True},
        machine={"cpu_ranks_per_node": 1},
    )
    loop = Loop(RunSpec.from_run(run), make_data(200, 20), SINGLE, CPU, mlp(64, [16], 4))
    with caplog.at_level(logging.INFO, logger="ddpflow.training.progress_bar"):
        fit(loop, lambda record: None, tasks.progress_bar(loop.run, SINGLE))
    lines = [r.getMessage() for r in caplog.records if r.name == "ddpflow.training.progress_bar"]
    assert lines and lines[-1].startswith("epoch 1: step 23/24 "), lines
