"""The report's summary: each run's row (what trained it, how well, how fast), from which the
report's tables are drawn, and the content of summary.json and summary.csv. Pure: the report
stage (build.py) writes them.

    rows = with_task([summary_row(name, epochs, ev) for name, epochs, ev in loaded])
    text = summary_csv(rows)
"""

from __future__ import annotations

import csv
import io
import json

from ddpflow.config import VOLATILE_TRAIN_KEYS
from ddpflow.report import metrics, sweep
from ddpflow.report.efficiency import efficiency_fields
from ddpflow.runtime import PHASES
from ddpflow.task import DEFAULT_TASK, Task, get_task, record_task

__all__ = ["summary_csv", "summary_extras", "summary_json", "summary_row", "with_task"]


def summary_row(name: str, epochs: list[dict], ev: dict) -> dict:
    """A run's row: its task's headline metrics (classification: accuracy), the final epoch's
    selection metric (final_val_accuracy, final_val_mse, ...), what trained it and how fast."""
    train, task, chosen = ev["train"], record_task(ev), metrics.selection(ev)
    own = {"task": task.name} if task.named_in_records else {}
    row = {
        "run": name, **own, **{key: ev.get(key) for key in metrics.headline(ev)},
        "samples_evaluated": ev["samples_evaluated"],
        "test_size": ev["test_size"], "world_size": train["world_size"], "nodes": train["nodes"],
        "hosts": train["hosts"], "train_samples_per_s": train["samples_per_s"],
        "train_wall_seconds": train["wall_seconds"], "epochs": train["epochs"],
        "attempts": train["attempts"], "eval_seconds": ev["eval_seconds"],
        "eval_world_size": ev["world_size"], "final_train_loss": epochs[-1]["train_loss"],
        f"final_{chosen.metric}": epochs[-1][chosen.metric],
        # what breaks a tie on it (report.compare)
        "final_val_loss": epochs[-1].get("val_loss"),
        "git_commit": ev["provenance"]["git_commit"],
        # device name and precision: written since the GPU path ran (older files: cpu/cuda)
        "device": train.get("device_name", str(train.get("device", "cpu")).split(":")[0])
        + _data_read(train, task),
        "precision": train.get("precision", "fp32"),
        # what was trained (older metrics files lack some: shown as "?")
        "model": _model_name(ev["provenance"]["config"]), "parameters": train.get("parameters"),
        "global_batch": train.get("global_batch"), "lr": train.get("lr"),
        "science": _science(ev["provenance"]["config"], task),
        "split": ev.get("split", "test"),
        # the training job (one allocation per run) or a job of its own; older files: own
        "evaluated_by": ev.get("evaluated_by", "evaluate job"),
    }  # fmt: skip
    row.update(task.summary_fields(ev))  # a language model's tokens/s
    row.update(efficiency_fields(train))  # model TFLOP/s, MFU, memory estimate and peak
    # Summed over the kept (deduplicated) epochs: the time of the final, complete history.
    for phase in (*PHASES, "epoch"):
        row[f"{phase}_seconds"] = sum(e["seconds"][phase] for e in epochs)
    return row


def _data_read(train: dict, task: Task) -> str:
    """How the ranks read the data, where it is not the usual in-memory copy: as the task
    says (a language model's token files are always memory-mapped), else as recorded."""
    fixed = task.data_read(train)
    if fixed is not None:
        return fixed
    return ", data streamed" if train.get("data_in_memory") is False else ""


def _model_name(config: dict) -> str:
    model = config.get("model")
    return str(model.get("name", "?")) if isinstance(model, dict) else str(model or "?")


def _science(config: dict, task: Task | None = None) -> str:
    """What a run trained, apart from the machine shape: data, model, training settings (less
    those that cannot change a result), CPU vs GPU and a task other than classification. Runs
    that agree on it form a scaling study; runs that differ in it are not compared by
    speedup."""
    train = config.get("train")
    if isinstance(train, dict):
        train = {k: v for k, v in train.items() if k not in VOLATILE_TRAIN_KEYS}
    section = config.get("machine")
    machine = section if isinstance(section, dict) else {}
    science = {
        "data": config.get("data"),
        "model": config.get("model"),
        "train": train,
        "gpu": bool(machine.get("gpus_per_node")),
    }
    if task is not None and task.named_in_records:  # its data section names it too
        science["task"] = task.name
    return json.dumps(science, sort_keys=True, default=str)


def with_task(rows: list[dict]) -> list[dict]:
    """Where any run is not classification, every row names its task (after its name)."""
    if all("task" not in row for row in rows):
        return rows
    return [{"run": r["run"], "task": r.get("task", DEFAULT_TASK), **r} for r in rows]


def summary_csv(rows: list[dict]) -> str:
    if not rows:
        return "run\n"
    buffer = io.StringIO()
    columns = list(dict.fromkeys(key for row in rows for key in row))  # tasks differ in keys
    writer = csv.DictWriter(buffer, fieldnames=columns, restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows({**row, "hosts": " ".join(map(str, row["hosts"]))} for row in rows)
    return buffer.getvalue()


def summary_json(loaded, rows, baseline, generated: str, unfinished) -> dict:
    """summary.json's content, but for summary_extras' keys and groups: the runs' rows, the
    best run, the unfinished runs, the scaling baseline, per-class figures and each run's
    provenance."""
    # the run selected in the first listed run's comparability group (ddpflow.report.compare;
    # every group's: summary.json's groups); null where that run was compared with none
    group = rows[0].get("group") if rows else None
    best = next((row["run"] for row in rows if row["best"] and row.get("group") == group), None)
    return {
        "generated": generated, "best_run": best, "runs": rows,
        # without the sweep point an entry may carry: summary.json's sweep has the ranking
        "unfinished": [{k: v for k, v in u.items() if k != "sweep"} for u in unfinished],
        "scaling_baseline": {"world_size": baseline[0], "samples_per_s": baseline[1],
                             "runs": baseline[2]} if baseline else None,
        **_per_run(loaded, named=False),
        **_task_summary(loaded, rows),
        "provenance": {name: ev["provenance"] for name, _, ev in loaded},
    }  # fmt: skip


def _per_run(loaded, named: bool) -> dict:
    """summary.json's per-run keys (Task.summary_record) of the tasks whose records name
    them (named) or not (classification): {key: {run: its value}}; those of the default task
    are there even without a run of it (as they were before tasks existed)."""
    out: dict[str, dict] = {} if named else {k: {} for k in get_task().summary_keys}
    for name, _, ev in loaded:
        task = record_task(ev)
        if task.named_in_records == named:
            for key, value in task.summary_record(ev).items():
                out.setdefault(key, {})[name] = value
    return out


def _task_summary(loaded, rows: list[dict]) -> dict:
    """summary.json's keys of tasks other than classification (none without such a run): the
    best run of each task (its first comparability group's; none for a run compared with
    none), the task's own per-run keys (Task.summary_record: each multilabel run's per-label
    F1 and counts, each regression run's per-target errors)."""
    if all("task" not in row for row in rows):
        return {}
    out: dict[str, dict] = {"best_by_task": {}, "selected_by": {}}
    for row in rows:
        if row["best"]:
            out["best_by_task"].setdefault(row["task"], row["run"])
    for _, _, ev in loaded:
        out["selected_by"].setdefault(record_task(ev).name, metrics.selection(ev).record())
    return {**out, **_per_run(loaded, named=True)}


def summary_extras(view, bad_nodes, found, trackers) -> dict:
    """summary.json's sweep (where there is one), bad nodes, insight and tracker runs."""
    extras = {"sweep": sweep.summary(view)} if view else {}
    return {
        **extras, "bad_nodes": list(bad_nodes), "insight": found,
        "trackers": [dict(zip(("run", "tracker", "run_id", "where"), row, strict=True))
                     for row in trackers],
    }  # fmt: skip
