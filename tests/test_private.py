"""Nothing open to other users (ddpflow.cluster.private, runtime): job and work folders are
created 0700 and the files ddpflow writes there 0600; a folder others can write, or that
another user owns, is refused before anything is loaded from it (on the login node, in the
job's batch script before submitit loads its pickle, and on the ranks), naming the chmod
that fixes it; checkpoints and weights load only on a torch without the known weights_only
bypasses. Real folders, a real bash for the batch script's line."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest
import torch
from ddpflow import runtime
from ddpflow.cluster import private
from ddpflow.training import workspace
from workflow_helpers import make_run


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_new_folder_is_0700_and_what_ddpflow_writes_there_0600(tmp_path):
    os.umask(0o022)
    work = private.make(tmp_path / "results/work/run", "work folder")
    assert _mode(work) == 0o700 and _mode(work.parent) == 0o755  # only the leaf is private
    runtime.atomic_write_json(work / "fingerprint.json", {"a": 1})
    runtime.append_jsonl(work / "metrics.jsonl", {"epoch": 1})
    runtime.atomic_torch_save({"x": torch.ones(1)}, work / "ckpt.pt")
    for name in ("fingerprint.json", "metrics.jsonl", "ckpt.pt"):
        assert _mode(work / name) == 0o600, name
    # elsewhere the umask decides, as for any file (results are the user's to share)
    runtime.atomic_write_json(tmp_path / "results/summary.json", {"a": 1})
    assert _mode(tmp_path / "results/summary.json") == 0o644


def test_an_older_folder_is_tightened_and_one_others_can_write_is_refused(tmp_path):
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    os.chmod(old, 0o755)
    private.make(old, "work folder")
    assert _mode(old) == 0o700
    for mode, who in ((0o777, "its group and every user"), (0o720, "its group can write it")):
        open_ = tmp_path / f"open{mode:o}"
        open_.mkdir()
        os.chmod(open_, mode)
        with pytest.raises(private.OpenFolder) as refused:
            private.make(open_, "work folder")
        message = str(refused.value)
        assert f"work folder {open_}: " in message and who in message
        assert f"fix: chmod 700 {open_}" in message
        assert _mode(open_) == mode  # refused, not silently changed


def test_a_folder_of_another_user_is_refused(tmp_path):
    if os.getuid() != 0:
        pytest.skip("chown to another user needs root (CI runs as root)")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)  # nobody
    with pytest.raises(private.OpenFolder, match=r"belongs to uid 65534, not to you"):
        private.check(theirs, "job folder")


def test_the_work_folder_is_refused_before_the_training_is_planned(tmp_path):
    run = make_run()
    work = tmp_path / "work"
    work.mkdir()
    os.chmod(work, 0o777)
    with pytest.raises(private.OpenFolder, match=r"work folder .*every user can write it"):
        workspace.prepare(run, work)
    assert sorted(work.iterdir()) == []  # nothing read or written


@pytest.mark.parametrize("parent", ["results/work", "results/work/.."])
def test_a_parent_others_can_write_is_refused_before_anything_is_read(tmp_path, parent):
    """Whoever can write results/work can move a run's folder aside and put their own in its
    place: refused as the folder itself is, naming the parent and its chmod. Above
    ddpflow's own folder (results/work) the user's folders are theirs to share."""
    run = make_run()
    work = private.make(tmp_path / "results/work/run", "work folder")
    (work / "fingerprint.json").write_text("{}")
    writable = (tmp_path / parent).resolve()
    os.chmod(writable, 0o777)
    if parent != "results/work":
        assert workspace.prepare(run, work) == "fresh"  # results/ is the user's to share
        return
    with pytest.raises(private.OpenFolder) as refused:
        workspace.prepare(run, work)
    message = str(refused.value)
    assert f"work folder {work}: its parent {writable}: its group and every user can" in message
    assert f"fix: chmod go-w {writable}" in message
    assert sorted(p.name for p in work.iterdir()) == ["fingerprint.json"]  # nothing touched
    assert _mode(writable) == 0o777
    os.chmod(writable, 0o1777)  # sticky, as /tmp: nobody can rename what another user owns
    private.make(work, "work folder")


def test_parents_are_created_unwritable_by_others_whatever_the_umask(tmp_path):
    old = os.umask(0o002)  # a group project's umask: mkdir would give 0775
    try:
        folder = private.make_job_folder(tmp_path / "logs/submitit/run/train")
    finally:
        os.umask(old)
    assert _mode(folder) == 0o700
    assert _mode(folder.parent) == 0o755 and _mode(folder.parent.parent) == 0o755
    private.make(folder, "job folder", top=tmp_path / "logs/submitit")  # and accepted again


def _batch_line(folder) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", private.refusal_script(folder) + "\necho loaded"],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_batch_script_refuses_to_load_pickles_from_an_open_folder(tmp_path):
    folder = private.make(tmp_path / "logs/submitit/run/train", "job folder")
    done = _batch_line(folder)
    assert done.returncode == 0 and done.stdout == "loaded\n", done.stderr
    os.chmod(folder, 0o770)
    done = _batch_line(folder)
    assert done.returncode == 1 and "loaded" not in done.stdout
    assert f"ddpflow: the job folder {folder} can be written by others" in done.stderr
    assert f"chmod 700 {folder}" in done.stderr


def test_the_batch_script_refuses_a_job_folder_whose_parent_others_can_write(tmp_path):
    top = tmp_path / "logs/submitit"
    folder = private.make_job_folder(top / "run/train")
    script = private.job_refusal_script(folder)
    for writable in (top, top / "run"):
        os.chmod(writable, 0o777)
        done = subprocess.run(["bash", "-c", script + "\necho loaded"], capture_output=True,
                              text=True, timeout=30)  # fmt: skip
        assert done.returncode == 1 and "loaded" not in done.stdout, writable
        assert "or so can one of its parents" in done.stderr and "chmod go-w" in done.stderr
        os.chmod(writable, 0o1777)  # sticky: safe
        done = subprocess.run(["bash", "-c", script + "\necho loaded"], capture_output=True,
                              text=True, timeout=30)  # fmt: skip
        assert done.stdout == "loaded\n", done.stderr
        os.chmod(writable, 0o755)


def test_the_submitit_pickles_are_sealed(tmp_path):
    folder = private.make(tmp_path / "job", "job folder")
    (folder / "1_submitted.pkl").write_bytes(b"x")
    os.chmod(folder / "1_submitted.pkl", 0o644)
    private.seal_files(folder)
    assert _mode(folder / "1_submitted.pkl") == 0o600


@pytest.mark.parametrize(
    ("version", "safe"),
    [("2.14.1", True), ("2.10.0+cu128", True), ("3.0.0", True), ("2.9.1", False),
     ("2.5.1+cpu", False), ("1.13.1", False)],
)  # fmt: skip
def test_weights_load_only_on_a_torch_without_the_known_bypasses(version, safe):
    problem = runtime.weights_only_problem(version)
    assert (problem is None) is safe
    if not safe:
        assert f"torch {version}" in problem and "CVE-2025-32434" in problem
        assert "torch>=2.10" in problem


def test_a_checkpoint_is_not_loaded_on_an_unsafe_torch(tmp_path, monkeypatch):
    path = tmp_path / "model.pt"
    runtime.atomic_torch_save({"w": torch.ones(2)}, path)
    assert torch.equal(runtime.safe_torch_load(path)["w"], torch.ones(2))
    monkeypatch.setattr(torch, "__version__", "2.9.1")
    with pytest.raises(RuntimeError, match=r"torch 2.9.1 loads checkpoints"):
        runtime.safe_torch_load(path)
