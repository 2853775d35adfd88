"""The memory estimate before a run is queued: training.footprint's figures measured on fake
tensors against the real model's tensors, checks.memory's per-strategy arithmetic and verdicts,
and the refusal through a real `snakemake -n` parse (the Slurm test cluster's refusal is in
tests/slurm/test_workflow_slurm.py)."""

from __future__ import annotations

import json
import os
import re

import pytest
from ddpflow.checks import memory as fits
from ddpflow.checks import memory_knobs as fit_knobs
from ddpflow.checks.early import memory_verdicts
from ddpflow.checks.slurm import gpu_types
from ddpflow.cluster.slurm_parse import Node
from ddpflow.training.footprint import measure
from ddpflow.training.models import build_model
from workflow_helpers import make_run, snakemake, write_config

MB = 2**20
ADAM = {
    "name": "adam",
    "momentum": 0.9,
    "nesterov": True,
    "weight_decay": 0.0,
    "betas": [0.9, 0.999],
}
SGD = {**ADAM, "name": "sgd"}


def _figures(name="resnet18", micro=8, precision="fp32", checkpointing=False, opt=ADAM):
    run = make_run(model={"name": name})
    return measure(run["model"], [3, 32, 32], 10, micro, precision, "cpu", checkpointing, opt)


def test_parameters_gradients_and_optimizer_state_are_the_real_models_bytes():
    run = make_run(model={"name": "resnet18"})
    real = build_model(run["model"], [3, 32, 32], 10)
    params = sum(p.numel() * 4 for p in real.parameters())
    buffers = sum(b.numel() * b.element_size() for b in real.buffers())
    adam, sgd = _figures(opt=ADAM), _figures(opt=SGD)
    assert adam["parameters"] == params and adam["gradients"] == params
    assert adam["buffers"] == buffers
    # Adam: two moments per parameter (and a step counter each); SGD: one momentum buffer
    assert 2 * params <= adam["optimizer"] <= 2 * params + 1 * MB
    assert params <= sgd["optimizer"] <= params + 1 * MB
    units = [m for m in real.modules() if type(m).__name__ == "BasicBlock"]
    assert adam["largest_unit"] == max(sum(p.numel() * 4 for p in u.parameters()) for u in units)


def test_activations_grow_with_the_micro_batch_and_shrink_with_the_memory_knobs():
    small, large = _figures(micro=8), _figures(micro=16)
    # a line: what grows with the micro-batch, and what does not (the measurement at 1)
    per_sample = (large["activations"] - small["activations"]) / 8
    assert 0 < large["activations_at_2"] < small["activations"]
    predicted = large["activations_at_2"] + 14 * per_sample
    assert abs(predicted / large["activations"] - 1) < 0.1
    assert _figures(micro=16, checkpointing=True)["activations"] < 0.6 * large["activations"]
    assert _figures(micro=16, precision="bf16")["activations"] < 0.9 * large["activations"]
    # a CPU rank trains fp16 in fp32 (build.autocast_factory): the same figures as fp32
    assert _figures(micro=16, precision="fp16")["activations"] == large["activations"]


# a CPU rank's process: 100 MB of its own, 80 MB of library pages (not counted: page cache)
PROCESS = {"anon": 100 * MB, "file": 80 * MB}
FIGURES = {
    "parameters": 400 * MB,
    "buffers": 0,
    "gradients": 400 * MB,
    "optimizer": 800 * MB,
    "activations": 1000 * MB,
    "activations_at_2": 1000 * MB // 128,  # in proportion to the micro-batch (256 below)
    "largest_unit": 50 * MB,
}


@pytest.mark.parametrize(
    "strategy, world, expected_mb",
    [
        ("ddp", 1, 400 + 400 + 800 + 1000),  # one rank trains plain whatever the strategy
        ("fsdp", 1, 400 + 400 + 800 + 1000),
        ("ddp", 4, 400 + 400 + 800 + 1000),
        # the optimizer state divided; rank 0 gathers the rest (600) for a checkpoint, when
        # the activations (1000, larger) are gone
        ("zero", 4, 400 + 400 + 200 + 1000),
        # a CPU rank: (P + G + O) / 4, and the blocks FSDP gathers whole stay resident (glibc)
        ("fsdp", 4, 100 + 400 + 100 + 400 + 200 + 1000),
    ],
)
def test_a_ranks_share_by_strategy(strategy, world, expected_mb):
    run = make_run(
        train={"strategy": strategy, "global_batch_size": 64, "micro_batch_size": 16},
        machine={"cpu_ranks_per_node": world},
    )
    est = fits.estimate(run, FIGURES, PROCESS, data_bytes=0)
    # the process: its own 100 MB; the node's 80 MB of library pages, a quarter each
    assert est.total == expected_mb * MB + 100 * MB and est.shared == 80 * MB // world


def test_on_a_gpu_fsdp_holds_two_gathered_units_and_zero_rank_0_gathers_the_state():
    cpu = make_run(
        train={"strategy": "fsdp", "global_batch_size": 64, "micro_batch_size": 16},
        machine={"cpu_ranks_per_node": 4},
    )
    gpu = {**cpu, "machine": {**cpu["machine"], "gpus_per_node": 4}}
    est = fits.estimate(gpu, FIGURES, PROCESS, 0)
    # (P + G + O) / 4 + two gathered units + one unit's unsharded gradients
    assert (est.parameters, est.gradients, est.optimizer) == (200 * MB, 150 * MB, 200 * MB)
    assert est.runtime == fits.CUDA_CONTEXT and est.shared == 0
    zero = {**gpu, "train": {**gpu["train"], "strategy": "zero"}}
    small = {**FIGURES, "activations": 100 * MB}
    est = fits.estimate(zero, small, PROCESS, 0)
    assert est.gather == 600 * MB and est.total == (400 + 400 + 200 + 600) * MB + fits.CUDA_CONTEXT
    assert "0.59 of optimizer state gathered for a checkpoint" in est.parts()


def test_bucket_copies_and_bf16_gathers_change_the_share():
    base = {"global_batch_size": 64, "micro_batch_size": 16}
    copies = make_run(
        train={**base, "ddp": {"gradient_as_bucket_view": False}}, machine={"cpu_ranks_per_node": 2}
    )
    assert fits.estimate(copies, FIGURES, PROCESS, 0).gradients == 800 * MB
    bf16 = make_run(
        train={**base, "strategy": "fsdp", "precision": "bf16"}, machine={"cpu_ranks_per_node": 2}
    )
    # the shard in fp32, the gathered copies in bf16 (FSDP2's param_dtype)
    assert fits.estimate(bf16, FIGURES, PROCESS, 0).parameters == (200 + 200) * MB


def _slurm_run(**machine):
    run = make_run(
        train={"global_batch_size": 512, "micro_batch_size": 256},
        machine={"cpu_ranks_per_node": 2, **machine},
    )
    return {**run, "launcher": "slurm"}


def test_a_run_that_cannot_fit_is_refused_naming_the_estimate_and_the_knobs():
    run = _slurm_run(mem_gb=4)
    est = fits.estimate(run, FIGURES, PROCESS, 0)
    room, where = fits.capacity(run, "slurm", None, [])
    verdict, text = fits.judge(run, est, room, where, FIGURES)
    assert verdict == "refused"
    assert "about 2.64 GB per rank (parameters 0.39, gradients 0.39, optimizer 0.78, " in text
    assert ", and 0.04 GB of library pages shared with the node's other ranks" in text
    assert "does not fit the 2.00 GB a rank has (machine.mem_gb 4 over 2 ranks per node)" in text
    # 1.66 GB without activations leaves 0.34 GB: 89 samples' worth, 64 splits the batch
    assert "train.micro_batch_size 64 " in text
    # only knobs estimated to fit alone: fsdp on CPU ranks keeps the blocks it gathers (no
    # gain), activation checkpointing and bf16 were not measured here (early measures them)
    assert "train.strategy" not in text and "activation_checkpointing" not in text
    # 2.64 GB a rank and its 0.04 GB share of the library pages, for 2 ranks: set as
    # offered, the run fits without the 'close to its limit' warning over 100%
    assert "machine.mem_gb 5.4 or more" in text
    offered = _slurm_run(mem_gb=5.4)
    est = fits.estimate(offered, FIGURES, PROCESS, 0)
    verdict, said = fits.judge(offered, est, *fits.capacity(offered, "slurm", None, []), FIGURES)
    assert verdict == "tight" and not re.search(r": 1\d\d% of the", said), said
    assert "machine.cpu_ranks_per_node 1 and machine.nodes 2 (the same world size)" in text


def test_above_80_percent_warns_and_below_says_the_share():
    run = _slurm_run(mem_gb=6)
    est = fits.estimate(run, FIGURES, PROCESS, 0)
    verdict, text = fits.judge(run, est, *fits.capacity(run, "slurm", None, []), FIGURES)
    assert verdict == "tight" and ": 89% of the 3.00 GB a rank has" in text  # with the pages
    # 2720 MB a rank: the 2700 MB it holds fit, not with the node's library pages (page
    # cache the kernel drops under pressure): a warning, never a refusal
    run = _slurm_run(mem_gb=2720 * 2 / 1024)
    verdict, text = fits.judge(run, est, *fits.capacity(run, "slurm", None, []), FIGURES)
    assert verdict == "tight" and ": 101% of the 2.66 GB a rank has" in text
    run = _slurm_run(mem_gb=16)
    verdict, text = fits.judge(run, est, *fits.capacity(run, "slurm", None, []), FIGURES)
    assert verdict == "fits" and text.endswith(
        "of 8.00 GB (machine.mem_gb 16 over 2 ranks per node): 33%"
    )


def test_a_gpu_ranks_memory_comes_from_the_key_the_local_gpu_or_the_partitions_gpu_type():
    cpu = make_run()
    gpu = {**cpu, "machine": {**cpu["machine"], "gpus_per_node": 1}, "launcher": "slurm"}
    assert fits.capacity(gpu, "slurm", None, ["h100"]) == (
        80 * 2**30,
        "the partition's GPU type h100, 80 GB",
    )
    assert fits.capacity(gpu, "slurm", None, ["a100"])[0] is None  # 40 or 80 GB: not guessed
    assert fits.capacity(gpu, "slurm", None, ["h100", "l4"])[0] is None  # mixed partition
    assert fits.capacity(gpu, "local", 12 * 2**30, [])[0] == 12 * 2**30
    keyed = {**gpu, "machine": {**gpu["machine"], "gpu_mem_gb": 24}}
    assert fits.capacity(keyed, "slurm", None, ["h100"]) == (24 * 2**30, "machine.gpu_mem_gb 24")
    est = fits.estimate(keyed, FIGURES, PROCESS, 0)
    assert est.runtime == fits.CUDA_CONTEXT and est.device == "cuda"


def test_the_gpu_types_of_a_partitions_nodes():
    def node(gres):
        return Node("n1", ("gpu",), 8, 1000, 4, gres)

    nodes = [node("gpu:h100:4(S:0-1)"), node("gpu:h100:4,shard:8"), node("gpu:2")]
    assert gpu_types(nodes) == ["", "h100"]


def test_the_measurement_is_made_once_for_every_workflow(tmp_path, monkeypatch):
    """memory_verdicts measures in a subprocess, keeps the figures in the user's cache, and
    answers the next identical question from it (no subprocess: ddpflow.checks.early.measure)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    run = {**make_run(model={"name": "mlp"}), "launcher": "local"}
    inputs = {run["name"]: ([1, 8, 8], 10, 0)}
    _, first = memory_verdicts([run], inputs, tmp_path / "a")
    cached = json.loads((tmp_path / "cache/ddpflow/footprints.json").read_text())
    process = cached["process_memory"]
    assert len(cached) == 2 and process["anon"] > 50 * MB and process["file"] > 50 * MB
    import subprocess

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("measured again"))
    _, second = memory_verdicts([run], inputs, tmp_path / "b")
    assert first == second and first["default"][0] == "fits"


def test_a_local_gpu_run_is_compared_with_the_gpu_also_from_the_cache(tmp_path, monkeypatch):
    """The local GPU's memory comes from the driver (nvidia-smi, for the first GPU the ranks
    see) whenever the figures come from the cache, where no subprocess asked torch: before,
    a second parse showed the GPU's memory as unknown. This machine has no GPU: a stand-in
    nvidia-smi on PATH answers as the H100's driver did (81559 MiB)."""
    from ddpflow.checks.host import local_gpu_memory_bytes

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234,GPU-5678")
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/asked\necho 81559\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:{os.environ['PATH']}")
    local_gpu_memory_bytes.cache_clear()
    base = make_run(model={"name": "mlp"})
    run = {**base, "machine": {**base["machine"], "gpus_per_node": 1}, "launcher": "local"}
    inputs = {run["name"]: ([1, 8, 8], 10, 0)}
    try:
        _, first = memory_verdicts([run], inputs, tmp_path / "a")
        _, second = memory_verdicts([run], inputs, tmp_path / "b")  # from the cache
    finally:
        local_gpu_memory_bytes.cache_clear()
    assert first == second
    assert "of 79.6 GB (this machine's GPU, 79.6 GB)" in second["default"][1], second
    assert (tmp_path / "asked").read_text().split()[-2:] == ["-i", "GPU-1234"]


def test_snakemake_refuses_at_parse_a_run_this_machine_cannot_hold(workdir):
    """The local launcher compares with this machine's memory: a ViT-B/16 at micro-batch
    4096 is tens of GB per rank; `snakemake -n` refuses before planning anything."""
    configfile = write_config(
        workdir / "config.yaml",
        {
            "model": {"name": "vit_b_16", "kwargs": {"image_size": 32}},
            "data": {
                "source": "synthetic",
                "synthetic": {"channels": 3, "height": 32, "width": 32},
            },
            "train": {"global_batch_size": 8192, "micro_batch_size": 4096},
        },
    )
    result = snakemake(workdir, configfile, "-n")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "ddpflow: configuration error: run 'default': about " in output, output[-2000:]
    assert "does not fit the " in output and " GB a rank has (this machine's " in output
    # each knob estimated on its own, the model's from its own measurement (bf16 here)
    assert "train.precision: bf16 (activations in about half the bytes: " in output
    assert "machine.cpu_ranks_per_node 1 (each needs " in output
    assert not (workdir / "results").exists()


def _probe(run: dict, shape: list[int], steps: int = 2) -> dict:
    """tests/memory_probe.py in a fresh process: a CPU rank's steps and evaluation, its peak."""
    import subprocess
    import sys
    from pathlib import Path

    from ddpflow.config.machine import uses_channels_last

    spec = {
        "model": dict(run["model"]),
        "shape": shape,
        "micro_batch": run["train"]["micro_batch_size"],
        "eval_batch": run["eval"]["batch_size"],
        "steps": steps,
        "channels_last": uses_channels_last(run),
        "optimizer": dict(run["train"]["optimizer"]),
    }
    script = Path(__file__).with_name("memory_probe.py")
    done = subprocess.run(
        [sys.executable, str(script), json.dumps(spec)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, shape, micro, eval_batch, optimizer",
    [
        # the evaluation's 512 images outgrow the step: 0.51 GB of activations against 0.15
        ("resnet18", [3, 32, 32], 32, 512, "adam"),
        ("cnn", [3, 32, 32], 128, 32, "sgd"),  # the training step's activations lead
        ("mlp", [1, 8, 8], 32, 64, "adamw"),  # the process itself, nearly all of it
    ],
)
def test_the_estimate_is_within_a_quarter_of_a_real_ranks_peak(
    model, shape, micro, eval_batch, optimizer
):
    """The estimate against a real process that trains and evaluates as a CPU rank does (its
    own resident memory at the peak: ru_maxrss less the libraries' pages, which the estimate
    leaves out by design). Before the evaluation was counted, ResNet-18 at micro-batch 32
    came out 44% under."""
    run = make_run(
        model={"name": model},
        train={
            "global_batch_size": micro,
            "micro_batch_size": micro,
            "optimizer": {"name": optimizer},
        },
        eval={"batch_size": eval_batch},
        machine={"cpu_ranks_per_node": 1},
    )
    got = _probe(run, shape)
    train = run["train"]
    figures = measure(
        run["model"], shape, 10, micro, "fp32", "cpu", False, train["optimizer"], eval_batch
    )
    est = fits.estimate(run, figures, got["process"], 0)
    own_peak = got["peak_bytes"] - got["file_bytes"]
    assert abs(est.total / own_peak - 1) < 0.25, (est.parts(), own_peak / 2**30)
    # and as RSS shows it, the libraries' pages counted in full
    assert abs((est.total + got["file_bytes"]) / got["peak_bytes"] - 1) < 0.25


def _debug_partition():
    """The test cluster's partition 'debug' from its captured scontrol text: 2 nodes of
    8000 MB."""
    from pathlib import Path

    from ddpflow.checks.slurm import partition_limits
    from ddpflow.cluster import slurm_parse as sp

    golden = Path(__file__).parent / "golden" / "slurm"
    parts = sp.parse_partitions((golden / "testbed_partitions.txt").read_text())
    nodes = sp.parse_nodes((golden / "testbed_nodes.txt").read_text())
    return partition_limits(parts["debug"], [n for n in nodes if "debug" in n.partitions])


def _refusal(run, figures, variants=None, partition=None):
    est = fits.estimate(run, figures, PROCESS, 0)
    room, where = fits.capacity(run, "slurm", None, [])
    return fits.judge(run, est, room, where, figures, variants, partition)


BIG = {**FIGURES, "activations": 4000 * MB, "activations_at_2": 4000 * MB // 128}


def test_a_refusal_offers_only_knobs_the_partition_allows():
    """A refusal used to suggest `machine.mem_gb N or more` beyond what the partition's nodes
    have (which the cluster check then refused, suggesting a value that did not fit): a
    knob is offered only where it alone fits the rank and the partition."""
    debug = _debug_partition()
    assert (debug.name, debug.mem_mb, debug.nodes) == ("debug", 8000, 2)
    run = _slurm_run(mem_gb=3.9, partition="debug")
    verdict, text = _refusal(run, BIG, partition=debug)
    assert verdict == "refused"
    knobs = text.split("To fit: ")[1]
    # 5.57 GB a rank (and its pages): 11.3 GB for a node of 2 ranks, over the partition's 8000 MB
    assert "machine.mem_gb 11.3" not in knobs and "or more" not in knobs
    assert "train.micro_batch_size 16 (1.90 GB;" in knobs
    # one rank per node on the partition's two nodes fits its 8000 MB
    assert "machine.cpu_ranks_per_node 1 and machine.nodes 2 (the same world size) with " in knobs
    assert "train.strategy" not in knobs  # fsdp on CPU ranks keeps what it gathers: no gain
    assert "activation_checkpointing" not in knobs and "bf16" not in knobs  # not measured
    # without the partition's limits (not asked), more memory is a knob again
    _, text = _refusal(run, BIG)
    assert "machine.mem_gb 11.3 or more" in text


def test_the_models_own_knobs_are_offered_where_their_figures_fit():
    """A torchvision ResNet at 224 px with the small stem: its measured variant without it
    fits, the bf16 and checkpointed variants do not and are left out."""
    run = _slurm_run(mem_gb=3.9, partition="debug")
    run = {**run, "model": {**run["model"], "name": "resnet50"}}
    huge = {**FIGURES, "activations": 8000 * MB, "activations_at_2": 8000 * MB // 128}
    variants = {
        "model.small_input_stem: false": {**huge, "activations": 200 * MB},
        "train.precision: bf16": {**huge, "activations": 7200 * MB},
        "train.activation_checkpointing: true": {**huge, "activations": 4000 * MB},
    }
    assert set(variants) == set(fit_knobs.variant_runs(run))  # the knobs early measures
    verdict, text = _refusal(run, huge, variants, _debug_partition())
    assert verdict == "refused"
    assert "model.small_input_stem: false (the ImageNet stem shrinks" in text
    assert "first block: different science, a model that sees less: 1.86 GB)" in text
    assert "bf16" not in text and "activation_checkpointing" not in text


def test_where_no_knob_fits_the_refusal_names_the_partitions_limit():
    run = _slurm_run(mem_gb=3.9, partition="debug")
    huge = {**FIGURES, "parameters": 4000 * MB, "gradients": 4000 * MB}
    verdict, text = _refusal(run, huge, {}, _debug_partition())
    assert verdict == "refused"
    assert text.endswith(
        "To fit: nothing fits partition 'debug': a node gives at most 8000 MB (its 2 ranks "
        "3.91 GB each) on at most 2 nodes: a smaller model or a bigger machine"
    ), text


def _together(text: str) -> str:
    head = "To fit: no single knob fits partition 'debug': a node gives at most 8000 MB"
    assert head in text and "; together they do: " in text, text
    return text.split("; together they do: ")[1]


def test_where_no_single_knob_fits_a_combination_that_does_is_offered():
    """At 224 px with evaluation at 512 neither a smaller micro-batch nor a smaller
    evaluation batch fits alone; both together do, and the combination is checked against
    the estimate it names. Where the batches cannot fit either, the model's own measured knob
    joins them (the stem that shrinks the image first)."""
    run = _slurm_run(mem_gb=3.9, partition="debug")
    run = {**run, "model": {**run["model"], "name": "resnet50"}}
    big = {**FIGURES, "parameters": 50 * MB, "gradients": 50 * MB, "optimizer": 100 * MB,
           "activations": 8000 * MB, "activations_at_2": 8000 * MB // 128,
           "evaluation": 8000 * MB, "eval_batch": 512}  # fmt: skip
    verdict, text = _refusal(run, big, {}, _debug_partition())
    assert verdict == "refused"
    combo = _together(text)
    micro, size = (
        int(x) for x in re.findall(r"(?:micro_batch_size|eval\.batch_size) (\d+)", combo)
    )
    assert combo.startswith("train.micro_batch_size") and 1 <= micro < 256 and size < 512
    smaller = {**run, "train": {**run["train"], "micro_batch_size": micro},
               "eval": {**run["eval"], "batch_size": size}}  # fmt: skip
    cut = {**big, "activations": 8000 * MB * micro // 256, "evaluation": 8000 * MB * size // 512}
    room, _ = fits.capacity(smaller, "slurm", None, [])
    assert fits.estimate(smaller, cut, PROCESS, 0).total <= room
    # a fixed part no batch removes (what the small stem's full-size maps keep): the stem
    # variant's figures are needed, and named first
    stuck = {**big, "activations_at_2": 4000 * MB, "activations": 8000 * MB}
    stem = {**big, "activations": 400 * MB, "activations_at_2": 400 * MB // 128}
    variants = {"model.small_input_stem: false": stem}
    _, text = _refusal(run, stuck, variants, _debug_partition())
    assert _together(text).startswith("model.small_input_stem: false, ")
    # nothing at all: the partition's limit, as before
    _, text = _refusal(run, {**stuck, "parameters": 4000 * MB}, {}, _debug_partition())
    assert "nothing fits partition 'debug'" in text


def test_eval_batch_auto_chooses_the_largest_evaluation_batch_that_fits(tmp_path, monkeypatch):
    """eval.batch_size auto, measured as the parse and the train rule measure (fake tensors
    in early's subprocess): a gpt whose evaluation logits at 512 blocks of 512 tokens cannot
    fit a 2 GB rank is refused at 512, naming auto; with auto the same run is judged at the
    largest power of two that fits, which the train rule writes to admitted.json for the
    ranks (training.evaluate.batch_size)."""
    from ddpflow.checks.admission import admission
    from ddpflow.config.typed import RunSpec
    from ddpflow.training import evaluate

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def lm_run(batch):
        run = make_run(
            task="language_model",
            data={"source": "text", "path": "corpus.txt", "block_size": 512},
            model={"name": "gpt", "kwargs": {"n_layer": 2, "n_head": 4, "n_embd": 128}},
            train={"global_batch_size": 16, "micro_batch_size": 8},
            eval={"batch_size": batch},
            machine={"cpu_ranks_per_node": 1, "mem_gb": 2},
        )
        return {**run, "launcher": "slurm"}

    inputs = {"default": ([512], 8192, 0, 4096)}  # block 512, vocabulary 8192, 4096 blocks
    _, verdicts = memory_verdicts([lm_run(512)], inputs, tmp_path / "a")
    verdict, text = verdicts["default"]
    assert verdict == "refused" and "evaluation" in text, text
    assert re.search(r"eval\.batch_size (\d+), or auto", text), text
    _, verdicts = memory_verdicts([lm_run("auto")], inputs, tmp_path / "a")
    verdict, text = verdicts["default"]
    chosen = int(re.search(r"evaluation at eval\.batch_size auto: (\d+)", text).group(1))
    assert verdict == "fits" and 1 <= chosen < 512 and chosen & (chosen - 1) == 0, text
    # twice the batch would not have fitted: the largest power of two that does
    run = lm_run(chosen * 2)
    _, verdicts = memory_verdicts([run], inputs, tmp_path / "a")
    assert verdicts["default"][0] != "fits", verdicts["default"][1]

    manifest = {"shape": [512], "num_classes": 8192}
    monkeypatch.setattr("ddpflow.checks.early.input_of", lambda run, manifest: inputs["default"])
    admitted = admission(lm_run("auto"), manifest, tmp_path / "a")
    assert admitted["eval_batch"] == chosen
    spec = RunSpec.from_run(lm_run("auto"))
    assert evaluate.batch_size(spec, admitted) == chosen
    assert evaluate.batch_size(spec, {}) == 8  # nothing admitted: the training's micro-batch
    assert evaluate.batch_size(RunSpec.from_run(lm_run(64)), admitted) == 64
