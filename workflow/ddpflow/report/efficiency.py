"""The report's efficiency section: each run's model FLOPs per step, achieved TFLOP/s per rank
and in all, MFU against its device's peak, and the memory estimate it was admitted with
beside its ranks' measured peaks (train_summary.json's "efficiency" and "memory", written by
ddpflow.monitoring.flops), with the estimator's misses named. Pure, like render.py.

    blocks = efficiency_blocks(loaded)   # [] where no run recorded either
    row.update(efficiency_fields(ev["train"]))   # summary.json's per-run keys
"""

from __future__ import annotations

from ddpflow.monitoring.flops import MISS

GIB = 2**30

_TEXT = (
    "Model FLOPs are one optimizer step's forward and backward arithmetic (a multiply-add is "
    "two), counted once per run by torch's FlopCounterMode on fake tensors; activation "
    "checkpointing's recomputation is the hardware's work, not the model's. TFLOP/s: model "
    "FLOPs over the training's seconds (validation left out). MFU: a rank's model TFLOP/s "
    "over its GPU's dense peak at the run's precision (none for CPU ranks or a GPU not in the "
    "table). The memory estimate is what the run was admitted with before it was queued, "
    "in the form the peak takes: a CPU rank's resident memory (library pages included), a "
    "GPU rank's tensors (torch.cuda.max_memory_allocated)."
)


def efficiency_fields(train: dict) -> dict:
    """summary.json's per-run keys: model_tflops (the whole job's), mfu (where a peak is
    known), memory_estimate_bytes and memory_peak_bytes (None where not recorded)."""
    efficiency, memory = train.get("efficiency") or {}, train.get("memory") or {}
    return {
        "model_tflops": efficiency.get("model_tflops"),
        "mfu": efficiency.get("mfu"),
        "memory_estimate_bytes": memory.get("estimate_bytes"),
        "memory_peak_bytes": memory.get("peak_bytes"),
    }


def efficiency_blocks(loaded) -> list[tuple]:
    """The section's blocks ([] where no run recorded its efficiency: runs trained before)."""
    recorded = [(name, ev["train"]) for name, _, ev in loaded if "efficiency" in ev["train"]]
    if not recorded:
        return []
    headers = ["Run", "Model FLOPs / step", "TFLOP/s per rank", "TFLOP/s total", "MFU"]
    headers += ["Memory estimate", "Ranks' peaks", "Peak vs estimate"]
    body = [[name, *_flops_cells(train), *_memory_cells(train)] for name, train in recorded]
    blocks = [("h3", "Efficiency"), ("table", headers, body, None), ("p", _TEXT)]
    misses = [_miss_line(name, train) for name, train in recorded if _missed(train)]
    if misses:
        blocks.append(("p", "Estimator misses: " + " ".join(misses)))
    return blocks


def _flops_cells(train: dict) -> list[str]:
    efficiency = train["efficiency"]
    if not efficiency.get("counted"):
        why = efficiency.get("why", "not counted")
        return [f"not counted ({why})", "–", "–", "–"]
    per_step = _flops(efficiency["model_flops_per_step"])
    if efficiency["hardware_flops_per_step"] != efficiency["model_flops_per_step"]:
        per_step += f" ({_flops(efficiency['hardware_flops_per_step'])} with recomputation)"
    mfu = efficiency.get("mfu")
    mfu_text = f"{mfu:.1%}" if mfu is not None else f"– ({efficiency.get('peak', 'no peak')})"
    rank, total = efficiency["model_tflops_per_rank"], efficiency["model_tflops"]
    return [per_step, f"{rank:.3g}", f"{total:.3g}", mfu_text]


def _memory_cells(train: dict) -> list[str]:
    memory = train.get("memory") or {}
    estimate, ranks = memory.get("estimate_bytes"), memory.get("ranks") or []
    key = "gpu_peak_bytes" if memory.get("compared_with", "").startswith("torch") else "peak_bytes"
    peaks = [r[key] for r in ranks if r.get(key)]
    shown = "–"
    if peaks:
        low, high = f"{min(peaks) / GIB:.2f}", f"{max(peaks) / GIB:.2f}"
        shown = f"{high} GB" if low == high else f"{low}–{high} GB"
        shown += f" ({len(peaks)} ranks)" if len(peaks) > 1 else ""
        reserved = [r["gpu_reserved_bytes"] for r in ranks if r.get("gpu_reserved_bytes")]
        if reserved:  # what the caching allocator held: the GPU's view of the peak
            shown += f"; reserved up to {max(reserved) / GIB:.2f} GB"
    if estimate is None:
        return ["not recorded", shown, "–"]
    difference = memory.get("difference")
    versus = "–" if difference is None else f"{difference:+.1%} (rank {memory['peak_rank']})"
    if _missed(train):
        versus += " ⚠ estimator miss"
    return [f"{estimate / GIB:.2f} GB", shown, versus]


def _missed(train: dict) -> bool:
    return bool((train.get("memory") or {}).get("estimator_miss"))


def _miss_line(name: str, train: dict) -> str:
    """Which run's estimate the peak outran, by how much, and the run's shape (so that the
    estimator's misses are found where they happen)."""
    memory = train["memory"]
    rank = next(r for r in memory["ranks"] if r["rank"] == memory["peak_rank"])
    parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in (memory.get("parts") or {}).items())
    shape = (
        f"world size {train.get('world_size')}, strategy {memory.get('strategy')}, "
        f"micro-batch {train.get('micro_batch')}, "
        f"{train.get('device_name', train.get('device'))}, {train.get('precision', 'fp32')}"
    )
    return (
        f"run {name!r}: rank {rank['rank']} on {rank.get('host', '?')} peaked at "
        f"{memory['peak_bytes'] / GIB:.2f} GB, {memory['difference']:.0%} above the estimate of "
        f"{memory['estimate_bytes'] / GIB:.2f} GB it was admitted with (more than {MISS:.0%}; "
        f"{shape}{'; estimate: ' + parts if parts else ''}): ddpflow's memory estimate "
        "(ddpflow.checks.memory) missed this shape."
    )


def _flops(value: float) -> str:
    """FLOPs with an SI prefix: '571 MFLOP', '2.75 GFLOP', '1.2 PFLOP'."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}FLOP"
    return f"{value:.3g} FLOP"
