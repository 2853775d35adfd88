"""Checkpoint files: atomic, checksummed, pruned, verified on load, refused under another config."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from ddpflow import config as ddpconfig
from ddpflow.config.typed import RunSpec
from ddpflow.training import checkpoint


def _state(step: int, config_hash: str = "h1") -> dict:
    return {
        "model": {"w": torch.full((4,), float(step))},
        "epoch": 1,
        "epoch_step": step,
        "step": step,
        "attempt": 1,
        "config_hash": config_hash,
        "rng": [],
    }


def test_save_prunes_to_keep_and_loads_newest(tmp_path):
    for step in (2, 4, 6, 8):
        checkpoint.save(_state(step), tmp_path, step, keep=3)
    names = sorted(p.name for p in tmp_path.glob("ckpt-*.pt"))
    assert names == ["ckpt-000000004.pt", "ckpt-000000006.pt", "ckpt-000000008.pt"]
    assert len(list(tmp_path.glob("*.sha256"))) == 3
    assert checkpoint.load_latest(tmp_path, "h1")["step"] == 8


@pytest.mark.parametrize("damage", ["flip", "truncate", "no_sidecar"])
def test_damaged_newest_falls_back_to_previous(tmp_path, caplog, damage):
    for step in (4, 8):
        checkpoint.save(_state(step), tmp_path, step, keep=3)
    newest = tmp_path / "ckpt-000000008.pt"
    data = bytearray(newest.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        newest.write_bytes(bytes(data))
    elif damage == "truncate":
        newest.write_bytes(bytes(data[: len(data) // 3]))
    else:
        (tmp_path / "ckpt-000000008.pt.sha256").unlink()
    with caplog.at_level(logging.WARNING):
        state = checkpoint.load_latest(tmp_path, "h1")
    assert state["step"] == 4
    assert "skipping checkpoint ckpt-000000008.pt" in caplog.text


def test_no_valid_checkpoint_means_fresh_start(tmp_path):
    assert checkpoint.load_latest(tmp_path, "h1") is None


def test_checkpoint_of_another_config_is_refused(tmp_path):
    checkpoint.save(_state(4, config_hash="old"), tmp_path, 4, keep=3)
    with pytest.raises(checkpoint.CheckpointMismatch, match="different config"):
        checkpoint.load_latest(tmp_path, "new")


def test_start_over_keeps_old_checkpoints_aside(tmp_path):
    directory = tmp_path / "checkpoints"
    checkpoint.save(_state(4, config_hash="old"), directory, 4, keep=3)
    moved = checkpoint.set_aside(directory, "test")
    assert not directory.exists() and (moved / "ckpt-000000004.pt").exists()


def test_training_hash_ignores_volatile_keys_but_not_science():
    run = ddpconfig.resolve_runs(ddpconfig.load(None))[0]
    base = checkpoint.training_hash(run)
    run["train"]["progress"] = not run["train"]["progress"]
    run["train"]["checkpoint"]["keep"] = 9
    assert checkpoint.training_hash(run) == base
    run["train"]["optimizer"]["lr"] *= 2
    assert checkpoint.training_hash(run) != base
    run["train"]["optimizer"]["lr"] /= 2
    run["world_size"] = 8  # a machine setting: the same training continues at any size
    run["machine"]["nodes"], run["machine"]["cpu_ranks_per_node"] = 4, 2
    assert checkpoint.training_hash(run) == base


def test_loading_runs_no_pickled_code(tmp_path):
    """weights_only=True: a checkpoint carrying an arbitrary object is rejected, not executed."""
    path = tmp_path / "ckpt-000000001.pt"
    torch.save({"format": 1, "payload": subprocess.Popen}, path)
    import hashlib

    (tmp_path / "ckpt-000000001.pt.sha256").write_text(
        hashlib.sha256(path.read_bytes()).hexdigest()
    )
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        checkpoint.load_latest(tmp_path, "h1")


def test_full_disk_during_write_keeps_previous_checkpoint(tmp_path):
    """A file size limit (RLIMIT_FSIZE) makes the second, larger write fail mid-way, as a
    full disk would: the previous checkpoint stays valid and no partial file is left."""
    checkpoint.save(_state(4), tmp_path, 4, keep=3)
    script = textwrap.dedent(f"""
        import resource, signal, torch
        from ddpflow.training import checkpoint
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        state = {{"model": {{"w": torch.zeros(1_000_000)}}, "epoch": 2, "epoch_step": 0,
                 "step": 8, "attempt": 1, "config_hash": "h1", "rng": []}}
        try:
            checkpoint.save(state, __import__("pathlib").Path({str(tmp_path)!r}), 8, keep=3)
        except OSError as exc:
            print("write failed:", exc.errno)
        else:
            raise SystemExit("the write should have failed")
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "write failed" in out.stdout, out.stdout + out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000004.pt",
        "ckpt-000000004.pt.sha256",
    ]
    assert checkpoint.load_latest(tmp_path, "h1")["step"] == 4


# --- restore is collective: every rank takes the same collectives, whatever it found ---------


def _restore_where_only_rank_0_sees_another_config(env, work_dirs, policy):
    """Rank 0's work folder holds a checkpoint of another config, rank 1's none: what a peer
    sees when rank 0 set the folder aside before that peer read it. Both ranks must agree
    and keep their collectives paired (an all_reduce right after proves it)."""
    import torch.distributed as dist
    from ddpflow.training.checkpoint import Checkpointer, CheckpointMismatch
    from workflow_helpers import make_run

    run = make_run(
        train={"checkpoint": {"on_config_change": policy}},
        machine={"cpu_ranks_per_node": 2},
    )
    work = work_dirs[env.rank]
    if env.rank == 0:
        checkpoint.save(_state(5, config_hash="another"), checkpoint.checkpoint_dir(work), 5, 3)
    ckpt = Checkpointer(RunSpec.from_run(run), work, env)
    try:
        # no loop is loaded into here: neither rank may resume another config's state
        nothing = types.SimpleNamespace(device=torch.device("cpu"))
        outcome = "fresh" if ckpt.restore(nothing) is None else "resumed"
    except CheckpointMismatch as exc:
        outcome = f"refused: {exc}"
    value = torch.tensor([float(env.rank)])
    dist.all_reduce(value)  # would pair with a stray barrier if restore had not agreed
    return outcome, float(value)


@pytest.mark.parametrize("policy", ["start_over", "refuse"])
def test_restore_agrees_across_ranks_when_one_rank_sees_another_config(tmp_path, policy):
    from distributed_helpers import run_group

    work_dirs = [str(tmp_path / "rank0"), str(tmp_path / "rank1")]
    ranks = run_group(
        2, _restore_where_only_rank_0_sees_another_config, (work_dirs, policy), tmp_path / "r"
    )
    assert [value for _, value in ranks] == [1.0, 1.0]
    outcomes = [outcome for outcome, _ in ranks]
    if policy == "start_over":
        assert outcomes == ["fresh", "fresh"]
        assert list((tmp_path / "rank0").glob("checkpoints.old-*/ckpt-*.pt")), "not set aside"
    else:
        assert all(o.startswith("refused") for o in outcomes), outcomes
        assert "another rank found checkpoints of another config" in outcomes[1]


# --- ZeRO's state on rank 0: tensors sent as tensors (training.zero_state) ------------------


def _zero_state_both_ways(env) -> dict | None:
    """A ZeRO optimizer over a channels_last conv net stepped twice at 3 ranks; rank 0's
    whole state from torch's consolidate_state_dict (pickles) and from zero_state."""
    from ddpflow.training import zero_state
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.Conv2d(8, 4, 3),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 2),
    ).to(memory_format=torch.channels_last)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, fused=True)
    for _ in range(2):
        model(torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.consolidate_state_dict(to=0)
    torchs = opt.state_dict() if env.rank == 0 else None
    zero_state.consolidate(opt)
    ours = opt.state_dict() if env.rank == 0 else None
    zero_state.release(opt)
    released = opt._all_state_dicts == []
    return {"torch": torchs, "ours": ours, "released": released}


def test_zero_state_on_rank_0_equals_torchs_consolidation_layout_included(tmp_path):
    from distributed_helpers import run_group

    results = run_group(3, _zero_state_both_ways, (), tmp_path)
    torchs, ours = results[0]["torch"], results[0]["ours"]
    assert ours["param_groups"] == torchs["param_groups"]
    assert ours["state"].keys() == torchs["state"].keys() and len(ours["state"]) == 6
    for index, entry in torchs["state"].items():
        for name, tensor in entry.items():
            got = ours["state"][index][name]
            assert torch.equal(got, tensor), (index, name)
            # the fused optimizer pairs a parameter's elements with its state's by memory
            # order: a channels_last weight's moments keep its strides
            assert got.stride() == tensor.stride(), (index, name)
    assert all(r["released"] for r in results)


def _trained_with(tmp_path, **checkpoint_cfg):
    """1 rank, 2 epochs of 6 steps of the MLP, its Checkpointer watching every step as the
    training job's does; returns the Checkpointer, the loop and the checkpoint folder."""
    from ddpflow.cluster.distenv import DistEnv
    from ddpflow.training.loop import Loop, fit
    from ddpflow.training.models import mlp
    from distributed_helpers import make_data
    from workflow_helpers import make_run

    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                  num_nodes=1, master_addr="127.0.0.1", master_port=29500, job_id="0",
                  launcher="single")  # fmt: skip
    run = make_run(
        model={"name": "mlp", "mlp_hidden": [16]},
        train={"epochs": 2, "global_batch_size": 32, "micro_batch_size": 32, "progress": False,
               "checkpoint": {"every_epochs": 0, "keep": 20, **checkpoint_cfg}},
        machine={"cpu_ranks_per_node": 1},
    )  # fmt: skip
    torch.manual_seed(0)
    spec = RunSpec.from_run(run)
    loop = Loop(spec, make_data(200, 20), env, torch.device("cpu"), mlp(64, [16], 4))
    ckpt = checkpoint.Checkpointer(spec, tmp_path, env)
    loop.watch_steps(ckpt.on_step)
    try:
        fit(loop, lambda record: None)
    finally:
        ckpt.saves.wait()
    return ckpt, loop, tmp_path / "checkpoints"


def test_background_checkpoints_hold_what_synchronous_ones_hold(tmp_path, caplog):
    """train.checkpoint.async: the same checkpoints (model, optimizer, position), each
    written by the background thread from a copy taken at its step."""
    with caplog.at_level(logging.INFO, logger="ddpflow.training.checkpoint"):
        _, _, sync_dir = _trained_with(tmp_path / "sync", every_steps=4)
        ckpt, _, async_dir = _trained_with(tmp_path / "async", every_steps=4, **{"async": True})
    names = [p.name for p in sorted(async_dir.glob("ckpt-*.pt"))]
    assert names == [p.name for p in sorted(sync_dir.glob("ckpt-*.pt"))] and len(names) == 3
    assert "written in the background" in caplog.text and ckpt.saves.waited_s
    for name in names:
        a, b = (checkpoint.safe_torch_load(d / name, "cpu") for d in (sync_dir, async_dir))
        assert a["step"] == b["step"] and a["epoch_step"] == b["epoch_step"]
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        moments = [(s["exp_avg"] if "exp_avg" in s else s.get("momentum_buffer"))
                   for s in (a["optimizer"]["state"][0], b["optimizer"]["state"][0])]  # fmt: skip
        assert moments[0] is None or torch.equal(*moments)


def test_every_minutes_checkpoints_by_wall_time(tmp_path, caplog, monkeypatch):
    """train.checkpoint.every_minutes: a checkpoint at the first agreed step (every 10 steps)
    once the time passed; off (0), none."""
    clock = iter(range(0, 10_000, 30))  # each look at the clock: 30 s later
    monkeypatch.setattr(checkpoint, "_clock", lambda: next(clock))
    with caplog.at_level(logging.INFO, logger="ddpflow.training.checkpoint"):
        _, _, folder = _trained_with(tmp_path / "on", every_minutes=0.5)
    assert [p.name for p in sorted(folder.glob("ckpt-*.pt"))] == ["ckpt-000000010.pt"]
    assert "(every 0.5 minutes)" in caplog.text
    _, _, folder = _trained_with(tmp_path / "off", every_minutes=0)
    assert not list(folder.glob("ckpt-*.pt"))


def test_a_resume_says_the_steps_it_redoes(tmp_path):
    """Rank 0 notes the step it reached after every step; a resume from the checkpoint at
    step S redoes reached - S steps (0 where the ranks saved where they stopped)."""
    _, _, folder = _trained_with(tmp_path, every_steps=4)  # 12 steps; checkpoints at 4, 8, 12
    assert (folder / checkpoint.REACHED).read_text().strip() == "12"
    assert checkpoint.steps_redone(folder, 8) == 4 and checkpoint.steps_redone(folder, 12) == 0
    assert checkpoint.steps_redone(tmp_path / "nothing-noted", 8) is None
    state = {"epoch": 1, "step": 8, "world_size": 1, "steps_redone": 4}
    assert checkpoint.resumed_line(state, 1) == (
        "resumed at epoch 2 step 8 on 1 rank, the world size it was written on; 4 steps redone"
    )
    assert checkpoint.resumed_line({**state, "steps_redone": 0}, 2).endswith(
        "the checkpoint was written on 1; no steps redone"
    )
