"""The task tables of the report: each classification run's per-class accuracy, each multilabel
run's per-label F1 and counts, each regression run's per-target errors, as render.py's
format-neutral blocks; split_label, what the figures were measured on; and the table of
each run's model and exports (Link: a cell that links a file); each run's provenance.
Pure, like render.py.

    blocks = task_sections(loaded, rows, focus, note)  # per-label and per-target
    blocks = class_tables(classified, focus)  # one per class list
"""

from __future__ import annotations

from typing import NamedTuple

import yaml

from ddpflow.report import metrics
from ddpflow.text import counted

__all__ = [
    "class_tables",
    "dataset_line",
    "hosts_text",
    "provenance_blocks",
    "split_label",
    "task_sections",
]


def split_label(rows: list[dict]) -> str:
    """What the accuracy was measured on: eval.split: val is validation, not test."""
    splits = {row.get("split", "test") for row in rows}
    if len(splits) > 1:
        return "evaluation"
    return {"val": "validation", "train": "training"}.get(splits.pop(), "test")


def class_tables(loaded, focus=None) -> list[tuple]:
    """One table per distinct class list (runs on the same dataset share a table), a column
    per run: with many runs, only the focus runs' (summary.json has every run's)."""
    groups: dict[tuple, list] = {}
    for name, _, ev in loaded:
        if focus is not None and name not in focus:
            continue
        groups.setdefault(tuple(map(str, ev["class_names"])), []).append((name, ev))
    tables = []
    for classes, members in groups.items():
        body = [[cls, *(_class_cell(ev, i) for _, ev in members)] for i, cls in enumerate(classes)]
        tables.append(("table", ["Class", *(name for name, _ in members)], body, None))
    return tables


def _class_cell(ev: dict, index: int) -> str:
    """A class's accuracy and support; a class with no sample in the split: n/a."""
    accuracy, support = ev["per_class_accuracy"][index], sum(ev["confusion_matrix"][index])
    if accuracy is None or not support:
        return "n/a (0 samples)"
    return f"{accuracy:.2%} ({support})"


def _label_tables(loaded, focus=None) -> list[tuple]:
    """Each multilabel run's labels: F1, true and false positives, false negatives and the
    support (true positives + false negatives: the samples that carry the label)."""
    out = []
    headers = ["Label", "F1", "True positives", "False positives", "False negatives", "Support"]
    for name, _, ev in loaded:
        if metrics.task_of(ev) != "multilabel" or (focus is not None and name not in focus):
            continue
        body = []
        for i, label in enumerate(ev["class_names"]):
            tp, fp, fn = (
                ev[k][i] for k in ("true_positives", "false_positives", "false_negatives")
            )
            f1 = ev["per_label_f1"][i]
            f1 = "n/a (never present, never predicted)" if f1 is None else f"{f1:.4f}"
            body.append([str(label), f1, str(tp), str(fp), str(fn), str(tp + fn)])
        overall = _overall(ev, ("exact_match", "f1_micro", "f1_macro"))
        if isinstance(ev.get("exact_matches"), int):
            overall += f" ({ev['exact_matches']} of {ev['samples_evaluated']} samples exact)"
        if isinstance(ev.get("threshold"), int | float):
            overall += f"; a label is predicted at probability ≥ {ev['threshold']:g}"
        out += [("h3", name), ("p", overall + "."), ("table", headers, body, None)]
    return out


def _target_tables(loaded, focus=None) -> list[tuple]:
    """Each regression run's targets: MSE, MAE and R² in the targets' own units."""
    out = []
    for name, _, ev in loaded:
        if metrics.task_of(ev) != "regression" or (focus is not None and name not in focus):
            continue
        errors = ev["per_target"]
        keys = ("mse", "mae", "r2")
        body = [
            [str(target), *(metrics.shown(k, errors[k][i]) for k in keys)]
            for i, target in enumerate(ev["class_names"])
        ]
        overall = _overall(ev, keys)
        if len(body) > 1:
            overall += " (the mean over the targets)"
        if isinstance(ev.get("loss_name"), str):
            overall += f"; trained with {ev['loss_name']} loss"
        table = ("table", ["Target", "MSE", "MAE", "R²"], body, None)
        out += [("h3", name), ("p", overall + "."), table]
    return out


def _overall(ev: dict, keys) -> str:
    """The run's metrics in words: "MSE 0.0123, MAE 0.0871, R² 0.9512"."""
    return ", ".join(f"{metrics.label(k)} {metrics.shown(k, ev.get(k))}" for k in keys)


def task_sections(loaded, rows: list[dict], focus, note: list) -> list[tuple]:
    """The per-label tables of multilabel runs and per-target tables of regression runs."""
    blocks = []
    for task, heading, tables in (
        ("multilabel", "Per-label {} F1 and counts", _label_tables),
        ("regression", "Per-target {} errors", _target_tables),
    ):
        members = [item for item in loaded if metrics.task_of(item[2]) == task]
        if not members:
            continue
        label = split_label([r for r in rows if r.get("task") == task])
        blocks += [("h2", heading.format(label)), *note, *tables(members, focus)]
        if task == "regression":
            blocks.append(("p", _TARGET_NOTE))
    return blocks


_TARGET_NOTE = (
    "MSE and MAE are in the targets' units (MSE squared); R² is 1 - MSE / the variance of "
    "the evaluated split's targets: n/a where that target is constant."
)


class Link(NamedTuple):
    """A table cell that links a file (a path relative to the report's folder)."""

    text: str
    href: str


def export_blocks(exports) -> list[tuple]:
    """Each run's model.pt and its exports (export.formats), linked (docs/use-your-model.md)."""
    text = (
        "Each run's model.pt and what export.formats wrote next to it: model.safetensors "
        "loads without running code, model.pt2 and model.onnx without the model's code. "
        "snakemake predict applies a model to new data."
    )
    table = ("table", ["Run", "File", "Size"], exports, None)
    return [("h2", "Models and exports"), ("p", text), table]


def fine_tuning_blocks(rows) -> list[tuple]:
    """The runs that started from weights or froze parameters (docs/fine-tuning.md)."""
    text = (
        "Runs that started from model.weights (checked by sha256, loaded strictly: only a "
        "classifier head of another class count is re-initialised) or froze parameters "
        "(train.freeze)."
    )
    header = ["Run", "Weights", "sha256", "Head", "Frozen", "Input normalisation"]
    return [("h2", "Fine-tuning"), ("p", text), ("table", header, rows, None)]


def language_model_blocks(found: list[tuple[str, dict]]) -> list[tuple]:
    """The language models (docs/language-models.md): their data, speed, and the samples they
    generated from a fixed prompt with fixed seeds (text data)."""
    text = (
        "Runs of task language_model: the context (data.block_size), the vocabulary, the "
        "tokens of each split and those trained on, and training tokens per second (all "
        "ranks). Perplexity is exp(loss), the loss in nats per token over every scored position."
    )
    header = [
        "Run",
        "Block size",
        "Vocabulary",
        "Tokens (train/val/test)",
        "Tokens trained",
        "Tokens/s",
    ]
    rows = [
        [
            name,
            str(lm["block_size"]),
            str(lm["vocab_size"]),
            "/".join(f"{lm['tokens'].get(s, 0):,}" for s in ("train", "val", "test")),
            f"{lm['tokens_trained']:,}",
            f"{lm['tokens_per_s']:,.0f}",
        ]
        for name, lm in found
    ]
    blocks: list[tuple] = [("h2", "Language models"), ("p", text), ("table", header, rows, None)]
    for name, lm in found:
        made = lm.get("generated")
        if not made:
            continue
        blocks.append(("h3", f"Samples from {name}"))
        how = f"{made['new_tokens']} tokens sampled (top-40, temperature 1) after the prompt"
        blocks.append(("p", f"The prompt: the validation split's first tokens; then {how}."))
        for sample in made["samples"]:
            text = made["prompt"] + sample["text"]
            blocks.append(("details", f"seed {sample['seed']}", text, "text"))
    return blocks


def model_blocks(exports, fine_tuned, language_models=()) -> list[tuple]:
    """The sections on the models: their files and exports, how they were fine-tuned, and
    the language models' data, speed and samples."""
    return (
        (export_blocks(exports) if exports else [])
        + (fine_tuning_blocks(fine_tuned) if fine_tuned else [])
        + (language_model_blocks(language_models) if language_models else [])
    )


def hosts_text(hosts: list) -> str:
    """One entry per host with its rank count ('node1 ×4, node2 ×4'); a 32-node run would
    drown the table, so at most 4 hosts (summary.json keeps the full list)."""
    counts: dict[str, int] = {}
    for host in map(str, hosts):
        counts[host] = counts.get(host, 0) + 1
    shown = ", ".join(f"{h} ×{n}" if n > 1 else h for h, n in list(counts.items())[:4])
    return shown + (f", … (+{counted(len(counts) - 4, 'host')})" if len(counts) > 4 else "")


def provenance_blocks(loaded) -> list[tuple]:
    """Each run's provenance: commit, hosts, data, package versions, resolved config."""
    blocks = []
    for name, _, ev in loaded:
        prov = ev["provenance"]
        hosts = hosts_text(prov["hostnames"]) or "unknown"
        dirty = {True: " with uncommitted changes", False: ""}.get(prov.get("git_dirty"), "")
        blocks += [
            ("h3", name),
            ("p", f"git commit: {prov['git_commit'] or 'unknown (not a git checkout)'}{dirty}; "
                  f"created: {prov['created']}; hosts: {hosts}"),
            *dataset_line(prov.get("dataset") or {}),
            ("table", ["Package", "Version"],
             [[str(k), str(v)] for k, v in sorted(prov["versions"].items())], None),
            ("details", "Resolved config (YAML)",
             yaml.safe_dump(prov["config"], sort_keys=False, allow_unicode=True).rstrip()),
        ]  # fmt: skip
    return blocks


def dataset_line(dataset: dict) -> list[tuple]:
    """The data a run was trained on, with what staging skipped (your own data)."""
    if not dataset:
        return []
    found = dataset.get("sizes", {})
    sizes = ", ".join(f"{k} {found[k]}" for k in ("train", "val", "test") if k in found)
    text = f"data: {dataset.get('source')} ({sizes})"
    notes = dataset.get("source_notes") or {}
    if "skipped_corrupt" in notes:  # an image folder
        corrupt, ignored = notes["skipped_corrupt"], notes["ignored_files"]
        text += (f"; {counted(corrupt, 'corrupt image')} skipped, "
                 f"{counted(ignored, 'file')} that are not images ignored")  # fmt: skip
    for done in ("upscaled", "skipped"):  # data.on_small (a manifest staged before: none)
        if count := notes.get(f"{done}_small"):
            size, mode = notes["image_size"], notes["on_small"]
            text += (f"; {counted(count, 'image')} smaller than data.image_size {size} "
                     f"{done} (data.on_small: {mode})")  # fmt: skip
    return [("p", text)]
