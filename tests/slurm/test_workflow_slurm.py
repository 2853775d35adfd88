"""The whole pipeline on the real Slurm test cluster: profiles/slurm, submitit's Slurm
executor, 2 nodes x 2 ranks across network namespaces; plain sbatch; interrupt/reattach."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from slurm_helpers import job_ids, job_story, sacct_state
from snakemake.common import get_appdirs
from workflow_helpers import BIN, REPO, jobs_planned, snakemake, snakemake_command, write_config

pytestmark = pytest.mark.slurm

# 4 ranks (2 nodes x 2) take one micro-batch of 32 each per step of 128
SCIENCE = {
    "train": {"epochs": 4, "progress": False, "global_batch_size": 128, "micro_batch_size": 32}
}
CLUSTER_MACHINE = {
    "nodes": 2,
    "cpu_ranks_per_node": 2,
    "partition": "debug",
    "account": "ddpflow",
    "mem_gb": 1,
    "time_min": 10,
    "pg_timeout_s": 60,
    # staging is not what most of these tests are about: it runs on the login node here (the
    # pre-machine.stage behaviour); slurm_run stages in a Slurm job, the default under Slurm
    "stage": {"where": "login"},
}
FAST_POLL = [
    "--slurm-init-seconds-before-status-checks",
    "2",
    "--seconds-between-status-checks",
    "3",
    "--latency-wait",
    "5",
]


def slurm_snakemake(workdir: Path, configfile: Path, *args: str, **kwargs):
    return snakemake(
        workdir, configfile, "--profile", str(REPO / "profiles/slurm"), *FAST_POLL, *args, **kwargs
    )


def named_profile_snakemake(workdir: Path, configfile: Path, *args: str, **kwargs):
    """`snakemake --profile slurm`, the profile found by name as users type it: `make run` /
    `make test` link profiles/slurm into Snakemake's user profile folder."""
    linked = Path(get_appdirs().user_config_dir) / "slurm"
    assert (linked / "config.yaml").is_file(), f"{linked} missing: run `make profile`"
    return snakemake(workdir, configfile, "--profile", "slurm", *FAST_POLL, *args, **kwargs)


@pytest.fixture(scope="module")
def slurm_run(slurm_cluster, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("slurm-run")
    # staging in a Slurm job (machine.stage); no machine.account: the user's default one,
    # which the staging job is given (the plugin's own guess of it fails on Slurm 22.05)
    machine = {**CLUSTER_MACHINE, "account": None, "stage": {}}
    configfile = write_config(
        workdir / "config.yaml", {**SCIENCE, "machine": machine, "runs": [{"name": "cnn"}]}
    )
    started = time.monotonic()
    result = named_profile_snakemake(workdir, configfile)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "invalid option" not in output and "slurm_account=ddpflow" in output, output[-4000:]
    return workdir, time.monotonic() - started


def test_profile_runs_whole_pipeline_on_two_nodes(slurm_run):
    workdir, _ = slurm_run
    metrics = json.loads((workdir / "results/runs/cnn/eval_metrics.json").read_text())
    train = metrics["train"]
    assert train["launcher"] == "slurm" and train["world_size"] == 4 and train["nodes"] == 2
    assert sorted(set(train["hosts"])) == ["node1", "node2"]
    assert sorted(set(metrics["hosts"])) == ["node1", "node2"]
    assert metrics["samples_evaluated"] == metrics["test_size"]
    assert (workdir / "results/report/report.html").stat().st_size > 0
    # one allocation per run: the training job evaluated before it released its ranks
    ids = job_ids(workdir / "logs/submitit/cnn/train")
    assert len(ids) == 1, f"expected one Slurm job, found {ids}"
    assert sacct_state(ids[0]) == "COMPLETED"
    assert not (workdir / "logs/submitit/cnn/evaluate").exists(), "a second job was queued"
    assert metrics["evaluated_by"] == "train job"
    # nothing open to other users: the job's and the run's folders are the user's alone
    job_folder, work = workdir / "logs/submitit/cnn/train", workdir / "results/work/cnn"
    assert stat.S_IMODE(job_folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(work.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in job_folder.glob("*.pkl")} == {0o600}
    assert stat.S_IMODE((work / "fingerprint.json").stat().st_mode) == 0o600
    # staging ran in a Slurm job of its own (machine.stage), which its log names
    (stage_log,) = (workdir / "logs/stage").glob("*.log")
    staged_by = re.search(r"in Slurm job (\d+) on node\d \(4 threads\)", stage_log.read_text())
    assert staged_by, stage_log.read_text()
    # named like ddpflow's own jobs (profiles/slurm: slurm-jobname-prefix)
    name = subprocess.run(["sacct", "-nX", "-j", staged_by.group(1), "-o", "JobName%60"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert name.startswith("ddpflow-stage_"), name
    # cluster efficiency from the cluster's accounting, in the report (issue 14)
    assert train["slurm_job_id"] == ids[0]
    summary = json.loads((workdir / "results/report/summary.json").read_text())
    (job,) = summary["insight"]["cnn"]["slurm_jobs"]
    assert job["job_id"] == ids[0] and job["stage"] == "train" and job["state"] == "COMPLETED"
    assert job["nodes"] == 2 and job["limit_s"] == 600 and 0 < job["elapsed_s"] < 600
    assert 0 < job["cpu_efficiency"] <= 1.05, job  # 4 ranks x 1 CPU, busy most of the job
    assert job["mem_used_mib"] > 100 and job["mem_asked_mib"] == 1024, job
    report = (workdir / "results/report/report.md").read_text()
    assert "## Cluster efficiency (Slurm)" in report and f"| {ids[0]} | COMPLETED |" in report


def test_a_work_folder_others_can_write_is_refused_before_a_job_is_queued(slurm_cluster, tmp_path):
    configfile = write_config(
        tmp_path / "config.yaml", {**SCIENCE, "machine": CLUSTER_MACHINE, "runs": [{"name": "cnn"}]}
    )
    work = tmp_path / "results/work/cnn"
    work.mkdir(parents=True)
    os.chmod(work, 0o777)
    result = slurm_snakemake(tmp_path, configfile)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "results/work/cnn: its group and every user can write it (mode 0777)" in output, output[
        -3000:
    ]
    assert "chmod 700" in output
    train_jobs = tmp_path / "logs/submitit/cnn/train"
    assert not train_jobs.exists() or not job_ids(train_jobs)  # nothing was queued
    assert stat.S_IMODE(work.stat().st_mode) == 0o777  # refused, not changed behind the user


def test_a_run_that_cannot_fit_its_memory_is_refused_before_anything_is_queued(
    slurm_cluster, tmp_path
):
    """ResNet-50 at micro-batch 256 with Adam in machine.mem_gb 1 (2 ranks a node): refused
    while Snakemake parses, naming the estimate, before the staging job (the default under
    Slurm) or the training job is queued; nothing is written under logs/ or results/. The
    knobs offered fit the partition, and following them is accepted."""
    machine = {**CLUSTER_MACHINE, "stage": {}}  # staging would be the first job queued
    train = {**SCIENCE["train"], "global_batch_size": 1024, "micro_batch_size": 256}
    science = {"model": {"name": "resnet50"}, "train": {**train, "optimizer": {"name": "adam"}}}
    configfile = write_config(
        tmp_path / "config.yaml", {**science, "machine": machine, "runs": [{"name": "big"}]}
    )
    before = _my_job_count()
    result = slurm_snakemake(tmp_path, configfile)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    found = re.search(r"run 'big': about ([\d.]+) GB per rank \(parameters 0\.09, ", output)
    assert found, output[-3000:]
    assert float(found[1]) > 0.5, output[-3000:]  # the activations alone are gigabytes
    assert "does not fit the 0.50 GB a rank has (machine.mem_gb 1 over 2 ranks per node)" in output
    assert _my_job_count() == before  # neither the staging nor the training job was queued
    assert not (tmp_path / "logs").exists() and not (tmp_path / "results").exists()
    # only knobs that fit alone and within partition 'debug' (8000 MB nodes): more memory,
    # here; fsdp, checkpointing and bf16 leave the rank over its 0.50 GB and are not offered
    knobs = output.split("To fit: ")[1].splitlines()[0]
    offered = re.search(r"machine\.mem_gb ([\d.]+) or more", knobs)
    assert offered and 1 < float(offered[1]) <= 8000 / 1024, knobs
    for knob in ("train.strategy: fsdp", "activation_checkpointing", "bf16"):
        assert knob not in knobs, knobs
    # and following it is accepted by the cluster check and the estimate alike
    followed = {**machine, "mem_gb": float(offered[1])}
    configfile = write_config(
        tmp_path / "config.yaml", {**science, "machine": followed, "runs": [{"name": "big"}]}
    )
    result = slurm_snakemake(tmp_path, configfile, "-n")
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "does not fit" not in output, output[-3000:]
    assert not re.search(r": 1\d\d% of the", output), output[-3000:]  # no warning over 100%


def _my_job_count() -> int:
    done = subprocess.run(
        ["sacct", "-n", "-X", "-o", "JobID", "-S", "now-1days"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return len(done.stdout.split())


def test_accuracy_equals_local_run(slurm_run, tmp_path):
    """Same config, seed and world size (4) on one machine: gloo sums gradients in the same
    order whatever the transport, so the results are identical, not just close."""
    workdir, _ = slurm_run
    local_machine = {"nodes": 1, "cpu_ranks_per_node": 4}
    configfile = write_config(
        tmp_path / "config.yaml", {**SCIENCE, "machine": local_machine, "runs": [{"name": "cnn"}]}
    )
    result = snakemake(tmp_path, configfile)
    assert result.returncode == 0, result.stderr[-3000:]
    local = json.loads((tmp_path / "results/runs/cnn/eval_metrics.json").read_text())
    remote = json.loads((workdir / "results/runs/cnn/eval_metrics.json").read_text())
    assert local["train"]["world_size"] == remote["train"]["world_size"] == 4
    assert remote["accuracy"] == local["accuracy"]
    assert remote["confusion_matrix"] == local["confusion_matrix"]
    losses = [
        [
            json.loads(line)["train_loss"]
            for line in (root / "results/runs/cnn/train_metrics.jsonl").read_text().splitlines()
        ]
        for root in (tmp_path, workdir)
    ]
    assert losses[0] == losses[1]

    # The same science switched between launchers retrains nothing, in both directions:
    # the local outputs are up to date for --profile slurm (2 nodes x 2 ranks) ...
    slurm_config = write_config(
        tmp_path / "slurm.yaml", {**SCIENCE, "machine": CLUSTER_MACHINE, "runs": [{"name": "cnn"}]}
    )
    slurm_args = ("--profile", "slurm", *FAST_POLL)
    assert jobs_planned(tmp_path, slurm_config, *slurm_args) == set()
    # ... and the Slurm outputs for the local launcher (1 node x 4 ranks)
    assert jobs_planned(workdir, configfile) == set()
    # a change that does matter is named in one short line
    seed = {"train": {**SCIENCE["train"], "seed": 1}, "machine": local_machine}
    dry = snakemake(
        tmp_path, write_config(tmp_path / "seed.yaml", {**seed, "runs": [{"name": "cnn"}]}), "-n"
    )
    reason = next(line for line in dry.stdout.splitlines() if "Params have changed" in line)
    assert "train.seed=1" in reason and len(reason) < 300, reason


FSDP_SCIENCE = {"train": {**SCIENCE["train"], "strategy": "fsdp"}, "runs": [{"name": "cnn"}]}


@pytest.fixture(scope="module")
def fsdp_local(tmp_path_factory) -> Path:
    """The fsdp run on one machine, 4 local ranks: what the sharded runs on 2 nodes equal."""
    local_dir = tmp_path_factory.mktemp("fsdp-local")
    local_machine = {"nodes": 1, "cpu_ranks_per_node": 4}
    local = snakemake(
        local_dir, write_config(local_dir / "c.yaml", {**FSDP_SCIENCE, "machine": local_machine})
    )
    assert local.returncode == 0, local.stderr[-3000:]
    return local_dir


def _sharded_on_two_nodes(workdir: Path, science: dict) -> tuple[dict, list[float]]:
    """(eval_metrics.json, the epochs' train losses) of `science` run on 2 nodes x 2 ranks;
    each rank wrote its file of every DCP checkpoint into the shared work folder."""
    workdir.mkdir()
    remote = slurm_snakemake(
        workdir, write_config(workdir / "c.yaml", {**science, "machine": CLUSTER_MACHINE})
    )
    assert remote.returncode == 0, (remote.stdout + remote.stderr)[-4000:]
    (kept,) = (workdir / "results/work/cnn/checkpoints").glob("ckpt-*.dcp")
    assert sorted(p.name for p in kept.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    return _metrics_and_losses(workdir)


def _metrics_and_losses(root: Path) -> tuple[dict, list[float]]:
    metrics = json.loads((root / "results/runs/cnn/eval_metrics.json").read_text())
    lines = (root / "results/runs/cnn/train_metrics.jsonl").read_text().splitlines()
    return metrics, [json.loads(line)["train_loss"] for line in lines]


def test_fsdp_on_two_nodes_trains_what_it_trains_on_one_machine(
    slurm_cluster, fsdp_local, tmp_path
):
    """train.strategy: fsdp across 2 nodes x 2 ranks: each rank writes its shards of every
    checkpoint (DCP) into the shared work folder, and the run equals a local 4-rank one."""
    metrics, losses = _sharded_on_two_nodes(tmp_path / "slurm", FSDP_SCIENCE)
    local_metrics, local_losses = _metrics_and_losses(fsdp_local)
    assert sorted(set(metrics["train"]["hosts"])) == ["node1", "node2"]
    assert metrics["confusion_matrix"] == local_metrics["confusion_matrix"]
    assert metrics["accuracy"] == local_metrics["accuracy"] > 0.95
    assert losses == local_losses


def test_hsdp_on_two_nodes_shards_within_a_node(slurm_cluster, fsdp_local, tmp_path):
    """train.strategy: hsdp across 2 nodes x 2 ranks: a 2 x 2 mesh (a node's two ranks share
    one sharded copy, the nodes replicate it), the same science as fsdp: its losses equal
    the local fsdp run's within float rounding (the gradients summed in another order), and
    its test predictions the same."""
    science = {**FSDP_SCIENCE, "train": {**FSDP_SCIENCE["train"], "strategy": "hsdp"}}
    metrics, losses = _sharded_on_two_nodes(tmp_path / "slurm", science)
    local_metrics, local_losses = _metrics_and_losses(fsdp_local)
    rank0 = next((tmp_path / "slurm/logs/submitit/cnn/train").glob("*_0_log.err")).read_text()
    assert "hsdp mesh: 2 replicas x 2 shards" in rank0, rank0[-2000:]
    assert sorted(set(metrics["train"]["hosts"])) == ["node1", "node2"]
    assert metrics["confusion_matrix"] == local_metrics["confusion_matrix"]
    # each epoch's mean loss after 4 epochs of sums in another order: ~1e-5 apart measured
    assert losses == pytest.approx(local_losses, rel=1e-4)


def test_deleted_evaluation_is_scored_alone_in_a_job_of_its_own(slurm_run):
    """After the training job's evaluation is published, deleting eval_metrics.json scores
    the model again in an evaluate job on the cluster, without retraining: same counts."""
    workdir, _ = slurm_run
    published = workdir / "results/runs/cnn/eval_metrics.json"
    before = json.loads(published.read_text())
    model_mtime = (workdir / "results/runs/cnn/model.pt").stat().st_mtime_ns
    published.unlink()
    result = slurm_snakemake(workdir, workdir / "config.yaml")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    (job,) = job_ids(workdir / "logs/submitit/cnn/evaluate")
    assert sacct_state(job) == "COMPLETED", job_story(job, workdir / "logs/submitit/cnn/evaluate")
    after = json.loads(published.read_text())
    assert after["evaluated_by"] == "evaluate job" and sorted(set(after["hosts"])) == [
        "node1",
        "node2",
    ]
    for key in ("confusion_matrix", "correct", "samples_evaluated", "loss"):
        assert after[key] == before[key], key
    assert (workdir / "results/runs/cnn/model.pt").stat().st_mtime_ns == model_mtime
    # the report's cluster efficiency lists both jobs of the run now
    summary = json.loads((workdir / "results/report/summary.json").read_text())
    jobs = {j["stage"]: j for j in summary["insight"]["cnn"]["slurm_jobs"]}
    assert jobs["evaluate"]["job_id"] == job and jobs["evaluate"]["state"] == "COMPLETED"
    assert jobs["train"]["job_id"] == after["train"]["slurm_job_id"]


def test_predict_runs_in_a_slurm_job_on_the_runs_nodes(slurm_run):
    """`snakemake --profile slurm predict`: the staged test images as an npz, scored in one
    Slurm job on the run's 2 nodes x 2 ranks, give the evaluation's confusion matrix; the
    training is not redone."""
    import csv

    import numpy as np

    workdir, _ = slurm_run
    staged = next((workdir / "results/staged").glob("digits-*"))
    manifest = json.loads((staged / "manifest.json").read_text())
    images = np.concatenate([np.load(staged / s["file"]) for s in manifest["shards"]["test"]])
    labels = np.load(staged / "test_labels.npy")
    np.savez(workdir / "test.npz", images=images)
    configfile = workdir / "config.yaml"
    config = yaml.safe_load(configfile.read_text())
    write_config(configfile, {**config, "predict": {"input": "test.npz"}})
    dry = named_profile_snakemake(workdir, configfile, "-n")  # predict: is no run's science
    assert "Nothing to be done" in dry.stdout + dry.stderr, (dry.stdout + dry.stderr)[-3000:]
    model_mtime = (workdir / "results/runs/cnn/model.pt").stat().st_mtime_ns
    result = named_profile_snakemake(workdir, configfile, "predict")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    (job,) = job_ids(workdir / "logs/submitit/cnn/predict")
    assert sacct_state(job) == "COMPLETED", job_story(job, workdir / "logs/submitit/cnn/predict")
    summary = json.loads((workdir / "results/runs/cnn/predictions.json").read_text())
    assert summary["world_size"] == 4 and summary["hosts"] == ["node1", "node2"]
    with (workdir / "results/runs/cnn/predictions.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    names = manifest["class_names"]
    assert [row["path"] for row in rows] == [f"images[{i}]" for i in range(len(labels))]
    matrix = [[0] * len(names) for _ in names]
    for row, label in zip(rows, labels, strict=True):
        matrix[int(label)][names.index(row["prediction"])] += 1
    evaluation = json.loads((workdir / "results/runs/cnn/eval_metrics.json").read_text())
    assert matrix == evaluation["confusion_matrix"]
    assert (workdir / "results/runs/cnn/model.pt").stat().st_mtime_ns == model_mtime


def _node_local_lines(folder: Path, job_id: str) -> list[str]:
    """The "node-local data on <host>: ..." lines of one job (local rank 0 of each node)."""
    return [
        line.split("node-local data on ", 1)[1]
        for log in sorted(folder.glob(f"{job_id}_*_log.err"))
        for line in log.read_text(errors="replace").splitlines()
        if "node-local data on " in line
    ]


def test_node_local_copy_is_made_once_per_node_and_reused_by_the_next_job(slurm_cluster, tmp_path):
    """data.loading.node_local_dir with $SLURMD_NODENAME (set by slurmd in every task): local
    rank 0 of each node copies the staged data to its own node's folder and verifies it; a
    retrain in a later job reuses both copies and trains bitwise the same weights."""
    scratch = tmp_path / "scratch"  # one filesystem on the testbed: a folder per node
    configfile = write_config(
        tmp_path / "config.yaml",
        {
            "data": {"loading": {"node_local_dir": f"{scratch}/$SLURMD_NODENAME/ddpflow"}},
            **SCIENCE,
            "machine": CLUSTER_MACHINE,
            "runs": [{"name": "cnn"}],
        },
    )
    folder = tmp_path / "logs/submitit/cnn/train"
    result = slurm_snakemake(tmp_path, configfile)
    stories = "\n".join(job_story(job, folder, tail=800) for job in job_ids(folder))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:] + stories
    (first_job,) = job_ids(folder)
    assert sacct_state(first_job) == "COMPLETED", job_story(first_job, folder)
    metrics = json.loads((tmp_path / "results/runs/cnn/eval_metrics.json").read_text())
    assert metrics["train"]["world_size"] == 4 and metrics["train"]["nodes"] == 2
    assert sorted(set(metrics["train"]["hosts"])) == ["node1", "node2"]
    assert metrics["samples_evaluated"] == metrics["test_size"]
    assert metrics["accuracy"] > 0.95, metrics["accuracy"]

    (staged,) = (tmp_path / "results/staged").iterdir()
    manifest = (staged / "manifest.json").read_bytes()
    copies = {node: scratch / node / "ddpflow" / staged.name for node in ("node1", "node2")}
    for copy in copies.values():
        assert (copy / ".verified").read_bytes() == manifest, copy
        assert (copy / "manifest.json").read_bytes() == manifest, copy
    assert sorted(p.name for p in scratch.iterdir()) == ["node1", "node2"]  # nothing unexpanded
    lines = _node_local_lines(folder, first_job)
    assert sorted(line.split(" in ")[0] for line in lines) == [
        f"{node}: copied to {copy}" for node, copy in copies.items()
    ], lines
    first = torch.load(tmp_path / "results/runs/cnn/model.pt", weights_only=True)["state_dict"]

    # a retrain in a new job: each node reuses its verified copy (hashed again, not copied)
    (tmp_path / "results/runs/cnn/model.pt").unlink()
    result = slurm_snakemake(tmp_path, configfile)
    stories = "\n".join(job_story(job, folder, tail=800) for job in job_ids(folder))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:] + stories
    (second_job,) = set(job_ids(folder)) - {first_job}
    assert sacct_state(second_job) == "COMPLETED", job_story(second_job, folder)
    lines = _node_local_lines(folder, second_job)
    assert sorted(line.split(" in ")[0] for line in lines) == [
        f"{node}: reused the verified copy {copy}" for node, copy in copies.items()
    ], lines
    log = (tmp_path / "logs/train/cnn.log").read_text()  # the rerun's (rewritten per job)
    assert f"as slurm job {second_job} " in log and "training from scratch" in log, log
    again = torch.load(tmp_path / "results/runs/cnn/model.pt", weights_only=True)["state_dict"]
    assert again.keys() == first.keys()
    assert all(torch.equal(first[key], again[key]) for key in first)


def test_plain_sbatch_script(slurm_cluster, tmp_path):
    config = write_config(
        tmp_path / "config.yaml",
        {
            **SCIENCE,
            "results_dir": str(tmp_path / "results"),
            "machine": {"cpu_ranks_per_node": 2},
            "runs": [{"name": "batch"}],
        },
    )
    env = {**os.environ, "DDPFLOW_PYTHON": str(BIN / "python")}
    result = subprocess.run(
        [
            "sbatch",
            "--wait",
            "--nodes=2",
            "--ntasks-per-node=2",
            "--partition=debug",
            "--account=ddpflow",
            "--mem=1G",
            f"--output={tmp_path}/sbatch-%j.out",
            str(REPO / "scripts/sbatch_train.sh"),
            str(config),
            "batch",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=env,
    )
    logs = "".join(p.read_text() for p in tmp_path.glob("sbatch-*.out"))
    assert result.returncode == 0, result.stderr + logs[-3000:]
    metrics = json.loads((tmp_path / "results/runs/batch/eval_metrics.json").read_text())
    assert metrics["train"]["launcher"] == "slurm"
    assert sorted(set(metrics["train"]["hosts"])) == ["node1", "node2"]
    assert metrics["samples_evaluated"] == metrics["test_size"]
    assert metrics["accuracy"] > 0.8


def _start_and_wait_for_running_train(workdir: Path, configfile: Path) -> subprocess.Popen:
    cmd, env = snakemake_command(
        workdir, configfile, "--profile", str(REPO / "profiles/slurm"), *FAST_POLL
    )
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=open(workdir / "smk.err", "w"),  # noqa: SIM115 - lives as long as the process
        env=env,
        cwd=workdir,
        start_new_session=True,
        # as from a terminal: a CI started in the background (a non-interactive shell's
        # `&`) passes SIGINT down ignored, and Snakemake then rightly ignores it
        preexec_fn=_default_sigint,
    )
    folder = workdir / "logs/submitit/long/train"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        ids = job_ids(folder) if folder.exists() else []
        if ids and "epoch 1/" in (folder / f"{ids[0]}_0_log.err").read_text(errors="replace"):
            return proc
        assert proc.poll() is None, (workdir / "smk.err").read_text()[-3000:]
        time.sleep(1)
    proc.kill()
    raise AssertionError("training never started on the cluster")


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)  # what Ctrl-C / a dropped session amounts to
    proc.wait(timeout=120)


def _long_config(workdir: Path, cancel: bool, epochs: int = 40) -> Path:
    machine = {**CLUSTER_MACHINE, "cancel_on_interrupt": cancel}
    return write_config(
        workdir / "config.yaml",
        {
            "train": {**SCIENCE["train"], "epochs": epochs},
            "machine": machine,
            "runs": [{"name": "long"}],
        },
    )


def test_stopping_snakemake_cancels_the_job(slurm_cluster, tmp_path):
    """SIGINT to Snakemake's own PID (not its process group: Snakemake itself does not signal
    running rules) cancels the Slurm job; nothing is left in the queue. 400 epochs: 40 (about
    10 s on the test cluster) could end before Snakemake saw the signal, under CI's load."""
    configfile = _long_config(tmp_path, cancel=True, epochs=400)
    proc = _start_and_wait_for_running_train(tmp_path, configfile)
    job_id = job_ids(tmp_path / "logs/submitit/long/train")[0]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) != 0
    assert sacct_state(job_id) == "CANCELLED"
    # the error hook waited for the train rule to cancel its job and say so: interrupted,
    # with the command that goes on (not "failed", not a report of a finished run)
    said = (tmp_path / "smk.err").read_text()
    assert "ddpflow: run 'long': train interrupted" in said, said[-3000:]
    assert "its train rule failed" not in said and "report of the 0 finished of 1 run" in said
    # COMPLETING (CG) while Slurm kills the ranks (KillWait), then gone: nothing orphaned
    deadline = time.monotonic() + 60
    while _in_queue(job_id) and time.monotonic() < deadline:
        time.sleep(1)
    assert not _in_queue(job_id), "job still in the queue a minute after Snakemake stopped"


def _in_queue(job_id: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True)
    return bool(out.stdout.strip())


def test_rerun_reattaches_to_the_running_job(slurm_cluster, tmp_path):
    configfile = _long_config(tmp_path, cancel=False)
    proc = _start_and_wait_for_running_train(tmp_path, configfile)
    folder = tmp_path / "logs/submitit/long/train"
    job_id = job_ids(folder)[0]
    _stop(proc)
    assert _in_queue(job_id), "the job should survive the stop"
    result = slurm_snakemake(tmp_path, configfile)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert job_ids(folder) == [job_id], "a second training job was submitted"
    log = (tmp_path / "logs/train/long.log").read_text()
    assert re.search(
        rf"Slurm job {job_id}, submitted for this config earlier, "
        r"(still runs|has finished): reattaching to it",
        log,
    ), log[-2000:]
    assert sacct_state(job_id) == "COMPLETED", job_story(job_id, folder)


def test_edited_config_cancels_the_detached_job_instead_of_reattaching(slurm_cluster, tmp_path):
    """A job kept running after Snakemake stopped (cancel_on_interrupt: false), then the
    config edited: the rerun must not reattach to the outdated job, nor leave it running
    and writing into the run's work folder; it cancels it and trains the new config."""
    configfile = _long_config(tmp_path, cancel=False)
    proc = _start_and_wait_for_running_train(tmp_path, configfile)
    folder = tmp_path / "logs/submitit/long/train"
    old_job = job_ids(folder)[0]
    _stop(proc)
    assert _in_queue(old_job), "the job should survive the stop"
    edited = {
        "train": {**SCIENCE["train"], "epochs": 2, "optimizer": {"lr": 0.02}},
        "machine": {**CLUSTER_MACHINE, "cancel_on_interrupt": False},
        "runs": [{"name": "long"}],
    }
    result = slurm_snakemake(tmp_path, write_config(tmp_path / "config.yaml", edited))
    stories = "\n".join(job_story(job, folder, tail=800) for job in job_ids(folder))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:] + stories
    assert sacct_state(old_job) == "CANCELLED"
    new_jobs = [job for job in job_ids(folder) if job != old_job]
    assert len(new_jobs) == 1 and sacct_state(new_jobs[0]) == "COMPLETED"
    log = (tmp_path / "logs/train/long.log").read_text()
    assert f"cancelling Slurm job {old_job}" in log
    assert "train.optimizer.lr 0.05 -> 0.02" in log and "training from scratch" in log
    assert "reattaching" not in log


def test_a_failed_run_spares_the_other_and_the_report_names_it(slurm_cluster, tmp_path):
    """On Slurm as locally: a diverging run fails its jobs (retried once by the profile), the
    other run of the config trains and evaluates on the cluster, and the report of it names
    the failed run and why."""
    one_node = {**CLUSTER_MACHINE, "nodes": 1}
    configfile = write_config(
        tmp_path / "config.yaml",
        {
            "train": {"epochs": 2, "progress": False, "warmup_epochs": 0},
            "machine": one_node,
            "runs": [{"name": "steady"}, {"name": "wild", "train": {"optimizer": {"lr": 1e12}}}],
        },
    )
    result = slurm_snakemake(tmp_path, configfile)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    wild_jobs = job_ids(tmp_path / "logs/submitit/wild/train")
    assert len(wild_jobs) == 2, f"the profile retries a failed rule once: {wild_jobs}"
    for job in wild_jobs:
        assert sacct_state(job) == "FAILED", job_story(job, tmp_path / "logs/submitit/wild/train")
    steady = json.loads((tmp_path / "results/runs/steady/eval_metrics.json").read_text())
    assert steady["train"]["launcher"] == "slurm" and steady["samples_evaluated"] > 0
    summary = json.loads((tmp_path / "results/report/summary.json").read_text())
    assert [row["run"] for row in summary["runs"]] == ["steady"]
    (failed,) = summary["unfinished"]
    assert failed["run"] == "wild" and "NaN or infinite" in failed["cause"], failed
    assert "ddpflow: run 'wild' did not finish (train failed: rank " in output


def test_the_shipped_config_plans_on_two_nodes(slurm_cluster, tmp_path):
    """The user's first edit on a cluster: the shipped config.yaml with only machine.nodes
    (and the test cluster's partition and account) edited plans under `--profile slurm`
    (micro_batch_size auto resolves to 16 at 2 nodes x 2 ranks; 32 was refused there)."""
    shipped = yaml.safe_load((REPO / "config/config.yaml").read_text())
    # the shipped time_min (60) needs the unlimited partition: 'short' is refused before planning
    cluster = {"partition": slurm_cluster.partition, "account": slurm_cluster.account}
    shipped["machine"].update(nodes=2, **cluster)
    dry = named_profile_snakemake(tmp_path, write_config(tmp_path / "c.yaml", shipped), "-n")
    output = dry.stdout + dry.stderr
    assert dry.returncode == 0, output[-3000:]
    assert "rule train:" in output and "configuration error" not in output, output[-3000:]
