"""Pure parsers of Slurm client text: `scontrol --all --oneliner show partition|node`,
`sacctmgr -nP show assoc|event` and `sacct -D -X -P` output -> frozen dataclasses.

Kept apart from slurm_query.py (which runs the commands) and ddpflow.checks.slurm (which
checks runs against the result) so that they can be unit-tested on captured output
(tests/golden/slurm/) with no cluster. A time limit is read as the config reads one
(ddpflow.config.schema.parse_slurm_time).

    from ddpflow.cluster.slurm_parse import parse_partitions, parse_slurm_time
    parse_slurm_time("1-12:00:00")   # 129600; None for UNLIMITED
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ddpflow.cluster.distenv import expand_nodelist
from ddpflow.config.schema import NO_LIMIT, parse_slurm_time

__all__ = [
    "Association",
    "JobInstance",
    "Node",
    "NodeEvent",
    "Partition",
    "parse_associations",
    "parse_gpu_count",
    "parse_job_instances",
    "parse_node_events",
    "parse_nodes",
    "parse_oneliner",
    "parse_partitions",
    "parse_slurm_time",
]

# node state flags (scontrol's State=A+B, sinfo's trailing *) under which no job starts there
UNHEALTHY_STATES = {"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "NOT_RESPONDING",
                    "INVAL"}  # fmt: skip
# A key starts a record field only after whitespace: values may hold spaces (OS=Linux 6.1 #1
# SMP, Reason=Not responding) and '=' (TRES=cpu=8,mem=16000M), so a value runs to the next key.
FIELD_KEY = re.compile(r"(?:^|\s)([A-Za-z]\w*)=")


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    max_time: str  # as scontrol prints it, for messages
    max_nodes: int | None  # None: UNLIMITED
    max_mem_per_node_mb: int | None
    node_names: tuple[str, ...]


@dataclass(frozen=True)
class Node:
    name: str
    partitions: tuple[str, ...]
    cpus: int
    memory_mb: int
    gpus: int
    gres: str
    state: str = ""  # DOWN+NOT_RESPONDING, IDLE+DRAIN, MIXED, ...
    reason: str = ""  # why an admin or Slurm took it out ("" if none)

    @property
    def unhealthy(self) -> bool:
        """Down, drained or draining, failing, not responding: no new job starts on it."""
        return bool(set(self.state.upper().replace("*", "+NOT_RESPONDING").split("+"))
                    & UNHEALTHY_STATES)  # fmt: skip


@dataclass(frozen=True)
class JobInstance:
    """One run of a job in `sacct -D -X` (a requeued job has one line per run)."""

    job_id: str
    state: str  # NODE_FAIL, REQUEUED, RUNNING, ... ("CANCELLED by 0" -> CANCELLED)
    nodes: tuple[str, ...]
    start: str
    end: str


@dataclass(frozen=True)
class NodeEvent:
    """A node state change in `sacctmgr show event` (slurmdbd keeps them after the node is
    back: what names the node of a NODE_FAIL that returned to service at once)."""

    node: str
    start: str
    end: str
    state: str
    reason: str


@dataclass(frozen=True)
class Association:
    account: str
    partition: str  # "" = every partition
    qos: tuple[str, ...]


def parse_oneliner(text: str) -> list[dict[str, str]]:
    """`scontrol --oneliner show ...` output -> one {key: value} dict per record (line)."""
    records = []
    for line in text.splitlines():
        keys = list(FIELD_KEY.finditer(line))
        if keys:
            ends = [m.start() for m in keys[1:]] + [len(line)]
            records.append(
                {m.group(1): line[m.end() : end].strip() for m, end in zip(keys, ends, strict=True)}
            )
    return records


def parse_gpu_count(gres: str) -> int:
    """GPUs in a node's Gres: 'gpu:2', 'gpu:a100:8', 'gpu:a100:4(S:0-1)', 'gpu:a100' (one).
    Several GPU types are summed: --gpus-per-node without a type takes any of them."""
    total = 0
    # socket bindings like (S:0-1) or (S:0,2) are not counts and may contain commas
    for item in re.sub(r"\([^)]*\)", "", gres).split(","):
        fields = item.strip().split(":")
        if fields[0] != "gpu":
            continue  # (null), shard:8, mps:100, ...
        count = re.fullmatch(r"(\d+)([KMG]?)", fields[-1]) if len(fields) > 1 else None
        if count is None:
            total += 1  # 'gpu' or 'gpu:a100': a count of one
        else:
            total += int(count.group(1)) * 1024 ** " KMG".index(count.group(2) or " ")
    return total


def _limit(value: str | None) -> int | None:
    """An integer limit from scontrol; None when unlimited or absent."""
    if not value or value.upper() in NO_LIMIT or not value.isdigit():
        return None
    return int(value)


def parse_partitions(text: str) -> dict[str, Partition]:
    partitions = {}
    for rec in parse_oneliner(text):
        if "PartitionName" not in rec:
            continue
        nodes = rec.get("Nodes", "")
        partitions[rec["PartitionName"]] = Partition(
            name=rec["PartitionName"],
            default=rec.get("Default", "NO").upper() == "YES",
            max_time=rec.get("MaxTime", "UNLIMITED"),
            max_nodes=_limit(rec.get("MaxNodes")),
            max_mem_per_node_mb=_limit(rec.get("MaxMemPerNode")),
            node_names=tuple(expand_nodelist(nodes)) if nodes not in ("", "(null)") else (),
        )
    return partitions


def parse_nodes(text: str) -> tuple[Node, ...]:
    nodes = []
    for rec in parse_oneliner(text):
        if "NodeName" not in rec:
            continue
        # CPUEfctv (Slurm >= 22.05) leaves out cores reserved by CoreSpecCount; MemSpecLimit is
        # memory reserved for the system: neither can be given to a job.
        cpus = int(rec.get("CPUEfctv") or rec.get("CPUTot") or 0)
        memory = int(rec.get("RealMemory") or 0) - int(_limit(rec.get("MemSpecLimit")) or 0)
        partitions = rec.get("Partitions", "")
        nodes.append(
            Node(
                name=rec["NodeName"],
                partitions=tuple(p for p in partitions.split(",") if p),
                cpus=cpus,
                memory_mb=memory,
                gpus=parse_gpu_count(rec.get("Gres", "")),
                gres=rec.get("Gres", "(null)"),
                state=rec.get("State", ""),
                reason=_reason(rec.get("Reason", "")),
            )
        )
    return tuple(nodes)


def parse_associations(text: str) -> tuple[Association, ...]:
    """`sacctmgr -nP show assoc format=account,partition,qos` lines: 'acct|part|qos1,qos2'."""
    out = []
    for line in text.splitlines():
        fields = (line.split("|") + ["", "", ""])[:3]
        if fields[0]:
            qos = tuple(q for q in fields[2].split(",") if q)
            out.append(Association(fields[0], fields[1], qos))
    return tuple(out)


def _reason(text: str) -> str:
    """'test [root@2026-11-23T20:20:08]' -> 'test' (who and when are in the ledger anyway)."""
    return "" if text in ("", "(null)", "none") else re.sub(r"\s*\[[^]]*@[^]]*\]$", "", text)


def parse_job_instances(text: str) -> tuple[JobInstance, ...]:
    """`sacct -D -X -n -P -o JobID,State,NodeList,Start,End` lines; a NodeList of
    'None assigned' (a pending run) gives no nodes."""
    out = []
    for line in text.splitlines():
        fields = line.split("|")
        if len(fields) < 5 or not fields[0]:
            continue
        nodelist = fields[2].strip()
        nodes = () if not nodelist or " " in nodelist else tuple(expand_nodelist(nodelist))
        state = fields[1].split()[0] if fields[1].strip() else ""
        out.append(JobInstance(fields[0], state, nodes, fields[3], fields[4]))
    return tuple(out)


def parse_node_events(text: str) -> tuple[NodeEvent, ...]:
    """`sacctmgr -nP show event format=NodeName,TimeStart,TimeEnd,State,Reason` lines (the
    cluster's own events have no node name and are left out)."""
    out = []
    for line in text.splitlines():
        fields = (line.split("|") + [""] * 5)[:5]
        if fields[0]:
            out.append(NodeEvent(*fields))
    return tuple(out)
