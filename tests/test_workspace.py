"""Which keys retrain a run, and what the train rule does with a run's work folder before
and after training (ddpflow.config fingerprints, ddpflow.training.workspace). Real files,
no mocks."""

from __future__ import annotations

import copy
import json

import pytest
from ddpflow import config as ddpconfig
from ddpflow.training import workspace


@pytest.fixture
def run() -> dict:
    return ddpconfig.resolve_runs(ddpconfig.load(None))[0]


def _edited(run: dict, path: str, value) -> dict:
    out = copy.deepcopy(run)
    *parents, leaf = path.split(".")
    target = out
    for key in parents:
        target = target[key]
    target[leaf] = value
    return out


@pytest.mark.parametrize(
    "path, value",
    [
        ("launcher", "slurm"),
        ("machine.partition", "gpu"),
        ("machine.account", "proj"),
        ("machine.time_min", 999),
        ("machine.mem_gb", 64),
        ("machine.pg_timeout_s", 5),
        ("machine.cancel_on_interrupt", False),
        ("train.progress", False),
        ("train.max_requeues", 0),
        ("train.on_nonfinite", "warn"),
        ("train.checkpoint.every_steps", 7),
        ("eval.batch_size", 100),
        # GPU-only settings on CPU ranks (the default config has gpus_per_node: 0)
        ("train.precision", "fp16"),  # fp16 is GPU only: CPU ranks train it in fp32
        ("train.deterministic", True),
        ("train.strategy", "zero"),  # the same weights as ddp (tests/test_resume_exact.py)
        # the machine's shape: every world size computes the same training
        # (tests/test_world_size.py)
        ("world_size", 1),
        ("machine.cpu_ranks_per_node", 1),
        ("machine.nodes", 2),
    ],
)
def test_keys_that_cannot_change_the_model_are_not_in_the_training_fingerprint(run, path, value):
    before = ddpconfig.training_fingerprint(run)
    assert ddpconfig.training_fingerprint(_edited(run, path, value)) == before


@pytest.mark.parametrize(
    "path, value, key",
    [
        ("train.optimizer.lr", 0.02, "train.optimizer.lr"),
        ("train.epochs", 3, "train.epochs"),
        ("model.name", "mlp", "model.name"),
        ("data.seed", 1, "data.seed"),
        ("train.global_batch_size", 128, "train.global_batch_size"),
        ("train.micro_batch_size", 16, "train.micro_batch_size"),
        ("machine.gpus_per_node", 2, "device"),
        # the default CNN's convolutions run NHWC on CPU ranks too
        ("train.channels_last", False, "train.channels_last"),
        # bf16 autocast acts on CPU ranks too
        ("train.precision", "bf16", "train.precision"),
    ],
)
def test_keys_that_determine_the_model_are(run, path, value, key):
    before = ddpconfig.training_fingerprint(run)
    after = ddpconfig.training_fingerprint(_edited(run, path, value))
    # the key is named among the changes (another model also brings its own keys)
    assert f"{key} " in [f"{change.split(' ')[0]} " for change in
                         ddpconfig.describe_changes(before, after).split(", ")]  # fmt: skip


@pytest.mark.parametrize(
    "path, value", [("precision", "fp16"), ("channels_last", False), ("deterministic", True)]
)
def test_gpu_only_keys_retrain_gpu_runs(run, path, value):
    gpu = _edited(run, "machine.gpus_per_node", 1)
    before = ddpconfig.training_fingerprint(gpu)
    after = ddpconfig.training_fingerprint(_edited(gpu, f"train.{path}", value))
    assert ddpconfig.describe_changes(before, after).startswith(f"train.{path} ")


@pytest.mark.parametrize("path, value", [("model.name", "mlp"), ("train.strategy", "fsdp")])
def test_channels_last_does_not_retrain_where_it_does_not_act(run, path, value):
    """The MLP has no convolution; fsdp keeps the plain layout (FSDP2 shards contiguous
    parameters only): on CPU ranks neither retrains when channels_last is edited."""
    edited = _edited(run, path, value)
    assert ddpconfig.uses_channels_last(edited) == (path != "train.strategy")
    before = ddpconfig.training_fingerprint(edited)
    assert ddpconfig.training_fingerprint(_edited(edited, "train.channels_last", False)) == before


def test_describe_changes_is_one_short_line(run):
    edited = _edited(_edited(run, "train.optimizer.lr", 0.02), "train.global_batch_size", 128)
    text = ddpconfig.describe_changes(
        ddpconfig.training_fingerprint(run), ddpconfig.training_fingerprint(edited)
    )
    assert text == "train.global_batch_size 64 -> 128, train.optimizer.lr 0.05 -> 0.02"
    mlp = _edited(run, "model.name", "mlp")  # channels_last acts on the CNN, not the MLP
    text = ddpconfig.describe_changes(
        ddpconfig.training_fingerprint(mlp), ddpconfig.training_fingerprint(run)
    )
    assert "train.channels_last (not in effect) -> true" in text, text


def _checkpoint(work, step: int) -> None:
    directory = workspace.checkpoint_dir(work)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"ckpt-{step:09d}.pt").write_bytes(b"x")
    (directory / f"ckpt-{step:09d}.pt.sha256").write_text("x\n")


def test_interrupted_attempt_of_the_same_config_resumes(run, tmp_path):
    assert workspace.prepare(run, tmp_path) == "fresh"
    _checkpoint(tmp_path, 10)
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1}\n')
    assert workspace.prepare(run, tmp_path).startswith("resume")
    assert workspace.candidates(workspace.checkpoint_dir(tmp_path))
    assert (tmp_path / "metrics.jsonl").exists()  # the resumed training's own


def test_edited_config_sets_old_checkpoints_aside(run, tmp_path):
    workspace.prepare(run, tmp_path)
    _checkpoint(tmp_path, 10)
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1}\n')
    decision = workspace.prepare(_edited(run, "train.optimizer.lr", 0.02), tmp_path)
    assert decision == "retrain: train.optimizer.lr 0.05 -> 0.02"
    assert not (tmp_path / "metrics.jsonl").exists()  # another training's epoch lines
    assert not workspace.candidates(workspace.checkpoint_dir(tmp_path))
    (aside,) = tmp_path.glob("checkpoints.old-*")
    assert (aside / "ckpt-000000010.pt").exists()


def test_finished_training_is_never_resumed(run, tmp_path):
    workspace.prepare(run, tmp_path)
    for step in (10, 20, 30):
        _checkpoint(tmp_path, step)
    (tmp_path / "rendezvous-1-0.port").write_text("host 1\n")
    workspace.finish(run, tmp_path)
    kept = workspace.candidates(workspace.checkpoint_dir(tmp_path))
    assert [p.name for p in kept] == ["ckpt-000000030.pt"]  # keep_after_success: 1
    assert not list(tmp_path.glob("rendezvous-*"))
    assert json.loads((tmp_path / "finished.json").read_text())["fingerprint"]

    decision = workspace.prepare(run, tmp_path)  # model.pt deleted: the rule runs again
    assert decision.startswith("retrain: the previous training finished")
    assert not workspace.candidates(workspace.checkpoint_dir(tmp_path))
    assert not (tmp_path / "finished.json").exists()


def test_clean_keeps_an_interrupted_trainings_checkpoints(run, tmp_path):
    workspace.prepare(run, tmp_path)
    _checkpoint(tmp_path, 10)
    workspace.prepare(_edited(run, "train.epochs", 3), tmp_path)  # old ones set aside
    _checkpoint(tmp_path, 5)  # the new config's interrupted attempt
    removed = workspace.clean(tmp_path)
    assert [p.name for p in removed][0].startswith("checkpoints.old-")
    assert workspace.candidates(workspace.checkpoint_dir(tmp_path)), "resume state removed"


def test_the_resume_line_counts_epochs_as_the_checkpoint_line_does(tmp_path):
    """The checkpoint's log says "end of epoch 53": the resume says "after epoch 53", and a
    mid-epoch checkpoint "in epoch 54"."""
    from ddpflow.training.workspace import NEWEST, _newest_position

    (tmp_path / "ckpt-000000530.pt").write_bytes(b"state")
    newest = {"checkpoint": "ckpt-000000530.pt", "world_size": 4, "step": 530}
    (tmp_path / NEWEST).write_text(json.dumps({**newest, "epoch": 53, "epoch_step": 0}))
    assert _newest_position(tmp_path, 2) == (
        " (newest after epoch 53, step 530, written on 4 ranks; continuing on 2)"
    )
    (tmp_path / NEWEST).write_text(json.dumps({**newest, "epoch": 53, "epoch_step": 7}))
    assert _newest_position(tmp_path, 4) == " (newest in epoch 54 at step 530, written on 4 ranks)"
