"""The user's own loop, end to end: run, edit config.yaml, rerun; delete an output, rerun;
stop Snakemake, rerun. Every rerun redoes exactly what the edit affects, says why in one
short line, and never resumes a checkpoint that belongs to another config or to a finished
training. Real Snakemake, real submitit local jobs, 2 real gloo ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from workflow_helpers import jobs_planned, snakemake, snakemake_command, write_config

pytestmark = pytest.mark.e2e

BASE = {
    "train": {"epochs": 2, "progress": False, "checkpoint": {"every_epochs": 1, "keep": 3}},
    "runs": [{"name": "cnn"}],
    "export": {"formats": ["safetensors"]},  # the default, asked for: a deleted model re-exports
}


def _edit(base: dict, section: str, **values) -> dict:
    """base with section.<key> set (one level of nesting: 'optimizer__lr' -> optimizer.lr)."""
    out = json.loads(json.dumps(base))
    for key, value in values.items():
        target = out.setdefault(section, {})
        *parents, leaf = key.split("__")
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    return out


def _newest_rank0_log(workdir: Path, stage: str) -> str:
    logs = sorted(
        (workdir / f"logs/submitit/cnn/{stage}").glob("*_0_log.err"),
        key=lambda p: p.stat().st_mtime,
    )
    return logs[-1].read_text()


def _train_records(workdir: Path) -> list[dict]:
    text = (workdir / "results/runs/cnn/train_metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def _ok(result) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return output


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("loop")
    _ok(snakemake(workdir, write_config(workdir / "config.yaml", BASE)))
    return workdir


def test_success_leaves_a_lean_work_folder(trained):
    work = trained / "results/work/cnn"
    assert len(list((work / "checkpoints").glob("ckpt-*.pt"))) == 1  # keep_after_success: 1
    assert not list(work.glob("rendezvous-*")), "stale rendezvous files left behind"
    assert (work / "finished.json").exists()


def test_a_run_added_with_keys_of_its_own_plans_only_itself(trained, tmp_path):
    """An MLP run beside the CNN brings fingerprint keys the CNN has not (mlp_hidden): each
    rule has one param per key of any run, so the CNN's params used to gain
    `model.mlp_hidden=null` and it retrained. A key a run lacks is now left unrecorded."""
    added = {**BASE, "runs": [*BASE["runs"], {"name": "mlp", "model": {"name": "mlp"}}]}
    dry = snakemake(trained, write_config(tmp_path / "added.yaml", added), "-n")
    text = dry.stdout + dry.stderr
    assert dry.returncode == 0, text[-3000:]
    planned = {line.split()[-1] for line in text.splitlines() if "wildcards: run=" in line}
    assert planned == {"run=mlp"}, text[-3000:]


def test_changes_that_cannot_change_results_redo_nothing(trained):
    """Where and how the ranks run (the world size too), logging and checkpoint cadence:
    nothing is redone."""
    machine = _edit(BASE, "machine", time_min=30, mem_gb=2, pg_timeout_s=99, cpus_per_task=1,
                    cpu_ranks_per_node=1)  # fmt: skip
    edited = _edit(machine, "train", progress=True, max_requeues=1, checkpoint__keep=5)
    configfile = write_config(trained / "harmless.yaml", edited)
    assert jobs_planned(trained, configfile) == set()


def test_eval_edit_reevaluates_without_retraining(trained, tmp_path):
    configfile = write_config(tmp_path / "eval.yaml", _edit(BASE, "eval", batch_size=100))
    dry = snakemake(trained, configfile, "-n")
    assert jobs_planned(trained, configfile) == {"evaluate", "report", "all"}
    reason = next(line for line in dry.stdout.splitlines() if "Params have changed" in line)
    assert "eval.batch_size=100" in reason and "eval.batch_size=512" in reason
    assert len(reason) < 300, f"the rerun reason is not one short line: {reason}"
    # where the evaluation runs cannot change it: no rerun
    in_own_job = write_config(tmp_path / "own.yaml", _edit(BASE, "eval", in_train=False))
    assert jobs_planned(trained, in_own_job) == set()


def test_eval_split_edit_scores_alone_in_a_job_of_its_own(trained, tmp_path):
    """The training job evaluated the test split; eval.split: val is scored by an evaluate
    job (the training job's evaluation is of another split), without retraining."""
    first = json.loads((trained / "results/runs/cnn/eval_metrics.json").read_text())
    assert first["evaluated_by"] == "train job" and first["split"] == "test"
    assert not (trained / "logs/submitit/cnn/evaluate").exists()
    model_mtime = (trained / "results/runs/cnn/model.pt").stat().st_mtime_ns
    configfile = write_config(tmp_path / "val.yaml", _edit(BASE, "eval", split="val"))
    output = _ok(snakemake(trained, configfile))
    assert "(evaluated in a job of its own)" in output
    again = json.loads((trained / "results/runs/cnn/eval_metrics.json").read_text())
    assert again["evaluated_by"] == "evaluate job" and again["split"] == "val"
    assert again["samples_evaluated"] == again["test_size"] == 144
    assert (trained / "results/runs/cnn/model.pt").stat().st_mtime_ns == model_mtime
    # back to the test split: scored again (not the training job's stale record)
    _ok(snakemake(trained, trained / "config.yaml"))
    back = json.loads((trained / "results/runs/cnn/eval_metrics.json").read_text())
    assert back["split"] == "test" and back["evaluated_by"] == "evaluate job"
    assert back["confusion_matrix"] == first["confusion_matrix"] and back["loss"] == first["loss"]


def test_hyperparameter_edit_retrains_from_scratch_and_names_the_change(trained):
    """Finding 1: lr edited after a finished training used to fail with a checkpoint refusal
    (reported as 'ranks may have been killed'), after Snakemake had deleted the old model."""
    configfile = write_config(trained / "config.yaml", _edit(BASE, "train", optimizer__lr=0.02))
    dry = snakemake(trained, configfile, "-n")
    reason = next(line for line in dry.stdout.splitlines() if "Params have changed" in line)
    assert "train.optimizer.lr=0.02" in reason and "train.optimizer.lr=0.05" in reason
    assert len(reason) < 300, f"the rerun reason is not one short line: {reason}"

    output = _ok(snakemake(trained, configfile))
    rule_log = (trained / "logs/train/cnn.log").read_text()
    assert "train.optimizer.lr 0.05 -> 0.02: training from scratch" in rule_log, rule_log
    # the retrained run's epochs are shown live (the finished training's lines were taken
    # for this one's once, and none of its epochs was printed)
    assert "run 'cnn' epoch 1/2" in output and "run 'cnn' epoch 2/2" in output, output[-2000:]
    assert "RESUMED" not in _newest_rank0_log(trained, "train")
    assert [r["epoch"] for r in _train_records(trained)] == [1, 2]
    set_aside = list((trained / "results/work/cnn").glob("checkpoints.old-*/ckpt-*.pt"))
    assert set_aside, "the old config's checkpoints were not set aside"
    metrics = json.loads((trained / "results/runs/cnn/eval_metrics.json").read_text())
    assert metrics["provenance"]["config"]["train"]["optimizer"]["lr"] == 0.02
    assert "lr: 0.02" in (trained / "results/report/report.md").read_text()


def test_deleted_model_retrains_from_scratch(trained):
    """Finding 2: deleting model.pt used to restore the finished training's last checkpoint
    ('RESUMED from attempt 1: resumed at epoch E step N', zero epochs trained)."""
    configfile = write_config(trained / "config.yaml", _edit(BASE, "train", optimizer__lr=0.02))
    (trained / "results/runs/cnn/model.pt").unlink()
    assert jobs_planned(trained, configfile) == {
        "train",
        "evaluate",
        "export_safetensors",  # from the new model.pt
        "report",
        "all",
    }
    _ok(snakemake(trained, configfile))
    rank0 = _newest_rank0_log(trained, "train")
    assert "RESUMED" not in rank0, rank0[-2000:]
    assert rank0.count(" epoch 1/2 ") == 1 and rank0.count(" epoch 2/2 ") == 1, rank0[-2000:]
    assert "previous training finished" in (trained / "logs/train/cnn.log").read_text()


def test_clean_work_removes_set_aside_and_finished_checkpoints(trained):
    work = trained / "results/work/cnn"
    assert list(work.glob("checkpoints.old-*"))
    configfile = write_config(trained / "config.yaml", _edit(BASE, "train", optimizer__lr=0.02))
    # the target goes first: --configfile takes every name after it
    output = _ok(snakemake(trained, None, "clean_work", "--configfile", str(configfile)))
    assert not list(work.glob("checkpoints.old-*")), output[-2000:]
    assert not (work / "checkpoints").exists()
    assert (trained / "results/runs/cnn/model.pt").exists()
    assert jobs_planned(trained, configfile) == set(), "clean_work invalidated an output"


def _start(workdir: Path, configfile: Path, out: str = "snakemake.out") -> subprocess.Popen:
    """Snakemake in a session of its own, as a terminal starts it: os.killpg is a Ctrl-C."""
    cmd, env = snakemake_command(workdir, configfile)
    log = open(workdir / out, "ab")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        cmd, stdout=log, stderr=log, env=env, cwd=workdir, start_new_session=True,
        # as from a terminal: a CI started in the background (a non-interactive shell's
        # `&`) passes SIGINT down ignored, and Snakemake then rightly ignores it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


def _quietly_stopped(workdir: Path, out: str, stage: str) -> str:
    """The output of a stopped workflow: no traceback, and the run's one line saying what was
    interrupted, what is kept and the command that goes on."""
    text = (workdir / out).read_text()
    assert "Traceback" not in text, text[-4000:]
    lines = [line for line in text.splitlines() if line.startswith("ddpflow: run 'cnn': ")]
    assert len(lines) == 1 and f"{stage} interrupted" in lines[0], text[-3000:]
    assert "the same command" in lines[0] and "--configfile" in lines[0], lines[0]
    return lines[0]


def _wait_for(predicate, proc: subprocess.Popen, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"the workflow ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for every purpose here
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _job_pids(folder: Path) -> list[int]:
    """submitit's local job id is the PID of the process that runs the job's ranks."""
    return sorted({int(p.name.split("_")[0]) for p in folder.glob("*_log.err")})


def test_signals_to_snakemake_stop_the_jobs_and_rerun_recovers(workdir):
    """Finding 7: SIGINT to Snakemake (its PID only) during a local evaluation let the job
    run on. Now a terminal's Ctrl-C (SIGINT to the whole process group) and SIGTERM during
    training, and SIGINT during evaluation, all stop the job at once (nothing left running),
    each with one line naming what stopped, what is kept and the command that continues it,
    and no traceback; the reruns resume training, then redo evaluation."""
    slow = _edit(BASE, "train", epochs=6, checkpoint__every_steps=5)
    slow["eval"] = {"in_train": False}  # an evaluate job to stop, after the training job
    configfile = write_config(workdir / "config.yaml", slow)
    train_logs = workdir / "logs/submitit/cnn/train"
    checkpoints = workdir / "results/work/cnn/checkpoints"
    proc = _start(workdir, configfile, "ctrl-c.out")
    _wait_for(lambda: list(checkpoints.glob("ckpt-*.pt")), proc, "a ckpt")
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal
    assert proc.wait(timeout=90) != 0
    assert not any(_alive(pid) for pid in _job_pids(train_logs)), "training job left running"
    assert "checkpoint (step " in _quietly_stopped(workdir, "ctrl-c.out", "train")
    first = sorted(checkpoints.glob("ckpt-*.pt"))[-1]

    proc = _start(workdir, configfile, "sigterm.out")
    _wait_for(lambda: sorted(checkpoints.glob("ckpt-*.pt"))[-1] != first, proc, "a later ckpt")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) != 0
    assert not any(_alive(pid) for pid in _job_pids(train_logs)), "training job left running"
    _quietly_stopped(workdir, "sigterm.out", "train")
    assert not (workdir / "results/runs/cnn/model.pt").exists(), "stopped too late"

    proc = _start(workdir, configfile, "sigint.out")
    eval_logs = workdir / "logs/submitit/cnn/evaluate"
    _wait_for(lambda: _job_pids(eval_logs), proc, "the evaluation job")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=90) != 0
    assert not any(_alive(pid) for pid in _job_pids(eval_logs)), "evaluation job left running"
    _quietly_stopped(workdir, "sigint.out", "evaluate")
    assert "RESUMED from attempt" in _newest_rank0_log(workdir, "train")
    assert not (workdir / "results/runs/cnn/eval_metrics.json").exists(), "stopped too late"

    output = _ok(snakemake(workdir, configfile))
    assert "rule train" not in output, "training redone although it had finished"
    metrics = json.loads((workdir / "results/runs/cnn/eval_metrics.json").read_text())
    assert metrics["samples_evaluated"] == metrics["test_size"]
