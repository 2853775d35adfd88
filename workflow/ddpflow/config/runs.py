"""Load a config file and resolve its named runs: each run is the top-level sections with
the run's overrides merged in, validated, and checked (checks.py) before anything runs.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from ddpflow.config.checks import _check_run, check_tracking
from ddpflow.config.fingerprint import dataset_id
from ddpflow.config.machine import world_size
from ddpflow.config.schema import ConfigError, deep_merge, validate

SECTIONS = ("data", "model", "train", "eval", "machine")


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
    check_tracking(config["tracking"])
    return config, runs


def resolve_runs(config: dict) -> list[dict]:
    """Each named run: the top-level sections with the run's overrides merged in, validated."""
    runs = []
    for index, entry in enumerate(config["runs"]):
        # tracking: where a run is logged, the same for every run and in no fingerprint; the
        # train rule reads it from the run (its script, a rerun trigger, stays as it was)
        shared = ("launcher", "results_dir", "logs_dir", "tracking")
        merged = {key: config[key] for key in shared if key in config}
        for section in SECTIONS:
            merged[section] = deep_merge(config[section], entry.get(section, {}))
        where = f"runs[{index}] ({entry['name']!r})"
        resolved = validate(merged, where=where)
        resolved["name"] = entry["name"]
        resolved["world_size"] = world_size(resolved["machine"])
        resolved["dataset_id"] = dataset_id(resolved["data"])
        runs.append(resolved)
    return runs


def run_by_name(config: dict, name: str) -> dict:
    """The resolved run called `name` of a validated config."""
    for run in resolve_runs(config):
        if run["name"] == name:
            return run
    raise ConfigError(f"no run named {name!r}; runs: {[r['name'] for r in config['runs']]}")
