"""The train rule's own refusals, made while Snakemake parses the workflow, before any job.

The train rule refuses a global batch larger than the staged training split and a model that
cannot be built or cannot take the data's shape (pipeline._check_user_model). Made there, a
refusal comes after Snakemake has removed the run's previous outputs (ddpflow.kept brings
them back); made here, from the staged manifest of each run whose data is staged already, it
comes before anything is planned, in `snakemake -n` too. A run whose data is not staged yet
has no finished outputs to lose: its train rule checks it after staging.

Building a torchvision or plug-in model needs torch, which the parse does not import: those
checks run in one subprocess for all runs, and a model that passed (the same config, shape,
class count, plug-in code and torch) is not checked again (.snakemake/ddpflow/models.json).

    check_before_jobs(runs, "results", ".snakemake/ddpflow")          # raises ConfigError
    python -m ddpflow.early request.json answer.json                   # the subprocess
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from ddpflow.config import ConfigError, check_batch_fits, config_hash
from ddpflow.config.fingerprint import BUILT_IN_MODELS, plugin_source_hash
from ddpflow.config.machine import uses_channels_last
from ddpflow.paths import staged_dir
from ddpflow.plugins import is_plugin

CACHE = "models.json"


def check_before_jobs(runs: list[dict], results: str, cache_dir: str | Path) -> None:
    """Refuse, naming every problem of every run at once, what the train rule would."""
    problems, models, manifests = [], {}, {}
    for run in runs:
        dataset = run["dataset_id"]  # a sweep's runs share a few datasets: each read once
        if dataset not in manifests:
            manifests[dataset] = _manifest(staged_dir(results, dataset))
        manifest = manifests[dataset]
        if manifest is None:
            continue
        try:
            check_batch_fits(run, manifest["sizes"]["train"])
        except ConfigError as err:
            problems.append(str(err))
        if run["model"]["name"] not in BUILT_IN_MODELS:
            check = _model_check(run, manifest)
            models.setdefault(_key(check), (check, []))[1].append(run["name"])
    problems += _check_models(models, Path(cache_dir) / CACHE)
    if problems:
        raise ConfigError("\n".join(problems))


def _manifest(staged: Path) -> dict | None:
    try:
        return json.loads((staged / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def _model_check(run: dict, manifest: dict) -> dict:
    return {
        "model": run["model"],
        "shape": manifest["shape"],
        "num_classes": manifest["num_classes"],
        "channels_last": uses_channels_last(run),
    }


def _key(check: dict) -> str:
    name = check["model"]["name"]
    code = plugin_source_hash(name) if is_plugin(name) else version("torchvision")
    return config_hash({**check, "code": code, "torch": version("torch")})


def _check_models(models: dict[str, tuple[dict, list[str]]], cache: Path) -> list[str]:
    """Check the models not checked before, in one subprocess; remember those that pass."""
    passed = set(_read_cache(cache))
    todo = {key: check for key, (check, _) in models.items() if key not in passed}
    if not todo:
        return []
    cache.parent.mkdir(parents=True, exist_ok=True)
    request = cache.with_name(f"request-{config_hash(sorted(todo))[:12]}.json")
    answer = request.with_suffix(".out.json")
    request.write_text(json.dumps(todo))
    done = subprocess.run(
        [sys.executable, "-m", "ddpflow.early", str(request), str(answer)],
        capture_output=True,
        text=True,
    )
    request.unlink(missing_ok=True)
    if done.returncode != 0 or not answer.is_file():
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return [f"the model check before any job could not run: {tail}"]
    errors = json.loads(answer.read_text())
    answer.unlink()
    cache.write_text(json.dumps(sorted(passed | {k for k in todo if errors[k] is None})))
    return [
        f"runs {', '.join(repr(n) for n in models[key][1])}: {error}"
        for key, error in errors.items()
        if error is not None
    ]


def _read_cache(cache: Path) -> list[str]:
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        return []


def _run_checks(request: Path) -> dict[str, str | None]:
    """In the subprocess: each model built and run once (training.models.check_model)."""
    from ddpflow.errors import UserError
    from ddpflow.training.models import check_model

    errors = {}
    for key, check in json.loads(request.read_text()).items():
        try:
            shape, classes = check["shape"], check["num_classes"]
            check_model(check["model"], shape, classes, check["channels_last"])
            errors[key] = None
        except UserError as err:
            errors[key] = str(err)
        except Exception as err:  # noqa: BLE001 - a plug-in may raise anything: name it
            errors[key] = f"model.name {check['model']['name']!r}: {type(err).__name__}: {err}"
    return errors


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(_run_checks(Path(sys.argv[1]))))
