"""The config's values, checked before anything is submitted: combinations of keys the
schema cannot express (a ConfigError naming the keys and the fix), legal but suspicious
settings (run_warnings), trackers and exports whose packages are missing. The global batch
against the world size is batch.py; checks against a Slurm cluster are slurm.py.
"""

from __future__ import annotations

import importlib.util
import os

from ddpflow.checks.batch import check_world_size
from ddpflow.checks.container import check_container, container_warnings
from ddpflow.checks.host import cpu_computes_bf16, local_gpu_count
from ddpflow.checks.model_kwargs import check_gpt_kwargs
from ddpflow.checks.tensor_parallel import check_tensor_parallel, tensor_parallel_warnings
from ddpflow.checks.token_windows import check_token_windows
from ddpflow.config.fingerprint import BUILT_IN_MODELS
from ddpflow.config.machine import (
    SHARDED_STRATEGIES,
    accumulation_steps,
    data_parallel_size,
    hsdp_mesh,
    hsdp_shard_size,
    micro_batches_per_step,
    ranks_per_node,
    splitting_micro_batch,
    tensor_parallel_degree,
    trains_sharded,
    working_world_sizes,
)
from ddpflow.config.schema import ConfigError, validate
from ddpflow.plugins import is_plugin
from ddpflow.runtime import usable_cores
from ddpflow.words import counted


def check_resolved_run(run: dict, launcher: str) -> None:
    """Refuse, naming the keys and the fix, a resolved run whose settings cannot work
    together (checked in this order: the first problem is the one reported)."""
    where = f"runs ({run['name']!r})"
    _check_machine(where, run["machine"], launcher)
    _check_features(where, run)
    _check_data_and_model(where, run)
    _check_batches(where, run)


def _check_machine(where: str, machine: dict, launcher: str) -> None:
    if launcher == "local" and machine["nodes"] > 1:
        raise ConfigError(
            f"{where}: machine.nodes is {machine['nodes']} but the local launcher runs on one "
            "machine; set machine.nodes: 1 or run with --profile profiles/slurm"
        )
    if launcher == "local" and machine["gpus_per_node"]:
        _check_local_gpus(where, machine["gpus_per_node"])
    _check_min_nodes(where, machine)
    check_container(where, machine, launcher)


def _check_features(where: str, run: dict) -> None:
    """Training features that do not combine (train.tensor_parallel: checks.tensor_parallel,
    strategies fsdp and hsdp: _check_fsdp, hsdp's mesh: _check_hsdp)."""
    train = run["train"]
    check_tensor_parallel(where, run)
    if train["strategy"] in SHARDED_STRATEGIES:
        _check_fsdp(where, run)
    if train["strategy"] == "hsdp":
        _check_hsdp(where, run)
    if train["activation_checkpointing"] and train["compile"]:
        raise ConfigError(
            f"{where}: train.activation_checkpointing with train.compile: true is not "
            "supported yet; set one of them to false"
        )


def _check_data_and_model(where: str, run: dict) -> None:
    """Keys a data source or model requires, or refuses; gpt's model.kwargs, which decide
    whether it can be built."""
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
    if model["name"] in BUILT_IN_MODELS and model["name"] != "gpt" and model["kwargs"]:
        raise ConfigError(
            f"{where}: model.kwargs {model['kwargs']} is set for the built-in model "
            f"{model['name']!r}, which takes none (they are for torchvision models and "
            f"plug-ins); remove model.kwargs, or use the built-in model's own keys "
            f"(model.cnn_channels, model.mlp_hidden)"
        )
    if model["name"] == "gpt":
        check_gpt_kwargs(where, model["kwargs"])
    check_token_windows(where, run)
    if not is_plugin(model["name"]) and "weights" in model["kwargs"]:
        raise ConfigError(
            f"{where}: model.kwargs.weights: pretrained weights go in model.weights (a "
            "torchvision name like DEFAULT read from the local torch hub cache, a file, or "
            "run:NAME), where they are checked and loaded strictly; remove it from model.kwargs "
            "(docs/fine-tuning.md)"
        )


def _check_batches(where: str, run: dict) -> None:
    """The global batch against the world size (its data-parallel ranks: world size /
    train.tensor_parallel), the training samples and DDP's static graph."""
    machine, train, world = run["machine"], run["train"], run["world_size"]
    machine_text = (
        f" (machine.nodes {machine['nodes']} x {counted(ranks_per_node(machine), 'rank')})"
    )
    check_world_size(where, train, world, machine_text)
    samples = run["data"]["max_train_samples"]
    if samples is not None and samples < train["global_batch_size"]:
        raise ConfigError(
            f"{where}: data.max_train_samples is {samples}, less than one global batch "
            f"(train.global_batch_size {train['global_batch_size']}): an epoch would have no "
            f"step; raise max_train_samples or lower global_batch_size"
        )
    # torch 2.14 fails an internal assert at the first no_sync micro-step with a static graph
    # (pytorch/pytorch#143580): refuse it here, not minutes later on every rank. With
    # train.tensor_parallel no DistributedDataParallel wraps the model (run_warnings says so)
    accum = accumulation_steps(train, data_parallel_size(train, world))
    wraps_ddp = tensor_parallel_degree(train) == 1 and world > 1
    if train["ddp"]["static_graph"] and accum > 1 and wraps_ddp:
        raise ConfigError(
            f"{where}: train.ddp.static_graph is true with {accum} accumulation steps per "
            f"rank (global_batch_size {train['global_batch_size']} / (micro_batch_size "
            f"{train['micro_batch_size']} x world size {world})): DDP's static graph does not "
            "support skipping the all-reduce on accumulation steps; set "
            "train.ddp.static_graph: false, or micro_batch_size x world size = global_batch_size"
        )


def _check_fsdp(where: str, run: dict) -> None:
    """Combinations strategies fsdp and hsdp do not support, refused before anything is
    submitted."""
    train, gpu = run["train"], bool(run["machine"]["gpus_per_node"])
    strategy = train["strategy"]
    if gpu and train["precision"] == "fp16":
        raise ConfigError(
            f"{where}: train.strategy {strategy} with train.precision fp16: fp16's gradient scaler "
            "is not built for sharded gradients here; use train.precision: bf16 (FSDP's "
            "mixed precision: bf16 parameters and compute, fp32 gradient reduction)"
        )
    if train["compile"]:
        raise ConfigError(
            f"{where}: train.strategy {strategy} with train.compile: true is not supported yet; "
            "set train.compile: false, or train.strategy: ddp or zero"
        )
    if train["fsdp"]["cpu_offload"] and not gpu:
        raise ConfigError(
            f"{where}: train.fsdp.cpu_offload is true but the run has no GPU "
            "(machine.gpus_per_node is 0): everything is in host memory already; set "
            "train.fsdp.cpu_offload: false"
        )


def _check_hsdp(where: str, run: dict) -> None:
    """hsdp's shard groups must split every world size the run may get (machine.min_nodes
    to machine.nodes nodes)."""
    machine = run["machine"]
    shard = hsdp_shard_size(run["train"], machine)
    per_node = ranks_per_node(machine)
    fewest = machine["min_nodes"] or machine["nodes"]
    worlds = [n * per_node for n in range(fewest, machine["nodes"] + 1)]
    given = run["train"]["hsdp"]["shard_size"]
    if given is not None and given > min(worlds) > 1:  # would be clamped: not what was asked
        raise ConfigError(
            f"{where}: train.hsdp.shard_size {given} is more than the world size "
            f"{min(worlds)} ({min(worlds) // per_node} nodes x {per_node} ranks): a shard group "
            f"holds at most every rank; set train.hsdp.shard_size to a divisor of "
            f"{min(worlds)}, or null (the {per_node} ranks of a node)"
        )
    bad = [world for world in worlds if world > 1 and hsdp_mesh(world, shard) is None]
    if bad:
        raise ConfigError(
            f"{where}: train.hsdp.shard_size {shard} does not divide the world size "
            f"{bad[0]} ({bad[0] // per_node} nodes x {per_node} ranks); set "
            f"train.hsdp.shard_size to a divisor of it, or null (the {per_node} ranks of a node)"
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
    if machine.get("spare_nodes") and not machine.get("restarts_in_job"):
        raise ConfigError(
            f"{where}: machine.spare_nodes is {machine['spare_nodes']} but "
            "machine.restarts_in_job is 0: spare nodes only serve restarts inside the job; set "
            "machine.restarts_in_job above 0 (3 by default), or machine.spare_nodes: 0"
        )


def _check_local_gpus(where: str, wanted: int) -> None:
    """The local launcher runs on this machine: it must have the GPUs asked for (counted
    without importing torch: CUDA_VISIBLE_DEVICES, else the NVIDIA driver's device list)."""
    if os.environ.get("DDPFLOW_ALLOW_CPU_FALLBACK") == "1":
        return
    found = local_gpu_count()
    if found >= wanted:
        return
    have = "no NVIDIA GPU" if found == 0 else counted(found, "GPU")
    raise ConfigError(
        f"{where}: machine.gpus_per_node is {wanted} but this machine has {have} (counted from "
        "CUDA_VISIBLE_DEVICES, else /dev/nvidia*) and the local launcher runs here; set "
        "machine.gpus_per_node: 0 for CPU ranks, or run on a GPU machine or cluster "
        "(--profile slurm)"
    )


def micro_batch_warnings(where: str, train: dict, chosen, world: int = 1) -> list[str]:
    """A cap below the micro-batch written by hand, and an edit that changes the micro-batch
    of a model whose forward draws per micro-batch (checks.norm_batch): that retrains."""
    out, micro = [], train["micro_batch_size"]
    if chosen.get("max") is not None and not chosen["auto"] and micro > chosen["max"]:
        out.append(
            f"{where}: train.micro_batch_size {micro} is above train.max_micro_batch_size "
            f"{chosen['max']}, which acts only with micro_batch_size auto; lower the number "
            "to fit the cap, or set micro_batch_size: auto"
        )
    recorded = chosen.get("recorded")
    if chosen.get("role") == "draws" and chosen.get("auto") and recorded not in (None, micro):
        keep = "no micro-batch keeps it"
        if train["global_batch_size"] % recorded == 0:
            keep = f"write train.micro_batch_size: {recorded} to keep it"
        out.append(
            f"{where}: this retrains: train.micro_batch_size auto resolves to {micro} at this "
            f"machine, and the run trained with {recorded}; its model draws random numbers per "
            f"micro-batch (dropout, or a model ddpflow cannot see into), so the micro-batch is "
            f"its science; {keep} (where the world size splits it)"
        )
    return out + _shares_warnings(where, train, chosen, world)


def _shares_warnings(where: str, train: dict, chosen, world: int) -> list[str]:
    """A new run whose BatchNorm batch this machine decided (it cannot hold the recipe's),
    and a step whose micro-batches the ranks share unevenly."""
    out, count = [], micro_batches_per_step(train)
    recipe = splitting_micro_batch(train["global_batch_size"], chosen.get("max"), [1])
    norm = chosen.get("norm")
    fresh = chosen.get("auto") and chosen.get("recorded") is None and train.get("norm_batch_size")
    if chosen.get("role") == "norm" and fresh and recipe and norm != recipe:
        out.append(
            f"{where}: BatchNorm's batch is {norm}, not the recipe's {recipe}: world size "
            f"{world} cannot hold {train['global_batch_size'] // recipe} batches of {recipe} a "
            f"step; once trained it stays {norm} at any world size (to keep {recipe}, write "
            f"train.norm_batch_size: {recipe} and a world size that holds it)"
        )
    if count % world:
        most, extra = -(-count // world), count % world
        out.append(
            f"{where}: world size {world} shares the step's {count} micro-batches unevenly: "
            f"{counted(extra, 'rank computes', 'ranks compute')} {most}, the others "
            f"{most - 1}, and every step waits for them; the science is the same "
            f"({', '.join(map(str, working_world_sizes(train)))} ranks share them evenly)"
        )
    return out


def run_warnings(run: dict, launcher: str) -> list[str]:
    """Legal but suspicious settings: the run starts, and these lines say what looks wrong."""
    where = f"run {run['name']!r}"
    machine, train, out = run["machine"], run["train"], []
    data_ranks = data_parallel_size(train, run["world_size"])
    out += micro_batch_warnings(where, train, run.get("micro_batch", {}), data_ranks)
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
    out += _strategy_warnings(where, run) + container_warnings(where, machine, launcher)
    out += tensor_parallel_warnings(where, run)
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


def _strategy_warnings(where: str, run: dict) -> list[str]:
    """Settings of a strategy the run does not train with: ignored, and said so."""
    train, out = run["train"], []
    if train["hsdp"]["shard_size"] is not None and train["strategy"] != "hsdp":
        out.append(
            f"{where}: train.hsdp.shard_size set, but train.strategy is {train['strategy']}: "
            "it is ignored (it shapes strategy hsdp's mesh)"
        )
    tensor = tensor_parallel_degree(train)
    if trains_sharded(run) or tensor > 1:
        defaults = validate({})["train"]["ddp"]
        changed = sorted(k for k, v in train["ddp"].items() if v != defaults[k])
        trains = f"strategy {train['strategy']}"
        if tensor > 1:  # ddp's gradients are averaged by training.tensor_parallel's sync
            trains = f"train.tensor_parallel {tensor} (strategy {train['strategy']})"
        if changed:
            out.append(
                f"{where}: train.ddp.{', train.ddp.'.join(changed)} set, but {trains} does not "
                "use DistributedDataParallel: these settings are ignored"
            )
    return out


# the Python modules each tracker's client needs (envs/tracking.txt, `make tracking`)
TRACKER_MODULES = {"mlflow": ("mlflow",), "sqlite": ("sqlalchemy", "alembic"), "wandb": ("wandb",)}


def tracking_enabled(tracking: dict) -> bool:
    """Whether `tracking:` enables any tracker (the track rule then runs for every run)."""
    return bool(tracking["mlflow"]["uri"]) or tracking["wandb"]["mode"] != "off"


def check_tracking(tracking: dict, find_spec=None) -> None:
    """Refuse, before anything runs, a tracker that cannot be used: its client not installed
    (found with importlib.util.find_spec, nothing imported) or MLflow's deprecated file
    store. find_spec: for tests, a stand-in for importlib.util.find_spec."""

    find_spec = find_spec or importlib.util.find_spec
    uri = tracking["mlflow"]["uri"]
    needed = []
    if uri:
        scheme = uri.partition("://")[0] if "://" in uri else ""
        if scheme in ("", "file"):
            raise ConfigError(
                f"tracking.mlflow.uri is {uri!r}: MLflow's file store (a folder) is deprecated "
                "and refused since MLflow 3.13; use sqlite:///results/mlflow.db (a file, no "
                "server) or a tracking server, http://host:5000"
            )
        needed.append(("tracking.mlflow.uri", TRACKER_MODULES["mlflow"]))
        if scheme == "sqlite":
            needed.append(("tracking.mlflow.uri (sqlite)", TRACKER_MODULES["sqlite"]))
    if tracking["wandb"]["mode"] != "off":
        needed.append(("tracking.wandb.mode", TRACKER_MODULES["wandb"]))
    for key, modules in needed:
        missing = [m for m in modules if _find(find_spec, m) is None]
        if missing:
            raise ConfigError(
                f"{key} enables a tracker but its client is not installed (no Python module "
                f"{', '.join(missing)}): run `make tracking` (installs envs/tracking.txt into "
                "the .venv), or switch the tracker off"
            )


def _find(find_spec, module: str):
    try:
        return find_spec(module)
    except (ImportError, ValueError):
        return None


# what export.formats: [onnx] needs (envs/onnx.txt, `make onnx`)
ONNX_MODULES = ("onnx", "onnxscript", "onnxruntime")


def check_export(export: dict, find_spec=None) -> None:
    """Refuse, before anything runs, an onnx export whose packages are not installed."""
    find_spec = find_spec or importlib.util.find_spec
    if "onnx" not in export["formats"]:
        return
    missing = [m for m in ONNX_MODULES if _find(find_spec, m) is None]
    if missing:
        raise ConfigError(
            f"export.formats has onnx but {', '.join(missing)} is not installed: run `make "
            "onnx` (installs envs/onnx.txt into the .venv), or leave onnx out of export.formats"
        )
