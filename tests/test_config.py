"""ddpflow.config: the shipped config, schema defaults, run resolution, and bad configs that
must fail before anything runs with a message naming the offending key.

The last tests run the real `snakemake -n` on bad configs: the workflow must refuse them
before scheduling (and so before submitting) anything.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from ddpflow import config as ddpconfig
from ddpflow.config import ConfigError
from workflow_helpers import REPO, snakemake_command

SHIPPED = REPO / "config" / "config.yaml"


def load_yaml(tmp_path: Path, text: str) -> dict:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return ddpconfig.load(path)


# --- good configs --------------------------------------------------------------------------


def test_shipped_config_loads_and_validates():
    config = ddpconfig.load(SHIPPED)
    assert config["launcher"] == "local"
    runs = ddpconfig.resolve_runs(config)
    assert [run["name"] for run in runs] == ["default"]
    run = runs[0]
    assert run["world_size"] == 2  # 1 node x 2 CPU ranks
    assert run["dataset_id"].startswith("digits-") and len(run["dataset_id"]) == len("digits-") + 10
    assert set(ddpconfig.SECTIONS) <= set(run)


def _schema_defaults(schema: dict, node: dict) -> dict:
    """Every {key: default} the schema declares below `node` (following $ref)."""
    if "$ref" in node:
        node = schema["$defs"][node["$ref"].rsplit("/", 1)[1]]
    out = {}
    for key, sub in node.get("properties", {}).items():
        if "default" in sub:
            out[key] = sub["default"]
        resolved = schema["$defs"][sub["$ref"].rsplit("/", 1)[1]] if "$ref" in sub else sub
        if "properties" in resolved:
            out[key] = {**_as_dict(out.get(key)), **_schema_defaults(schema, resolved)}
    return out


def _as_dict(value):
    return value if isinstance(value, dict) else {}


def test_every_schema_default_is_filled_in():
    schema = ddpconfig.load_schema()
    config = ddpconfig.load(None)
    expected = _schema_defaults(schema, schema)
    assert config == expected  # nothing missing, nothing extra
    # spot checks of nested defaults
    assert config["train"]["optimizer"]["name"] == "sgd"
    assert config["data"]["synthetic"]["height"] == 8
    assert config["runs"] == [{"name": "default"}]
    assert config["machine"]["gpus_per_node"] == 0


def test_load_does_not_modify_its_inputs():
    overrides = {"train": {"epochs": 3}}
    ddpconfig.load(None, overrides)
    assert overrides == {"train": {"epochs": 3}}


def test_run_overrides_deep_merge():
    config = ddpconfig.load(
        None,
        {
            "model": {"cnn_channels": 8, "mlp_hidden": [64]},
            "train": {"optimizer": {"lr": 0.2}},
            "runs": [
                {"name": "cnn"},
                {
                    "name": "mlp-3",
                    "model": {"name": "mlp"},
                    "train": {"optimizer": {"momentum": 0.5}},
                    "machine": {"cpu_ranks_per_node": 3},
                },
            ],
        },
    )
    cnn, mlp = ddpconfig.resolve_runs(config)
    assert cnn["model"] == {"name": "cnn", "mlp_hidden": [64], "cnn_channels": 8}
    assert mlp["model"] == {"name": "mlp", "mlp_hidden": [64], "cnn_channels": 8}
    assert mlp["train"]["optimizer"]["lr"] == 0.2  # sibling keys of an override survive
    assert mlp["train"]["optimizer"]["momentum"] == 0.5
    assert cnn["train"]["optimizer"]["momentum"] == 0.9
    assert (cnn["world_size"], mlp["world_size"]) == (2, 3)
    assert cnn["dataset_id"] == mlp["dataset_id"]
    assert config["runs"][1]["model"] == {"name": "mlp"}  # the config itself is not changed


def test_world_size_counts_gpus_when_given():
    config = ddpconfig.load(
        None,
        {
            "launcher": "slurm",
            "machine": {"nodes": 2, "gpus_per_node": 4, "partition": "gpu"},
            "runs": [{"name": "big"}, {"name": "one", "machine": {"nodes": 1, "gpus_per_node": 1}}],
        },
    )
    assert [r["world_size"] for r in ddpconfig.resolve_runs(config)] == [8, 1]


def test_dataset_id_is_shared_by_equal_data_and_differs_otherwise():
    config = ddpconfig.load(
        None,
        {
            "runs": [
                {"name": "a"},
                {"name": "b", "model": {"name": "mlp"}, "train": {"epochs": 1}},
                {"name": "c", "data": {"seed": 0, "source": "digits"}},  # restates defaults
                {"name": "d", "data": {"seed": 1}},
                {"name": "e", "data": {"source": "synthetic"}},
                {"name": "f", "data": {"source": "synthetic", "synthetic": {"noise": 1.0}}},
            ]
        },
    )
    ids = {run["name"]: run["dataset_id"] for run in ddpconfig.resolve_runs(config)}
    assert ids["a"] == ids["b"] == ids["c"]
    assert len({ids["a"], ids["d"], ids["e"], ids["f"]}) == 4
    assert ids["e"].startswith("synthetic-")
    again = ddpconfig.resolve_runs(ddpconfig.load(None, {"runs": [{"name": "x"}]}))
    assert again[0]["dataset_id"] == ids["a"]  # stable across loads (it names a directory)


def test_torchvision_files_are_checked_by_staging_not_at_every_parse(tmp_path):
    """The config names a folder; whether torchvision's files are in it is staging's check
    (tests/test_data.py: test_missing_source_files_name_the_path), which runs before any job
    is submitted and names every missing file; a parse after staging must not need them."""
    config = ddpconfig.load(None, {"data": {"source": "fashion_mnist", "root": str(tmp_path)}})
    assert config["data"]["source"] == "fashion_mnist"


# --- bad configs ----------------------------------------------------------------------------

TWO_RUNS_BAD_SECOND = """
runs:
  - name: fine
  - name: broken
    train: {epochs: ten}
"""

# (id, YAML text, texts the message must contain); {tmp} is the test's tmp_path
BAD_CONFIGS = [
    ("epochs-string", "train: {epochs: ten}", ["train.epochs", "'ten'"]),
    ("epochs-bool", "train: {epochs: true}", ["train.epochs"]),
    ("unknown-dataset", "data: {source: imagenet}", ["data.source", "imagenet"]),
    ("unknown-model", "model: {name: vgg16}", ["model.name", "vgg16"]),
    ("zero-nodes", "machine: {nodes: 0}", ["machine.nodes"]),
    ("negative-gpus", "machine: {gpus_per_node: -1}", ["machine.gpus_per_node"]),
    ("zero-batch", "train: {batch_size: 0}", ["train.batch_size"]),
    ("zero-lr", "train: {optimizer: {lr: 0}}", ["train.optimizer.lr"]),
    ("unknown-optimizer", "train: {optimizer: {name: lion}}", ["train.optimizer.name", "lion"]),
    ("unknown-top-level-key", "trian: {epochs: 3}", ["trian", "<top level>"]),
    ("unknown-nested-key", "train: {batchsize: 64}", ["train", "batchsize", "batch_size"]),
    ("val-fraction-too-big", "data: {val_fraction: 0.7}", ["data.val_fraction"]),
    ("precision-fp8", "train: {precision: fp8}", ["train.precision", "fp8"]),
    ("synthetic-too-small", "data: {synthetic: {height: 2}}", ["data.synthetic.height"]),
    ("setup-not-a-list", "machine: {setup: module load cuda}", ["machine.setup"]),
    ("no-runs", "runs: []", ["runs"]),
    ("duplicate-runs", "runs: [{name: a}, {name: b}, {name: a}]", ["runs", "unique", "'a'"]),
    ("run-name-slash", "runs: [{name: a/b}]", ["runs[0].name", "a/b"]),
    ("run-without-name", "runs: [{model: {name: mlp}}]", ["runs[0]", "name"]),
    ("run-unknown-section", "runs: [{name: a, optimizer: {lr: 1}}]", ["runs[0]", "optimizer"]),
    ("run-bad-type", TWO_RUNS_BAD_SECOND, ["runs[1]", "broken", "train.epochs"]),
    ("run-unknown-key", "runs: [{name: a, train: {batchsize: 8}}]", ["runs[0]", "batchsize"]),
    ("run-section-not-mapping", "runs: [{name: a, train: 5}]", ["runs[0].train"]),
    ("nodes-2-local", "machine: {nodes: 2}", ["machine.nodes", "local"]),
    ("run-nodes-2-local", "runs: [{name: multi, machine: {nodes: 2}}]", ["machine.nodes", "multi"]),
    ("unknown-launcher", "launcher: kubernetes", ["launcher", "kubernetes"]),
    (
        "static-graph-with-accumulation",
        "train: {grad_accum_steps: 2, ddp: {static_graph: true}}",
        ["train.ddp.static_graph", "train.grad_accum_steps 2", "static_graph: false"],
    ),
    ("not-a-mapping", "- train\n- epochs\n", ["config.yaml", "mapping"]),
    ("scalar-file", "just a string\n", ["config.yaml", "mapping"]),
    ("invalid-yaml", "train: {epochs: 3\n", ["config.yaml", "not valid YAML"]),
]


@pytest.mark.parametrize(
    ("text", "expected"), [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS]
)
def test_bad_config_names_the_key(tmp_path, text, expected):
    with pytest.raises(ConfigError) as info:
        load_yaml(tmp_path, text.replace("{tmp}", str(tmp_path)))
    message = str(info.value)
    for part in expected:
        assert part.replace("{tmp}", str(tmp_path)) in message, message


def test_missing_config_file_is_named(tmp_path):
    missing = tmp_path / "nope" / "config.yaml"
    with pytest.raises(ConfigError, match="does not exist") as info:
        ddpconfig.load(missing)
    assert str(missing) in str(info.value)


def test_empty_file_means_all_defaults(tmp_path):
    assert load_yaml(tmp_path, "") == ddpconfig.load(None)


@pytest.mark.parametrize(
    "text", ["machine: {cpu_ranks_per_node: 2.0}", "train: {batch_size: 32.0}"]
)
def test_integer_keys_reject_floats(tmp_path, text):
    with pytest.raises(ConfigError):
        load_yaml(tmp_path, text)


# --- bad configs through the real workflow ----------------------------------------------------

WORKFLOW_CASES = [
    ("epochs-string", {"train": {"epochs": "ten"}}, "train.epochs"),
    ("unknown-dataset", {"data": {"source": "imagenet"}}, "data.source"),
    ("nodes-2-local", {"machine": {"nodes": 2}}, "machine.nodes"),
]


@pytest.fixture(scope="module")
def workflow_runs(tmp_path_factory):
    """`snakemake -n` on each bad config, the three at once (each is ~3 s of CPU start-up)."""
    started = {}
    for name, overrides, _ in WORKFLOW_CASES:
        workdir = tmp_path_factory.mktemp(name)
        configfile = workdir / "bad.yaml"
        configfile.write_text(yaml.safe_dump(overrides))
        cmd, env = snakemake_command(workdir, configfile, "-n")
        proc = subprocess.Popen(
            cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        started[name] = (workdir, proc)
    out = {}
    for name, (workdir, proc) in started.items():
        try:
            output, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        out[name] = (workdir, proc.returncode, output)
    return out


@pytest.mark.parametrize(("name", "key"), [(c[0], c[2]) for c in WORKFLOW_CASES])
def test_workflow_refuses_bad_config_before_submitting(workflow_runs, name, key):
    workdir, returncode, output = workflow_runs[name]
    assert returncode != 0, output
    assert "configuration error" in output and key in output, output
    assert "Traceback" not in output, output  # a clean message, not a crash
    for directory in ("results", "logs"):
        assert not (workdir / directory).exists(), f"{directory}/ was created:\n{output}"
    assert not any(workdir.rglob("*submitit*"))
