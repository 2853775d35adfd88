"""The typed run (ddpflow.config.typed): generated from config/schema.yaml, current, and a
faithful, frozen copy of every resolved run the shipped configs make."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from ddpflow import config as ddpconfig
from ddpflow.config import typed, typed_gen
from ddpflow.config.schema import load_schema
from workflow_helpers import REPO, make_run

BIN = Path(sys.executable).parent


def test_the_committed_typed_run_is_what_the_schema_generates():
    """`make typed-config` writes it; a schema edit without it fails here."""
    formatted = subprocess.run(
        [str(BIN / "ruff"), "format", "--stdin-filename", "typed.py", "-"],
        input=typed_gen.render(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    committed = (REPO / "workflow/ddpflow/config/typed.py").read_text()
    assert committed == formatted, "stale: run make typed-config"


def _objects(node: dict, schema: dict, path: tuple):
    """(path, properties) of the schema's sections and nested objects."""
    if "$ref" in node:
        node = schema["$defs"][node["$ref"].rsplit("/", 1)[-1]]
    if node.get("type") == "object" and "properties" in node:
        yield path, node
        for key, prop in node["properties"].items():
            yield from _objects(prop, schema, (*path, key))


@pytest.mark.parametrize("section", typed_gen.SECTIONS)
def test_every_section_and_object_of_the_schema_is_a_dataclass_with_its_keys(section):
    schema = load_schema()
    found = 0
    for path, node in _objects(schema["$defs"][section], schema, (section,)):
        cls = _class_at(path)
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, path
        assert "__slots__" in cls.__dict__, path
        extras = [key for key, *_ in typed_gen.EXTRAS.get(section, [])] if len(path) == 1 else []
        names = [f.name for f in dataclasses.fields(cls)]
        keys = [typed._field(key) for key in node["properties"]]  # a keyword's: key_
        assert sorted(names) == sorted([*keys, *extras]), path
        found += 1
    assert found >= 1


def _class_at(path: tuple) -> type:
    cls = getattr(typed, typed_gen._camel(path[:1]))
    for key in path[1:]:
        cls = cls.NESTED[key]
    return cls


def _shipped_runs() -> list[dict]:
    runs = []
    for config in ("config/config.yaml", "config/scaling.yaml", "config/tutorials/*.yaml"):
        for path in sorted(REPO.glob(config)):
            loaded = ddpconfig.load(path, {"launcher": "slurm"})
            runs += ddpconfig.resolve_runs(loaded)
    regression = make_run(task="regression", data={"source": "npz", "path": "x.npz"})
    return [*runs, regression]


def test_every_shipped_run_becomes_a_typed_run_with_the_same_values():
    for run in _shipped_runs():
        spec = typed.RunSpec.from_run(run)
        for section in typed_gen.SECTIONS:
            flat = ddpconfig.flatten(run[section])
            for dotted, value in flat.items():
                got = getattr(spec, section)
                for part in dotted.split("."):
                    got = got[part]  # a section by its key: checkpoint.async is field async_
                expected = tuple(value) if isinstance(value, list) else value
                assert got == expected, f"{run['name']}: {section}.{dotted}"
        assert spec.name == run["name"] and spec.world_size == run["world_size"]
        assert spec.task == run["task"]
        checkpoint = spec.train.checkpoint  # a keyword key reads as the key and as key_
        assert checkpoint["async"] is checkpoint.async_ is run["train"]["checkpoint"]["async"]


def test_a_typed_run_is_frozen_and_names_a_key_it_does_not_know():
    run = make_run()
    spec = typed.RunSpec.from_run(run)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.train.epochs = 3  # type: ignore[misc]
    with pytest.raises(TypeError):  # a list is a tuple, a dict a read-only mapping
        spec.data.kwargs["x"] = 1  # type: ignore[index]
    run["train"]["optimiser"] = {"lr": 0.1}
    with pytest.raises(KeyError, match=r"train: optimiser not in the typed run \(TrainSpec\)"):
        typed.RunSpec.from_run(run)


def test_a_typed_run_is_slotted_and_reads_as_the_dict_did_for_shared_helpers():
    spec = typed.RunSpec.from_run(make_run())
    assert not hasattr(spec.train, "__dict__") and not hasattr(spec, "__dict__")
    assert spec.train["optimizer"]["lr"] == spec.train.optimizer.lr
    assert spec.train.get("no_such_key", 7) == 7 and "epochs" in spec.train
    with pytest.raises(KeyError, match="epoch"):
        spec.train["epoch"]  # a typo fails as the dict's lookup did
