"""The report's and the trackers' view of the built-in tasks (the hooks of
ddpflow.task.views.ReportView they override): classification's per-class accuracy and
confusion matrix, multilabel's per-label F1 and counts, regression's per-target errors and
predicted-vs-true histogram, a language model's tokens/s and vocabulary. Pure, like views."""

from __future__ import annotations

import logging
from typing import Any

from ddpflow.errors import ReportInputError
from ddpflow.task.views import NUM, OPTIONAL, PlotSpec, ReportView, numbers, overall, shown

log = logging.getLogger("ddpflow.report.inputs")

TEXT_VOCABULARY = 257  # data.source text: 256 bytes and the end-of-document token
SPLIT_WORDS = {"val": "validation", "test": "test", "train": "training"}  # in order


def split_word(split: str) -> str:
    """A split in the report's words: eval.split val is validation, not test."""
    return SPLIT_WORDS.get(split, split)


def _split(ev: dict) -> str:
    return ev.get("split") or "test"  # a record before eval.split scored test


class ClassificationView(ReportView):
    summary_keys = ("per_class_accuracy",)

    def record_fields(self) -> dict:
        return {"accuracy": NUM, "per_class_accuracy": list, "confusion_matrix": list}

    def check_record(self, data: dict, n: int, where: str) -> None:
        matrix = data["confusion_matrix"]
        if len(data["per_class_accuracy"]) != n or len(matrix) != n:
            raise ReportInputError(
                f"{where}: class_names, per_class_accuracy, confusion_matrix differ"
            )
        if any(not isinstance(row, list) or len(row) != n for row in matrix):
            raise ReportInputError(f"{where}: confusion_matrix is not {n}x{n}")
        if any(not isinstance(c, int) or isinstance(c, bool) for row in matrix for c in row):
            raise ReportInputError(f"{where}: confusion_matrix holds a value that is not a count")
        # None: a class with no sample in the evaluated split (shown as n/a)
        found = [a for a in data["per_class_accuracy"] if a is not None]
        if any(isinstance(a, bool) or not isinstance(a, NUM) for a in found):
            raise ReportInputError(
                f"{where}: per_class_accuracy holds a value that is not a number"
            )
        # Padded samplers double-count (README: Exact evaluation): loud, not fatal.
        total = sum(sum(row) for row in matrix)
        if not data["samples_evaluated"] == data["test_size"] == total:
            log.warning("%s: %d samples evaluated, test size %d, confusion total %d", where,
                        data["samples_evaluated"], data["test_size"], total)  # fmt: skip

    def summary_record(self, ev: dict) -> dict[str, Any]:
        names = map(str, ev["class_names"])
        return {"per_class_accuracy": dict(zip(names, ev["per_class_accuracy"], strict=True))}

    def report_section(self, members: list, label: str, own_label: str, focus, note) -> list:
        """Its own runs' split in the heading (label, the report's, may be a sweep's)."""
        shown = [m for m in members if focus is None or m[0] in focus]
        splits = list(dict.fromkeys(_split(ev) for _, _, ev in shown))
        word = split_word(splits[0]) if len(splits) == 1 else "evaluation"
        return [("h2", f"Per-class {word} accuracy"), *note, *class_tables(members, focus)]

    def evaluation_plots(self, name: str, ev: dict) -> list[PlotSpec]:
        args = (name, ev["confusion_matrix"], ev["class_names"], ev["accuracy"])
        caption = f"Confusion matrix: {name} ({split_word(_split(ev))} split)"
        return [PlotSpec("confusion", "confusion_matrix", caption, (*args, _split(ev)))]

    def tracker_files(self, ev: dict) -> dict[str, Any]:
        matrix = {"class_names": ev["class_names"], "confusion_matrix": ev["confusion_matrix"]}
        return {"confusion_matrix.json": matrix}


_APART = (
    "Runs evaluated on different splits (eval.split) are not compared: each split has its "
    "own table."
)


def class_tables(loaded, focus=None) -> list[tuple]:
    """One table per evaluated split and class list (runs on the same dataset and split share
    a table), a column per run: with many runs, only the focus runs' (summary.json has every
    run's). Runs of several splits: a note, then each split's tables under its own heading,
    validation first (a validation figure is never set beside a test one)."""
    by_split: dict[str, dict[tuple, list]] = {}
    for name, _, ev in loaded:
        if focus is not None and name not in focus:
            continue
        classes = tuple(map(str, ev["class_names"]))
        by_split.setdefault(_split(ev), {}).setdefault(classes, []).append((name, ev))
    order = sorted(by_split, key=lambda split: [*SPLIT_WORDS, split].index(split))
    tables: list[tuple] = [("p", _APART)] if len(order) > 1 else []
    for split in order:
        if len(order) > 1:
            tables.append(("h3", f"Per-class {split_word(split)} accuracy"))
        for classes, members in by_split[split].items():
            body = [[c, *(_class_cell(ev, i) for _, ev in members)] for i, c in enumerate(classes)]
            tables.append(("table", ["Class", *(name for name, _ in members)], body, None))
    return tables


def _class_cell(ev: dict, index: int) -> str:
    """A class's accuracy and support; a class with no sample in the split: n/a."""
    accuracy, support = ev["per_class_accuracy"][index], sum(ev["confusion_matrix"][index])
    if accuracy is None or not support:
        return "n/a (0 samples)"
    return f"{accuracy:.2%} ({support})"


_COUNTS = ("true_positives", "false_positives", "false_negatives")


class MultilabelView(ReportView):
    names_word = "label"
    summary_keys = ("per_label",)

    def epoch_fields(self) -> dict:
        return dict.fromkeys(("val_f1_micro", "val_f1_macro", "val_exact_match"), NUM)

    def record_fields(self) -> dict:
        return {
            **dict.fromkeys(("exact_match", "f1_micro", "f1_macro"), NUM),
            **dict.fromkeys(("per_label_f1", *_COUNTS), list),
        }

    def check_record(self, data: dict, n: int, where: str) -> None:
        numbers(data["per_label_f1"], n, "per_label_f1", where)
        for key in _COUNTS:
            numbers(data[key], n, key, where, int)
        super().check_record(data, n, where)

    def summary_record(self, ev: dict) -> dict[str, Any]:
        return {
            "per_label": {
                label: {
                    "f1": ev["per_label_f1"][i],
                    **{key: ev[key][i] for key in _COUNTS},
                    "support": ev["true_positives"][i] + ev["false_negatives"][i],
                }
                for i, label in enumerate(map(str, ev["class_names"]))
            }
        }

    def report_section(self, members: list, label: str, own_label: str, focus, note) -> list:
        heading = ("h2", f"Per-label {own_label} F1 and counts")
        return [heading, *note, *_label_tables(members, focus, own_label == "evaluation")]


def _run_heading(name: str, ev: dict, mixed: bool) -> tuple:
    """A run's table heading: its name, with its split where the section's runs differ."""
    return ("h3", f"{name} ({split_word(_split(ev))} split)" if mixed else name)


def _label_tables(loaded, focus=None, mixed=False) -> list[tuple]:
    """Each multilabel run's labels: F1, true and false positives, false negatives and the
    support (true positives + false negatives: the samples that carry the label); mixed:
    its runs were evaluated on several splits (each heading names its run's)."""
    out = []
    headers = ["Label", "F1", "True positives", "False positives", "False negatives", "Support"]
    for name, _, ev in loaded:
        if focus is not None and name not in focus:
            continue
        body = []
        for i, label in enumerate(ev["class_names"]):
            tp, fp, fn = (ev[k][i] for k in _COUNTS)
            f1 = ev["per_label_f1"][i]
            f1 = "n/a (never present, never predicted)" if f1 is None else f"{f1:.4f}"
            body.append([str(label), f1, str(tp), str(fp), str(fn), str(tp + fn)])
        said = overall(ev, ("exact_match", "f1_micro", "f1_macro"))
        if isinstance(ev.get("exact_matches"), int):
            said += f" ({ev['exact_matches']} of {ev['samples_evaluated']} samples exact)"
        if isinstance(ev.get("threshold"), int | float):
            said += f"; a label is predicted at probability ≥ {ev['threshold']:g}"
        out += [_run_heading(name, ev, mixed), ("p", said + "."), ("table", headers, body, None)]
    return out


_ERRORS = ("mse", "mae", "r2")
_TARGET_NOTE = (
    "MSE and MAE are in the targets' units (MSE squared); R² is 1 - MSE / the variance of "
    "the evaluated split's targets: n/a where that target is constant."
)


class RegressionView(ReportView):
    names_word = "target"
    summary_keys = ("per_target",)

    def epoch_fields(self) -> dict:
        return {"val_mse": NUM, "val_mae": NUM, "val_r2": OPTIONAL}

    def record_fields(self) -> dict:
        return {
            "mse": NUM,
            "mae": NUM,
            "r2": OPTIONAL,
            "per_target": dict.fromkeys(_ERRORS, list),
            "predicted_vs_true": {"bins": int, "range": list, "counts": list},
        }

    def check_record(self, data: dict, n: int, where: str) -> None:
        for key in _ERRORS:
            values = data["per_target"][key]
            numbers(values, n, f"per_target.{key}", where, OPTIONAL if key == "r2" else NUM)
        _check_histogram(data["predicted_vs_true"], n, where)
        super().check_record(data, n, where)

    def summary_record(self, ev: dict) -> dict[str, Any]:
        errors = ev["per_target"]
        return {
            "per_target": {
                target: {key: errors[key][i] for key in _ERRORS}
                for i, target in enumerate(map(str, ev["class_names"]))
            }
        }

    def report_section(self, members: list, label: str, own_label: str, focus, note) -> list:
        heading = ("h2", f"Per-target {own_label} errors")
        tables = _target_tables(members, focus, own_label == "evaluation")
        return [heading, *note, *tables, ("p", _TARGET_NOTE)]

    def evaluation_plots(self, name: str, ev: dict) -> list[PlotSpec]:
        histogram = ev.get("predicted_vs_true") or {}
        if not histogram.get("counts"):
            return []
        split = _split(ev)
        caption = (
            f"Predicted against true values: {name}, {split_word(split)} split (the red "
            "diagonal: predicted = true)"
        )
        args = (name, histogram, ev["class_names"], split)
        return [PlotSpec("predicted_vs_true", "predicted_vs_true", caption, args)]


def _check_histogram(histogram: dict, n: int, where: str) -> None:
    bins, ranges, counts = histogram["bins"], histogram["range"], histogram["counts"]
    if bins < 1 or len(ranges) != len(counts) or len(counts) > n:
        raise ReportInputError(
            f"{where}: predicted_vs_true has {bins} bins, {len(ranges)} ranges and "
            f"{len(counts)} histograms for {n} targets"
        )
    for span in ranges:
        if (
            not isinstance(span, list)
            or len(span) != 2
            or any(isinstance(v, bool) or not isinstance(v, NUM) for v in span)
            or not span[0] < span[1]
        ):
            raise ReportInputError(f"{where}: predicted_vs_true.range holds {span!r}: no [lo, hi]")
    for grid in counts:
        if not isinstance(grid, list) or len(grid) != bins:
            raise ReportInputError(f"{where}: predicted_vs_true.counts is not {bins}x{bins}")
        if any(not isinstance(row, list) or len(row) != bins for row in grid):
            raise ReportInputError(f"{where}: predicted_vs_true.counts is not {bins}x{bins}")
        for row in grid:
            numbers(row, bins, "predicted_vs_true.counts", where, int)


def _target_tables(loaded, focus=None, mixed=False) -> list[tuple]:
    """Each regression run's targets: MSE, MAE and R² in the targets' own units; mixed: its
    runs were evaluated on several splits (each heading names its run's)."""
    out = []
    for name, _, ev in loaded:
        if focus is not None and name not in focus:
            continue
        errors = ev["per_target"]
        body = [
            [str(target), *(shown(k, errors[k][i]) for k in _ERRORS)]
            for i, target in enumerate(ev["class_names"])
        ]
        said = overall(ev, _ERRORS)
        if len(body) > 1:
            said += " (the mean over the targets)"
        if isinstance(ev.get("loss_name"), str):
            said += f"; trained with {ev['loss_name']} loss"
        table = ("table", ["Target", "MSE", "MAE", "R²"], body, None)
        out += [_run_heading(name, ev, mixed), ("p", said + "."), table]
    return out


class LanguageModelView(ReportView):
    names_word = None  # its outputs are a vocabulary's ids
    train_record_key = "language_model"

    def epoch_fields(self) -> dict:
        return {"val_perplexity": NUM, "val_token_accuracy": NUM}

    def record_fields(self) -> dict:
        return {"perplexity": NUM, "token_accuracy": NUM, "tokens": int}

    def summary_fields(self, ev: dict) -> dict:
        # a sample is a block: tokens/s is the figure that compares
        record = ev["train"].get(self.train_record_key) or {}
        return {"train_tokens_per_s": record.get("tokens_per_s")}

    def data_read(self, train: dict) -> str:
        return ", tokens memory-mapped"  # always (ddpflow.training.rankdata)

    def compared_by(self, ev: dict) -> int | None:
        """The vocabulary: runs on other tokenizers are not compared."""
        lm = ev.get("train", {}).get(self.train_record_key)
        if isinstance(lm, dict) and isinstance(lm.get("vocab_size"), int):
            return lm["vocab_size"]
        data = ev.get("provenance", {}).get("config", {}).get("data") or {}
        if data.get("source") == "text":
            return TEXT_VOCABULARY
        vocab = data.get("vocab_size")
        return vocab if isinstance(vocab, int) else None
