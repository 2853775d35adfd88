"""Report figures: every function builds one figure and returns it as PNG bytes.

report.py writes the bytes atomically and render.py embeds the same bytes in report.html,
so a figure is rendered once. Figures use matplotlib's object API on an explicit Agg canvas
instead of pyplot: rendering is headless, the caller's backend is never switched (a notebook
that calls build_report keeps its own), and nothing is registered in pyplot's figure list, so
there is no figure left open to leak between calls.
"""

from __future__ import annotations

import functools
import io
import logging
import re
import uuid
from collections.abc import Callable

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FormatStrFormatter, FuncFormatter, MaxNLocator, ScalarFormatter

from ddpflow.report import metrics
from ddpflow.task import Selection, record_task
from ddpflow.task.views import PlotSpec
from ddpflow.words import counted

__all__ = [
    "plot_confusion",
    "plot_per_epoch",
    "plot_predicted_vs_true",
    "predicted_vs_true_figure",
    "plot_scaling",
    "plot_throughput",
    "render_figures",
    "safe_name",
    "text_label",
]

log = logging.getLogger(__name__)


def text_label(text: str) -> str:
    """Make a run or class name safe as matplotlib text.

    "$...$" would be parsed as mathtext (and an odd "$" raises), and legend entries whose
    label starts with "_" are silently dropped.
    """
    text = str(text).replace("$", r"\$")
    return " " + text if text.startswith("_") else text


def new_figure(width: float = 7.0, height: float = 4.2) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)  # Agg for this figure only: no global backend switch
    return fig


def png_bytes(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _spans_decades(values) -> bool:
    """A log axis reads a loss better once it spans a factor of 10 (a first epoch at 2.3 and
    a last at 0.01 flatten every later epoch onto the floor of a linear axis)."""
    values = [v for v in values if np.isfinite(v)]
    return bool(values) and min(values) > 0 and max(values) / min(values) >= 10


def _minor_log_label(value: float, _position) -> str:
    """Between the decades of a log axis, label 2x and 5x only (0.2, 0.5): every minor
    tick labelled would crowd the axis."""
    if value <= 0:
        return ""
    lead = round(value / 10 ** np.floor(np.log10(value)))
    return f"{value:g}" if lead in (2, 5) else ""


def plot_per_epoch(
    series: dict[str, list[tuple[int, float | None]]], ylabel: str, title: str, log_if_wide=False,
    focus=None,
) -> bytes:  # fmt: skip
    """One line per run: series maps run name -> [(epoch, value), ...] sorted by epoch.
    log_if_wide: a logarithmic y axis where the values span a factor of 10 or more.
    focus: the runs drawn in colour and named (many runs: the best); the rest in grey."""
    return png_bytes(per_epoch_figure(series, ylabel, title, log_if_wide, focus))


def per_epoch_figure(series, ylabel: str, title: str, log_if_wide=False, focus=None) -> Figure:
    fig = new_figure()
    ax = fig.add_subplot()
    if focus is not None:  # a legend of 100 runs fills the figure: name the best only
        for name in [n for n in series if n not in focus]:
            epochs, values = zip(*series[name], strict=True)
            ax.plot(epochs, values, color="0.8", lw=0.7, alpha=0.6)
        ax.plot([], [], color="0.8", label=f"{len(series) - len(focus)} other runs")
    for name in series if focus is None else [n for n in focus if n in series]:
        epochs, values = zip(*series[name], strict=True)
        ax.plot(epochs, values, marker="o", markersize=3, label=text_label(name))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    if log_if_wide and _spans_decades([v for points in series.values() for _, v in points]):
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))  # 0.1, not 10^-1
        ax.yaxis.set_minor_formatter(FuncFormatter(_minor_log_label))
        ylabel += " (log scale)"
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    return fig


def plot_throughput(names: list[str], samples_per_s: list[float], unit: str = "samples") -> bytes:
    """Training throughput per run: horizontal bars, one fixed-height row per run, so that
    one run reads as one labelled bar rather than a slab filling the figure; unit: what a
    rate counts (tokens for language models)."""
    fig = new_figure(7.0, 1.3 + (0.45 if len(names) <= 20 else 0.2) * len(names))
    ax = fig.add_subplot()
    rows = range(len(names))
    bars = ax.barh(rows, samples_per_s, height=0.6, color="tab:blue")
    ax.bar_label(bars, fmt=f"%.0f {unit}/s", fontsize="small", padding=3)
    ax.set_yticks(rows, [text_label(n) for n in names])
    ax.set_ylim(len(names) - 0.4, -0.6)  # the first run on top, as in the tables
    ax.set_xlim(0, max(samples_per_s, default=1) * 1.25 or 1)  # room for the labels
    ax.set_xlabel(f"train {unit}/s (whole run, all ranks)")
    ax.set_title("Training throughput")
    ax.grid(axis="x", alpha=0.3)
    return png_bytes(fig)


def _rates(rows: list[dict]) -> tuple[str, list[float]]:
    """What the per-run throughput plot counts: tokens where every run is a language model
    (a sample is a block of tokens; one without a recorded rate: 0), else samples."""
    if rows and all("train_tokens_per_s" in row for row in rows):
        return "tokens", [row["train_tokens_per_s"] or 0.0 for row in rows]
    return "samples", [row["train_samples_per_s"] for row in rows]


def plot_scaling(points: list[tuple[str, int, float]], base_ranks: int, base_rate: float) -> bytes:
    """Throughput against ranks with the ideal linear line from the baseline run.

    points: (run name, world size, samples/s). Log2 axes make linear scaling a straight line
    and keep 1 to 64 ranks readable.
    """
    fig = new_figure()
    ax = fig.add_subplot()
    sizes = sorted({ranks for _, ranks, _ in points})
    ideal = [base_rate * ranks / base_ranks for ranks in sizes]
    ax.plot(
        sizes, ideal, "--", color="gray", label=f"ideal: linear from {counted(base_ranks, 'rank')}"
    )
    best = [max(rate for _, r, rate in points if r == ranks) for ranks in sizes]
    ax.plot(sizes, best, "o-", color="tab:blue", label="measured")
    for name, ranks, rate in points:
        ax.annotate(text_label(name), (ranks, rate), textcoords="offset points", xytext=(4, -10))
        ax.plot([ranks], [rate], "o", color="tab:blue")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.yaxis.set_major_formatter(ScalarFormatter())  # 2048, not 2^11
    ax.set_xlabel("ranks (world size)")
    ax.set_ylabel("train samples/s")
    ax.set_title("Scaling")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    return png_bytes(fig)


def plot_confusion(
    name: str, matrix: list[list[int]], classes: list[str], accuracy: float, split: str = "test"
) -> bytes:
    """Confusion matrix coloured by fraction of the true class (rows), annotated with counts."""
    counts = np.asarray(matrix, dtype=np.int64)
    rates = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    size = min(3.5 + 0.45 * len(classes), 12.0)
    fig = new_figure(size + 1.2, size)
    ax = fig.add_subplot()
    image = ax.imshow(rates, cmap="Blues", vmin=0.0, vmax=1.0)
    ticks = range(len(classes))
    labels = [text_label(c) for c in classes]
    ax.set_xticks(ticks, labels, rotation=45, ha="right")
    ax.set_yticks(ticks, labels)
    if len(classes) <= 20:  # beyond that the numbers are unreadable; the colours still tell
        for (row, col), count in np.ndenumerate(counts):
            colour = "white" if rates[row, col] > 0.5 else "black"
            ax.text(col, row, str(count), ha="center", va="center", color=colour, fontsize=8)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    label = {"val": "validation", "train": "training"}.get(split, split)
    ax.set_title(f"{text_label(name)}: {label} accuracy {accuracy:.2%}")
    fig.colorbar(image, ax=ax, label="fraction of true class")
    return png_bytes(fig)


def plot_predicted_vs_true(
    name: str, histogram: dict, targets: list[str], split: str = "test"
) -> bytes:
    return png_bytes(predicted_vs_true_figure(name, histogram, targets, split))


def predicted_vs_true_figure(
    name: str, histogram: dict, targets: list[str], split: str = "test"
) -> Figure:
    """A regression run's predicted against true values: one panel per plotted target, the
    evaluation's 2-D histogram (histogram["counts"][t][i][j]: samples whose true value fell
    in bin i and prediction in bin j, over histogram["range"][t] in the target's units; a
    value beyond the range counts in the edge bin) on a log colour scale, with the diagonal
    where predicted = true."""
    grids, spans = histogram["counts"], histogram["range"]
    if not grids:
        raise ValueError("no target was binned")
    fig = new_figure(1.2 + 3.6 * len(grids), 4.0)
    axes = fig.subplots(1, len(grids), squeeze=False)[0]
    peak = max(max(max(row) for row in grid) for grid in grids)
    norm = LogNorm(vmin=1, vmax=max(peak, 10))
    for ax, grid, (low, high), target in zip(axes, grids, spans, targets, strict=False):
        counts = np.asarray(grid, dtype=float).T  # x: true (rows), y: predicted (columns)
        image = ax.imshow(
            np.ma.masked_less(counts, 1),
            origin="lower",
            extent=(low, high, low, high),
            cmap="viridis",
            norm=norm,
            interpolation="nearest",
            aspect="equal",
        )
        ax.plot([low, high], [low, high], "--", color="tab:red", lw=1, label="predicted = true")
        ax.set_xlim(low, high)
        ax.set_ylim(low, high)
        ax.set_xlabel(f"true {text_label(target)}")
        ax.set_ylabel(f"predicted {text_label(target)}")
        ax.set_title(text_label(target), fontsize="medium")
        ax.grid(alpha=0.2)
    axes[0].legend(fontsize="small", loc="upper left")
    fig.colorbar(image, ax=list(axes), label="samples (log scale)")
    label = {"val": "validation", "train": "training"}.get(split, split)
    fig.suptitle(f"{text_label(name)}: predicted against true ({label} split)")
    return fig


def safe_name(name: str) -> str:
    """A file-name-safe form of a run name; a hash suffix keeps altered names distinct."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    return safe if safe == name else f"{safe}-{uuid.uuid5(uuid.NAMESPACE_URL, name).hex[:8]}"


def render_figures(loaded, rows: list[dict], baseline, focus=None) -> dict[str, tuple]:
    """All report figures as key -> (caption, PNG bytes); the key is the file stem in plots/.

    loaded: [(run name, per-epoch records, eval metrics)]; rows: report summary rows;
    baseline: (ranks, samples/s, run names) of the plotted scaling study, or None; focus:
    with many runs, the best ones (by validation accuracy), named in the per-epoch plots and
    the only ones with a confusion matrix or a predicted-vs-true plot (None: every run).
    Each task's selection metric has a per-epoch plot of its runs (val_accuracy,
    val_f1_micro, val_mse). A figure its numbers cannot
    draw (an infinite throughput, say) is (caption saying so and why, None): the report
    says so in its place and is written.
    """
    figures = {}
    for key, caption, draw in _figure_plan(loaded, rows, baseline, focus):
        try:
            figures[key] = (caption, draw())
        except Exception as exc:  # noqa: BLE001 - one figure never costs the report
            log.warning("report: plot %s not drawn: %s: %s", key, type(exc).__name__, exc)
            figures[key] = (f"{caption}: not drawn ({type(exc).__name__}: {exc})", None)
    return figures


def _figure_plan(loaded, rows: list[dict], baseline, focus) -> list[tuple]:
    """[(key, caption, a function drawing the PNG)] of every figure of the report."""
    keys = ("train_loss", "val_loss", "lr", "samples_per_s")
    per_epoch = {key: {name: [(e["epoch"], e[key]) for e in epochs] for name, epochs, _ in loaded}
                 for key in keys}  # fmt: skip
    # each selection metric: its selection and its runs' series
    chosen: dict[str, tuple[Selection, dict[str, list[tuple[int, float]]]]] = {}
    for name, history, ev in loaded:
        selection = metrics.selection(ev)
        chosen.setdefault(selection.metric, (selection, {}))[1][name] = [
            (e["epoch"], e[selection.metric]) for e in history
        ]
    per_epoch.update({metric: series for metric, (_, series) in chosen.items()})

    def epochs(key, ylabel, title, log_if_wide=False):
        shown = focus if focus is None else [n for n in focus if n in per_epoch[key]]
        return lambda: plot_per_epoch(per_epoch[key], ylabel, title, log_if_wide, shown)

    names, (unit, rates) = [row["run"] for row in rows], _rates(rows)
    plan = [
        ("loss", "Training loss per epoch", epochs("train_loss", "train loss", "Training loss",
                                                   True)),
        ("val_loss", "Validation loss per epoch", epochs("val_loss", "validation loss",
                                                         "Validation loss", True)),
        *_selection_plans(chosen, epochs),
        ("lr", "Learning rate at the end of each epoch (warmup, then the schedule)",
         epochs("lr", "learning rate", "Learning rate")),
        ("throughput_epochs", "Training throughput per epoch (all ranks)", epochs(
            "samples_per_s", "train samples/s", "Throughput per epoch")),
        ("throughput", "Training throughput per run",
         lambda: plot_throughput(names, rates, unit)),
    ]  # fmt: skip
    if baseline:
        base_ranks, base_rate, runs = baseline
        points = [(r["run"], r["world_size"], r["train_samples_per_s"]) for r in rows
                  if r["run"] in runs]  # fmt: skip
        caption = f"Throughput against ranks ({', '.join(runs)})"
        plan.append(("scaling", caption, lambda: plot_scaling(points, base_ranks, base_rate)))
    for name, _, ev in loaded:
        if focus is None or name in focus:
            plan += _evaluation_plans(name, ev)
    return plan


def _selection_plans(chosen: dict, epochs) -> list[tuple]:
    """A per-epoch plot of each selection metric (classification's: val_accuracy)."""
    plans = []
    for metric, (selection, _) in chosen.items():
        title = selection.label[:1].upper() + selection.label[1:]
        caption = f"{title} per epoch{metrics.direction(selection)}"
        wide = not selection.higher_is_better  # an error spanning decades: a log axis
        plans.append((metric, caption, epochs(metric, selection.label, title, wide)))
    return plans


def _evaluation_plans(name: str, ev: dict) -> list[tuple]:
    """A run's evaluation figures, as its task says (Task.evaluation_plots: classification's
    confusion matrix, regression's predicted against true values)."""
    return [
        (f"{spec.slug}_{safe_name(name)}", spec.caption, _drawn(spec))
        for spec in record_task(ev).evaluation_plots(name, ev)
    ]


def _drawn(spec: PlotSpec):
    return functools.partial(DRAWERS[spec.kind], *spec.args)


# the plots a task's evaluation_plots names (PlotSpec.kind) -> the function that draws them
DRAWERS: dict[str, Callable[..., bytes]] = {
    "confusion_matrix": plot_confusion,
    "predicted_vs_true": plot_predicted_vs_true,
}
