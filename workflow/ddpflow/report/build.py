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
The Markdown and HTML are rendered by render.py, from the same blocks; each run's row and
summary.json/.csv's content come from summary.py.

Each run is shown with its task's metrics (ddpflow.report.metrics): classification's accuracy,
multilabel's exact match and F1, regression's MSE, MAE and R². Runs are ranked only inside a
comparability group (ddpflow.report.compare: same task, selection metric, data and, for a
language model, vocabulary), on the group's validation metric in its direction (a lower MSE
wins); the headline says which runs are not compared and why.
"""

from __future__ import annotations

import json
import logging
import os
import traceback
from collections.abc import Sequence
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

from ddpflow.paths import EXPORT_FILES, REPORT_FILES, RUN_FILES
from ddpflow.report import compare, insight, metrics, plots, sweep, sweep_plots
from ddpflow.report.inputs import load_eval_metrics, load_runs, load_train_metrics, unrenderable
from ddpflow.report.render import document, to_html, to_markdown
from ddpflow.report.summary import (
    summary_csv,
    summary_extras,
    summary_json,
    summary_row,
    with_task,
)
from ddpflow.report.tables import Link
from ddpflow.runtime import atomic_write_bytes, sha256_file
from ddpflow.task import record_task
from ddpflow.words import counted

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
    # plots and a ranking left by an earlier set of runs would mislead: every plot this
    # report did not draw (a run gone, another task, a failed workflow's partial report)
    stale = [*plots_dir.glob("*.png"), out_dir / sweep.CSV_NAME]
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
        "summary_csv": (REPORT_FILES["summary_csv"], summary_csv(rows)),
        "markdown": (REPORT_FILES["markdown"], to_markdown(title, blocks)),
        "html": (REPORT_FILES["html"], to_html(title, blocks)),
    }


def _mark_best(rows: list[dict], loaded, view: dict | None) -> list[compare.Group]:
    """Each run's comparability group and the run selected in each (ddpflow.report.compare):
    by the final validation figure, a tie to the sweep's own pick. The test figure is
    reported, never used to select; a run alone in its group is not ranked."""
    pick = (sweep.selected(view) or {}).get("run") if view else None
    return compare.groups(rows, {name: ev for name, _, ev in loaded}, pick)


def _focus(rows: list[dict], selections: dict) -> list[str] | None:
    """With more than MANY_RUNS runs, the FOCUS_RUNS best by validation accuracy (another
    task: its selection metric; several comparability groups: the best of each group
    first), best first: the runs named in the per-epoch plots and given a confusion matrix
    and per-class column (100 legend entries, matrices and columns made the report
    unreadable). None: every run."""
    if len(rows) <= MANY_RUNS:
        return None
    by_group: dict[int, list[dict]] = {}
    for row in rows:
        by_group.setdefault(row["group"], []).append(row)
    place = {}
    for group in by_group.values():
        chosen = selections[group[0]["run"]]
        final = f"final_{chosen.metric}"
        ranked = sorted(group, key=partial(_focus_key, chosen, final))
        place.update({row["run"]: number for number, row in enumerate(ranked)})
    ranked = sorted(rows, key=lambda r: (place[r["run"]], not r["best"], r["run"]))
    return [row["run"] for row in ranked[:FOCUS_RUNS]]


def _focus_key(chosen, final: str, row: dict) -> tuple:
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
    row = summary_row(name, epochs, ev)
    summary_csv([row])
    _add_scaling([row])
    row["best"], row["group"] = True, 1
    view = sweep.collect([run], [item])
    inside = insight.blocks({name: insight.entry(run, epochs, ev)})
    shown = sweep.blocks(view, {}) if view else ()
    blocks = document([item], [row], {}, "", inside=inside, sweep=shown)
    to_markdown("", blocks), to_html("", blocks), sweep.csv_text(view) if view else None


def build_report(
    runs: list[dict],
    out_dir,
    unfinished: Sequence[dict] = (),
    bad_nodes: Sequence[dict] = (),
    tracking_failures: Sequence[dict] = (),
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
    loaded, runs, unfinished = _shown(runs, unfinished)
    rows = with_task([summary_row(name, epochs, ev) for name, epochs, ev in loaded])
    baseline = _add_scaling(rows)
    view = sweep.collect(runs, loaded, unfinished)
    selections = {name: metrics.selection(ev) for name, _, ev in loaded}
    ranked = _mark_best(rows, loaded, view)
    focus = _focus(rows, selections)
    figures = plots.render_figures(loaded, rows, baseline, focus) if rows else {}
    swept = sweep_plots.render(view) if view else {}
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    found = insight.collect(runs, loaded)
    trackers = _tracker_rows(runs, tracking_failures)
    exports = _export_rows(runs, loaded, Path(out_dir))
    models = (exports, _fine_tuning_rows(runs, loaded), _language_models(runs, loaded))
    blocks = document(loaded, rows, figures, generated, unfinished, insight.blocks(found),
                      bad_nodes, trackers, sweep.blocks(view, swept) if view else (), focus,
                      *models, compared=compare.headline(ranked))  # fmt: skip
    summary = summary_json(loaded, rows, baseline, generated, unfinished)
    summary["groups"] = compare.summary(ranked)
    summary.update(summary_extras(view, bad_nodes, found, trackers))
    paths = _write_all(Path(out_dir), {**figures, **swept}, _texts(summary, rows, blocks, view))
    _log_written(rows, unfinished, [row for row in rows if row["best"]], out_dir)
    return paths


def _shown(runs: list[dict], unfinished) -> tuple[list, list[dict], list[dict]]:
    """The loaded runs the report can render, their entries of runs, and unfinished with an
    entry for each run that could not be loaded or rendered."""
    loaded, unreadable = _renderable(runs, *load_runs(runs, unfinished))
    shown = {name for name, _, _ in loaded}
    return loaded, [r for r in runs if str(r["name"]) in shown], [*unfinished, *unreadable]


def _log_written(rows: list[dict], unfinished: list[dict], best: list[dict], out_dir) -> None:
    selected = ", ".join(row["run"] for row in best)
    log.info(
        "report: %s%s, %s -> %s",
        counted(len(rows), "run"),
        f", {len(unfinished)} unfinished" if unfinished else "",
        f"selected on validation: {selected}" if selected else "no runs compared",
        out_dir,
    )


def _export_rows(runs: list[dict], loaded, out_dir: Path) -> list[list]:
    """One row per file: each shown run's model.pt and the exports that exist, linked from
    the report's folder; none where no run has an export (export.formats: [])."""
    shown = {name for name, _, _ in loaded}
    rows = []
    for run in (run for run in runs if run["name"] in shown):
        folder = Path(run["train_metrics"]).parent
        for name in (RUN_FILES["model"], *EXPORT_FILES.values()):
            path = folder / name
            if path.is_file():
                size = f"{path.stat().st_size / 2**20:.1f} MiB"
                rows.append([run["name"], Link(name, os.path.relpath(path, out_dir)), size])
    return rows if any(row[1].text != RUN_FILES["model"] for row in rows) else []


def _language_models(runs: list[dict], loaded) -> list[tuple[str, dict]]:
    """(run, its task's own train_summary.json record: Task.train_record_key, a language
    model's) of each shown run whose task keeps one."""
    keys = {name: record_task(ev).train_record_key for name, _, ev in loaded}
    found = []
    for run in (run for run in runs if keys.get(run["name"])):
        summary_file = Path(run["train_metrics"]).parent / RUN_FILES["train_summary"]
        try:
            record = json.loads(summary_file.read_text()).get(keys[run["name"]])
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            found.append((run["name"], record))
    return found


def _fine_tuning_rows(runs: list[dict], loaded) -> list[list[str]]:
    """One row per shown run whose train_summary.json has a fine_tuning record."""
    shown = {name for name, _, _ in loaded}
    rows = []
    for run in (run for run in runs if run["name"] in shown):
        summary_file = Path(run["train_metrics"]).parent / RUN_FILES["train_summary"]
        try:
            done = json.loads(summary_file.read_text()).get("fine_tuning")
        except (OSError, ValueError):
            continue
        if not done:
            continue
        weights = done.get("weights") or {}
        until = f" until epoch {done['unfreeze_at_epoch']}" if done.get("unfreeze_at_epoch") else ""
        frozen = f"{done['freeze']}{until}" if done.get("freeze") else "nothing"
        rows.append(
            [
                run["name"],
                weights.get("spec", "random"),
                weights.get("sha256", "")[:16],
                weights.get("head") or "kept",
                frozen,
                done.get("normalisation", ""),
            ]
        )
    return rows
