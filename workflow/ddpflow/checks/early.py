"""The train rule's own refusals, made while Snakemake parses the workflow, before any job.

The train rule refuses a global batch larger than the staged training split and a model that
cannot be built or cannot take the data's shape (pipeline._check_user_model). Made there, a
refusal comes after Snakemake has removed the run's previous outputs (ddpflow.kept brings
them back); made here, from the staged manifest of each run whose data is staged already, it
comes before anything is planned, in `snakemake -n` too. A run whose data is not staged yet
has no finished outputs to lose: its train rule checks it after staging.

Each run's memory is estimated here too (ddpflow.checks.memory, from figures that
ddpflow.training.footprint measures on fake tensors), for every run whose input shape is known:
from its staged manifest, or before staging from the config (built-in datasets, synthetic,
image_folder's data.image_size). A run that cannot fit its ranks' memory is refused before
anything is queued; one above 80% is warned about. npz and plug-in data are estimated by the
train rule, after staging and before the training job is queued.

Building a torchvision or plug-in model needs torch, which the parse does not import: those
checks and measurements run in one subprocess for all runs. A model that passed (the same
config, shape, class count, plug-in code and torch) is not checked again
(.snakemake/ddpflow/models.json), and a measurement is kept by what it measured in the user's
cache (footprints.json under $XDG_CACHE_HOME/ddpflow, else ~/.cache/ddpflow), shared by every
workflow.

    check_before_jobs(runs, "results", ".snakemake/ddpflow")          # raises ConfigError
    python -m ddpflow.checks.early request.json answer.json                   # the subprocess
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from ddpflow.checks import memory
from ddpflow.checks.batch import check_batch_fits
from ddpflow.checks.host import local_gpu_memory_bytes, missing_data, user_cache_dir, version
from ddpflow.checks.weight_files import refusal
from ddpflow.config.fingerprint import BUILT_IN_MODELS, config_hash, plugin_source_hash
from ddpflow.config.machine import uses_channels_last
from ddpflow.config.schema import ConfigError
from ddpflow.data.windows import train_samples
from ddpflow.paths import staged_dir
from ddpflow.plugins import is_plugin
from ddpflow.runtime import atomic_write_json

log = logging.getLogger(__name__)

CACHE = "models.json"
FOOTPRINTS = "footprints.json"
# footprints.json's entry for a rank's process before its first tensor (anonymous and
# file-backed resident bytes: training.footprint.process_memory)
RUNTIME = "process_memory"
# the input shape and class count of the built-in datasets, known before they are staged
BUILT_IN_SHAPES = {
    "digits": ([1, 8, 8], 10),
    "mnist": ([1, 28, 28], 10),
    "fashion_mnist": ([1, 28, 28], 10),
    "cifar10": ([3, 32, 32], 10),
    "cifar100": ([3, 32, 32], 100),
}
# what input_of tells of a run: (input shape, model outputs, data bytes a rank holds, rows)
RunInput = tuple[list[int], int, int, int | None]


def check_before_jobs(
    runs: list[dict],
    results: str,
    cache_dir: str | Path,
    gpu_types: dict | None = None,  # {run: its Slurm partition, memory_knobs.Partition}
    warn=None,
) -> list[str]:
    """Refuse, naming every problem of every run at once, what the train rule would; return
    the memory estimate's line of each run it could estimate (those near the limit also go
    to `warn`)."""
    problems, manifests, inputs = [], {}, {}
    models: dict[str, tuple[dict, list[str]]] = {}
    for run in runs:
        dataset = run["dataset_id"]  # a sweep's runs share a few datasets: each read once
        if dataset not in manifests:
            manifests[dataset] = _manifest(staged_dir(results, dataset))
        manifest = manifests[dataset]
        inputs[run["name"]] = input_of(run, manifest)
        if manifest is None:  # staging will read the files: they must be there
            problems += missing_data(run)
            continue
        try:
            check_batch_fits(run, train_samples(run, manifest))
        except ConfigError as err:
            problems.append(str(err))
        check = model_check(run, manifest)
        if run["model"]["name"] not in BUILT_IN_MODELS or fine_tunes(check):
            models.setdefault(_key(check), (check, []))[1].append(run["name"])
    model_problems, verdicts = memory_verdicts(runs, inputs, cache_dir, gpu_types, models)
    problems += model_problems
    for verdict, text in verdicts.values():
        if verdict == "refused":
            problems.append(text)
        elif verdict == "tight" and warn is not None:
            warn(text)
    if problems:
        raise ConfigError("\n".join(problems))
    return [text for _, text in verdicts.values()]


def memory_verdicts(
    runs: list[dict],
    inputs: dict[str, RunInput | None],
    cache_dir: str | Path,
    gpu_types: dict | None = None,  # {run: its Slurm partition, memory_knobs.Partition}
    models: dict | None = None,
) -> tuple[list[str], dict[str, tuple[str, str]]]:
    """(the models' problems, {run: (verdict, line)}) for the runs whose input is known
    (input_of); the models to check (check_before_jobs) share the one subprocess."""
    keys, requests = {}, {}
    for run in runs:
        request = footprint_request(run, inputs[run["name"]])
        if request is not None:
            keys[run["name"]] = key = footprint_key(request)
            requests[key] = request
    model_problems, measured = measure(models or {}, requests, Path(cache_dir) / CACHE)
    verdicts = {}
    for run in runs:
        figures = measured.get(keys.get(run["name"], ""))
        if not figures:
            continue
        refused = any(f"'{run['name']}'" in problem for problem in model_problems)
        if "error" in figures and not refused:  # a refused model is said once, below
            log.warning("run %r: memory not estimated: %s", run["name"], figures["error"])
        if "error" in figures:
            continue
        part = (gpu_types or {}).get(run["name"])
        verdicts[run["name"]] = _judge(run, inputs[run["name"]], figures, measured, part)
        if verdicts[run["name"]][0] == "refused":  # its model knobs, measured on their own
            variants = _measure_variants(run, inputs[run["name"]], cache_dir)
            verdicts[run["name"]] = _judge(
                run, inputs[run["name"]], figures, measured, part, variants
            )
    return model_problems, verdicts


def _measure_variants(run: dict, inputs, cache_dir: str | Path) -> dict[str, dict]:
    """The figures of each model-side knob of a refused run (memory_knobs.variant_runs)."""
    from ddpflow.checks.memory_knobs import variant_runs

    keys, requests = {}, {}
    for knob, variant in variant_runs(run).items():
        request = footprint_request(variant, inputs)
        assert request is not None, "a refused run's input is known"
        keys[knob] = key = footprint_key(request)
        requests[key] = request
    _, measured = measure({}, requests, Path(cache_dir) / CACHE)
    return {knob: measured[key] for knob, key in keys.items() if key in measured}


def input_of(run: dict, manifest: dict | None) -> RunInput | None:
    """(input shape, model outputs, bytes of data the rank holds, the most rows the training
    job scores in one split) of run: from the staged manifest, or from the config before
    staging where it decides them (data: 0, rows: None then); None where only staging tells
    (npz, plug-in data)."""
    if manifest is not None:  # the model's outputs: num_classes for every task (Task.outputs)
        sizes, split = manifest["sizes"], run["eval"]["split"]
        rows = max(sizes.get("val", 0), sizes.get(split, 0) if run["eval"]["in_train"] else 0)
        return manifest["shape"], int(manifest["num_classes"]), _data_bytes(run, manifest), rows
    data = run["data"]
    if "task" in data:  # a task that stages its own targets (config.runs names it there)
        return None  # the targets' width comes from the staged data
    if data["source"] in BUILT_IN_SHAPES:
        shape, classes = BUILT_IN_SHAPES[data["source"]]
        return shape, classes, 0, None
    if data["source"] == "synthetic":
        syn = data["synthetic"]
        return [syn["channels"], syn["height"], syn["width"]], syn["num_classes"], 0, None
    if data["source"] == "image_folder" and data["image_size"]:
        train = Path(data["root"]) / "train"
        classes = len([p for p in train.iterdir() if p.is_dir()]) if train.is_dir() else 0
        return [data["channels"], *data["image_size"]], max(classes, 2), 0, None
    return None


def _data_bytes(run: dict, manifest: dict) -> int:
    """The images a rank keeps in memory (ddpflow.data.staged.choose_in_memory decides as
    the ranks do), else the batches its DataLoader workers hold in flight."""
    from ddpflow.data.staged import choose_in_memory

    uses = {"train", "val", run["eval"]["split"] if run["eval"]["in_train"] else "train"}
    sample = math.prod(manifest["shape"])
    nbytes = sum(manifest["sizes"][split] for split in uses) * sample
    if choose_in_memory(run, nbytes)[0]:
        return nbytes
    loading = run["data"]["loading"]
    return loading["workers"] * loading["prefetch"] * run["train"]["micro_batch_size"] * sample


def footprint_request(run: dict, inputs) -> dict | None:
    if inputs is None:
        return None
    shape, outputs = inputs[0], inputs[1]
    request = memory.figures_request(run, shape, outputs, inputs[3] if len(inputs) > 3 else None)
    name = run["model"]["name"]
    request["code"] = plugin_source_hash(name) if is_plugin(name) else version("torchvision")
    request["torch"] = version("torch")
    request["method"] = _METHOD  # a new ddpflow that measures otherwise measures again
    return request


_METHOD = config_hash((Path(__file__).parents[1] / "training" / "footprint.py").read_text())[:16]


def footprint_key(request: dict) -> str:
    return config_hash(request)


def _judge(run: dict, inputs, figures: dict, measured: dict, part, variants=None):
    """(verdict, line) of run from its measured figures (memory.estimate, capacity, judge);
    part: its Slurm partition's memory_knobs.Partition (None: not on Slurm, or not asked)."""
    process = measured.get(RUNTIME) or {"anon": 0, "file": 0}
    room, room_text = room_of(run, measured, part)
    if run["eval"]["batch_size"] == "auto":  # judged at the batch it chooses
        size = memory.auto_eval_batch(run, figures, process, inputs[2], room)
        figures = memory.with_eval_batch(figures, size)
    est = memory.estimate(run, figures, process, inputs[2])
    return memory.judge(run, est, room, room_text, figures, variants, part)


def room_of(run: dict, measured: dict, part) -> tuple[int | None, str]:
    """memory.capacity of run's ranks, with this machine's GPU where the local launcher
    runs GPU ranks (measured by the subprocess, else the driver's cached answer)."""
    local_gpu = measured.get("gpu_bytes")
    if local_gpu is None and run["launcher"] == "local" and run["machine"]["gpus_per_node"]:
        local_gpu = local_gpu_memory_bytes()
    types = list(part.gpu_types) if part else []
    return memory.capacity(run, run["launcher"], local_gpu, types)


def _manifest(staged: Path) -> dict | None:
    try:
        return json.loads((staged / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def model_check(run: dict, manifest: dict) -> dict:
    return {
        "model": run["model"],
        "shape": manifest["shape"],
        "num_classes": manifest["num_classes"],
        "channels_last": uses_channels_last(run),
        # fine-tuning: the weights file against the model (its sha256 in the key), and
        # the parameter names train.freeze and lr_mult give (training.weights)
        **({"weights": run["weights"]} if _weights_ready(run) else {}),
        **({"freeze": run["train"]["freeze"]} if run["train"]["freeze"] else {}),
        **(
            {"lr_mult": run["train"]["optimizer"]["lr_mult"]}
            if run["train"]["optimizer"]["lr_mult"]
            else {}
        ),
    }


FINE_TUNING_KEYS = ("weights", "freeze", "lr_mult")


def fine_tunes(check: dict) -> bool:
    """Whether a model check has fine-tuning to check (training.weights.check_fine_tuning)."""
    return any(key in check for key in FINE_TUNING_KEYS)


def _weights_ready(run: dict) -> bool:
    """The run's weights file is there and sound (else the train rule's input names what is
    wrong, when a training is planned: `snakemake fetch_weights` is not held up by it)."""
    weights = run.get("weights")
    if not weights:
        return False
    return Path(weights["path"]).is_file() and refusal(run) is None


def _key(check: dict) -> str:
    name = check["model"]["name"]
    code = plugin_source_hash(name) if is_plugin(name) else version("torchvision")
    return config_hash({**check, "code": code, "torch": version("torch")})


def measure(
    models: dict[str, tuple[dict, list[str]]], footprints: dict[str, dict], cache: Path
) -> tuple[list[str], dict]:
    """Check the models not checked before and measure the footprints not measured before,
    in one subprocess; remember the models that pass and every measurement. Returns (the
    models' problems, every footprint by key plus RUNTIME and gpu_bytes)."""
    passed = set(_read_cache(cache))
    known = read_footprints()
    todo = {key: check for key, (check, _) in models.items() if key not in passed}
    measure = {key: request for key, request in footprints.items() if key not in known}
    # the subprocess also measures a rank's process (RUNTIME), once for all footprints
    if not todo and not measure and (RUNTIME in known or not footprints):
        return [], known
    cache.parent.mkdir(parents=True, exist_ok=True)
    request = cache.with_name(f"request-{config_hash([sorted(todo), sorted(measure)])[:12]}.json")
    answer = request.with_suffix(".out.json")
    request.write_text(json.dumps({"models": todo, "footprints": measure}))
    done = subprocess.run(
        [sys.executable, "-m", "ddpflow.checks.early", str(request), str(answer)],
        capture_output=True,
        text=True,
    )
    request.unlink(missing_ok=True)
    if done.returncode != 0 or not answer.is_file():
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        if todo:
            return [f"the model check before any job could not run: {tail}"], known
        log.warning("memory not estimated: the measurement could not run: %s", tail)
        return [], known
    result = json.loads(answer.read_text())
    answer.unlink()
    errors = result["models"]
    cache.write_text(json.dumps(sorted(passed | {k for k in todo if errors[k] is None})))
    known = {**known, **result["footprints"], RUNTIME: result[RUNTIME]}
    _write_footprints(known)
    known["gpu_bytes"] = result.get("gpu_bytes")
    return [
        f"runs {', '.join(repr(n) for n in models[key][1])}: {error}"
        for key, error in errors.items()
        if error is not None
    ], known


def read_footprints() -> dict:
    """What was measured before (this user's cache): footprints by key, and RUNTIME."""
    try:
        known = json.loads((user_cache_dir() / FOOTPRINTS).read_text())
        return known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_footprints(known: dict) -> None:
    """Kept by what was measured (a measurement that failed is kept too: it fails again
    until the model, its code or torch changes, which changes the key)."""
    path = user_cache_dir() / FOOTPRINTS
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {k: v for k, v in known.items() if k != "gpu_bytes"})
    except OSError as err:  # a read-only home: measured again next time
        log.warning("memory estimates not kept (%s): %s", path, err)


def _read_cache(cache: Path) -> list[str]:
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        return []


def _run_checks(request: Path) -> dict:
    """In the subprocess: each model built and run once (training.models.check_model), each
    footprint measured (training.footprint.measure), and this process's own memory."""
    from ddpflow.training import footprint

    asked = json.loads(request.read_text())
    runtime = footprint.process_memory()  # before anything is measured
    models = _check_each(asked["models"])
    measured: dict[str, dict[str, Any]] = {}
    for key, want in asked["footprints"].items():
        try:
            keys = ("shape", "outputs", "micro_batch", "precision", "device_type")
            args = {k: want[k] for k in (*keys, "checkpointing", "optimizer", "eval_batch")}
            measured[key] = footprint.measure(want["model"], **args)
        except Exception as err:  # noqa: BLE001 - never blocks a run: it goes unestimated
            measured[key] = {"error": f"{type(err).__name__}: {err}"[:300]}
    gpu = footprint.local_gpu_bytes()
    return {"models": models, "footprints": measured, RUNTIME: runtime, "gpu_bytes": gpu}


def _check_each(checks: dict) -> dict[str, str | None]:
    from ddpflow.errors import UserError
    from ddpflow.training.models import check_model
    from ddpflow.training.weights import check_fine_tuning

    errors: dict[str, str | None] = {}
    for key, check in checks.items():
        try:
            shape, classes = check["shape"], check["num_classes"]
            check_model(check["model"], shape, classes, check["channels_last"])
            check_fine_tuning(check)
            errors[key] = None
        except UserError as err:
            errors[key] = str(err)
        except Exception as err:  # noqa: BLE001 - a plug-in may raise anything: name it
            errors[key] = f"model.name {check['model']['name']!r}: {type(err).__name__}: {err}"
    return errors


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(_run_checks(Path(sys.argv[1]))))
