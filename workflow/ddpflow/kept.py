"""A failed rerun never costs a finished run: its previous outputs come back.

Snakemake deletes a job's declared outputs before the job runs (and again after it fails), so
a rerun of a finished run that fails (a refusal only the rule can make, a rank that crashes
on the edited config) would leave the run with no model and no metrics: the report would not
show it, and reverting the edit would train it all again. Before any job runs (Snakemake's
`onstart`, workflow/rules/hooks.smk), every complete set of a run's outputs (train: model,
metrics, summary; evaluate; track; predict; generate; each export) is hard-linked into
results/runs/<run>/.kept/<rule>/ (no copy: the same bytes, the same modification time) and
Snakemake's metadata record of each file is kept in memory. After a failed workflow
(`onerror`), a set whose files are all gone is linked back and its metadata written back: the
run is finished as before, byte for byte, its downstream outputs stay up to date, and
Snakemake still sees the params the files were made with, so the edit is retried by the next
run and reverting it plans nothing.

    kept = KeptOutputs(workflow.persistence, runs, "results")   # onstart
    kept.restore_failed(interrupted)                              # onerror
    kept.drop()                                                   # onsuccess
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Collection
from pathlib import Path

from ddpflow.paths import (
    EXPORT_FILES,
    GENERATE_FILES,
    PREDICT_FILES,
    RUN_FILES,
    TRACKING_FILE,
)

KEPT = ".kept"
# Snakemake's own metadata methods (not a public API: snakemake is pinned in
# envs/requirements.txt, and tests/test_refusal_keeps_finished_run.py runs them for real)
PERSISTENCE_API = ("_read_record", "_write_record", "_unmark_incomplete", "_filter_incomplete_keys")
# each rule's declared outputs in a run's folder: a set is kept and restored whole
GROUPS = {
    "train": (RUN_FILES["model"], RUN_FILES["train_metrics"], RUN_FILES["train_summary"]),
    "evaluate": (RUN_FILES["eval_metrics"],),
    "track": (TRACKING_FILE,),
    # `snakemake predict` (a corrupt input under predict.on_corrupt: fail) and the exports
    "predict": tuple(PREDICT_FILES.values()),
    "generate": tuple(GENERATE_FILES.values()),
    **{f"export_{fmt}": (name,) for fmt, name in EXPORT_FILES.items()},
}


class KeptOutputs:
    """The finished outputs of every run as they were when this workflow started."""

    def __init__(self, persistence, run_names, results: str):
        if not all(hasattr(persistence, m) for m in PERSISTENCE_API):  # another Snakemake
            print(
                f"ddpflow: warning: this Snakemake's metadata store has no {PERSISTENCE_API}:"
                " a failed rerun of a finished run cannot give its outputs back",
                file=sys.stderr,
            )
            run_names = ()
        self._persistence = persistence
        self._records: dict[str, object] = {}
        # the folders as the rules name their outputs: f"{RESULTS}/runs/{run}/<file>" is
        # Snakemake's metadata key of each file
        self._folders = [f"{results}/runs/{name}" for name in run_names]
        self._kept: list[tuple[str, str]] = []
        for folder in self._folders:
            shutil.rmtree(Path(folder, KEPT), ignore_errors=True)  # an earlier workflow's
            for rule, names in GROUPS.items():
                keys = [f"{folder}/{name}" for name in names]
                if all(Path(key).is_file() for key in keys) and not (
                    persistence._filter_incomplete_keys(keys)  # a killed job's half files
                ):
                    self._keep(folder, rule, names)

    def _keep(self, folder: str, rule: str, names: tuple[str, ...]) -> None:
        target = Path(folder, KEPT, rule)
        target.mkdir(parents=True, exist_ok=True)
        for name in names:
            _link(f"{folder}/{name}", target / name)
            key = f"{folder}/{name}"
            self._records[key] = self._persistence._read_record(key)
        self._kept.append((folder, rule))

    def restore_failed(self, interrupted: Collection[str] = ()) -> list[str]:
        """Link back every kept set whose files a failed job removed; returns the names of
        the runs restored (each said in the terminal). interrupted: the runs whose rule was
        stopped, not failed: nothing to fix, the same command goes on (ddpflow.report.outcome
        says how far it got)."""
        restored = []
        for folder, rule in self._kept:
            names = GROUPS[rule]
            if any(Path(folder, name).exists() for name in names):
                continue  # the rerun wrote new outputs (or left them): nothing to restore
            for name in names:
                key = f"{folder}/{name}"
                _link(Path(folder, KEPT, rule, name), key)
                record = self._records.get(key)
                if record is not None:
                    self._persistence._write_record(key, record)
                self._persistence._unmark_incomplete(key)
            restored.append(Path(folder).name)
            print(
                _restored_line(restored[-1], rule, names, restored[-1] in interrupted),
                file=sys.stderr,
            )
        self.drop()
        return sorted(set(restored))

    def drop(self) -> None:
        for folder in self._folders:
            shutil.rmtree(Path(folder, KEPT), ignore_errors=True)


def _restored_line(run: str, rule: str, names: tuple[str, ...], interrupted: bool) -> str:
    files = ", ".join(names)
    if interrupted:
        return (
            f"ddpflow: run {run!r}: its {rule} rule was interrupted; the run's previous "
            f"{files} are kept as they were until it finishes (or revert the edit: then "
            "nothing is retrained)"
        )
    return (
        f"ddpflow: run {run!r}: its {rule} rule failed; the run's previous {files} are "
        "kept as they were (fix the cause and rerun, or revert the edit: then nothing is "
        "retrained)"
    )


def _link(source, target) -> None:
    """A hard link (no copy, the same modification time); a copy with its times where the
    filesystem has no hard links."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
