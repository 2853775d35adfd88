"""What the jobs write: train_summary.json's content (rank 0 of the training job), what an
evaluation writes and what its rule logs: eval_metrics.json's record (rank 0 of
the training job or of the evaluate job) and the published subset. No torch: the login
node's rules read these too."""

from __future__ import annotations

from ddpflow import runtime
from ddpflow.checks.weight_files import input_normalisation
from ddpflow.cluster.distenv import DistEnv
from ddpflow.config import plugin_source, plugin_source_hash
from ddpflow.config.typed import RunSpec, RunView
from ddpflow.data.windows import scored_samples
from ddpflow.monitoring import flops
from ddpflow.plugins import is_plugin
from ddpflow.task import run_task
from ddpflow.words import counted


def evaluation_record(
    run: RunSpec, result, manifest, world_size, hosts, train, evaluated_by
) -> dict:
    """eval_metrics.json's content: the counts, what was scored and by whom, the training
    summary and provenance. Refuses a count that is not the whole split."""
    split = run.eval.split
    record = {
        **result,
        "run": run.name,
        "split": split,
        "test_size": scored_samples(manifest, split, run.eval.stride),
        "class_names": manifest["class_names"],
        "world_size": world_size,
        "hosts": hosts,
        "evaluated_by": evaluated_by,
        "train": train,
    }
    record.update(task_fields(run))
    if run.eval.stride is not None:  # a language model's sliding windows
        record["stride"] = run.eval.stride
    if record["samples_evaluated"] != record["test_size"]:
        raise RuntimeError(
            f"evaluated {record['samples_evaluated']} samples, the {split} split has "
            f"{record['test_size']}"
        )
    record["provenance"] = {
        **runtime.provenance(),
        "config": run.resolved,
        "hostnames": hosts,
        "dataset": {k: manifest[k] for k in ("source", "sizes", "source_notes") if k in manifest},
    }
    model = run.model.name
    if is_plugin(model):  # its code, which the config does not hold
        source = plugin_source(model)
        record["provenance"]["model_plugin"] = {
            "spec": model,
            "file": str(source) if source else None,
            "sha256": plugin_source_hash(model),
        }
    return record


def task_fields(run: RunView) -> dict:
    """What a train summary and an evaluation record say about a task other than
    classification: its name and the validation metric that selects (with its direction),
    which the report, sweeps and trackers read (ddpflow.task.selection_of). Nothing for
    classification: its records are those written before tasks existed."""
    task = run_task(run)
    if not task.named_in_records:
        return {}
    selection = task.selection.record()
    return {"task": task.name, "selection": selection, "headline": list(task.headline)}


def published(record: dict) -> dict:
    """What the evaluate rule logs of an eval_metrics.json record."""
    headline = record.get("headline", ("accuracy", "correct"))
    keys = ("run", "split", *headline, "samples_evaluated", "test_size")
    keys += ("tokens",) if "tokens" in record else ()  # a language model's positions scored
    extra = {"headline": record["headline"]} if "headline" in record else {}
    return {**{k: record.get(k) for k in keys}, **extra}


def describe(record: dict) -> str:
    """The evaluation in words: "412 of 500 samples correct, accuracy 0.8240" or the task's
    headline metrics ("mse 0.0123, mae 0.0871, r2 0.9512 (500 samples)")."""
    if "headline" not in record:
        correct, total = record["correct"], record["samples_evaluated"]
        return f"{correct} of {total} samples correct, accuracy {record['accuracy']:.4f}"
    shown = ", ".join(
        f"{key} {'n/a' if record.get(key) is None else format(record[key], '.4f')}"
        for key in record["headline"]
    )
    if "tokens" in record:  # a language model: every position scored once
        return f"{shown} ({record['tokens']:,} tokens)"
    return f"{shown} ({record['samples_evaluated']} samples)"


def train_summary(
    run: RunSpec,
    loop,
    env: DistEnv,
    hosts,
    attempt,
    wall_seconds,
    parameters,
    slurm_job_id,
    generated=None,
) -> dict:
    """train_summary.json's content, from the finished Loop's epoch records (rank 0)."""
    records, data = loop.history, loop.data
    pruned = {"pruned": loop.pruned} if loop.pruned is not None else {}  # sweep pruning
    train_seconds = sum(r["seconds"]["train"] for r in records)
    samples = sum(r["samples"] for r in records)  # global: every rank's
    phases = {p: sum(r["seconds"][p] for r in records) for p in records[0]["seconds"]}
    summary = {
        "run": run.name,
        "world_size": env.processes,  # every rank (tensor-parallel ones too)
        **tensor_record(env),
        "nodes": env.num_nodes,
        "hosts": hosts,
        "launcher": env.launcher,
        "slurm_job_id": slurm_job_id,
        "epochs": run.train.epochs,
        "steps": loop.scheduler.last_epoch,
        "attempts": attempt,
        "train_seconds": train_seconds,
        "wall_seconds": wall_seconds,
        "samples_per_s": samples / train_seconds if train_seconds else 0.0,
        "phase_seconds": phases,
        "device": str(data.device),
        "device_name": runtime.device_name(data.device),
        "data_in_memory": data.in_memory,
        "parameters": parameters,
        **fine_tuning_record(run, loop),  # model.weights, train.freeze: only where set
        **run_task(run).train_record(loop, generated),  # a language model's tokens/s
        "lr": loop.lr,
        **_batch_record(run, loop),
        # each stretch of the training: world size, hosts (one unless continued elsewhere)
        "segments": loop.segments,
        "precision": run.train.precision if loop.autocast else "fp32",
        **pruned,
        **task_fields(run),
    }
    return {**summary, **_admitted_records(loop, summary, hosts)}


def _admitted_records(loop, summary: dict, hosts) -> dict:
    """train_summary's "efficiency" and "memory" (monitoring.flops), from what the train rule
    admitted the run with; none for a Loop made without the train rule (a test's)."""
    if loop.admitted is None:
        return {}
    own = {"host": hosts[0] if hosts else "?", **runtime.peak_memory_mib()}
    return {
        "efficiency": flops.efficiency_record(loop.admitted, summary),
        "memory": flops.memory_record(loop.admitted, loop.history, own),
    }


def accumulation_words(loop) -> str:
    """'4 accumulation steps', or where the ranks share a step unevenly '2 or 1 accumulation
    steps' (the first ranks one more: the log's global batch = micro x ranks x these)."""
    base, extra = divmod(loop.micro_per_step, loop.env.world_size)
    if not extra:
        return counted(base, "accumulation step")
    return f"{base + 1} or {base} accumulation steps (the first {extra} ranks one more)"


def _batch_record(run: RunSpec, loop) -> dict:
    """The batches: global, micro (chosen by train.micro_batch_size auto for this world size:
    checks.batch), accumulation steps, and the science the micro-batch decides
    (checks.norm_batch): "norm_batch", what a later parse keeps as the run's normalisation
    batch (recorded_norm_batch), and "norm_group", the ranks that hold one together (absent
    for a run resolved before train.norm_batch_size)."""
    chosen = run.micro_batch
    record = {
        "global_batch": run.train.global_batch_size,
        "micro_batch": run.train.micro_batch_size,
        "micro_batch_auto": chosen.get("auto", False),
    }
    if chosen.get("science") is not None:
        record.update(norm_batch=chosen["science"], norm_group=loop.norm_group)
    return {**record, "accumulation_steps": loop.accum}


def tensor_record(env: DistEnv) -> dict:
    """train.tensor_parallel of the ranks (their world_size / it data-parallel ranks), where
    it is above 1: train_summary's "tensor_parallel"; absent otherwise."""
    return {"tensor_parallel": env.tensor_parallel} if env.tensor_parallel > 1 else {}


def fine_tuning_record(run, loop) -> dict:
    """train_summary's "fine_tuning" (absent for a run from random weights that freezes
    nothing): the weights loaded (file, sha256, head), the input normalisation, what froze."""
    tcfg = run.train
    if not (run.weights or tcfg.freeze or tcfg.optimizer.lr_mult):
        return {}
    _, _, normalised = input_normalisation(run.resolved["model"], loop.data.manifest)
    record = {
        "weights": loop.loaded,
        "normalisation": normalised,
        "freeze": tcfg.freeze if isinstance(tcfg.freeze, str) else list(tcfg.freeze),
        "unfreeze_at_epoch": tcfg.unfreeze_at_epoch,
        "lr_mult": dict(tcfg.optimizer.lr_mult),
    }
    return {"fine_tuning": record}
