"""sweep: grid, seeded random draws and a table file expand into ordinary named runs before the
DAG (ddpflow.config.sweep); the names are stable, a typo is refused naming the point and key."""

from __future__ import annotations

import csv
import json
import re

import pytest
import yaml
from ddpflow import config as ddpconfig
from ddpflow.config import ConfigError
from workflow_helpers import snakemake, write_config

GRID = {"train.optimizer.lr": [0.1, 0.05], "model.name": ["cnn", "mlp"]}


def runs_of(cfg: dict) -> list[dict]:
    return ddpconfig.check_runs(cfg)[1]


def names(cfg: dict) -> list[str]:
    return [r["name"] for r in runs_of(cfg)]


def test_grid_is_the_cross_product_named_from_values():
    runs = runs_of({"sweep": {"grid": GRID}})
    assert [r["name"] for r in runs] == [
        "lr-0.1_name-cnn", "lr-0.1_name-mlp", "lr-0.05_name-cnn", "lr-0.05_name-mlp",
    ]  # fmt: skip
    by_name = {r["name"]: r for r in runs}
    run = by_name["lr-0.05_name-mlp"]
    # the point's values are really set, and the rest is the config's base
    assert run["train"]["optimizer"]["lr"] == 0.05 and run["model"]["name"] == "mlp"
    assert run["train"]["epochs"] == ddpconfig.load()["train"]["epochs"]
    assert run["sweep"]["values"] == {"train.optimizer.lr": 0.05, "model.name": "mlp"}
    assert run["sweep"]["origin"] == "grid" and run["sweep"]["peers"] == [r["name"] for r in runs]


def test_sweep_without_runs_trains_no_default_run_and_with_runs_the_union():
    assert "default" not in names({"sweep": {"grid": GRID}})
    both = names({"runs": [{"name": "baseline"}], "sweep": {"grid": GRID}})
    assert both[0] == "baseline" and len(both) == 5
    assert names({}) == ["default"]  # no runs:, no sweep: one run named default


def test_a_run_name_shared_with_a_sweep_point_is_refused():
    with pytest.raises(ConfigError, match=r"unique.*lr-0.1_name-cnn"):
        runs_of({"runs": [{"name": "lr-0.1_name-cnn"}], "sweep": {"grid": GRID}})


def test_adding_a_value_keeps_every_other_point_and_its_fingerprint():
    before = {r["name"]: r for r in runs_of({"sweep": {"grid": GRID}})}
    wider = {**GRID, "train.optimizer.lr": [0.1, 0.05, 0.02]}
    after = {r["name"]: r for r in runs_of({"sweep": {"grid": wider}})}
    assert set(after) - set(before) == {"lr-0.02_name-cnn", "lr-0.02_name-mlp"}
    for name, run in before.items():
        assert ddpconfig.training_fingerprint(after[name]) == ddpconfig.training_fingerprint(run)


def test_sweep_settings_are_in_no_fingerprint():
    """peers and pruning change with the sweep's other points: they must retrain nothing."""
    plain = runs_of({"sweep": {"grid": GRID}})[0]
    pruned = runs_of(
        {"sweep": {"grid": {**GRID, "train.epochs": [12]}, "prune": {"after_epochs": 2}}}
    )
    same = next(r for r in pruned if r["train"]["optimizer"]["lr"] == 0.1
                and r["model"]["name"] == "cnn")  # fmt: skip
    assert same["sweep"]["prune"] == {"after_epochs": 2, "min_runs": 3}
    assert ddpconfig.training_fingerprint(same) == ddpconfig.training_fingerprint(plain)
    assert ddpconfig.evaluation_fingerprint(same) == ddpconfig.evaluation_fingerprint(plain)


def random_sweep(seed: int) -> dict:
    space = {
        "train.optimizer.weight_decay": {"log_uniform": [1e-5, 1e-2]},
        "train.warmup_epochs": {"choice": [0, 1, 2]},
        "train.optimizer.momentum": {"uniform": [0.8, 0.95]},
        "train.seed": {"int_uniform": [0, 1000]},
    }
    return {"sweep": {"random": {"samples": 6, "seed": seed, "space": space}}}


def test_random_draws_are_reproducible_and_named_by_their_values():
    first = runs_of(random_sweep(0))
    assert [r["name"] for r in first] == names(random_sweep(0))
    assert names(random_sweep(1)) != [r["name"] for r in first]
    for run in first:
        wd = run["train"]["optimizer"]["weight_decay"]
        assert 1e-5 <= wd <= 1e-2 and float(f"{wd:.3g}") == wd  # 3 significant digits
        assert f"weight_decay-{wd:g}" in run["name"]
        assert run["train"]["warmup_epochs"] in (0, 1, 2)
        assert isinstance(run["train"]["seed"], int)
        assert run["sweep"]["log_keys"] == ["train.optimizer.weight_decay"]
        assert run["sweep"]["origin"] == "random"


def test_table_file_one_run_per_row(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sweeps").mkdir()
    (tmp_path / "sweeps" / "lr.tsv").write_text(
        "train.optimizer.lr\tmodel.name\ttrain.augment.enabled\n0.1\tcnn\ttrue\n0.03\tmlp\tfalse\n"
    )
    (tmp_path / "sweeps" / "named.csv").write_text("name,train.epochs\nshort,1\nlong,20\n")
    runs = runs_of({"sweep": {"table": "sweeps/lr.tsv"}})
    assert [r["name"] for r in runs] == [
        "lr-0.1_name-cnn_enabled-true",
        "lr-0.03_name-mlp_enabled-false",
    ]
    assert (
        runs[1]["train"]["optimizer"]["lr"] == 0.03
        and runs[1]["train"]["augment"]["enabled"] is False
    )
    assert runs[0]["sweep"]["origin"] == "table"
    named = runs_of({"sweep": {"table": "sweeps/named.csv"}})
    assert [(r["name"], r["train"]["epochs"]) for r in named] == [("short", 1), ("long", 20)]


def test_table_errors_name_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"sweep.table: file nope.tsv does not exist"):
        runs_of({"sweep": {"table": "nope.tsv"}})
    (tmp_path / "short.tsv").write_text("train.epochs\ttrain.seed\n3\n")
    with pytest.raises(ConfigError, match=r"short.tsv line 2 has 1 cells"):
        runs_of({"sweep": {"table": "short.tsv"}})


@pytest.mark.parametrize(
    ("sweep", "message"),
    [
        (
            {"grid": {"train.optimizer.lrr": [0.1]}},
            r"sweep point 'lrr-0.1' \(grid\): train.optimizer: unknown key \['lrr'\]; "
            r"did you mean 'lr'",
        ),
        ({"grid": {"train.epochs": ["many"]}}, r"sweep point 'epochs-many'.*train.epochs"),
        ({"grid": {"lr": [0.1]}}, r"key 'lr' must be dotted from a section"),
        (
            {"random": {"samples": 2, "space": {"train.optimizer.lr": {"loguniform": [0.1, 1]}}}},
            r"sweep.random.space.train.optimizer.lr: unknown key.*did you mean 'log_uniform'",
        ),
        (
            {"random": {"samples": 2, "space": {"train.optimizer.lr": {"uniform": [1, 0.1]}}}},
            r"low < high",
        ),
        (
            {"grid": {"train.optimizer.lr": [0.1] * 1 + [0.2], "train.seed": list(range(200))}},
            r"would create 400 runs \(grid 2 x 200 = 400\), more than sweep.max_runs \(256\)",
        ),
        ({"grid": {"train.seed": [1, 2, 3]}, "max_runs": 2}, r"would create 3 runs"),
        ({"grid": {"train.seed": []}}, r"sweep.grid.train.seed"),
    ],  # fmt: skip
)
def test_bad_sweeps_are_refused_naming_the_key(sweep, message):
    with pytest.raises(ConfigError, match=message):
        runs_of({"sweep": sweep})


def test_run_by_name_finds_a_sweep_point_alone():
    cfg = ddpconfig.check_runs({"sweep": {"grid": GRID}})[0]
    run = ddpconfig.run_by_name(cfg, "lr-0.05_name-cnn")
    assert run["train"]["optimizer"]["lr"] == 0.05 and run["sweep"]["origin"] == "grid"
    with pytest.raises(ConfigError, match="no run named 'nope'"):
        ddpconfig.run_by_name(cfg, "nope")


def planned_runs(workdir, configfile) -> set[str]:
    """The runs the dry run would train."""
    dry = snakemake(workdir, configfile, "-n")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    blocks = re.findall(r"rule train:.*?wildcards: run=(\S+)", dry.stdout, flags=re.S)
    return set(blocks)


@pytest.mark.e2e
def test_adding_a_value_plans_exactly_the_new_runs(tmp_path):
    """Plan-only: the edit loop on a sweep, with the shipped config.yaml as the base."""
    cfg = tmp_path / "sweep.yaml"
    write_config(cfg, {"sweep": {"grid": GRID}})
    assert planned_runs(tmp_path, cfg) == {
        "lr-0.1_name-cnn", "lr-0.1_name-mlp", "lr-0.05_name-cnn", "lr-0.05_name-mlp",
    }  # fmt: skip
    dry = snakemake(tmp_path, cfg, "-n", "--configfile", str(write_config(
        tmp_path / "typo.yaml", {"sweep": {"grid": {"train.optimizr.lr": [0.1]}}})))  # fmt: skip
    assert dry.returncode != 0
    assert "sweep point 'lr-0.1' (grid): train: unknown key ['optimizr']" in dry.stderr
    assert yaml.safe_load(cfg.read_text())["sweep"]["grid"] == GRID  # nothing rewrote it


@pytest.mark.e2e
def test_a_2x2_grid_trains_four_runs_and_a_new_value_plans_only_its_runs(tmp_path):
    cfg = tmp_path / "sweep.yaml"
    write_config(cfg, {"train": {"epochs": 2}, "sweep": {"grid": GRID}})
    done = snakemake(tmp_path, cfg)
    assert done.returncode == 0, done.stdout + done.stderr
    four = {"lr-0.1_name-cnn", "lr-0.1_name-mlp", "lr-0.05_name-cnn", "lr-0.05_name-mlp"}
    for name in four:
        metrics = tmp_path / "results" / "runs" / name / "eval_metrics.json"
        assert metrics.is_file(), name
    assert not (tmp_path / "results" / "runs" / "default").exists()
    # the report ranks the four by validation accuracy, best first
    rows = list(csv.DictReader((tmp_path / "results/report/sweep.csv").open()))
    assert {r["run"] for r in rows} == four and [r["rank"] for r in rows] == ["1", "2", "3", "4"]
    vals = [float(r["val_accuracy"]) for r in rows]
    assert vals == sorted(vals, reverse=True)
    report = (tmp_path / "results/report/report.md").read_text()
    assert "## Sweep: runs ranked by validation accuracy" in report
    assert f"Selected: {rows[0]['run'].replace('_', chr(92) + '_')}" in report
    assert planned_runs(tmp_path, cfg) == set()
    wider = {**GRID, "train.optimizer.lr": [0.1, 0.05, 0.2]}
    write_config(cfg, {"train": {"epochs": 2}, "sweep": {"grid": wider}})
    assert planned_runs(tmp_path, cfg) == {"lr-0.2_name-cnn", "lr-0.2_name-mlp"}


@pytest.mark.e2e
def test_median_pruning_stops_the_hopeless_runs_and_a_rerun_keeps_them(tmp_path):
    """Pruning depends on the order runs finish in: the two good runs are trained first (by
    naming their models), then the sweep; lr 1e-5 and 1e-6 stay near chance on digits."""
    cfg = tmp_path / "prune.yaml"
    lrs = [0.1, 0.05, 1.0e-5, 1.0e-6]
    sweep = {"grid": {"train.optimizer.lr": lrs}, "prune": {"after_epochs": 2}}
    write_config(cfg, {"train": {"epochs": 4}, "sweep": sweep})
    runs = tmp_path / "results" / "runs"
    targets = [f"results/runs/{name}/model.pt" for name in ("lr-0.1", "lr-0.05")]
    # targets before --configfile, which takes every argument after it
    good = snakemake(tmp_path, None, *targets, "--configfile", str(cfg))
    assert good.returncode == 0, good.stdout + good.stderr
    done = snakemake(tmp_path, cfg)
    assert done.returncode == 0, done.stdout + done.stderr
    summaries = {
        name: json.loads((runs / name / "train_summary.json").read_text())
        for name in ("lr-0.1", "lr-0.05", "lr-1e-05", "lr-1e-06")
    }
    for name in ("lr-1e-05", "lr-1e-06"):
        pruned = summaries[name]["pruned"]
        assert pruned["epoch"] == 2 and pruned["val_accuracy"] < pruned["median"], name
        epochs = [
            json.loads(line)["epoch"] for line in (runs / name / "train_metrics.jsonl").open()
        ]
        assert epochs == [1, 2], name  # stopped at after_epochs, kept its model, was evaluated
        assert (runs / name / "eval_metrics.json").is_file()
        assert f"run '{name}' PRUNED after epoch 2" in done.stderr
    for name in ("lr-0.1", "lr-0.05"):
        assert "pruned" not in summaries[name]
        assert len((runs / name / "train_metrics.jsonl").read_text().splitlines()) == 4
    status = {
        r["run"]: r["status"]
        for r in csv.DictReader((tmp_path / "results/report/sweep.csv").open())
    }
    assert status == {"lr-0.1": "finished", "lr-0.05": "finished", "lr-1e-05": "pruned",
                      "lr-1e-06": "pruned"}  # fmt: skip
    report = (tmp_path / "results" / "report" / "report.md").read_text()
    assert report.count("| pruned after epoch 2 |") == 2  # the ranking table says which
    assert planned_runs(tmp_path, cfg) == set()  # a pruned run is not retrained
