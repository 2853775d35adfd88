"""The report's sweep view: the runs a sweep made, ranked by validation accuracy.

A run made by a sweep carries `run["sweep"]` (ddpflow.config: its point's `values`, every
swept `keys`, the `log_keys` drawn log-uniform, its `origin`, the sweep's `peers` and
`prune`); a run written under `runs:` carries none and is left out of the view. Runs are
ranked by the validation accuracy of the model they kept (the last epoch's: a pruned run
keeps its last model too), never by test accuracy: selecting on the test set would make the
test figure of the winner an optimistic one. The selected run's test accuracy is then the
held-out figure of the selection. Pure and matplotlib-free: the Snakefile imports `slim`.

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
from ddpflow.text import counted

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


def _finished_row(entry: dict, epochs: list[dict], ev: dict, block: dict) -> dict:
    pruned = _pruned(entry, ev)
    return {
        "run": str(entry["name"]), "values": dict(block["values"]),
        "val_accuracy": epochs[-1]["val_accuracy"], "val_loss": epochs[-1].get("val_loss"),
        "test_accuracy": ev["accuracy"],
        "split": ev.get("split", "test"), "epochs": len(epochs),
        "status": "pruned" if pruned else "finished", "pruned": pruned, "rank": None,
    }  # fmt: skip


def _unfinished_row(entry: dict, block: dict) -> dict:
    return {
        "run": str(entry["run"]), "values": dict(block["values"]), "val_accuracy": None,
        "test_accuracy": None, "split": None, "epochs": None,
        # a failure record names its log; a run that never ran (a step it needs failed) has none
        "status": "failed" if entry.get("log") else "unfinished", "pruned": None, "rank": None,
    }  # fmt: skip


def _ordered_union(lists) -> list:
    seen: dict = {}
    for items in lists:
        seen.update(dict.fromkeys(items))
    return list(seen)


def collect(runs: list[dict], loaded, unfinished=()) -> dict | None:
    """The sweep view of the report's runs, or None where no run came from a sweep.

    runs: build_report's run entries ({"name", "train_metrics", ..., optional "sweep"}),
    loaded: [(name, epochs, eval metrics)] in the same order, unfinished: outcome's entries
    (optional "sweep"). Ranked rows first (best first), then those without a result."""
    entries = {str(entry["name"]): entry for entry in runs}
    rows, blocks_seen = [], []
    for name, epochs, ev in loaded:
        if (block := _block(entries[name], ev)) is not None:
            rows.append(_finished_row(entries[name], epochs, ev, block))
            blocks_seen.append(block)
    for entry in unfinished:
        if (block := _block(entry, None)) is not None:
            rows.append(_unfinished_row(entry, block))
            blocks_seen.append(block)
    if not rows:
        return None
    # every swept key, in the sweep's order; a value under no listed key still gets a column
    keys = _ordered_union([b.get("keys") or [] for b in blocks_seen] + [r["values"] for r in rows])
    log_keys = _ordered_union(b.get("log_keys") or [] for b in blocks_seen)
    return {
        "keys": keys, "log_keys": [k for k in log_keys if k in keys],
        "origins": _ordered_union([b.get("origin")] for b in blocks_seen if b.get("origin")),
        "prune": next((b["prune"] for b in blocks_seen if b.get("prune")), None),
        "rows": _ranked(rows),
    }  # fmt: skip


def _ranked(rows: list[dict]) -> list[dict]:
    """Best validation accuracy first; a tie goes to the lower validation loss (still the
    validation split: small validation sets tie often), then to the run that finished (over
    a pruned one), then by name, so the order never depends on the order runs are listed in."""
    scored = [r for r in rows if r["val_accuracy"] is not None]

    def key(r: dict) -> tuple:
        loss = r.get("val_loss")
        loss = loss if isinstance(loss, int | float) and math.isfinite(loss) else math.inf
        return (-r["val_accuracy"], loss, r["status"] != "finished", r["run"])

    scored.sort(key=key)
    for rank, row in enumerate(scored, start=1):
        row["rank"] = rank
    rest = sorted((r for r in rows if r["val_accuracy"] is None), key=lambda r: r["run"])
    return scored + rest


def selected(view: dict | None) -> dict | None:
    """The run the sweep selects: rank 1 (by validation accuracy), None if none finished."""
    return next((row for row in view["rows"] if row["rank"] == 1), None) if view else None


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    return value if isinstance(value, str) else json.dumps(value)


def csv_text(view: dict) -> str:
    """sweep.csv: one row per sweep run, best first (rank empty for runs without a result)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["run", *view["keys"], "val_accuracy", "test_accuracy", "epochs", "status",
                     "rank"])  # fmt: skip
    for row in view["rows"]:
        writer.writerow([row["run"], *(_cell(row["values"].get(k)) for k in view["keys"]),
                         _cell(row["val_accuracy"]), _cell(row["test_accuracy"]),
                         _cell(row["epochs"]), row["status"], _cell(row["rank"])])  # fmt: skip
    return buffer.getvalue()


def summary(view: dict) -> dict:
    """summary.json's `sweep`: the keys and the ranking (no per-run configs)."""
    best = selected(view)
    return {
        "keys": view["keys"], "log_keys": view["log_keys"], "origins": view["origins"],
        "selected_run": best and best["run"], "selected_by": "val_accuracy",
        "ranking": [{k: row[k] for k in ("run", "rank", "status", "val_accuracy",
                                         "test_accuracy", "epochs", "values")}
                    for row in view["rows"]],
    }  # fmt: skip


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


def _table(view: dict, rows: list[dict]) -> tuple:
    split = _split_label(view)
    headers = ["Rank", "Run", *view["keys"], "Validation accuracy",
               f"{split.capitalize()} accuracy", "Epochs", "Status"]  # fmt: skip
    body = [[_value(r["rank"]), r["run"], *(_value(r["values"].get(k)) for k in view["keys"]),
             "–" if r["val_accuracy"] is None else f"{r['val_accuracy']:.2%}",
             "–" if r["test_accuracy"] is None else f"{r['test_accuracy']:.2%}",
             _value(r["epochs"]), _status(r)] for r in rows]  # fmt: skip
    best = 0 if rows and rows[0]["rank"] == 1 else None
    return ("table", headers, body, best)


def _split_label(view: dict) -> str:
    """What the runs' evaluation scored: eval.split may be val (then it is no test figure)."""
    splits = {r["split"] for r in view["rows"] if r["split"]}
    if len(splits) != 1:
        return "evaluation" if splits else "test"
    return {"val": "validation", "train": "training"}.get(splits.pop(), "test")


def _headline(view: dict) -> str:
    counts = {s: sum(r["status"] == s for r in view["rows"]) for s in
              ("finished", "pruned", "failed", "unfinished")}  # fmt: skip
    done = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    origins = ", ".join(view["origins"]) or "sweep"
    text = (f"{counted(len(view['rows']), 'run')} of a sweep ({origins}) "
            f"over {', '.join(view['keys'])}: {done}. Ranked by validation accuracy (of the model "
            "each run kept: its last epoch's); the test set is never used to select.")  # fmt: skip
    best = selected(view)
    if best is None:
        return text + " No run finished: nothing to select."
    split = _split_label(view)
    held_out = "held-out figure" if split == "test" else f"{split} figure (eval.split)"
    return text + (f" Selected: {best['run']} (validation accuracy {best['val_accuracy']:.2%}); "
                   f"its {split} accuracy, {best['test_accuracy']:.2%}, is the selection's "
                   f"{held_out}.")  # fmt: skip


def blocks(view: dict, figures: dict[str, tuple[str, bytes]]) -> list[tuple]:
    """The sweep section: headline, ranking (the top TOP_IN_TABLE, all of it folded in the
    HTML; the Markdown points to sweep.csv), then the figures (plots/sweep_*.png)."""
    rows = view["rows"]
    out = [("h2", "Sweep: runs ranked by validation accuracy"), ("p", _headline(view))]
    if view["prune"]:
        out.append(("p", f"Median pruning ({_cell(view['prune'])}): a pruned run stopped below "
                         "the median validation accuracy of the runs that had reached the same "
                         "epoch; it kept its last model and is ranked on it. Which runs are "
                         "pruned depends on the order in which runs finish."))  # fmt: skip
    out.append(_table(view, rows[:TOP_IN_TABLE]))
    if len(rows) > TOP_IN_TABLE:
        note = (
            f"The top {TOP_IN_TABLE} of {len(rows)} runs; every run is in "
            f"{CSV_NAME} and in report.html."
        )
        out.append(("fold", f"All {len(rows)} runs of the sweep", _table(view, rows), note))
    out += [("img", caption, f"plots/{key}.png", png) for key, (caption, png) in figures.items()]
    return out
