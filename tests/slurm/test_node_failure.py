"""A node dies under a 2-node training on the real Slurm cluster (machine.min_nodes: 1): the job
goes on at 1 node inside its allocation (by default: restarts inside the job), or, with
machine.restarts_in_job: 0, the rule's retry runs on the node left without it; the bad-node
ledger names it, the report and the terminal say so; with too few healthy nodes nothing is
submitted.

What Slurm does here (tests/slurm/README.md, "A node that fails"): the node set DOWN ends the
job's run as NODE_FAIL and Slurm requeues the job under the same id; with a live slurmd the
node is back in service within milliseconds (ReturnToService=2), so the test stops that
node's slurmd (SIGSTOP to the PID cluster.sh recorded) for the node to stay down, as a dead
one does, and restores it (SIGCONT, State=RESUME) whatever happens. Either way the job's rank
on the node is killed, as a dead or rebooted node's are: left alive, the ranks ignore the
SIGTERM that follows the NODE_FAIL and train on until Slurm's SIGKILL, which a short training
outlives (its results then stand: ddpflow.cluster.nodes.after_success)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from slurm_helpers import job_story, sacct_state
from test_workflow_slurm import CLUSTER_MACHINE, FAST_POLL, slurm_snakemake
from workflow_helpers import REPO, snakemake_command, write_config

pytestmark = pytest.mark.slurm

MACHINE = {**CLUSTER_MACHINE, "cpu_ranks_per_node": 1}
# the workflow's shared Slurm status every 2 s (15 s by default): Slurm's requeue after the
# node's loss, and the end of the job cancelled for it, are seen within seconds
QUICK = {"DDPFLOW_SLURM_POLL_S": "2"}
TRAIN = {"epochs": 40, "progress": False, "checkpoint": {"every_steps": 0, "every_epochs": 1}}


def _scontrol(*args: str) -> str:
    return subprocess.run(
        ["scontrol", *args], capture_output=True, text=True, check=True, timeout=30
    ).stdout


def _node_state(name: str) -> str:
    out = subprocess.run(
        ["sinfo", "-h", "-n", name, "-o", "%t"], capture_output=True, text=True, timeout=30
    )
    return out.stdout.split()[0] if out.stdout.split() else ""


def kill_ranks(name: str, gone_ok: bool = False) -> None:
    """SIGKILL the job's ranks on node `name`: the Python processes in its network namespace
    (cluster.sh's ddpf-<name>; its slurmd and the job's slurmstepd are left). gone_ok: a job
    submitted with --no-kill loses its step on every node at once when the node goes DOWN,
    so its rank there may be gone already."""
    netns = ["ip", "netns", "pids", f"ddpf-{name}"]
    found = subprocess.run(netns, capture_output=True, text=True, timeout=30).stdout.split()
    ranks = [int(pid) for pid in found if _command(pid).startswith("python")]
    assert ranks or gone_ok, f"no rank runs on {name}"
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _command(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:  # the process ended
        return ""


@contextlib.contextmanager
def node_dead(cluster, name: str):
    """`name` dies and stays dead until the block ends: its slurmd (a PID cluster.sh
    started) stops answering, Slurm is told the node is DOWN and the job's rank there is
    killed; then it is restored."""
    pid = int((cluster.state_dir / "pids" / f"slurmd-{name}.pid").read_text())
    os.kill(pid, signal.SIGSTOP)
    try:
        _scontrol("update", f"NodeName={name}", "State=DOWN", "Reason=ddpflow-test")
        kill_ranks(name)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
        subprocess.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"], timeout=30)
        deadline = time.monotonic() + 60
        while _node_state(name) not in ("idle", "mix", "alloc") and time.monotonic() < deadline:
            time.sleep(1)


@contextlib.contextmanager
def node_blip(cluster, name: str, gone_ok: bool = False):
    """`name` is set DOWN under the job, but its slurmd lives and answers: with
    ReturnToService=2 the node is back in service within milliseconds (a node that
    rebooted: its rank is gone); only slurmdbd's node events still name it."""
    _scontrol("update", f"NodeName={name}", "State=DOWN", "Reason=ddpflow-test")
    try:
        kill_ranks(name, gone_ok)
        yield
    finally:
        if _node_state(name).startswith("down"):
            subprocess.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"], timeout=30)


def wait_for_checkpoint(workdir: Path, proc: subprocess.Popen, run: str = "nf") -> Path:
    """The run's first checkpoint, once its training job wrote it (Snakemake still running)."""
    checkpoints = workdir / f"results/work/{run}/checkpoints"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if written := sorted(checkpoints.glob("ckpt-*.pt")):
            return written[0]
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    raise AssertionError("no checkpoint written")


def job_ids_in_order(folder: Path) -> list[str]:
    return sorted({p.name.split("_")[0] for p in folder.glob("*_0_log.out")}, key=int)


def train_and_lose(workdir: Path, configfile: Path, lose, run: str = "nf") -> tuple[str, Path]:
    """Snakemake --profile slurm trains the run; after its first checkpoint, lose() (a context
    making a node fail) holds until Snakemake ends, which must succeed: (its output, the
    checkpoint seen before the failure)."""
    cmd, env = snakemake_command(
        workdir, configfile, "--profile", str(REPO / "profiles/slurm"), *FAST_POLL, env=QUICK
    )
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=workdir
    )
    try:
        seen = wait_for_checkpoint(workdir, proc, run)
        with lose():
            output, _ = proc.communicate(timeout=480)
    finally:
        if proc.poll() is None:
            proc.kill()
    folder = workdir / f"logs/submitit/{run}/train"
    ids = job_ids_in_order(folder)
    assert proc.returncode == 0, output[-5000:] + "".join(job_story(i, folder) for i in ids)
    return output, seen


def test_failed_node_is_excluded_and_the_retry_runs_on_the_rest(slurm_cluster, tmp_path):
    """Without restarts inside the job (machine.restarts_in_job: 0), the path every lost node
    took before them: the job ends, the rule's retry runs without the node."""
    why = "(node DOWN"
    machine = {**MACHINE, "min_nodes": 1, "restarts_in_job": 0}
    configfile = write_config(
        tmp_path / "config.yaml", {"train": TRAIN, "machine": machine, "runs": [{"name": "nf"}]}
    )
    dead = functools.partial(node_dead, slurm_cluster, "node2")
    output, _ = train_and_lose(tmp_path, configfile, dead)
    folder = tmp_path / "logs/submitit/nf/train"
    ids = job_ids_in_order(folder)
    first, retry = ids  # the job that lost node2, the retry's

    # the first job: a NODE_FAIL run on both nodes; Slurm's requeue of it was cancelled
    runs = subprocess.run(
        ["sacct", "-D", "-X", "-n", "-P", "-j", first, "-o", "State,NodeList"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    assert "NODE_FAIL|node[1-2]" in runs, runs
    queued = subprocess.run(
        ["squeue", "-h", "-j", first, "-t", "PD,R,CF"], capture_output=True, text=True, timeout=30
    ).stdout
    assert queued.strip() == "", f"Slurm's requeue of job {first} was left queued: {queued}"
    # the retry: node2 excluded, ran and finished on node1 alone
    assert sacct_state(retry) == "COMPLETED", job_story(retry, folder)
    assert "#SBATCH --exclude=node2" in (folder / f"{retry}_submission.sh").read_text()
    shown = _scontrol("--oneliner", "show", "job", retry)
    assert "ExcNodeList=node2 " in shown and " NodeList=node1 " in shown, shown
    train = json.loads((tmp_path / "results/runs/nf/eval_metrics.json").read_text())["train"]
    assert (train["nodes"], train["world_size"], set(train["hosts"])) == (1, 1, {"node1"})

    (entry,) = json.loads((tmp_path / "results/work/bad_nodes.json").read_text())["nodes"]
    assert (entry["node"], entry["job_id"], entry["run"]) == ("node2", first, "nf")
    assert entry["reason"].startswith(f"NODE_FAIL in job {first}") and why in entry["reason"]
    assert f"node failure: node2 (NODE_FAIL in job {first}" in output
    assert (
        f"run 'nf': excluding node2 (NODE_FAIL in job {first}" in output
        and "running on 1 node of 2 (machine.min_nodes: 1)" in output
    ), output[-5000:]
    report = (tmp_path / "results/report/report.md").read_text()
    assert "## Bad nodes" in report and f"| node2 | NODE\\_FAIL in job {first}" in report

    # the retry continued the 2-node training from its checkpoint on 1 node (the same global
    # batch: 1 rank now accumulates both micro-batches of a step)
    rank0 = (folder / f"{retry}_0_log.err").read_text(errors="replace")
    assert "RESUMED from attempt" in rank0, rank0[-3000:]
    assert "on 1 rank; the checkpoint was written on 2" in rank0, rank0[-3000:]
    assert "training from scratch" not in output, output[-5000:]


def test_a_lost_node_shrinks_the_job_in_its_allocation(slurm_cluster, tmp_path):
    """machine.min_nodes: 1 and no spare: node2 is set DOWN under the 2-node job (back in
    service at once, its rank gone); Slurm takes it away from the job (--no-kill) and the
    job's supervisor restarts the training on node1 alone, in the same job."""
    configfile = write_config(
        tmp_path / "config.yaml",
        {"train": TRAIN, "machine": {**MACHINE, "min_nodes": 1}, "runs": [{"name": "nf"}]},
    )
    blip = functools.partial(node_blip, slurm_cluster, "node2", gone_ok=True)
    output, _ = train_and_lose(tmp_path, configfile, blip)
    folder = tmp_path / "logs/submitit/nf/train"
    ids = job_ids_in_order(folder)
    (job,) = ids
    assert sacct_state(job) == "COMPLETED", job_story(job, folder)
    train = json.loads((tmp_path / "results/runs/nf/eval_metrics.json").read_text())["train"]
    assert (train["world_size"], set(train["hosts"])) == (1, {"node1"})
    (entry,) = json.loads((tmp_path / "results/work/bad_nodes.json").read_text())["nodes"]
    assert (entry["node"], entry["job_id"]) == ("node2", job)
    assert (
        entry["reason"].startswith(f"lost in job {job}: ")
        and "taken out of the job" in entry["reason"]
    )
    assert f"restart 1 inside job {job} on node1, 1 rank, from the newest checkpoint" in output
    rank0 = (folder / f"{job}_0_log.err").read_text(errors="replace")
    assert "on 1 rank; the checkpoint was written on 2" in rank0, rank0[-3000:]
    assert "training from scratch" not in output, output[-5000:]


def test_too_few_healthy_nodes_fails_before_submitting(slurm_cluster, tmp_path):
    ledger = tmp_path / "results/work/bad_nodes.json"
    ledger.parent.mkdir(parents=True)
    entry = {
        "node": "node2",
        "reason": "NODE_FAIL in job 99",
        "job_id": "99",
        "run": "nf",
        "time": "2026-11-23T20:20:08Z",
        "failures": 1,
    }
    ledger.write_text(json.dumps({"nodes": [entry]}))
    configfile = write_config(
        tmp_path / "config.yaml",
        {"train": {**TRAIN, "epochs": 1}, "machine": MACHINE, "runs": [{"name": "nf"}]},
    )
    result = slurm_snakemake(tmp_path, configfile, "--retries", "0", timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert (
        "machine.nodes is 2 (machine.min_nodes is null) but the partition has 1 healthy "
        "node: node1; left out: node2 (NODE_FAIL in job 99, ledger "
        "results/work/bad_nodes.json). Nothing was submitted."
    ) in output, output[-3000:]
    assert "`snakemake clean_bad_nodes`" in output and "machine.min_nodes: 1" in output
    assert not list((tmp_path / "logs/submitit").glob("**/*_submission.sh")), "a job was queued"

    cleaned = slurm_snakemake(tmp_path, configfile, "clean_bad_nodes", timeout=120)
    assert cleaned.returncode == 0, (cleaned.stdout + cleaned.stderr)[-3000:]
    assert not ledger.exists()
    assert "forgot 1 node" in cleaned.stdout + cleaned.stderr
