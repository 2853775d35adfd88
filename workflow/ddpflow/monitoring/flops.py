"""A run's arithmetic against its hardware's, and its memory against the estimate it was
admitted with: what train_summary.json's "efficiency" and "memory" hold, the per-epoch
TFLOP/s, and the table of the GPUs' peaks. No torch: the login node writes what the run was
admitted with (admission_record, into the work folder's admitted.json), rank 0 reads it.

The FLOPs are counted once per run, on the login node, on fake tensors
(ddpflow.training.footprint.count_flops: one micro-batch's forward and backward); per step
they are that per sample times the global batch (every layer's arithmetic grows with the
batch). Model FLOPs leave out what activation checkpointing recomputes (hardware FLOPs
count it). MFU, model FLOP/s utilisation, is a rank's model FLOP/s over its device's dense
peak at the run's precision (fp32 is not TF32: ddpflow leaves TF32 off); a device not in
PEAKS has none and says so.

    record = efficiency_record(admitted, summary, history)   # train_summary["efficiency"]
    peak_tflops("NVIDIA H100 80GB HBM3", "bf16")               # (989.4, 'H100 SXM, bf16 dense')
"""

from __future__ import annotations

import json
from pathlib import Path

from ddpflow.runtime import device_name

ADMITTED = "admitted.json"  # in the run's work folder: what the train rule admitted the run with
MISS = 0.25  # a peak this far above the estimate flags the estimator's miss (report)
TERA = 1e12

# dense peak TFLOP/s (no structured sparsity) by precision, from the vendors' datasheets:
# (what the device name contains, the device, {precision: TFLOP/s}), the first match wins
PEAKS: tuple[tuple[str, str, dict[str, float]], ...] = (
    ("H200 NVL", "H200 NVL", {"fp32": 60.0, "bf16": 835.0, "fp16": 835.0}),
    ("H200", "H200 SXM", {"fp32": 66.9, "bf16": 989.4, "fp16": 989.4}),
    ("GH200", "GH200", {"fp32": 66.9, "bf16": 989.4, "fp16": 989.4}),
    ("H100 NVL", "H100 NVL", {"fp32": 60.0, "bf16": 835.0, "fp16": 835.0}),
    ("H100 PCIe", "H100 PCIe", {"fp32": 51.2, "bf16": 756.5, "fp16": 756.5}),
    ("H100", "H100 SXM", {"fp32": 66.9, "bf16": 989.4, "fp16": 989.4}),
    ("A100", "A100", {"fp32": 19.5, "bf16": 312.0, "fp16": 312.0}),
    ("L40S", "L40S", {"fp32": 91.6, "bf16": 362.05, "fp16": 362.05}),
    ("MI250X", "MI250X", {"fp32": 95.7, "bf16": 383.0, "fp16": 383.0}),
    ("MI300X", "MI300X", {"fp32": 163.4, "bf16": 1307.4, "fp16": 1307.4}),
)


def peak_tflops(device_name: str, precision: str) -> tuple[float | None, str]:
    """(the device's dense peak TFLOP/s at precision, what it is), or (None, why not)."""
    if device_name == "cpu" or not device_name:
        return None, "CPU ranks"
    for pattern, device, peaks in PEAKS:
        if pattern.lower() in device_name.lower():
            return peaks[precision], f"{device}, {precision} dense"
    return None, f"{device_name}: not in the table of peaks (ddpflow.monitoring.flops.PEAKS)"


def gpt_formula_flops(parameters: int, n_layer: int, n_embd: int, block_size: int) -> int:
    """A gpt's training FLOPs per token by the formula of the PaLM paper's appendix (and
    nanoGPT's MFU): 6N + 12 L H Q T, N its parameters less the position embedding, causal
    attention counted whole; what count_flops counts, to within its layer norms' share."""
    return 6 * parameters + 12 * n_layer * n_embd * block_size


def admission_record(figures: dict, micro_batch: int, memory: dict) -> dict:
    """admitted.json's content: the FLOPs per sample (footprint's, at micro_batch) and the
    memory estimate the run was admitted with (memory: checks.admission's)."""
    record: dict = {"memory": memory}
    if figures.get("model_flops"):
        record["flops"] = {
            "model_per_sample": figures["model_flops"] / micro_batch,
            "hardware_per_sample": figures["hardware_flops"] / micro_batch,
            "counted_at_micro_batch": micro_batch,
        }
    return record


def read_admitted(work: str | Path) -> dict:
    """The work folder's admitted.json ({} where the run was admitted without one)."""
    try:
        return json.loads((Path(work) / ADMITTED).read_text())
    except (OSError, ValueError):
        return {}


def step_flops(admitted: dict, global_batch: int) -> tuple[float, float] | None:
    """(model, hardware) FLOPs of one optimizer step of the whole job, or None uncounted."""
    flops = admitted.get("flops")
    if not flops:
        return None
    return flops["model_per_sample"] * global_batch, flops["hardware_per_sample"] * global_batch


def epoch_figures(
    admitted: dict,
    global_batch: int,
    steps: int,
    seconds: float,
    ranks: int,
    name: str,
    precision: str,
) -> dict:
    """An epoch record's achieved model TFLOP/s (the whole job's, over the steps trained in
    seconds) and, where the device's peak is known, MFU; {} where no FLOPs were counted."""
    per_step = step_flops(admitted, global_batch)
    if per_step is None or not seconds or not steps:
        return {}
    total = per_step[0] * steps / seconds / TERA
    figures = {"model_tflops": total}
    peak, _ = peak_tflops(name, precision)
    if peak:
        figures["mfu"] = total / ranks / peak
    return figures


def loop_epoch_figures(loop, steps: int, seconds: float) -> dict:
    """epoch_figures of a training Loop's epoch (its admitted record, batch, ranks, device and
    precision as it trains: autocast off is fp32)."""
    if not loop.admitted:
        return {}
    precision = loop.tcfg.precision if loop.autocast else "fp32"
    batch, ranks, name = loop.tcfg.global_batch_size, loop.env.processes, device_name(loop.device)
    return epoch_figures(loop.admitted, batch, steps, seconds, ranks, name, precision)


def efficiency_record(admitted: dict, summary: dict) -> dict:
    """train_summary.json's "efficiency": FLOPs per step, achieved TFLOP/s per rank and in
    all over the training's seconds (validation left out), the device's peak and MFU."""
    per_step = step_flops(admitted, summary["global_batch"])
    if per_step is None:
        return {"counted": False, "why": admitted.get("why", "no FLOP count was admitted")}
    model, hardware = per_step
    seconds, ranks, steps = summary["train_seconds"], summary["world_size"], summary["steps"]
    total = model * steps / seconds / TERA if seconds else 0.0
    peak, peak_text = peak_tflops(summary["device_name"], summary["precision"])
    record = {
        "counted": True,
        "model_flops_per_step": model,
        "hardware_flops_per_step": hardware,
        "model_tflops": total,
        "model_tflops_per_rank": total / ranks,
        "hardware_tflops": hardware * steps / seconds / TERA if seconds else 0.0,
        "peak_tflops": peak,
        "peak": peak_text,
    }
    if peak:
        record["mfu"] = total / ranks / peak
    formula = admitted["flops"].get("formula_per_sample")  # the gpt's 6N + 12LHQT
    if formula:
        record["formula_flops_per_step"] = formula * summary["global_batch"]
    return record


def memory_record(admitted: dict, history: list[dict], own: dict) -> dict:
    """train_summary.json's "memory": the estimate the run was admitted with, in the form a
    rank's peak takes (a CPU rank's resident memory counts the library pages; a GPU rank's
    peak is its tensors', without the CUDA context), each rank's measured peak over the
    epochs (own: rank 0's at the end, where the epochs recorded none) and the difference."""
    estimate = admitted.get("memory") or {}
    ranks: dict[int, dict] = {}
    for record in history:
        for entry in record.get("ranks") or []:
            seen = ranks.setdefault(entry["rank"], {"rank": entry["rank"], "host": entry["host"]})
            for key, value in _peaks(entry).items():
                seen[key] = max(seen.get(key, 0), value)
    if not ranks:
        ranks[0] = {"rank": 0, "host": own.get("host", "?"), **_peaks(own)}
    gpu = any("gpu_peak_bytes" in r for r in ranks.values())
    key = "gpu_peak_bytes" if gpu else "peak_bytes"
    largest = max(ranks.values(), key=lambda r: r.get(key, 0))
    record = {
        "estimate_bytes": estimate.get("comparable_bytes"),
        "admitted_bytes": estimate.get("total_bytes"),
        "compared_with": "torch.cuda.max_memory_allocated" if gpu else "peak resident memory",
        "peak_bytes": largest.get(key),
        "peak_rank": largest["rank"],
        "ranks": [ranks[r] for r in sorted(ranks)],
        "parts": estimate.get("parts"),  # the estimate's, by part (checks.memory.Estimate)
        "strategy": estimate.get("strategy"),
    }
    if record["estimate_bytes"] and record["peak_bytes"]:
        record["difference"] = record["peak_bytes"] / record["estimate_bytes"] - 1
        record["estimator_miss"] = record["difference"] > MISS
    return record


def _peaks(entry: dict) -> dict[str, int]:
    """A rank's peaks in bytes, from an epoch record's MiB figures (runtime.peak_memory_mib)."""
    names = {
        "peak_rss_mib": "peak_bytes",
        "gpu_peak_alloc_mib": "gpu_peak_bytes",
        "gpu_peak_reserved_mib": "gpu_reserved_bytes",
    }
    return {names[k]: int(entry[k] * 2**20) for k in names if entry.get(k) is not None}
