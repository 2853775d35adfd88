"""The schema and validation: read schema.yaml, check a config against it filling defaults,
coerce what the user plainly meant (numbers written as text, Slurm times), and say what is
wrong in one line that names the key and the fix (including "did you mean" for a key that
belongs elsewhere); refuse the per-rank batch keys that the global batch replaced.
"""

from __future__ import annotations

import copy
import difflib
import functools
import math
import re
from importlib import resources

import jsonschema
import yaml

from ddpflow.config.machine import world_size
from ddpflow.errors import UserError

# package data beside this module: found by importlib.resources in any install
SCHEMA = "schema.yaml"


class ConfigError(UserError, ValueError):
    """A configuration problem, with the key path and how to fix it."""


def load_schema() -> dict:
    """The config schema (a copy: a caller may change it)."""
    return copy.deepcopy(_parsed_schema())


@functools.cache
def _parsed_schema() -> dict:
    """schema.yaml parsed once per process, by libyaml where PyYAML has it (the pure-Python
    parser takes a third of a second for it: every rule's process parses it)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    text = resources.files("ddpflow.config").joinpath(SCHEMA).read_text()
    return yaml.load(text, Loader=loader)  # a safe loader (C or Python)


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


# a Slurm time limit that is none (also a partition's MaxTime as scontrol prints it)
NO_LIMIT = {"INFINITE", "UNLIMITED"}


def parse_slurm_time(text: str) -> int | None:
    """Seconds in a Slurm time limit; None for INFINITE/UNLIMITED. Formats as sbatch --time:
    MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    value = text.strip()
    if value.upper() in NO_LIMIT:
        return None
    if not re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}", value):
        raise ValueError(f"not a Slurm time limit: {text!r}")
    days, _, clock = value.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days or len(parts) == 3:
        # after a day count (or with two colons) the first field is hours
        hours, minutes, seconds = (parts + [0, 0])[:3]
    else:
        hours, (minutes, seconds) = 0, (parts + [0])[:2]
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


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
    # YAML 1.1 reads a bare `off` as false: tracking.wandb.mode: off means "off"
    if error.validator == "enum" and error.instance is False and "off" in error.validator_value:
        return "off"
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
    wanted = error.validator_value
    number = isinstance(error.instance, int | float) and not isinstance(error.instance, bool)
    if "string" in wanted and number and path:
        # a sha256 or a run name of digits only: YAML reads it as a number
        return (
            f" (YAML reads an unquoted value of digits as a number: quote it, "
            f"{path[-1]}: '...', exactly as written)"
        )
    return ""


def schema_keys(schema: dict, node: dict | None = None, prefix: tuple = ()) -> list[tuple]:
    """Every key path the schema declares, parents before children, following $ref:
    ("data",), ("data", "loading"), ("data", "loading", "in_memory"), ... (not inside runs)."""
    node = schema if node is None else node
    if "$ref" in node:
        node = schema["$defs"][node["$ref"].rsplit("/", 1)[1]]
    out = []
    for key, sub in node.get("properties", {}).items():
        out.append((*prefix, key))
        out += schema_keys(schema, sub, (*prefix, key))
    return out


def _elsewhere(key: str, where: list) -> list[str]:
    """The dotted paths where a key of this name exists, for a key unknown at `where`:
    in_memory under data -> ["data.loading.in_memory"]. In a runs[] entry, the sections'
    keys (dotted from the run)."""
    in_run = where[:1] == ["runs"]
    # sweep's own keys (seed, samples) are no home for a run's key
    in_sweep = where[:1] == ["sweep"]
    return [
        ".".join(path)
        for path in schema_keys(load_schema())
        if path[-1] == key
        and path[:-1] != tuple(where)
        and not (in_run and len(path) == 1)
        and (in_sweep or path[0] != "sweep")
    ]


def _unknown_key_hint(key: str, allowed: list[str], where: list) -> str:
    """'; did you mean ...?' for an unknown key: the places where a key of exactly this name
    exists (data.in_memory -> data.loading.in_memory), then a close spelling allowed here."""
    close = difflib.get_close_matches(key, allowed, n=1)
    elsewhere = " or ".join(_elsewhere(key, where))
    if close and elsewhere:
        return f"; did you mean {elsewhere}, or {close[0]!r} for {key!r}?"
    if close:
        return f"; did you mean {close[0]!r} for {key!r}?"
    return f"; did you mean {elsewhere}?" if elsewhere else ""


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
        hints = "".join(_unknown_key_hint(key, allowed, list(error.absolute_path)) for key in extra)
        keys = "key" if len(extra) == 1 else "keys"
        return f"{path}: unknown {keys} {extra}{hints} (allowed keys here: {allowed})"
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
    if error.validator == "anyOf":
        return _none_of(path, error)
    if error.validator == "type":
        return (
            f"{path}: {error.instance!r} has the wrong type; expected {error.validator_value}"
            + _type_hint(error)
        )
    return f"{path}: {error.message}"


def _none_of(path: str, error: jsonschema.ValidationError) -> str:
    """A value none of a key's alternatives takes: the alternatives in words (jsonschema says
    only 'is not valid under any of the given schemas'), and a close spelling of a word."""
    subs = error.validator_value
    words = [
        w for sub in subs for w in [*sub.get("enum", []), sub.get("const")] if isinstance(w, str)
    ]
    given = error.instance if isinstance(error.instance, str) else ""
    close = difflib.get_close_matches(given, words, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    allowed = " or ".join(_alternative(sub) for sub in subs)
    return f"{path}: {error.instance!r} is not allowed here: {allowed}{hint}"


def _alternative(sub: dict) -> str:
    """One anyOf alternative in words: 'backbone', 'a list of strings', 'an integer >= 1'."""
    if "const" in sub:
        return repr(sub["const"])
    if "enum" in sub:
        return "one of " + ", ".join(map(repr, sub["enum"]))
    kind = sub.get("type")
    if kind == "array":
        return f"a list of {sub.get('items', {}).get('type', 'value')}s"
    signs = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<="}
    text = "an integer" if kind == "integer" else f"a {kind or 'value'}"
    if "pattern" in sub:
        text += f" matching {sub['pattern']}"
    return " ".join([text, *(f"{sign} {sub[k]}" for k, sign in signs.items() if k in sub)])


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
        given = config.get("train")
        top = given if isinstance(given, dict) else {}
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


def deep_merge(base: dict, override: dict) -> dict:
    """A new dict: override's mappings merged key by key into base's (lists are replaced)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
