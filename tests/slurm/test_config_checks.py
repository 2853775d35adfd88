"""ddpflow.checks.slurm: a machine section the cluster cannot run fails before anything is queued.

Two kinds of tests live here:
- unit tests of the parsers and checks on captured `scontrol` / `sacctmgr` text
  (tests/golden/slurm/: testbed_* captured from the test cluster, hetero_* a production-like
  cluster in the same format); they need no cluster and run under `-m "not slurm"`;
- `slurm`-marked tests against the REAL test cluster (fixture `slurm_cluster`).
"""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import pytest
from ddpflow import config as ddpconfig
from ddpflow.checks import slurm as sc
from ddpflow.cluster import slurm_parse as sp
from ddpflow.config import ConfigError
from ddpflow.config import machine as machine_config
from ddpflow.config.machine import stage_rule_resources

CAPTURED = Path(__file__).resolve().parents[1] / "golden" / "slurm"


def captured(name: str) -> str:
    return (CAPTURED / name).read_text()


def cluster_from(prefix: str, accounting: bool = True) -> sc.Cluster:
    """A Cluster built from captured text exactly as query_cluster builds it from live output."""
    assoc = sp.parse_associations(captured(f"{prefix}_assoc.txt")) if accounting else None
    accounts = tuple(captured(f"{prefix}_accounts.txt").split()) if accounting else None
    return sc.Cluster(
        sp.parse_partitions(captured(f"{prefix}_partitions.txt")),
        sp.parse_nodes(captured(f"{prefix}_nodes.txt")),
        "alice",
        assoc,
        accounts,
    )


def runs_for(machine: dict, name: str = "big") -> list[dict]:
    """Resolved runs as common.smk has them (schema defaults filled, launcher slurm)."""
    cfg = ddpconfig.validate({"launcher": "slurm", "machine": machine, "runs": [{"name": name}]})
    return ddpconfig.resolve_runs(cfg)


def error_of(machine: dict, cluster: sc.Cluster) -> str:
    with pytest.raises(ConfigError) as info:
        sc.check_run(runs_for(machine)[0], cluster)
    return str(info.value)


# ---------------------------------------------------------------- parsers


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("INFINITE", None),
        ("UNLIMITED", None),
        ("10", 600),  # MM
        ("10:30", 630),  # MM:SS
        ("00:10:00", 600),  # HH:MM:SS
        ("36:00:00", 129600),
        ("2-12", 216000),  # D-HH
        ("1-00:30", 88200),  # D-HH:MM
        ("1-12:00:00", 129600),  # D-HH:MM:SS
        (" 0-00:00:05 ", 5),
    ],
)
def test_parse_slurm_time(text, seconds):
    assert sp.parse_slurm_time(text) == seconds


@pytest.mark.parametrize("text", ["", "1:2:3:4", "soon", "1-", "-5", "NONE"])
def test_parse_slurm_time_rejects_garbage(text):
    with pytest.raises(ValueError, match="not a Slurm time limit"):
        sp.parse_slurm_time(text)


@pytest.mark.parametrize(
    ("gres", "gpus"),
    [
        ("gpu:2", 2),
        ("gpu:a100:8", 8),
        ("gpu:a100:4(S:0-1)", 4),
        ("gpu:a100:4(S:0),gpu:v100:2(S:1),shard:a100:16", 6),
        ("gpu:a100:2(S:0,1),mps:100", 2),
        ("gpu", 1),
        ("gpu:a100", 1),
        ("gpu:1K", 1024),
        ("(null)", 0),
        ("", 0),
    ],
)
def test_parse_gpu_count(gres, gpus):
    assert sp.parse_gpu_count(gres) == gpus


def test_parse_oneliner_keeps_values_with_spaces_and_equals():
    line = "NodeName=n1 Sockets=1  OS=Linux 6.1 #1 SMP  CfgTRES=cpu=4,mem=8000M Reason=No [x]"
    [record] = sp.parse_oneliner(line + "\n\n")
    assert record == {
        "NodeName": "n1",
        "Sockets": "1",
        "OS": "Linux 6.1 #1 SMP",
        "CfgTRES": "cpu=4,mem=8000M",
        "Reason": "No [x]",
    }
    assert sp.parse_oneliner("No partitions in the system\n") == []


def test_parse_testbed_capture():
    cluster = cluster_from("testbed")
    assert list(cluster.partitions) == ["debug", "short"]
    debug, short = cluster.partitions["debug"], cluster.partitions["short"]
    assert debug.default and not short.default
    assert (debug.max_time, short.max_time) == ("UNLIMITED", "00:10:00")
    assert debug.node_names == ("node1", "node2")
    assert [(n.name, n.cpus, n.memory_mb, n.gpus) for n in cluster.nodes] == [
        ("node1", 4, 8000, 2),
        ("node2", 4, 8000, 2),
    ]
    assert cluster.nodes[0].partitions == ("debug", "short")
    assert {a.account for a in cluster.associations} == {"ddpflow", "root"}


def test_parse_production_like_capture():
    cluster = cluster_from("hetero")
    gpu = cluster.partitions["gpu"]
    assert (gpu.max_nodes, gpu.max_mem_per_node_mb, gpu.max_time) == (4, 500000, "2-00:00:00")
    assert cluster.partitions["preempt"].node_names[-1] == "cpu002"  # hidden, still listed
    nodes = {n.name: n for n in cluster.nodes}
    assert nodes["gpu03"].cpus == 126  # CPUEfctv: cores kept for the system don't count
    assert nodes["gpu03"].memory_mb == 508000  # RealMemory - MemSpecLimit
    assert nodes["gpu05"].gpus == 6 and nodes["cpu001"].gpus == 0
    assert nodes["gpu05"].partitions == ("gpu", "preempt", "quick")
    assert [n.name for n in cluster.nodes_of(cluster.partitions["quick"])] == ["gpu05"]
    proj = [a for a in cluster.associations if a.account == "proj"]
    assert proj[0] == sp.Association("proj", "gpu", ("normal", "high"))


# ---------------------------------------------------------------- checks on captured clusters


@pytest.mark.parametrize(
    ("machine", "expected"),
    [
        ({"partition": "gpux"}, ["machine.partition", "'gpux'", "debug (default), short"]),
        ({"account": "nope"}, ["machine.account", "'nope'", "no such account", "ddpflow"]),
        ({"qos": "high"}, ["machine.qos", "'high'", "['normal']"]),
        ({"nodes": 3}, ["machine.nodes is 3", "at most 2", "node1,node2", "<= 2"]),
        (
            {"nodes": 2, "spare_nodes": 1},
            ["machine.nodes 2 + machine.spare_nodes 1 = 3 nodes", "at most 2", "spare_nodes <= 0"],
        ),
        ({"gpus_per_node": 4}, ["machine.gpus_per_node is 4", "at most 2 GPUs", "Gres=gpu:2"]),
        ({"partition": "short", "time_min": 30}, ["machine.time_min is 30", "MaxTime=00:10:00"]),
        ({"mem_gb": 100}, ["machine.mem_gb is 100", "102400 MB", "8000 MB", "<= 7.8"]),
        ({"cpus_per_task": 3}, ["machine.cpus_per_task is 3", "6 CPUs", "at most 4", "<= 2"]),
        ({"cpu_ranks_per_node": 5}, ["5 ranks", "machine.cpu_ranks_per_node <= 4"]),
    ],
)
def test_bad_machine_on_testbed_capture(machine, expected):
    message = error_of(machine, cluster_from("testbed"))
    assert message.startswith("runs ('big'): machine.")
    for part in expected:
        assert part in message


def test_time_error_suggests_partitions_that_allow_it():
    message = error_of({"partition": "quick", "time_min": 31}, cluster_from("hetero"))
    assert "allows at most 30 min (MaxTime=30)" in message
    assert "use a partition that allows it: cpu, gpu, preempt" in message
    sc.check_run(runs_for({"partition": "quick", "time_min": 30})[0], cluster_from("hetero"))


@pytest.mark.parametrize(
    ("machine", "expected"),
    [
        # MaxNodes=4 although the partition has 5 nodes
        ({"partition": "gpu", "nodes": 5}, "allows at most 4 (MaxNodes=4"),
        # 8 x 16 = 128 CPUs: gpu03 keeps 2 cores for the system, gpu05 has 6 GPUs -> 3 nodes fit
        (
            {"partition": "gpu", "nodes": 4, "gpus_per_node": 8, "cpus_per_task": 16},
            "only 3 nodes of partition 'gpu' have 8 GPUs, 128 CPUs and 4096 MB together "
            "(gpu01,gpu02,gpu04)",
        ),
        ({"partition": "gpu", "mem_gb": 490}, "at most 500000 MB (MaxMemPerNode)"),
        ({"gpus_per_node": 1}, "partition 'cpu' have at most 0 GPUs (Gres=(null))"),
        ({"partition": "preempt", "account": "proj"}, "not associated with it on partition"),
        ({"partition": "gpu", "account": "other"}, "user alice is not associated"),
        ({"partition": "cpu", "account": "proj", "qos": "high"}, "may only use ['normal']"),
    ],
)
def test_bad_machine_on_production_like_capture(machine, expected):
    assert expected in error_of(machine, cluster_from("hetero"))


@pytest.mark.parametrize(
    "machine",
    [
        {"partition": "gpu", "nodes": 4, "gpus_per_node": 8, "cpus_per_task": 15, "mem_gb": 480},
        {"partition": "gpu", "account": "proj", "qos": "high", "time_min": 2880},
        {"partition": "preempt", "account": "teach", "time_min": 100000},
        {"cpu_ranks_per_node": 64, "cpus_per_task": 2, "nodes": 2},  # null -> default `cpu`
    ],
)
def test_good_machine_on_production_like_capture(machine):
    sc.check_run(runs_for(machine)[0], cluster_from("hetero"))


def test_account_not_checked_without_accounting():
    sc.check_run(runs_for({"account": "nope"})[0], cluster_from("testbed", accounting=False))


def test_null_partition_needs_a_default():
    cluster = cluster_from("hetero")
    no_default = {n: p for n, p in cluster.partitions.items() if not p.default}
    cluster = sc.Cluster(no_default, cluster.nodes, "alice", None, None)
    assert "no default partition" in error_of({}, cluster)


# ---------------------------------------------------------------- the query layer, faked tools


def fake_slurm_tools(bindir: Path, prefix: str, sacctmgr: bool = True) -> None:
    """scontrol/sacctmgr stand-ins answering with captured text (no cluster needed)."""
    bindir.mkdir()
    scripts = {
        "scontrol": f'case "$*" in *partition*) f={prefix}_partitions;; *) f={prefix}_nodes;; '
        f"esac; exec /bin/cat {CAPTURED}/$f.txt",
    }
    if sacctmgr:
        scripts["sacctmgr"] = f'case "$*" in *assoc*) f={prefix}_assoc;; *) f={prefix}_accounts;; '
        scripts["sacctmgr"] += f"esac; exec /bin/cat {CAPTURED}/$f.txt"
    for name, body in scripts.items():
        (bindir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bindir / name).chmod(0o755)


def test_check_runs_through_the_commands(tmp_path, monkeypatch):
    fake_slurm_tools(tmp_path / "bin", "hetero")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    good = runs_for({"partition": "gpu", "gpus_per_node": 8, "account": "proj"}, name="ok")
    bad = runs_for({"partition": "gpu", "gpus_per_node": 8, "nodes": 5}, name="wide")
    sc.check_runs_against_cluster(good)
    with pytest.raises(ConfigError, match=r"runs \('wide'\): machine.nodes is 5"):
        sc.check_runs_against_cluster(good + bad)


def test_missing_accounting_only_warns(tmp_path, monkeypatch, caplog):
    fake_slurm_tools(tmp_path / "bin", "testbed", sacctmgr=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with caplog.at_level(logging.WARNING, logger="ddpflow.cluster.slurm_query"):
        sc.check_runs_against_cluster(runs_for({"account": "anything"}))
    assert "accounting not available" in caplog.text


def test_missing_scontrol_says_what_is_needed(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="needs the Slurm client tools.*login node"):
        sc.check_runs_against_cluster(runs_for({}))


def test_hanging_scontrol_times_out(tmp_path, monkeypatch):
    (tmp_path / "scontrol").write_text("#!/bin/sh\nexec /bin/sleep 30\n")
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="did not answer within 0.5 s"):
        sc.check_runs_against_cluster(runs_for({}), timeout_s=0.5)


# ---------------------------------------------------------------- the real cluster


def queued_jobs() -> set[str]:
    out = subprocess.run(
        ["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30, check=True
    )
    return set(out.stdout.split())


@pytest.mark.slurm
@pytest.mark.parametrize(
    ("machine", "key"),
    [
        ({"partition": "nosuch"}, "machine.partition is 'nosuch'"),
        ({"account": "nosuch"}, "machine.account is 'nosuch'"),
        ({"nodes": 3}, "machine.nodes is 3"),
        ({"gpus_per_node": 4}, "machine.gpus_per_node is 4"),
        ({"partition": "short", "time_min": 30}, "machine.time_min is 30"),
        ({"mem_gb": 100}, "machine.mem_gb is 100"),
        ({"cpus_per_task": 8}, "machine.cpus_per_task is 8"),
    ],
)
def test_real_cluster_rejects_before_queueing(slurm_cluster, machine, key):
    before = queued_jobs()
    with pytest.raises(ConfigError) as info:
        sc.check_runs_against_cluster(runs_for(machine))
    assert str(info.value).startswith(f"runs ('big'): {key}")
    # the checks only read: no job was queued (one queued before may have ended meanwhile)
    assert queued_jobs() <= before


@pytest.mark.slurm
def test_real_cluster_accepts_what_fits(slurm_cluster):
    before = queued_jobs()
    fits = {
        "partition": slurm_cluster.short_partition,
        "account": slurm_cluster.account,
        "nodes": len(slurm_cluster.nodes),
        "gpus_per_node": 2,
        "cpus_per_task": 2,
        "mem_gb": 7,
        "time_min": 10,
    }
    sc.check_runs_against_cluster(runs_for(fits) + runs_for({}, name="defaults"))
    assert queued_jobs() <= before  # no job queued; one queued before may have ended


# ---------------------------------------------------------------- the staging job


def test_the_staging_job_must_fit_a_node_of_its_partition():
    cluster = cluster_from("testbed")
    (run,) = runs_for({"stage": {"cpus": 4, "mem_gb": 4}})
    sc.check_stage_job(run, cluster)  # the defaults' sizes fit the testbed's nodes
    cases = [
        ({"cpus": 8}, "machine.stage.cpus is 8 but the nodes of partition 'debug' have at most "
                      "4 CPUs; set machine.stage.cpus <= 4"),
        ({"mem_gb": 9}, "machine.stage.mem_gb is 9 but partition 'debug' gives a node at most "
                        "8000 MB; set machine.stage.mem_gb <= 7.8"),
        ({"partition": "short", "time_min": 30}, "machine.stage.time_min is 30 but partition "
                                                 "'short' allows at most 10 min"),
        ({"partition": "nope"}, "machine.partition is 'nope' but the cluster has no such"),
    ]  # fmt: skip
    for stage, expected in cases:
        (run,) = runs_for({"stage": stage})
        with pytest.raises(ConfigError, match=re.escape(expected)):
            sc.check_stage_job(run, cluster)


def test_the_default_staging_cpus_fit_a_partition_of_smaller_nodes():
    """Left unset, machine.stage.cpus asks for 4 CPUs, or a node's all where the partition's
    nodes have fewer (never a refusal of the user's first --profile slurm); a number the
    user wrote is asked for as written, and refused where no node has it."""
    nodes = re.sub(r"CPU(Tot|Efctv)=4", r"CPU\1=2", captured("testbed_nodes.txt"))
    small = sc.Cluster(sp.parse_partitions(captured("testbed_partitions.txt")),
                       sp.parse_nodes(nodes), "alice", None, None)  # fmt: skip
    (unset,) = runs_for({})
    assert ddpconfig.stage_cpus(unset) == 4  # before the cluster is asked (or without it)
    sc.check_stage_job(unset, small)
    assert ddpconfig.stage_job_resources(unset)["cpus_per_task"] == 2
    (unset,) = runs_for({})
    sc.check_stage_job(unset, cluster_from("testbed"))
    assert ddpconfig.stage_job_resources(unset)["cpus_per_task"] == 4
    (written,) = runs_for({"stage": {"cpus": 4}})
    with pytest.raises(ConfigError, match="machine.stage.cpus is 4 but the nodes of partition "
                                          "'debug' have at most 2 CPUs"):  # fmt: skip
        sc.check_stage_job(written, small)


def test_the_default_staging_memory_fits_nodes_of_4000_mb_and_the_job_asks_the_same(
    monkeypatch,
):
    """Left unset, machine.stage.mem_gb asks for 4 GB, or a node's all where the partition's
    nodes have less (4000 MB: the issue's cluster); the staging job's own Snakemake, which
    cannot ask the cluster, takes the CPUs and memory fitted on the login node, so srun
    inside the job is asked for what the job holds."""
    nodes = re.sub(r"CPU(Tot|Efctv)=4", r"CPU\1=2", captured("testbed_nodes.txt"))
    nodes = re.sub(r"RealMemory=8000", "RealMemory=4000", nodes)
    small = sc.Cluster(sp.parse_partitions(captured("testbed_partitions.txt")),
                       sp.parse_nodes(nodes), "alice", None, None)  # fmt: skip
    (login,) = runs_for({})
    assert ddpconfig.stage_job_resources(login)["mem_mb"] == 4096  # unfitted: the default
    sc.check_stage_job(login, small)
    fitted = ddpconfig.stage_job_resources(login)
    assert (fitted["cpus_per_task"], fitted["mem_mb"]) == (2, 4000)
    monkeypatch.delenv(machine_config.STAGE_FITTED, raising=False)
    machine_config.export_fitted_stage([login])
    (job,) = runs_for({})  # the staging job's parse: no cluster to ask
    machine_config.apply_fitted_stage([job])
    assert ddpconfig.stage_job_resources(job) == fitted
    (written,) = runs_for({"stage": {"mem_gb": 2, "cpus": 1}})  # numbers stay as written
    machine_config.apply_fitted_stage([written])
    assert (written["machine"]["stage"]["cpus"], written["machine"]["stage"]["mem_gb"]) == (1, 2)


def test_where_staging_runs_and_what_its_job_asks_for():
    slurm = runs_for({"partition": "debug", "account": "ddpflow", "stage": {"cpus": 2}})
    assert ddpconfig.stage_where(slurm, "slurm") == "job"
    assert ddpconfig.stage_where(slurm, "local") == "login"
    assert ddpconfig.stage_job_resources(slurm[0]) == {
        "cpus_per_task": 2, "mem_mb": 4096, "runtime": 60, "nodes": 1, "tasks": 1,
        "slurm_partition": "debug", "slurm_account": "ddpflow",
    }  # fmt: skip
    login = runs_for({"stage": {"where": "login"}})
    assert ddpconfig.stage_where(login, "slurm") == "login"
    with pytest.raises(ConfigError, match="machine.stage.where: job stages in a Slurm job"):
        ddpconfig.stage_where(runs_for({"stage": {"where": "job"}}), "local")
    mixed = [*login, *runs_for({"stage": {"where": "job"}}, name="other")]
    with pytest.raises(ConfigError, match=r"differs between runs \('big' login, 'other' job\)"):
        ddpconfig.stage_where(mixed, "slurm")


def test_runs_that_differ_in_partition_and_account_each_stage_where_they_ask():
    """A key one run sets and another does not is "" for the other (the plugin's default
    partition and account, as if absent), not a KeyError while Snakemake plans."""
    from types import SimpleNamespace

    (short,) = runs_for({"partition": "short", "account": "ddpflow", "qos": "normal"})
    (plain,) = runs_for({}, name="other")
    runs = {"d-short": short, "d-plain": plain}
    resources = stage_rule_resources([short, plain], lambda dataset: runs[dataset])
    asked = {
        dataset: {key: value(SimpleNamespace(dataset=dataset)) for key, value in resources.items()}
        for dataset in runs
    }
    assert asked["d-short"]["slurm_partition"] == "short"
    assert asked["d-short"]["slurm_extra"] == "--qos=normal"
    assert asked["d-plain"]["slurm_partition"] == asked["d-plain"]["slurm_account"] == ""
    assert asked["d-plain"]["slurm_extra"] == "" and asked["d-plain"]["cpus_per_task"] == 4
