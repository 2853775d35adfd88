"""The task tables of the report, each as its task draws them (Task.report_section:
classification's per-class accuracy, multilabel's per-label F1 and counts, regression's
per-target errors), as render.py's format-neutral blocks; split_label, what the figures were
measured on; and the table of each run's model and exports (Link: a cell that links a
file); each run's provenance. Pure, like render.py.

    blocks = result_tables(loaded, rows, label, focus, note)  # every task's tables
"""

from __future__ import annotations

from typing import NamedTuple

import yaml

from ddpflow.task import BUILT_IN_TASKS, DEFAULT_TASK, Task, record_task
from ddpflow.task.builtin_views import class_tables
from ddpflow.words import counted

__all__ = [
    "class_tables",
    "dataset_line",
    "hosts_text",
    "provenance_blocks",
    "result_tables",
    "split_label",
    "task_sections",
]


def split_label(rows: list[dict]) -> str:
    """What the accuracy was measured on: eval.split: val is validation, not test."""
    splits = {row.get("split", "test") for row in rows}
    if len(splits) > 1:
        return "evaluation"
    return {"val": "validation", "train": "training"}.get(splits.pop(), "test")


def result_tables(loaded, rows: list[dict], label: str, focus, note: list) -> list[tuple]:
    """Each task's tables of its runs, as the task draws them (Task.report_section: per-class
    accuracy, per-label F1, per-target errors): the built-in tasks first, in their order."""
    return _sections(loaded, rows, label, focus, note, lambda task: True)


def task_sections(loaded, rows: list[dict], focus, note: list) -> list[tuple]:
    """The tables of the tasks whose records name them (result_tables less classification's
    per-class tables, which class_tables draws)."""
    return _sections(loaded, rows, "", focus, note, lambda task: task.named_in_records)


def _sections(loaded, rows, label, focus, note, shown_task) -> list[tuple]:
    by_task: dict[str, tuple[Task, list]] = {}
    for item in loaded:
        task = record_task(item[2])
        by_task.setdefault(task.name, (task, []))[1].append(item)
    built_in = [n for n in BUILT_IN_TASKS if n in by_task]
    order = built_in + [n for n in by_task if n not in built_in]
    blocks = []
    for name in order:
        task, members = by_task[name]
        if shown_task(task):
            own = [r for r in rows if r.get("task", DEFAULT_TASK) == name]
            own_label = split_label(own) if own else label
            blocks += task.report_section(members, label, own_label, focus, note)
    return blocks


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
        "Runs of task language_model: the context (data.block_size), the tokenizer and the "
        "vocabulary, the tokens of each split and those trained on, and training tokens per "
        "second (all ranks). Perplexity is exp(loss), the loss in nats per token over every "
        "scored position; it compares runs of one tokenizer. Bits per byte (the loss over the "
        "UTF-8 bytes of the scored text) compares runs across tokenizers."
    )
    header = [
        "Run",
        "Block size",
        "Tokenizer",
        "Vocabulary",
        "Tokens (train/val/test)",
        "Tokens trained",
        "Tokens/s",
    ]
    rows = [
        [
            name,
            str(lm["block_size"]),
            tokenizer_words(lm),
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


def tokenizer_words(lm: dict) -> str:
    """A language model's tokenizer (its train record's) in a table cell: "bytes", "bpe
    (sha256 42cb96c8)", "gpt2.json (sha256 ...)"; "token ids" for token files. A text run
    recorded before data.tokenizer (samples, no tokenizer) read bytes."""
    entry = lm.get("tokenizer")
    if not isinstance(entry, dict):
        return "bytes" if lm.get("generated") else "token ids"
    if entry.get("kind") == "bytes":
        return "bytes"
    name = "bpe" if entry.get("kind") == "bpe" else str(entry.get("from", "tokenizer.json"))
    return f"{name.rsplit('/', 1)[-1]} (sha256 {str(entry.get('sha256', ''))[:8]})"


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
        not_images = counted(ignored, "file that is not an image", "files that are not images")
        text += f"; {counted(corrupt, 'corrupt image')} skipped, {not_images} ignored"
    for done in ("upscaled", "skipped"):  # data.on_small (a manifest staged before: none)
        if count := notes.get(f"{done}_small"):
            size, mode = notes["image_size"], notes["on_small"]
            text += (f"; {counted(count, 'image')} smaller than data.image_size {size} "
                     f"{done} (data.on_small: {mode})")  # fmt: skip
    return [("p", text)]
