"""Cluster efficiency of a run's Slurm jobs, from the cluster's own accounting (`sacct`), as
`seff` reports it: elapsed time against the time limit, CPU efficiency (CPU time used over
the CPU time allocated), peak resident memory against the memory asked for, state and nodes,
and what to change in config.yaml when a request is far from what was used.

    rows = job_efficiency(["412", "413"])   # {job id: {...}}; {} when sacct is missing

Needs accounting with job accounting gathering (JobAcctGatherType=jobacct_gather/linux or
cgroup); without it CPU time and memory are unknown, and the rows say so.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import time

log = logging.getLogger(__name__)

FIELDS = (
    "JobID",
    "JobName",
    "State",
    "ElapsedRaw",
    "TimelimitRaw",
    "TotalCPU",
    "AllocCPUS",
    "MaxRSS",
    "ReqMem",
    "NodeList",
    "NNodes",
    "NTasks",
)
# a job in one of these may still gain CPU time and memory in the accounting
UNSETTLED = ("PENDING", "RUNNING", "REQUEUED", "SUSPENDED", "COMPLETING", "CONFIGURING")
# a request this far above use earns a suggestion (seff's rule of thumb)
WASTE = 0.25
_UNITS = {"K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0**2}


def cpu_seconds(text: str) -> float | None:
    """sacct's TotalCPU: [D-][HH:]MM:SS[.mmm] -> seconds."""
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+(?:\.\d+)?)", text.strip())
    if not match:
        return None
    days, hours, minutes, seconds = match.groups()
    return ((int(days or 0) * 24 + int(hours or 0)) * 60 + int(minutes)) * 60 + float(seconds)


def mebibytes(text: str) -> float | None:
    """sacct's MaxRSS / ReqMem ('123456K', '1000M', '4G', '0', '1000Mn', '500Mc'): MiB."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)[nc]?", text.strip())
    if not match:
        return None
    value, unit = match.groups()
    return float(value) * _UNITS[unit or "K"]  # sacct's unit when none is printed: K


def parse(text: str) -> dict[str, dict]:
    """`sacct --parsable2 --noheader --format=<FIELDS>` output -> per job: the job's line
    (state, times, CPUs, request, nodes) and the largest per-task MaxRSS of its steps."""
    jobs: dict[str, dict] = {}
    for line in text.splitlines():
        cells = line.split("|")
        if len(cells) != len(FIELDS):
            continue
        row = dict(zip(FIELDS, cells, strict=True))
        job, _, step = row["JobID"].partition(".")
        entry = jobs.setdefault(job, {"job_id": job, "max_rss_mib": None, "tasks_per_node": 1})
        rss = mebibytes(row["MaxRSS"]) if row["MaxRSS"] else None
        if step:
            if rss is not None and (entry["max_rss_mib"] or 0) < rss:
                entry["max_rss_mib"] = rss
                tasks, nodes = int(row["NTasks"] or 1), int(row["NNodes"] or 1)
                entry["tasks_per_node"] = max(1, round(tasks / max(nodes, 1)))
            continue
        entry.update(
            name=row["JobName"],
            state=row["State"].split()[0] if row["State"] else "?",
            elapsed_s=int(row["ElapsedRaw"] or 0),
            limit_s=int(row["TimelimitRaw"]) * 60 if row["TimelimitRaw"].isdigit() else None,
            cpu_s=cpu_seconds(row["TotalCPU"]),
            cpus=int(row["AllocCPUS"] or 0),
            nodes=int(row["NNodes"] or 1),
            node_list=row["NodeList"],
            req_mem_mib=mebibytes(row["ReqMem"]) if row["ReqMem"] else None,
            # Slurm >= 21.08: the job's total; before: a suffix n (per node) or c (per CPU)
            req_mem_per=row["ReqMem"][-1:] if row["ReqMem"][-1:] in ("n", "c") else "job",
        )
    return {job: _derive(e) for job, e in jobs.items() if "state" in e}


def _derive(e: dict) -> dict:
    """Efficiencies and seff-like advice (config keys named) from a parsed job."""
    alloc = e["elapsed_s"] * e["cpus"]
    e["cpu_efficiency"] = e["cpu_s"] / alloc if alloc and e["cpu_s"] is not None else None
    e["time_used"] = e["elapsed_s"] / e["limit_s"] if e["limit_s"] else None
    per_node, nodes = e["req_mem_mib"], max(e["nodes"], 1)
    if per_node is not None and e["req_mem_per"] != "n":
        per_node *= (e["cpus"] if e["req_mem_per"] == "c" else 1) / nodes
    used = e["max_rss_mib"] * e["tasks_per_node"] if e["max_rss_mib"] is not None else None
    e["mem_used_mib"], e["mem_asked_mib"] = used, per_node
    e["mem_efficiency"] = used / per_node if used is not None and per_node else None
    e["advice"] = [*_time_advice(e), *_memory_advice(e), *_cpu_advice(e)]
    return e


def _time_advice(e: dict) -> list[str]:
    if e["state"] == "TIMEOUT":
        return ["the job hit its time limit: raise machine.time_min"]
    used = e["time_used"]
    if used is None or used >= WASTE or e["limit_s"] <= 600:
        return []
    minutes = max(10, round(e["elapsed_s"] / 60 * 2))
    twice = f"machine.time_min: {minutes} would still leave twice the time"
    return [f"used {used:.0%} of its time limit: {twice} (a shorter limit often starts sooner)"]


def _memory_advice(e: dict) -> list[str]:
    if e["state"] == "OUT_OF_MEMORY":
        return ["the job ran out of memory: raise machine.mem_gb"]
    efficiency, used = e["mem_efficiency"], e["mem_used_mib"]
    if efficiency is None or efficiency >= WASTE or used is None:
        return []
    gb = max(1, -(-used * 2 // 1024))
    twice = f"machine.mem_gb: {gb:.0f} would still leave twice the peak"
    return [f"used {efficiency:.0%} of the memory asked for: {twice}"]


def _cpu_advice(e: dict) -> list[str]:
    efficiency = e["cpu_efficiency"]
    if efficiency is None or efficiency >= WASTE or e["elapsed_s"] < 60:
        return []
    fewer = "fewer machine.cpus_per_task would do (on GPUs low CPU use is normal)"
    return [f"CPU efficiency {efficiency:.0%}: {fewer}"]


def job_efficiency(job_ids: list[str], settle_s: float = 20.0) -> dict[str, dict]:
    """sacct's view of these jobs; waits up to settle_s for the accounting to show every job
    in a final state (it lags squeue by seconds). {} without sacct or on its failure."""
    ids = sorted({str(j) for j in job_ids if j})
    if not ids:
        return {}
    if shutil.which("sacct") is None:
        log.warning("cluster efficiency: sacct not found; section left out")
        return {}
    deadline = time.monotonic() + settle_s
    columns = f"--format={','.join(FIELDS)}"
    command = ["sacct", "-j", ",".join(ids), "--parsable2", "--noheader", columns]
    while True:
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)
        except (OSError, subprocess.SubprocessError) as err:
            log.warning("cluster efficiency: sacct failed (%s); section left out", err)
            return {}
        jobs = parse(out.stdout)
        unsettled = [j for j in ids if j not in jobs or jobs[j]["state"] in UNSETTLED]
        if not unsettled or time.monotonic() > deadline:
            for job in unsettled:
                log.warning("cluster efficiency: job %s is not final in sacct yet", job)
            return jobs
        time.sleep(1.0)
