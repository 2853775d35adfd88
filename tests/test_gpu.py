"""The CUDA path on a real GPU: NCCL, mixed precision, GradScaler, channels_last, device
selection, exact evaluation, checkpoint and exact resume, and the whole workflow.

`pytest -m gpu` runs these; without a CUDA device they skip with the reason (CI has none),
and DDPFLOW_REQUIRE_GPU=1 turns that skip into a failure. Every case runs in spawned rank
processes (a 1-rank NCCL group: one GPU per rank, and NCCL refuses two ranks on one GPU),
so each gets a fresh CUDA context, as a real rank (and a requeued one) does.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from ddpflow import runtime
from ddpflow.checks.links import _timed_all_reduce
from ddpflow.cluster.distenv import discover
from ddpflow.config.typed import RunSpec
from ddpflow.training import evaluate
from ddpflow.training.checkpoint import Checkpointer
from ddpflow.training.evaluate import Scoring
from ddpflow.training.loop import Loop, fit
from ddpflow.training.models import build_model, place
from ddpflow.training.rankdata import Split
from distributed_helpers import make_data, run_group
from workflow_helpers import make_run, snakemake, write_config

pytestmark = pytest.mark.gpu


def _run(precision="fp32", deterministic=True, channels_last=True, epochs=3, **train):
    return make_run(
        model={"name": "cnn", "cnn_channels": 16},
        train={
            "epochs": epochs,
            "global_batch_size": 32,
            "micro_batch_size": 16,
            "progress": False,
            "precision": precision,
            "deterministic": deterministic,
            "channels_last": channels_last,
            **train,
        },
        machine={"gpus_per_node": 1},
    )


def _loop(env, run, n_train=256, n_val=64) -> Loop:
    """A Loop on this rank's GPU, built as TrainTask.work builds it."""
    runtime.configure_cuda(run["train"]["deterministic"])
    device = runtime.select_device(1, env.local_rank)
    data = make_data(n_train, n_val, device=device)
    torch.manual_seed(run["train"]["seed"])
    model = place(build_model(run["model"], data.shape, data.num_classes), device, True)
    return Loop(RunSpec.from_run(run), data, env, device, model)


def _weights(loop: Loop) -> dict:
    return {k: v.detach().cpu().clone() for k, v in loop.model.state_dict().items()}


def _parameters(loop: Loop) -> dict:
    """Only what the optimizer steps (BatchNorm statistics move with every forward)."""
    return {k: v.detach().cpu().clone() for k, v in loop.model.named_parameters()}


# --- process group and device ------------------------------------------------------------


def _nccl_and_devices(env):
    device = runtime.select_device(1, env.local_rank)
    counts = torch.arange(16, dtype=torch.int64, device=device)
    dist.all_reduce(counts)  # int64 confusion counts travel this way in evaluation
    seconds = _timed_all_reduce(torch.ones(1 << 20, device=device), 5, torch.cuda.synchronize)
    return {
        "backend": dist.get_backend(),
        "device": str(device),
        "current": torch.cuda.current_device(),
        "counts": counts.cpu().tolist(),
        "all_reduce_s": seconds,
        # per-task GPU binding (each task sees one device) maps any local rank to device 0
        "bound": str(runtime.select_device(1, torch.cuda.device_count() + 3)),
        "cpu": str(runtime.select_device(0, 0)),
        "name": runtime.device_name(device),
    }


def test_nccl_group_and_device_selection(tmp_path):
    (result,) = run_group(1, _nccl_and_devices, (), tmp_path, backend="nccl")
    assert result["backend"] == "nccl"
    assert result["device"] == "cuda:0" and result["current"] == 0
    assert result["counts"] == list(range(16))
    assert 0 < result["all_reduce_s"] < 1.0
    assert result["bound"] == "cuda:0" and result["cpu"] == "cpu"
    assert result["name"] == torch.cuda.get_device_name(0)


# --- mixed precision ---------------------------------------------------------------------


def _precisions(env):
    out = {}
    for precision in ("fp32", "bf16", "fp16"):
        loop = _loop(env, _run(precision, deterministic=False))
        x = evaluate.normalize(loop.data.train.inputs[:8], *loop.data.norm)
        with loop.autocast() if loop.autocast else torch.autocast("cuda", enabled=False):
            logits_dtype = loop.model(x).dtype
        fit(loop, lambda record: None)
        out[precision] = {
            "logits_dtype": str(logits_dtype),
            "param_dtypes": sorted({str(p.dtype) for p in loop.model.parameters()}),
            "scaler_enabled": loop.scaler.is_enabled(),
            "losses": [r["train_loss"] for r in loop.history],
            "val_accuracy": loop.history[-1]["val_accuracy"],
            "phases": loop.history[-1]["seconds"],
        }
    return out


def test_training_in_fp32_bf16_and_fp16(tmp_path):
    (out,) = run_group(1, _precisions, (), tmp_path, backend="nccl")
    assert out["fp32"]["logits_dtype"] == "torch.float32"
    assert out["bf16"]["logits_dtype"] == "torch.bfloat16"
    assert out["fp16"]["logits_dtype"] == "torch.float16"
    for precision, result in out.items():
        # autocast computes in low precision; the master weights stay fp32
        assert result["param_dtypes"] == ["torch.float32"], precision
        assert result["scaler_enabled"] == (precision == "fp16")
        losses = result["losses"]
        assert all(map(torch.isfinite, torch.tensor(losses))), (precision, losses)
        assert losses[-1] < losses[0], (precision, losses)
        assert result["val_accuracy"] > 0.8, (precision, result)
        # per-phase GPU time from CUDA events: every phase measured, none negative
        phases = result["phases"]
        assert all(phases[p] > 0 for p in runtime.PHASES), phases
        # estimated from sampled steps: GPU time of the phases, within the epoch's wall time
        assert sum(phases[p] for p in runtime.PHASES) < 1.25 * phases["train"], phases


def _scaler_skips_inf(env):
    loop = _loop(env, _run("fp16", deterministic=False))
    first = next(loop.model.parameters())
    fired = []

    def poison(grad):  # one non-finite gradient, as an fp16 overflow produces
        if not fired:
            fired.append(True)
            return torch.full_like(grad, float("inf"))
        return grad

    handle = first.register_hook(poison)
    scale_before = loop.scaler.get_scale()
    before = _parameters(loop)
    batches = torch.arange(16, device=loop.device)
    images = loop.feed.epoch([batches, batches], 0)  # the epoch's two steps of 1 micro-batch
    loop._micro_step(batches, images, last_micro=True, step=0, micro=0)
    skipped = {
        "unchanged": all(torch.equal(before[k], v) for k, v in _parameters(loop).items()),
        "scale": (scale_before, loop.scaler.get_scale()),
    }
    loop._micro_step(batches, images, last_micro=True, step=1, micro=0)
    handle.remove()
    after = _parameters(loop)
    skipped["then_steps"] = any(not torch.equal(before[k], after[k]) for k in before)
    return skipped


def test_grad_scaler_skips_a_step_with_inf_gradients(tmp_path):
    (result,) = run_group(1, _scaler_skips_inf, (), tmp_path, backend="nccl")
    assert result["unchanged"], "the optimizer stepped on inf gradients"
    before, after = result["scale"]
    assert after == before / 2, "GradScaler should halve its scale after an overflow"
    assert result["then_steps"], "the next, finite step must update the weights"


# --- channels_last -----------------------------------------------------------------------


def _channels_last(env):
    out = {}
    for channels_last in (True, False):
        run = _run(channels_last=channels_last, deterministic=True)
        runtime.configure_cuda(True)
        device = runtime.select_device(1, env.local_rank)
        torch.manual_seed(0)
        model = place(build_model(run["model"], [1, 8, 8], 4), device, channels_last)
        # the last conv: with one input channel (the first) both layouts have equal strides
        conv = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)][-1]
        x = torch.randn(32, 1, 8, 8, device=device)
        out[channels_last] = {
            "weight_nhwc": conv.weight.is_contiguous(memory_format=torch.channels_last),
            "logits": model.eval()(x).detach().cpu(),
        }
    mlp_cfg = make_run(model={"name": "mlp"})["model"]
    mlp = place(build_model(mlp_cfg, [1, 8, 8], 4), device, True)
    out["mlp_untouched"] = all(p.is_contiguous() for p in mlp.parameters())
    return out


def test_channels_last_models_compute_the_same_logits(tmp_path):
    (out,) = run_group(1, _channels_last, (), tmp_path, backend="nccl")
    assert out[True]["weight_nhwc"] and not out[False]["weight_nhwc"]
    assert out["mlp_untouched"]
    # the same function, other kernels: equal up to fp32 rounding
    torch.testing.assert_close(out[True]["logits"], out[False]["logits"], atol=1e-4, rtol=1e-4)


# --- exact evaluation ----------------------------------------------------------------------


def _evaluation(env):
    loop = _loop(env, _run(epochs=2))
    fit(loop, lambda record: None)
    model, data = loop.model, loop.data
    x, y, n = data.val.inputs, data.val.labels, data.num_classes
    single = discover({})
    whole = evaluate.evaluate_split(model, data.val, data.scoring(64), single)
    # what 3 ranks evaluate, shard by shard (batches of 7: other shapes than the whole run)
    shards = [evaluate.shard_bounds(x.shape[0], 3, r) for r in range(3)]
    confusion = sum(
        evaluate.shard_counts(model, x[a:b], y[a:b], n, 7, data.norm)[0] for a, b in shards
    )
    dist.all_reduce(confusion)  # int64 over NCCL, as evaluate_split sums shards
    on_cpu = Scoring(data.task, data.task_manifest, tuple(t.cpu() for t in data.norm), 64)
    cpu = evaluate.evaluate_split(model.cpu().float(), Split(x.cpu(), y.cpu()), on_cpu, single)
    return {
        "whole": whole["confusion_matrix"],
        "sharded": confusion.cpu().tolist(),
        "cpu": cpu["confusion_matrix"],
        "accuracy": whole["accuracy"],
    }


def test_sharded_evaluation_on_cuda_equals_single_process(tmp_path):
    (out,) = run_group(1, _evaluation, (), tmp_path, backend="nccl")
    assert out["sharded"] == out["whole"], "sharded CUDA evaluation differs from one process"
    assert out["whole"] == out["cpu"], "CUDA and CPU evaluation of the same weights differ"
    assert sum(map(sum, out["whole"])) == 64 and out["accuracy"] > 0.8


# --- checkpoint and exact resume -----------------------------------------------------------

RESUME_CASES = {  # name -> (precision, deterministic); checkpoint at step 21 of 48, mid-epoch
    "fp32_deterministic": ("fp32", True),
    "bf16_deterministic": ("bf16", True),
    "fp16_deterministic": ("fp16", True),
    "bf16_autotuned": ("bf16", False),
}
AT_STEP = 21


def _resume_run(case):
    precision, deterministic = RESUME_CASES[case]
    return _run(precision, deterministic=deterministic, epochs=3)


def _uninterrupted(env, work: str):
    out = {}
    for case in RESUME_CASES:
        loop = _loop(env, _resume_run(case))
        ckpt = Checkpointer(RunSpec.from_run(_resume_run(case)), f"{work}/{case}", env)

        def on_step(lp, ckpt=ckpt):
            if lp.scheduler.last_epoch == AT_STEP:
                ckpt.save(lp, "test")

        loop.watch_steps(on_step)
        fit(loop, lambda record: None)
        out[case] = {"weights": _weights(loop), "losses": [r["train_loss"] for r in loop.history]}
    return out


def _resumed(env, work: str):
    out = {}
    for case in RESUME_CASES:
        loop = _loop(env, _resume_run(case))
        state = Checkpointer(RunSpec.from_run(_resume_run(case)), f"{work}/{case}", env).restore(
            loop
        )
        position = (state["step"], state["epoch"], state["epoch_step"])
        fit(loop, lambda record: None)
        out[case] = {
            "weights": _weights(loop),
            "losses": [r["train_loss"] for r in loop.history],
            "position": position,
            "weights_on": str(next(loop.model.parameters()).device),
        }
    return out


def test_checkpoint_resume_on_cuda(tmp_path):
    """Deterministic kernels: bitwise the uninterrupted run, in every precision. cuDNN
    autotuning (the default) may pick another algorithm in the new process: equal within
    the tolerance the README states."""
    (clean,) = run_group(1, _uninterrupted, (str(tmp_path),), tmp_path / "a", backend="nccl")
    (resumed,) = run_group(1, _resumed, (str(tmp_path),), tmp_path / "b", backend="nccl")
    report = {}
    for case, (_, deterministic) in RESUME_CASES.items():
        got, expected = resumed[case], clean[case]
        assert got["position"][0] == AT_STEP and got["position"][2] > 0, got["position"]
        assert got["weights_on"] == "cuda:0"
        diff = max(
            (got["weights"][k] - v).abs().max().item()
            for k, v in expected["weights"].items()
            if v.is_floating_point()
        )
        report[case] = diff
        if deterministic:
            for key, value in expected["weights"].items():
                assert torch.equal(value, got["weights"][key]), f"{case}: {key} differs"
            assert got["losses"] == expected["losses"], case
        else:
            torch.testing.assert_close(got["losses"], expected["losses"], rtol=2e-2, atol=0)
            assert diff < 5e-2, (case, diff)
    print("max |weight difference| resumed vs uninterrupted:", json.dumps(report))


# --- the whole workflow --------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_workflow_on_the_gpu(workdir, precision):
    config = {
        "train": {"epochs": 6, "progress": False, "precision": precision},
        "machine": {"gpus_per_node": 1},
        "runs": [{"name": "gpu"}],
    }
    configfile = write_config(workdir / "config.yaml", config)
    result = snakemake(workdir, configfile)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    metrics = json.loads((workdir / "results/runs/gpu/eval_metrics.json").read_text())
    train = metrics["train"]
    assert train["device"] == "cuda:0" and train["world_size"] == 1
    assert train["device_name"] == torch.cuda.get_device_name(0)
    assert train["precision"] == precision
    assert metrics["samples_evaluated"] == metrics["test_size"]
    assert metrics["accuracy"] > 0.9
    report = (workdir / "results/report/report.md").read_text()
    runs_row = next(line for line in report.splitlines() if line.startswith("| gpu |"))
    assert f"| {precision} |" in runs_row, runs_row  # the Runs table's precision column
    assert f"| {torch.cuda.get_device_name(0)} |" in report  # Machine and speed: the device
    # GPU metrics through NVML, every epoch, and in the report's per-rank table (issue 14)
    lines = (workdir / "results/runs/gpu/train_metrics.jsonl").read_text().splitlines()
    for record in map(json.loads, lines):
        (rank,) = record["ranks"]
        assert 0 <= rank["gpu_util_percent"] <= 100 and rank["gpu_mem_mib"] > 0, rank
        assert rank["gpu_power_w"] > 0 and 0 < rank["gpu_temp_c"] < 120, rank
    assert "| GPU util % | GPU mem MiB | Power W | Temp °C |" in report
    assert os.path.getsize(workdir / "results/report/report.html") > 0


# --- several NCCL ranks: ddp, zero, fsdp, exact evaluation, 4 -> 2 ------------------------

# NCCL >= 2.30 (torch 2.14's) runs several ranks on one GPU when this is set (experimental):
# enough to exercise the multi-rank NCCL paths (bucketed all-reduce, ZeRO's and FSDP's
# gathers, the evaluation's int64 sums, a resumed world size) on a one-GPU machine
MULTI_RANK = (
    os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"
    and torch.cuda.is_available()
    and torch.cuda.nccl.version() >= (2, 30)  # 2.28 refuses: "Duplicate GPU detected"
)
SHARED_GPU_ENV = {  # the local launcher checks the GPUs asked for; here ranks share GPU 0
    "DDPFLOW_ALLOW_CPU_FALLBACK": "1",
    "NCCL_MULTI_RANK_GPU_ENABLE": "1",
}
NCCL_RANKS = {
    "train": {"epochs": 2, "progress": False, "global_batch_size": 64, "micro_batch_size": 16,
              "checkpoint": {"every_steps": 4, "every_epochs": 1}},
    "machine": {"pg_timeout_s": 60, "gpus_per_node": 4},
}  # fmt: skip


def _needs_four_ranks() -> None:
    if torch.cuda.device_count() < 4 and not MULTI_RANK:
        pytest.skip(
            "needs 4 GPUs, or NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1 to share one "
            f"(torch {torch.__version__} has NCCL {torch.cuda.nccl.version()})"
        )


def _eval(workdir, run: str) -> dict:
    return json.loads((workdir / f"results/runs/{run}/eval_metrics.json").read_text())


@pytest.mark.e2e
def test_ddp_zero_and_fsdp_over_nccl_at_two_ranks(workdir):
    _needs_four_ranks()
    config = {
        **NCCL_RANKS,
        "machine": {**NCCL_RANKS["machine"], "gpus_per_node": 2},
        "runs": [{"name": s, "train": {"strategy": s}} for s in ("ddp", "zero", "fsdp")],
    }
    configfile = write_config(workdir / "config.yaml", config)
    result = snakemake(workdir, configfile, env=SHARED_GPU_ENV if MULTI_RANK else None)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    for strategy in ("ddp", "zero", "fsdp"):
        metrics = _eval(workdir, strategy)
        assert metrics["train"]["world_size"] == 2 and metrics["train"]["device"] == "cuda:0"
        # the evaluation's NCCL all-reduce: every test sample scored exactly once
        assert metrics["samples_evaluated"] == metrics["test_size"], (strategy, metrics)
        assert metrics["accuracy"] > 0.85, (strategy, metrics["accuracy"])
        lines = (workdir / f"results/runs/{strategy}/train_metrics.jsonl").read_text()
        ranks = json.loads(lines.splitlines()[-1])["ranks"]
        assert sorted(r["rank"] for r in ranks) == [0, 1]
        assert all(r["gpu_peak_alloc_mib"] > 0 for r in ranks), ranks


@pytest.mark.e2e
def test_a_four_rank_nccl_run_killed_continues_at_two(workdir):
    _needs_four_ranks()
    env = {**(SHARED_GPU_ENV if MULTI_RANK else {}), "DDPFLOW_FAULT": "kill:3:1:7",
           "DDPFLOW_FAULT_ONCE": str(workdir / "fired")}  # fmt: skip
    configfile = write_config(workdir / "config.yaml", {**NCCL_RANKS, "runs": [{"name": "cnn"}]})
    first = snakemake(workdir, configfile, env=env)
    assert first.returncode != 0 and (workdir / "fired").exists(), first.stderr[-3000:]
    two = {**NCCL_RANKS, "machine": {**NCCL_RANKS["machine"], "gpus_per_node": 2}}
    write_config(configfile, {**two, "runs": [{"name": "cnn"}]})
    second = snakemake(workdir, configfile, env=SHARED_GPU_ENV if MULTI_RANK else None)
    terminal = second.stdout + second.stderr
    assert second.returncode == 0, terminal[-4000:]
    assert "written on 4 ranks; continuing on 2" in terminal, terminal[-3000:]
    rank0 = "".join(
        p.read_text() for p in (workdir / "logs/submitit/cnn/train").glob("*_0_log.err")
    )
    assert "resumed at epoch 2 step 24 on 2 ranks; the checkpoint was written on 4" in rank0
    metrics = _eval(workdir, "cnn")
    assert metrics["samples_evaluated"] == metrics["test_size"] and metrics["accuracy"] > 0.85


# --- BatchNorm statistics at any world size, on CUDA tensors ---------------------------------


def _batchnorm_on_cuda(env):
    """Two epochs of the CNN (BatchNorm) at 2 micro-batches a step on this rank's GPU: the
    trained parameters, every buffer and the validation records."""
    loop = _loop(env, _run(epochs=2))
    fit(loop, lambda record: None)
    params = _parameters(loop)
    state = loop.full_model_state()
    return {
        "params": params,
        "buffers": {k: v.detach().cpu().clone() for k, v in state.items() if k not in params},
        "val": [{k: v for k, v in r.items() if k.startswith("val_")} for r in loop.history],
        "device": str(next(loop.model.parameters()).device),
    }


def test_batchnorm_statistics_on_cuda_are_the_same_at_one_and_two_ranks(tmp_path):
    """The exact BatchNorm statistics' gather on CUDA tensors: 1 rank computing both
    micro-batches of each step and 2 ranks computing one each hold the same parameters
    (bitwise), the same running statistics on every rank, and validate the same (within
    1e-5: cuDNN picks its kernels per batch shape, and a 2-rank evaluation shard holds
    half the rows). One GPU holds both ranks (gloo over CUDA tensors; NCCL refuses two
    ranks on one GPU): this proves the CUDA code path, not NCCL's all-gather or two
    devices' kernels."""
    (one,) = run_group(1, _batchnorm_on_cuda, (), tmp_path / "one")
    twos = run_group(2, _batchnorm_on_cuda, (), tmp_path / "two")
    assert one["device"] == "cuda:0" and {two["device"] for two in twos} == {"cuda:0"}
    for rank, two in enumerate(twos):
        for key, value in one["params"].items():
            assert torch.equal(two["params"][key], value), (rank, key)
        assert one["buffers"].keys() == two["buffers"].keys()
        for key, value in one["buffers"].items():
            torch.testing.assert_close(two["buffers"][key], value, msg=f"rank {rank} {key}")
    buffers = {k: (twos[0]["buffers"][k] - v).abs().max().item() for k, v in one["buffers"].items()}
    print("max |buffer difference| 2 vs 1 rank:", max(buffers.values()))
    for epoch, record in enumerate(one["val"]):
        assert record and record.keys() == twos[0]["val"][epoch].keys()
        print(f"epoch {epoch + 1}: 1 rank {record}, 2 ranks {twos[0]['val'][epoch]}")
        for key, value in record.items():
            assert twos[0]["val"][epoch][key] == pytest.approx(value, rel=1e-5), (epoch, key)
