"""Load a config file and resolve its named runs: each run is the top-level sections with
the run's overrides merged in, validated, and checked (ddpflow.checks) before anything runs.
"""

from __future__ import annotations

import copy
from pathlib import Path

from ddpflow.checks import weight_files as weights
from ddpflow.checks.batch import resolve_micro_batch
from ddpflow.checks.norm_batch import batch_role, recorded_norm_batch
from ddpflow.checks.tokenizer import check_tokenizer
from ddpflow.checks.values import check_export, check_resolved_run, check_tracking
from ddpflow.config.fingerprint import TOKEN_SOURCES, dataset_id
from ddpflow.config.machine import world_size
from ddpflow.config.schema import ConfigError, deep_merge, validate
from ddpflow.config.sweep import has_sweep, sweep_entries
from ddpflow.config.yamlfile import read_config_file
from ddpflow.plugins import is_plugin
from ddpflow.task import DEFAULT_TASK, Task, TaskError, get_task

SECTIONS = ("data", "model", "train", "eval", "machine")


def load(path: str | Path | None = None, overrides: dict | None = None) -> dict:
    """Read a YAML config file (optionally deep-merging overrides), validate it, fill defaults."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        raw = read_config_file(path)
    return check(deep_merge(raw, overrides or {}))


def check(config: dict) -> dict:
    """Schema-validate the whole config, then every resolved run; returns the validated config."""
    return check_runs(config)[0]


def check_runs(config: dict) -> tuple[dict, list[dict]]:
    """check() and the resolved runs, validating each run once (the Snakefile's parse)."""
    given_runs = "runs" in config
    config = validate(copy.deepcopy(config))
    if not given_runs and has_sweep(config):
        config["runs"] = []  # a sweep without runs: trains its points only, no "default"
    entries = run_entries(config)
    if not entries:
        raise ConfigError("runs: no run to train; name one under runs: or sweep: a key")
    runs = [_resolve(config, entry, where) for entry, where in entries]
    for run in runs:
        check_resolved_run(run, config["launcher"])
    check_tracking(config["tracking"])
    check_export(config["export"])
    return config, runs


def check_plugin_tasks(runs: list[dict]) -> None:
    """A plug-in task built with its task_kwargs, as the workflow's parse builds it anyway
    (export_formats): a typo in them is refused as a ddpflow configuration error."""
    from ddpflow.task import run_task

    for run in runs:
        if is_plugin(run["task"]):
            try:
                run_task(run)
            except TaskError as err:
                raise ConfigError(f"run {run['name']!r}: {err}") from err


def export_formats(run: dict, formats: list[str]) -> list[str]:
    """The export.formats that apply to a run, as its task says (Task.exports: a language
    model's is safetensors only, the traced formats take an image batch)."""
    from ddpflow.task import TaskError, run_task

    try:
        applies = run_task(run).exports
    except TaskError as err:
        raise ConfigError(f"run {run['name']!r}: {err}") from err
    return list(formats) if applies is None else [fmt for fmt in formats if fmt in applies]


def run_entries(config: dict) -> list[tuple[dict, str]]:
    """Every run's entry ({"name", <section>: overrides}) and where it was written: the runs:
    list, then the sweep's points (ddpflow.config.sweep); a name given twice is refused."""
    entries = [(e, f"runs[{i}] ({e['name']!r})") for i, e in enumerate(config["runs"])]
    entries += [(e, f"sweep point {e['name']!r} ({e['sweep']['origin']})")
                for e in sweep_entries(config)]  # fmt: skip
    names = [entry["name"] for entry, _ in entries]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(
            f"runs: run names must be unique; repeated: {duplicates} (a runs: entry and a "
            "sweep point may not share a name: rename the runs: entry)"
        )
    return entries


def resolve_runs(config: dict) -> list[dict]:
    """Each named run (runs: and sweep:): the top-level sections with the run's overrides
    merged in, validated."""
    return [_resolve(config, entry, where) for entry, where in run_entries(config)]


def _resolve(config: dict, entry: dict, where: str) -> dict:
    # tracking (where a run is logged) and export (what model.pt is also written as): the
    # same for every run and in no fingerprint; the train rule reads them from the run (its
    # script, a rerun trigger, stays as it was)
    shared = ("launcher", "results_dir", "logs_dir", "tracking", "export")
    merged = {key: config[key] for key in shared if key in config}
    for section in SECTIONS:
        merged[section] = deep_merge(config[section], entry.get(section, {}))
    # a run's own task takes its own task_kwargs (the top-level ones are another task's)
    merged["task"] = entry.get("task", config.get("task", DEFAULT_TASK))
    own = "task" in entry and entry["task"] != config.get("task", DEFAULT_TASK)
    merged["task_kwargs"] = entry.get("task_kwargs", {} if own else config.get("task_kwargs", {}))
    resolved = validate(merged, where=where)
    # the config's, not a run's (in no fingerprint); `runs` is the schema's default
    # [{name: default}], which would read as this run's provenance (export stays: rank 0
    # writes the safetensors export it asks for, ddpflow.export.prepare_safetensors)
    for key in ("predict", "generate", "runs"):
        resolved.pop(key, None)
    _resolve_task(resolved, where)
    resolved["name"] = entry["name"]
    resolved["train"], resolved["micro_batch"] = resolve_micro_batch(
        where,
        resolved["train"],
        resolved["machine"],
        batch_role(resolved),
        recorded_norm_batch(resolved.get("results_dir", "results"), entry["name"]),
    )
    resolved["world_size"] = world_size(resolved["machine"])
    resolved["dataset_id"] = dataset_id(resolved["data"])
    _resolve_weights(config, resolved, where)
    if "sweep" in entry:  # in no fingerprint, like tracking
        block = entry["sweep"]
        values = {key: _dotted(resolved, key) for key in block["keys"]}
        resolved["sweep"] = {**block, "values": values}
    return resolved


def _resolve_task(run: dict, where: str) -> None:
    """A built-in task and its task_kwargs are checked here, at parse (a plug-in task when
    its data is staged: importing your code at every parse would import torch). A task other
    than classification stages its targets its own way: the data section carries its name
    (and a plug-in task's kwargs), so its staged dataset and fingerprint are its own, while a
    classification run's stay what they were before tasks existed."""
    name, task = run["task"], _built_in_task(run, where)
    own = task is None or task.stages_targets  # a plug-in stages its targets
    source, table = run["data"]["source"], run["data"]["labels_csv"]
    _check_language_model(run, task, where)
    if table and (source != "image_folder" or not own):
        raise ConfigError(
            f"{where}: data.labels_csv {table!r} gives an image folder's targets under task "
            f"multilabel or regression (here: task {name}, data.source {source}); remove it, "
            "or set the task (docs/tasks.md)"
        )
    labelled = source == "image_folder" and table
    own_targets = source in ("npz", *TOKEN_SOURCES) or is_plugin(source) or labelled
    if own and not own_targets:
        held = "class folders: one class per image"
        if source != "image_folder":
            held = f"one class per image (the built-in {source})"
        raise ConfigError(
            f"{where}: task {name!r} on data.source {source}, which holds {held}; give the "
            "targets in an npz (data.source: npz), a data plug-in or, for an image folder, "
            "data.labels_csv (docs/tasks.md), or set task: classification"
        )
    if own:
        run["data"]["task"] = name
        if is_plugin(name):
            run["data"]["task_kwargs"] = run["task_kwargs"]


def _built_in_task(run: dict, where: str) -> Task | None:
    """The run's built-in task with its task_kwargs, checked (None: a plug-in task)."""
    if is_plugin(run["task"]):
        return None
    try:
        return get_task(run["task"], run["task_kwargs"])
    except TaskError as err:
        raise ConfigError(f"{where}: {err}") from err


def _check_language_model(run: dict, task: Task | None, where: str) -> None:
    """A task that reads tokens (task: language_model) takes token data (data.source text or
    tokens) and a model that reads tokens (gpt or a plug-in); token data takes no other task
    (docs/language-models.md)."""
    data, model, name = run["data"], run["model"]["name"], run["task"]
    source, lm = data["source"], task is not None and task.reads == "tokens"
    if lm and source not in TOKEN_SOURCES:
        raise ConfigError(
            f"{where}: task language_model on data.source {source}, which holds images; set "
            "data.source: text (data.path: a text file or a folder of them) or data.source: "
            "tokens (data.path: a folder of train.bin/val.bin) (docs/language-models.md)"
        )
    if source in TOKEN_SOURCES and not lm:
        raise ConfigError(
            f"{where}: data.source {source} holds tokens, which task {name} cannot learn "
            "from; set task: language_model, or give images (docs/language-models.md)"
        )
    if not lm:
        return _refuse_language_model_keys(data, model, source, where)
    if not data["path"]:
        raise ConfigError(
            f"{where}: data.path is required for data.source {source}: "
            + (
                "a text file or a folder of text files"
                if source == "text"
                else "the folder of train.bin and val.bin (or .npy) token files"
            )
        )
    if data["max_train_samples"] is not None:
        raise ConfigError(
            f"{where}: data.max_train_samples {data['max_train_samples']} caps images; a "
            "language model trains on every block of its text: set it to null for this run"
        )
    if source == "tokens" and data["vocab_size"] is None:
        raise ConfigError(
            f"{where}: data.vocab_size is required for data.source tokens: your tokenizer's "
            "vocabulary size (every token id must be below it; GPT-2's is 50257)"
        )
    check_tokenizer(data, where)  # data.tokenizer with data.vocab_size
    if model != "gpt" and not is_plugin(model):
        raise ConfigError(
            f"{where}: model.name {model!r} is an image model; a language model is model.name "
            "gpt or your own 'package.module:function' called with (vocab_size, block_size)"
        )


def _refuse_language_model_keys(data: dict, model: str, source: str, where: str) -> None:
    """A run of another task with a language model's data keys or model."""
    later = (("block_size", 64), ("vocab_size", None), ("tokenizer", "bytes"))
    for key, default in (*later, ("tokenizer_sha256", None)):
        if data[key] != default:
            raise ConfigError(
                f"{where}: data.{key} {data[key]} is set for data.source {source}; it is a "
                "language model's key (data.source text or tokens): remove it"
            )
    if model == "gpt":
        raise ConfigError(
            f"{where}: model.name gpt is a language model; it needs task: language_model "
            "and data.source text or tokens"
        )


def _resolve_weights(config: dict, run: dict, where: str) -> None:
    """run["weights"]: what model.weights names and its identity (checks.weight_files), set only
    when model.weights is (a run resolved without it is what it was before the key existed)."""
    model, train = run["model"], run["train"]
    if model["weights_sha256"] and (
        not model["weights"] or weights.kind(model["weights"]) == "run"
    ):
        raise ConfigError(
            f"{where}: model.weights_sha256 pins the file of model.weights (a file or a "
            "torchvision name), and there is none here; remove it or set model.weights"
        )
    if train["unfreeze_at_epoch"] is not None:
        if not train["freeze"]:
            raise ConfigError(
                f"{where}: train.unfreeze_at_epoch with nothing frozen; set "
                "train.freeze (e.g. backbone) or remove it"
            )
        if train["unfreeze_at_epoch"] > train["epochs"]:
            raise ConfigError(
                f"{where}: train.unfreeze_at_epoch {train['unfreeze_at_epoch']} is after the "
                f"last epoch ({train['epochs']}); lower it or remove it (frozen to the end)"
            )
    found = weights.describe(config, run, lambda name: run_by_name(config, name))
    if found is not None:
        run["weights"] = found


def _dotted(run: dict, key: str):
    """The run's value of a dotted key (every swept key, also one this point left at its base)."""
    node: object = run
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def run_by_name(config: dict, name: str) -> dict:
    """The resolved run called `name` of a validated config (validating that run alone: a
    rule's script calls this, and a sweep may have hundreds of runs)."""
    entries = run_entries(config)
    for entry, where in entries:
        if entry["name"] == name:
            return _resolve(config, entry, where)
    raise ConfigError(f"no run named {name!r}; runs: {[e['name'] for e, _ in entries]}")


def stage_where(runs: list[dict], launcher: str) -> str:
    """Where the stage rule runs for this config: "job" (a Slurm job of its own, through the
    Snakemake Slurm executor plugin) or "login". machine.stage.where, by default job under
    the Slurm launcher and login otherwise; every run must agree (it decides how the one
    stage rule runs). A job needs the Slurm launcher (`snakemake --profile slurm`)."""
    default = "job" if launcher == "slurm" else "login"
    chosen = {run["name"]: run["machine"]["stage"]["where"] or default for run in runs}
    if len(set(chosen.values())) > 1:
        listed = ", ".join(f"{name!r} {where}" for name, where in chosen.items())
        raise ConfigError(
            f"machine.stage.where differs between runs ({listed}); it decides how the one "
            "stage rule runs, so it must be one value for every run: set it at the top level, "
            "not in runs: entries"
        )
    where = next(iter(chosen.values()))
    if where == "job" and launcher != "slurm":
        raise ConfigError(
            "machine.stage.where: job stages in a Slurm job, which needs the Slurm launcher "
            "(snakemake --profile slurm); locally use login or leave it null"
        )
    return where
