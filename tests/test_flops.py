"""FLOPs counted once per run (ddpflow.training.footprint.count_flops, on fake tensors as the
login node counts them), the peaks MFU is taken against, and what a run's records say of its
arithmetic and memory (ddpflow.monitoring.flops)."""

from __future__ import annotations

import pytest
import torch
from ddpflow.monitoring import flops
from ddpflow.training import footprint
from ddpflow.training.gpt import GPT
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode


def test_a_linear_stack_counts_exactly_its_matrix_products():
    """Forward: 2 x batch x (in x hidden + hidden x out). Backward: the weights' gradients
    the same again, and the input gradient of every layer but the first (the data needs
    none): 2 x batch x hidden x out."""
    batch, inputs, hidden, outputs = 16, 64, 32, 10
    with FakeTensorMode():
        model = nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, outputs))
        counted = footprint.count_flops(model, torch.empty(batch, inputs))
    products = inputs * hidden + hidden * outputs
    assert counted == 2 * batch * products * 2 + 2 * batch * hidden * outputs


@pytest.mark.parametrize("n_layer,n_head,n_embd,block", [(4, 4, 128, 64), (2, 2, 64, 256)])
def test_the_gpt_counts_what_its_formula_says(n_layer, n_head, n_embd, block):
    """The gpt against 6N + 12 L H Q T per token (PaLM's appendix, nanoGPT's MFU) within 5%:
    the attention the CPU's fused kernel computes is counted too (FlopCounterMode has no
    formula of its own for it)."""
    batch, vocab = 4, 512
    with FakeTensorMode():
        model = GPT(vocab, block, n_layer, n_head, n_embd)
        counted = footprint.count_flops(model, torch.zeros(batch, block, dtype=torch.int64))
        parameters = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    per_token = flops.gpt_formula_flops(parameters, n_layer, n_embd, block)
    assert counted == pytest.approx(per_token * batch * block, rel=0.05)


def test_the_footprint_counts_recomputation_as_hardware_work_only():
    """With activation checkpointing the backward recomputes each block's forward: the
    hardware's FLOPs, not the model's, which stay those of the run without it."""
    model = {"name": "gpt", "kwargs": {"n_layer": 2, "n_head": 2, "n_embd": 64}}
    optimizer = {"name": "adamw", "lr": 1e-3, "weight_decay": 0.0, "betas": [0.9, 0.999]}
    args = dict(shape=[32], outputs=128, micro_batch=4, precision="fp32", device_type="cpu")
    plain = footprint.measure(model, **args, checkpointing=False, optimizer=optimizer)
    kept = footprint.measure(model, **args, checkpointing=True, optimizer=optimizer)
    assert plain["model_flops"] == plain["hardware_flops"] == kept["model_flops"] > 0
    # each block's forward is about a third of its forward and backward
    extra = kept["hardware_flops"] - kept["model_flops"]
    assert 0.15 * kept["model_flops"] < extra < 0.34 * kept["model_flops"]


@pytest.mark.parametrize(
    "name,precision,peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H200", "fp32", 66.9),
        ("NVIDIA A100-SXM4-80GB", "fp16", 312.0),
        ("NVIDIA L40S", "bf16", 362.05),
        ("AMD Instinct MI300X", "bf16", 1307.4),
        ("AMD Instinct MI250X", "fp32", 95.7),
    ],
)
def test_the_peaks_of_the_gpus_sites_run(name, precision, peak):
    assert flops.peak_tflops(name, precision)[0] == peak


def test_an_unknown_device_has_no_peak_and_says_so():
    assert flops.peak_tflops("cpu", "fp32") == (None, "CPU ranks")
    peak, why = flops.peak_tflops("NVIDIA GeForce RTX 4090", "bf16")
    assert peak is None and "not in the table" in why and "RTX 4090" in why


def test_a_runs_efficiency_from_its_admitted_flops():
    """Per step: FLOPs per sample x the global batch; TFLOP/s over the training's seconds;
    MFU per rank against the device's peak."""
    admitted = flops.admission_record({"model_flops": 8e9, "hardware_flops": 1e10}, 8, {})
    summary = {"global_batch": 64, "train_seconds": 2.0, "world_size": 4, "steps": 100,
               "device_name": "NVIDIA H100 80GB HBM3", "precision": "bf16"}  # fmt: skip
    record = flops.efficiency_record(admitted, summary)
    assert record["model_flops_per_step"] == 64e9 and record["hardware_flops_per_step"] == 80e9
    assert record["model_tflops"] == pytest.approx(64e9 * 100 / 2.0 / 1e12)
    assert record["model_tflops_per_rank"] == pytest.approx(record["model_tflops"] / 4)
    assert record["mfu"] == pytest.approx(record["model_tflops_per_rank"] / 989.4)
    epoch = flops.epoch_figures(admitted, 64, 50, 1.0, 4, "NVIDIA H100 80GB HBM3", "bf16")
    assert epoch["model_tflops"] == pytest.approx(3.2)
    assert epoch["mfu"] == pytest.approx(0.8 / 989.4)
    # nothing admitted (a job queued by an earlier ddpflow): said, not guessed
    assert flops.efficiency_record({}, summary) == {
        "counted": False,
        "why": "no FLOP count was admitted",
    }
    assert flops.epoch_figures({}, 64, 50, 1.0, 4, "cpu", "fp32") == {}


def test_a_gpu_runs_records_compare_its_tensors_and_show_mfu():
    """A GPU rank's peak is torch.cuda.max_memory_allocated (reserved beside it), compared
    with the estimate less the CUDA context; the report's row shows the MFU against the
    device's peak. (The records a GPU run writes, built here: no GPU on this machine.)"""
    from ddpflow.report.efficiency import efficiency_blocks, efficiency_fields

    gib = 2**30
    history = [
        {
            "ranks": [
                {
                    "rank": r,
                    "host": "g1",
                    "peak_rss_mib": 3000.0,
                    "gpu_peak_alloc_mib": 1024.0 * (r + 1),
                    "gpu_peak_reserved_mib": 4096.0,
                }
                for r in (0, 1)
            ]
        }  # fmt: skip
    ]
    admitted = flops.admission_record(
        {"model_flops": 1e12, "hardware_flops": 1e12}, 8, {"comparable_bytes": 2 * gib}
    )
    memory = flops.memory_record(admitted, history, {})
    assert memory["compared_with"] == "torch.cuda.max_memory_allocated"
    assert memory["peak_bytes"] == 2 * gib and memory["peak_rank"] == 1
    assert memory["difference"] == 0 and not memory["estimator_miss"]
    summary = {"global_batch": 64, "train_seconds": 10.0, "world_size": 2, "steps": 100,
               "device_name": "NVIDIA H100 80GB HBM3", "precision": "bf16"}  # fmt: skip
    train = {**summary, "efficiency": flops.efficiency_record(admitted, summary),
             "memory": memory}  # fmt: skip
    (_, _), (_, headers, (row,), _), *_ = efficiency_blocks([("run", [], {"train": train})])
    cells = dict(zip(headers, row, strict=True))
    assert cells["MFU"] == f"{train['efficiency']['mfu']:.1%}" and cells["MFU"] != "0.0%"
    assert cells["Ranks' peaks"] == "1.00–2.00 GB (2 ranks); reserved up to 4.00 GB"
    assert cells["Peak vs estimate"] == "+0.0% (rank 1)"
    assert efficiency_fields(train)["mfu"] == train["efficiency"]["mfu"]
