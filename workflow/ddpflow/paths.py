"""Where a run's files live: the one place that names them.

The rules (workflow/rules/*.smk) declare these paths as outputs, the ranks write them
(ddpflow.training.entry), the report reads them; all take the names from here. Importing this module
imports no torch: the Snakefile reads it at parse time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

# a run's declared outputs, in results/runs/<run>/
RUN_FILES = {
    "model": "model.pt",
    "train_metrics": "train_metrics.jsonl",
    "train_summary": "train_summary.json",
    "eval_metrics": "eval_metrics.json",
}
# `snakemake predict`'s outputs in results/runs/<run>/ (ddpflow.predict): one row per input,
# in input order, and what was predicted from what (the input's listing, skipped files)
PREDICT_FILES = {
    "predictions": "predictions.csv",
    "predictions_summary": "predictions.json",
}
PREDICT_WORK = "predict"  # results/work/<run>/predict/: the request and the ranks' parts
# `snakemake generate`'s output in results/runs/<run>/ (ddpflow.generate): one JSON line per
# prompt, in the prompts' order
GENERATE_FILES = {"generations": "generations.jsonl"}
GENERATE_WORK = "generate"  # results/work/<run>/generate/: the request and the ranks' parts
# the exports of model.pt by export.formats, in results/runs/<run>/ (ddpflow.export)
EXPORT_FILES = {
    "safetensors": "model.safetensors",
    "torch_export": "model.pt2",
    "onnx": "model.onnx",
}
# a run's record of the trackers it was logged to (the track rule's output, only where
# `tracking:` enables one): tracker run ids and URLs (ddpflow.tracking); its copy in the
# work folder tells a rerun what was logged already
TRACKING_FILE = "tracking.json"
# the report's declared outputs, in results/report/
REPORT_FILES = {
    "markdown": "report.md",
    "html": "report.html",
    "summary": "summary.json",
    "summary_csv": "summary.csv",
    "plots": "plots",
}
# results/work/<run>/ is never a declared output: Snakemake's clean-up of a failed job cannot
# delete what lives there (checkpoints, live metrics, rendezvous, job records)
CHECKPOINTS = "checkpoints"
SET_ASIDE_PREFIX = "checkpoints.old-"
FINGERPRINT = "fingerprint.json"  # the config the checkpoints belong to
FINISHED = "finished.json"  # written once a training's outputs are published
EVAL_FROM_TRAIN = "eval_from_train.json"  # the training job's evaluation, until published
TRACKING_FAILED = "tracking_failed.json"  # why the run's last track rule failed
LIVE_TRACKING = "tracking_live.json"  # the MLflow run the train rule streams epochs to
FAILED = "failed.json"  # why the run's last train/evaluate rule failed (ddpflow.report.outcome)
LIVE_METRICS = "metrics.jsonl"  # rank 0's epoch lines while it trains (progress, resume)
# the step an attempt has reached, noted by rank 0 after every step (a write into the page
# cache, a few microseconds, which outlives a killed process): a resume says the steps it
# redoes, and a job's supervisor sees its first step after a restart
REACHED = f"{CHECKPOINTS}/reached"
# the supervisor's events of the run's Slurm training jobs (ddpflow.cluster.supervise)
RESTART_EVENTS = "restarts.jsonl"
# results/work/ itself: nodes that failed under the workflow's Slurm jobs (ddpflow.cluster.nodes);
# a run name cannot collide with it in practice, and clean_work only looks at folders
BAD_NODES = "bad_nodes.json"


def run_dir(results_dir: str | Path, run_name: str) -> Path:
    return Path(results_dir) / "runs" / run_name


def work_dir(results_dir: str | Path, run_name: str) -> Path:
    return Path(results_dir) / "work" / run_name


def bad_nodes_file(results_dir: str | Path) -> Path:
    return Path(results_dir) / "work" / BAD_NODES


def staged_dir(results_dir: str | Path, dataset_id: str) -> Path:
    return Path(results_dir) / "staged" / dataset_id


def report_dir(results_dir: str | Path) -> Path:
    return Path(results_dir) / "report"


@dataclass(frozen=True)
class RunPaths:
    """Absolute paths one run reads and writes (what a rank needs, wherever it runs)."""

    staged: str
    model: str
    train_metrics: str
    train_summary: str
    eval_metrics: str
    work: str

    @classmethod
    def for_run(cls, results_dir: str | Path, run: dict) -> RunPaths:
        root = Path(results_dir).resolve()
        out = run_dir(root, run["name"])
        return cls(
            staged=str(staged_dir(root, run["dataset_id"])),
            work=str(work_dir(root, run["name"])),
            **{key: str(out / name) for key, name in RUN_FILES.items()},
        )

    @classmethod
    def for_rule(cls, results_dir: str | Path, run: dict, files) -> RunPaths:
        """The paths of a rule's job: every field the rule declares as a named input or
        output (snakemake.input / snakemake.output, named like the fields) is taken from
        there, absolute; the rest (the work folder) from for_run."""
        declared = {
            field: str(Path(files[field]).resolve())
            for field in cls.__dataclass_fields__
            if field in files
        }
        return replace(cls.for_run(results_dir, run), **declared)
