"""`python -m ddpflow plan`: a run's training at a cluster shape, simulated in one process
before anything is queued; nothing is allocated.

    python -m ddpflow plan --configfile config/config.yaml --nodes 128 --gpus-per-node 8
    python -m ddpflow plan --configfile F --nodes 128 --gpus-per-node 8 --json plan.json

For the run (default: the config's first) at nodes x ranks per node:

* the memory estimate per rank and strategy (ddp, zero, fsdp, hsdp): one training step measured
  on fake tensors (ddpflow.training.footprint) turned into a rank's peak at this world size
  (ddpflow.checks.memory), for rank 0 and for the others, in bytes (`peak_bytes`);
* the FSDP units and the device mesh (the run's: hsdp's replicate x shard mesh under
  strategy hsdp, else fsdp's), from FSDP2's fully_shard on a meta-device model in a fake
  process group of the whole world (ddpflow.training.sharding_plan), and the parameter
  bytes a rank's shards really hold (FSDP pads each parameter's rows to the shard count);
* each rank's micro-batches of an optimizer step (ddpflow.training.schedule);
* the checkpoint: its files, and after a resume at --resume-nodes which files each rank reads.

The strategies planned are those ddpflow trains (ddp, zero, fsdp, hsdp). With
train.tensor_parallel T: ddp and fsdp (those that combine with it); the micro-batches, the
fsdp mesh and a resume's reads are of the data-parallel ranks (world size / T), and the
memory counts a rank's tensor share of each GPT block's projections.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from ddpflow import config as ddpconfig
from ddpflow.checks import memory as fits
from ddpflow.checks.early import RUNTIME, input_of, read_footprints
from ddpflow.checks.tensor_parallel import WITH_TENSOR_PARALLEL
from ddpflow.config.fingerprint import TOKEN_SOURCES
from ddpflow.config.machine import (
    SHARDED_STRATEGIES,
    accumulation_steps,
    data_parallel_size,
    micro_batches_per_step,
    ranks_per_node,
    tensor_parallel_degree,
)
from ddpflow.paths import RunPaths
from ddpflow.task.builtin_views import TEXT_VOCABULARY
from ddpflow.words import counted

STRATEGIES = ("ddp", "zero", "fsdp", "hsdp")


def load_run(configfile: str, nodes: int, per_node: int, name: str | None) -> dict:
    """The run at this shape, checked as the workflow checks it (a Slurm shape: the local
    launcher runs one machine). Raises ConfigError naming what does not divide or fit."""
    shape = {"nodes": nodes, "gpus_per_node": per_node}  # 0 GPUs: machine.cpu_ranks_per_node
    cfg = ddpconfig.load(configfile, {"launcher": "slurm", "machine": shape})
    name = name or ddpconfig.run_entries(cfg)[0][0]["name"]
    run = ddpconfig.run_by_name(cfg, name)
    given = {k: run["machine"][k] for k in shape}
    if given != shape:
        raise ddpconfig.ConfigError(
            f"run {name!r} sets its own machine {given} under runs:, which --nodes/"
            "--gpus-per-node do not override: remove it there to plan other shapes"
        )
    return {**run, "results_dir": cfg["results_dir"]}


def model_input(run: dict) -> tuple[list[int], int, int, int | None]:
    """(input shape, outputs, data bytes a rank holds, most rows scored) of run: from its
    staged manifest, else from the config (ddpflow.checks.early.input_of; a language model's block
    and vocabulary)."""
    staged = Path(RunPaths.for_run(run["results_dir"], run).staged) / "manifest.json"
    manifest = json.loads(staged.read_text()) if staged.is_file() else None
    found = input_of(run, manifest)
    if found is not None:
        return found
    data = run["data"]
    if data["source"] in TOKEN_SOURCES:  # a task that reads tokens (config.runs checks)
        vocab = data["vocab_size"] or TEXT_VOCABULARY
        return [data["block_size"]], vocab, 0, None
    raise ddpconfig.ConfigError(
        f"run {run['name']!r}: its input shape is known only after staging "
        f"(data.source {data['source']}): run `python -m ddpflow stage` first"
    )


def rank_process() -> dict:
    """A fresh rank's own memory after its imports (training.footprint.process_memory): the
    workflow's measurement where it made one (ddpflow.checks.early's cache), else measured in a
    fresh process. Never this process's: a login-node process that has built models since
    its start holds far more than a rank starts with."""
    known = read_footprints().get(RUNTIME)
    if isinstance(known, dict) and {"anon", "file"} <= set(known):
        return known
    code = "import json; from ddpflow.training import footprint as f; "
    code += "print(json.dumps(f.process_memory()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def memory(run: dict, inputs) -> dict[str, dict]:
    """{strategy: {"peak_bytes": {"rank_0", "other_ranks"}, "parts": ...}} at run's world."""
    from ddpflow.training import footprint

    shape, outputs, data_bytes, rows = inputs
    want = fits.figures_request(run, shape, outputs, rows)
    figures = footprint.measure(want.pop("model"), **{k: v for k, v in want.items() if k != "code"})
    cpu = fits.device_of(run) == "cpu"
    process = rank_process() if cpu else {"anon": 0, "file": 0}
    out = {}
    planned = STRATEGIES if tensor_parallel_degree(run["train"]) == 1 else WITH_TENSOR_PARALLEL
    for strategy in planned:
        variant = {**run, "train": {**run["train"], "strategy": strategy}}
        est = fits.estimate(variant, figures, process, data_bytes)
        others = dataclasses.replace(est, gather=0)  # only rank 0 gathers for a checkpoint
        parts = {
            k: getattr(est, k)
            for k in (
                "parameters",
                "gradients",
                "optimizer",
                "activations",
                "evaluation",
                "data",
                "runtime",
            )
        }
        out[strategy] = {
            "peak_bytes": {"rank_0": est.total, "other_ranks": others.total},
            "parts": {**parts, "rank_0_checkpoint_gather": est.gather},
        }
    return out


def plan(configfile: str, nodes: int, per_node: int, name=None, resume_nodes=None) -> dict:
    """The whole plan (module docstring) as a JSON-ready dict."""
    from ddpflow.training import sharding_plan as sp

    started = time.perf_counter()
    run = load_run(configfile, nodes, per_node, name)
    world, inputs = run["world_size"], model_input(run)
    resume = resume_nodes or max(1, nodes // 2)
    per_node, tensor = ranks_per_node(run["machine"]), tensor_parallel_degree(run["train"])
    mesh = _mesh(run, nodes, per_node // tensor)  # over the data-parallel ranks
    layout = sp.shard_layout(run["model"], inputs[0], inputs[1], mesh)
    data = data_parallel_size(run["train"], world)
    shares = sp.micro_batch_shares(micro_batches_per_step(run["train"]), data)
    strategies = memory(run, inputs)
    own = run["train"]["strategy"] if world > 1 else "ddp"
    return {
        "run": run["name"],
        "nodes": nodes,
        # machine.spare_nodes: held idle by the training job for a lost node's ranks
        "spare_nodes": run["machine"].get("spare_nodes", 0),
        "ranks_per_node": per_node,
        "world_size": world,
        "tensor_parallel": tensor,
        "data_parallel_size": data,
        "strategy": own,
        "peak_bytes": strategies[own]["peak_bytes"],
        "strategies": strategies,
        "fsdp": _fsdp_part(layout),
        "micro_batches": _micro_part(run, shares),
        "eval_batch_size": run["eval"]["batch_size"],
        "checkpoint": _checkpoint_part(run, layout, resume * per_node, per_node),
        "input": {"shape": inputs[0], "outputs": inputs[1]},
        "seconds": round(time.perf_counter() - started, 2),
    }


def _mesh(run: dict, nodes: int, per_node: int):
    """The run's sharding mesh: hsdp's under strategy hsdp, else fsdp's (what the run would
    shard like under fsdp)."""
    from ddpflow.training import sharding_plan as sp

    strategy = "hsdp" if run["train"]["strategy"] == "hsdp" else "fsdp"
    return sp.MeshSpec.for_strategy(strategy, nodes, per_node, run["train"]["hsdp"]["shard_size"])


def _fsdp_part(layout) -> dict:
    return {
        "mesh": {"shape": list(layout.mesh.shape), "names": list(layout.mesh.names)},
        "units": layout.units,
        "placements": sorted(set(layout.placements.values())),
        "parameter_bytes_whole": layout.full_bytes,
        # what fully_shard's shards hold on a rank (padded: the same on every rank), against
        # the even split the memory estimate assumes
        "parameter_bytes_per_rank": layout.rank0_bytes,
        "even_split_bytes": -(-layout.full_bytes // layout.mesh.shape[-1]),
        "ranks_symmetric": True,
    }


def _micro_part(run: dict, shares: list[list[int]]) -> dict:
    train = run["train"]
    return {
        "per_step": micro_batches_per_step(train),
        "micro_batch_size": train["micro_batch_size"],
        # by data-parallel rank: a tensor group's ranks compute the same micro-batches
        "per_rank": accumulation_steps(train, data_parallel_size(train, run["world_size"])),
        "by_rank": shares,
        # BatchNorm's batch and the ranks that normalise one together (checks.norm_batch)
        "norm_batch_size": train.get("norm_batch_size", train["micro_batch_size"]),
        "norm_group": (run.get("micro_batch") or {}).get("group", 1),
    }


def _checkpoint_part(run: dict, layout, resume_world: int, per_node: int) -> dict:
    """fsdp: one DCP file per rank (its shards) and which ones each rank reads after a resume
    at resume_world; ddp and zero: rank 0's one file, read whole by every rank; with
    train.tensor_parallel: _tensor_checkpoint_part."""
    from ddpflow.training import sharding_plan as sp

    tensor = tensor_parallel_degree(run["train"])
    if tensor > 1:
        return _tensor_checkpoint_part(run, resume_world)
    if run["train"]["strategy"] not in SHARDED_STRATEGIES or run["world_size"] == 1:
        return {
            "format": "torch.save (rank 0)",
            "files": 1,
            "resume_world_size": resume_world,
            "reads": "every rank reads rank 0's file whole",
        }
    if micro_batches_per_step(run["train"]) < resume_world:  # fewer may share unevenly
        return {
            "format": "DCP",
            "files": run["world_size"],
            "resume_world_size": resume_world,
            "reads": f"{resume_world} ranks are more than the step's micro-batches",
        }
    new = _mesh(run, resume_world // per_node or 1, min(per_node, resume_world))
    reads = sp.resharding_reads(layout.sizes, layout.mesh, new)
    return {
        "format": "DCP (ckpt-<step>.dcp/__<rank>_0.distcp per rank, rank 0's .pt commits)",
        "files": run["world_size"],
        "resume_world_size": resume_world,
        "reads": reads,
        # fsdp: shard k is rank k's file; hsdp: shard k is held by one rank of each replica
        # group and DCP writes it once, in the file of one of them
        "reads_from_means": "shard index" if len(layout.mesh.shape) == 2 else "rank",
        "most_files_one_rank_reads": max(len(r["reads_from"]) for r in reads),
    }


def _tensor_checkpoint_part(run: dict, resume_world: int) -> dict:
    """train.tensor_parallel: DCP at every strategy, one file per rank; after a resume each
    rank reads its slices by index (not planned file by file here)."""
    data = data_parallel_size(run["train"], resume_world)
    reads = "each rank reads its tensor and data slices by index (not planned per file)"
    if not data or micro_batches_per_step(run["train"]) % data:
        reads = f"{data} data-parallel ranks do not divide the step's micro-batches"
    return {
        "format": "DCP (ckpt-<step>.dcp/__<rank>_0.distcp per rank, rank 0's .pt commits)",
        "files": run["world_size"],
        "resume_world_size": resume_world,
        "reads": reads,
    }


def _spares_text(doc: dict) -> str:
    spares = doc.get("spare_nodes", 0)
    return (
        f", and {spares} spare node{'s' if spares != 1 else ''} held for a lost one"
        if spares
        else ""
    )


def render(doc: dict) -> str:
    """The terminal's short table."""
    gib, tensor = 2**30, doc.get("tensor_parallel", 1)
    who, split = "rank", ""
    if tensor > 1:  # the data-parallel ranks split the batch and shard the state
        who = f"data-parallel rank (of {doc['data_parallel_size']}; tensor_parallel {tensor})"
        split = f", each block's projections then split {tensor} ways"
    lines = [
        f"run {doc['run']!r} at {doc['nodes']} nodes x {doc['ranks_per_node']} ranks = "
        f"{doc['world_size']} ranks{_spares_text(doc)} (planned in {doc['seconds']:.1f} s, "
        "nothing allocated)",
        f"{'strategy':<10}{'rank 0 GiB':>12}{'others GiB':>12}",
    ]
    for name, part in doc["strategies"].items():
        peak = part["peak_bytes"]
        mark = "  <- train.strategy" if name == doc["strategy"] else ""
        lines.append(
            f"{name:<10}{peak['rank_0'] / gib:>12.2f}{peak['other_ranks'] / gib:>12.2f}{mark}"
        )
    fsdp, micro, ckpt = doc["fsdp"], doc["micro_batches"], doc["checkpoint"]
    lines.append(_parts_text(doc))
    grouped = ""
    if micro.get("norm_group", 1) > 1:
        grouped = (
            f"; BatchNorm's batch of {micro['norm_batch_size']} normalised by "
            f"{micro['norm_group']} ranks together"
        )
    lines += [
        f"{doc['strategy'] if doc['strategy'] == 'hsdp' else 'fsdp'} mesh "
        f"{fsdp['mesh']['shape']} {fsdp['mesh']['names']}, {len(fsdp['units'])} "
        f"units; {fsdp['parameter_bytes_per_rank'] / 2**20:.1f} MiB of parameters per rank "
        f"(even split {fsdp['even_split_bytes'] / 2**20:.1f} MiB{split})",
        f"micro-batches: {micro['per_step']} per step, {_shares_text(micro, who)}{grouped}",
        f"checkpoint: {ckpt['format']}, {ckpt['files']} files; resumed at "
        f"{ckpt['resume_world_size']} ranks: " + _reads_text(ckpt),
    ]
    return "\n".join(lines)


def _shares_text(micro: dict, who: str) -> str:
    """How the ranks share a step's micro-batches: evenly, or the first ones one more."""
    sizes = sorted({len(rank) for rank in micro["by_rank"]}) or [micro["per_rank"]]
    if len(sizes) == 1:
        a = sizes[0]
        return f"{a} per {who} (rank r computes [r*{a}, (r+1)*{a}))"
    extra = sum(len(rank) == sizes[-1] for rank in micro["by_rank"])
    return (
        f"{sizes[-1]} or {sizes[0]} per {who} (the first {extra} one more: the step waits "
        "for them; each computes a contiguous block)"
    )


def _parts_text(doc: dict) -> str:
    """What the run's own strategy's rank 0 peak is made of (an evaluation batch of a
    language model's logits can be most of it: eval.batch_size is its knob)."""
    parts = doc["strategies"][doc["strategy"]]["parts"]
    knobs = {
        "activations": f" (train.micro_batch_size {doc['micro_batches']['micro_batch_size']})",
        "evaluation": f" (eval.batch_size {doc.get('eval_batch_size', '?')})",
    }
    named = ", ".join(
        f"{name.replace('rank_0_', '').replace('_', ' ')} {value / 2**30:.2f}{knobs.get(name, '')}"
        for name, value in parts.items()
        if value
    )
    return f"{doc['strategy']} rank 0 GiB: {named or 'nothing measurable'}"


def _reads_text(ckpt: dict) -> str:
    if isinstance(ckpt["reads"], str):
        return ckpt["reads"]
    most = ckpt["most_files_one_rank_reads"]
    if ckpt.get("reads_from_means") == "shard index":
        return f"a rank reads at most {counted(most, 'shard')} (each written once, by one replica)"
    return f"a rank reads at most {most} ranks' files"
