"""The report's look inside each run: per-rank system use and stragglers (from the `ranks`
lists in train_metrics.jsonl), the profiler's top operators (results/runs/<run>/profile) and,
for Slurm runs, the cluster's own accounting (ddpflow.monitoring.efficiency). Reads files,
imports no torch; `blocks` turns the result into render.py's format-neutral blocks.

    found = collect(runs, loaded)          # {run: {"ranks", "stragglers", "top_ops", ...}}
    blocks(found)                          # [("h2", ...), ("table", ...), ...]
"""

from __future__ import annotations

import json
from pathlib import Path

from ddpflow.monitoring import efficiency
from ddpflow.monitoring.rankstats import combine_epochs, stragglers

PROFILE_TOP_OPS = Path("profile") / "top_ops-rank0.json"
DEFAULT_MARGIN = 0.25
_GPU_COLUMNS = (
    ("gpu_util_percent", ".0f"),
    ("gpu_mem_mib", ",.0f"),
    ("gpu_power_w", ".0f"),
    ("gpu_temp_c", ".0f"),
)


def _train_config(ev: dict) -> dict:
    train = ev["provenance"]["config"].get("train")
    return train if isinstance(train, dict) else {}


def collect(runs: list[dict], loaded) -> dict[str, dict]:
    files = {str(run["name"]): run for run in runs}
    found = {name: entry(files[name], epochs, ev) for name, epochs, ev in loaded}
    _add_efficiency(loaded, found)
    return found


def entry(run: dict, epochs: list[dict], ev: dict) -> dict:
    """One run's ranks, stragglers and profile (collect's, without the cluster's accounting)."""
    train = _train_config(ev)
    margin = (train.get("monitor") or {}).get("straggler_margin", DEFAULT_MARGIN)
    ranks = combine_epochs([e.get("ranks") for e in epochs])
    found = {"margin": margin, "ranks": ranks, "stragglers": stragglers(ranks, margin)}
    profile = train.get("profile") or {}
    if profile.get("enabled"):
        path = Path(run["train_metrics"]).parent / PROFILE_TOP_OPS
        try:
            found["top_ops"] = json.loads(path.read_text())
        except (OSError, ValueError):
            found["top_ops"] = None  # the run ended before its profiled steps
        found["profile"] = {k: profile.get(k) for k in ("wait", "warmup", "active", "ranks")}
        found["profile_dir"] = str(path.parent)
    return found


def _add_efficiency(loaded, found: dict[str, dict]) -> None:
    """The Slurm jobs of each run (training; evaluation when it had a job of its own), with
    sacct's figures: one sacct call for all of them."""
    jobs = {}
    for name, _, ev in loaded:
        stages = [("train", ev["train"].get("slurm_job_id"))]
        if ev.get("evaluated_by") == "evaluate job":
            stages.append(("evaluate", ev.get("slurm_job_id")))
        # a job id as sacct knows it; anything else a writer left is no job to look up
        jobs[name] = [(stage, str(job)) for stage, job in stages if _job_id(job)]
    figures = efficiency.job_efficiency([job for pairs in jobs.values() for _, job in pairs])
    for name, pairs in jobs.items():
        if pairs:
            found[name]["slurm_jobs"] = [
                {"stage": stage, "job_id": job, **figures.get(job, {})} for stage, job in pairs
            ]


def _job_id(job) -> bool:
    return bool(job) and isinstance(job, str | int) and not isinstance(job, bool)


def _cell(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _rank_table(entry: dict) -> tuple:
    ranks, flagged = entry["ranks"], {f["rank"]: f["reason"] for f in entry["stragglers"]}
    gpu = any("gpu_util_percent" in r or "gpu_mem_mib" in r for r in ranks)
    least = min(r["compute_s"] for r in ranks)
    headers = ["Rank", "Host", "Samples/s", "Own work", "Waited", "CPU %", "Peak RSS MiB"]
    if gpu:
        headers += ["GPU util %", "GPU mem MiB", "Power W", "Temp °C"]
    headers.append("Straggler")
    body = []
    for r in ranks:
        waited = r["compute_s"] - least
        rate = f"{r.get('samples_per_s', 0):.1f}"
        work = [f"{r['train_s'] - waited:.2f} s", f"{waited:.2f} s"]
        use = [_cell(r.get("cpu_percent"), ".0f"), _cell(r.get("rss_mib"), ",.0f")]
        cells = [str(r["rank"]), str(r["host"]), rate, *work, *use]
        if gpu:
            cells += [_cell(r.get(key), fmt) for key, fmt in _GPU_COLUMNS]
        cells.append(f"yes: {flagged[r['rank']]}" if r["rank"] in flagged else "no")
        body.append(cells)
    return ("table", headers, body, None)


def _top_ops_table(top: dict) -> tuple:
    device = top["sorted_by"] == "self_device_time_total"
    total = top["total_ms"] or 1.0
    headers = ["Operator", "Calls", "Self CPU ms", "CPU total ms"]
    headers += ["Self device ms"] if device else []
    headers.append("Share of self time")
    body = []
    for op in top["ops"]:
        own = op["self_device_ms"] if device else op["self_cpu_ms"]
        cells = [op["name"], str(op["calls"]), f"{op['self_cpu_ms']:.2f}"]
        cells.append(f"{op['cpu_total_ms']:.2f}")
        cells += [f"{op['self_device_ms']:.2f}"] if device else []
        body.append([*cells, f"{own / total:.1%}"])
    return ("table", headers, body, None)


def blocks(found: dict[str, dict]) -> list[tuple]:
    out = []
    measured = {name: e for name, e in found.items() if e["ranks"]}
    if measured:
        out += [("h2", "Ranks: system use and stragglers"), ("p", _RANKS)]
        for name, entry in measured.items():
            out += [("h3", name), _rank_table(entry), ("p", _verdict(entry))]
    out += _efficiency_blocks(found)
    profiled = {name: e for name, e in found.items() if "top_ops" in e}
    if profiled:
        out.append(("h2", "Profile: top operators by self time (rank 0)"))
        for name, entry in profiled.items():
            p, top = entry["profile"], entry["top_ops"]
            first = p["wait"] + p["warmup"] + 1
            last = first + p["active"] - 1
            steps = f"optimizer steps {first}–{last} of the last training attempt"
            trace = f"trace (ui.perfetto.dev, chrome://tracing) in {entry['profile_dir']}"
            where = f"{name}: torch.profiler over {steps}; {trace}"
            if top is None:
                out.append(("p", f"{name}: {_NO_PROFILE}"))
                continue
            out += [("p", where), _top_ops_table(top)]
    return out


def _verdict(entry: dict) -> str:
    """The run's stragglers and why, or that it had none."""
    flagged = [
        f"rank {f['rank']} on {f['host']} is a straggler ({f['reason']})"
        for f in entry["stragglers"]
    ]
    return "; ".join(flagged) or f"No straggler (margin {entry['margin']:.0%})."


_RANKS = (
    "Per rank, over all epochs: training samples per second, its own work (epoch time less the "
    "time it waited for the slowest rank inside the gradient all-reduce, estimated against the "
    "rank that waited least), mean CPU use (100 = one core), peak resident memory and, on GPUs, "
    "NVML's mean utilisation and power, peak memory and temperature. A straggler is a rank whose "
    "own work exceeds the other ranks' median by more than train.monitor.straggler_margin (or, "
    "on GPUs, whose utilisation lags by as much); the others wait for it at every step. The "
    "samples over time are in results/runs/<run>/system/rank-<r>.jsonl."
)
_NO_PROFILE = (
    "profiling was on, but no profile was written (the run ended before its profiled steps: "
    "lower train.profile.wait and warmup)."
)


def _duration(seconds) -> str:
    if seconds is None:
        return "?"
    minutes, sec = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{sec:02d}"


def _efficiency_blocks(found: dict[str, dict]) -> list[tuple]:
    rows = []
    for name, entry in found.items():
        for job in entry.get("slurm_jobs", []):
            job_of = [name, job["stage"], job["job_id"]]
            if "state" not in job:
                rows.append([*job_of, "not in sacct", *["?"] * 5])
                continue
            rows.append([*job_of, job["state"], *_job_use(job)])
    if not rows:
        return []
    headers = ["Run", "Job of", "Slurm job", "State", "Nodes", "Elapsed", "CPU efficiency"]
    headers += ["Peak memory per node", "Suggestion"]
    table = ("table", headers, rows, None)
    return [("h2", "Cluster efficiency (Slurm)"), ("p", _ACCOUNTING), table]


def _job_use(job: dict) -> list[str]:
    """An accounted job's nodes, elapsed time (of its limit), CPU and memory use, advice."""
    limit = f" of {_duration(job['limit_s'])}" if job["limit_s"] else ""
    used = f" ({job['time_used']:.0%})" if job["time_used"] is not None else ""
    memory = "not gathered"
    if job["mem_used_mib"] is not None:
        asked = job["mem_asked_mib"]
        of = f" of {asked:,.0f} MiB ({job['mem_efficiency']:.0%})" if asked else ""
        memory = f"{job['mem_used_mib']:,.0f} MiB{of}"
    efficiency = job["cpu_efficiency"]
    cpu = "not gathered" if efficiency is None else f"{efficiency:.0%}"
    nodes = f"{job['nodes']}: {job['node_list']}"
    elapsed = _duration(job["elapsed_s"]) + limit + used
    return [nodes, elapsed, cpu, memory, "; ".join(job["advice"]) or "–"]


_ACCOUNTING = (
    "From the cluster's accounting (sacct) at report time, as seff shows it: elapsed time of "
    "the time limit, CPU efficiency (CPU time used / (elapsed x CPUs allocated)), peak memory "
    "(largest task's MaxRSS x tasks per node) of the memory asked per node, and what to change "
    "in config.yaml when a request is far above use. CPU time and memory need job accounting "
    "gathering on the cluster (JobAcctGatherType); without it they read 'not gathered'."
)
