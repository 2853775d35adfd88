"""What decides a rerun: the keys that identify a staged dataset (dataset_id, stage_params),
a trained model (training_fingerprint) and an evaluation (evaluation_fingerprint), as
Snakemake rule params, and the one-line account of what changed between two of them.
Keys outside them (VOLATILE_TRAIN_KEYS, DATA_RUNTIME_KEYS, the machine) redo nothing.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any

from ddpflow.config.machine import SHARDED_STRATEGIES
from ddpflow.plugins import is_plugin
from ddpflow.task import DEFAULT_TASK, get_task

# train keys that cannot change a run's result: changing them retrains nothing. strategy:
# zero trains bitwise the same weights as ddp and its checkpoints hold the whole optimizer
# state, so a run switched from one to the other resumes (tests/test_resume_exact.py); fsdp
# sums gradients another way and checkpoints shards: it is part of the fingerprint (with
# its settings), ddp and zero are not; hsdp is fsdp on another mesh (a machine setting: its
# checkpoints resume at any mesh), recorded as fsdp. activation_checkpointing recomputes the
# same values. tensor_parallel is a machine setting like the world size: the same
# micro-batches are computed, only the order of float sums changes, and its checkpoints are
# DCP's, which resume at any degree (1 included)
VOLATILE_TRAIN_KEYS = ("progress", "checkpoint", "max_requeues", "on_nonfinite", "monitor",
                       "strategy", "fsdp", "hsdp", "activation_checkpointing",
                       "tensor_parallel")  # fmt: skip
# train keys that act on GPUs only: on CPU ranks they change nothing, so nothing retrains.
# precision acts on CPU ranks when it is bf16 (fp16 and fp32 train in fp32 there).
# channels_last acts on every device (oneDNN's NHWC convolutions are faster on CPU too), but
# only on models with convolutions: the built-in MLP has none
GPU_ONLY_TRAIN_KEYS = ("precision", "deterministic")
NO_CONV_MODELS = ("mlp",)


# data keys only your own data reads (image_folder, npz): left out of the other sources'
# fingerprints, so their staged datasets and trained models keep their identity
OWN_DATA_KEYS = ("path", "image_size", "channels", "on_corrupt", "kwargs", "labels_csv")
# own-data keys added after runs were trained: left out of ids, params and fingerprints at
# their default (what every run trained before them had), so those runs keep their identity
LATER_DATA_DEFAULTS = {
    "labels_csv": None,
    "block_size": 64,
    "vocab_size": None,
    "tokenizer": "bytes",
    "tokenizer_sha256": None,
}
# the sources of task: language_model (ddpflow.data.text), and the data keys only they read
TOKEN_SOURCES = ("text", "tokens")
TOKEN_DATA_KEYS = ("block_size", "vocab_size", "tokenizer", "tokenizer_sha256")
# data keys that check the data, not define it: data.tokenizer_sha256 pins the file whose
# content data_settings already holds, so pinning it restages and retrains nothing
CHECK_DATA_KEYS = ("tokenizer_sha256",)


def is_own_data(source: str) -> bool:
    return source in ("image_folder", "npz", *TOKEN_SOURCES) or is_plugin(source)


# train keys added after runs were trained (fine-tuning, a language model's fresh windows):
# left out of the fingerprint at their default, which is what every run trained before them did
LATER_TRAIN_DEFAULTS: dict[str, Any] = {
    "freeze": [],
    "unfreeze_at_epoch": None,
    "fresh_windows": False,
}


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
    # image folders and plug-ins hand over PIL images of any size
    resizes = data["source"] == "image_folder" or is_plugin(data["source"])
    return resizes and on_small(data) != ON_SMALL_IMPLIED


def data_keys(data: dict) -> dict:
    """The data keys that define the staged data: those that apply to the source (the
    built-in sources ignore OWN_DATA_KEYS; on_small: see above), without DATA_RUNTIME_KEYS."""
    own = is_own_data(data["source"])
    skip: tuple[str, ...] = DATA_RUNTIME_KEYS if own else DATA_RUNTIME_KEYS + OWN_DATA_KEYS
    skip += CHECK_DATA_KEYS
    if not _on_small_acts(data):
        skip += ("on_small",)
    skip += _at_later_default(data)
    if data["source"] not in TOKEN_SOURCES:
        skip += TOKEN_DATA_KEYS
    return {k: v for k, v in data.items() if k not in skip}


def _at_later_default(data: dict) -> tuple[str, ...]:
    return tuple(k for k, v in LATER_DATA_DEFAULTS.items() if data.get(k, v) == v)


def stage_params(data: dict) -> dict:
    """The stage rule's params (Snakemake restages when they change): the data keys without
    DATA_RUNTIME_KEYS and on_small where it does not act, so that editing those restages
    nothing. (The keys a built-in source ignores stay, as they always were: removing them
    would change every staged dataset's params, and restage it, once.)"""
    acts = _on_small_acts(data)
    skip: tuple[str, ...] = DATA_RUNTIME_KEYS if acts else DATA_RUNTIME_KEYS + ("on_small",)
    skip += _at_later_default(data) + CHECK_DATA_KEYS
    # in the schema's order, not the config file's: Snakemake compares a dict param by its
    # text, so moving a key in config.yaml would otherwise restage (and retrain) the data
    order = {key: index for index, key in enumerate(_schema_data_keys())}
    keys = sorted((k for k in data if k not in skip), key=lambda k: (order.get(k, len(order)), k))
    return {k: data[k] for k in keys}


@functools.cache
def _schema_data_keys() -> tuple[str, ...]:
    from ddpflow.config.schema import load_schema

    return tuple(load_schema()["$defs"]["data"]["properties"])


def data_settings(data: dict) -> dict:
    """data_keys, plus, for your own data, the content of its files (name, size, modification
    time of each: adding, removing or replacing an image restages it, without reading every
    image at each parse) or the plug-in's code."""
    settings = data_keys(data)
    if not is_own_data(data["source"]):
        return settings
    if is_plugin(data["source"]):  # its code is what it reads
        settings["plugin_sha256"] = plugin_source_hash(data["source"])
    else:
        settings["files"] = own_data_listing(data)
    if data.get("tokenizer", "bytes") not in ("bytes", "bpe"):  # a tokenizer.json's content
        settings["tokenizer_file"] = file_sha256(Path(data["tokenizer"]).expanduser())
    if data.get("labels_csv"):  # the table's content: an edited target restages
        table = Path(data["labels_csv"])
        settings["labels_sha256"] = (
            hashlib.sha256(table.read_bytes()).hexdigest() if table.is_file() else "missing"
        )
    if is_plugin(data.get("task", "")):  # a plug-in task's code stages the targets
        settings["task_sha256"] = plugin_source_hash(data["task"])
    return settings


def file_sha256(path: Path) -> str:
    """A file's sha256 ("missing" where it does not exist: staging then says so)."""
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"


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
    micro-batches, with the same draws, at any size: schedule.step_micro_batches), where and how
    the ranks run (launcher, nodes, ranks per node, partition, account, time limit, memory,
    logging, progress, checkpoint cadence): changing those retrains nothing. The eval section
    is the evaluate rule's (training's validation metrics are exact counts, except the float
    validation loss, whose last bits may depend on eval.batch_size)."""
    gpu = bool(run["machine"]["gpus_per_node"])
    ignored: tuple[str, ...] = (
        VOLATILE_TRAIN_KEYS if gpu else VOLATILE_TRAIN_KEYS + GPU_ONLY_TRAIN_KEYS
    )
    if not gpu and run["train"]["precision"] == "bf16":  # bf16 autocast on CPU ranks too
        ignored = tuple(key for key in ignored if key != "precision")
    train = {k: v for k, v in run["train"].items() if k not in ignored}
    # the science a micro-batch decides (checks.norm_batch): the normalisation batch, under
    # the key and value runs recorded before it existed; the micro-batch is the machine's
    chosen = run.get("micro_batch") or {}
    if chosen.get("science") is not None and chosen["size"] == train["micro_batch_size"]:
        train["micro_batch_size"] = chosen["science"]
    train.pop("norm_batch_size", None)
    for key, default in LATER_TRAIN_DEFAULTS.items():  # absent at their default
        if train.get(key, default) == default:
            train.pop(key, None)
    lr_mult = train["optimizer"].get("lr_mult")  # one value: its prefixes may contain dots
    train["optimizer"] = {k: v for k, v in train["optimizer"].items() if k != "lr_mult"}
    if not train["augment"]["enabled"]:  # its settings act only when it is on
        del train["augment"]
    fsdp = run["train"]["strategy"] in SHARDED_STRATEGIES
    if not gpu and (run["model"]["name"] in NO_CONV_MODELS or fsdp):
        del train["channels_last"]  # no convolution to lay out, or fsdp's plain layout
    flat = flatten({"data": data_keys(run["data"]), "model": model_settings(run["model"]),
                    "train": train})  # fmt: skip
    if is_own_data(run["data"]["source"]):  # the files' or the plug-in's content too
        flat["dataset_id"] = run["dataset_id"]
    flat.update(task_settings(run, training=True))
    if lr_mult:
        flat["train.optimizer.lr_mult"] = lr_mult
    if run.get("weights"):  # the file's sha256, or run:NAME's own training fingerprint
        identity = run["weights"].get("sha256") or run["weights"]["source_fingerprint"]
        flat.update({"model.weights": run["weights"]["spec"], "model.weights_sha256": identity})
    if fsdp:  # at any world size and mesh: its checkpoints and layout are fsdp's, even on 1 rank
        flat.update(flatten({"train": {"strategy": "fsdp", "fsdp": run["train"]["fsdp"]}}))
    flat["device"] = "cuda" if gpu else "cpu"
    return flat


BUILT_IN_MODELS = {
    "mlp": ("mlp_hidden",),
    "cnn": ("cnn_channels",),
    "resnet18": (),
    "resnet34": (),
    "gpt": ("kwargs",),
}


def model_settings(model: dict) -> dict[str, Any]:
    """The model keys that shape this model, and only those: editing the MLP's widths does
    not retrain a CNN run. A plug-in's code counts too (its file's sha256)."""
    name = model["name"]
    if name in BUILT_IN_MODELS:
        return {"name": name, **{key: model[key] for key in BUILT_IN_MODELS[name]}}
    settings = {"name": name, "kwargs": model["kwargs"]}
    if is_plugin(name):
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
    it runs (eval.in_train: the training job or a job of its own score alike), and a task's
    settings (a multi-label threshold) other than classification's. eval.stride only where it
    slides the windows: at block_size (or null, its default) it scores what every evaluation
    before the key scored, so a finished run is not evaluated again."""
    slides = run["eval"].get("stride") not in (None, run["data"].get("block_size"))
    skip = ("in_train",) if slides else ("in_train", "stride")
    flat = flatten({"eval": {k: v for k, v in run["eval"].items() if k not in skip}})
    flat.update(task_settings(run, training=False))
    return flat


def task_settings(run: dict, training: bool) -> dict[str, Any]:
    """The task keys of a fingerprint, none for classification (the default: a run trained
    before tasks existed keeps its fingerprints). Training: what of the task changes the
    weights (a regression's loss; a plug-in task's code and kwargs); the task's name is the
    data's (data.task). Evaluation: the task and all its kwargs (a threshold)."""
    name = run.get("task", DEFAULT_TASK)
    if not is_plugin(name) and not get_task(name).named_in_records:
        return {}  # classification: fingerprints as before tasks existed
    if not training:
        return flatten({"task": name, "task_kwargs": run.get("task_kwargs") or {}})
    if is_plugin(name):
        kwargs = flatten({"task_kwargs": run.get("task_kwargs") or {}})
        return {"task_sha256": plugin_source_hash(name), **kwargs}

    return flatten({"task": get_task(name, run.get("task_kwargs") or {}).fingerprint()})


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
