"""Eight nodes on the real Slurm cluster, and one of them dies: an 8-node x 1 CPU rank training
through `snakemake --profile slurm`; after its first checkpoint a node (not rank 0's) dies and
stays dead. Slurm takes the node away from the job (sbatch --no-kill, as machine.min_nodes 7
allows fewer nodes) and the job's supervisor restarts the ranks on the 7 left, in the same
job, with the same global batch, from the checkpoint the 8 nodes wrote; the bad-node ledger,
the report and the terminal name the node. The node dies as in test_node_failure.py: its
slurmd stops answering, Slurm holds it DOWN and its rank is killed (its slurmstepd stays:
where that goes too, Slurm's first node waits a minute for it and is drained as well,
tests/slurm/README.md). The suite's one test at 8 nodes (the cluster is rebuilt at 8 nodes
for this module: conftest.eight_node_cluster)."""

from __future__ import annotations

import functools
import json
import re
import subprocess

import pytest
from slurm_helpers import job_story, sacct_state
from test_node_failure import job_ids_in_order, node_dead, train_and_lose
from test_workflow_slurm import CLUSTER_MACHINE
from workflow_helpers import write_config

pytestmark = pytest.mark.slurm

LOST = "node5"  # rank 4's node: rank 0 (node1) writes the checkpoints
MACHINE = {**CLUSTER_MACHINE, "nodes": 8, "min_nodes": 7, "cpu_ranks_per_node": 1}
# micro-batch auto: 14, BatchNorm's batch the largest that 8 ranks (one each) and 7 (the
# first one two) both hold, so the 7 train the same global batch and science
TRAIN = {
    "epochs": 4,
    "progress": False,
    "global_batch_size": 112,
    "micro_batch_size": "auto",
    "checkpoint": {"every_steps": 0, "every_epochs": 1},
}
MODEL = {"name": "cnn", "cnn_channels": 8}
RESUMED = re.compile(
    r"resuming from ckpt-(?P<ckpt>\d+)\.pt \(written by attempt 1\).*RESUMED from attempt 1: "
    r"resumed at epoch (?P<epoch>\d+) step (?P<step>\d+) on 7 ranks; the checkpoint was written "
    r"on 8",
    re.S,
)


def test_a_node_lost_at_eight_nodes_is_named_excluded_and_the_run_resumes_on_seven(
    eight_node_cluster, tmp_path
):
    assert len(eight_node_cluster.nodes) == 8
    configfile = write_config(
        tmp_path / "config.yaml",
        {"model": MODEL, "train": TRAIN, "machine": MACHINE, "runs": [{"name": "eight"}]},
    )
    lose = functools.partial(node_dead, eight_node_cluster, LOST)
    output, seen = train_and_lose(tmp_path, configfile, lose, "eight")
    folder = tmp_path / "logs/submitit/eight/train"
    ids = job_ids_in_order(folder)
    (job,) = ids  # one job: it went on at 7 nodes inside its allocation (sbatch --no-kill)

    # Slurm took the node away from the job (a RESIZING record) and the job completed on 7
    runs = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-j", job, "-o", "State,NodeList"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    assert "RESIZING|node[1-8]" in runs, runs
    assert sacct_state(job) == "COMPLETED", job_story(job, folder)
    shown = subprocess.run(
        ["scontrol", "--oneliner", "show", "job", job], capture_output=True, text=True, timeout=30
    ).stdout
    assert " NodeList=node[1-4,6-8] " in shown, shown

    # named: the ledger, the terminal and the report
    (entry,) = json.loads((tmp_path / "results/work/bad_nodes.json").read_text())["nodes"]
    assert (entry["node"], entry["job_id"], entry["run"]) == (LOST, job, "eight")
    assert entry["reason"].startswith(f"lost in job {job}: "), entry
    assert entry["reason"].endswith("in Slurm, taken out of the job"), entry
    assert f"the ranks of job {job} failed (exit code" in output, output[-5000:]
    seven_nodes = "node1,node2,node3,node4,node6,node7,node8"
    assert f"restart 1 inside job {job} on {seven_nodes}, 7 ranks" in output, output[-5000:]
    report = (tmp_path / "results/report/report.md").read_text()
    assert "## Bad nodes" in report and f"| {LOST} | lost in job {job}" in report

    train = json.loads((tmp_path / "results/runs/eight/eval_metrics.json").read_text())["train"]
    others = {f"node{i}" for i in range(1, 9)} - {LOST}
    assert (train["nodes"], train["world_size"], set(train["hosts"])) == (7, 7, others)

    # resumed: from a checkpoint the 8-node job wrote, no earlier than the one seen before the
    # node died, at the same global batch (8 micro-batches of 14 over 7 ranks: 2 + 1 x 6)
    rank0 = (folder / f"{job}_0_log.err").read_text(errors="replace")
    resumed = RESUMED.search(rank0)
    assert resumed, rank0[-3000:]
    step = int(resumed.group("step"))
    assert step == int(resumed.group("ckpt")) >= int(seen.stem.split("-")[1]) > 0, resumed[0]
    assert (
        "global batch 112 = micro-batch 14 x 7 ranks x 2 or 1 accumulation steps (the first 1 "
        "ranks one more)" in rank0
    ), rank0[-3000:]
    # the training's record: steps 0 to `step` on the 8 nodes, the rest on the 7
    summary = json.loads((tmp_path / "results/runs/eight/train_summary.json").read_text())
    eight, seven = summary["segments"]
    assert (eight["attempt"], eight["world_size"], eight["start_step"]) == (1, 8, 0)
    assert (seven["attempt"], seven["world_size"], seven["start_step"]) == (2, 7, step)
    assert eight["end_step"] == step and set(eight["hosts"]) == others | {LOST}
    assert set(seven["hosts"]) == others
    per_epoch = step // (int(resumed.group("epoch")) - 1)  # whole epochs were checkpointed
    assert seven["end_step"] == summary["steps"] == TRAIN["epochs"] * per_epoch
    assert "training from scratch" not in output, output[-5000:]
