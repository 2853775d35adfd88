"""Why a run did not finish, and the report of the runs that did.

A failed train or evaluate rule leaves a record in the run's work folder
(results/work/<run>/failed.json: stage, cause, log), which Snakemake's clean-up of the failed
job cannot delete (it is no declared output); the next attempt of that rule removes it first.
A failed stage rule leaves one per dataset (results/work/.staging/<dataset>/failed.json: a run
name cannot start with a dot), and it is the cause of every run that reads that dataset.
With keep-going (both profiles), the other runs of the config train and evaluate on; the
report rule, which needs every run, cannot run, so Snakemake's `onerror` hook
(workflow/rules/hooks.smk) calls `report_unfinished`: whatever failed or was stopped, the
report of this config's runs that finished, with a section naming each run that did not and
why, so results/report/ never keeps describing an earlier config.

    record_failure(work, "train", exc, "logs/train/wild.log")   # in the rule's process
    report_unfinished(runs, "results")                            # in Snakemake's, on error
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from logging import FileHandler
from pathlib import Path

from ddpflow.cluster.nodes import read_ledger
from ddpflow.config import evaluation_fingerprint, training_fingerprint
from ddpflow.errors import UserError
from ddpflow.paths import (
    CHECKPOINTS,
    FAILED,
    LIVE_METRICS,
    REPORT_FILES,
    TRACKING_FILE,
    RunPaths,
    bad_nodes_file,
    report_dir,
    run_dir,
    staged_dir,
    work_dir,
)
from ddpflow.report.sweep import slim
from ddpflow.runtime import atomic_write_json
from ddpflow.tracking.track import read_failure as read_tracking_failure
from ddpflow.words import counted

log = logging.getLogger(__name__)

# shown in the report for a run with neither a result nor a failure record of its own
NOT_RUN = (
    "not run: a step it needs failed or was stopped (staging, say); see Snakemake's output above"
)


def staging_work(results_dir: str | Path, dataset_id: str) -> Path:
    """Where the stage rule of one dataset keeps why it failed (shared by its runs)."""
    return work_dir(results_dir, ".staging") / dataset_id


@contextmanager
def staging_recorded(out_dir: str | Path) -> Iterator[None]:
    """Stage into out_dir (results/staged/<dataset>) and, where that fails, keep why for the
    report of every run that reads the dataset. Called by pipeline.stage_data, not by
    scripts/stage.py: Snakemake restages every dataset whose rule script is newer than its
    output, so an upgrade that touched the script would retrain every run."""
    work = staging_work(Path(out_dir).parent.parent, Path(out_dir).name)
    clear_failure(work)
    try:
        yield
    except BaseException as exc:
        # the stage rule's log: pipeline.run_rule sends this process's logging there
        handlers = logging.getLogger().handlers
        log_file = next((h.baseFilename for h in handlers if isinstance(h, FileHandler)), None)
        if log_file and Path(log_file).is_relative_to(Path.cwd()):  # as Snakemake names it
            log_file = str(Path(log_file).relative_to(Path.cwd()))
        record_failure(work, "stage", exc, log_file)
        raise


def clear_failure(work: str | Path) -> None:
    """A rule starts again for this run: the last failure no longer describes it."""
    (Path(work) / FAILED).unlink(missing_ok=True)


def record_failure(work: str | Path, stage: str, exc: BaseException, log_file: str | None):
    """Keep why `stage` of this run failed: the message's first line is the cause shown in
    the report's table, the first lines of the rest its detail."""
    message = str(exc).strip() or type(exc).__name__
    if isinstance(exc, KeyboardInterrupt):
        message = "stopped (Ctrl-C or a signal to Snakemake)"
    elif not isinstance(exc, SystemExit | UserError):  # a user error's message says it all
        message = f"{type(exc).__name__}: {message}"
    lines = message.splitlines()
    # a failed job's message: "<job> failed (...)", then one line per culprit rank
    # ("  rank 0 on node3: <exception>"): the first culprit is the cause
    culprit = next((line.strip() for line in lines[1:] if line.startswith("  rank ")), None)
    cause = lines[0]
    if cause.endswith(":") and len(lines) > 1:  # "... fix them and rerun:" then the first one
        cause += " " + lines[1].strip().removeprefix("- ")
        more = counted(len(lines) - 2, "more line")
        cause += f" (and {more}: see the log)" if len(lines) > 2 else ""
    record = {
        "interrupted": isinstance(exc, KeyboardInterrupt),
        "stage": stage,
        "cause": culprit or cause,
        "detail": "\n".join(lines[:40]),
        "log": log_file,
        "host": socket.gethostname(),
        "time": time.time(),
    }
    try:
        Path(work).mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(work) / FAILED, record)
    except OSError as err:  # the failure itself must still surface, whatever happens here
        log.warning("could not record the failure in %s: %s", work, err)


def read_failure(work: str | Path) -> dict | None:
    try:
        record = json.loads((Path(work) / FAILED).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "cause" in record else None


def run_failure(run: dict, results_dir: str | Path) -> dict | None:
    """Why this run did not finish, if a rule said so: a failed staging of its dataset comes
    first (its train rule never ran under this config: a record of its own is older)."""
    dataset = run["dataset_id"]
    staging = read_failure(staging_work(results_dir, dataset))
    if staging and not staged_dir(results_dir, dataset).is_dir():  # staged since: stale
        return staging
    return read_failure(work_dir(results_dir, run["name"]))


def interrupted_runs(runs: dict[str, dict], results_dir: str | Path) -> set[str]:
    """The runs whose last train or evaluate rule was stopped (Ctrl-C, a signal)."""
    return {
        name
        for name, run in runs.items()
        if (run_failure(run, results_dir) or {}).get("interrupted")
    }


def _current(run: dict, paths: RunPaths) -> bool:
    """The run's published result exists and belongs to its current config (a run whose
    staging failed keeps an older config's result: that is no result of this config)."""
    if not (Path(paths.train_metrics).is_file() and Path(paths.eval_metrics).is_file()):
        return False
    try:
        recorded = json.loads(Path(paths.eval_metrics).read_text())["provenance"]["config"]
        return training_fingerprint(recorded) == training_fingerprint(run) and (
            evaluation_fingerprint(recorded) == evaluation_fingerprint(run)
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def report_unfinished(
    runs: dict[str, dict], results_dir: str | Path, restored: Iterable[str] = (), persistence=None
) -> Path | None:
    """After a failed or stopped workflow: the report of this config's runs that finished,
    naming every run that did not and why (its failure record, else NOT_RUN). Returns the
    HTML report's path, or None where it could not be written. Never raises: it runs in
    Snakemake's error hook, after the failure was reported. restored: runs whose rerun failed
    or was stopped and whose previous outputs came back (ddpflow.kept): this config's run did
    not finish (a failed one's entry says where the previous config's result is kept)."""
    try:
        return _report_unfinished(runs, results_dir, set(restored), persistence)
    except Exception as exc:  # noqa: BLE001 - the hook must not hide the original failure
        log.warning("ddpflow: no report of the finished runs: %s: %s", type(exc).__name__, exc)
        return None


def _unfinished_line(entry: dict, runs: dict[str, dict], results_dir) -> str:
    """One line per run that did not finish; a stopped one says where it stopped, what is
    kept and the command that continues it."""
    name = entry["run"]
    if not entry.get("interrupted"):
        if "log" not in entry:  # no rule of it failed: one it needs did (see above)
            return f"ddpflow: run {name!r} did not finish"
        failed, again = f"{entry['stage']} failed: {entry['cause']}", "run the same command again"
        return f"ddpflow: run {name!r} did not finish ({failed}); fix that, then {again}"
    work = work_dir(results_dir, name)
    epochs = _lines(work / LIVE_METRICS) if entry["stage"] == "train" else 0
    total = runs.get(name, {}).get("train", {}).get("epochs", "?")
    where = f" after epoch {epochs} of {total}" if epochs else ""
    saved = sorted((work / CHECKPOINTS).glob("ckpt-*"))
    step = saved[-1].name.removeprefix("ckpt-").split(".")[0].lstrip("0") if saved else ""
    kept = "no checkpoint was written yet; the same command starts it again"
    if entry["stage"] != "train":
        kept = "the same command runs it again"
    elif saved:
        kept = f"its checkpoint (step {step or 0}) is kept; the same command continues it"
    run = runs.get(name, {})
    if run.get("launcher") == "slurm" and not run["machine"]["cancel_on_interrupt"]:
        kept = "its Slurm job keeps running (machine.cancel_on_interrupt: false); the same "
        kept += "command reattaches to it"
    return f"ddpflow: run {name!r}: {entry['stage']} interrupted{where}; {kept}: {_command()}"


def _lines(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except OSError:
        return 0


def _command() -> str:
    """This Snakemake's command line as the user can type it again."""
    program = Path(sys.argv[0])
    if program.name == "snakemake" and shutil.which("snakemake") == str(program):
        shown = "snakemake"  # on the PATH (an activated .venv)
    else:
        shown = os.path.relpath(program) if program.is_absolute() else str(program)
        shown = shown if len(shown) < len(str(program)) else str(program)
    return shlex.join([shown, *sys.argv[1:]])


def bad_nodes_line(bad_nodes: list[dict]) -> str:
    """The ledger in one line for the terminal."""
    names = ", ".join(f"{e['node']} ({e.get('reason', '?')})" for e in bad_nodes)
    repaired = "once repaired: snakemake clean_bad_nodes"
    return f"bad nodes, excluded from later Slurm jobs: {names}; {repaired}"


def _sort_runs(runs: dict[str, dict], results_dir, restored=frozenset()) -> tuple[list, list, list]:
    """The finished runs' report entries, the unfinished ones' (with why) and the tracking
    failures of finished runs; each keeps its sweep point for the report's ranking."""
    finished, unfinished, tracking_failures = [], [], []
    for name, run in runs.items():
        paths = RunPaths.for_run(results_dir, run)
        failure = run_failure(run, results_dir)
        # a result of this config is finished, whatever an older failure record says (a
        # failed retraining given back, then the edit reverted); a retraining that failed
        # or was stopped is this config's unfinished run, whatever was given back
        if (name in restored and failure is None) or _current(run, paths):
            finished.append(_finished_entry(name, run, paths))
            # only its logging to a tracker failed: a finished run, named in the trackers'
            # section (the report rule, after every track rule, could not run)
            if tracked := read_tracking_failure(paths.work):
                tracking_failures.append({"run": name, **tracked})
        else:
            failure = failure or stage_job_failure(run, results_dir)
            entry = {"run": name, **(failure or {"stage": "-", "cause": NOT_RUN})}
            if name in restored and not entry.get("interrupted"):
                kept = run_dir(results_dir, name)
                entry["cause"] += f"; the previous config's result is kept in {kept}"
            unfinished.append({**entry, "sweep": slim(run.get("sweep"))})
    return finished, unfinished, tracking_failures


# where Snakemake's Slurm executor plugin keeps its jobs' logs (the staging job's)
PLUGIN_STAGE_LOGS = Path(".snakemake") / "slurm_logs" / "rule_stage"
_SLURM_ERROR = re.compile(r"\berror\b|CANCELLED|DUE TO|out of memory|oom-kill", re.IGNORECASE)


def stage_job_failure(run: dict, results_dir) -> dict | None:
    """A staging job that failed before ddpflow's script could say why (srun refused its
    step; its time or memory ran out): Slurm's own last error line from the plugin's log of
    the job, so the terminal and the report name the cause, not "not run"."""
    if staged_dir(results_dir, run["dataset_id"]).exists() or not PLUGIN_STAGE_LOGS.is_dir():
        return None
    logs = [p for p in PLUGIN_STAGE_LOGS.rglob("*.log") if run["dataset_id"] in str(p)]
    if not logs:
        return None
    newest = max(logs, key=lambda p: p.stat().st_mtime)
    lines = newest.read_text(errors="replace").splitlines()
    errors = [line.strip() for line in lines if _SLURM_ERROR.search(line)]
    said = errors[-1] if errors else "no error line in its log"
    cause = f"the staging job failed in Slurm: {said} (machine.stage sets its resources)"
    return {"stage": "stage", "cause": cause, "detail": "\n".join(lines[-40:]), "log": str(newest)}


def _finished_entry(name: str, run: dict, paths: RunPaths) -> dict:
    """A finished run's report entry: its records, its tracking file, its sweep point."""
    records = {"train_metrics": paths.train_metrics, "eval_metrics": paths.eval_metrics}
    tracking = str(Path(paths.eval_metrics).parent / TRACKING_FILE)
    return {"name": name, **records, "tracking": tracking, "sweep": slim(run.get("sweep"))}


# the report rule's files a failed workflow's report rewrites (and the plots folder)
REPORT_OUTPUTS = ("markdown", "html", "summary_json", "summary_csv")


def _mark_incomplete(persistence, keys: list[str]) -> None:
    """Snakemake's record of each file says incomplete: the next run redoes the report
    (the profiles rerun incomplete outputs). Without that record (another Snakemake, or
    none given) the files are dated 1970 instead, older than any input."""
    mark = getattr(persistence, "_mark_incomplete", None)
    for key in keys:
        if mark is not None:
            mark(key, None)
        elif Path(key).is_file():
            os.utime(key, (0, 0))


def _report_unfinished(
    runs: dict[str, dict], results_dir: str | Path, restored, persistence=None
) -> Path | None:
    finished, unfinished, untracked = _sort_runs(runs, results_dir, restored)
    from ddpflow.report.build import build_report  # matplotlib: only once a report is written

    out = report_dir(results_dir)
    bad_nodes = read_ledger(bad_nodes_file(results_dir))
    written = build_report(
        finished, out, unfinished=unfinished, bad_nodes=bad_nodes, tracking_failures=untracked
    )
    # Snakemake's report rule must redo this report on the next run even when no input
    # changes (the failed run removed from config.yaml, say): its outputs are marked
    # incomplete in Snakemake's records (the profile reruns incomplete outputs), and keep
    # their true dates
    keys = [str(written[k]) for k in REPORT_OUTPUTS] + [str(out / REPORT_FILES["plots"])]
    _mark_incomplete(persistence, keys)
    for entry in unfinished:
        print(_unfinished_line(entry, runs, results_dir), file=sys.stderr)
    for entry in untracked:
        line = f"ddpflow: run {entry['run']!r} finished; its tracking failed: {entry['cause']}"
        print(line, file=sys.stderr)
    if bad_nodes:
        print(f"ddpflow: {bad_nodes_line(bad_nodes)}", file=sys.stderr)
    print(
        f"ddpflow: report of the {len(finished)} finished of {counted(len(runs), 'run')}, "
        f"naming the others: {written['html']}",
        file=sys.stderr,
    )
    return written["html"]
