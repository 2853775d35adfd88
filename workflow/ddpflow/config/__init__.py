"""Load, validate and resolve the ddpflow configuration.

One source of truth for the Snakefile (workflow/rules/common.smk), the scripts and the tests:
the JSON schema schema.yaml beside this module (package data, so a non-editable install
has it) holds types, ranges and defaults; this module adds the checks a schema cannot express
and expands the list of named runs.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import importlib.util
import json
import math
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from ddpflow.cluster.slurm_parse import parse_slurm_time
from ddpflow.errors import UserError
from ddpflow.runtime import usable_cores

SCHEMA = (
    "schema.yaml"  # package data beside this module: found by importlib.resources in any install
)
SECTIONS = ("data", "model", "train", "eval", "machine")
# train keys that cannot change a run's result: changing them retrains nothing. strategy:
# zero trains bitwise the same weights as ddp and its checkpoints hold the whole optimizer
# state, so a run switched from one to the other resumes (tests/test_resume_exact.py); fsdp
# sums gradients another way and checkpoints shards: it is part of the fingerprint (with
# its settings), ddp and zero are not. activation_checkpointing recomputes the same values
VOLATILE_TRAIN_KEYS = ("progress", "checkpoint", "max_requeues", "on_nonfinite", "monitor",
                       "strategy", "fsdp", "activation_checkpointing")  # fmt: skip
# train keys that act on GPUs only: on CPU ranks they change nothing, so nothing retrains.
# precision acts on CPU ranks when it is bf16 (fp16 and fp32 train in fp32 there).
# channels_last acts on every device (oneDNN's NHWC convolutions are faster on CPU too), but
# only on models with convolutions: the built-in MLP has none
GPU_ONLY_TRAIN_KEYS = ("precision", "deterministic")
NO_CONV_MODELS = ("mlp",)


class ConfigError(UserError, ValueError):
    """A configuration problem, with the key path and how to fix it."""


def load_schema() -> dict:
    return yaml.safe_load(resources.files(__name__).joinpath(SCHEMA).read_text())


def _defaulting_validator(schema: dict) -> jsonschema.protocols.Validator:
    """A validator that fills `default` values as it validates (as snakemake.utils.validate)."""
    base = jsonschema.Draft202012Validator

    def fill_properties(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for key, sub in properties.items():
                if "default" in sub and key not in instance:
                    instance[key] = copy.deepcopy(sub["default"])
        yield from base.VALIDATORS["properties"](validator, properties, instance, schema)

    # JSON Schema counts 32.0 as an integer; torch does not (randperm(...).split(32.0) fails
    # after the job is queued), so integer keys must be real ints.
    type_checker = base.TYPE_CHECKER.redefine(
        "integer", lambda _, value: isinstance(value, int) and not isinstance(value, bool)
    )
    cls = jsonschema.validators.extend(
        base, {"properties": fill_properties}, type_checker=type_checker
    )
    return cls(schema)


def _key_path(error: jsonschema.ValidationError) -> str:
    parts = [f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path]
    return "".join(parts).lstrip(".") or "<top level>"


def slurm_minutes(text: str) -> int | None:
    """Minutes of a Slurm time string ('1:30:00' -> 90, '2-00' -> 2880, '90' -> 90; seconds
    round up), None if it is not a finite one."""
    try:
        seconds = parse_slurm_time(text)
    except ValueError:
        return None
    return None if seconds is None else math.ceil(seconds / 60)


def _as_number(text: str) -> float | None:
    """'1e-3' -> 0.001: PyYAML follows YAML 1.1, where a float needs a dot ('1.0e-3'), so
    '1e-3' arrives as a string although the user plainly wrote a number."""
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _coerced(error: jsonschema.ValidationError):
    """The value the user unambiguously meant for a string of the wrong type, or None."""
    if error.validator != "type" or not isinstance(error.instance, str):
        return None
    expected = error.validator_value
    expected = [expected] if isinstance(expected, str) else list(expected)
    path = list(error.absolute_path)
    if path and path[-1] == "time_min":
        return slurm_minutes(error.instance)
    number = _as_number(error.instance)
    if number is None:
        return None
    if "number" in expected:
        return number
    if "integer" in expected and number == int(number):
        return int(number)
    return None


def _set_path(config: dict, path: list, value) -> None:
    target = config
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value


def _type_hint(error: jsonschema.ValidationError) -> str:
    path = list(error.absolute_path)
    if path and path[-1] == "time_min":
        return " (minutes, e.g. 90, or a Slurm time such as 1:30:00 or 1-12:00:00)"
    if isinstance(error.instance, str):
        return " (in YAML, a value in quotes is a string: write numbers and true/false bare)"
    return ""


def _describe(error: jsonschema.ValidationError) -> str:
    path = _key_path(error)
    if error.validator == "pattern" and path.endswith(".name"):
        return (
            f"{path}: {error.instance!r} is not a valid run name: use letters, digits, '_', "
            "'.' and '-', starting with a letter or digit (it names folders)"
        )
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed))
        close = {key: difflib.get_close_matches(key, allowed, n=1) for key in extra}
        hints = "".join(f"; did you mean {match[0]!r} for {key!r}?" for key, match in close.items()
                        if match)  # fmt: skip
        return f"{path}: unknown key(s) {extra}{hints} (allowed keys here: {allowed})"
    if error.validator == "enum":
        return f"{path}: {error.instance!r} is not one of {error.validator_value}"
    if error.validator == "anyOf" and path.endswith("data.source"):
        known = error.validator_value[0]["enum"]
        close = difflib.get_close_matches(str(error.instance), known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return (
            f"{path}: {error.instance!r} is neither a built-in source ({', '.join(known)}) nor "
            f"a plug-in written 'package.module:function'{hint}"
        )
    if error.validator == "type":
        return (
            f"{path}: {error.instance!r} has the wrong type; expected {error.validator_value}"
            + _type_hint(error)
        )
    return f"{path}: {error.message}"


def validate(config: dict, where: str = "config") -> dict:
    """Validate in place, filling defaults; ConfigError names the first problem."""
    _refuse_per_rank_batch(config, where)
    validator = _defaulting_validator(load_schema())
    errors = list(validator.iter_errors(config))
    # accept numbers written as strings and Slurm time strings; validate again only then
    while fixes := [(e.absolute_path, v) for e in errors if (v := _coerced(e)) is not None]:
        for path, value in fixes:
            _set_path(config, list(path), value)
        errors = list(validator.iter_errors(config))
    errors.sort(key=lambda e: list(e.absolute_path))
    if errors:
        raise ConfigError(f"{where}: {_describe(errors[0])}")
    return config


# train keys of the per-rank batch that train.global_batch_size / micro_batch_size replaced
PER_RANK_BATCH_KEYS = ("batch_size", "grad_accum_steps")


def _refuse_per_rank_batch(config: dict, where: str) -> None:
    """A config written for the per-rank batch fails in one line that says what to write
    instead: the two new keys with the values that reproduce it at its own world size.
    (Not kept as an alias: a per-rank batch makes the science move with the world size,
    which is exactly what the new keys end.)"""
    sections = [(where, config)]
    runs = config.get("runs")
    if isinstance(runs, list):
        for index, entry in enumerate(runs):
            if isinstance(entry, dict):
                name = entry.get("name", index)
                sections.append((f"{where}: runs[{index}] ({name!r})", entry))
    for place, section in sections:
        train = section.get("train")
        if not isinstance(train, dict) or not set(PER_RANK_BATCH_KEYS) & set(train):
            continue
        top = config.get("train") if isinstance(config.get("train"), dict) else {}
        per_rank = train.get("batch_size", top.get("batch_size", 32))
        accum = train.get("grad_accum_steps", top.get("grad_accum_steps", 1))
        machine = deep_merge(config.get("machine") or {}, section.get("machine") or {})
        try:
            world = world_size(validate({"machine": machine})["machine"])
        except ConfigError:
            world = None
        named = [f"train.{k}" for k in PER_RANK_BATCH_KEYS if k in train]
        keys = " and ".join(named) + (" (per rank) are" if len(named) > 1 else " (per rank) is")
        if isinstance(per_rank, int) and isinstance(accum, int) and world:
            advice = (f"to reproduce batch_size {per_rank} x grad_accum_steps {accum} at world "
                      f"size {world}, set train.global_batch_size: {per_rank * accum * world} "
                      f"and train.micro_batch_size: {per_rank}")  # fmt: skip
        else:
            advice = "set both (docs/configuration: batches)"
        raise ConfigError(
            f"{place}: {keys} replaced by train.global_batch_size (samples per "
            f"optimizer step, at any world size) and train.micro_batch_size (per rank per "
            f"forward/backward); {advice}"
        )


def load(path: str | Path | None = None, overrides: dict | None = None) -> dict:
    """Read a YAML config file (optionally deep-merging overrides), validate it, fill defaults."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of keys")
    return check(deep_merge(raw, overrides or {}))


def deep_merge(base: dict, override: dict) -> dict:
    """A new dict: override's mappings merged key by key into base's (lists are replaced)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def check(config: dict) -> dict:
    """Schema-validate the whole config, then every resolved run; returns the validated config."""
    return check_runs(config)[0]


def check_runs(config: dict) -> tuple[dict, list[dict]]:
    """check() and the resolved runs, validating each run once (the Snakefile's parse)."""
    config = validate(copy.deepcopy(config))
    names = [run["name"] for run in config["runs"]]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"runs: run names must be unique; repeated: {duplicates}")
    runs = resolve_runs(config)
    for run in runs:
        _check_run(run, config["launcher"])
    return config, runs


def resolve_runs(config: dict) -> list[dict]:
    """Each named run: the top-level sections with the run's overrides merged in, validated."""
    runs = []
    for index, entry in enumerate(config["runs"]):
        merged = {key: config[key] for key in ("launcher", "results_dir", "logs_dir")}
        for section in SECTIONS:
            merged[section] = deep_merge(config[section], entry.get(section, {}))
        where = f"runs[{index}] ({entry['name']!r})"
        resolved = validate(merged, where=where)
        resolved["name"] = entry["name"]
        resolved["world_size"] = world_size(resolved["machine"])
        resolved["dataset_id"] = dataset_id(resolved["data"])
        runs.append(resolved)
    return runs


def ranks_per_node(machine: dict) -> int:
    """One rank per GPU; without GPUs, cpu_ranks_per_node CPU ranks (Slurm: tasks per node)."""
    return machine["gpus_per_node"] or machine["cpu_ranks_per_node"]


def world_size(machine: dict) -> int:
    return machine["nodes"] * ranks_per_node(machine)


def accumulation_steps(train: dict, world: int) -> int:
    """Micro-batches each rank computes per optimizer step: global / (micro x world),
    derived (check_world_size has made sure it divides)."""
    return train["global_batch_size"] // (train["micro_batch_size"] * world)


def micro_batches_per_step(train: dict) -> int:
    return train["global_batch_size"] // train["micro_batch_size"]


def working_world_sizes(train: dict) -> list[int]:
    """The world sizes that split a step's micro-batches evenly: divisors of global/micro."""
    count = micro_batches_per_step(train)
    return [w for w in range(1, count + 1) if count % w == 0]


def check_world_size(where: str, train: dict, world: int, machine_text: str = "") -> None:
    """Refuse, before anything is submitted, a world size that cannot compute the recipe's
    global batch in whole micro-batches, naming the sizes that can."""
    global_, micro = train["global_batch_size"], train["micro_batch_size"]
    if global_ % micro:
        raise ConfigError(
            f"{where}: train.global_batch_size {global_} is not a multiple of "
            f"train.micro_batch_size {micro}: a step is a whole number of micro-batches; "
            f"set global_batch_size to a multiple of {micro} (e.g. "
            f"{max(micro, global_ // micro * micro)} or {(global_ // micro + 1) * micro}) or "
            "another micro_batch_size"
        )
    count = global_ // micro
    if count % world:
        works = ", ".join(map(str, working_world_sizes(train)))
        raise ConfigError(
            f"{where}: {global_} = {micro} x world size x accumulation steps "
            f"(train.global_batch_size = train.micro_batch_size x ...), but world size "
            f"{world}{machine_text} does not divide {count} micro-batches: world sizes "
            f"{works} work; {world} does not. Change the machine, or the two batch sizes"
        )


def memory_mb(machine: dict) -> int:
    """Memory per node in MB: what the Slurm job asks for and what the checks compare."""
    return int(machine["mem_gb"] * 1024)


# data keys only your own data reads (image_folder, npz): left out of the other sources'
# fingerprints, so their staged datasets and trained models keep their identity
OWN_DATA_KEYS = ("path", "image_size", "channels", "on_corrupt", "kwargs")


def is_own_data(source: str) -> bool:
    return source in ("image_folder", "npz") or ":" in source


# data keys that say how data is staged or read, not what it is: no staged byte and no
# trained weight depends on them (tests/test_streaming.py), so editing them redoes nothing
DATA_RUNTIME_KEYS = ("stage_threads", "loading")


# data.on_small: what staging does with an image smaller than data.image_size. The dataset
# id is computed at parse time from the config and the folder's listing, without opening an
# image, so it cannot know whether a folder has small images. The rule that follows:
# - upscale is left out of the id, the training fingerprint and the stage rule's params: on
#   a folder with no small image it stages the bytes staged before on_small existed, so the
#   id is unchanged and nothing restages or retrains after the upgrade; a folder with small
#   images was refused before, so no staged data carries its id;
# - skip and error are in them: on a folder with small images, skip stages other images
#   than upscale, and error must really look at the images (under upscale's id, a folder
#   staged with upscaled images would never be checked, or, rerun for its changed params,
#   a refusal would make Snakemake delete a directory that upscale runs share). On a folder
#   without small images they stage the same images into a directory of their own: one
#   restaging and retraining after that edit, the price of not decoding every image at parse;
# - sources that never resize an image (built-in, npz) leave it out whatever its value.
ON_SMALL_IMPLIED = "upscale"  # what a data config without on_small (an id, params) stands for


def on_small(data: dict) -> str:
    return data.get("on_small", ON_SMALL_IMPLIED)


def _on_small_acts(data: dict) -> bool:
    resizes = data["source"] == "image_folder" or ":" in data["source"]  # a plug-in's PIL images
    return resizes and on_small(data) != ON_SMALL_IMPLIED


def data_keys(data: dict) -> dict:
    """The data keys that define the staged data: those that apply to the source (the
    built-in sources ignore OWN_DATA_KEYS; on_small: see above), without DATA_RUNTIME_KEYS."""
    skip = DATA_RUNTIME_KEYS if is_own_data(data["source"]) else DATA_RUNTIME_KEYS + OWN_DATA_KEYS
    if not _on_small_acts(data):
        skip += ("on_small",)
    return {k: v for k, v in data.items() if k not in skip}


def stage_params(data: dict) -> dict:
    """The stage rule's params (Snakemake restages when they change): the data keys without
    DATA_RUNTIME_KEYS and on_small where it does not act, so that editing those restages
    nothing. (The keys a built-in source ignores stay, as they always were: removing them
    would change every staged dataset's params, and restage it, once.)"""
    skip = DATA_RUNTIME_KEYS if _on_small_acts(data) else DATA_RUNTIME_KEYS + ("on_small",)
    return {k: v for k, v in data.items() if k not in skip}


def data_settings(data: dict) -> dict:
    """data_keys, plus, for your own data, the content of its files (name, size, modification
    time of each: adding, removing or replacing an image restages it, without reading every
    image at each parse) or the plug-in's code."""
    settings = data_keys(data)
    if not is_own_data(data["source"]):
        return settings
    if ":" in data["source"]:  # a plug-in: its code is what it reads
        settings["plugin_sha256"] = plugin_source_hash(data["source"])
    else:
        settings["files"] = own_data_listing(data)
    return settings


def own_data_listing(data: dict) -> str:
    """sha256 of (relative path, size, mtime) of every file of an image folder or npz file;
    "missing" where it does not exist (staging then says what is wrong)."""
    root = Path(data["root"] if data["source"] == "image_folder" else data["path"] or "")
    digest = hashlib.sha256()
    if root.is_file():
        stat = root.stat()
        digest.update(f"{root.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    elif root.is_dir():
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(files):
                path = Path(folder, name)
                stat = path.stat()
                rel = path.relative_to(root).as_posix()
                digest.update(f"{rel}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    else:
        return "missing"
    return digest.hexdigest()


def dataset_id(data: dict) -> str:
    """Directory name of a staged dataset: runs with the same data share one staging."""
    prefix = re.sub(r"\W", "_", data["source"])  # a plug-in's "pkg.module:fn" too
    return f"{prefix}-{config_hash(data_settings(data))[:10]}"


def config_hash(section: Any) -> str:
    return hashlib.sha256(json.dumps(section, sort_keys=True).encode()).hexdigest()


def run_by_name(config: dict, name: str) -> dict:
    """The resolved run called `name` of a validated config."""
    for run in resolve_runs(config):
        if run["name"] == name:
            return run
    raise ConfigError(f"no run named {name!r}; runs: {[r['name'] for r in config['runs']]}")


def flatten(section: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay whole (they are one value to the user)."""
    if not isinstance(section, dict):
        return {prefix: section}
    out: dict[str, Any] = {}
    for key, value in section.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else key))
    return out


def training_fingerprint(run: dict) -> dict[str, Any]:
    """Every key that determines a trained model, flat: the data, model and training settings
    and the device kind. Not in it: the world size (every step computes the same
    micro-batches, with the same draws, at any size: loop.step_micro_batches), where and how
    the ranks run (launcher, nodes, ranks per node, partition, account, time limit, memory,
    logging, progress, checkpoint cadence): changing those retrains nothing. The eval section
    is the evaluate rule's (training's validation metrics are exact counts, except the float
    validation loss, whose last bits may depend on eval.batch_size)."""
    gpu = bool(run["machine"]["gpus_per_node"])
    ignored = VOLATILE_TRAIN_KEYS if gpu else VOLATILE_TRAIN_KEYS + GPU_ONLY_TRAIN_KEYS
    if not gpu and run["train"]["precision"] == "bf16":  # bf16 autocast on CPU ranks too
        ignored = tuple(key for key in ignored if key != "precision")
    train = {k: v for k, v in run["train"].items() if k not in ignored}
    if not train["augment"]["enabled"]:  # its settings act only when it is on
        del train["augment"]
    fsdp = run["train"]["strategy"] == "fsdp"
    if not gpu and (run["model"]["name"] in NO_CONV_MODELS or fsdp):
        del train["channels_last"]  # no convolution to lay out, or fsdp's plain layout
    flat = flatten({"data": data_keys(run["data"]), "model": model_settings(run["model"]),
                    "train": train})  # fmt: skip
    if is_own_data(run["data"]["source"]):  # the files' or the plug-in's content too
        flat["dataset_id"] = run["dataset_id"]
    if fsdp:  # at any world size: its checkpoints and layout are fsdp's, even on 1 rank
        flat.update(flatten({"train": {"strategy": "fsdp", "fsdp": run["train"]["fsdp"]}}))
    flat["device"] = "cuda" if gpu else "cpu"
    return flat


def trains_sharded(run: dict) -> bool:
    """Whether the run trains under fsdp (a 1-rank run trains as ddp)."""
    return run["train"]["strategy"] == "fsdp" and run["world_size"] > 1


def uses_channels_last(run: dict) -> bool:
    """train.channels_last, except under fsdp (at any world size, so that the layout does
    not change with it): FSDP2 shards contiguous parameters only. Training and both
    evaluations lay the model out alike, so that they score alike."""
    return run["train"]["channels_last"] and run["train"]["strategy"] != "fsdp"


BUILT_IN_MODELS = {"mlp": ("mlp_hidden",), "cnn": ("cnn_channels",), "resnet18": (),
                   "resnet34": ()}  # fmt: skip


def model_settings(model: dict) -> dict[str, Any]:
    """The model keys that shape this model, and only those: editing the MLP's widths does
    not retrain a CNN run. A plug-in's code counts too (its file's sha256)."""
    name = model["name"]
    if name in BUILT_IN_MODELS:
        return {"name": name, **{key: model[key] for key in BUILT_IN_MODELS[name]}}
    settings = {"name": name, "kwargs": model["kwargs"]}
    if ":" in name:
        settings["plugin_sha256"] = plugin_source_hash(name)
    else:  # a torchvision model
        settings["small_input_stem"] = model["small_input_stem"]
    return settings


def plugin_source(spec: str) -> Path | None:
    """The file of a plug-in's module ('package.module:function'), found without running it:
    the working directory first, as the ranks import it, then the environment."""
    module = spec.partition(":")[0]
    origin = Path(*module.split(".")).with_suffix(".py")
    if origin.is_file():
        return origin.resolve()
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if found is None or not found.origin or not Path(found.origin).is_file():
        return None
    return Path(found.origin)


def plugin_source_hash(spec: str) -> str:
    """sha256 of a plug-in module's file: editing the model's code retrains like editing the
    config ("unresolved" where it cannot be found; the train rule then names the cause)."""
    origin = plugin_source(spec)
    return hashlib.sha256(origin.read_bytes()).hexdigest() if origin else "unresolved"


def evaluation_fingerprint(run: dict) -> dict[str, Any]:
    """What determines an evaluation besides the model file: the eval section, less where
    it runs (eval.in_train: the training job or a job of its own score alike)."""
    return flatten({"eval": {k: v for k, v in run["eval"].items() if k != "in_train"}})


def as_params(fingerprint: dict[str, Any]) -> list[str]:
    """One `key=value` string per key: Snakemake compares a rule's params as a set and names
    the differing members, so its rerun reason lists exactly the keys that changed."""
    return [f"{key}={json.dumps(value)}" for key, value in sorted(fingerprint.items())]


def describe_changes(old: dict[str, Any], new: dict[str, Any]) -> str:
    """'train.optimizer.lr 0.05 -> 0.02, world_size 2 -> 4' (empty when nothing changed). A
    key on one side only did not act on the other (augmentation off, a key a model or device
    ignores, or one that an older ddpflow did not apply): '(not in effect)'."""
    missing = object()

    def shown(value) -> str:
        return "(not in effect)" if value is missing else json.dumps(value)

    return ", ".join(
        f"{key} {shown(old.get(key, missing))} -> {shown(new.get(key, missing))}"
        for key in sorted(set(old) | set(new))
        if old.get(key, missing) != new.get(key, missing)
    )


def _check_run(run: dict, launcher: str) -> None:
    where = f"runs ({run['name']!r})"
    machine, train = run["machine"], run["train"]
    if launcher == "local" and machine["nodes"] > 1:
        raise ConfigError(
            f"{where}: machine.nodes is {machine['nodes']} but the local launcher runs on one "
            "machine; set machine.nodes: 1 or run with --profile profiles/slurm"
        )
    if launcher == "local" and machine["gpus_per_node"]:
        _check_local_gpus(where, machine["gpus_per_node"])
    _check_min_nodes(where, machine)
    if train["strategy"] == "fsdp":
        _check_fsdp(where, run)
    if train["activation_checkpointing"] and train["compile"]:
        raise ConfigError(
            f"{where}: train.activation_checkpointing with train.compile: true is not "
            "supported yet; set one of them to false"
        )
    data = run["data"]
    if data["source"] == "image_folder" and data["image_size"] is None:
        raise ConfigError(
            f"{where}: data.image_size is required for data.source image_folder: the "
            "[height, width] every image is resized to, e.g. data.image_size: [32, 32]"
        )
    if data["source"] == "npz" and not data["path"]:
        raise ConfigError(
            f"{where}: data.path is required for data.source npz: the .npz file to read"
        )
    model = run["model"]
    if model["name"] in BUILT_IN_MODELS and model["kwargs"]:
        raise ConfigError(
            f"{where}: model.kwargs {model['kwargs']} is set for the built-in model "
            f"{model['name']!r}, which takes none (they are for torchvision models and "
            f"plug-ins); remove model.kwargs, or use the built-in model's own keys "
            f"(model.cnn_channels, model.mlp_hidden)"
        )
    world = run["world_size"]
    machine_text = f" (machine.nodes {machine['nodes']} x {ranks_per_node(machine)} ranks)"
    check_world_size(where, train, world, machine_text)
    samples = run["data"]["max_train_samples"]
    if samples is not None and samples < train["global_batch_size"]:
        raise ConfigError(
            f"{where}: data.max_train_samples is {samples}, less than one global batch "
            f"(train.global_batch_size {train['global_batch_size']}): an epoch would have no "
            f"step; raise max_train_samples or lower global_batch_size"
        )
    # torch 2.14 fails an internal assert at the first no_sync micro-step with a static graph
    # (pytorch/pytorch#143580): refuse it here, not minutes later on every rank
    accum = accumulation_steps(train, world)
    if train["ddp"]["static_graph"] and accum > 1 and world > 1:
        raise ConfigError(
            f"{where}: train.ddp.static_graph is true with {accum} accumulation steps per "
            f"rank (global_batch_size {train['global_batch_size']} / (micro_batch_size "
            f"{train['micro_batch_size']} x world size {world})): DDP's static graph does not "
            "support skipping the all-reduce on accumulation steps; set "
            "train.ddp.static_graph: false, or micro_batch_size x world size = global_batch_size"
        )


def _check_fsdp(where: str, run: dict) -> None:
    """Combinations strategy fsdp does not support, refused before anything is submitted."""
    train, gpu = run["train"], bool(run["machine"]["gpus_per_node"])
    if gpu and train["precision"] == "fp16":
        raise ConfigError(
            f"{where}: train.strategy fsdp with train.precision fp16: fp16's gradient scaler "
            "is not built for sharded gradients here; use train.precision: bf16 (FSDP's "
            "mixed precision: bf16 parameters and compute, fp32 gradient reduction)"
        )
    if train["compile"]:
        raise ConfigError(
            f"{where}: train.strategy fsdp with train.compile: true is not supported yet; "
            "set train.compile: false, or train.strategy: ddp or zero"
        )
    if train["fsdp"]["cpu_offload"] and not gpu:
        raise ConfigError(
            f"{where}: train.fsdp.cpu_offload is true but the run has no GPU "
            "(machine.gpus_per_node is 0): everything is in host memory already; set "
            "train.fsdp.cpu_offload: false"
        )


def _check_min_nodes(where: str, machine: dict) -> None:
    fewest = machine["min_nodes"]
    if fewest is not None and fewest > machine["nodes"]:
        raise ConfigError(
            f"{where}: machine.min_nodes is {fewest} but machine.nodes is {machine['nodes']}: "
            "min_nodes is the fewest nodes a submission may shrink to after node failures; "
            f"set machine.min_nodes to at most {machine['nodes']} (or null to always run on "
            "machine.nodes)"
        )


def _check_local_gpus(where: str, wanted: int) -> None:
    """The local launcher runs on this machine: it must have the GPUs asked for (counted
    without importing torch: CUDA_VISIBLE_DEVICES, else the NVIDIA driver's device list)."""
    if os.environ.get("DDPFLOW_ALLOW_CPU_FALLBACK") == "1":
        return
    found = local_gpu_count()
    if found >= wanted:
        return
    have = "no NVIDIA GPU" if found == 0 else f"{found} GPU(s)"
    raise ConfigError(
        f"{where}: machine.gpus_per_node is {wanted} but this machine has {have} (counted from "
        "CUDA_VISIBLE_DEVICES, else /dev/nvidia*) and the local launcher runs here; set "
        "machine.gpus_per_node: 0 for CPU ranks, or run on a GPU machine or cluster "
        "(--profile slurm)"
    )


def local_gpu_count() -> int:
    """GPUs a process here may use: CUDA_VISIBLE_DEVICES when set, else the NVIDIA device
    files (/dev/nvidia0, ...: what a container is given), else the driver's list."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    devices = [p for p in Path("/dev").glob("nvidia*") if p.name[len("nvidia") :].isdigit()]
    if devices:
        return len(devices)
    driver = Path("/proc/driver/nvidia/gpus")
    return len(list(driver.iterdir())) if driver.is_dir() else 0


def run_warnings(run: dict, launcher: str) -> list[str]:
    """Legal but suspicious settings: the run starts, and these lines say what looks wrong."""
    where = f"run {run['name']!r}"
    machine, train, out = run["machine"], run["train"], []
    if train["warmup_epochs"] > train["epochs"]:
        reached = train["epochs"] / train["warmup_epochs"]
        out.append(
            f"{where}: train.warmup_epochs {train['warmup_epochs']} is more than train.epochs "
            f"{train['epochs']}: the learning rate only reaches {reached:.0%} of its value; "
            "lower warmup_epochs"
        )
    if train["precision"] == "fp16" and not machine["gpus_per_node"]:
        out.append(
            f"{where}: train.precision fp16 on CPU ranks (machine.gpus_per_node 0) trains in "
            "fp32: fp16 is for GPUs; for mixed precision on a CPU set train.precision: bf16"
        )
    if trains_sharded(run):
        defaults = validate({})["train"]["ddp"]
        changed = sorted(k for k, v in train["ddp"].items() if v != defaults[k])
        if changed:
            out.append(
                f"{where}: train.ddp.{', train.ddp.'.join(changed)} set, but strategy fsdp "
                "does not use DistributedDataParallel: these settings are ignored"
            )
    if launcher == "local" and not machine["gpus_per_node"]:
        cores = usable_cores()
        wanted = machine["cpu_ranks_per_node"] * machine["cpus_per_task"]
        if cores and wanted > cores:
            out.append(
                f"{where}: machine.cpu_ranks_per_node {machine['cpu_ranks_per_node']} x "
                f"cpus_per_task {machine['cpus_per_task']} = {wanted} threads on this "
                f"machine's {cores} cores: the ranks will contend and train slower than "
                f"fewer would; set cpu_ranks_per_node to at most "
                f"{max(1, cores // machine['cpus_per_task'])}"
            )
        if train["precision"] == "bf16" and not cpu_computes_bf16():
            out.append(
                f"{where}: train.precision bf16, but this machine's CPU has no bf16 "
                "instructions (AMX or AVX512-BF16 in /proc/cpuinfo): oneDNN would emulate "
                "bf16, likely slower than fp32; set train.precision: fp32"
            )
    return out


def cpu_computes_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this machine's CPU has bf16 instructions (read without importing torch;
    the ranks ask oneDNN itself, loop.cpu_has_native_bf16). True where unknown."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return True
    flags = next((line for line in text.splitlines() if line.startswith("flags")), None)
    return flags is None or bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


def check_batch_fits(run: dict, train_samples: int) -> None:
    """Before the training job is submitted: an epoch takes floor(samples / global batch)
    steps, so a global batch larger than the staged training split would train nothing."""
    global_, micro = run["train"]["global_batch_size"], run["train"]["micro_batch_size"]
    if global_ > train_samples:
        unit = micro * run["world_size"]  # a global batch this world size can split
        fits = train_samples // unit * unit
        advice = (
            f"set train.global_batch_size to at most {fits} (a multiple of micro_batch_size "
            f"{micro} x world size {run['world_size']})"
            if fits
            else f"lower train.micro_batch_size (now {micro}) and the global batch"
        )
        raise ConfigError(
            f"run {run['name']!r}: train.global_batch_size is {global_} but the staged "
            f"training split has only {train_samples} samples, so an epoch would have no "
            f"optimizer step; {advice}"
        )
