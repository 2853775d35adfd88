"""Per-rank figures of a run and the stragglers among the ranks: pure functions over the
`ranks` lists that ddpflow.monitoring.sampler adds to each epoch record (no torch: the
report imports this).

    flagged = stragglers(combine_epochs([r.get("ranks") for r in records]), margin=0.25)
"""

from __future__ import annotations

import statistics

# below this much excess time per epoch a rank is never called a straggler (timer noise)
STRAGGLER_FLOOR_S = 0.05
# figures averaged when samples or epochs are combined (the rest: their maximum)
MEAN_KEYS = ("cpu_percent", "gpu_util_percent", "gpu_power_w", "samples_per_s")


def rank_summary(record: dict, system: dict, rank: int, host: str) -> dict:
    """One rank's epoch: its times (the epoch's training time and the forward + backward
    time, which includes the wait for the slowest rank inside DDP's all-reduce) and system
    figures."""
    seconds = record["seconds"]
    return {
        "rank": rank,
        "host": host,
        "train_s": seconds["train"],
        "compute_s": seconds["forward"] + seconds["backward_sync"],
        # this rank's own samples (an epoch record's "samples" counts every rank's)
        "samples_per_s": record["rank_samples"] / seconds["train"] if seconds["train"] else 0.0,
        **{k: round(v, 3) for k, v in system.items()},
    }


# the figures of a rank_summary, in the order they are packed into one float64 tensor for
# the epoch's all_gather (rank and host are known to every rank: not sent)
SUMMARY_FIGURES = (
    "train_s",
    "compute_s",
    "samples_per_s",
    "cpu_percent",
    "rss_mib",
    "gpu_util_percent",
    "gpu_mem_mib",
    "gpu_power_w",
    "gpu_temp_c",
    "peak_rss_mib",
    "gpu_peak_alloc_mib",
    "gpu_peak_reserved_mib",
)


def pack_summary(summary: dict) -> list[float]:
    """A rank_summary's figures as floats in SUMMARY_FIGURES order (NaN: not measured)."""
    return [float(summary.get(key, float("nan"))) for key in SUMMARY_FIGURES]


def unpack_summary(values: list[float], rank: int, host: str) -> dict:
    """pack_summary's inverse (figures that were not measured are left out)."""
    figures = {k: v for k, v in zip(SUMMARY_FIGURES, values, strict=True) if v == v}
    return {"rank": rank, "host": host, **figures}


def combine_epochs(epochs: list[list[dict] | None]) -> list[dict]:
    """Per-rank totals over epochs (times summed, system figures averaged or maximised), for
    the report's table; epochs without per-rank data are skipped."""
    by_rank: dict[int, list[dict]] = {}
    for ranks in epochs:
        for entry in ranks or []:
            by_rank.setdefault(entry["rank"], []).append(entry)
    out = []
    for rank, entries in sorted(by_rank.items()):
        row = {"rank": rank, "host": entries[-1]["host"]}
        for key in ("train_s", "compute_s"):
            row[key] = sum(e[key] for e in entries)
        for key in {k for e in entries for k in e} - {"rank", "host", "train_s", "compute_s"}:
            values = [e[key] for e in entries if key in e]
            row[key] = statistics.fmean(values) if key in MEAN_KEYS else max(values)
        out.append(row)
    return out


def stragglers(ranks: list[dict], margin: float) -> list[dict]:
    """The ranks that hold the others up, each with why.

    In synchronous data-parallel training every rank's epoch takes as long as the slowest
    rank's, so the epoch time itself shows nothing: the others wait for the slow one inside
    the gradient all-reduce (in their forward + backward time). A rank's wait is estimated as
    its forward + backward time less the smallest of any rank (the rank that waited least
    waited ~0), its own work as its epoch time less that wait; a rank whose own work exceeds
    the other ranks' median by more than `margin` (and STRAGGLER_FLOOR_S) is flagged. On GPUs
    a rank whose utilisation is below the others' median by more than `margin` is flagged too
    (a rank that waits in NCCL shows busy, one starved of data does not)."""
    if len(ranks) < 2:
        return []
    least = min(r["compute_s"] for r in ranks)
    own = {r["rank"]: r["train_s"] - (r["compute_s"] - least) for r in ranks}
    flagged = []
    for r in ranks:
        others = [own[o["rank"]] for o in ranks if o["rank"] != r["rank"]]
        typical = statistics.median(others)
        excess = own[r["rank"]] - typical
        if excess > margin * typical and excess > STRAGGLER_FLOOR_S:
            why = f"own work {own[r['rank']]:.2f} s vs the others' {typical:.2f} s"
            flagged.append({"rank": r["rank"], "host": r["host"], "reason": why})
            continue
        reported = [o.get("gpu_util_percent") for o in ranks if o["rank"] != r["rank"]]
        utils = [u for u in reported if u is not None]
        mine = r.get("gpu_util_percent")
        if mine is not None and utils and len(utils) == len(reported):
            typical_util = statistics.median(utils)
            if typical_util >= 10 and mine < (1 - margin) * typical_util:
                why = f"GPU utilisation {mine:.0f}% vs the others' {typical_util:.0f}%"
                flagged.append({"rank": r["rank"], "host": r["host"], "reason": why})
    return flagged
