"""What a run's settings mean on its machine: ranks, world size, data-parallel ranks (world
size / train.tensor_parallel), memory, gradient accumulation and the world sizes and
micro-batches that split the global batch, the staging job's resources, sharding, memory
layout. Arithmetic of the config alone: what this machine has is probed in
ddpflow.checks.host, and the refusals are ddpflow.checks.batch's.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddpflow.config.typed import RunView, SectionView


def ranks_per_node(machine: SectionView) -> int:
    """One rank per GPU; without GPUs, cpu_ranks_per_node CPU ranks (Slurm: tasks per node)."""
    return machine["gpus_per_node"] or machine["cpu_ranks_per_node"]


def world_size(machine: dict) -> int:
    return machine["nodes"] * ranks_per_node(machine)


def tensor_parallel_degree(train: SectionView) -> int:
    """train.tensor_parallel: the ranks of one tensor-parallel group (1: none; a run
    resolved before the key existed has none)."""
    return train.get("tensor_parallel") or 1


def data_parallel_size(train: SectionView, world: int) -> int:
    """The data-parallel ranks of `world` ranks: world / train.tensor_parallel. The ranks of
    a tensor group compute the same micro-batches, so every split of the global batch counts
    these (checks.tensor_parallel has made sure the degree divides a node's ranks)."""
    return world // tensor_parallel_degree(train)


def accumulation_steps(train: SectionView, world: int, rank: int = 0) -> int:
    """Micro-batches a rank computes per optimizer step: global / (micro x world), derived;
    where the world size does not divide the step's micro-batches, the first ranks take one
    more each (rank_shares); world: the data-parallel ranks (data_parallel_size)."""
    return rank_shares(micro_batches_per_step(train), world)[rank]


def rank_shares(count: int, world: int) -> list[int]:
    """Each rank's micro-batches of a step's `count`: equal where world divides it, else the
    first count % world ranks one more (the step waits for them)."""
    base, extra = divmod(count, world)
    return [base + (rank < extra) for rank in range(world)]


def micro_batches_per_step(train: SectionView) -> int:
    return train["global_batch_size"] // train["micro_batch_size"]


def working_world_sizes(train: dict) -> list[int]:
    """The world sizes that split a step's micro-batches evenly: divisors of global/micro."""
    count = micro_batches_per_step(train)
    return [w for w in range(1, count + 1) if count % w == 0]


def sharing_micro_batch(global_batch: int, cap: int | None, worlds: list[int]) -> int | None:
    """The largest micro-batch up to `cap` that cuts the global batch into whole
    micro-batches, evenly shared at every world size where one does (splitting_micro_batch),
    else shared unevenly: at least one per rank at the largest world size (None: there is
    none, a world larger than the global batch)."""
    even = splitting_micro_batch(global_batch, cap, worlds)
    if even is not None:
        return even
    for micro in range(min(cap or global_batch, global_batch), 0, -1):
        if global_batch % micro == 0 and global_batch // micro >= max(worlds):
            return micro
    return None


def request_world_sizes(machine: dict) -> list[int]:
    """Every world size a job of this request can run at: machine.nodes, and each node count
    down to machine.min_nodes (placement shrinks a job there after node failures)."""
    per_node = ranks_per_node(machine)
    fewest = machine.get("min_nodes") or machine["nodes"]
    return [nodes * per_node for nodes in range(fewest, machine["nodes"] + 1)]


def splitting_micro_batch(global_batch: int, cap: int | None, worlds: list[int]) -> int | None:
    """The largest micro-batch up to `cap` that cuts the global batch into whole
    micro-batches which every world size in `worlds` shares out evenly (None: there is none)."""
    for micro in range(min(cap or global_batch, global_batch), 0, -1):
        count, rest = divmod(global_batch, micro)
        if not rest and all(count % world == 0 for world in worlds):
            return micro
    return None


def memory_mb(machine: dict) -> int:
    """Memory per node in MB: what the Slurm job asks for and what the checks compare."""
    return int(machine["mem_gb"] * 1024)


# machine.stage.cpus and mem_gb when null, unless the partition's nodes have less
# (checks.slurm fits them there, and the staging job's own parse takes the fitted values:
# STAGE_FITTED)
DEFAULT_STAGE_CPUS = 4
DEFAULT_STAGE_MEM_GB = 4.0
STAGE_FITTED = "DDPFLOW_STAGE_FITTED"  # {run: {cpus, mem_gb}}, in the jobs' environment


def stage_cpus(run: dict) -> int:
    """The staging job's CPUs: machine.stage.cpus, as checks.slurm fitted a null one to the
    partition (where the cluster was asked), else DEFAULT_STAGE_CPUS."""
    return run["machine"]["stage"]["cpus"] or DEFAULT_STAGE_CPUS


def stage_mem_gb(run: dict) -> float:
    """The staging job's memory: machine.stage.mem_gb, fitted like stage_cpus."""
    return run["machine"]["stage"]["mem_gb"] or DEFAULT_STAGE_MEM_GB


def export_fitted_stage(runs: list[dict]) -> None:
    """The staging resources fitted on the login node, for the Snakemake that runs inside the
    staging job (it inherits this environment, and cannot ask the cluster): the same CPUs and
    memory everywhere, or srun refuses the job's step ("More processors requested than
    permitted")."""
    fitted = {r["name"]: {k: r["machine"]["stage"][k] for k in ("cpus", "mem_gb")} for r in runs}
    os.environ[STAGE_FITTED] = json.dumps(fitted)


def apply_fitted_stage(runs: list[dict]) -> None:
    """In a job's own parse: machine.stage as the login node fitted it (export_fitted_stage)."""
    fitted = json.loads(os.environ.get(STAGE_FITTED) or "{}")
    for run in runs:
        for key, value in (fitted.get(run["name"]) or {}).items():
            if run["machine"]["stage"][key] is None:
                run["machine"]["stage"][key] = value


def stage_job_resources(run: dict) -> dict:
    """The stage rule's resources as the Snakemake Slurm executor plugin reads them, from
    machine.stage (partition: machine.partition where null): one node, one task."""
    machine, stage = run["machine"], run["machine"]["stage"]
    resources = {
        "cpus_per_task": stage_cpus(run),
        "mem_mb": int(stage_mem_gb(run) * 1024),
        "runtime": stage["time_min"],
        "nodes": 1,
        "tasks": 1,
    }
    partition = stage["partition"] or machine["partition"]
    for key, value in (("slurm_partition", partition), ("slurm_account", machine["account"])):
        if value:
            resources[key] = value
    if machine["qos"]:
        resources["slurm_extra"] = f"--qos={machine['qos']}"
    return resources


def stage_rule_resources(runs: list[dict], run_for_dataset) -> dict:
    """The stage rule's `resources:` for staging jobs: each a function of the rule's
    wildcards, from the machine.stage of a run that uses the dataset (the first, where runs
    share one). A key another run sets and this one does not (a partition, an account, a
    qos) is "" here: the plugin's default, as if absent."""
    keys = set().union(*(stage_job_resources(run) for run in runs))

    def resource(key: str):
        def value(wildcards):
            return stage_job_resources(run_for_dataset(wildcards.dataset)).get(key, "")

        return value

    return {key: resource(key) for key in sorted(keys)}


# the strategies that shard the model with FSDP2 (hsdp: on a replicate x shard mesh)
SHARDED_STRATEGIES = ("fsdp", "hsdp")


def trains_sharded(run: RunView) -> bool:
    """Whether the run trains under fsdp or hsdp (a 1-rank run trains as ddp)."""
    return run["train"]["strategy"] in SHARDED_STRATEGIES and run["world_size"] > 1


def hsdp_shard_size(train: SectionView, machine: SectionView) -> int:
    """Ranks per hsdp shard group: train.hsdp.shard_size, or the ranks of one node."""
    return train["hsdp"]["shard_size"] or ranks_per_node(machine)


def hsdp_mesh(world: int, shard_size: int) -> tuple[int, int] | None:
    """(replicas, shard size) of hsdp's mesh at this world size; None where the shard size
    does not divide it. A shard group larger than the world is the world (fsdp)."""
    shard = min(shard_size, world)
    return (world // shard, shard) if world % shard == 0 else None


def uses_channels_last(run: RunView) -> bool:
    """train.channels_last, except under fsdp and hsdp (at any world size, so that the
    layout does not change with it): FSDP2 shards contiguous parameters only. Training and
    both evaluations lay the model out alike, so that they score alike."""
    return run["train"]["channels_last"] and run["train"]["strategy"] not in SHARDED_STRATEGIES
