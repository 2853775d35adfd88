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
    # no run folder: a developer's results/ would be a run trained before (checks.norm_batch)
    config["results_dir"] = "/nonexistent/ddpflow-results"
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
    """global 64, micro auto up to 32: the largest micro-batch that splits at this size; the
    CNN's BatchNorm batch stays 32 (groups of 32 / micro ranks hold one), and so does its
    fingerprint: the same science at every size, nothing retrains."""
    run = _run(_shipped(launcher, **machine))
    assert run["world_size"] == world
    assert run["train"]["micro_batch_size"] == micro
    assert run["train"]["norm_batch_size"] == 32
    assert run["micro_batch"] == {
        "size": micro, "auto": True, "max": 32, "norm": 32, "group": 32 // micro,
        "science": 32, "role": "norm", "recorded": None,
    }  # fmt: skip
    assert ddpconfig.accumulation_steps(run["train"], world) * micro * world == 64
    one = {"nodes": 1, "gpus_per_node": min(machine.get("gpus_per_node", 0), 1)}
    assert training_fingerprint(run) == training_fingerprint(_run(_shipped(launcher, **one)))


def test_auto_at_the_shipped_size_is_the_fingerprint_of_the_runs_trained_before_it():
    """A run trained with micro_batch_size 32 (the previous shipped config, and the schema's
    default) plans nothing after the upgrade: same fingerprint, no new key in it."""
    before = _shipped()
    before["train"] = {k: v for k, v in before["train"].items() if k != "max_micro_batch_size"}
    before["train"]["micro_batch_size"] = 32
    now = _run(_shipped())
    assert training_fingerprint(now) == training_fingerprint(_run(before))
    assert not any("max_micro_batch_size" in key for key in training_fingerprint(now))


def test_three_ranks_share_the_step_unevenly_and_keep_a_trained_runs_batch(tmp_path):
    """The default job at 3 ranks: a new run takes BatchNorm batches of 16 (4 a step, 2 + 1
    + 1 micro-batches), said before anything runs; a run trained with batches of 32 (2 a
    step) is not changed behind its back: refused, naming the sizes that hold it and the
    number that would train at 3."""
    run = _run(_shipped(cpu_ranks_per_node=3))
    assert (run["train"]["norm_batch_size"], run["train"]["micro_batch_size"]) == (16, 16)
    assert ddpconfig.accumulation_steps(run["train"], 3, 0) == 2
    assert ddpconfig.accumulation_steps(run["train"], 3, 2) == 1
    said = " ".join(ddpconfig.run_warnings(run, "local"))
    assert "BatchNorm's batch is 16, not the recipe's 32: world size 3 cannot hold 2" in said
    assert "shares the step's 4 micro-batches unevenly: 1 rank computes 2, the others 1" in said
    _trained(tmp_path, "default", micro_batch=32, norm_batch=32)
    with pytest.raises(ConfigError) as err:
        _run({**_shipped(cpu_ranks_per_node=3), "results_dir": str(tmp_path)})
    text = str(err.value)
    assert "world size 3" in text and "whole normalisation batches of 32" in text
    assert "world sizes 1, 2, 4, 8, 16, 32, 64 work" in text
    assert "set train.norm_batch_size: 16 (the science changes: the run retrains)" in text


def test_auto_splits_at_every_node_count_the_request_may_shrink_to():
    """machine.min_nodes: a job placed on fewer nodes keeps the run's batches, so auto must
    hold them at each node count (world 6 and 8 here): 96 = 8 BatchNorm batches of 12, even
    at 8 ranks, 2 + 2 + 1 + 1 + 1 + 1 at 6; a world larger than the step's batches is
    refused, naming the node counts."""
    config = _shipped("slurm", nodes=4, min_nodes=3)
    config["train"]["global_batch_size"] = 96
    run = _run(config)
    assert (run["train"]["norm_batch_size"], run["train"]["micro_batch_size"]) == (12, 12)
    config["train"]["global_batch_size"] = 64  # 8 batches of 8
    assert _run(config)["train"]["micro_batch_size"] == 8
    config["train"].update(global_batch_size=32, max_micro_batch_size=8)  # 4 batches of 8
    config["train"]["norm_batch_size"] = 8
    with pytest.raises(ConfigError, match=r"world size 6, 8 \(machine.min_nodes 3 to nodes 4"):
        _run(config)


def test_a_fixed_micro_batch_keeps_refusing_and_points_to_auto():
    config = _shipped(cpu_ranks_per_node=4)
    config["train"]["micro_batch_size"] = 32
    with pytest.raises(
        ConfigError,
        match="world size 4 .* is more than 2 micro-batches a step: world sizes up to 2 work.*"
        "micro_batch_size: auto",
    ):
        _run(config)


def test_a_number_within_the_shipped_cap_is_no_warning_one_above_it_is():
    """strategies.md advises a number; the shipped cap 32 then only speaks when contradicted."""
    config = _shipped()
    config["train"]["micro_batch_size"] = 16
    run = _run(config)
    assert run["train"]["micro_batch_size"] == 16
    assert not [w for w in ddpconfig.run_warnings(run, "local") if "max_micro" in w]
    config["train"]["micro_batch_size"] = 64
    config["machine"]["cpu_ranks_per_node"] = 1
    (warning,) = [w for w in ddpconfig.run_warnings(_run(config), "local") if "max_micro" in w]
    assert "train.micro_batch_size 64 is above train.max_micro_batch_size 32" in warning


def test_no_cap_means_no_accumulation():
    config = _shipped(cpu_ranks_per_node=4)
    config["train"]["max_micro_batch_size"] = None
    assert _run(config)["train"]["micro_batch_size"] == 16  # 64 / 4 ranks


@pytest.mark.e2e
@pytest.mark.slow
def test_the_shipped_config_plans_at_1_2_4_8_ranks_and_trains_at_4(workdir):
    """The user's first edit, through the real workflow: the shipped config.yaml with only the
    CPU ranks edited plans at 1, 2, 4 and 8; at 4 it trains (micro-batch 16, pairs of ranks
    normalising BatchNorm's batch of 32 together, recorded) and evaluates every test sample
    once; then editing the ranks to 1, 2 or 8 plans nothing: the same science."""
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
    assert (summary["norm_batch"], summary["norm_group"]) == (32, 2)
    metrics = json.loads((workdir / "results/runs/default/eval_metrics.json").read_text())
    assert metrics["samples_evaluated"] == metrics["test_size"] == 359
    assert jobs_planned(workdir, configfile) == set()
    for ranks in (1, 2, 8):
        shipped["machine"]["cpu_ranks_per_node"] = ranks
        assert jobs_planned(workdir, write_config(workdir / "config.yaml", shipped)) == set()


def _trained(results, run: str, **summary) -> None:
    """A run folder as a finished training leaves it (its train_summary.json)."""
    folder = results / "runs" / run
    folder.mkdir(parents=True)
    (folder / "train_summary.json").write_text(json.dumps(summary))


def test_a_run_trained_by_the_previous_main_keeps_its_batch_at_any_world_size(tmp_path):
    """The shipped job trained at 4 ranks before train.norm_batch_size (micro-batch 16 in its
    summary and fingerprint): at 1, 2, 4 and 8 ranks its BatchNorm batch stays 16 and its
    fingerprint is the one it was trained under; a new summary's norm_batch wins."""
    _trained(tmp_path, "default", micro_batch=16, micro_batch_auto=True)
    before = _shipped(cpu_ranks_per_node=4)
    before["train"] = {k: v for k, v in before["train"].items() if k != "max_micro_batch_size"}
    before["train"]["micro_batch_size"] = 16  # what the previous main resolved and recorded
    recorded = training_fingerprint(_run(before))
    for ranks in (1, 2, 4, 8):
        config = {**_shipped(cpu_ranks_per_node=ranks), "results_dir": str(tmp_path)}
        run = _run(config)
        assert run["train"]["norm_batch_size"] == 16
        assert run["train"]["micro_batch_size"] == {1: 16, 2: 16, 4: 16, 8: 8}[ranks]
        assert training_fingerprint(run) == recorded, ranks
    kept = tmp_path / "kept"  # the .kept copy while a rerun has the outputs removed
    _trained(kept, "default", micro_batch=8, norm_batch=32)
    summary = kept / "runs/default/train_summary.json"
    (kept / "runs/default/.kept/train").mkdir(parents=True)
    summary.rename(kept / "runs/default/.kept/train/train_summary.json")
    run = _run({**_shipped(cpu_ranks_per_node=2), "results_dir": str(kept)})
    assert (run["train"]["norm_batch_size"], run["train"]["micro_batch_size"]) == (32, 32)


def _gpt(**kwargs) -> dict:
    config = _shipped()
    config["data"] = {"source": "text", "path": "corpus.txt", "block_size": 16}
    config["task"] = "language_model"
    config["model"] = {"name": "gpt", "kwargs": {"n_layer": 1, "n_head": 2, "n_embd": 16, **kwargs}}
    config["train"]["global_batch_size"] = 32
    return config


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_a_model_without_batch_dependent_layers_keeps_its_fingerprint(tmp_path, ranks):
    """gpt without dropout: the micro-batch is the machine's (16 at 2 ranks, 32 at 1), the
    fingerprint is the recipe's; a run trained at 2 ranks before the key (16) keeps 16."""
    new = _gpt()
    new["machine"]["cpu_ranks_per_node"] = ranks
    assert training_fingerprint(_run(new)) == training_fingerprint(_run(_gpt()))
    assert _run(new)["train"]["micro_batch_size"] == 32 // max(ranks, 1)
    _trained(tmp_path, "default", micro_batch=16)
    old = {**new, "results_dir": str(tmp_path)}
    assert training_fingerprint(_run(old))["train.micro_batch_size"] == 16


def test_a_model_that_draws_per_micro_batch_says_the_edit_retrains(tmp_path):
    """gpt with dropout: its micro-batch is its science, as before; the edit that changes it
    is named before anything runs, with the number that keeps it."""
    config = {**_gpt(dropout=0.1), "results_dir": str(tmp_path)}
    _trained(tmp_path, "default", micro_batch=32, norm_batch=32)
    config["machine"]["cpu_ranks_per_node"] = 2
    run = _run(config)
    assert run["micro_batch"]["role"] == "draws"
    assert training_fingerprint(run)["train.micro_batch_size"] == 16
    (warning,) = [w for w in ddpconfig.run_warnings(run, "local") if "retrains" in w]
    assert "resolves to 16" in warning and "train.micro_batch_size: 32 to keep it" in warning
    config["machine"]["cpu_ranks_per_node"] = 1
    assert not [w for w in ddpconfig.run_warnings(_run(config), "local") if "retrains" in w]


def test_a_micro_batch_that_does_not_divide_the_normalisation_batch_is_refused():
    config = _shipped()
    config["train"].update(micro_batch_size=12, norm_batch_size=32)
    with pytest.raises(
        ConfigError, match="micro_batch_size 12 does not divide.*norm_batch_size 32"
    ):
        _run(config)
    config["train"].update(micro_batch_size=8, norm_batch_size=48)
    with pytest.raises(ConfigError, match="global_batch_size 64 is not a multiple of.*48"):
        _run(config)
    config["train"].update(micro_batch_size=8, norm_batch_size=32)  # 4 ranks share one
    config["machine"]["cpu_ranks_per_node"] = 2  # 2 ranks cannot: a group is 4
    with pytest.raises(
        ConfigError,
        match="world sizes 4, 8 work. To keep the science at this "
        "size, write train.micro_batch_size: 32 and train.norm_batch_size: 32",
    ):
        _run(config)
