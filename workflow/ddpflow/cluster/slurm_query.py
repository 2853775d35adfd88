"""The Slurm cluster as it is now, asked read-only with a timeout: its partitions and nodes
(`scontrol --all --oneliner show partition|node`) and, where asked, the user's associations
and the accounts (`sacctmgr -nP show assoc|account`), parsed by slurm_parse.py. The checks
before anything is queued (ddpflow.checks.slurm) and placement read it.

    cluster = query_cluster(need_accounting=False)
    partition = resolve_partition("run 'a'", None, cluster)   # the default partition
"""

from __future__ import annotations

import logging
import os
import pwd
import subprocess
from dataclasses import dataclass

from ddpflow.cluster.slurm_parse import (
    Association,
    Node,
    Partition,
    parse_associations,
    parse_nodes,
    parse_partitions,
)
from ddpflow.config.schema import ConfigError

log = logging.getLogger(__name__)


QUERY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Cluster:
    partitions: dict[str, Partition]
    nodes: tuple[Node, ...]
    user: str
    associations: tuple[Association, ...] | None  # None: accounting not available
    accounts: tuple[str, ...] | None

    def nodes_of(self, partition: Partition) -> list[Node]:
        named = set(partition.node_names)
        return [n for n in self.nodes if partition.name in n.partitions or n.name in named]


def _command(cmd: list[str], timeout_s: float) -> str:
    """stdout of a Slurm client command; every way it can fail becomes a ConfigError."""
    shown = " ".join(cmd)
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError as exc:
        raise ConfigError(
            f"launcher is slurm but `{cmd[0]}` is not installed here: the slurm launcher needs "
            "the Slurm client tools (scontrol, sbatch, sacct); run snakemake on a login node of "
            "the cluster, or set launcher: local"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise ConfigError(
            f"`{shown}` did not answer within {timeout_s:g} s; is slurmctld reachable from "
            "here (`scontrol ping`)?"
        ) from exc
    if res.returncode != 0:
        raise ConfigError(f"`{shown}` failed (exit {res.returncode}): {res.stderr.strip()}")
    return res.stdout


def _accounting(user: str, timeout_s: float) -> tuple[tuple | None, tuple | None]:
    """The user's associations and all account names; (None, None) without accounting, where
    Slurm cannot check accounts either, so we only warn."""
    fmt = "format=account,partition,qos"
    try:
        assoc = _command(["sacctmgr", "-nP", "show", "assoc", f"user={user}", fmt], timeout_s)
        accounts = _command(["sacctmgr", "-nP", "show", "account", "format=account"], timeout_s)
    except ConfigError as err:
        log.warning("accounting not available, machine.account/qos not checked: %s", err)
        return None, None
    names = tuple(line.strip() for line in accounts.splitlines() if line.strip())
    return parse_associations(assoc), names


def default_account(user: str, timeout_s: float = QUERY_TIMEOUT_S) -> str | None:
    """The user's default account (sacctmgr), None where accounting cannot say: what a job
    submitted without --account is billed to."""
    try:
        text = _command(
            ["sacctmgr", "-nP", "show", "user", user, "format=defaultaccount"], timeout_s
        )
    except ConfigError:
        return None
    return next((line.strip() for line in text.splitlines() if line.strip()), None)


def current_user() -> str:
    # Slurm associates by uid, so ask the password database rather than trust $USER.
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return os.environ.get("USER", str(os.getuid()))


def query_cluster(need_accounting: bool, timeout_s: float = QUERY_TIMEOUT_S) -> Cluster:
    # --all: hidden partitions exist and are usable by those allowed in them
    part_text = _command(["scontrol", "--all", "--oneliner", "show", "partition"], timeout_s)
    node_text = _command(["scontrol", "--all", "--oneliner", "show", "node"], timeout_s)
    user = current_user()
    assoc, accounts = _accounting(user, timeout_s) if need_accounting else (None, None)
    return Cluster(parse_partitions(part_text), parse_nodes(node_text), user, assoc, accounts)


def _partition_list(cluster: Cluster) -> str:
    return ", ".join(
        f"{p.name}{' (default)' if p.default else ''}" for p in cluster.partitions.values()
    )


def resolve_partition(where: str, name: str | None, cluster: Cluster) -> Partition:
    """The named partition, or the cluster's default (Default=YES) for null."""
    if name is None:
        default = [p for p in cluster.partitions.values() if p.default]
        if not default:
            raise ConfigError(
                f"{where}: machine.partition is null but this cluster has no default partition; "
                f"set machine.partition to one of: {_partition_list(cluster)}"
            )
        return default[0]
    if name not in cluster.partitions:
        raise ConfigError(
            f"{where}: machine.partition is {name!r} but the cluster has no such partition; "
            f"existing partitions: {_partition_list(cluster)} (`sinfo -s`); set "
            "machine.partition to one of them"
        )
    return cluster.partitions[name]
