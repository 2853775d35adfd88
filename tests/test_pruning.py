"""Median pruning of a sweep's runs (ddpflow.training.pruning): the median rule, which peers'
records count, and real trainings (gloo process groups, staged digits, TrainTask's own path)
that stop after `after_epochs` on every rank when their peers did better, keep their model
and say so, finish when they are above the median, and are unchanged without a sweep."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from datafixtures import make_folder
from ddpflow import paths as ddpaths
from ddpflow.config import dataset_id, training_fingerprint
from ddpflow.config.typed import RunSpec
from ddpflow.paths import RunPaths
from ddpflow.task import get_task
from ddpflow.training import pruning
from ddpflow.training.entry import TrainTask
from distributed_helpers import run_group
from workflow_helpers import make_run

CPU = torch.device("cpu")
PEERS = ["me", "p1", "p2", "p3"]
PRUNE = {"after_epochs": 2}


def _sweep(name="me", lr=0.05, prune=None, results_dir=None, **train):
    """A resolved run as a sweep point over train.optimizer.lr (run["sweep"] by hand)."""
    extra = {"results_dir": results_dir} if results_dir else {}
    run = make_run(
        train={"epochs": 5, "optimizer": {"lr": lr}, "progress": False,
               "global_batch_size": 64, "micro_batch_size": 32, **train},
        machine={"cpu_ranks_per_node": 2}, **extra,
    )  # fmt: skip
    run["name"] = name
    run["sweep"] = {
        "values": {"train.optimizer.lr": lr}, "keys": ["train.optimizer.lr"],
        "log_keys": [], "origin": "grid", "peers": PEERS,
        "prune": prune,
    }  # fmt: skip
    return run


def _peer(results: Path, run: dict, name: str, lr: float, accuracies: list[float]) -> None:
    """A peer's work folder as its train rule and rank 0 leave it: fingerprint.json and one
    metrics.jsonl line per epoch reached."""
    work = ddpaths.work_dir(results, name)
    work.mkdir(parents=True, exist_ok=True)
    peer = _sweep(name, lr, run["sweep"]["prune"])
    peer["train"]["epochs"] = run["train"]["epochs"]
    (work / ddpaths.FINGERPRINT).write_text(json.dumps(training_fingerprint(peer)))
    lines = [{"epoch": e, "val_accuracy": a, "run": name} for e, a in enumerate(accuracies, 1)]
    (work / ddpaths.LIVE_METRICS).write_text("".join(json.dumps(r) + "\n" for r in lines))


# --- the median rule ---------------------------------------------------------------------


def test_below_the_median_prunes_at_or_above_continues():
    pruned = pruning.decide(0.2, [0.9, 0.8, 0.5], epoch=3, min_runs=3)
    assert pruned == {"epoch": 3, "val_accuracy": 0.2, "median": 0.65, "runs": 4, "prune": True}
    assert not pruning.decide(0.5, [0.9, 0.5, 0.1], 3, 3)["prune"]  # equal to the median
    assert not pruning.decide(0.9, [0.1, 0.2], 3, 3)["prune"]
    assert not pruning.decide(0.1, [0.1, 0.1, 0.1], 3, 3)["prune"]  # all at chance: a tie


def test_a_task_whose_metric_is_lower_better_prunes_above_the_median(tmp_path):
    """Regression selects by val_mse (lower is better): the run above the median stops, with
    its metric under its own key; the peers' values are read from that key too."""
    mse = get_task("regression").selection
    pruned = pruning.decide(4.0, [1.0, 2.0, 3.0], epoch=2, min_runs=3, selection=mse)
    assert pruned == {"epoch": 2, "val_mse": 4.0, "median": 2.5, "runs": 4, "prune": True}
    assert not pruning.decide(1.0, [2.0, 3.0, 4.0], 2, 3, mse)["prune"]
    line = pruning.pruned_line("lr-1", pruned, mse)
    assert "val MSE 4.0000 is above the median 2.5000" in line
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"epoch": 2, "val_mse": 1.5, "val_accuracy": 0.1}) + "\n")
    assert pruning.accuracy_at(metrics, 2, "val_mse") == 1.5


def test_too_few_runs_never_prune():
    assert pruning.decide(0.1, [0.9], 3, 3) is None  # 2 runs reached the epoch, 3 needed
    assert pruning.decide(0.1, [0.9, math.nan], 3, 3) is None  # a NaN is no run's result
    assert pruning.decide(math.nan, [0.9, 0.8], 3, 3) is None
    assert pruning.decide(0.1, [0.9], 3, 2)["prune"]  # min_runs: 2 is the user's choice


def test_accuracy_at_reads_the_epochs_line_and_skips_a_half_written_one(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"epoch": 1, "val_accuracy": 0.5}\n{"epoch": 2, "val_accuracy": 0.7}\n'
                       '{"epoch": 3, "val_acc')  # fmt: skip
    assert pruning.accuracy_at(metrics, 2) == 0.7
    assert pruning.accuracy_at(metrics, 3) is None
    assert pruning.accuracy_at(tmp_path / "missing.jsonl", 1) is None


def test_peers_count_only_with_records_of_their_current_config(tmp_path):
    results = tmp_path / "results"
    run = _sweep(prune={"after_epochs": 2})
    _peer(results, run, "p1", 0.1, [0.5, 0.9])
    _peer(results, run, "p2", 0.02, [0.4])  # has not reached epoch 2
    _peer(results, run, "p3", 0.2, [0.6, 0.8])
    # p3's records are of an older base config (another seed): ignored until it retrains
    stale = json.loads((ddpaths.work_dir(results, "p3") / ddpaths.FINGERPRINT).read_text())
    stale["train.seed"] += 1
    (ddpaths.work_dir(results, "p3") / ddpaths.FINGERPRINT).write_text(json.dumps(stale))
    work = ddpaths.work_dir(results, "me")
    assert pruning.peer_accuracies(run, work, 2) == {"p1": 0.9}
    assert pruning.peer_accuracies(run, work, 1) == {"p1": 0.5, "p2": 0.4}


@pytest.mark.parametrize("own_data", [False, True], ids=["digits", "image_folder"])
def test_peers_of_a_sweep_over_a_data_key_count(tmp_path, own_data):
    """A swept data key: the peer's records count. Own data's fingerprint holds the dataset
    id (from the folder's listing), which each point has of its own: the peer's is taken."""
    results = tmp_path / "results"
    run = _sweep(prune={"after_epochs": 2})
    if own_data:
        root = make_folder(tmp_path / "images", per_class=(4, 2))
        data = {"source": "image_folder", "root": str(root), "image_size": [8, 8]}
        own = make_run(data=data, train=run["train"], machine=run["machine"])
        run = {**own, "name": "me", "sweep": run["sweep"]}
    run["sweep"]["keys"] = ["train.optimizer.lr", "data.val_fraction"]
    work = ddpaths.work_dir(results, "p1")
    work.mkdir(parents=True)
    peer = copy.deepcopy(run)
    peer["data"]["val_fraction"], peer["train"]["optimizer"]["lr"] = 0.2, 0.1
    peer["dataset_id"] = dataset_id(peer["data"])
    assert own_data == (peer["dataset_id"] != run["dataset_id"] and
                        "dataset_id" in training_fingerprint(peer))  # fmt: skip
    (work / ddpaths.FINGERPRINT).write_text(json.dumps(training_fingerprint(peer)))
    (work / ddpaths.LIVE_METRICS).write_text(json.dumps({"epoch": 2, "val_accuracy": 0.9}) + "\n")
    assert pruning.peer_accuracies(run, ddpaths.work_dir(results, "me"), 2) == {"p1": 0.9}
    run["sweep"]["keys"] = ["train.optimizer.lr"]  # val_fraction not swept: stale records
    assert pruning.peer_accuracies(run, ddpaths.work_dir(results, "me"), 2) == {}


def test_pruning_is_due_only_when_set_from_after_epochs_to_before_the_last():
    env = type("Env", (), {"world_size": 1, "is_master": True})()
    assert not pruning.MedianPruner(RunSpec.from_run(make_run()), "w", env, CPU).due(
        3
    )  # hand-written run
    assert not pruning.MedianPruner(RunSpec.from_run(_sweep()), "w", env, CPU).due(
        3
    )  # a sweep, prune off
    due = pruning.MedianPruner(
        RunSpec.from_run(_sweep(prune={"after_epochs": 2})), "w", env, CPU
    ).due
    assert [due(e) for e in range(1, 6)] == [False, True, True, True, False]


def test_no_collective_where_pruning_is_off_and_a_failed_check_never_fails_the_run(
    monkeypatch, caplog
):
    env = type("Env", (), {"world_size": 2, "is_master": True})()

    def no_collective(*args):
        raise AssertionError("a collective where pruning is not due")

    monkeypatch.setattr(pruning, "agree", no_collective)
    for run in (make_run(), _sweep()):  # hand-written; a sweep without prune
        assert (
            pruning.MedianPruner(RunSpec.from_run(run), "w", env, CPU).on_epoch({"epoch": 3})
            is None
        )
    monkeypatch.setattr(pruning, "agree", lambda pruned, env, device, metric: pruned)
    broken = _sweep(prune=PRUNE)
    broken["sweep"]["peers"] = None  # whatever goes wrong reading the peers
    record = {"epoch": 3, "val_accuracy": 0.1}
    with caplog.at_level("WARNING", logger="ddpflow.training.pruning"):
        assert (
            pruning.MedianPruner(RunSpec.from_run(broken), "w", env, CPU).on_epoch(record) is None
        )
    assert "pruning at epoch 3 skipped: TypeError" in caplog.text and "pruned" not in record


def test_the_pruned_line_names_the_run_epoch_accuracy_and_median():
    line = pruning.pruned_line("lr1e-05", {"epoch": 3, "val_accuracy": 0.1, "median": 0.9,
                                           "runs": 4})  # fmt: skip
    assert "'lr1e-05' PRUNED after epoch 3" in line and "0.1000" in line and "0.9000" in line


# --- real trainings ----------------------------------------------------------------------


class _Recorded(TrainTask):
    """TrainTask that also reports, on every rank, the epoch its loop ended at."""

    def _train(self, loop, ckpt, env, hosts):
        super()._train(loop, ckpt, env, hosts)
        self.ended_at = (loop.epoch, loop.scheduler.last_epoch)


def _train_all(env, runs: list[dict]) -> list:
    """Every run's training, one after the other, in this group; per run: what work()
    returned and where this rank's loop ended."""
    import socket

    from ddpflow import runtime

    runtime.setup_logging(env.rank)
    out = []
    for run in runs:
        task = _Recorded(run, RunPaths.for_run(run["results_dir"], run))
        torch.manual_seed(run["train"]["seed"])  # as DistributedTask's process would be
        hosts = [socket.gethostname()] * env.world_size
        result = task.work(RunSpec.from_run(run), env, CPU, hosts)
        out.append((result, task.ended_at))
    return out


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    from ddpflow.data.staging import stage_dataset

    results = tmp_path_factory.mktemp("pruning") / "results"
    run = _sweep(results_dir=str(results))
    stage_dataset(run["data"], RunPaths.for_run(results, run).staged, seed=run["data"]["seed"])
    return results


def _point(staged: Path, name: str, lr: float, peers: dict[str, list[float]], prune=PRUNE):
    """A sweep point of `name` whose peers' work folders show these accuracies."""
    run = _sweep(name, lr, prune, str(staged))
    run["sweep"]["peers"] = [name, *peers]
    for peer, accuracies in peers.items():
        _peer(staged, run, peer, 0.05, accuracies)
    return run


def _files(run: dict) -> dict:
    paths = RunPaths.for_run(run["results_dir"], run)
    return {
        "summary": json.loads(Path(paths.train_summary).read_text()),
        "metrics": [
            json.loads(line) for line in Path(paths.train_metrics).read_text().splitlines()
        ],
        "model": torch.load(paths.model, weights_only=True)["state_dict"],
        "evaluated": (Path(paths.work) / ddpaths.EVAL_FROM_TRAIN).is_file(),
    }


HIGH = [0.95, 0.97, 0.98, 0.99, 0.99]
LOW = [0.1, 0.15, 0.2, 0.2, 0.2]


@pytest.fixture(scope="module")
def trained(staged):
    """At 2 ranks, one after another: a hopeless point (lr 1e-5, stays near chance) among
    better peers, a good one among worse peers, the same good one as a hand-written run
    (no sweep block), then the hopeless one again on its own work folder once its peers'
    records have fallen (an interrupted attempt's rerun: it resumes from the checkpoint of
    its pruned epoch)."""
    runs = {
        "hopeless": _point(staged, "hopeless", 1e-5, {"h1": HIGH, "h2": HIGH}),
        "good": _point(staged, "good", 0.1, {"l1": LOW, "l2": LOW, "l3": LOW[:2]}),
        "plain": {**_sweep("plain", 0.1, None, str(staged))},
    }
    del runs["plain"]["sweep"]
    ended = {}
    for name, run in runs.items():
        ranks = run_group(2, _train_all, ([run],), staged / "rendezvous")
        ended[name] = [rank[0] for rank in ranks]  # (work()'s result, (epoch, step)) by rank
    files = {name: _files(run) for name, run in runs.items()}
    _point(staged, "hopeless", 1e-5, {"h1": LOW, "h2": LOW})
    again = run_group(2, _train_all, ([runs["hopeless"]],), staged / "rendezvous")
    return runs, ended, files, [rank[0] for rank in again]


@pytest.mark.slow
def test_a_run_below_the_median_stops_on_every_rank_and_keeps_its_model(trained):
    runs, ended, files, _ = trained
    (summary, rank0), (_, rank1) = ended["hopeless"]
    steps = rank0[1]
    assert rank0 == rank1 == (2, steps), (rank0, rank1)  # both ranks stopped after epoch 2
    pruned = files["hopeless"]["summary"]["pruned"]
    assert pruned["epoch"] == 2 and pruned["runs"] == 3 and pruned["median"] == 0.97
    assert pruned["val_accuracy"] < 0.5  # lr 1e-5: near chance on 10 classes
    assert summary["pruned"] == pruned and summary["steps"] == steps
    metrics = files["hopeless"]["metrics"]
    assert [r["epoch"] for r in metrics] == [1, 2] and metrics[-1]["pruned"] == pruned
    assert "pruned" not in metrics[0]
    assert files["hopeless"]["evaluated"]  # the kept model was scored, as after any training


@pytest.mark.slow
def test_a_resumed_pruned_run_keeps_its_decision(trained):
    """Its peers now did worse, but epoch 2 was decided: no epoch is trained again."""
    _, ended, files, again = trained
    (summary, rank0), (_, rank1) = again
    assert rank0 == rank1 == ended["hopeless"][0][1]
    assert summary["pruned"] == files["hopeless"]["summary"]["pruned"]


@pytest.mark.slow
def test_a_run_above_the_median_trains_every_epoch(trained):
    _, ended, files, _ = trained
    assert [rank[1][0] for rank in ended["good"]] == [5, 5]
    assert "pruned" not in files["good"]["summary"]
    assert not any("pruned" in r for r in files["good"]["metrics"])


@pytest.mark.slow
def test_pruning_changes_nothing_in_what_is_trained(trained):
    """The good point (checked at every epoch from 2 on) and the same config without a
    sweep block (no check, no collective) train the same weights, bit for bit."""
    _, ended, files, _ = trained
    assert [rank[1] for rank in ended["plain"]] == [rank[1] for rank in ended["good"]]
    good, plain = files["good"]["model"], files["plain"]["model"]
    assert all(torch.equal(good[k], plain[k]) for k in plain)
    assert "pruned" not in files["plain"]["summary"]
    strip = ("seconds", "samples_per_s", "model_tflops", "run", "ranks")
    same = [{k: v for k, v in r.items() if k not in strip} for r in files["plain"]["metrics"]]
    assert same == [{k: v for k, v in r.items() if k not in strip}
                    for r in files["good"]["metrics"]]  # fmt: skip


@pytest.mark.slow
def test_a_single_rank_run_is_pruned_too(staged):
    run = _point(staged, "alone", 1e-5, {"a1": HIGH, "a2": HIGH, "a3": HIGH})
    ((summary, ended),) = run_group(1, _train_all, ([run],), staged / "rendezvous")[0]
    assert ended[0] == 2 and summary["pruned"]["runs"] == 4
