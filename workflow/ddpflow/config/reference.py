"""The configuration reference, docs/reference/config.md, rendered from schema.yaml: one row
per key with its type, default, allowed values and description, and what editing it redoes.

That last column is not written by hand: it is computed by the code that decides reruns
(fingerprint.py). Each key is set to other valid values in a few representative runs, and
the stage rule's params and dataset id (restage), the training fingerprint (retrain) and the
evaluation fingerprint (re-evaluate) are compared before and after.

    python -m ddpflow.config.reference > docs/reference/config.md    (make docs-reference)
"""

from __future__ import annotations

import copy
import json

import jsonschema

from ddpflow.config.fingerprint import (
    dataset_id,
    evaluation_fingerprint,
    stage_params,
    training_fingerprint,
)
from ddpflow.config.machine import world_size
from ddpflow.config.runs import SECTIONS, resolve_runs
from ddpflow.config.schema import load_schema, schema_keys, validate
from ddpflow.words import counted

REGENERATE = "make docs-reference (python -m ddpflow.config.reference > docs/reference/config.md)"
# an edit is tried in the default run and in runs where keys act that the default run ignores
# (the column then says "retrain with model.name: mlp"). Own data names files that do not
# exist, so that rendering reads no file (a listing of "missing" is compared with itself).
NOWHERE = "/nonexistent/ddpflow-reference"
CONTEXTS: dict[str, dict] = {
    "": {},
    "GPUs": {"machine": {"gpus_per_node": 1}},
    "model.name: mlp": {"model": {"name": "mlp"}},
    "a torchvision model": {"model": {"name": "resnet50"}},
    "data.source: image_folder": {"data": {"source": "image_folder", "image_size": [32, 32]}},
    "data.source: npz": {"data": {"source": "npz"}},
    "train.strategy: fsdp": {"train": {"strategy": "fsdp"}},
    "train.strategy: hsdp": {"train": {"strategy": "hsdp"}},
    "train.augment.enabled: true": {"train": {"augment": {"enabled": True}}},
    "machine.container": {"machine": {"container": {"runtime": "charliecloud", "image": NOWHERE}}},
}
# what a rerun redoes, from least to most: each level redoes the ones before it too
LEVELS = ("nothing", "re-evaluate", "retrain", "restage")
# keys whose effect is not a rerun of the same outputs
NOT_A_RERUN = {
    "results_dir": "everything, in the new folder (the old one is left as it is)",
    "runs": "a new run is trained and evaluated; the report is redone for any change",
    # resolved before a run exists (checks.batch.resolve_micro_batch): a number is the
    # science; auto follows the world size
    # resolved into run["weights"] (checks.weight_files): its sha256, or run:NAME's fingerprint
    "model.weights": "retrain (the file's sha256, or run:NAME's own training, is in the "
    "fingerprint; replacing the file retrains too)",
    "model.weights_sha256": "nothing where the file has it; another hash is refused",
    "train.micro_batch_size": "a number: retrain where it changes the normalisation batch "
    "(train.norm_batch_size auto follows it); auto: nothing where the model has BatchNorm or "
    "no draws (the normalisation batch stays the run's), retrain for a model that draws per "
    "micro-batch (dropout) where the micro-batch auto resolves to changes",
    "train.max_micro_batch_size": "nothing where the model has BatchNorm or no draws; with "
    "auto, retrain for a model that draws per micro-batch where the micro-batch changes",
    "train.norm_batch_size": "retrain where the normalisation batch changes (auto: the run's "
    "own, so writing the number it trained with retrains nothing)",
    # resolved before a run exists (config.runs._resolve_task): the data section carries it
    "task": "restage and retrain (the targets are staged as the task needs them)",
    "task_kwargs": "multilabel threshold: re-evaluate; regression loss, huber_delta: retrain; "
    "your own task's: restage and retrain",
}
# tracking: where runs are logged, in no fingerprint (ddpflow.tracking)
TRACKING_EFFECT = "nothing; the track rule logs again (and the report is redone)"
# predict, generate and export: what is made from a finished run's model.pt
# (ddpflow.predict, ddpflow.generate, ddpflow.export), in no fingerprint
OUTSIDE_RUNS = {
    "predict": "nothing is retrained or re-evaluated; `snakemake predict` predicts again "
    "(predict.runs: only the runs newly named)",
    "export": "nothing is retrained or re-evaluated; a format added is exported, and the "
    "report is redone",
    "generate": "nothing is retrained or re-evaluated; `snakemake generate` generates again "
    "(generate.runs: only the runs newly named)",
}
# sweep: which runs exist, not what one run computes (ddpflow.config.sweep)
SWEEP_EFFECT = {
    "prune": "nothing: a finished or pruned run is not retrained (force it: --forcerun)",
    "max_runs": "nothing",
}
SWEEP_DEFAULT_EFFECT = (
    "a new point is trained and evaluated; a removed one is left as it is; the other points "
    "redo nothing"
)
# values tried for a key, beside its enum members and its default moved up or down: those
# the key's schema accepts (3.0 is left out: JSON Schema counts it an integer, ddpflow not)
TRIED = (True, False, 0, 1, 2, 3, 7, 100, 0.1, 0.3, 2.5, "x", None, [32, 32], [64],
         [0.5, 0.9], ["true"], {"x": 1})  # fmt: skip


def _resolved(overrides: dict) -> dict:
    """The first run of a config of schema defaults with these overrides (own data nowhere)."""
    config = {"data": {"root": NOWHERE, "path": f"{NOWHERE}/data.npz"}}
    for section, values in overrides.items():
        config[section] = {**config.get(section, {}), **values}
    return resolve_runs(validate(config))[0]


def _outcome(run: dict) -> tuple:
    return (
        (run["dataset_id"], json.dumps(stage_params(run["data"]), sort_keys=True)),
        training_fingerprint(run),
        evaluation_fingerprint(run),
    )


def _level(before: tuple, after: tuple) -> int:
    changed = [b != a for b, a in zip(before, after, strict=True)]
    return 3 if changed[0] else 2 if changed[1] else 1 if changed[2] else 0


def _edited(run: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(run)
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = copy.deepcopy(value)
    out["world_size"] = world_size(out["machine"])
    out["dataset_id"] = dataset_id(out["data"])
    return out


def _current(run: dict, path: tuple):
    value = run
    for key in path:
        if value is None:  # below a section that is null in this run
            return None
        value = value[key]
    return value


def _alternatives(node: dict, value) -> list:
    """Other values this key's schema accepts."""
    tried = [*node.get("enum", ()), *(v for s in node.get("anyOf", ()) for v in s.get("enum", ()))]
    if isinstance(value, int | float) and not isinstance(value, bool):
        tried += [value + 1, value - 1, value * 2, value / 2]
    checker = jsonschema.Draft202012Validator(node)
    shown = json.dumps(value)
    return [v for v in [*tried, *TRIED] if json.dumps(v) != shown and checker.is_valid(v)]


def _effect(path: tuple, node: dict, runs: dict[str, dict]) -> str:
    """What editing the key redoes in the default run, and more where it acts in another."""
    dotted = ".".join(path)
    if dotted in NOT_A_RERUN:
        return NOT_A_RERUN[dotted]
    if path[0] == "tracking":  # in no run's fingerprint: only the track rule's params
        return TRACKING_EFFECT
    if path[0] in OUTSIDE_RUNS:
        return OUTSIDE_RUNS[path[0]]
    if path[0] == "sweep":  # makes runs: a point's run is a run like any other
        return (
            SWEEP_EFFECT.get(path[1], SWEEP_DEFAULT_EFFECT)
            if len(path) > 1
            else SWEEP_DEFAULT_EFFECT
        )
    levels = {}
    for name, run in runs.items():
        if _current(run, path[:-1]) is None:  # a section that is off here (machine.container)
            levels[name] = 0
            continue
        before = _outcome(run)
        value = _current(run, path)
        edits = [_edited(run, path, v) for v in _alternatives(node, value)]
        levels[name] = max((_level(before, _outcome(e)) for e in edits), default=0)
    text = LEVELS[levels[""]]
    more: dict[int, list[str]] = {}
    for name, level in levels.items():
        if level > levels[""]:
            more.setdefault(level, []).append(name)
    for level in sorted(more, reverse=True):
        text += f"; {LEVELS[level]} with {' or '.join(more[level])}"
    return text


def _node(schema: dict, path: tuple) -> dict:
    node = schema
    for key in path:
        if "$ref" in node:
            node = schema["$defs"][node["$ref"].rsplit("/", 1)[1]]
        node = node["properties"][key]
    return schema["$defs"][node["$ref"].rsplit("/", 1)[1]] | node if "$ref" in node else node


def _type(node: dict) -> str:
    if "enum" in node:
        return "enum"
    if "anyOf" in node:
        return " or ".join(
            _type(sub) if "const" not in sub else f"`{sub['const']}`" for sub in node["anyOf"]
        )
    kind = node.get("type", "any")
    kinds = [kind] if isinstance(kind, str) else kind
    text = " or ".join(kinds)
    if "array" in kinds and "type" in node.get("items", {}):
        text = text.replace("array", f"list of {node['items']['type']}")
    return text


def _shown(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else json.dumps(value)


def _bounds(node: dict) -> list[str]:
    out = []
    for key, sign in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"),
                      ("exclusiveMaximum", "<")):  # fmt: skip
        if key in node:
            out.append(f"{sign} {node[key]}")
    return out


def _allowed(node: dict) -> str:
    if "enum" in node:
        return ", ".join(f"`{_shown(v)}`" for v in node["enum"])
    if "anyOf" in node:
        parts = [_allowed(sub) or _type(sub) for sub in node["anyOf"]]
        return " or ".join(f"`{sub['const']}`" if "const" in sub else p
                           for sub, p in zip(node["anyOf"], parts, strict=True))  # fmt: skip
    out = _bounds(node)
    if "pattern" in node:
        out.append(f"matches `{node['pattern']}`")
    if node.get("minLength"):
        out.append("not empty")
    if "minItems" in node:
        count = node["minItems"]
        same = node.get("maxItems") == count
        out.append(counted(count, "item") if same else f"at least {counted(count, 'item')}")
    items = " and ".join(_bounds(node.get("items", {})))
    if items:
        out.append(f"each {items}")
    return ", ".join(out)


def _cell(text: str) -> str:
    """Schema prose in a table cell: one line, and no character Markdown would act on."""
    text = " ".join(str(text).split())
    for char, escaped in (("|", "\\|"), ("<", "&lt;"), (">", "&gt;"), ("*", "\\*")):
        text = text.replace(char, escaped)
    return text


def rows() -> list[dict[str, str]]:
    """One row per schema key, parents before children (a section's row has no effect)."""
    schema = load_schema()
    runs = {name: _resolved(overrides) for name, overrides in CONTEXTS.items()}
    out = []
    for path in schema_keys(schema):
        node = _node(schema, path)
        leaf = "properties" not in node
        out.append({
            "key": ".".join(path),
            "type": _type(node),
            "default": f"`{_shown(node['default'])}`" if "default" in node and leaf else "",
            "allowed": _allowed(node),
            "redoes": _effect(path, node, runs) if leaf else "(its keys below)",
            "description": _cell(node.get("description", "")),
        })  # fmt: skip
    return out


HEADER = f"""# Configuration reference

<!-- Generated from workflow/ddpflow/config/schema.yaml: do not edit. Regenerate with
{REGENERATE}. -->

Every key a ddpflow configuration accepts, as the schema declares it (`config/config.yaml`
shows the ones usually edited). A key left out takes its default; an unknown key is an error
(with "did you mean ..." when it belongs elsewhere).
A named run (`runs:`) may override any key of the sections `{", ".join(SECTIONS)}`.

**Editing it redoes** says what the next `snakemake` run does after the key is edited, as
computed by ddpflow's rerun rules (`ddpflow.config.fingerprint`):

- *nothing*: no rule reruns (the key says how or where a run executes, not what it computes);
  it applies from the next job that runs;
- *re-evaluate*: the evaluate rule reruns (its params change), the model is kept;
- *retrain*: the train rule reruns for the runs concerned, then their evaluation;
- *restage*: the stage rule reruns for the data concerned, then everything after it.

"retrain with model.name: mlp" means the key retrains only runs with that setting (elsewhere
it is not in effect). The report is redone whenever something it shows was redone.
"""


def markdown() -> str:
    """docs/reference/config.md: a table of the top-level keys, then one per section."""
    titles = ("Key", "Type", "Default", "Allowed", "Editing it redoes", "Description")
    groups: dict[str, list[str]] = {"top level": [], **{section: [] for section in SECTIONS}}
    for row in rows():
        top = row["key"].split(".")[0]
        cells = [f"`{row['key']}`", *(row[c] for c in ("type", "default", "allowed", "redoes",
                                                        "description"))]  # fmt: skip
        groups[top if top in SECTIONS else "top level"].append("| " + " | ".join(cells) + " |")
    parts = [HEADER]
    for group, lines in groups.items():
        parts.append(f"\n## {group}\n\n| {' | '.join(titles)} |\n|{'---|' * len(titles)}")
        parts += lines
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
