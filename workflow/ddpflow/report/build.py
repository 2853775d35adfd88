"""Report stage: every run's metrics -> tables, plots, report.md/.html and summary.json/.csv.

    from ddpflow.report.build import build_report
    paths = build_report(
        [{"name": "2x4", "train_metrics": "results/2x4/train.jsonl",
          "eval_metrics": "results/2x4/eval.json"}],
        "results/report",
    )

All inputs are loaded and validated, and every file is rendered in memory, before the first
write; each file is then replaced atomically and report.md/.html come last, so a bad input or
a crash never leaves a half-written report (a stale but whole one at most).
The Markdown and HTML are rendered by render.py, from the same blocks.

Each run is shown with its task's metrics (ddpflow.report.metrics): classification's accuracy,
multilabel's exact match and F1, regression's MSE, MAE and R². Runs of different tasks are
never compared: each task has its own best run, chosen by the task's selection metric in its
direction (a lower MSE wins).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import traceback
from datetime import UTC, datetime
from pathlib import Path

from ddpflow.config import VOLATILE_TRAIN_KEYS
from ddpflow.data.staged import sha256_file
from ddpflow.paths import REPORT_FILES
from ddpflow.report import insight, metrics, plots, sweep, sweep_plots
from ddpflow.report.inputs import load_eval_metrics, load_runs, load_train_metrics, unrenderable
from ddpflow.report.render import PHASES, document, to_html, to_markdown
from ddpflow.runtime import atomic_write_bytes
from ddpflow.text import counted

__all__ = ["build_report", "load_eval_metrics", "load_train_metrics"]

log = logging.getLogger(__name__)

MANY_RUNS = 12
FOCUS_RUNS = 8


def _tracker_rows(runs: list[dict], tracking_failures=()) -> list[list[str]]:
    """[run, tracker, run id, where] for each tracker run of a run's tracking.json (one that
    belongs to the run's current evaluation), then each tracker that failed (the run itself
    finished: only its logging failed)."""
    rows = []
    for run in runs:
        path = run.get("tracking")
        if not path or not Path(path).is_file():
            continue
        try:
            record = json.loads(Path(path).read_text())
            if record["identity"]["eval_sha256"] != sha256_file(run["eval_metrics"]):
                continue  # logged before the run was evaluated again: not this result
            for tracker, entry in sorted(record["trackers"].items()):
                where = entry.get("url") or entry.get("sync") or entry.get("view") or "-"
                rows.append([run["name"], tracker, str(entry.get("run_id")), where])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("run %r: unreadable %s: %s", run["name"], path, exc)
    for failure in tracking_failures:
        rows.append([failure["run"], ", ".join(failure.get("trackers", [])) or "?", "-",
                     f"failed: {failure['cause']} (log: {failure.get('log') or '-'})"])  # fmt: skip
    return rows


def _summary_row(name: str, epochs: list[dict], ev: dict) -> dict:
    """A run's row: its task's headline metrics (classification: accuracy), the final epoch's
    selection metric (final_val_accuracy, final_val_mse, ...), what trained it and how fast."""
    train, task, chosen = ev["train"], metrics.task_of(ev), metrics.selection(ev)
    own = {} if task == metrics.CLASSIFICATION else {"task": task}
    row = {
        "run": name, **own, **{key: ev.get(key) for key in metrics.headline(ev)},
        "samples_evaluated": ev["samples_evaluated"],
        "test_size": ev["test_size"], "world_size": train["world_size"], "nodes": train["nodes"],
        "hosts": train["hosts"], "train_samples_per_s": train["samples_per_s"],
        "train_wall_seconds": train["wall_seconds"], "epochs": train["epochs"],
        "attempts": train["attempts"], "eval_seconds": ev["eval_seconds"],
        "eval_world_size": ev["world_size"], "final_train_loss": epochs[-1]["train_loss"],
        f"final_{chosen.metric}": epochs[-1][chosen.metric],
        "git_commit": ev["provenance"]["git_commit"],
        # device name and precision: written since the GPU path ran (older files: cpu/cuda)
        "device": train.get("device_name", str(train.get("device", "cpu")).split(":")[0])
        + (", data streamed" if train.get("data_in_memory") is False else ""),
        "precision": train.get("precision", "fp32"),
        # what was trained (older metrics files lack some: shown as "?")
        "model": _model_name(ev["provenance"]["config"]), "parameters": train.get("parameters"),
        "global_batch": train.get("global_batch"), "lr": train.get("lr"),
        "science": _science(ev["provenance"]["config"], task),
        "split": ev.get("split", "test"),
        # the training job (one allocation per run) or a job of its own; older files: own
        "evaluated_by": ev.get("evaluated_by", "evaluate job"),
    }  # fmt: skip
    # Summed over the kept (deduplicated) epochs: the time of the final, complete history.
    for phase in (*PHASES, "epoch"):
        row[f"{phase}_seconds"] = sum(e["seconds"][phase] for e in epochs)
    return row


def _model_name(config: dict) -> str:
    model = config.get("model")
    return str(model.get("name", "?")) if isinstance(model, dict) else str(model or "?")


def _science(config: dict, task: str = "classification") -> str:
    """What a run trained, apart from the machine shape: data, model, training settings (less
    those that cannot change a result), CPU vs GPU and a task other than classification. Runs
    that agree on it form a scaling study; runs that differ in it are not compared by
    speedup."""
    train = config.get("train")
    if isinstance(train, dict):
        train = {k: v for k, v in train.items() if k not in VOLATILE_TRAIN_KEYS}
    machine = config.get("machine") if isinstance(config.get("machine"), dict) else {}
    science = {
        "data": config.get("data"),
        "model": config.get("model"),
        "train": train,
        "gpu": bool(machine.get("gpus_per_node")),
    }
    if task != metrics.CLASSIFICATION:  # its data section names it too (config.runs)
        science["task"] = task
    return json.dumps(science, sort_keys=True, default=str)


def _add_scaling(rows: list[dict]) -> tuple[int, float, list[str]] | None:
    """Speedup and efficiency within each group of runs that differ only in machine shape,
    against the group's fastest run at its smallest world size (the fastest keeps efficiency
    from being flattered by a slow reference). Returns the largest group's baseline and run
    names (the scaling plot's), or None when no group spans two world sizes."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        row["speedup"] = row["efficiency"] = row["scaling_group"] = None
        groups.setdefault(row["science"], []).append(row)
    studies = [g for g in groups.values() if len({row["world_size"] for row in g}) >= 2]
    if any(r["train_samples_per_s"] <= 0 or r["world_size"] <= 0 for g in studies for r in g):
        log.warning("report: a run has no positive throughput or world size; no scaling")
        return None
    plotted = None
    for number, group in enumerate(studies, start=1):
        base_ranks = min(row["world_size"] for row in group)
        base_rate = max(r["train_samples_per_s"] for r in group if r["world_size"] == base_ranks)
        for row in group:
            row["speedup"] = row["train_samples_per_s"] / base_rate
            row["efficiency"] = row["speedup"] / (row["world_size"] / base_ranks)
            row["scaling_group"] = number
        if plotted is None or len(group) > len(plotted[2]):
            plotted = (base_ranks, base_rate, [row["run"] for row in group])
    return plotted


def _with_task(rows: list[dict]) -> list[dict]:
    """Where any run is not classification, every row names its task (after its name)."""
    if all("task" not in row for row in rows):
        return rows
    return [{"run": r["run"], "task": r.get("task", metrics.CLASSIFICATION), **r} for r in rows]


def _summary_csv(rows: list[dict]) -> str:
    if not rows:
        return "run\n"
    buffer = io.StringIO()
    columns = list(dict.fromkeys(key for row in rows for key in row))  # tasks differ in keys
    writer = csv.DictWriter(buffer, fieldnames=columns, restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows({**row, "hosts": " ".join(map(str, row["hosts"]))} for row in rows)
    return buffer.getvalue()


def _summary(loaded, rows, baseline, generated: str, unfinished) -> dict:
    # the best run of the first listed run's task (each task's: best_by_task)
    task = rows[0].get("task") if rows else None
    best = next((row["run"] for row in rows if row["best"] and row.get("task") == task), None)
    classified = [(n, ev) for n, _, ev in loaded if metrics.task_of(ev) == metrics.CLASSIFICATION]
    return {
        "generated": generated, "best_run": best, "runs": rows,
        # without the sweep point an entry may carry: summary.json's sweep has the ranking
        "unfinished": [{k: v for k, v in u.items() if k != "sweep"} for u in unfinished],
        "scaling_baseline": {"world_size": baseline[0], "samples_per_s": baseline[1],
                             "runs": baseline[2]} if baseline else None,
        "per_class_accuracy": {
            name: dict(zip(map(str, ev["class_names"]), ev["per_class_accuracy"], strict=True))
            for name, ev in classified
        },
        **_task_summary(loaded, rows),
        "provenance": {name: ev["provenance"] for name, _, ev in loaded},
    }  # fmt: skip


def _task_summary(loaded, rows: list[dict]) -> dict:
    """summary.json's keys of tasks other than classification (none without such a run): the
    best run of each task, each multilabel run's per-label F1 and counts, each regression
    run's per-target errors."""
    if all("task" not in row for row in rows):
        return {}
    out = {"best_by_task": {}, "selected_by": {}}
    for row in rows:
        if row["best"]:
            out["best_by_task"][row["task"]] = row["run"]
    for name, _, ev in loaded:
        chosen = metrics.selection(ev)
        out["selected_by"].setdefault(metrics.task_of(ev), chosen.record())
        names = list(map(str, ev["class_names"]))
        if metrics.task_of(ev) == "multilabel":
            out.setdefault("per_label", {})[name] = {
                label: {
                    "f1": ev["per_label_f1"][i],
                    "true_positives": ev["true_positives"][i],
                    "false_positives": ev["false_positives"][i],
                    "false_negatives": ev["false_negatives"][i],
                    "support": ev["true_positives"][i] + ev["false_negatives"][i],
                }
                for i, label in enumerate(names)
            }
        elif metrics.task_of(ev) == "regression":
            errors = ev["per_target"]
            out.setdefault("per_target", {})[name] = {
                target: {key: errors[key][i] for key in ("mse", "mae", "r2")}
                for i, target in enumerate(names)
            }
    return out


def _summary_extras(view, bad_nodes, found, trackers) -> dict:
    """summary.json's sweep (where there is one), bad nodes, insight and tracker runs."""
    extras = {"sweep": sweep.summary(view)} if view else {}
    return {
        **extras, "bad_nodes": list(bad_nodes), "insight": found,
        "trackers": [dict(zip(("run", "tracker", "run_id", "where"), row, strict=True))
                     for row in trackers],
    }  # fmt: skip


def _write_all(out_dir: Path, figures: dict, texts: dict) -> dict[str, Path]:
    plots_dir = out_dir / REPORT_FILES["plots"]
    plots_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for key, (_, png) in figures.items():
        if png is None:  # not drawn (plots.render_figures): an earlier report's would mislead
            (plots_dir / f"{key}.png").unlink(missing_ok=True)
            continue
        paths[f"plot_{key}"] = plots_dir / f"{key}.png"
        atomic_write_bytes(paths[f"plot_{key}"], png)
    # plots and a ranking left by an earlier set of runs would mislead
    stale = [plots_dir / "scaling.png", *plots_dir.glob("sweep_*.png"), out_dir / sweep.CSV_NAME]
    # a task's per-epoch and predicted-vs-true plots (runs of another task now)
    stale += [*plots_dir.glob("val_*.png"), *plots_dir.glob("predicted_vs_true_*.png")]
    for path in stale:
        if path.stem not in figures and not (path.name == sweep.CSV_NAME and "sweep_csv" in texts):
            path.unlink(missing_ok=True)
    for key, (filename, text) in texts.items():  # the reports last: they reference the rest
        paths[key] = out_dir / filename
        atomic_write_bytes(paths[key], (text.rstrip("\n") + "\n").encode("utf-8"))
    return paths


def _texts(summary: dict, rows: list[dict], blocks: list, view) -> dict[str, tuple[str, str]]:
    """{key: (file name, text)} of the report's text files (sweep.csv with a sweep view)."""
    title = "ddpflow report"
    extra = {"sweep_csv": (sweep.CSV_NAME, sweep.csv_text(view))} if view else {}
    return {
        **extra,
        "summary_json": (
            REPORT_FILES["summary"],
            json.dumps(summary, indent=2, default=str) + "\n",
        ),
        "summary_csv": (REPORT_FILES["summary_csv"], _summary_csv(rows)),
        "markdown": (REPORT_FILES["markdown"], to_markdown(title, blocks)),
        "html": (REPORT_FILES["html"], to_html(title, blocks)),
    }


def _by_task(rows: list[dict]) -> dict[str, list[dict]]:
    """The rows of each task, the tasks in the order of their first run."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row.get("task", metrics.CLASSIFICATION), []).append(row)
    return groups


def _best(rows: list[dict], view: dict | None, selections: dict) -> list[dict]:
    """The best run of each task, by the task's selection metric in its direction: with a
    sweep, its final validation figure (selecting on the test set would flatter the
    winner's test figure), a tie to the sweep's own pick; otherwise, as before sweeps, the
    evaluation's figure of the same metric (accuracy, mse). Then the faster run; then the
    first listed. Runs of different tasks are never compared."""
    pick = (sweep.selected(view) or {}).get("run") if view else None
    best = []
    for group in _by_task(rows).values():
        chosen = selections[group[0]["run"]]
        key = f"final_{chosen.metric}" if view else metrics.eval_key(chosen)
        if not all(key in row for row in group):  # a task that does not head with it
            key = f"final_{chosen.metric}"
        best.append(min(group, key=_ranking(chosen, key, pick)))
    return best


def _ranking(chosen, key: str, pick: str | None = None):
    """A sort key of rows (best first): the key's value in the selection's direction, then
    the sweep's pick, then the faster run."""
    return lambda r: (metrics.score(chosen, r[key]), r["run"] != pick, -r["train_samples_per_s"])


def _mark_best(rows: list[dict], view: dict | None, selections: dict) -> list[dict]:
    best = _best(rows, view, selections)
    for row in rows:
        row["best"] = any(row is b for b in best)
    return best


def _focus(rows: list[dict], selections: dict) -> list[str] | None:
    """With more than MANY_RUNS runs, the FOCUS_RUNS best by validation accuracy (another
    task: its selection metric; several tasks: the best of each task first), best first:
    the runs named in the per-epoch plots and given a confusion matrix and per-class column
    (100 legend entries, matrices and columns made the report unreadable). None: every run."""
    if len(rows) <= MANY_RUNS:
        return None
    place = {}
    for group in _by_task(rows).values():
        chosen = selections[group[0]["run"]]
        final = f"final_{chosen.metric}"
        ranked = sorted(group, key=lambda r, c=chosen, f=final: _focus_key(c, r, f))
        place.update({row["run"]: number for number, row in enumerate(ranked)})
    ranked = sorted(rows, key=lambda r: (place[r["run"]], not r["best"], r["run"]))
    return [row["run"] for row in ranked[:FOCUS_RUNS]]


def _focus_key(chosen, row: dict, final: str) -> tuple:
    return (metrics.score(chosen, row[final]), not row["best"], row["run"])


def _renderable(runs: list[dict], loaded, unreadable) -> tuple[list, list[dict]]:
    """The loaded runs the report can render, and unreadable with an unfinished entry for
    each it cannot (a key an optional table reads left out, a text where a number belongs):
    each run is first rendered alone, in memory, so that a run's odd records cost its rows,
    never the report."""
    files = {str(run["name"]): run for run in runs}
    kept, failed = [], []
    for item in loaded:
        run = files[item[0]]
        try:
            _render_alone(run, item)
        except Exception as exc:  # noqa: BLE001 - whatever the records hold, a report is written
            where = traceback.extract_tb(exc.__traceback__)[-1].name
            cause = f"run {item[0]!r} ({Path(run['eval_metrics']).parent}): "
            cause += f"{type(exc).__name__}: {exc} (in {where})"
            log.warning("report: %s", cause)
            failed.append(unrenderable(item[0], cause, run.get("sweep")))
        else:
            kept.append(item)
    return kept, [*unreadable, *failed]


def _render_alone(run: dict, item: tuple) -> None:
    """Every table and text of the report for one run alone: raises what its records raise."""
    name, epochs, ev = item
    row = _summary_row(name, epochs, ev)
    _summary_csv([row])
    _add_scaling([row])
    row["best"] = True
    view = sweep.collect([run], [item])
    inside = insight.blocks({name: insight.entry(run, epochs, ev)})
    shown = sweep.blocks(view, {}) if view else ()
    blocks = document([item], [row], {}, "", inside=inside, sweep=shown)
    to_markdown("", blocks), to_html("", blocks), sweep.csv_text(view) if view else None


def build_report(
    runs: list[dict],
    out_dir,
    unfinished: list[dict] = (),
    bad_nodes: list[dict] = (),
    tracking_failures: list[dict] = (),
) -> dict[str, Path]:
    """Write report.md/.html, summary.json/.csv and plots/*.png for runs into out_dir.

    runs: [{"name", "train_metrics", "eval_metrics"}, ...], each with an optional "sweep" (the
    run's sweep block, ddpflow.report.sweep: the report then ranks the sweep's runs by
    validation accuracy (another task: its selection metric), selects on it, and writes
    sweep.csv); unfinished: runs that did not finish, [{"run", "stage", "cause", "detail",
    "log"}, ...] (ddpflow.report.outcome), named in a section of their own; bad_nodes: the
    bad-node ledger's entries (ddpflow.cluster.nodes), a section of their own where there are
    any. A run's optional "tracking" (its
    tracking.json) and tracking_failures ([{"run", "trackers", "cause", "log"}]) make the
    section of experiment trackers. Returns {key: path}, with keys markdown,
    html, summary_json, summary_csv, sweep_csv (with a sweep) and plot_<stem> for every
    plots/<stem>.png. A run whose files are missing, unreadable or incomplete, or whose
    records cannot be rendered, is listed among the unfinished runs with the reason (naming
    the run and its file or folder); a plot that cannot be drawn says why in its place.
    ValueError only for a call without runs or with a run listed twice.
    """
    loaded, unreadable = _renderable(runs, *load_runs(runs, unfinished))
    shown = {name for name, _, _ in loaded}
    runs, unfinished = [r for r in runs if str(r["name"]) in shown], [*unfinished, *unreadable]
    rows = _with_task([_summary_row(name, epochs, ev) for name, epochs, ev in loaded])
    baseline = _add_scaling(rows)
    view = sweep.collect(runs, loaded, unfinished)
    selections = {name: metrics.selection(ev) for name, _, ev in loaded}
    best = _mark_best(rows, view, selections)
    focus = _focus(rows, selections)
    figures = plots.render_figures(loaded, rows, baseline, focus) if rows else {}
    swept = sweep_plots.render(view) if view else {}
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    found = insight.collect(runs, loaded)
    trackers = _tracker_rows(runs, tracking_failures)
    blocks = document(loaded, rows, figures, generated, unfinished, insight.blocks(found),
                      bad_nodes, trackers, sweep.blocks(view, swept) if view else (),
                      focus)  # fmt: skip
    summary = _summary(loaded, rows, baseline, generated, unfinished)
    summary.update(_summary_extras(view, bad_nodes, found, trackers))
    paths = _write_all(Path(out_dir), {**figures, **swept}, _texts(summary, rows, blocks, view))
    log.info(
        "report: %s%s, best %s -> %s",
        counted(len(rows), "run"),
        f", {len(unfinished)} unfinished" if unfinished else "",
        ", ".join(row["run"] for row in best) or None,
        out_dir,
    )
    return paths
