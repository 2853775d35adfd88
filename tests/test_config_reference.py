"""docs/reference/config.md is generated from the schema (ddpflow.config.reference): the
committed file is current, names every key, and its "editing it redoes" column agrees with
the rerun rules the workflow applies (ddpflow.config fingerprints)."""

from __future__ import annotations

import re

import pytest
from ddpflow import config as ddpconfig
from ddpflow.config import reference
from workflow_helpers import REPO

COMMITTED = REPO / "docs" / "reference" / "config.md"


@pytest.fixture(scope="module")
def rendered() -> str:
    return reference.markdown()


def test_the_committed_reference_is_current(rendered):
    assert COMMITTED.read_text() == rendered, (
        f"{COMMITTED.relative_to(REPO)} is stale (schema.yaml or the rerun rules changed): "
        f"regenerate it with {reference.REGENERATE}"
    )


def _schema_keys(schema: dict, node: dict, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, written out here independently of the module."""
    if "$ref" in node:
        node = schema["$defs"][node["$ref"].rsplit("/", 1)[1]]
    out = []
    for key, sub in node.get("properties", {}).items():
        out.append(prefix + key)
        out += _schema_keys(schema, sub, f"{prefix}{key}.")
    return out


def test_every_schema_key_has_a_row(rendered):
    schema = ddpconfig.load_schema()
    keys = _schema_keys(schema, schema)
    rows = re.findall(r"^\| `([^`]+)` \|", rendered, flags=re.MULTILINE)
    assert len(keys) > 100
    assert sorted(rows) == sorted(keys)  # each once, none invented


def _redoes(rendered: str, key: str) -> str:
    (line,) = [line for line in rendered.splitlines() if line.startswith(f"| `{key}` |")]
    return line.split(" | ")[4]


@pytest.mark.parametrize(
    "key, redoes",
    [
        # the cases tests/test_workspace.py and tests/test_streaming.py pin down
        ("train.optimizer.lr", "retrain"),
        ("train.epochs", "retrain"),
        ("train.channels_last", "retrain"),
        ("train.progress", "nothing"),
        ("train.checkpoint.every_steps", "nothing"),
        ("train.deterministic", "nothing; retrain with GPUs"),
        ("train.augment.crop_padding", "nothing; retrain with train.augment.enabled: true"),
        (
            "train.fsdp.cpu_offload",
            "nothing; retrain with train.strategy: fsdp or train.strategy: hsdp",
        ),
        ("train.hsdp.shard_size", "nothing"),
        ("train.strategy", "retrain"),
        ("model.mlp_hidden", "nothing; retrain with model.name: mlp"),
        ("machine.nodes", "nothing"),
        ("machine.partition", "nothing"),
        ("machine.gpus_per_node", "retrain"),
        ("eval.batch_size", "re-evaluate"),
        ("eval.in_train", "nothing"),
        ("data.seed", "restage"),
        ("data.stage_threads", "nothing"),
        ("data.loading.in_memory", "nothing"),
        ("data.on_small", "nothing; restage with data.source: image_folder"),
        ("launcher", "nothing"),
        # in no fingerprint: only the track rule logs again (tests/test_tracking.py)
        ("tracking.mlflow.uri", "nothing; the track rule logs again (and the report is redone)"),
        ("tracking.wandb.mode", "nothing; the track rule logs again (and the report is redone)"),
    ],
)
def test_the_redo_column_follows_the_rerun_rules(rendered, key, redoes):
    assert _redoes(rendered, key) == redoes
