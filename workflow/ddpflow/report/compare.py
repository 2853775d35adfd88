"""Which runs the report may rank against each other, and the words that say so.

Runs are ranked only inside a comparability group: the same task, the same selection metric
in the same direction, the same data (the samples that are validated and tested: source,
files, split seed and fractions, targets; not how they are prepared: image size, channels,
block size, a cap on the training samples, staging threads) and, for a language model, the
same vocabulary (perplexity is per token of a tokenizer: a byte model and a 1000-token model
do not compare by it; bits per byte would). Inside a group the validation figure of the model
each run kept selects (the test figure is reported, never used to select); a run alone in its
group is not ranked, not starred, and the headline says why it is not compared. Pure.

    found = groups(rows, evals, pick)      # rows get "group" and "best"
    text = headline(found)                 # "selected on validation MSE (lower ...) ..."
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ddpflow.config.fingerprint import CHECK_DATA_KEYS, LATER_DATA_DEFAULTS
from ddpflow.report import metrics
from ddpflow.task import Selection, record_task
from ddpflow.task.builtin_views import TEXT_VOCABULARY as BYTE_VOCABULARY

__all__ = ["Group", "Identity", "groups", "headline", "identity", "summary"]

# data keys that change how samples are prepared or read, or how many training samples are
# used, not which samples are validated and tested: runs that differ in them still compare
PREPARATION_KEYS = (
    "stage_threads",
    "loading",
    "image_size",
    "channels",
    "block_size",
    "max_train_samples",
)
NAMED_RUNS = 6  # a group of more runs is counted in the headline, not listed


@dataclass(frozen=True)
class Identity:
    """What must agree for two runs' validation figures to rank them."""

    task: str
    selection: Selection
    data: str  # canonical JSON of the data that is validated and tested ("" unrecorded)
    vocabulary: int | None  # Task.compared_by: a language model's; None for other tasks
    split: str = "test"  # eval.split: figures of another split are not ranked beside these


@dataclass
class Group:
    """Runs that compare: their rows in listed order and the selected one (None alone)."""

    number: int
    identity: Identity
    rows: list[dict] = field(default_factory=list)
    best: dict | None = None
    tied: list[dict] = field(default_factory=list)  # the runs equal on every ranking figure
    loss_decided: bool = False  # the selection figure tied; the validation loss chose


def _data(ev: dict) -> dict:
    """The run's data section less PREPARATION_KEYS, with the split sizes (of tokens for a
    language model) that staging recorded: an edited folder stages other samples."""
    config = ev.get("provenance", {}).get("config")
    data = config.get("data") if isinstance(config, dict) else None
    if not isinstance(data, dict):
        return {}
    kept = {k: v for k, v in data.items() if k not in PREPARATION_KEYS + CHECK_DATA_KEYS}
    for name, default in LATER_DATA_DEFAULTS.items():  # as runs before the key recorded it
        if kept.get(name, default) == default:
            kept.pop(name, None)
    key = record_task(ev).train_record_key  # a language model's counts its split's tokens
    lm = ev.get("train", {}).get(key) if key else None
    if isinstance(lm, dict) and isinstance(lm.get("tokens"), dict):
        kept["tokens"] = {s: lm["tokens"].get(s) for s in ("val", "test")}
    else:
        sizes = (ev["provenance"].get("dataset") or {}).get("sizes") or {}
        kept["sizes"] = {s: sizes[s] for s in ("val", "test") if s in sizes}
    return kept


def identity(ev: dict) -> Identity:
    """The run's comparability key, from its eval_metrics.json record."""
    task = record_task(ev)
    data = _data(ev)
    return Identity(
        task=task.name,
        selection=metrics.selection(ev),
        data=json.dumps(data, sort_keys=True, default=str) if data else "",
        vocabulary=task.compared_by(ev),  # a language model's: other tokenizers differ
        split=ev.get("split", "test"),
    )


def groups(rows: list[dict], evals: dict[str, dict], pick: str | None = None) -> list[Group]:
    """The comparability groups of rows (in the order of their first run); sets each row's
    "group" (its number) and "best" (selected in a group of two or more). pick: a sweep's
    selected run, which wins a tie."""
    found: dict[Identity, Group] = {}
    for row in rows:
        key = identity(evals[row["run"]])
        group = found.setdefault(key, Group(len(found) + 1, key))
        group.rows.append(row)
        row["group"] = group.number
    for group in found.values():
        if len(group.rows) > 1:
            ranking = _ranking(group.identity.selection, pick)
            ranked = sorted(group.rows, key=ranking)
            group.tied = [row for row in ranked if ranking(row) == ranking(ranked[0])]
            group.best = ranked[0] if len(group.tied) == 1 else None
            group.loss_decided = not group.tied[1:] and _metric_tie(group, ranked)
    for row in rows:
        row["best"] = any(row is group.best for group in found.values())
    return list(found.values())


LOSS = Selection("val_loss", False, "validation loss")  # what breaks a tie on the metric


def _ranking(chosen: Selection, pick: str | None):
    """A sort key of rows, best first: the final validation figure in the selection's
    direction, then the sweep's pick, then the lower final validation loss. Runs equal on
    all three are a tie: none is selected (the speed of a noisy machine never decides)."""
    final = f"final_{chosen.metric}"
    return lambda r: (
        metrics.score(chosen, r.get(final)),
        r["run"] != pick,
        metrics.score(LOSS, r.get("final_val_loss")),
    )


def _metric_tie(group: Group, ranked: list[dict]) -> bool:
    """Whether the selected run shares its selection figure with the next (the validation
    loss decided)."""
    final = f"final_{group.identity.selection.metric}"
    return ranked[0].get(final) == ranked[1].get(final)


def _names(group: Group) -> str:
    names = [row["run"] for row in group.rows]
    if len(names) > NAMED_RUNS:
        return f"{len(names)} runs"
    return "runs " + ", ".join(names)


def _selected(group: Group) -> str:
    chosen, best = group.identity.selection, group.best
    if best is None:  # a tie on every figure
        final = group.tied[0].get(f"final_{chosen.metric}")
        names = ", ".join(row["run"] for row in group.tied)
        return (
            f"{names} tie on {chosen.label} ({_figure(final)}) and validation loss: no run "
            f"selected among {_names(group)}"
        )
    said = f"selected on {chosen.label}{metrics.direction(chosen)} among {_names(group)}: "
    if group.loss_decided:
        final = best.get(f"final_{chosen.metric}")
        return said + (
            f"{best['run']} (tied on {chosen.label} {_figure(final)}; the lower validation "
            f"loss, {_figure(best.get('final_val_loss'))}, decided)"
        )
    return said + best["run"]


def _figure(value) -> str:
    return f"{value:.4f}" if isinstance(value, int | float) else "?"


def headline(found: list[Group]) -> str:
    """The headline's words on ranking: what selected each group's run (or that its best
    runs tie), then which runs are not compared and why."""
    said = [_selected(g) for g in found if len(g.rows) > 1]
    said += _apart(found)
    if not said:
        return "nothing to compare it with."
    return "; ".join(said) + "."


def _apart(found: list[Group]) -> list[str]:
    """Why the groups are not ranked against each other: different tasks, then, inside a
    task, different tokenizers, selection metrics or data."""
    tasks = list(dict.fromkeys(group.identity.task for group in found))
    out = []
    if len(tasks) > 1:
        out.append(f"runs of different tasks are not compared ({', '.join(tasks)})")
    for task in tasks:
        mine = [group for group in found if group.identity.task == task]
        if len(mine) > 1:
            out.append(_why_apart(mine))
    return out


def _why_apart(mine: list[Group]) -> str:
    """ "not compared: a (byte vocabulary 257) and b (vocabulary 1,000) use different
    tokenizers, ..." for the groups of one task."""
    ids = [group.identity for group in mine]
    if len({i.vocabulary for i in ids}) > 1:
        described = [_vocabulary_words(i.vocabulary) for i in ids]
        why = (
            "use different tokenizers: perplexity compares only under the same tokenizer "
            "(bits per byte compares across them)"
        )
    elif len({i.selection for i in ids}) > 1:
        described = [i.selection.label + metrics.direction(i.selection) for i in ids]
        why = "are selected by different metrics"
    elif len({i.split for i in ids}) > 1:
        described = [f"eval.split {i.split}" for i in ids]
        why = "are evaluated on different splits"
    else:
        described = _data_words([i.data for i in ids])
        why = "were validated and tested on different data"
    names = [", ".join(row["run"] for row in group.rows) for group in mine]
    parts = [f"{name} ({words})" for name, words in zip(names, described, strict=True)]
    return f"not compared: {', '.join(parts[:-1])} and {parts[-1]} {why}"


def _vocabulary_words(vocabulary: int | None) -> str:
    if vocabulary is None:
        return "vocabulary not recorded"
    return f"{'byte ' if vocabulary == BYTE_VOCABULARY else ''}vocabulary {vocabulary:,}"


def _data_words(datas: list[str]) -> list[str]:
    """Each group's values of the data keys in which the groups differ (at most three)."""
    parsed = [json.loads(d) if d else None for d in datas]
    keys = list(dict.fromkeys(k for p in parsed if p for k in p))
    differ = [
        k for k in keys if len({json.dumps((p or {}).get(k), sort_keys=True) for p in parsed}) > 1
    ][:3]
    return [
        "data not recorded" if p is None else ", ".join(_data_value(k, p.get(k)) for k in differ)
        for p in parsed
    ]


def _data_value(key: str, value) -> str:
    if key in ("sizes", "tokens") and isinstance(value, dict):  # what staging found
        # by name: the identity's JSON sorts the keys (test before val)
        unit = "tokens" if key == "tokens" else "samples"
        return f"{unit} val/test {value.get('val', '?')}/{value.get('test', '?')}"
    shown = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return f"data.{key} {shown if len(shown) <= 40 else shown[:37] + '...'}"


def summary(found: list[Group]) -> list[dict]:
    """summary.json's "groups": each group's runs, what selects among them and the run it
    selected (null for a run alone: nothing was compared)."""
    return [
        {
            "group": group.number,
            "task": group.identity.task,
            "selected_by": group.identity.selection.metric,
            "higher_is_better": group.identity.selection.higher_is_better,
            **({"vocabulary": group.identity.vocabulary} if group.identity.vocabulary else {}),
            "runs": [row["run"] for row in group.rows],
            "best": group.best["run"] if group.best else None,
        }
        for group in found
    ]
