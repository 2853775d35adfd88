"""train.micro_batch_size: auto, the shipped setting: the user's first edit (more CPU ranks,
nodes or GPUs) plans and runs, the micro-batch each run trains with is resolved before anything
runs and recorded, and the runs trained before `auto` existed keep their fingerprints.
"""

from __future__ import annotations

import json

import pytest
import yaml
from ddpflow import config as ddpconfig
from ddpflow.config import ConfigError, training_fingerprint
from workflow_helpers import REPO, jobs_planned, snakemake, write_config

SHIPPED = REPO / "config" / "config.yaml"


def _shipped(launcher: str = "local", **machine) -> dict:
    config = yaml.safe_load(SHIPPED.read_text())
    config["machine"] = {**config["machine"], **machine}
    config["launcher"] = launcher
    return config


def _run(config: dict) -> dict:
    return ddpconfig.check_runs(config)[1][0]


@pytest.mark.parametrize(
    ("launcher", "machine", "world", "micro"),
    [
        ("local", {"cpu_ranks_per_node": 1}, 1, 32),
        ("local", {"cpu_ranks_per_node": 2}, 2, 32),
        ("local", {"cpu_ranks_per_node": 4}, 4, 16),
        ("local", {"cpu_ranks_per_node": 8}, 8, 8),
        ("slurm", {"nodes": 2}, 4, 16),
        ("slurm", {"nodes": 4}, 8, 8),
        ("slurm", {"gpus_per_node": 1}, 1, 32),
        ("slurm", {"gpus_per_node": 2}, 2, 32),
        ("slurm", {"gpus_per_node": 4}, 4, 16),
        ("slurm", {"gpus_per_node": 8}, 8, 8),
        ("slurm", {"nodes": 4, "gpus_per_node": 8}, 32, 2),
    ],
)
def test_the_shipped_config_splits_at_the_sizes_users_ask_for(launcher, machine, world, micro):
    """global 64, micro auto up to 32: the largest micro-batch that splits at this size."""
    run = _run(_shipped(launcher, **machine))
    assert run["world_size"] == world
    assert run["train"]["micro_batch_size"] == micro
    assert run["micro_batch"] == {"size": micro, "auto": True, "max": 32}
    assert ddpconfig.accumulation_steps(run["train"], world) * micro * world == 64


def test_auto_at_the_shipped_size_is_the_fingerprint_of_the_runs_trained_before_it():
    """A run trained with micro_batch_size 32 (the previous shipped config, and the schema's
    default) plans nothing after the upgrade: same fingerprint, no new key in it."""
    before = _shipped()
    before["train"] = {k: v for k, v in before["train"].items() if k != "max_micro_batch_size"}
    before["train"]["micro_batch_size"] = 32
    now = _run(_shipped())
    assert training_fingerprint(now) == training_fingerprint(_run(before))
    assert not any("max_micro_batch_size" in key for key in training_fingerprint(now))


def test_a_size_the_global_batch_cannot_split_is_refused_naming_those_that_work():
    with pytest.raises(ConfigError) as err:
        _run(_shipped(cpu_ranks_per_node=3))
    text = str(err.value)
    assert "train.micro_batch_size auto" in text and "world size 3" in text
    assert "world sizes 1, 2, 4, 8, 16, 32, 64 work" in text


def test_auto_splits_at_every_node_count_the_request_may_shrink_to():
    """machine.min_nodes: a job placed on fewer nodes keeps the run's micro-batch, so auto
    must split at each of them (world 6 and 8 here: 96 = 24 micro-batches of 4)."""
    config = _shipped("slurm", nodes=4, min_nodes=3)
    config["train"]["global_batch_size"] = 96
    assert _run(config)["train"]["micro_batch_size"] == 4
    config["train"]["global_batch_size"] = 64  # 64 splits at 8 ranks, never at 6
    with pytest.raises(ConfigError, match=r"world size 6, 8 \(machine.min_nodes 3 to nodes 4"):
        _run(config)


def test_a_fixed_micro_batch_keeps_refusing_and_points_to_auto():
    config = _shipped(cpu_ranks_per_node=4)
    config["train"]["micro_batch_size"] = 32
    with pytest.raises(
        ConfigError, match="world sizes 1, 2 work; 4 does not.*micro_batch_size: auto"
    ):
        _run(config)


def test_a_cap_without_auto_is_said_to_do_nothing():
    config = _shipped()
    config["train"]["micro_batch_size"] = 16
    run = _run(config)
    assert run["train"]["micro_batch_size"] == 16
    (warning,) = [w for w in ddpconfig.run_warnings(run, "local") if "max_micro" in w]
    assert "train.max_micro_batch_size 32 is set but train.micro_batch_size is 16" in warning


def test_no_cap_means_no_accumulation():
    config = _shipped(cpu_ranks_per_node=4)
    config["train"]["max_micro_batch_size"] = None
    assert _run(config)["train"]["micro_batch_size"] == 16  # 64 / 4 ranks


@pytest.mark.e2e
@pytest.mark.slow
def test_the_shipped_config_plans_at_1_2_4_8_ranks_and_trains_at_4(workdir):
    """The user's first edit, through the real workflow: the shipped config.yaml with only the
    CPU ranks edited plans at 1, 2, 4 and 8; at 4 it trains (micro-batch 16, recorded) and
    evaluates every test sample once."""
    shipped = yaml.safe_load(SHIPPED.read_text())
    for ranks in (1, 2, 4, 8):
        shipped["machine"]["cpu_ranks_per_node"] = ranks
        configfile = write_config(workdir / f"ranks{ranks}.yaml", shipped)
        assert {"train", "evaluate", "report"} <= jobs_planned(workdir, configfile)
    shipped["machine"]["cpu_ranks_per_node"] = 4
    shipped["train"].update(epochs=1, progress=False)
    configfile = write_config(workdir / "config.yaml", shipped)
    result = snakemake(workdir, configfile)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    summary = json.loads((workdir / "results/runs/default/train_summary.json").read_text())
    assert (summary["world_size"], summary["micro_batch"], summary["micro_batch_auto"]) == (
        4,
        16,
        True,
    )
    assert summary["accumulation_steps"] == 1
    metrics = json.loads((workdir / "results/runs/default/eval_metrics.json").read_text())
    assert metrics["samples_evaluated"] == metrics["test_size"] == 359
    assert jobs_planned(workdir, configfile) == set()
