"""Report stage: every run's metrics -> tables, plots, report.md/.html and summary.json/.csv.

    from ddpflow.report import build_report
    paths = build_report(
        [{"name": "2x4", "train_metrics": "results/2x4/train.jsonl",
          "eval_metrics": "results/2x4/eval.json"}],
        "results/report",
    )

All inputs are loaded and validated, and every file is rendered in memory, before the first
write; each file is then replaced atomically and report.md/.html come last, so a bad input or
a crash never leaves a half-written report (a stale but whole one at most).
"""

from __future__ import annotations

import base64
import contextlib
import csv
import html
import io
import json
import logging
import os
import re
import uuid
from datetime import UTC, datetime
from pathlib import Path

import yaml

from ddpflow import plots

__all__ = ["build_report", "load_eval_metrics", "load_train_metrics"]

log = logging.getLogger(__name__)

PHASES = ("data", "forward", "backward_sync", "optimizer")
_NUM = (int, float)
_TRAIN_SPEC = {
    "run": str, "attempt": int, "epoch": int, "step": int, "train_loss": _NUM,
    "val_accuracy": _NUM, "val_loss": _NUM, "lr": _NUM, "samples_per_s": _NUM,
    "seconds": {key: _NUM for key in (*PHASES, "epoch")},
}  # fmt: skip
_EVAL_SPEC = {
    "run": str, "accuracy": _NUM, "per_class_accuracy": list, "confusion_matrix": list,
    "class_names": list, "samples_evaluated": int, "test_size": int, "world_size": int,
    "hosts": list, "eval_seconds": _NUM,
    "train": {
        "world_size": int, "nodes": int, "samples_per_s": _NUM, "wall_seconds": _NUM,
        "epochs": int, "attempts": int, "hosts": list, "phase_seconds": dict,
    },
    "provenance": {
        "config": dict, "git_commit": (str, type(None)), "versions": dict, "hostnames": list,
        "created": str,
    },
}  # fmt: skip


def _check(obj: dict, spec: dict, where: str, prefix: str = "") -> None:
    for key, kind in spec.items():
        if key not in obj:
            raise ValueError(f"{where}: missing key {prefix + key!r}")
        value, expected = obj[key], dict if isinstance(kind, dict) else kind
        # bool is an int subclass; a JSON true where a count belongs is a producer bug
        if isinstance(value, bool) or not isinstance(value, expected):
            raise ValueError(f"{where}: key {prefix + key!r} has type {type(value).__name__}")
        if isinstance(kind, dict):
            _check(value, kind, where, f"{prefix}{key}.")


def _read_text(path, where: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{where}: cannot read file ({err})") from err


def load_train_metrics(name: str, path) -> list[dict]:
    """Per-epoch records sorted by epoch; a resumed attempt re-does epochs, the last one wins."""
    where = f"run {name!r}: train_metrics {path}"
    by_epoch: dict[int, dict] = {}
    for number, line in enumerate(_read_text(path, where).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: line {number} is not JSON ({err.msg})") from err
        if not isinstance(record, dict):
            raise ValueError(f"{where}: line {number} is not a JSON object")
        _check(record, _TRAIN_SPEC, f"{where} line {number}")
        by_epoch[record["epoch"]] = record
    if not by_epoch:
        raise ValueError(f"{where}: no epochs recorded")
    return [by_epoch[epoch] for epoch in sorted(by_epoch)]


def load_eval_metrics(name: str, path) -> dict:
    """The evaluation JSON, checked for every key the report reads and for class consistency."""
    where = f"run {name!r}: eval_metrics {path}"
    try:
        data = json.loads(_read_text(path, where))
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not JSON ({err.msg})") from err
    if not isinstance(data, dict):
        raise ValueError(f"{where}: not a JSON object")
    _check(data, _EVAL_SPEC, where)
    n, matrix = len(data["class_names"]), data["confusion_matrix"]
    if len(data["per_class_accuracy"]) != n or len(matrix) != n:
        raise ValueError(f"{where}: class_names, per_class_accuracy, confusion_matrix differ")
    if any(not isinstance(row, list) or len(row) != n for row in matrix):
        raise ValueError(f"{where}: confusion_matrix is not {n}x{n}")
    # Padded samplers double-count (design.md): make a count mismatch loud, not fatal.
    total = sum(sum(row) for row in matrix)
    if not data["samples_evaluated"] == data["test_size"] == total:
        log.warning("%s: %d samples evaluated, test size %d, confusion total %d", where,
                    data["samples_evaluated"], data["test_size"], total)  # fmt: skip
    return data


def _load_runs(runs: list[dict]) -> list[tuple[str, list[dict], dict]]:
    if not runs:
        raise ValueError("build_report: no runs given")
    loaded, names = [], set()
    for run in runs:
        missing = {"name", "train_metrics", "eval_metrics"} - set(run)
        if missing:
            raise ValueError(f"run {run.get('name')!r}: missing {sorted(missing)}")
        name = str(run["name"])
        if name in names:
            raise ValueError(f"run {name!r}: listed twice")
        names.add(name)
        evals = load_eval_metrics(name, run["eval_metrics"])
        loaded.append((name, load_train_metrics(name, run["train_metrics"]), evals))
    return loaded


def _summary_row(name: str, epochs: list[dict], ev: dict) -> dict:
    train = ev["train"]
    row = {
        "run": name, "accuracy": ev["accuracy"], "samples_evaluated": ev["samples_evaluated"],
        "test_size": ev["test_size"], "world_size": train["world_size"], "nodes": train["nodes"],
        "hosts": train["hosts"], "train_samples_per_s": train["samples_per_s"],
        "train_wall_seconds": train["wall_seconds"], "epochs": train["epochs"],
        "attempts": train["attempts"], "eval_seconds": ev["eval_seconds"],
        "eval_world_size": ev["world_size"], "final_train_loss": epochs[-1]["train_loss"],
        "final_val_accuracy": epochs[-1]["val_accuracy"],
        "git_commit": ev["provenance"]["git_commit"],
    }  # fmt: skip
    # Summed over the kept (deduplicated) epochs: the time of the final, complete history.
    for phase in (*PHASES, "epoch"):
        row[f"{phase}_seconds"] = sum(e["seconds"][phase] for e in epochs)
    return row


def _add_scaling(rows: list[dict]) -> tuple[int, float] | None:
    """Speedup and efficiency against the fastest run at the smallest world size.

    The fastest baseline keeps efficiency from being flattered by a slow reference run.
    """
    for row in rows:
        row["speedup"] = row["efficiency"] = None
    if len({row["world_size"] for row in rows}) < 2:
        return None
    if any(row["train_samples_per_s"] <= 0 or row["world_size"] <= 0 for row in rows):
        log.warning("report: a run has no positive throughput or world size; no scaling")
        return None
    base_ranks = min(row["world_size"] for row in rows)
    base_rate = max(r["train_samples_per_s"] for r in rows if r["world_size"] == base_ranks)
    for row in rows:
        row["speedup"] = row["train_samples_per_s"] / base_rate
        row["efficiency"] = row["speedup"] / (row["world_size"] / base_ranks)
    return base_ranks, base_rate


def _seconds(value: float) -> str:
    if value < 120:
        return f"{value:.1f} s"
    return f"{value / 60:.1f} min" if value < 7200 else f"{value / 3600:.2f} h"


def _hosts(hosts: list) -> str:
    # A 32-node run would drown the table; summary.json keeps the full list.
    shown = ", ".join(map(str, hosts[:4]))
    return shown + (f", … (+{len(hosts) - 4})" if len(hosts) > 4 else "")


def _runs_table(rows: list[dict], scaling: bool) -> tuple:
    headers = ["Run", "Test accuracy", "Evaluated / test size", "World size", "Nodes", "Hosts",
               "Train samples/s", "Train wall time", "Attempts", "Eval time"]  # fmt: skip
    if scaling:
        headers[7:7] = ["Speedup", "Efficiency"]
    body, best = [], None
    for index, row in enumerate(rows):
        cells = [row["run"] + (" ★ best" if row["best"] else ""), f"{row['accuracy']:.2%}",
                 f"{row['samples_evaluated']} / {row['test_size']}", str(row["world_size"]),
                 str(row["nodes"]), _hosts(row["hosts"]),
                 f"{row['train_samples_per_s']:.1f}", _seconds(row["train_wall_seconds"]),
                 str(row["attempts"]), _seconds(row["eval_seconds"])]  # fmt: skip
        if scaling:
            cells[7:7] = [f"{row['speedup']:.2f}×", f"{row['efficiency']:.1%}"]
        body.append(cells)
        best = index if row["best"] else best
    return ("table", headers, body, best)


def _phase_table(rows: list[dict]) -> tuple:
    body = []
    for row in rows:
        total = row["epoch_seconds"] or 1.0  # a zero total would divide by zero; shares are 0
        shares = [f"{_seconds(row[f'{p}_seconds'])} ({row[f'{p}_seconds'] / total:.0%})"
                  for p in PHASES]  # fmt: skip
        body.append([row["run"], *shares, _seconds(row["epoch_seconds"])])
    return ("table", ["Run", *PHASES, "epochs total"], body, None)


def _class_tables(loaded) -> list[tuple]:
    """One table per distinct class list (runs on the same dataset share a table)."""
    groups: dict[tuple, list] = {}
    for name, _, ev in loaded:
        groups.setdefault(tuple(map(str, ev["class_names"])), []).append((name, ev))
    tables = []
    for classes, members in groups.items():
        body = [[cls, *(f"{ev['per_class_accuracy'][i]:.2%}" for _, ev in members)]
                for i, cls in enumerate(classes)]  # fmt: skip
        tables.append(("table", ["Class", *(name for name, _ in members)], body, None))
    return tables


def _provenance_blocks(loaded) -> list[tuple]:
    blocks = []
    for name, _, ev in loaded:
        prov = ev["provenance"]
        hosts = ", ".join(map(str, prov["hostnames"])) or "unknown"
        blocks += [
            ("h3", name),
            ("p", f"git commit: {prov['git_commit'] or 'unknown (not a git checkout)'}; "
                  f"created: {prov['created']}; hosts: {hosts}"),
            ("table", ["Package", "Version"],
             [[str(k), str(v)] for k, v in sorted(prov["versions"].items())], None),
            ("details", "Resolved config (YAML)",
             yaml.safe_dump(prov["config"], sort_keys=False, allow_unicode=True).rstrip()),
        ]  # fmt: skip
    return blocks


def _document(loaded, rows, figures, generated: str) -> list[tuple]:
    best = next(row["run"] for row in rows if row["best"])
    scaling = rows[0]["speedup"] is not None
    blocks = [("p", f"Generated {generated}. {len(rows)} run(s); best test accuracy: {best}.")]
    blocks += [("h2", "Runs"), _runs_table(rows, scaling)]
    if scaling:
        blocks.append(("p", "Speedup and efficiency are relative to the fastest run at the "
                            "smallest world size (ideal: linear in ranks)."))  # fmt: skip
    blocks += [("h2", "Time per phase (sum over epochs, share of epoch time)"), _phase_table(rows)]
    blocks += [("h2", "Per-class test accuracy"), *_class_tables(loaded)]
    blocks.append(("h2", "Plots"))
    blocks += [("img", caption, f"plots/{key}.png", png) for key, (caption, png) in figures.items()]
    return blocks + [("h2", "Provenance"), *_provenance_blocks(loaded)]


def _md(text) -> str:
    text = html.escape(str(text), quote=False).replace("\n", " ")
    return re.sub(r"([\\`*_\[\]|#])", r"\\\1", text)


def _to_markdown(title: str, blocks: list[tuple]) -> str:
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
                    cells = [f"**{_md(c)}**" if index == best else _md(c) for c in cells]
                    lines.append("| " + " | ".join(cells) + " |")
                out.append("\n".join(lines))
            case ("img", caption, path, _):
                out.append(f"![{_md(caption)}]({path})")
            case ("details", summary, code):
                # A fence longer than any backtick run inside keeps the block closed.
                fence = "`" * max(3, 1 + max(map(len, re.findall(r"`+", code)), default=0))
                out.append(f"<details><summary>{html.escape(summary)}</summary>\n\n"
                           f"{fence}yaml\n{code}\n{fence}\n\n</details>")  # fmt: skip
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


def _html_block(block: tuple) -> str:
    esc = html.escape
    match block:
        case ("h2" | "h3" | "p" as tag, text):
            return f"<{tag}>{esc(str(text))}</{tag}>"
        case ("table", headers, body, best):
            head = "".join(f"<th>{esc(h)}</th>" for h in headers)
            trs = [("<tr class='best'>" if index == best else "<tr>")
                   + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>"
                   for index, cells in enumerate(body)]  # fmt: skip
            return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(trs)}</tbody></table>"
        case ("img", caption, _, png):
            data = base64.b64encode(png).decode("ascii")
            return (f"<figure><img alt='{esc(caption)}' src='data:image/png;base64,{data}'>"
                    f"<figcaption>{esc(caption)}</figcaption></figure>")  # fmt: skip
        case ("details", summary, code):
            return f"<details><summary>{esc(summary)}</summary><pre>{esc(code)}</pre></details>"
    raise ValueError(f"unknown report block {block[0]!r}")


def _to_html(title: str, blocks: list[tuple]) -> str:
    body = "\n".join(_html_block(block) for block in blocks)
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n"
            f"<body><h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n")  # fmt: skip


def _summary_csv(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows({**row, "hosts": " ".join(map(str, row["hosts"]))} for row in rows)
    return buffer.getvalue()


def _write_atomic(path: Path, data: bytes) -> None:
    """Write to a sibling temp file, fsync, rename: readers see the old or the new file whole."""
    # open(..., "xb") rather than mkstemp: mkstemp makes 0600 files, unreadable to the group.
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _summary(loaded, rows, baseline, generated: str) -> dict:
    best = next(row["run"] for row in rows if row["best"])
    return {
        "generated": generated, "best_run": best, "runs": rows,
        "scaling_baseline": {"world_size": baseline[0], "samples_per_s": baseline[1]}
        if baseline else None,
        "per_class_accuracy": {
            name: dict(zip(map(str, ev["class_names"]), ev["per_class_accuracy"], strict=True))
            for name, _, ev in loaded
        },
        "provenance": {name: ev["provenance"] for name, _, ev in loaded},
    }  # fmt: skip


def _write_all(out_dir: Path, figures: dict, texts: dict) -> dict[str, Path]:
    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    paths = {}
    for key, (_, png) in figures.items():
        paths[f"plot_{key}"] = out_dir / "plots" / f"{key}.png"
        _write_atomic(paths[f"plot_{key}"], png)
    if "scaling" not in figures:  # a scaling plot left by an earlier set of runs would mislead
        (out_dir / "plots" / "scaling.png").unlink(missing_ok=True)
    for key, (filename, text) in texts.items():  # the reports last: they reference the rest
        paths[key] = out_dir / filename
        _write_atomic(paths[key], text.encode("utf-8"))
    return paths


def build_report(runs: list[dict], out_dir) -> dict[str, Path]:
    """Write report.md/.html, summary.json/.csv and plots/*.png for runs into out_dir.

    runs: [{"name", "train_metrics", "eval_metrics"}, ...]. Returns {key: path}, with keys
    markdown, html, summary_json, summary_csv and plot_<stem> for every plots/<stem>.png.
    Raises ValueError naming the run and file for a missing, unreadable or incomplete input.
    """
    loaded = _load_runs(runs)
    rows = [_summary_row(name, epochs, ev) for name, epochs, ev in loaded]
    baseline = _add_scaling(rows)
    # Ties on accuracy go to the faster run; the first listed wins a full tie.
    best = max(rows, key=lambda r: (r["accuracy"], r["train_samples_per_s"]))
    for row in rows:
        row["best"] = row is best
    figures = plots.render_figures(loaded, rows, baseline)
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    blocks = _document(loaded, rows, figures, generated)
    summary = _summary(loaded, rows, baseline, generated)
    title = "ddpflow report"
    texts = {
        "summary_json": ("summary.json", json.dumps(summary, indent=2, default=str) + "\n"),
        "summary_csv": ("summary.csv", _summary_csv(rows)),
        "markdown": ("report.md", _to_markdown(title, blocks)),
        "html": ("report.html", _to_html(title, blocks)),
    }
    paths = _write_all(Path(out_dir), figures, texts)
    log.info("report: %d run(s), best %r -> %s", len(rows), best["run"], out_dir)
    return paths
