"""The report's sweep view: the runs a sweep made, ranked by validation accuracy (another
task: by its selection metric in its direction, a lower validation MSE first).

A run made by a sweep carries `run["sweep"]` (ddpflow.config: its point's `values`, every
swept `keys`, the `log_keys` drawn log-uniform, its `origin`, the sweep's `peers` and
`prune`); a run written under `runs:` carries none and is left out of the view. Runs are
ranked by the validation accuracy of the model they kept (the last epoch's: a pruned run
keeps its last model too), never by test accuracy: selecting on the test set would make the
test figure of the winner an optimistic one. The selected run's test accuracy is then the
held-out figure of the selection. A run of another task (ddpflow.task) is ranked the same
way on its task's selection metric (ddpflow.task.selection_of: val_f1_micro, val_mse), its
evaluation's figure of the same metric (f1_micro, mse) the held-out one; the rows, sweep.csv
and summary.json name the metric (val_mse, test_mse). A sweep's runs share their task; a run
of another task than the sweep's first finished run is listed unranked ("other task").
Pure and matplotlib-free: the Snakefile imports `slim`.

    view = collect(runs, loaded, unfinished)   # None without a sweep run
    csv_text(view); blocks(view, figures)
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from pathlib import Path

from ddpflow.paths import RUN_FILES
from ddpflow.report import compare, metrics
from ddpflow.task import selection_of
from ddpflow.words import counted

__all__ = ["CSV_NAME", "TOP_IN_TABLE", "blocks", "collect", "csv_text", "slim"]

log = logging.getLogger(__name__)

CSV_NAME = "sweep.csv"  # results/report/sweep.csv: one row per sweep run
TOP_IN_TABLE = 20  # ranking rows shown in full; report.html folds the rest, sweep.csv has all
_SLIM_KEYS = ("values", "keys", "log_keys", "origin", "prune")


def slim(block: dict | None) -> dict | None:
    """The part of a run's sweep block the report needs: without `peers` (every run's name,
    so that N runs would pass N x N names to the report rule)."""
    if not isinstance(block, dict):
        return None
    return {key: block[key] for key in _SLIM_KEYS if key in block}


def _block(entry: dict, ev: dict | None) -> dict | None:
    """The run's sweep block: given with the run (the report rule's current config), else
    the one its evaluation recorded with the config it ran."""
    block = entry.get("sweep")
    if block is None and ev is not None:
        config = ev["provenance"]["config"]
        block = config.get("sweep") if isinstance(config, dict) else None
    return block if isinstance(block, dict) and isinstance(block.get("values"), dict) else None


def _pruned(entry: dict, ev: dict) -> dict | None:
    """train_summary.json's `pruned` record (beside train_metrics), else the copy of the
    summary that eval_metrics.json embeds."""
    path = Path(entry["train_metrics"]).parent / RUN_FILES["train_summary"]
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        summary = ev.get("train") or {}
    record = summary.get("pruned") if isinstance(summary, dict) else None
    return record if isinstance(record, dict) else None


def held_out(chosen) -> str:
    """The row key of the evaluation's figure of the selection metric: test_accuracy,
    test_mse (named test whatever eval.split scored, as sweep.csv always named it)."""
    return f"test_{metrics.eval_key(chosen)}"


def _finished_row(entry: dict, epochs: list[dict], ev: dict, block: dict, first) -> dict:
    """A finished run's row; first: the comparability identity of the sweep's first finished
    run (ddpflow.report.compare): a run of another task, or on other data or another
    vocabulary (a swept data.path, data.vocab_size), is listed but not ranked."""
    pruned, chosen, mine = _pruned(entry, ev), first.selection, compare.identity(ev)
    own = mine == first
    val, test = chosen.metric, held_out(chosen)
    status = "pruned" if pruned else "finished"
    if not own:
        status = "other task" if mine.selection.metric != chosen.metric else "other data"
    return {
        "run": str(entry["name"]),
        "values": dict(block["values"]),
        val: epochs[-1][val] if own else None,
        "val_loss": epochs[-1].get("val_loss"),
        test: ev.get(metrics.eval_key(chosen)) if own else None,
        "split": ev.get("split", "test"),
        "epochs": len(epochs),
        "status": status,
        "pruned": pruned,
        "rank": None,
    }


def _unfinished_row(entry: dict, block: dict, chosen) -> dict:
    return {
        "run": str(entry["run"]),
        "values": dict(block["values"]),
        chosen.metric: None,
        held_out(chosen): None,
        "split": None,
        "epochs": None,
        # a failure record names its log; a run that never ran (a step it needs failed) has none
        "status": "failed" if entry.get("log") else "unfinished",
        "pruned": None,
        "rank": None,
    }


def _ordered_union(lists) -> list:
    seen: dict = {}
    for items in lists:
        seen.update(dict.fromkeys(items))
    return list(seen)


def collect(runs: list[dict], loaded, unfinished=()) -> dict | None:
    """The sweep view of the report's runs, or None where no run came from a sweep.

    runs: build_report's run entries ({"name", "train_metrics", ..., optional "sweep"}),
    loaded: [(name, epochs, eval metrics)] in the same order, unfinished: outcome's entries
    (optional "sweep"). Ranked rows first (best first), then those without a result. The
    view's "selection" is the runs' (the first finished sweep run's: classification's
    validation accuracy where none finished)."""
    entries = {str(entry["name"]): entry for entry in runs}
    finished = []
    for name, epochs, ev in loaded:
        if block := _block(entries[name], ev):
            finished.append((entries[name], epochs, ev, block))
    chosen = metrics.selection(finished[0][2]) if finished else selection_of(None)
    rows: list[dict] = []
    blocks_seen: list[dict] = []
    for entry, epochs, ev, block in finished:
        rows.append(_finished_row(entry, epochs, ev, block, compare.identity(finished[0][2])))
        blocks_seen.append(block)
    for entry in unfinished:
        if (block := _block(entry, None)) is not None:
            rows.append(_unfinished_row(entry, block, chosen))
            blocks_seen.append(block)
    if not rows:
        return None
    # every swept key, in the sweep's order; a value under no listed key still gets a column
    keys = _ordered_union([b.get("keys") or [] for b in blocks_seen] + [r["values"] for r in rows])
    log_keys = _ordered_union(b.get("log_keys") or [] for b in blocks_seen)
    return {
        "keys": keys,
        "log_keys": [k for k in log_keys if k in keys],
        "origins": _ordered_union([b.get("origin")] for b in blocks_seen if b.get("origin")),
        "prune": next((b["prune"] for b in blocks_seen if b.get("prune")), None),
        "selection": chosen,
        "rows": _ranked(rows, chosen),
    }


def _ranked(rows: list[dict], chosen=None) -> list[dict]:
    """Best validation accuracy first (chosen: the selection, another task's metric and
    direction: a lower validation MSE first); a tie goes to the lower validation loss (still
    the validation split: small validation sets tie often), then to the run that finished
    (over a pruned one), then by name, so the order never depends on the order runs are
    listed in. A value that is not finite (a diverged run) ranks last."""
    chosen = chosen or selection_of(None)
    metric = chosen.metric
    scored = [r for r in rows if r.get(metric) is not None]

    def key(r: dict) -> tuple:
        loss = r.get("val_loss")
        loss = loss if isinstance(loss, int | float) and math.isfinite(loss) else math.inf
        return (metrics.score(chosen, r[metric]), loss, r["status"] != "finished", r["run"])

    scored.sort(key=key)
    for rank, row in enumerate(scored, start=1):
        row["rank"] = rank
    rest = sorted((r for r in rows if r.get(metric) is None), key=lambda r: r["run"])
    return scored + rest


def _selection(view: dict):
    return view.get("selection") or selection_of(None)


def selected(view: dict | None) -> dict | None:
    """The run the sweep selects: rank 1 (by its selection metric), None if none finished."""
    return next((row for row in view["rows"] if row["rank"] == 1), None) if view else None


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    return value if isinstance(value, str) else json.dumps(value)


def csv_text(view: dict) -> str:
    """sweep.csv: one row per sweep run, best first (rank empty for runs without a result);
    its metric columns name the selection metric (val_accuracy, test_accuracy; val_mse,
    test_mse)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    val, test = _selection(view).metric, held_out(_selection(view))
    writer.writerow(["run", *view["keys"], val, test, "epochs", "status", "rank"])
    for row in view["rows"]:
        values = [_cell(row["values"].get(k)) for k in view["keys"]]
        figures = [_cell(row.get(val)), _cell(row.get(test)), _cell(row["epochs"])]
        writer.writerow([row["run"], *values, *figures, row["status"], _cell(row["rank"])])
    return buffer.getvalue()


def summary(view: dict) -> dict:
    """summary.json's `sweep`: the keys and the ranking (no per-run configs); selected_by
    names the selection metric, and higher_is_better: false says where lower wins."""
    best, chosen = selected(view), _selection(view)
    direction = {} if chosen.higher_is_better else {"higher_is_better": False}
    fields = ("run", "rank", "status", chosen.metric, held_out(chosen), "epochs", "values")
    return {
        "keys": view["keys"],
        "log_keys": view["log_keys"],
        "origins": view["origins"],
        "selected_run": best and best["run"],
        "selected_by": chosen.metric,
        **direction,
        "ranking": [{k: row.get(k) for k in fields} for row in view["rows"]],
    }


def _value(value) -> str:
    if value is None:
        return "–"
    return format(value, ".4g") if isinstance(value, float) else _cell(value)


def _status(row: dict) -> str:
    pruned = row["pruned"]
    if not pruned:
        return row["status"]
    epoch = pruned.get("epoch")
    return "pruned" + (f" after epoch {epoch}" if epoch is not None else "")


def _figure(key: str, value) -> str:
    return "–" if value is None else metrics.shown(key, value)


def _table(view: dict, rows: list[dict]) -> tuple:
    split, chosen = _split_label(view), _selection(view)
    val, test, name = chosen.metric, held_out(chosen), metrics.metric_name(chosen)
    figures = [f"Validation {name}", f"{split.capitalize()} {name}"]
    headers = ["Rank", "Run", *view["keys"], *figures, "Epochs", "Status"]
    body = [_table_row(r, view["keys"], val, test) for r in rows]
    best = 0 if rows and rows[0]["rank"] == 1 else None
    return ("table", headers, body, best)


def _table_row(r: dict, keys: list[str], val: str, test: str) -> list[str]:
    values = [_value(r["values"].get(k)) for k in keys]
    figures = [_figure(val, r.get(val)), _figure(test, r.get(test))]
    return [_value(r["rank"]), r["run"], *values, *figures, _value(r["epochs"]), _status(r)]


def _split_label(view: dict) -> str:
    """What the runs' evaluation scored: eval.split may be val (then it is no test figure)."""
    splits = {r["split"] for r in view["rows"] if r["split"]}
    if len(splits) != 1:
        return "evaluation" if splits else "test"
    return {"val": "validation", "train": "training"}.get(splits.pop(), "test")


def _headline(view: dict) -> str:
    statuses = ("finished", "pruned", "failed", "unfinished", "other task", "other data")
    counts = {s: sum(r["status"] == s for r in view["rows"]) for s in statuses}
    done = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    origins = ", ".join(view["origins"]) or "sweep"
    chosen, keys = _selection(view), ", ".join(view["keys"])
    runs = counted(len(view["rows"]), "run")
    ranked = f"Ranked by {chosen.label}{metrics.direction(chosen)} {_KEPT}"
    text = f"{runs} of a sweep ({origins}) over {keys}: {done}. {ranked}"
    if counts["other task"]:
        text += f" A run of another task than the sweep's ({chosen.metric}) is not ranked."
    if counts["other data"]:
        text += " A run on other data or another vocabulary than the sweep's first finished "
        text += "run is not ranked: its figures do not compare."
    best = selected(view)
    if best is None:
        return text + " No run finished: nothing to select."
    split, name = _split_label(view), metrics.metric_name(chosen)
    val = metrics.shown(chosen.metric, best[chosen.metric])
    test = metrics.shown(chosen.metric, best.get(held_out(chosen)))
    where = "held-out figure" if split == "test" else f"{split} figure (eval.split)"
    selection = f"Selected: {best['run']} ({chosen.label} {val})"
    return f"{text} {selection}; its {split} {name}, {test}, is the selection's {where}."


_KEPT = "(of the model each run kept: its last epoch's); the test set is never used to select."


def blocks(view: dict, figures: dict[str, tuple[str, bytes]]) -> list[tuple]:
    """The sweep section: headline, ranking (the top TOP_IN_TABLE, all of it folded in the
    HTML; the Markdown points to sweep.csv), then the figures (plots/sweep_*.png)."""
    rows, chosen = view["rows"], _selection(view)
    out: list[tuple] = [("h2", f"Sweep: runs ranked by {chosen.label}"), ("p", _headline(view))]
    if view["prune"]:
        where = "below" if chosen.higher_is_better else "above"
        median = f"the median {chosen.label} of the runs that had reached the same epoch"
        stopped = f"Median pruning ({_cell(view['prune'])}): a pruned run stopped {where} {median}"
        out.append(("p", f"{stopped}; {_PRUNED}"))
    out.append(_table(view, rows[:TOP_IN_TABLE]))
    if len(rows) > TOP_IN_TABLE:
        note = (
            f"The top {TOP_IN_TABLE} of {len(rows)} runs; every run is in "
            f"{CSV_NAME} and in report.html."
        )
        out.append(("fold", f"All {len(rows)} runs of the sweep", _table(view, rows), note))
    out += [("img", caption, f"plots/{key}.png", png) for key, (caption, png) in figures.items()]
    return out


_PRUNED = (
    "it kept its last model and is ranked on it. Which runs are pruned depends on the order in "
    "which runs finish."
)
