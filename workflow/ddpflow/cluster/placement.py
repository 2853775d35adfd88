"""How many nodes a run's next Slurm job gets, and which it must avoid.

Before every Slurm submission (train and evaluate; the rule's retry and a rerun alike):
healthy nodes = the partition's nodes, less those in the bad-node ledger
(results/work/bad_nodes.json, ddpflow.cluster.nodes) and those Slurm holds DOWN, DRAINED or FAILED.
- `machine.nodes` healthy nodes: the job asks for machine.nodes, the ledger's nodes excluded
  (sbatch --exclude);
- fewer, with `machine.min_nodes`: as many as there are, down to min_nodes. The job is given a
  copy of the run whose machine.nodes is that count (the user's config is never edited), so
  it keeps the same global batch wherever the training derives its accumulation from it;
- fewer than min_nodes (machine.nodes when min_nodes is null): a ConfigError before anything
  is submitted, naming the ledger, the nodes and how to clear it.
Imports no torch.

    run_on, exclude = place(run, ledger, record)   # run_on["machine"]["nodes"] may be smaller
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path

from ddpflow.cluster.nodes import read_ledger, shown
from ddpflow.cluster.slurm_parse import Node
from ddpflow.config.machine import world_size
from ddpflow.config.schema import ConfigError
from ddpflow.words import counted

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    nodes: int  # what the job asks for
    exclude: tuple[str, ...]  # ledger nodes of the partition: sbatch --exclude
    down: tuple[str, ...]  # unhealthy in Slurm now, not in the ledger: "node3 (DOWN: why)"
    healthy: tuple[str, ...]


def on_nodes(run: dict, count: int) -> dict:
    """A copy of the run that runs on `count` nodes (world size to match)."""
    if count == run["machine"]["nodes"]:
        return run
    placed = copy.deepcopy(run)
    placed["machine"]["nodes"] = count
    placed["world_size"] = world_size(placed["machine"])
    return placed


def accepts(run: dict, count: int) -> str | None:
    """None if the run's checks pass on `count` nodes, else why not (e.g. too few samples
    for the ranks, a global batch the ranks cannot split evenly)."""
    # the one import of ddpflow.checks in cluster/: a run's checks, at the node count it gets
    from ddpflow.checks.values import check_resolved_run

    try:
        check_resolved_run(on_nodes(run, count), run["launcher"])
    except ConfigError as err:
        return str(err)
    return None


def decide(run: dict, members: list[Node], ledger: list[dict], ledger_path) -> Decision:
    """The node count and exclusions for the run's next job (pure: members are the
    partition's nodes as scontrol shows them now)."""
    machine = run["machine"]
    wanted, fewest = machine["nodes"], machine["min_nodes"] or machine["nodes"]
    names = {n.name for n in members}
    exclude = tuple(sorted({e["node"] for e in ledger} & names))
    unhealthy = [n for n in members if n.unhealthy and n.name not in exclude]
    down = tuple(f"{n.name} ({n.state}{': ' + n.reason if n.reason else ''} in Slurm)"
                 for n in sorted(unhealthy, key=lambda n: n.name))  # fmt: skip
    healthy = tuple(sorted(names - set(exclude) - {n.name for n in unhealthy}))
    refused = []
    for count in range(min(wanted, len(healthy)), fewest - 1, -1):
        why = accepts(run, count)
        if why is None:
            return Decision(count, exclude, down, healthy)
        refused.append(f"{counted(count, 'node')}: {why}")
    raise ConfigError(shortage(run, ledger, ledger_path, Decision(0, exclude, down, healthy),
                               refused))  # fmt: skip


def _excluded(ledger: list[dict], decision: Decision, ledger_path) -> str:
    by_node = {e["node"]: e for e in ledger}
    why = [f"{n} ({by_node[n]['reason']}, ledger {shown(ledger_path)})" for n in decision.exclude]
    return ", ".join([*why, *decision.down])


def shortage(run, ledger, ledger_path, decision: Decision, refused: list[str]) -> str:
    machine = run["machine"]
    fewest = machine["min_nodes"]
    wanted = f"machine.nodes is {machine['nodes']}" + (
        f" and machine.min_nodes {fewest}" if fewest else " (machine.min_nodes is null)"
    )
    have = len(decision.healthy)
    text = (
        f"run {run['name']!r}: {wanted} but the partition has {counted(have, 'healthy node')}"
        f"{': ' + ', '.join(decision.healthy) if have else ''}; left out: "
        f"{_excluded(ledger, decision, ledger_path) or 'none'}. Nothing was submitted."
    )
    if refused:
        text += " Fewer nodes do not fit the run: " + "; ".join(refused) + "."
    if decision.exclude:
        text += (
            f" The bad-node ledger {shown(ledger_path)} lists nodes that failed under earlier "
            "jobs; once they are repaired (`sinfo -R` lists nodes Slurm holds down), clear it "
            f"with `snakemake clean_bad_nodes` (or delete {shown(ledger_path)})."
        )
    if have and not refused and (fewest or machine["nodes"]) > have:
        text += f" Or set machine.min_nodes: {have} to run on the healthy nodes."
    return text


def announce(run: dict, decision: Decision, ledger: list[dict], ledger_path) -> None:
    """One line in the terminal when the job avoids nodes or runs on fewer."""
    if not decision.exclude and decision.nodes == run["machine"]["nodes"]:
        return
    parts = []
    if decision.exclude or decision.down:
        parts.append("excluding " + _excluded(ledger, decision, ledger_path))
    wanted, count = run["machine"]["nodes"], decision.nodes
    shrink = f" (machine.min_nodes: {run['machine']['min_nodes']})" if count < wanted else ""
    parts.append(f"running on {count} node{'s' if count != 1 else ''} of {wanted}{shrink}")
    log.warning("run %r: %s", run["name"], "; ".join(parts))


def place(run: dict, ledger_path: str | Path, previous: dict | None = None):
    """(the run as its next Slurm job runs it, nodes to exclude). previous: the record of
    a live job submitted by an earlier attempt (reattached as it was placed)."""
    if run["launcher"] != "slurm":
        return run, ()
    if previous and isinstance(previous.get("nodes"), int):
        return on_nodes(run, previous["nodes"]), tuple(previous.get("exclude", ()))
    from ddpflow.cluster.slurm_query import query_cluster, resolve_partition

    cluster = query_cluster(need_accounting=False)
    partition = resolve_partition(f"run {run['name']!r}", run["machine"]["partition"], cluster)
    ledger = read_ledger(ledger_path)
    decision = decide(run, cluster.nodes_of(partition), ledger, ledger_path)
    announce(run, decision, ledger, ledger_path)
    return on_nodes(run, decision.nodes), decision.exclude
