"""The benchmarks (bench/throughput.py, end_to_end.py, memory.py, data.py, layout.py,
finetune.py, lm.py, generate.py, lm_windows.py, scaling.py, micro_batch.py,
memory_estimate.py, store_scale.py, accumulation_drift.py, tensor_parallel.py,
norm_groups.py, flops.py, checkpoint.py) run in a tiny
configuration and
write complete JSON, through the harness every one of them shares (bench/harness.py).

Speed is measured by the benchmarks and never asserted here: only that the numbers exist.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest
from workflow_helpers import REPO

# slow: real process groups or subprocesses for seconds each; make test-fast leaves it out
pytestmark = pytest.mark.slow


def test_throughput_tiny_run_writes_complete_json(tmp_path):
    out = tmp_path / "throughput.json"
    cmd = [
        sys.executable,
        str(REPO / "bench" / "throughput.py"),
        "--cases",
        "mlp",
        "--world-sizes",
        "1",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--samples-scale",
        "0.01",
        "--out",
        str(out),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "speedup" in result.stdout

    report = json.loads(out.read_text())
    assert {"hostname", "cpu_model", "cpu_count"} <= set(report["machine"])
    assert {"torch", "python"} <= set(report["provenance"]["versions"])
    assert report["conditions"]["repeats"] == 1
    assert report["conditions"]["warmup_epochs"] == 0
    (row,) = report["runs"]
    assert (row["name"], row["world_size"], row["batch"], row["threads"]) == ("mlp", 1, 32, 1)
    assert row["samples"] % row["batch"] == 0
    for loop in ("raw", "ddpflow"):
        assert len(row[loop]["all"]) == 1
        assert math.isfinite(row[loop]["samples_per_s"])
    assert set(row["ddpflow"]["phase_seconds_per_step"]) >= {"data", "forward", "optimizer"}
    # the profiled epoch's split of wall time: the MLP's time is in matmuls and other ops
    shares = row["ddpflow"]["op_shares"]
    assert set(shares) == {"convolution", "batch_norm", "matmul", "other_ops", "outside_ops"}
    assert shares["convolution"] == 0 and shares["matmul"] > 0
    assert sum(shares.values()) == pytest.approx(1.0)
    assert math.isfinite(row["speedup"])
    assert row["train_flops_per_sample"] > 0


# --- the peers (issue 11): Lightning and the raw DDP script --------------------------------
# Lightning is no ddpflow dependency: these tests install it the way bench/run does
# (bench/install-peers: pinned, --no-deps, into bench/.peers-site, on PYTHONPATH for the
# Lightning processes only), so that CI, which has the package index, really runs the
# Lightning code. Only where that install fails (no index) do they skip, saying why.


@pytest.fixture(scope="module")
def lightning_site():
    proc = subprocess.run(
        [str(REPO / "bench" / "install-peers"), sys.executable],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode:
        pytest.skip(f"bench/install-peers could not install Lightning: {proc.stderr[-500:]}")
    return REPO / "bench" / ".peers-site"


def test_harness_writes_the_head_every_result_starts_with(tmp_path, capsys):
    """bench/harness.py: the keys docs/gen_performance.py reads from every result (machine,
    versions, start), the JSON written where asked with its wall time, a Markdown table."""
    sys.path.insert(0, str(REPO / "bench"))
    import harness

    report = harness.head("a test", conditions={"repeats": 1}, runs=[])
    assert list(report)[:4] == ["benchmark", "started", "machine", "provenance"]
    assert list(report)[4:] == ["conditions", "runs"]
    machine = report["machine"]
    assert {"hostname", "cpu_model", "cpu_count", "platform", "python", "torch"} <= set(machine)
    assert machine["cuda_devices"] == [] or all(isinstance(d, str) for d in machine["cuda_devices"])
    assert {"torch", "python"} <= set(report["provenance"]["versions"])
    login = harness.machine(devices=False)  # login-node benchmarks: torch's version, no import
    assert login["torch"].split("+")[0] == machine["torch"].split("+")[0]
    assert login["cuda_devices"] == []

    out = tmp_path / "deep" / "r.json"
    assert harness.write(report, out, wall_since=0.0) == 0
    assert json.loads(out.read_text()) == report and report["wall_s"] > 0
    assert f"wrote {out} (" in capsys.readouterr().out
    table = harness.markdown_table(["n", "s"], [[1, "2.0"], [3, "4.0"]], rule="--:")
    assert table == "| n | s |\n|--:|--:|\n| 1 | 2.0 |\n| 3 | 4.0 |"


def test_lightning_is_not_a_runtime_dependency():
    """The project's environment does not import lightning; only bench/.peers-site has it."""
    code = "import importlib.util as u; print(u.find_spec('lightning') is None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert out.strip() == "True"


def test_schedule_alternates_loops_after_warmup():
    sys.path.insert(0, str(REPO / "bench"))
    from loops import schedule

    assert schedule(["ddpflow", "lightning"], 1, 3) == [
        ("ddpflow", None),
        ("lightning", None),
        ("ddpflow", 0),
        ("lightning", 0),
        ("lightning", 1),
        ("ddpflow", 1),
        ("ddpflow", 2),
        ("lightning", 2),
    ]


def test_throughput_lightning_tiny_run_writes_complete_json(tmp_path, lightning_site):
    out = tmp_path / "throughput_lightning.json"
    cmd = [sys.executable, str(REPO / "bench" / "throughput.py"), "--lightning"]
    cmd += ["--cases", "cnn", "--world-sizes", "2", "--repeats", "2", "--warmup", "1"]
    # both loops in bf16 (Lightning's 'bf16-mixed'), the peer's model in ddpflow's layout
    cmd += ["--precision", "bf16", "--peer-channels-last"]
    cmd += ["--samples-scale", "0.05", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ddpflow / lightning" in result.stdout

    report = json.loads(out.read_text())
    assert report["provenance"]["versions"]["lightning"] == "2.6.6"  # the pin
    assert {"hostname", "cpu_model", "cpu_count"} <= set(report["machine"])
    assert "1.2x" in report["conditions"]["target"]
    (row,) = report["runs"]
    assert (row["name"], row["world_size"], row["baseline"]) == ("cnn", 2, "lightning")
    assert (row["precision"], row["peer_channels_last"]) == ("bf16", True)
    assert report["conditions"]["peers"].startswith("bf16; convolutional models in channels_last")
    assert "raw" not in row
    for loop in ("lightning", "ddpflow"):
        assert len(row[loop]["all"]) == 2  # the warmup epoch is not among them
        assert math.isfinite(row[loop]["samples_per_s"]) and row[loop]["samples_per_s"] > 0
    assert math.isfinite(row["speedup"]) and math.isfinite(row["cpu_time_speedup"])


@pytest.mark.e2e
def test_end_to_end_tiny_run_writes_complete_json(tmp_path, lightning_site):
    out = tmp_path / "peers.json"
    cmd = [sys.executable, str(REPO / "bench" / "end_to_end.py")]
    cmd += ["--repeats", "1", "--epochs", "1", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "ddpflow / lightning wall time" in result.stdout

    report = json.loads(out.read_text())
    assert report["provenance"]["versions"]["lightning"] == "2.6.6"
    assert {"hostname", "cpu_model", "cpu_count"} <= set(report["machine"])
    assert report["job"]["train"]["epochs"] == 1 and report["conditions"]["repeats"] == 1
    assert [r["peer"] for r in report["runs"]] == ["ddpflow", "lightning", "raw"]
    for peer, row in report["summary"].items():
        assert "error" not in row, (peer, row)
        assert row["wall_s"] > 0 and 0.0 < row["test_accuracy"] <= 1.0
        # the same job: split, epochs, ranks
        assert (row["train_samples"], row["test_samples"]) == (1294, 359)
        assert (row["epochs"], row["world_size"]) == (1, 2)
    # Lightning's test sampler pads 359 to 360; ddpflow and raw count each image once
    assert report["summary"]["lightning"]["test_samples_counted"] == 360
    assert report["summary"]["raw"]["test_samples_counted"] == 359
    assert report["summary"]["ddpflow"]["test_samples_counted"] == 359
    assert math.isfinite(report["ddpflow_vs_lightning_wall"])


def test_memory_tiny_run_measures_each_strategys_share(tmp_path):
    """Memory is not speed: the per-rank state each strategy holds is a count of bytes, and
    it must be what the strategy promises (ddp all, zero 1/N of the optimizer state, fsdp
    1/N of everything), measured on real ranks."""
    out = tmp_path / "memory.json"
    cmd = [sys.executable, str(REPO / "bench" / "memory.py"), "--models", "resnet50",
           "--optimizers", "sgd", "--world-sizes", "2", "--steps", "1",
           "--throughput-model", "mlp", "--throughput-batch", "8", "--throughput-steps", "2",
           "--out", str(out)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    runs = {r["strategy"]: r for r in report["runs"]}
    assert sorted(runs) == ["ddp", "fsdp", "zero"]
    for run in runs.values():
        assert abs(run["measured_over_theory"] - 1) < 0.01, run["strategy"]
    state = {k: r["max_over_ranks"]["optimizer_bytes"] for k, r in runs.items()}
    half = runs["ddp"]["param_bytes"] / 2  # SGD: one momentum tensor per parameter
    assert state["ddp"] == 2 * half
    # the largest rank holds a few bytes more than half: zero assigns whole tensors, fsdp
    # pads each parameter's rows to a multiple of the world size
    for held in (state["zero"], state["fsdp"], runs["fsdp"]["max_over_ranks"]["params_bytes"]):
        assert half <= held < half * 1.001
    assert [r["strategy"] for r in report["throughput"]["rows"]] == ["ddp", "zero", "fsdp"]
    assert all(r["samples_per_s"] > 0 for r in report["throughput"]["rows"])


def test_data_tiny_run_writes_complete_json(tmp_path):
    """bench/data.py: loader throughput (streamed, tutorial, in memory), a rank's peak memory
    against the budget and staging, on a tiny image folder; numbers exist, none asserted."""
    out = tmp_path / "data.json"
    # batch 32 per rank: the 216 staged train images hold 3 global batches of 2 x 32
    cmd = [sys.executable, str(REPO / "bench" / "data.py"), "--quick", "--images", "300",
           "--sizes", "16", "--batch", "32", "--repeats", "1", "--memory-budget-gb", "0.002",
           "--tmp", str(tmp_path), "--out", str(out)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "streamed / tutorial" in result.stdout

    report = json.loads(out.read_text())
    assert {"hostname", "cpu_model", "cpu_count"} <= set(report["machine"])
    assert {"torch", "python"} <= set(report["provenance"]["versions"])
    conditions = report["conditions"]
    assert conditions["repeats"] == 1 and conditions["images"] == 300
    assert len(conditions["loadavg_at_start"]) == 3 and len(conditions["loadavg_after"]) == 3
    (row,) = report["loader"]
    assert row["size"] == 16 and row["image_shape"] == [3, 16, 16]
    assert sorted(row["paths"]) == ["in_memory", "streamed", "tutorial"]
    for path in row["paths"].values():
        assert path["images_per_epoch"] > 0 and len(path["all_images_per_s"]) == 1
        assert math.isfinite(path["images_per_s"]) and path["images_per_s"] > 0
    assert row["paths"]["tutorial"]["images_per_epoch"] == 150  # 300 images, rank 0 of 2
    # ddpflow's paths: rank 0's micro-batch of each full global step of the train split
    train = report["staging"][0]["splits"]["train"]
    for name in ("streamed", "in_memory"):
        assert row["paths"][name]["images_per_epoch"] == train // 64 * 32
    assert math.isfinite(row["streamed_over_tutorial"]) and isinstance(row["meets_target"], bool)

    mem = report["memory"]
    assert mem["train_over_budget"] >= 4.0
    assert [r["path"] for r in mem["runs"]] == ["streamed", "in_memory"]
    for r in mem["runs"]:
        assert r["images_read"] == mem["train_images"] // 64 * 32
        assert r["peak_rss_bytes"] >= r["constant_rss_bytes"] > 0
        assert isinstance(r["fits_budget"], bool) and r["sampled"]["samples"] > 0
        assert r["auto_in_memory"] is False  # 4x the budget: auto streams
    streamed, in_memory = mem["runs"]
    assert len(streamed["worker_peak_rss_bytes"]) == 2 and in_memory["worker_peak_rss_bytes"] == []

    assert [(r["size"], r["threads"]) for r in report["staging"]] == [(16, 1), (16, 2)]
    for r in report["staging"]:
        assert r["images"] == 300 and r["seconds"] > 0 and math.isfinite(r["images_per_s"])
        assert r["same_bytes_as_first"]  # staging is deterministic whatever the threads
    quarter, whole = report["staging_memory"]
    assert (quarter["folder"], whole["folder"]) == ("quarter", "all")
    assert whole["images"] == 300 and 0 < quarter["images"] < 300
    assert whole["peak_rss_bytes"] >= whole["constant_rss_bytes"] > 0
    assert list(tmp_path.glob("ddpflow-bench-data-*")) == []  # the folders are removed


def test_layout_tiny_run_writes_complete_json(tmp_path):
    """bench/layout.py: the CPU step in fp32 NCHW, fp32 channels_last and bf16 channels_last,
    each model built as ddpflow builds it (no timing asserted)."""
    out = tmp_path / "layout.json"
    cmd = [sys.executable, str(REPO / "bench" / "layout.py"), "--cases", "cnn:1x8x8", "mlp:1x8x8"]
    cmd += ["--steps", "1", "--repeats", "2", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bf16 CL ms" in result.stdout
    report = json.loads(out.read_text())
    assert {"hostname", "cpu_model", "cpu_bf16_instructions"} <= set(report["machine"])
    assert [r["case"] for r in report["runs"]] == ["cnn:1x8x8", "mlp:1x8x8"]
    for row in report["runs"]:
        assert set(row["step_s"]) == {"fp32_nchw", "fp32_channels_last", "bf16_channels_last"}
        assert all(len(times) == 2 for times in row["all_step_s"].values())
        assert row["speedup_vs_fp32_nchw"]["fp32_nchw"] == 1.0
        assert all(math.isfinite(s) and s > 0 for s in row["step_s"].values())


def test_finetune_tiny_run_writes_complete_json(tmp_path):
    """bench/finetune.py: ddpflow's Loop from scratch, fully fine-tuned and with the backbone
    frozen; the frozen optimizer holds the head alone and the backbone stays as loaded, and the
    performance page renders it (no timing asserted)."""
    out = tmp_path / "finetune.json"
    cmd = [sys.executable, str(REPO / "bench" / "finetune.py"), "--cases", "cnn", "--batch", "8"]
    cmd += ["--steps", "2", "--repeats", "1", "--warmup", "1", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "speedup" in result.stdout
    report = json.loads(out.read_text())
    assert {"hostname", "cpu_model", "cpu_count"} <= set(report["machine"])
    assert {"torch", "python"} <= set(report["provenance"]["versions"])
    assert report["conditions"]["threads"] == 1 and report["wall_s"] > 0
    (row,) = report["runs"]
    assert (row["case"], row["batch"], row["samples_per_epoch"]) == ("cnn:3x32x32", 8, 16)
    modes = row["modes"]
    assert list(modes) == ["scratch", "full", "frozen"]
    for m in modes.values():
        assert len(m["all_epoch_s"]) == 1  # the warmup epoch is not among them
        assert math.isfinite(m["samples_per_s"]) and m["samples_per_s"] > 0
        assert m["steps_per_s"] > 0 and m["trainable_parameters"] > 0
    assert modes["scratch"]["trainable_parameters"] == modes["full"]["trainable_parameters"]
    assert modes["frozen"]["trainable_parameters"] < modes["scratch"]["trainable_parameters"]
    assert modes["frozen"]["trainable_parameters"] == modes["frozen"]["requires_grad_parameters"]
    assert modes["scratch"]["weights_head"] is None
    assert "1000 -> 10 classes" in modes["frozen"]["weights_head"]
    assert row["speedup_vs_scratch"]["scratch"] == 1.0 and row["frozen_backbone_unchanged"]
    assert "| `cnn:3x32x32` | frozen | 650 of 66,410 |" in "\n".join(_renderer(report)(report))


def test_lm_quick_run_writes_complete_json(tmp_path):
    """bench/lm.py --quick: ddpflow's language-model step and the nanoGPT-style loop, fp32
    and bf16 at 1 and 2 ranks, the same initial weights; the performance page renders it."""
    out = tmp_path / "lm.json"
    cmd = [sys.executable, str(REPO / "bench" / "lm.py"), "--quick", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    report = json.loads(out.read_text())
    assert {"hostname", "cpu_model", "cpu_count"} <= set(report["machine"])
    assert {"torch", "python"} <= set(report["provenance"]["versions"])
    assert {"loadavg_before", "loadavg_after"} <= set(report["conditions"]["load"])
    assert report["model"]["flops_per_token"] == 6 * report["model"]["flops_parameters"] > 0
    rows = {(r["precision"], r["world_size"]): r for r in report["runs"]}
    assert set(rows) == {(p, w) for p in ("fp32", "bf16") for w in (1, 2)}
    for row in rows.values():
        assert row["same_initial_weights"] and math.isfinite(row["speedup"])
        for loop in ("nanogpt", "ddpflow"):
            assert len(row[loop]["all"]) == 1  # the warmup repeat is not among them
            assert row[loop]["tokens_per_s"] > 0 and row[loop]["gflops"] > 0
            assert row[loop]["mfu"] is None  # no --peak-tflops
    assert "| bf16 | cpu | 2 |" in "\n".join(_renderer(report)(report))


def test_generate_quick_run_writes_complete_json(tmp_path):
    """bench/generate.py --quick: decoding with and without the KV cache, the same greedy
    tokens both ways; the performance page renders it."""
    out = tmp_path / "generate.json"
    cmd = [sys.executable, str(REPO / "bench" / "generate.py"), "--quick", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    report = json.loads(out.read_text())
    assert {"hostname", "cpu_model", "cpu_count"} <= set(report["machine"])
    assert report["conditions"]["batch"] == 1 and report["conditions"]["repeats"] == 1
    (row,) = report["runs"]
    assert row["same_tokens"] and row["cached_steps"] > 0
    for way in ("with_cache", "recompute"):
        assert len(row[way]["seconds"]) == 1 and row[way]["tokens_per_s"] > 0
    assert "| gpt 2x64, T 32 |" in "\n".join(_renderer(report)(report))


# --- strong scaling and the sampler's cost (issue 23) ----------------------------------


def test_scaling_plan_flips_the_world_sizes_every_round():
    sys.path.insert(0, str(REPO / "bench"))
    from scaling import parse_args, scaling_plan

    args = parse_args(["--rounds", "2", "--world-sizes", "1", "2", "4"])
    plan = scaling_plan(args)
    assert [(c["round"], c["world_size"]) for c in plan] == [
        (0, 1), (0, 2), (0, 4), (1, 4), (1, 2), (1, 1)
    ]  # fmt: skip
    # the same science at every world size: the global batch and micro-batch are fixed
    assert {(c["global_batch"], c["batch"]) for c in plan} == {(64, 16)}
    with pytest.raises(ValueError, match="is more than 4 micro-batches a step"):
        scaling_plan(parse_args(["--world-sizes", "5"]))


def test_scaling_baseline_is_the_distributed_sampler_order():
    """The old order the benchmark times new against is DistributedSampler's, padding too."""
    sys.path.insert(0, str(REPO / "bench"))
    from scaling import old_epoch_indices
    from torch.utils.data import DistributedSampler

    for n, world, rank in ((10, 3, 1), (10, 3, 2), (7, 4, 3), (8, 2, 0)):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, seed=5)
        sampler.set_epoch(2)
        assert old_epoch_indices(n, world, rank, 5, 2).tolist() == list(sampler)


def test_scaling_tiny_run_writes_complete_json(tmp_path):
    """bench/scaling.py: samples/s at world sizes 1 and 2 with one global batch, the two
    sampler orders and the seeding; numbers exist and the science is the same, no timing
    asserted."""
    out = tmp_path / "scaling.json"
    cmd = [sys.executable, str(REPO / "bench" / "scaling.py"), "--case", "mlp",
           "--world-sizes", "1", "2", "--samples", "128", "--repeats", "1", "--warmup", "1",
           "--rounds", "1", "--sampler-n", "1000", "--sampler-repeats", "2",
           "--seed-calls", "10", "--seed-repeats", "2", "--out", str(out)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "efficiency" in result.stdout and "new / old" in result.stdout

    report = json.loads(out.read_text())
    assert {"hostname", "cpu_model", "cpu_count", "loadavg_at_start"} <= set(report["machine"])
    assert {"torch", "python"} <= set(report["provenance"]["versions"])
    assert "git_commit" in report["provenance"]
    c = report["conditions"]
    assert (c["global_batch"], c["micro_batch"]) == (64, 16)
    assert c["cores"] == report["machine"]["cpu_count"]
    assert len(c["loadavg_after"]) == 3 and "shared_machine" in c and c["note"]
    rows = report["scaling"]["rows"]
    assert [(r["world_size"], r["accum"]) for r in rows] == [(1, 4), (2, 2)]
    assert rows[0]["speedup"] == 1.0 and rows[0]["efficiency"] == 1.0
    for r in rows:
        assert r["epoch_samples"] == 128 and len(r["all_samples_per_s"]) == 1
        assert math.isfinite(r["speedup"]) and r["samples_per_s"] > 0
        assert len(r["train_loss"]) == 2  # warmup + repeats epochs
        # the same micro-batches and mean gradient at both world sizes: the same loss up
        # to the summation order
        assert r["first_loss_diff_vs_base"] <= r["max_loss_diff_vs_base"] < 1e-4
    assert [(r["n"], r["world_size"]) for r in report["sampler"]] == [(1000, 1), (1000, 2)]
    for r in report["sampler"]:
        for key in ("old_s", "new_s", "old_batches_s", "new_batches_s"):
            assert r[key] > 0 and len(r["all_s"][key.removesuffix("_s")]) == 2
    seeding = report["seeding"]
    assert set(seeding["seconds_per_call"]) == {
        "loop", "loop_depth_30", "torch_manual_seed_loop", "torch_manual_seed_loop_depth_30",
        "micro_batch_seed", "torch_manual_seed", "cpu_generator",
    }  # fmt: skip
    assert all(v > 0 for v in seeding["seconds_per_call"].values())
    assert set(seeding["share_of_micro_step"]) == {"loop", "loop_depth_30"}


# --- the micro-batch auto resolves and the science (issue 32) ----------------------------


def test_micro_batch_plan_flips_the_micro_batches_every_seed():
    sys.path.insert(0, str(REPO / "bench"))
    from micro_batch import plan

    order = plan([32, 16, 8], [0, 1, 2])
    assert [micro for micro, _ in order] == [32, 16, 8, 8, 16, 32, 32, 16, 8]
    assert [seed for _, seed in order] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


@pytest.mark.e2e
def test_memory_estimate_tiny_run_compares_the_estimate_with_the_ranks_peaks(tmp_path):
    """bench/memory_estimate.py through the real workflow (one run): the estimate the run
    is judged by, beside the ranks' recorded peak RSS, and the performance page renders it
    (what the error is on this machine is the benchmark's to say, not asserted)."""
    out = tmp_path / "memory_estimate.json"
    cmd = [sys.executable, str(REPO / "bench" / "memory_estimate.py"), "--models", "mlp"]
    cmd += ["--strategies", "ddp", "--epochs", "1", "--no-probes", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["cpu_count"] and report["provenance"]["versions"]["torch"]
    (row,) = report["rows"]
    assert (row["model"], row["strategy"], row["world"]) == ("mlp", "ddp", 2)
    # torch's process alone is hundreds of MiB: both figures are real measurements
    assert row["estimate_bytes"] > 2**28 and row["measured_peak_bytes"] > 2**28
    assert row["estimate_rss_gb"] > row["estimate_total_gb"]  # the library pages added
    assert set(row["per_rank_peak_mib"]) == {"0", "1"}
    assert "GB per rank" in row["train_log_estimate"]
    rendered = "\n".join(_renderer(report)(report))
    assert "| mlp | ddp |" in rendered


def _renderer(report: dict):
    spec = importlib.util.spec_from_file_location("gen", REPO / "docs" / "gen_performance.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen.renderer(report)


def test_micro_batch_tiny_run_writes_complete_json(tmp_path):
    """bench/micro_batch.py through the real workflow: each run trains at the micro-batch it
    names (BatchNorm's batch), the one auto picks at 2 ranks has the shipped default run's
    training fingerprint, the check run trains at the world size auto picks its micro-batch
    for, and the performance page renders the result (no timing asserted)."""
    out = tmp_path / "micro_batch.json"
    cmd = [sys.executable, str(REPO / "bench" / "micro_batch.py"), "--micro-batches", "32", "16"]
    cmd += ["--seeds", "3", "--check-seeds", "3", "--epochs", "1", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "| micro-batch | auto at ranks |" in result.stdout

    report = json.loads(out.read_text())
    assert {"hostname", "cpu_model", "cpu_count", "loadavg_at_start"} <= set(report["machine"])
    assert {"torch", "python", "snakemake"} <= set(report["provenance"]["versions"])
    assert report["started"] and report["wall_s"] > 0
    c = report["conditions"]
    assert (c["ranks"], c["cores"]) == (2, 2) and len(c["loadavg_after"]) == 3
    assert c["runs_listed"] == ["micro32-seed3", "micro16-seed3", "micro16-seed3-4ranks"]
    assert sorted(c["runs_trained_in_order"]) == sorted(c["runs_listed"])
    assert "the run's normalisation batch here" in c["batchnorm"]
    runs = {r["micro_batch"]: r for r in report["seed_runs"]}
    assert sorted(runs) == [16, 32]
    for micro, accum in ((32, 1), (16, 2)):
        row = runs[micro]
        assert (row["seed"], row["world_size"], row["epochs"]) == (3, 2, 1)
        assert row["accumulation_steps"] == accum and row["steps"] == 1294 // 64
        assert row["test_samples"] == 359 and 0.0 < row["test_accuracy"] <= 1.0
        assert math.isfinite(row["test_loss"]) and row["train_seconds"] > 0
    # 32 is what auto picks at 2 ranks: the shipped default run's science; 16 is another
    assert runs[32]["same_training_fingerprint_as_shipped_default"] is True
    assert runs[16]["same_training_fingerprint_as_shipped_default"] is False
    # ... and at 4 ranks, where auto resolves micro-batch 16, the shipped default keeps its
    # BatchNorm batch of 32: a batch of 16 there is still another science
    (check,) = report["at_auto_world_size"]
    assert (check["micro_batch"], check["seed"], check["world_size"]) == (16, 3, 4)
    assert check["accumulation_steps"] == 1 and check["steps"] == runs[16]["steps"]
    assert check["same_training_fingerprint_as_shipped_default"] is False
    assert check["at_ranks_here"]["test_accuracy"] == runs[16]["test_accuracy"]
    assert 0.0 < check["test_accuracy"] <= 1.0
    bn = {r["micro_batch"]: r for r in report["batchnorm"]}
    assert bn[32]["auto_picks_it_at_world_sizes"] == [1, 2]
    assert bn[16]["auto_picks_it_at_world_sizes"] == [4]
    assert bn[16]["rank0_forwards_per_step_here"] == 2
    assert bn[16]["rank0_forwards_per_step_at_auto_world_sizes"] == {"4": 1}
    for s in report["by_micro_batch"]:
        assert s["runs"] == 1 and s["test_accuracy"]["std"] == 0.0
        assert s["test_accuracy"]["mean"] == runs[s["micro_batch"]]["test_accuracy"]

    spec = importlib.util.spec_from_file_location("gen", REPO / "docs" / "gen_performance.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    page = "\n".join(gen.renderer(report)(report))
    assert "| 32 | 1, 2 | 1 / 2 at 1, 1 at 2 |" in page and "| 16 | 4 | 2 / 1 at 4 |" in page
    assert "| 16 | 3 | 4 |" in page


def test_store_scale_tiny_run_writes_complete_json(tmp_path):
    out = tmp_path / "store_scale.json"
    command = [sys.executable, str(REPO / "bench" / "store_scale.py"), "--sizes", "4", "8",
               "--res-options", "", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(out.read_text())
    (only,) = doc["passes"]
    assert [r["clients"] for r in only["rows"]] == [4, 8]
    assert all(r["barrier_s"] >= r["joined_s"] > 0 and not r["errors"] for r in only["rows"])
    assert set(only["growth"]["barrier_s"]) == {"exponent", "ratio", "from", "to"}


def test_accumulation_drift_tiny_run_compares_the_world_sizes(tmp_path):
    """One epoch at 1 and 2 ranks: each world size's loss, and the parameters' distance (not
    asserted small: the page shows it; only that it is a measured number)."""
    out = tmp_path / "accumulation_drift.json"
    script = str(REPO / "bench" / "accumulation_drift.py")
    command = [sys.executable, script, "--world-sizes", "1", "2", "--epochs", "1"]
    done = subprocess.run(
        [*command, "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(out.read_text())
    shapes = [(r["world_size"], r["micro_batches_per_rank"]) for r in doc["runs"]]
    assert shapes == [(1, 4), (2, 2)]  # micro-batch 16 of 64: added in sequence per rank
    assert all(len(r["epochs"]) == 1 and r["epochs"][0]["train_loss"] > 0 for r in doc["runs"])
    (pair,) = doc["distances"]
    assert (pair["a"], pair["b"]) == (1, 2) and math.isfinite(pair["relative_l2"])
    assert pair["max_abs"] >= 0 and isinstance(pair["bitwise_equal"], bool)


def test_tensor_parallel_quick_run_counts_each_ranks_state_and_collectives(tmp_path):
    """bench/tensor_parallel.py --quick (a 1-block gpt): ddp, ddp at tensor_parallel 2 and
    fsdp at 2 ranks; a rank's state is the theory's share, tensor parallelism runs two
    all-reduces per block in the forward and two in the backward; the page renders it."""
    out = tmp_path / "tensor_parallel.json"
    cmd = [sys.executable, str(REPO / "bench" / "tensor_parallel.py"), "--quick"]
    result = subprocess.run(
        [*cmd, "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    rows = {r["case"]: r for r in run["rows"]}
    layout = {name: (r["data_ranks"], r["tensor_ranks"]) for name, r in rows.items()}
    assert layout == {"ddp": (2, 1), "ddp_tp2": (1, 2), "fsdp": (2, 1)}
    assert 0 < run["split_parameters"] < run["parameters"]
    for r in rows.values():
        assert math.isfinite(r["step_seconds"]) and r["step_seconds"] > 0
        assert r["measured_over_theory"] == pytest.approx(1.0, rel=0.01), r["case"]
    # a rank holds half of each block's projections: less than ddp, more than fsdp's half
    assert rows["fsdp"]["state_vs_baseline"] < rows["ddp_tp2"]["state_vs_baseline"] < 1
    blocks = run["gpt"]["n_layer"]
    assert rows["ddp_tp2"]["collectives_per_step"] == {"all_reduce": 4 * blocks}
    assert rows["ddp"]["collectives_per_step"] == {"all_reduce": 1}  # DDP's one bucket
    assert all(r["collectives_same_every_step"] for r in rows.values())
    assert "| ddp, tensor_parallel 2 | 1 x 2 |" in "\n".join(_renderer(report)(report))


def test_lm_windows_quick_run_writes_complete_json(tmp_path):
    """bench/lm_windows.py --quick: the same gpt with the same blocks every epoch and with
    fresh windows, each epoch's losses and the final models at every eval stride; the
    performance page renders it."""
    out = tmp_path / "lm_windows.json"
    cmd = [sys.executable, str(REPO / "bench" / "lm_windows.py"), "--quick", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    report = json.loads(out.read_text())
    assert report["conditions"]["corpus"]["package"] == "json" and report["machine"]["cpu_count"]
    fixed, fresh = report["runs"]
    assert (fixed["fresh_windows"], fresh["fresh_windows"]) == (False, True)
    assert fresh["steps_per_epoch"] == fixed["steps_per_epoch"] > 0
    n = report["conditions"]["corpus"]["tokens"]["val"]
    for run in report["runs"]:
        assert len(run["epochs"]) == 2 and all(math.isfinite(e["val_loss"]) for e in run["epochs"])
        assert list(run["val_loss_by_stride"]) == ["32", "16", "8", "4"]
        assert set(run["val_tokens_by_stride"].values()) == {n - 1}  # each token once
    assert "| fresh windows | 0 |" in "\n".join(_renderer(report)(report))


def test_norm_groups_tiny_run_times_both_loops(tmp_path):
    """bench/norm_groups.py: the grouped loop shares each BatchNorm batch between the two
    ranks, the other does not; both step times measured and rendered (no timing asserted)."""
    out = tmp_path / "norm_groups.json"
    cmd = [sys.executable, str(REPO / "bench" / "norm_groups.py"), "--repeats", "1"]
    result = subprocess.run(
        [*cmd, "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert run["groups"] == {"grouped": 2, "own": 1}
    assert all(math.isfinite(s) and s > 0 for s in run["step_s"].values())
    assert "| grouped | 2 |" in "\n".join(_renderer(report)(report))


def test_flops_tiny_run_counts_and_times_against_the_measurement(tmp_path):
    """bench/flops.py --quick: each model's count equals the memory measurement's own, the
    gpt's is within 5% of its formula; both times measured and rendered (none asserted)."""
    out = tmp_path / "flops.json"
    cmd = [sys.executable, str(REPO / "bench" / "flops.py"), "--quick", "--repeats", "1"]
    result = subprocess.run(
        [*cmd, "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    report = json.loads(out.read_text())
    assert [r["model"] for r in report["runs"]] == ["cnn", "gpt 4x128"]
    for run in report["runs"]:
        assert run["measured_flops_match"] and run["flops_per_micro_batch"] > 0
        assert math.isfinite(run["count_s"]) and run["measure_s"] > 0
    assert report["runs"][1]["counted_over_formula"] == pytest.approx(1.0, abs=0.05)
    assert "| gpt 4x128 | 32 |" in "\n".join(_renderer(report)(report))


def test_checkpoint_tiny_run_times_both_modes(tmp_path):
    """bench/checkpoint.py --quick: each model's stop, synchronous and asynchronous, the
    background write and the training with checkpoints, measured and rendered (no timing
    asserted)."""
    out = tmp_path / "checkpoint.json"
    cmd = [sys.executable, str(REPO / "bench" / "checkpoint.py"), "--quick", "--saves", "1"]
    result = subprocess.run(
        [*cmd, "--repeats", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    report = json.loads(out.read_text())
    assert [r["model"] for r in report["runs"]] == ["cnn", "gpt 10M"]
    for run in report["runs"]:
        assert run["checkpoint_bytes"] > 0 and set(run["blocking_s"]) == {"sync", "async"}
        assert all(s > 0 for s in run["step_s"].values())
    assert "| gpt 10M |" in "\n".join(_renderer(report)(report))
