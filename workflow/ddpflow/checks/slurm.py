"""Check every run's `machine` section against the real Slurm cluster before anything is queued.

Why: with Slurm's default EnforcePartLimits=NO, sbatch ACCEPTS a job that asks for more than
its partition can ever give (nodes, GPUs, CPUs, memory, time) and lets it pend forever (reason
PartitionTimeLimit, Resources, ...); with AccountingStorageEnforce=none a misspelled account is
accepted too and the hours are billed nowhere. Each such mistake becomes a ConfigError when
Snakemake starts, naming the run, the key, the value, what the cluster has, and the fix.

The cluster is asked once (ddpflow.cluster.slurm_query: `scontrol --all --oneliner show
partition|node` and, when a run names an account or qos, `sacctmgr -nP show assoc|account`);
the checks here are pure functions of its answer, unit-tested on captured output
(tests/slurm/).

    from ddpflow.checks.slurm import check_runs_against_cluster
    check_runs_against_cluster(resolved_runs)   # raises ConfigError, returns None when all fit
"""

from __future__ import annotations

import logging

from ddpflow.checks.memory_knobs import Partition as Limits
from ddpflow.cluster.slurm_parse import Node, Partition, parse_slurm_time
from ddpflow.cluster.slurm_query import (
    QUERY_TIMEOUT_S,
    Cluster,
    default_account,
    query_cluster,
    resolve_partition,
)
from ddpflow.config.machine import (
    DEFAULT_STAGE_CPUS,
    DEFAULT_STAGE_MEM_GB,
    memory_mb,
    ranks_per_node,
)
from ddpflow.config.schema import ConfigError
from ddpflow.words import counted

log = logging.getLogger(__name__)


def check_runs_against_cluster(
    runs: list[dict], timeout_s: float = QUERY_TIMEOUT_S, stage_in_job: bool = False
) -> dict[str, Limits]:
    """Raise ConfigError for the first run whose machine section this cluster cannot run
    (and, stage_in_job, whose machine.stage job it cannot run). Returns each run's partition
    limits (memory_knobs.Partition: the GPU types in its GRES, what ddpflow.checks.memory reads
    the GPU memory from, and the memory and nodes a memory refusal's knobs must keep)."""
    if not runs:
        return {}
    need_accounting = any(run["machine"]["account"] or run["machine"]["qos"] for run in runs)
    cluster = query_cluster(need_accounting, timeout_s)
    types = {}
    for run in runs:
        check_run(run, cluster)
        if stage_in_job:
            check_stage_job(run, cluster)
    if stage_in_job:
        name_stage_accounts(runs, cluster.user, timeout_s)
    for run in runs:
        partition = resolve_partition(run["name"], run["machine"]["partition"], cluster)
        types[run["name"]] = partition_limits(partition, cluster.nodes_of(partition))
    return types


def name_stage_accounts(runs: list[dict], user: str, timeout_s: float) -> None:
    """A run without machine.account gets the user's default account for its staging job's
    resources (the job is billed to it anyway): else Snakemake's Slurm plugin guesses it with
    an sacct call that fails on some Slurm versions and prints its error at every staging
    job ("sacct: invalid option"). Only this process's runs change (never a fingerprint)."""
    if all(run["machine"]["account"] for run in runs):
        return
    account = default_account(user, timeout_s)
    for run in runs:
        if account and not run["machine"]["account"]:
            run["machine"]["account"] = account


def partition_limits(partition: Partition, nodes: list[Node]) -> Limits:
    """The most a job of partition gets: a node's memory, its nodes, the GPU types."""
    cap, most = partition.max_mem_per_node_mb, max((n.memory_mb for n in nodes), default=0)
    count = min(len(nodes), partition.max_nodes or len(nodes))
    mem = cap if cap and cap < most else most
    return Limits(partition.name, mem, count, tuple(gpu_types(nodes)))


def gpu_types(nodes: list[Node]) -> list[str]:
    """The GPU types named in the nodes' GRES ("gpu:h100:4(S:0-1)" -> h100; an untyped
    "gpu:4" -> "")."""
    types = set()
    for node in nodes:
        for item in node.gres.split(","):
            fields = item.split("(")[0].split(":")
            if fields[0] == "gpu" and len(fields) >= 2:
                types.add(fields[1] if len(fields) == 3 else "")
    return sorted(types)


def check_stage_job(run: dict, cluster: Cluster) -> None:
    """The staging job (machine.stage: one node, one task) fits a node of its partition. A
    machine.stage.cpus left null is set here, in run, to what the job asks for: the default,
    or a node's CPUs where the partition's nodes have fewer (a default fits the partition it
    is used on; a number the user wrote is checked as written)."""
    where, stage = f"runs ({run['name']!r})", run["machine"]["stage"]
    name = stage["partition"] or run["machine"]["partition"]
    partition = resolve_partition(where, name, cluster)
    nodes = cluster.nodes_of(partition)
    if not nodes:
        raise ConfigError(f"{where}: machine.stage.partition {partition.name!r} has no nodes")
    most_cpus = max(n.cpus for n in nodes)
    if stage["cpus"] is None:
        stage["cpus"] = min(DEFAULT_STAGE_CPUS, most_cpus)
    if stage["cpus"] > most_cpus:
        raise ConfigError(
            f"{where}: machine.stage.cpus is {stage['cpus']} but the nodes of partition "
            f"{partition.name!r} have at most {counted(most_cpus, 'CPU')}; set "
            f"machine.stage.cpus <= {most_cpus}"
        )
    most_mb = max(n.memory_mb for n in nodes)
    cap = partition.max_mem_per_node_mb
    limit = cap if cap and cap < most_mb else most_mb
    if stage["mem_gb"] is None:  # the default, fitted as cpus are (whole MB, in GB)
        stage["mem_gb"] = min(DEFAULT_STAGE_MEM_GB, limit // 1 / 1024)
    if int(stage["mem_gb"] * 1024) > limit:
        raise ConfigError(
            f"{where}: machine.stage.mem_gb is {stage['mem_gb']} but partition "
            f"{partition.name!r} gives a node at most {limit} MB; set machine.stage.mem_gb <= "
            f"{int(limit / 1024 * 10) / 10}"
        )
    try:
        limit_s = parse_slurm_time(partition.max_time)
    except ValueError:
        return
    if limit_s is not None and not _within_max_time(limit_s, stage["time_min"]):
        raise ConfigError(
            f"{where}: machine.stage.time_min is {stage['time_min']} but partition "
            f"{partition.name!r} allows at most {limit_s // 60} min; set "
            f"machine.stage.time_min <= {limit_s // 60}"
        )


def check_run(run: dict, cluster: Cluster) -> None:
    where = f"runs ({run['name']!r})"
    partition = resolve_partition(where, run["machine"]["partition"], cluster)
    check_account(where, run["machine"], partition, cluster)
    check_nodes(where, run["machine"], partition, cluster.nodes_of(partition))
    check_time(where, run["machine"]["time_min"], partition, cluster)


def check_account(where: str, machine: dict, partition: Partition, cluster: Cluster) -> None:
    account, qos = machine["account"], machine["qos"]
    if cluster.associations is None or not (account or qos):
        return
    # an association with an empty partition field covers every partition
    usable = [a for a in cluster.associations if a.partition in ("", partition.name)]
    mine = sorted({a.account for a in usable})
    see = f"`sacctmgr show assoc user={cluster.user}`"
    if account and account not in (cluster.accounts or ()):
        raise ConfigError(
            f"{where}: machine.account is {account!r} but the cluster has no such account; "
            f"user {cluster.user} can use {mine} ({see}); set machine.account to one of them, "
            "or null for your default account"
        )
    if account and account not in mine:
        raise ConfigError(
            f"{where}: machine.account is {account!r} but user {cluster.user} is not associated "
            f"with it on partition {partition.name!r}; the user's accounts there: {mine} ({see}); "
            "set machine.account to one of them, or ask the cluster admins for access"
        )
    allowed = sorted({q for a in usable if not account or a.account == account for q in a.qos})
    if qos and allowed and qos not in allowed:
        raise ConfigError(
            f"{where}: machine.qos is {qos!r} but user {cluster.user} may only use {allowed} "
            f"here ({see}); set machine.qos to one of them, or null for the default"
        )


def check_nodes(where: str, machine: dict, partition: Partition, nodes: list[Node]) -> None:
    """Per-node resources first (the clearer message), then the node count, then whether
    enough nodes have everything at once (partitions may mix node kinds)."""
    if not nodes:
        raise ConfigError(
            f"{where}: machine.partition {partition.name!r} has no nodes; pick another partition"
        )
    _check_gpus(where, machine, partition, nodes)
    _check_cpus(where, machine, partition, nodes)
    _check_memory(where, machine, partition, nodes)
    wanted, asked = machine["nodes"], _nodes_asked(machine)
    total = wanted + machine.get("spare_nodes", 0)  # the job holds the spares too
    limit = min(len(nodes), partition.max_nodes or len(nodes))
    if total > limit:
        why = (
            f"MaxNodes={partition.max_nodes}" if limit < len(nodes) else counted(len(nodes), "node")
        )
        fix = f"set machine.nodes <= {limit} (more ranks per node keep the world size)"
        if machine.get("spare_nodes"):
            fix = f"set machine.spare_nodes <= {max(0, limit - wanted)}, or {fix}"
        raise ConfigError(
            f"{where}: {asked} but partition {partition.name!r} allows at most "
            f"{limit} ({why}: {','.join(n.name for n in nodes)}); {fix}"
        )
    ranks = ranks_per_node(machine)
    need = (machine["gpus_per_node"], ranks * machine["cpus_per_task"], memory_mb(machine))
    fitting = [n.name for n in nodes if _fits(n, need)]
    if total > len(fitting):
        raise ConfigError(
            f"{where}: {asked} but only {counted(len(fitting), 'node')} of "
            f"partition {partition.name!r} {'has' if len(fitting) == 1 else 'have'} "
            f"{counted(need[0], 'GPU')}, {counted(need[1], 'CPU')} and {need[2]} MB together "
            f"({','.join(fitting) or 'none'}); set machine.nodes <= {len(fitting)} or ask for less "
            "per node"
        )


def _nodes_asked(machine: dict) -> str:
    """'machine.nodes is 2', or with spares 'machine.nodes 2 + machine.spare_nodes 1 = 3 nodes'."""
    spares = machine.get("spare_nodes", 0)
    if not spares:
        return f"machine.nodes is {machine['nodes']}"
    total = machine["nodes"] + spares
    return f"machine.nodes {machine['nodes']} + machine.spare_nodes {spares} = {total} nodes"


def _fits(node: Node, need: tuple[int, int, int]) -> bool:
    return node.gpus >= need[0] and node.cpus >= need[1] and node.memory_mb >= need[2]


def _check_gpus(where: str, machine: dict, partition: Partition, nodes: list[Node]) -> None:
    most = max(n.gpus for n in nodes)
    if machine["gpus_per_node"] > most:
        gres = ", ".join(sorted({n.gres for n in nodes}))
        raise ConfigError(
            f"{where}: machine.gpus_per_node is {machine['gpus_per_node']} but the nodes of "
            f"partition {partition.name!r} have at most {counted(most, 'GPU')} (Gres={gres}); set "
            f"machine.gpus_per_node <= {most} (more machine.nodes give more GPUs), or pick a "
            "partition with bigger GPU nodes"
        )


def _check_cpus(where: str, machine: dict, partition: Partition, nodes: list[Node]) -> None:
    ranks, per_task = ranks_per_node(machine), machine["cpus_per_task"]
    most = max(n.cpus for n in nodes)
    if ranks * per_task <= most:
        return
    rank_key = "machine.gpus_per_node" if machine["gpus_per_node"] else "machine.cpu_ranks_per_node"
    fix = (
        f"set machine.cpus_per_task <= {most // ranks}"
        if most >= ranks
        else f"set {rank_key} <= {most} and machine.cpus_per_task: 1"
    )
    raise ConfigError(
        f"{where}: machine.cpus_per_task is {per_task} with {counted(ranks, 'rank')} per node "
        f"({rank_key}): {counted(ranks * per_task, 'CPU')} per node, but the nodes of partition "
        f"{partition.name!r} have at most {counted(most, 'CPU')}; {fix}"
    )


def _check_memory(where: str, machine: dict, partition: Partition, nodes: list[Node]) -> None:
    most = max(n.memory_mb for n in nodes)
    cap = partition.max_mem_per_node_mb
    limit, source = (cap, "MaxMemPerNode") if cap and cap < most else (most, "RealMemory")
    if memory_mb(machine) <= limit:
        return
    raise ConfigError(
        f"{where}: machine.mem_gb is {machine['mem_gb']} ({memory_mb(machine)} MB per node) but "
        f"partition {partition.name!r} gives a node at most {limit} MB ({source}); set "
        f"machine.mem_gb <= {int(limit / 1024 * 10) / 10}"
    )


def _within_max_time(limit_s: int | None, time_min: int) -> bool:
    """A time limit of time_min minutes within MaxTime (None: unlimited)."""
    return limit_s is None or time_min * 60 <= limit_s


def _allows(partition: Partition, time_min: int) -> bool:
    try:
        return _within_max_time(parse_slurm_time(partition.max_time), time_min)
    except ValueError:
        return False


def check_time(where: str, time_min: int, partition: Partition, cluster: Cluster) -> None:
    try:
        limit_s = parse_slurm_time(partition.max_time)
    except ValueError:
        # an unexpected format must not block a run that may well be fine: warn only
        log.warning(
            "partition %s: MaxTime=%r unreadable; time_min not checked",
            partition.name,
            partition.max_time,
        )
        return
    if limit_s is None or _within_max_time(limit_s, time_min):
        return
    longer = [p.name for p in cluster.partitions.values() if _allows(p, time_min)]
    other = f", or use a partition that allows it: {', '.join(longer)}" if longer else ""
    raise ConfigError(
        f"{where}: machine.time_min is {time_min} but partition {partition.name!r} allows at "
        f"most {limit_s // 60} min (MaxTime={partition.max_time}); Slurm would accept the job "
        f"and leave it pending forever (PartitionTimeLimit); set machine.time_min <= "
        f"{limit_s // 60}{other}"
    )
