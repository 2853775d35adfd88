"""train.tensor_parallel on the real Slurm test cluster: the gpt at tensor_parallel 2 on 2
nodes x 2 ranks through `--profile slurm`. srun numbers a node's ranks consecutively, so
each tensor group (ranks 0-1, 2-3) is one node's two ranks and only the data-parallel
gradient all-reduce crosses the network between the nodes' namespaces. The run records its
degree, and a dry run after editing the degree to 1 plans nothing (a machine setting)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_workflow_slurm import CLUSTER_MACHINE, slurm_snakemake
from workflow_helpers import REPO, jobs_planned, write_config

pytestmark = pytest.mark.slurm

JSON = Path(json.__file__).parent  # text that ships with Python


def _config(path: Path, tensor: int) -> Path:
    run = {
        "name": "gpt",
        "task": "language_model",
        "data": {"source": "text", "path": "corpus", "block_size": 32},
        "model": {"name": "gpt", "kwargs": {"n_layer": 2, "n_head": 2, "n_embd": 32}},
        "train": {
            "epochs": 2,
            "progress": False,
            "global_batch_size": 32,
            "micro_batch_size": 8,
            "tensor_parallel": tensor,
            "optimizer": {"name": "adamw", "lr": 0.003},
        },
    }
    return write_config(path, {"machine": CLUSTER_MACHINE, "runs": [run]})


def test_tensor_groups_stay_within_a_node(slurm_cluster, tmp_path):
    (tmp_path / "corpus").mkdir()
    for name in ("decoder.py", "encoder.py"):
        shutil.copy(JSON / name, tmp_path / "corpus" / name)
    result = slurm_snakemake(tmp_path, _config(tmp_path / "c.yaml", 2))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "4 ranks (2 data x 2 tensor-parallel) (node1, node2)" in result.stderr
    summary = json.loads((tmp_path / "results/runs/gpt/train_summary.json").read_text())
    assert summary["hosts"] == ["node1", "node1", "node2", "node2"]
    assert (summary["world_size"], summary["tensor_parallel"]) == (4, 2)
    assert summary["accumulation_steps"] == 2  # 32 = 8 x 2 data-parallel ranks x 2
    rank0 = next((tmp_path / "logs/submitit/gpt/train").glob("*_0_log.err")).read_text()
    assert "tensor parallel: 2 data x 2 tensor ranks" in rank0, rank0[-2000:]
    assert "span nodes" not in rank0
    epochs = (tmp_path / "results/runs/gpt/train_metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["train_loss"] for line in epochs]
    assert len(losses) == 2 and losses[1] < losses[0]
    metrics = json.loads((tmp_path / "results/runs/gpt/eval_metrics.json").read_text())
    assert metrics["perplexity"] > 1 and "bits_per_byte" in metrics
    at_one = _config(tmp_path / "c1.yaml", 1)
    assert jobs_planned(tmp_path, at_one, "--profile", str(REPO / "profiles/slurm")) == set()
