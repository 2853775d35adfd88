"""The sweep view's figures (ddpflow.report.sweep): the swept keys against validation accuracy
(another task: its selection metric, such as validation MSE, lower better).

Each axis is one of three kinds: numeric (linear), numeric drawn log-uniform (a log axis:
1e-5 to 1e-2 read evenly, as they were drawn) and categorical (any key with a value that is
no number: its distinct values at evenly spaced positions, labelled). Runs without a result
(failed, unfinished) have no validation figure and are not drawn; pruned runs are drawn
dashed / as crosses, the selected run in red on top.

    figures = render(view)   # {"sweep_parallel": (caption, png), "sweep_<key>": ...}
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib import colormaps
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure

from ddpflow.report import metrics
from ddpflow.report.plots import new_figure, png_bytes, safe_name, text_label
from ddpflow.task import Selection, selection_of
from ddpflow.words import counted

__all__ = ["key_figure", "parallel_figure", "plot_key", "plot_parallel", "render"]

_PICK = "tab:red"
ACCURACY: Selection = selection_of(None)  # classification's: validation accuracy, higher better


def _numeric(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _axis(values: list, log: bool) -> dict:
    """How one key's values map to an axis: kind, the position of each value (None where a
    run lacks the key) and the distinct categories of a categorical key."""
    present = [v for v in values if v is not None]
    if present and all(_numeric(v) for v in present):
        if log and min(present) > 0:
            return {"kind": "log", "pos": [None if v is None else float(v) for v in values]}
        return {"kind": "linear", "pos": [None if v is None else float(v) for v in values]}
    categories = sorted({str(v) for v in present}, key=_natural)
    index = {c: i for i, c in enumerate(categories)}
    return {"kind": "categorical", "categories": categories,
            "pos": [None if v is None else float(index[str(v)]) for v in values]}  # fmt: skip


def _natural(text: str):
    """'2' before '10': categories that are numbers mixed with words sort as numbers."""
    try:
        return (0, float(text), text)
    except ValueError:
        return (1, 0.0, text)


def _unit(axis: dict) -> tuple[list[float], list[tuple[float, str]]]:
    """Positions scaled to 0..1 (NaN where missing) and (position, label) ticks."""
    pos = np.array([np.nan if p is None else p for p in axis["pos"]], dtype=float)
    if axis["kind"] == "categorical":
        n = len(axis["categories"])
        at = [i / (n - 1) if n > 1 else 0.5 for i in range(n)]
        ticks = [(y, text_label(c)) for y, c in zip(at, axis["categories"], strict=True)]
        return list(pos / (n - 1) if n > 1 else np.where(np.isnan(pos), np.nan, 0.5)), ticks
    if np.isnan(pos).all():  # only runs without a result had the key
        return list(pos), []
    raw = np.log10(pos) if axis["kind"] == "log" else pos
    lo, hi = np.nanmin(raw), np.nanmax(raw)
    span = hi - lo or 1.0
    distinct = sorted(set(pos[~np.isnan(pos)]))
    shown = distinct if len(distinct) <= 6 else None
    if shown is None:  # evenly spaced ticks (in log space for a log key)
        steps = np.linspace(lo, hi, 5)
        shown = list(10**steps) if axis["kind"] == "log" else list(steps)
    tick_at = (lambda v: (np.log10(v) - lo) / span) if axis["kind"] == "log" else (
        lambda v: (v - lo) / span)  # fmt: skip
    unit = (raw - lo) / span if hi > lo else np.where(np.isnan(raw), np.nan, 0.5)
    return list(unit), [(tick_at(v) if hi > lo else 0.5, f"{v:.3g}") for v in shown]


def plot_parallel(
    keys: list[str], log_keys: list[str], points: list[dict], pick, chosen: Selection = ACCURACY
) -> bytes:
    return png_bytes(parallel_figure(keys, log_keys, points, pick, chosen))


def parallel_figure(
    keys: list[str], log_keys: list[str], points: list[dict], pick, chosen: Selection = ACCURACY
) -> Figure:
    """Parallel coordinates: one vertical axis per swept key and one for the selection metric
    (chosen: validation accuracy unless another task's), one line per run coloured by it
    (the best bright, drawn last, on top, whichever the metric's direction)."""
    accuracy = [p[chosen.metric] for p in points]
    columns = [_unit(_axis([p["values"].get(k) for p in points], k in log_keys)) for k in keys]
    columns.append(_unit({"kind": "linear", "pos": accuracy}))
    names = [*keys, chosen.label]
    fig = new_figure(max(7.0, 1.9 * len(names)), 4.8)
    ax = fig.add_subplot()
    norm = Normalize(min(accuracy), max(accuracy) if max(accuracy) > min(accuracy) else 1.0)
    cmap = colormaps["viridis" if chosen.higher_is_better else "viridis_r"]
    alpha = 0.9 if len(points) <= 20 else max(0.25, 20 / len(points))
    drawn = sorted(
        range(len(points)), key=lambda i: (points[i]["run"] == pick, -chosen.key(accuracy[i]))
    )
    for i in drawn:
        ys = [column[0][i] for column in columns]
        if points[i]["run"] == pick:
            ax.plot(range(len(names)), ys, color=_PICK, lw=2.6, zorder=3,
                    label=f"selected: {text_label(pick)}")  # fmt: skip
        else:
            ax.plot(range(len(names)), ys, color=cmap(norm(accuracy[i])), lw=1.1, alpha=alpha,
                    ls="--" if points[i]["status"] == "pruned" else "-")  # fmt: skip
    for x, (_, ticks) in enumerate(columns):
        ax.axvline(x, color="black", lw=0.8)
        for y, label in ticks:
            ax.text(x + 0.03, y, label, fontsize=7, va="center", ha="left",
                    bbox={"fc": "white", "ec": "none", "alpha": 0.7, "pad": 0.5})  # fmt: skip
    labels = [_wrap(text_label(n)) + ("\n(log)" if n in log_keys else "") for n in names]
    ax.set_xticks(range(len(names)), labels, fontsize="small")
    ax.set_xlim(-0.1, len(names) - 0.6)
    ax.set_ylim(-0.05, 1.05)
    ax.set_yticks([])
    ax.set_title(f"Swept keys against {chosen.label} ({counted(len(points), 'run')})")
    fig.colorbar(ScalarMappable(norm, cmap), ax=ax, label=chosen.label, pad=0.01)
    if pick is not None:
        fig.legend(fontsize="small", loc="outside lower center")
    return fig


def _wrap(key: str, width: int = 16) -> str:
    """A dotted key over lines at its dots: side by side, long keys ran into each other."""
    lines = [""]
    for part in key.split("."):
        if lines[-1] and len(lines[-1]) + len(part) >= width:
            lines[-1] += "."
            lines.append(part)
        else:
            lines[-1] += ("." if lines[-1] else "") + part
    return "\n".join(lines)


def plot_key(
    key: str, log: bool, points: list[dict], pick: str | None, chosen: Selection = ACCURACY
) -> bytes:
    return png_bytes(key_figure(key, log, points, pick, chosen))


def key_figure(
    key: str, log: bool, points: list[dict], pick: str | None, chosen: Selection = ACCURACY
) -> Figure:
    """The selection metric (validation accuracy unless chosen is another task's) against
    one key's value: a dot per run (a cross if pruned), the best run per value joined by a
    line, the selected run in red."""
    axis = _axis([p["values"].get(key) for p in points], log)
    fig = new_figure(6.4, 3.8)
    ax = fig.add_subplot()
    xs = np.array([np.nan if p is None else p for p in axis["pos"]], dtype=float)
    ys = np.array([p[chosen.metric] for p in points], dtype=float)
    if axis["kind"] == "categorical":  # spread equal values a little, deterministically
        xs = xs + (((np.arange(len(xs)) * 0.618) % 1.0) - 0.5) * 0.25
    pruned = np.array([p["status"] == "pruned" for p in points])
    ax.scatter(xs[~pruned], ys[~pruned], s=22, alpha=0.8, label="finished")
    if pruned.any():
        ax.scatter(xs[pruned], ys[pruned], s=26, marker="x", color="gray", label="pruned")
    _best_per_value(ax, axis, ys, chosen.higher_is_better)
    if pick is not None:
        at = [i for i, p in enumerate(points) if p["run"] == pick]
        ax.scatter(xs[at], ys[at], s=160, marker="*", color=_PICK, zorder=3,
                   label=f"selected: {text_label(pick)}")  # fmt: skip
    if axis["kind"] == "log":
        ax.set_xscale("log")
    if axis["kind"] == "categorical":
        ax.set_xticks(range(len(axis["categories"])), map(text_label, axis["categories"]),
                      rotation=30 if len(axis["categories"]) > 4 else 0, ha="right")  # fmt: skip
    ax.set_xlabel(text_label(key) + (" (log scale: drawn log-uniform)" if log else ""))
    ax.set_ylabel(chosen.label + metrics.direction(chosen))
    ax.set_title(f"{_capital(chosen.label)} against {text_label(key)}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    return fig


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _best_per_value(ax, axis: dict, ys, higher: bool = True) -> None:
    """A grid's few values: the best run at each, joined, shows the trend through the noise."""
    xs = np.array([np.nan if p is None else p for p in axis["pos"]], dtype=float)
    distinct = sorted(set(xs[~np.isnan(xs)]))
    if not 2 <= len(distinct) <= 20:
        return
    best_of = np.nanmax if higher else np.nanmin
    best = [best_of(np.where(xs == x, ys, np.nan)) for x in distinct]
    if axis["kind"] == "categorical":  # no line between categories: they have no order
        ax.scatter(distinct, best, marker="_", s=500, color="gray", label="best at each value")
    else:
        ax.plot(distinct, best, color="gray", lw=1, alpha=0.7, label="best at each value")


def render(view: dict) -> dict[str, tuple[str, bytes]]:
    """The sweep figures as {file stem: (caption, PNG bytes)}; none if no run finished."""
    chosen = view.get("selection") or ACCURACY
    points = [row for row in view["rows"] if row.get(chosen.metric) is not None]
    if not points:
        return {}
    pick = next((row["run"] for row in points if row["rank"] == 1), None)
    keys, log_keys, label = view["keys"], view["log_keys"], chosen.label
    figures = {"sweep_parallel": (
        f"Parallel coordinates: each line a run, across its swept values to its {label}"
        f"{metrics.direction(chosen)} (colour: {label}; dashed: pruned; red: the selected run)",
        plot_parallel(keys, log_keys, points, pick, chosen))}  # fmt: skip
    for key in keys:
        figures[f"sweep_{safe_name(key)}"] = (
            f"{_capital(label)} against {key}" + (" (log axis)" if key in log_keys else ""),
            plot_key(key, key in log_keys, points, pick, chosen),
        )
    return figures
