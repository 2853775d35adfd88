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
from ddpflow.checks import values as checks_values
from ddpflow.config import ConfigError
from workflow_helpers import REPO, make_run, snakemake_command

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
        # an object without a default (sweep.random) or null by default (sweep.prune) is
        # not filled in
        if "properties" in resolved and isinstance(out.get(key), dict):
            out[key] = {**out[key], **_schema_defaults(schema, resolved)}
    return out


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
                    "train": {"optimizer": {"momentum": 0.5}, "global_batch_size": 96},
                    "machine": {"cpu_ranks_per_node": 3},
                },
            ],
        },
    )
    cnn, mlp = ddpconfig.resolve_runs(config)
    defaults = {"kwargs": {}, "small_input_stem": True, "weights": None, "weights_sha256": None}
    assert cnn["model"] == {"name": "cnn", "mlp_hidden": [64], "cnn_channels": 8, **defaults}
    assert mlp["model"] == {"name": "mlp", "mlp_hidden": [64], "cnn_channels": 8, **defaults}
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
            "train": {"global_batch_size": 256},
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
GPT_RUN = "task: language_model\ndata: {source: text, path: corpus.txt}\nmodel: {name: gpt, "
BAD_CONFIGS = [
    ("epochs-string", "train: {epochs: ten}", ["train.epochs", "'ten'"]),
    ("epochs-bool", "train: {epochs: true}", ["train.epochs"]),
    ("unknown-dataset", "data: {source: imagenet}", ["data.source", "imagenet", "plug-in"]),
    ("dataset-typo", "data: {source: cifar01}", ["data.source", "did you mean 'cifar10'"]),
    # an unknown model name is the train rule's to refuse (tests/test_model_zoo.py): a
    # torchvision name is only known once torchvision is imported
    ("model-name-number", "model: {name: 5}", ["model.name", "string"]),
    ("model-kwargs-list", "model: {name: resnet50, kwargs: [1]}", ["model.kwargs"]),
    (
        "weights-in-kwargs",
        "model: {name: resnet50, kwargs: {weights: DEFAULT}}",
        ["model.kwargs.weights", "go in model.weights"],
    ),
    (
        "weights-of-itself",
        "runs: [{name: a, model: {weights: 'run:a'}}]",
        ["model.weights 'run:a'", "its own model"],
    ),
    ("weights-of-nobody", "model: {weights: 'run:nobody'}", ["no run named 'nobody'"]),
    (
        "weights-in-a-cycle",
        "runs: [{name: a, model: {weights: 'run:b'}}, {name: b, model: {weights: 'run:a'}}]",
        ["form a cycle"],
    ),
    ("pin-without-file", f"model: {{weights_sha256: '{'a' * 64}'}}", ["pins the file"]),
    ("unfreeze-without-freeze", "train: {unfreeze_at_epoch: 2}", ["nothing frozen"]),
    (
        "unfreeze-after-the-end",
        "train: {epochs: 3, freeze: backbone, unfreeze_at_epoch: 5}",
        ["after the last epoch (3)"],
    ),
    ("image-folder-no-size", "data: {source: image_folder}", ["data.image_size", "[32, 32]"]),
    ("npz-no-path", "data: {source: npz}", ["data.path", ".npz"]),
    ("image-size-one-number", "data: {source: image_folder, image_size: 32}", ["data.image_size"]),
    ("zero-nodes", "machine: {nodes: 0}", ["machine.nodes"]),
    ("negative-gpus", "machine: {gpus_per_node: -1}", ["machine.gpus_per_node"]),
    ("zero-batch", "train: {micro_batch_size: 0}", ["train.micro_batch_size"]),
    (
        "per-rank-batch",
        "train: {batch_size: 16}",
        [
            "train.batch_size (per rank) is replaced",
            "train.global_batch_size: 32",
            "train.micro_batch_size: 16",
            "world size 2",
        ],
    ),
    (
        "per-rank-batch-and-accumulation-in-a-run",
        "runs: [{name: a, train: {batch_size: 8, grad_accum_steps: 4},"
        " machine: {cpu_ranks_per_node: 1}}]",
        [
            "runs[0] ('a')",
            "train.batch_size and train.grad_accum_steps (per rank) are replaced",
            "global_batch_size: 32",
            "micro_batch_size: 8",
            "world size 1",
        ],
    ),
    (
        "world-size-larger-than-the-step",
        "machine: {cpu_ranks_per_node: 3}",
        [
            "64 = 32 x world size x accumulation steps",
            "is more than 2 micro-batches a step: world sizes up to 2 work",
            "machine.nodes 1 x 3 ranks",
        ],
    ),
    (
        "global-not-a-multiple",
        "train: {global_batch_size: 60}",
        ["train.global_batch_size 60 is not a multiple of train.micro_batch_size 32", "64"],
    ),
    ("zero-lr", "train: {optimizer: {lr: 0}}", ["train.optimizer.lr"]),
    ("unknown-optimizer", "train: {optimizer: {name: lion}}", ["train.optimizer.name", "lion"]),
    ("unknown-top-level-key", "trian: {epochs: 3}", ["trian", "<top level>"]),
    (
        "unknown-nested-key",
        "train: {global_batchsize: 64}",
        ["train", "global_batchsize", "global_batch_size"],
    ),
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
        "train: {global_batch_size: 128, ddp: {static_graph: true}}",
        ["train.ddp.static_graph", "2 accumulation steps", "static_graph: false"],
    ),
    ("not-a-mapping", "- train\n- epochs\n", ["config.yaml", "mapping"]),
    ("scalar-file", "just a string\n", ["config.yaml", "mapping"]),
    ("invalid-yaml", "train: {epochs: 3\n", ["config.yaml", "not valid YAML"]),
    # guard rails: each names the key, the value and the fix
    ("run-name-space", "runs: [{name: my run}]", ["runs[0].name", "'my run'", "letters, digits"]),
    ("lr-word", "train: {optimizer: {lr: fast}}", ["train.optimizer.lr", "'fast'", "in quotes"]),
    ("epochs-fraction-string", "train: {epochs: '2.5'}", ["train.epochs", "'2.5'", "integer"]),
    ("time-min-words", "machine: {time_min: an hour}", ["machine.time_min", "1:30:00"]),
    ("time-min-zero-string", "machine: {time_min: '0:00:00'}", ["machine.time_min"]),
    ("lr-nan-string", "train: {optimizer: {lr: nan}}", ["train.optimizer.lr", "'nan'"]),
    # a value none of a key's alternatives takes: the alternatives in words, a close word
    (
        "freeze-misspelt",
        "train: {freeze: backbon}",
        ["train.freeze: 'backbon'", "'backbone' or a list of strings", "did you mean 'backbone'"],
    ),
    ("micro-batch-word", "train: {micro_batch_size: autp}", ["an integer >= 1 or 'auto'"]),
    (
        "sha256-digits-unquoted",
        f"model: {{weights_sha256: {'1' * 64}}}",
        ["model.weights_sha256", "wrong type", "quote it, weights_sha256: '...'"],
    ),
    # a gpt that cannot be built is refused at parse, not on every rank after the queue
    (
        "gpt-heads-do-not-divide",
        GPT_RUN + "kwargs: {n_embd: 30, n_head: 4}}",
        ["model.kwargs n_embd 30 is not divisible by n_head 4", "28 or 32", "1, 2, 3, 5, 6"],
    ),
    ("gpt-zero-heads", GPT_RUN + "kwargs: {n_head: 0}}", ["model.kwargs.n_head is 0"]),
    ("gpt-dropout", GPT_RUN + "kwargs: {dropout: 1.5}}", ["model.kwargs.dropout is 1.5"]),
    (
        "gpt-unknown-key",
        GPT_RUN + "kwargs: {n_layers: 2}}",
        ["model.kwargs ['n_layers'] are not gpt's", "did you mean 'n_layer'"],
    ),
    (
        "max-train-samples-below-ranks",
        "data: {max_train_samples: 1}",
        ["data.max_train_samples is 1", "less than one global batch", "global_batch_size 64"],
    ),
    (
        "run-max-train-samples-below-ranks",
        "runs: [{name: tiny, data: {max_train_samples: 3}, train: {global_batch_size: 4,"
        " micro_batch_size: 1}, machine: {cpu_ranks_per_node: 4}}]",
        ["'tiny'", "data.max_train_samples is 3", "global_batch_size 4"],
    ),
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


def test_the_parse_checks_gpt_kwargs_as_the_model_takes_them(tmp_path):
    """The parse-time check (no torch) knows the keys and defaults gpt is built with, and
    every kwargs it accepts builds."""
    import torch
    from ddpflow.checks.model_kwargs import GPT_DEFAULTS
    from ddpflow.training.gpt import DEFAULTS, gpt

    assert GPT_DEFAULTS == DEFAULTS
    kwargs = {"n_layer": 1, "n_head": 3, "n_embd": 12, "dropout": 0.1, "bias": False}
    load_yaml(tmp_path, GPT_RUN + f"kwargs: {kwargs}}}".replace("False", "false"))
    assert gpt(257, 8, kwargs)(torch.zeros(2, 8, dtype=torch.int64)).shape == (2, 8, 257)


def test_missing_config_file_is_named(tmp_path):
    missing = tmp_path / "nope" / "config.yaml"
    with pytest.raises(ConfigError, match="does not exist") as info:
        ddpconfig.load(missing)
    assert str(missing) in str(info.value)


def test_empty_file_means_all_defaults(tmp_path):
    assert load_yaml(tmp_path, "") == ddpconfig.load(None)


@pytest.mark.parametrize(
    "text", ["machine: {cpu_ranks_per_node: 2.0}", "train: {micro_batch_size: 32.0}"]
)
def test_integer_keys_reject_floats(tmp_path, text):
    with pytest.raises(ConfigError):
        load_yaml(tmp_path, text)


# a key written under the wrong section: the message names where it belongs
MISPLACED_KEYS = [
    ("data-in-memory", "data: {in_memory: true}", "data", "did you mean data.loading.in_memory?"),
    ("train-nodes", "train: {nodes: 2}", "train", "did you mean machine.nodes?"),
    ("machine-optimizer", "machine: {optimizer: {lr: 0.1}}", "machine", "train.optimizer?"),
    ("eval-seed-two-places", "eval: {seed: 1}", "eval",
     "did you mean data.seed or train.seed or generate.seed?"),
    ("run-train-nodes", "runs: [{name: a, train: {nodes: 2}}]", "runs[0] ('a'): train",
     "did you mean machine.nodes?"),
    ("run-entry-epochs", "runs: [{name: a, epochs: 2}]", "runs[0]", "did you mean train.epochs?"),
    ("top-level-nodes", "nodes: 2", "<top level>", "did you mean machine.nodes"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "where", "hint"), [c[1:] for c in MISPLACED_KEYS], ids=[c[0] for c in MISPLACED_KEYS]
)
def test_a_key_under_the_wrong_section_names_the_right_one(tmp_path, text, where, hint):
    with pytest.raises(ConfigError) as info:
        load_yaml(tmp_path, text)
    message = str(info.value)
    assert f"{where}: unknown key" in message and hint in message, message


def test_validate_names_the_right_section_too():
    with pytest.raises(ConfigError, match=r"did you mean data\.loading\.in_memory\?"):
        ddpconfig.validate({"data": {"in_memory": False}})
    # a close spelling here still comes first when no key of that name exists elsewhere
    with pytest.raises(ConfigError) as info:
        ddpconfig.validate({"data": {"loading": {"inmemory": False}}})
    assert "did you mean 'in_memory' for 'inmemory'?" in str(info.value)


# --- what the user plainly meant is accepted -------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key", "value"),
    [
        ("train: {optimizer: {lr: 1e-3}}", ("train", "optimizer", "lr"), 0.001),  # YAML 1.1
        ("train: {optimizer: {lr: 2.5E-4}}", ("train", "optimizer", "lr"), 0.00025),
        ("train: {epochs: '12'}", ("train", "epochs"), 12),
        ("machine: {time_min: '1:00:00'}", ("machine", "time_min"), 60),
        ("machine: {time_min: '2-00'}", ("machine", "time_min"), 2880),
        ("machine: {time_min: '1-12:30:00'}", ("machine", "time_min"), 2190),
        ("machine: {time_min: '10:30'}", ("machine", "time_min"), 11),  # M:S rounds up
        ("machine: {time_min: 90}", ("machine", "time_min"), 90),
    ],
)
def test_numbers_and_slurm_times_written_as_strings_are_accepted(tmp_path, text, key, value):
    loaded = load_yaml(tmp_path, text)
    for part in key:
        loaded = loaded[part]
    assert loaded == value and type(loaded) is type(value)


def test_run_override_strings_are_accepted_too():
    config = ddpconfig.check({"runs": [{"name": "a", "train": {"optimizer": {"lr": "1e-2"}}}]})
    assert ddpconfig.resolve_runs(config)[0]["train"]["optimizer"]["lr"] == 0.01


def test_gpus_on_a_machine_without_them_are_refused_for_the_local_launcher(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError) as info:
        ddpconfig.check_runs({"machine": {"gpus_per_node": 1}})
    message = str(info.value)
    assert "machine.gpus_per_node is 1" in message and "no NVIDIA GPU" in message
    assert "gpus_per_node: 0" in message
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ConfigError, match="has 1 GPU"):
        ddpconfig.check_runs({"machine": {"gpus_per_node": 2}})
    ddpconfig.check_runs({"machine": {"gpus_per_node": 1}})  # enough GPUs: fine
    # on Slurm the GPUs are the cluster's (checked against its nodes, tests/slurm)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    ddpconfig.check_runs(
        {"launcher": "slurm", "machine": {"gpus_per_node": 4}, "train": {"global_batch_size": 128}}
    )


def _warnings(config: dict) -> list[str]:
    checked, runs = ddpconfig.check_runs(config)
    return [w for run in runs for w in ddpconfig.run_warnings(run, checked["launcher"])]


def test_suspicious_settings_are_warned_about(monkeypatch):
    assert _warnings({}) == []  # the shipped defaults are not suspicious
    (warmup,) = _warnings({"train": {"warmup_epochs": 50, "epochs": 3}})
    assert "train.warmup_epochs 50 is more than train.epochs 3" in warmup and "6%" in warmup
    crowd = {"machine": {"cpu_ranks_per_node": 2, "cpus_per_task": 4096}}
    (crowded,) = _warnings(crowd)
    assert "cpus_per_task 4096" in crowded and "cores" in crowded
    assert _warnings({"launcher": "slurm", **crowd}) == []
    (fp16,) = _warnings({"train": {"precision": "fp16"}})
    assert "train.precision fp16 on CPU ranks" in fp16 and "train.precision: bf16" in fp16
    bf16 = {"train": {"precision": "bf16"}}  # acts on CPU ranks
    assert _warnings(bf16) == [] or not ddpconfig.cpu_computes_bf16()
    monkeypatch.setattr(checks_values, "cpu_computes_bf16", lambda: False)  # where looked up
    (emulated,) = _warnings(bf16)
    assert "no bf16 instructions" in emulated and "train.precision: fp32" in emulated
    assert _warnings({**bf16, "launcher": "slurm"}) == []  # the nodes' CPUs are not this one


def test_bf16_instructions_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n")
    assert not ddpconfig.cpu_computes_bf16(str(cpuinfo))
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n")
    assert ddpconfig.cpu_computes_bf16(str(cpuinfo))
    assert ddpconfig.cpu_computes_bf16(str(tmp_path / "missing"))  # unknown: no warning


def test_a_global_batch_larger_than_the_training_split_is_refused():
    train = {"global_batch_size": 100000, "micro_batch_size": 50000}
    run = ddpconfig.resolve_runs(ddpconfig.check({"train": train}))[0]
    with pytest.raises(ConfigError) as info:
        ddpconfig.check_batch_fits(run, 1293)
    message = str(info.value)
    assert "train.global_batch_size is 100000" in message and "only 1293 samples" in message
    # not even one micro-batch per rank fits: the advice is the micro-batch
    assert "lower train.micro_batch_size (now 50000)" in message
    small = {**run, "train": {**run["train"], "global_batch_size": 2048, "micro_batch_size": 32}}
    with pytest.raises(ConfigError, match=r"at most 1280 \(a multiple of micro_batch_size 32 x"):
        ddpconfig.check_batch_fits(small, 1293)
    ddpconfig.check_batch_fits({**run, "train": {**run["train"], "global_batch_size": 1293}}, 1293)


@pytest.mark.parametrize(
    ("nodes", "ranks", "works"),
    [(1, 1, True), (1, 2, True), (2, 2, True), (1, 4, True), (1, 8, True), (3, 1, True),
     (1, 16, False)],
)  # fmt: skip
def test_world_sizes_that_share_the_steps_micro_batches(nodes, ranks, works):
    """global 64 / micro 8 = 8 micro-batches per step: world sizes 1, 2, 4, 8 evenly, 3
    unevenly (3 + 3 + 2), 16 refused: more ranks than micro-batches."""
    train = {"global_batch_size": 64, "micro_batch_size": 8}
    config = {"launcher": "slurm", "train": train,
              "machine": {"nodes": nodes, "cpu_ranks_per_node": ranks}}  # fmt: skip
    if works:
        run = ddpconfig.check_runs(config)[1][0]
        world = run["world_size"]
        shares = [ddpconfig.accumulation_steps(run["train"], world, r) for r in range(world)]
        assert (
            sum(shares) == 8
            and max(shares) - min(shares) <= 1
            and shares == sorted(shares, reverse=True)
        )
        return
    with pytest.raises(ConfigError, match=r"world size 16 .* more than 8 micro-batches a step: "
                       r"world sizes up to 8 work \(1, 2, 4, 8 evenly\)"):  # fmt: skip
        ddpconfig.check(config)


def test_the_world_size_is_not_in_the_training_fingerprint():
    """Nodes and ranks per node are the machine's: the same science at any world size."""
    base = ddpconfig.training_fingerprint(make_run(machine={"cpu_ranks_per_node": 2}))
    for machine in ({"cpu_ranks_per_node": 1}, {"nodes": 2, "cpu_ranks_per_node": 1}):
        config = ddpconfig.check({"launcher": "slurm", "machine": machine})
        assert ddpconfig.training_fingerprint(ddpconfig.resolve_runs(config)[0]) == base
    fsdp = {"strategy": "fsdp"}  # its keys and plain layout count at any world size
    one, two = (make_run(train=fsdp, machine={"cpu_ranks_per_node": n}) for n in (1, 2))
    assert ddpconfig.training_fingerprint(one) == ddpconfig.training_fingerprint(two)
    assert not ddpconfig.uses_channels_last(one) and not ddpconfig.uses_channels_last(two)


# --- bad configs through the real workflow ----------------------------------------------------

# (id, config.yaml overrides, texts the message must contain: the key, the value, the fix)
WORKFLOW_CASES = [
    ("epochs-string", {"train": {"epochs": "ten"}}, ["train.epochs", "'ten'"]),
    ("unknown-dataset", {"data": {"source": "imagenet"}}, ["data.source", "imagenet"]),
    ("nodes-2-local", {"machine": {"nodes": 2}}, ["machine.nodes", "local"]),
    ("gpus-local-without-gpu", {"machine": {"gpus_per_node": 1}},
     ["machine.gpus_per_node is 1", "no NVIDIA GPU", "gpus_per_node: 0"]),
    ("lr-word", {"train": {"optimizer": {"lr": "fast"}}},
     ["train.optimizer.lr", "'fast'", "in quotes"]),
    ("time-min-words", {"machine": {"time_min": "an hour"}}, ["machine.time_min", "1:30:00"]),
    ("max-train-samples-1", {"data": {"max_train_samples": 1}},
     ["data.max_train_samples is 1", "less than one global batch", "global_batch_size 64"]),
    ("per-rank-batch", {"train": {"batch_size": 32}},
     ["train.batch_size (per rank) is replaced", "global_batch_size: 64"]),
    ("world-size-3", {"machine": {"cpu_ranks_per_node": 3}},
     ["is more than 2 micro-batches a step: world sizes up to 2 work"]),
    ("run-name-space", {"runs": [{"name": "my run"}]},
     ["runs[0].name", "'my run'", "letters, digits"]),
    ("misspelt-key", {"train": {"global_batchsize": 64}},
     ["train", "did you mean 'global_batch_size' for 'global_batchsize'?"]),
    ("precision-fp8", {"train": {"precision": "fp8"}}, ["train.precision", "fp8"]),
    ("static-graph-accumulation",
     {"train": {"global_batch_size": 128, "ddp": {"static_graph": True}}},
     ["train.ddp.static_graph", "static_graph: false"]),
    ("duplicate-runs", {"runs": [{"name": "a"}, {"name": "a"}]}, ["runs", "unique", "'a'"]),
    ("val-fraction", {"data": {"val_fraction": 0.7}}, ["data.val_fraction", "0.7"]),
    ("unknown-optimizer", {"train": {"optimizer": {"name": "lion"}}},
     ["train.optimizer.name", "lion"]),
    ("run-bad-type", {"runs": [{"name": "ok"}, {"name": "broken", "train": {"epochs": "x"}}]},
     ["runs[1]", "broken", "train.epochs"]),
    ("cores-times-threads", {"machine": {"cpu_ranks_per_node": 2, "cpus_per_task": 0}},
     ["machine.cpus_per_task"]),
    # folders that cannot be made: one ddpflow block, not Snakemake's tracebacks
    ("results-below-a-file", {"results_dir": "results/runs/default/model.pt/results"},
     ["results_dir 'results/runs/default/model.pt/results'", "is a file, not a folder"]),
    ("logs-in-proc", {"logs_dir": "/proc/ddpflow-logs"},
     ["logs_dir '/proc/ddpflow-logs'", "/proc is the kernel's"]),
]  # fmt: skip

# what an earlier, successful run left: a bad config must not touch any of it
PREVIOUS = {
    "results/runs/default/model.pt": b"weights of an earlier run",
    "results/runs/default/eval_metrics.json": b'{"accuracy": 0.99}',
    "results/report/report.html": b"<html>earlier report</html>",
    "results/work/default/checkpoints/step-00000010.pt": b"an interrupted attempt",
    "logs/train/default.log": b"earlier log",
}


def _snapshot(workdir: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under results/ and logs/, with its bytes and mtime."""
    return {
        str(path.relative_to(workdir)): (path.read_bytes(), path.stat().st_mtime_ns)
        for top in ("results", "logs")
        for path in sorted((workdir / top).rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def workflow_runs(tmp_path_factory):
    """The user's literal command (`snakemake`, no -n) on each bad config, in a folder that
    holds an earlier run's results; four at a time (each is ~3 s of CPU start-up)."""
    out, pending = {}, list(WORKFLOW_CASES)
    while pending:
        batch, pending = pending[:4], pending[4:]
        started = {}
        for name, overrides, _ in batch:
            workdir = tmp_path_factory.mktemp(name)
            for relative, content in PREVIOUS.items():
                (workdir / relative).parent.mkdir(parents=True, exist_ok=True)
                (workdir / relative).write_bytes(content)
            before = _snapshot(workdir)
            configfile = workdir / "bad.yaml"
            configfile.write_text(yaml.safe_dump(overrides))
            # no GPU visible, whatever machine runs the tests
            cmd, env = snakemake_command(workdir, configfile, env={"CUDA_VISIBLE_DEVICES": ""})
            proc = subprocess.Popen(
                cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            started[name] = (workdir, before, proc)
        for name, (workdir, before, proc) in started.items():
            try:
                output, _ = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                output, _ = proc.communicate()
            out[name] = (workdir, before, proc.returncode, output)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("name", "expected"), [(c[0], c[2]) for c in WORKFLOW_CASES])
def test_workflow_refuses_bad_config_before_submitting(workflow_runs, name, expected):
    """One clear message naming the key, the value and the fix; nothing submitted, and an
    earlier run's results, checkpoints and logs untouched."""
    workdir, before, returncode, output = workflow_runs[name]
    assert returncode != 0, output
    assert "ddpflow: configuration error" in output, output
    for part in expected:
        assert part in output, f"{part!r} not in:\n{output}"
    assert "Traceback" not in output, output  # a clean message, not a crash
    assert _snapshot(workdir) == before, "results/ or logs/ changed"
    assert not any(workdir.rglob("*submitit*")), "a job was submitted"
    assert not (workdir / "results/staged").exists(), "staging ran"


def test_warnings_are_printed_by_the_dry_run(tmp_path):
    configfile = tmp_path / "odd.yaml"
    configfile.write_text(yaml.safe_dump({"train": {"warmup_epochs": 50, "epochs": 3}}))
    cmd, env = snakemake_command(tmp_path, configfile, "-n")
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ddpflow: warning: run 'default': train.warmup_epochs 50" in done.stderr


@pytest.mark.e2e
def test_oversized_batch_fails_the_train_rule_before_submitting(tmp_path):
    """Known only once the data are staged: the train rule refuses before any job exists."""
    configfile = tmp_path / "big.yaml"
    configfile.write_text(yaml.safe_dump({"train": {"global_batch_size": 100032}}))
    cmd, env = snakemake_command(tmp_path, configfile)
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    log = (tmp_path / "logs/train/default.log").read_text()
    assert "train.global_batch_size is 100032" in log and "at most 1280" in log, log
    assert "Traceback" not in log, log
    assert not (tmp_path / "logs/submitit/default/train").exists(), "a job was submitted"
    assert not (tmp_path / "results/runs/default/model.pt").exists()
    assert any((tmp_path / "results/staged").iterdir()), "staging should have run and stayed"


def test_moving_a_key_in_the_config_file_does_not_change_the_stage_params():
    """Snakemake compares the stage rule's dict param by its text: the order of the keys in
    config.yaml must not count (else moving a line restages and retrains), and the schema's
    order is the one earlier releases' shipped config.yaml produced."""
    data = ddpconfig.load(None)["data"]
    moved = dict(reversed(list(data.items())))
    assert repr(ddpconfig.stage_params(moved)) == repr(ddpconfig.stage_params(data))
    assert list(ddpconfig.stage_params(data))[:5] == [
        "source",
        "kwargs",
        "root",
        "path",
        "image_size",
    ]


# --- YAML errors: file, line, column, the key they are under -----------------------------

YAML_ERRORS = [
    (
        "unclosed-bracket",
        "train:\n  optimizer:\n    lr: [1, 2\nmodel: {name: cnn}\n",
        [
            ":4:6: not valid YAML (under model)",
            "flow sequence, which starts at line 3, column 9",
            "    lr: [1, 2",
        ],
    ),
    ("tab", "train:\n  epochs: 3\n\tlr: 2\n", [":3:1: not valid YAML", "never tabs"]),
    ("bad-indent", "train:\n  epochs: 3\n lr: 2\n", [":3:2: not valid YAML", "line 1, column 1"]),
    (
        "duplicate-key",
        "machine:\n  nodes: 1\n  gpus_per_node: 0\n  nodes: 2\n",
        [":4:3:", "(under machine.nodes)", "'nodes' is given twice (first on line 2)"],
    ),
]


@pytest.mark.parametrize(
    ("text", "expected"), [c[1:] for c in YAML_ERRORS], ids=[c[0] for c in YAML_ERRORS]
)
def test_a_yaml_error_names_the_file_line_column_and_key(tmp_path, text, expected):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        ddpconfig.load(path)
    for part in [str(path), *expected]:
        assert part in str(err.value), str(err.value)


def test_a_config_file_that_is_not_a_mapping_is_named(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("- data\n- model\n")
    with pytest.raises(ConfigError, match="the top level must be a mapping of keys .* not a list"):
        ddpconfig.load(path)


def test_snakemake_names_the_yaml_error_in_config_yaml(tmp_path):
    """The user's own file, read by the Snakefile's configfile: directive: ddpflow's message
    with file, line and column, no traceback, instead of Snakemake's 'not valid JSON or YAML'."""
    (tmp_path / "config").mkdir()
    (tmp_path / "config/config.yaml").write_text(YAML_ERRORS[0][1])
    cmd, env = snakemake_command(tmp_path, None, "-n")
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "ddpflow: configuration error: config/config.yaml:4:6: not valid YAML" in output
    assert "Traceback" not in output and "not valid JSON or YAML" not in output, output


def test_a_plugin_tasks_kwargs_typo_is_a_configuration_error(in_workdir):
    """What the workflow's parse builds anyway (a plug-in task with its task_kwargs) is
    refused as ddpflow's one block, not Snakemake's ConfigError in common.smk."""
    import shutil

    shutil.copy(REPO / "tests/plugin_task/ordinal.py", in_workdir / "ordinal.py")
    run = make_run(
        task="ordinal:make", task_kwargs={"grades": 5}, data={"source": "npz", "path": "g.npz"}
    )
    with pytest.raises(ConfigError, match="run 'default': task 'ordinal:make'.*'grades'"):
        ddpconfig.check_plugin_tasks([run])


def test_an_immutable_run_folder_is_refused_before_the_workflow_starts(tmp_path):
    """chattr +i on a finished run's folder: one configuration error naming the folder (the
    kept-outputs hook would otherwise end in a traceback)."""
    from ddpflow.checks.host import check_run_folders

    folder = tmp_path / "results/runs/default"
    folder.mkdir(parents=True)
    (folder / "model.pt").write_bytes(b"weights")
    check_run_folders(str(tmp_path / "results"), ["default", "absent"])  # writable: fine
    made = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"chattr +i does not work here: {made.stderr.strip()}")
    try:
        with pytest.raises(ConfigError, match=r"run 'default': .*runs/default cannot be written"):
            check_run_folders(str(tmp_path / "results"), ["default"])
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
