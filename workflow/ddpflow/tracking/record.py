"""What a tracker receives for one run, collected from the run's published files.

    record = collect(run, paths, out_dir)   # paths: ddpflow.paths.RunPaths
    record.params, record.metrics, record.tags, record.artifacts, record.identity

Params are the run's resolved config (as eval_metrics.json records it), flattened to dotted
keys (ddpflow.config.fingerprint.flatten); a run made by a sweep carries its swept keys
like any other key. Metrics are one point per epoch (step = epoch) per figure: training and
validation loss, the task's validation figures (classification's val_accuracy; multilabel's
val_f1_micro, val_f1_macro, val_exact_match; regression's val_mse, val_mae, val_r2: every
val_* key of the epoch record), learning rate, samples/s, the seconds of each phase and each
rank's own figures (rank<r>.<figure>); the final test figures (the task's headline metrics,
test_accuracy or test_mse, test_mae, test_r2, and the loss) have step 0. Artifacts: the
run's files, its plots (the selection metric per epoch; classification's confusion matrix,
regression's predicted against true values) and, for classification, confusion_matrix.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ddpflow.config.fingerprint import flatten
from ddpflow.paths import EXPORT_FILES
from ddpflow.runtime import sha256_file
from ddpflow.task import record_task, selection_of

# per-epoch figures of train_metrics.jsonl logged as they are (and every other val_* key: a
# task's validation figures)
EPOCH_FIGURES = (
    "train_loss",
    "val_loss",
    "val_accuracy",
    "lr",
    "samples_per_s",
    "model_tflops",  # achieved model TFLOP/s and, on a GPU of known peak, MFU (monitoring.flops)
    "mfu",
)


@dataclass
class RunRecord:
    name: str
    identity: dict
    params: dict[str, str]
    metrics: list[tuple[str, float, int]]  # (key, value, step)
    final: dict[str, float]
    tags: dict[str, str]
    artifacts: list[Path] = field(default_factory=list)
    config: dict = field(default_factory=dict)


def identity(paths) -> dict:
    """What one logging of the run stands for: its trained model and its evaluation. The
    same identity is never logged twice; another one (retrained, re-evaluated) is a new
    tracker run."""
    return {
        "model_sha256": sha256_file(paths.model),
        "eval_sha256": sha256_file(paths.eval_metrics),
    }


def param_value(value) -> str:
    """A param as trackers store it: text (lists and null as JSON, as in config.yaml)."""
    return value if isinstance(value, str) else json.dumps(value)


def params(config: dict) -> dict[str, str]:
    """The run's config as flat params, less `tracking:` itself (where it is logged is no
    property of the run, and the provenance's copy is that of the evaluation's time)."""
    shown = {key: value for key, value in config.items() if key != "tracking"}
    return {key: param_value(value) for key, value in flatten(shown).items()}


def epoch_metrics(lines: list[dict]) -> list[tuple[str, float, int]]:
    """One point per epoch per figure (an epoch trained twice, by a resumed attempt: the
    last line counts)."""
    by_epoch = {line["epoch"]: line for line in lines}
    out = []
    for epoch, line in sorted(by_epoch.items()):
        figures = {key: line.get(key) for key in EPOCH_FIGURES}
        figures.update({k: v for k, v in line.items() if k.startswith("val_")})
        figures.update({f"seconds.{k}": v for k, v in (line.get("seconds") or {}).items()})
        for rank in line.get("ranks") or []:
            figures.update(
                {f"rank{rank['rank']}.{k}": v for k, v in rank.items() if k not in ("rank", "host")}
            )
        out += [
            (key, float(value), epoch)
            for key, value in figures.items()
            if isinstance(value, int | float) and not isinstance(value, bool)
        ]
    return out


def _plots(name: str, lines: list[dict], evaluation: dict, out_dir: Path) -> list[Path]:
    """The run's own plots (the report's, for this run alone): the losses, the task's
    selection metric per epoch (val_accuracy.png, val_mse.png, ...), the learning rate, and
    the task's evaluation figures (Task.evaluation_plots: classification's confusion matrix,
    regression's predicted against true values)."""
    from ddpflow.report import plots  # matplotlib: only when a tracker is fed

    out_dir.mkdir(parents=True, exist_ok=True)
    chosen = selection_of(evaluation)
    figures = {
        "loss": plots.plot_per_epoch(
            {name: [(e["epoch"], e["train_loss"]) for e in lines]},
            "train loss",
            "Training loss",
            log_if_wide=True,
        ),
        chosen.metric: plots.plot_per_epoch(
            {name: [(e["epoch"], e.get(chosen.metric)) for e in lines]},
            chosen.label,
            chosen.label[:1].upper() + chosen.label[1:],
            log_if_wide=not chosen.higher_is_better,
        ),
        "lr": plots.plot_per_epoch(
            {name: [(e["epoch"], e["lr"]) for e in lines]}, "learning rate", "Learning rate"
        ),
    }
    for spec in record_task(evaluation).evaluation_plots(name, evaluation):
        figures[spec.kind] = plots.DRAWERS[spec.kind](*spec.args)
    written = []
    for key, png in figures.items():
        (out_dir / f"{key}.png").write_bytes(png)
        written.append(out_dir / f"{key}.png")
    return written


def _tags(run: dict, config: dict, evaluation: dict, summary: dict) -> dict[str, str]:
    """What a tracker filters runs by: commit, dataset, machine shape, strategy, precision
    (and a task other than classification)."""
    hosts = sorted(set(summary.get("hosts") or evaluation["provenance"].get("hostnames") or []))
    task = record_task(evaluation)
    return {
        **({"task": task.name} if task.named_in_records else {}),
        "ddpflow.run": run["name"],
        "git_commit": str(evaluation["provenance"].get("git_commit")),
        "dataset_id": str(config.get("dataset_id", run["dataset_id"])),
        "world_size": str(summary.get("world_size", config.get("world_size"))),
        "hosts": ",".join(hosts),
        "strategy": str(config["train"]["strategy"]),
        "precision": str(summary.get("precision", config["train"]["precision"])),
    }


def final_metrics(evaluation: dict) -> dict[str, float]:
    """The evaluation's figures as step-0 metrics named by the split, as its task says
    (Task.tracker_metrics: the headline metrics, test_accuracy, test_mse, ...; one that is
    undefined, an r2 of a constant target, is left out), then the loss."""
    split = evaluation.get("split", "test")
    final = record_task(evaluation).tracker_metrics(evaluation)
    if isinstance(evaluation.get("loss"), int | float):
        final[f"{split}_loss"] = float(evaluation["loss"])
    return final


def collect(run: dict, paths, out_dir: str | Path) -> RunRecord:
    """The run's record, its plots and (classification) its confusion matrix written into
    out_dir (artifacts)."""
    out_dir = Path(out_dir)
    lines = [
        json.loads(line)
        for line in Path(paths.train_metrics).read_text().splitlines()
        if line.strip()
    ]
    evaluation = json.loads(Path(paths.eval_metrics).read_text())
    summary = json.loads(Path(paths.train_summary).read_text())
    config = evaluation["provenance"]["config"]
    final = final_metrics(evaluation)
    tags = _tags(run, config, evaluation, summary)
    out_dir.mkdir(parents=True, exist_ok=True)
    matrix = []
    for file, content in record_task(evaluation).tracker_files(evaluation).items():
        matrix.append(out_dir / file)  # classification's confusion_matrix.json
        matrix[-1].write_text(json.dumps(content) + "\n")
    artifacts = [
        Path(paths.eval_metrics),
        Path(paths.train_metrics),
        Path(paths.train_summary),
        *matrix,
        *_model_export(paths, out_dir),
        *_plots(run["name"], lines, evaluation, out_dir / "plots"),
    ]
    return RunRecord(
        name=run["name"],
        identity=identity(paths),
        params=params(config),
        metrics=epoch_metrics(lines),
        final=final,
        tags=tags,
        artifacts=artifacts,
        config=config,
    )


def _model_export(paths, out_dir: Path) -> list[Path]:
    """model.safetensors (export.formats) and its metadata as model_metadata.json: the model
    a tracker keeps, never a pickle (which runs code when loaded)."""
    export = Path(paths.model).with_name(EXPORT_FILES["safetensors"])
    if not export.is_file():
        return []
    from safetensors import safe_open

    with safe_open(str(export), "np") as f:
        meta = f.metadata() or {}
    written = out_dir / "model_metadata.json"
    written.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return [export, written]
