"""Report rendering: run rows, figures and provenance -> report.md and report.html text.

report.py loads and validates the runs and computes the rows; here they become a list of
format-neutral blocks, ("h2", text), ("p", text), ("table", headers, body, best_index)
(best_index: a row index, a tuple of them (each comparability group's best run) or None),
("img", caption, path, png), ("details", summary, code), ("fold", summary, block, note) (a
block folded away in the HTML, the note in its place in the Markdown): both formats show the
same content. Task tables: tables.py; efficiency: efficiency.py. Pure: no file system.

    blocks = document(loaded, rows, figures, "2025-01-01 00:00 UTC")
    markdown, page = to_markdown("ddpflow report", blocks), to_html("ddpflow report", blocks)
"""

from __future__ import annotations

import base64
import html
import re

from ddpflow.report import metrics
from ddpflow.report.efficiency import efficiency_blocks
from ddpflow.report.segments import segments_blocks
from ddpflow.report.tables import (
    Link,
    hosts_text,
    model_blocks,
    provenance_blocks,
    result_tables,
    split_label,
)
from ddpflow.runtime import PHASES
from ddpflow.words import counted

__all__ = ["PHASES", "document", "to_html", "to_markdown"]

# the tables' fixed headers and the report's fixed paragraphs
_RECIPE_HEADS = ("Model", "Parameters", "Epochs", "Global batch", "LR (effective)", "Precision")
_TIME_HEADS = ("Train wall time", "Attempts", "Eval time", "Evaluated by")
_RERUN = (
    "Fix the cause, then run the same snakemake command again: it redoes the unfinished runs "
    "and this report, nothing else."
)
_UNRENDERABLE = (
    "A run that failed in 'report' trained and was evaluated, but its records cannot be "
    "shown: a rerun does not redo it. Fix or remove the file named, then build the report "
    "again (python -m ddpflow report)."
)
_EXCLUDED = (
    "later jobs exclude them (and run on fewer nodes with machine.min_nodes). Once they are "
    "repaired: snakemake clean_bad_nodes."
)
_LOGGED = (
    "Where each run was logged (results/runs/<run>/tracking.json). A failed tracker failed "
    "only its logging: the run trained and was evaluated; fix the cause and run the same "
    "snakemake command again."
)
_SPEEDUP = (
    "Speedup and efficiency compare only runs that differ in machine shape alone (same data, "
    "model and training settings, the global batch included: one scaling group, so this is "
    "strong scaling of the same training), each against its group's fastest run at the "
    "group's smallest world size (ideal: linear in ranks). Runs without a group have nothing "
    "to compare with."
)


def _seconds(value: float) -> str:
    if value < 1:  # a small split evaluates in milliseconds: "0.0 s" read as unmeasured
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.1f} s"
    return f"{value / 60:.1f} min" if value < 7200 else f"{value / 3600:.2f} h"


def _number(value, fmt: str) -> str:
    return "?" if value is None else format(value, fmt)


def _runs_table(rows: list[dict], scaling: bool, heads: dict | None = None) -> tuple:
    """What each run trained and how well: one row per run, with its task's headline metrics
    (heads: run -> metric keys; classification's accuracy where None). Runs of one task get a
    column per metric; runs of several tasks one column of each run's own metrics. A Task
    column wherever a run is not classification."""
    label = split_label(rows)
    heads = heads or {row["run"]: ["accuracy"] for row in rows}
    shared = len({row.get("task") for row in rows}) == 1
    keys = heads[rows[0]["run"]] if shared else []
    scores = [f"{label.capitalize()} {metrics.label(key)}" for key in keys]
    task_head = ["Task"] if "task" in rows[0] else []
    score_heads = scores if shared else [f"{label.capitalize()} metrics"]
    split_head = ["Split"] if label == "evaluation" else []  # runs evaluated on several
    headers = ["Run", *task_head, *split_head, *score_heads]
    headers += [f"Evaluated / {label} size", *_RECIPE_HEADS]
    body, best = [], []
    for index, row in enumerate(rows):
        task = [row["task"]] if "task" in row else []
        if shared:
            shown = [metrics.shown(key, row.get(key)) for key in keys]
        else:
            own = heads[row["run"]]
            shown = [", ".join(f"{metrics.label(k)} {metrics.shown(k, row.get(k))}" for k in own)]
        name = row["run"] + (" ★ best" if row["best"] else "")
        evaluated = f"{row['samples_evaluated']} / {row['test_size']}"
        split = [row.get("split", "test")] if split_head else []
        body.append([name, *task, *split, *shown, evaluated, *_recipe_cells(row)])
        best += [index] if row["best"] else []
    return ("table", headers, body, best[0] if len(best) == 1 else tuple(best) or None)


def _recipe_cells(row: dict) -> list[str]:
    """A run's model, parameters, epochs, global batch, learning rate and precision, shown."""
    parameters, batch = _number(row["parameters"], ","), _number(row["global_batch"], "d")
    lr = _number(row["lr"], ".4g")
    return [row["model"], parameters, str(row["epochs"]), batch, lr, row["precision"]]


def _machine_table(rows: list[dict], scaling: bool) -> tuple:
    """Where and how fast each run trained; speedup only within a scaling group."""
    unit, rate = _throughput(rows)
    headers = ["Run", "World size", "Nodes", "Hosts", "Device", unit, *_TIME_HEADS]
    if scaling:
        headers[6:6] = ["Scaling group", "Speedup", "Efficiency"]
    body = []
    for row in rows:
        shape = [str(row["world_size"]), str(row["nodes"]), hosts_text(row["hosts"])]
        train = [_seconds(row["train_wall_seconds"]), str(row["attempts"])]
        evaluated = [_seconds(row["eval_seconds"]), row["evaluated_by"]]
        cells = [row["run"], *shape, row["device"], rate(row), *train, *evaluated]
        if scaling:
            cells[6:6] = _group_cells(row)
        body.append(cells)
    return ("table", headers, body, None)


def _group_cells(row: dict) -> list[str]:
    """A run's scaling group, speedup and efficiency; dashes for a run in no group."""
    if row["speedup"] is None:
        return ["–", "–", "–"]
    return [str(row["scaling_group"]), f"{row['speedup']:.2f}×", f"{row['efficiency']:.1%}"]


def _throughput(rows: list[dict]) -> tuple:
    """The throughput column's header and cell: tokens/s for language models (a sample is a
    block of tokens), samples/s for the rest, each cell with its unit where both appear."""
    tokens = ["train_tokens_per_s" in row for row in rows]
    if all(tokens):
        return "Train tokens/s", lambda row: _number(row["train_tokens_per_s"], ",.0f")
    if not any(tokens):
        return "Train samples/s", lambda row: f"{row['train_samples_per_s']:.1f}"

    def cell(row: dict) -> str:
        if "train_tokens_per_s" in row:
            return f"{_number(row['train_tokens_per_s'], ',.0f')} tokens/s"
        return f"{row['train_samples_per_s']:.1f} samples/s"

    return "Train throughput", cell


def _phase_table(rows: list[dict]) -> tuple:
    body = []
    for row in rows:
        total = row["epoch_seconds"] or 1.0  # a zero total would divide by zero; shares are 0
        shares = [_share(row[f"{p}_seconds"], total) for p in PHASES]
        body.append([row["run"], *shares, _seconds(row["epoch_seconds"])])
    return ("table", ["Run", *PHASES, "epochs total"], body, None)


def _share(seconds: float, total: float) -> str:
    return f"{_seconds(seconds)} ({seconds / total:.0%})"


def _unfinished_blocks(unfinished, finished: int) -> list[tuple]:
    """The runs that did not finish, each with the stage that failed and why."""
    total = finished + len(unfinished)
    partial = f"Partial report: {finished} of {counted(total, 'run')} finished. {_RERUN}"
    table = [
        [u["run"], u.get("stage", "-"), u.get("cause", "?"), u.get("log") or "-"]
        for u in unfinished
    ]
    headers = ["Run", "Failed in", "Cause", "Log"]
    blocks = [("h2", "Runs that did not finish"), ("p", partial), ("table", headers, table, None)]
    detailed = [u for u in unfinished if u.get("detail")]
    blocks += [("details", f"{u['run']}: {u['cause']}", u["detail"]) for u in detailed]
    if any(u.get("stage") == "report" for u in unfinished):  # inputs.unrenderable
        blocks.insert(2, ("p", _UNRENDERABLE))
    return blocks


def _bad_node_blocks(bad_nodes) -> list[tuple]:
    """The nodes of the bad-node ledger (ddpflow.cluster.nodes), which later Slurm jobs avoid."""
    failed = f"{counted(len(bad_nodes), 'node')} failed under this workflow's Slurm jobs; "
    table = [[e["node"], e.get("reason", "?"), *_ledger_cells(e)] for e in bad_nodes]
    headers = ["Node", "Reason", "Job", "Run", "Time"]
    return [("h2", "Bad nodes"), ("p", failed + _EXCLUDED), ("table", headers, table, None)]


def _ledger_cells(entry: dict) -> list:
    return [entry.get(key, "-") for key in ("job_id", "run", "time")]


def _tracker_blocks(trackers) -> list[tuple]:
    """Each run's tracker runs (ddpflow.tracking): where to look at it in MLflow or W&B."""
    headers = ["Run", "Tracker", "Tracker run id", "URL, or where"]
    return [("h2", "Experiment trackers"), ("p", _LOGGED), ("table", headers, trackers, None)]


def document(
    loaded,
    rows,
    figures,
    generated: str,
    unfinished=(),
    inside=(),
    bad_nodes=(),
    trackers=(),
    sweep=(),
    focus=None,
    exports=(),
    fine_tuned=(),
    language_models=(),
    compared: str = "",
) -> list[tuple]:
    """The report's blocks; sweep: the sweep section (ddpflow.report.sweep); focus: with many
    runs, the best ones, the only ones given a per-class column and a confusion matrix
    (per-label and per-target tables likewise); compared: the headline's words on what was
    ranked against what (ddpflow.report.compare.headline)."""
    blocks = [("p", f"Generated {generated}.")]
    if unfinished:
        blocks += _unfinished_blocks(unfinished, len(rows))
    if bad_nodes:
        blocks += _bad_node_blocks(bad_nodes)
    if not rows:
        return blocks + (_tracker_blocks(trackers) if trackers else [])
    selections = {name: metrics.selection(ev) for name, _, ev in loaded}
    heads = {name: metrics.headline(ev) for name, _, ev in loaded}
    scaling = any(row["speedup"] is not None for row in rows)
    label = "validation" if sweep else split_label(rows)
    blocks[0] = ("p", f"Generated {generated}. {counted(len(rows), 'run')}; {compared}")
    blocks += [*sweep, ("h2", "Runs"), _runs_table(rows, scaling, heads)]
    blocks += _machine_blocks(loaded, rows, scaling)
    blocks += model_blocks(exports, fine_tuned, language_models)
    if trackers:
        blocks += _tracker_blocks(trackers)
    blocks += [("h2", "Time per phase (sum over epochs, share of epoch time)"), _phase_table(rows)]
    # ddpflow.report.insight: ranks, stragglers, profiles, cluster efficiency
    blocks += list(inside)
    blocks += _result_blocks(loaded, rows, figures, label, focus, selections)
    return blocks + [("h2", "Provenance"), *provenance_blocks(loaded)]


def _machine_blocks(loaded, rows: list[dict], scaling: bool) -> list[tuple]:
    """Where and how fast each run trained: the machine table, what its speedup compares and
    the segments of runs continued on another allocation."""
    blocks = [("h2", "Machine and speed"), _machine_table(rows, scaling)]
    if scaling:
        blocks.append(("p", _SPEEDUP))
    blocks += efficiency_blocks(loaded)  # FLOP/s, MFU, memory estimate vs peak
    return blocks + segments_blocks(loaded)  # continued on another allocation, restarted


def _result_blocks(loaded, rows, figures, label: str, focus, selections: dict) -> list[tuple]:
    """Each task's tables (per-class accuracy, per-label F1, per-target errors), then the
    plots; with many runs, a note that only the focus runs are shown."""
    note = [("p", _focus_note(focus, len(rows), selections))] if focus is not None else []
    blocks = result_tables(loaded, rows, label, focus, note)
    blocks += [("h2", "Plots"), *note]
    blocks += [
        ("img", caption, f"plots/{key}.png", png) if png else ("p", caption)
        for key, (caption, png) in figures.items()
    ]  # a plot not drawn: why, in its place
    return blocks


def _focus_note(focus, runs: int, selections: dict | None = None) -> str:
    chosen = {s.label for s in (selections or {}).values()} or {"validation accuracy"}
    what = chosen.pop() if len(chosen) == 1 else "validation figure of each task"
    shown = f"the {len(focus)} with the best {what} are shown here ({', '.join(focus)})"
    return f"{runs} runs: {shown}; summary.json and summary.csv hold every run."


def _md(text) -> str:
    text = html.escape(str(text), quote=False).replace("\n", " ")
    return re.sub(r"([\\`*_\[\]|#])", r"\\\1", text)


def _md_cell(cell) -> str:  # a table cell: text, or a Link (tables.Link)
    return f"[{_md(cell.text)}]({cell.href})" if isinstance(cell, Link) else _md(cell)


def _html_cell(cell) -> str:
    if isinstance(cell, Link):
        return f"<a href='{html.escape(cell.href)}'>{html.escape(cell.text)}</a>"
    return html.escape(str(cell))


def to_markdown(title: str, blocks: list[tuple]) -> str:
    out = [f"# {_md(title)}"]
    for block in blocks:
        match block:
            case ("h2" | "h3" as tag, text):
                out.append(f"{'#' * int(tag[1])} {_md(text)}")
            case ("p", text):
                out.append(_md(text))
            case ("table", headers, body, best):
                lines = ["| " + " | ".join(map(_md, headers)) + " |", "|---" * len(headers) + "|"]
                for index, cells in enumerate(body):
                    cells = [
                        f"**{_md_cell(c)}**" if _is_best(index, best) else _md_cell(c)
                        for c in cells
                    ]
                    lines.append("| " + " | ".join(cells) + " |")
                out.append("\n".join(lines))
            case ("img", caption, path, _):
                out.append(f"![{_md(caption)}]({path})")
            case ("fold", _, _, note):
                out.append(_md(note))
            case ("details", summary, code, *language):  # yaml unless another is given
                # A fence longer than any backtick run inside keeps the block closed.
                fence = "`" * max(3, 1 + max(map(len, re.findall(r"`+", code)), default=0))
                fence_open = fence + (language or ["yaml"])[0]
                opening = f"<details><summary>{html.escape(summary)}</summary>"
                out.append(f"{opening}\n\n{fence_open}\n{code}\n{fence}\n\n</details>")
    return "\n\n".join(out) + "\n"


_CSS = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; }
th { background: #f0f0f0; }
tr.best td { background: #e3f4e1; font-weight: 600; }
figure { margin: 1em 0; } img { max-width: 100%; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; }
"""


def _is_best(index: int, best) -> bool:
    """A table's best row: best is an index, a tuple of them (each task's best) or None."""
    return index in best if isinstance(best, tuple) else index == best


def _html_block(block: tuple) -> str:
    esc = html.escape
    match block:
        case ("h2" | "h3" | "p" as tag, text):
            return f"<{tag}>{esc(str(text))}</{tag}>"
        case ("table", headers, body, best):
            head = "".join(f"<th>{esc(h)}</th>" for h in headers)
            trs = [_html_row(cells, _is_best(index, best)) for index, cells in enumerate(body)]
            return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(trs)}</tbody></table>"
        case ("img", caption, _, png):
            src = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
            figcaption = f"<figcaption>{esc(caption)}</figcaption>"
            return f"<figure><img alt='{esc(caption)}' src='{src}'>{figcaption}</figure>"
        case ("details", summary, code, *_):
            return f"<details><summary>{esc(summary)}</summary><pre>{esc(code)}</pre></details>"
        case ("fold", summary, inner, _):
            return f"<details><summary>{esc(summary)}</summary>{_html_block(inner)}</details>"
    raise ValueError(f"unknown report block {block[0]!r}")


def _html_row(cells, best: bool) -> str:
    tds = "".join(f"<td>{_html_cell(c)}</td>" for c in cells)
    return f"<tr class='best'>{tds}</tr>" if best else f"<tr>{tds}</tr>"


def to_html(title: str, blocks: list[tuple]) -> str:
    body = "\n".join(_html_block(block) for block in blocks)
    head = f"<meta charset='utf-8'><title>{html.escape(title)}</title><style>{_CSS}</style>"
    page = f"<body><h1>{html.escape(title)}</h1>\n{body}\n</body>"
    return f"<!DOCTYPE html>\n<html lang='en'><head>{head}</head>\n{page}</html>\n"
