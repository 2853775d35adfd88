"""What each workflow rule does on the machine Snakemake runs on (the login node): one
function per rule, called by its thin adapter scripts/<rule>.py. train_run and evaluate_run
submit the run's job (one submitit task per rank: ddpflow.training.entry) and wait for it;
the ranks themselves run ddpflow.training.entry -> ddpflow.training.loop (training) or
ddpflow.training.evaluate (scoring)."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from pathlib import Path

from ddpflow import runtime
from ddpflow.checks.admission import admit
from ddpflow.checks.batch import check_batch_fits, warn_what_sits_out
from ddpflow.checks.early import fine_tunes, input_of, memory_verdicts, model_check
from ddpflow.cluster import launch, nodes, submit
from ddpflow.cluster.jobs import EvalJob, TrainJob
from ddpflow.config.fingerprint import (
    BUILT_IN_MODELS,
    config_hash,
    evaluation_fingerprint,
    training_fingerprint,
)
from ddpflow.config.machine import uses_channels_last
from ddpflow.data import in_image
from ddpflow.data.staged import choose_in_memory, read_manifest
from ddpflow.data.staging import stage_dataset
from ddpflow.data.text import describe_tokens
from ddpflow.data.windows import train_samples
from ddpflow.errors import UserError
from ddpflow.paths import (
    EVAL_FROM_TRAIN,
    RUN_FILES,
    TRACKING_FILE,
    RunPaths,
    bad_nodes_file,
    report_dir,
    run_dir,
)
from ddpflow.report import outcome
from ddpflow.task import run_task, selection_of
from ddpflow.tracking.live import LiveStream
from ddpflow.training import workspace
from ddpflow.training.pruning import pruned_line
from ddpflow.training.summaries import describe, published
from ddpflow.words import counted

log = logging.getLogger(__name__)
EARLY_CACHE = ".snakemake/ddpflow"  # the parse's checks and measurements (ddpflow.checks.early)


def stage_data(data_cfg: dict, out_dir: str, threads: int = 1) -> dict:
    # a failure is kept for the report, naming it for every run of the dataset
    with outcome.staging_recorded(out_dir):
        return _stage_data(data_cfg, out_dir, threads)


def _stage_data(data_cfg: dict, out_dir: str, threads: int) -> dict:
    job = os.environ.get("SLURM_JOB_ID")
    where = f"in Slurm job {job} on {socket.gethostname()}" if job else "on this machine"
    if job:  # a staging job decodes on every CPU it was given (Snakemake caps a rule's
        # threads at the login node's --cores)
        given = int(os.environ.get("SLURM_CPUS_PER_TASK") or runtime.usable_cores())
        threads = max(threads, given)
    log.info(
        "staging %s into %s %s (%s)", data_cfg["source"], out_dir, where, counted(threads, "thread")
    )
    start = time.perf_counter()
    machine = in_image.staging_machine(out_dir)  # a staging job with machine.container
    if machine is not None:
        manifest = in_image.stage(machine, data_cfg, out_dir, threads)
    else:
        manifest = stage_dataset(data_cfg, out_dir, seed=data_cfg["seed"], threads=threads)
    seconds = time.perf_counter() - start
    if manifest.get("kind") == "tokens":  # ddpflow.data.text
        log.info("staged %s into %s in %.1fs: %s", data_cfg["source"], out_dir, seconds,
                 describe_tokens(manifest))  # fmt: skip
        return manifest
    images = sum(manifest["sizes"].values())
    shards = sum(len(s) for s in manifest["shards"].values())
    log.info(
        "staged %s into %s in %.1fs (%d images, %.0f images/s, %s, %s): %s",
        data_cfg["source"], out_dir, seconds, images, images / max(seconds, 1e-9),
        counted(threads, "thread"), counted(shards, "shard"), manifest["sizes"],
    )  # fmt: skip
    return manifest


def _check_user_model(run: dict, manifest: dict) -> None:
    """A torchvision or plug-in model is built and run once on the CPU here, before any job
    is queued (built-in models need no check, and this process no torch import for them)."""
    _check_fine_tuning(run, manifest)
    if run["model"]["name"] in BUILT_IN_MODELS:  # not models.BUILT_IN: that imports torch
        return
    from ddpflow.training.models import check_model

    parameters = check_model(run["model"], manifest["shape"], manifest["num_classes"],
                             uses_channels_last(run))  # fmt: skip
    log.info("model %r: %s parameters; one forward of [N, %s] gave %d logits per sample",
             run["model"]["name"], f"{parameters:,}", ", ".join(map(str, manifest["shape"])),
             manifest["num_classes"])  # fmt: skip


def _check_fine_tuning(run: dict, manifest: dict) -> None:
    """model.weights, train.freeze and lr_mult checked against the model here, before the
    job is queued, and said in the terminal (a re-initialised head with its class counts)."""
    check = model_check(run, manifest)
    if fine_tunes(check):
        from ddpflow.training.weights import check_fine_tuning

        for line in check_fine_tuning(check):
            log.info("run %r: %s", run["name"], line)


def _check_memory(run: dict, manifest: dict) -> None:
    """The rank's memory, estimated from the staged data (ddpflow.checks.memory), said in the
    terminal, and refused before the job is queued where it cannot fit. The parse made the
    same check where it knew the data's shape; a measurement is made once (ddpflow.checks.early)."""
    inputs = {run["name"]: input_of(run, manifest)}
    _, verdicts = memory_verdicts([run], inputs, EARLY_CACHE)
    if run["name"] not in verdicts:
        return
    verdict, text = verdicts[run["name"]]
    if verdict == "refused":
        raise UserError(text)
    (log.warning if verdict == "tight" else log.info)("%s", text)


def _say_how_data_is_read(run: dict, manifest: dict) -> None:
    """In the terminal, before submission: in memory or streamed (the ranks decide the same
    way from the same figures: ddpflow.data.staged.choose_in_memory)."""
    if manifest.get("kind") == "tokens":  # ddpflow.data.text: always by memory map
        return log.info("run %r: %s, read by memory map", run["name"], describe_tokens(manifest))
    splits = dict.fromkeys(("train", "val", run["eval"]["split"] if run["eval"]["in_train"]
                            else "train"))  # fmt: skip
    nbytes = sum(manifest["sizes"][split] for split in splits) * math.prod(manifest["shape"])
    in_memory, why = choose_in_memory(run, nbytes)
    loading = run["data"]["loading"]
    how = "in memory" if in_memory else (
        f"streamed from the staged shards by {loading['workers']} DataLoader workers per rank"
    )  # fmt: skip
    node_local = loading["node_local_dir"]
    where = f", from a copy in {node_local} on each node" if node_local else ""
    log.info("run %r: data %s%s (%s)", run["name"], how, where, why)


def train_run(run: dict, paths: RunPaths, logs_dir: str) -> dict:
    """Train one run: resume only an interrupted attempt of this very config (else from
    scratch, saying why), then keep the work folder lean. With an MLflow URI in the run's
    `tracking:`, epochs are streamed there as they land."""
    manifest = read_manifest(paths.staged)
    samples = train_samples(run, manifest)  # a language model's fresh windows: (n - B) // B
    check_batch_fits(run, samples)
    warn_what_sits_out(run, samples)
    _check_user_model(run, manifest)
    _check_memory(run, manifest)
    _say_how_data_is_read(run, manifest)
    # from here on the run as its job runs it: on fewer nodes after node failures
    # (machine.min_nodes); the user's config is not edited
    run, exclude = submit.placed(run, paths, "train")
    # a job still running for an edited config (kept after a stop) must be gone before the
    # work folder is decided on: it would write its old-config checkpoints into it
    launch.cancel_outdated(
        submit.job_record(paths, "train"), config_hash(training_fingerprint(run))
    )
    workspace.prepare(run, paths.work)
    admit(run, manifest, EARLY_CACHE, paths.work)  # its memory estimate and FLOPs, to record
    stream = LiveStream.for_run(run, run.get("tracking"), paths.work)
    summary = submit.submit_and_wait(TrainJob, "train", run, paths, logs_dir, exclude, stream)[0]
    workspace.finish(run, paths.work)
    log.info(
        "train %r: %s on %s (%s)%s",
        run["name"],
        run_task(run).throughput(summary),
        counted(summary["world_size"], "rank") + _tensor_text(summary),
        ", ".join(sorted(set(summary["hosts"]))),
        _efficiency_text(summary),
    )
    if summary.get("pruned"):  # a sweep's median pruning stopped it: an ordinary end
        log.warning("%s", pruned_line(run["name"], summary["pruned"], selection_of(summary)))
    return summary


def _efficiency_text(summary: dict) -> str:
    """'; 0.087 model TFLOP/s (MFU 41.2%)' where the run's FLOPs were counted."""
    efficiency = summary.get("efficiency") or {}
    if not efficiency.get("counted"):
        return ""
    mfu = f" (MFU {efficiency['mfu']:.1%})" if "mfu" in efficiency else ""
    return f"; {efficiency['model_tflops']:.3g} model TFLOP/s{mfu}"


def _tensor_text(summary: dict) -> str:
    """' (2 data x 2 tensor-parallel)' for a run trained with train.tensor_parallel."""
    tensor = summary.get("tensor_parallel", 1)
    if tensor == 1:
        return ""
    return f" ({summary['world_size'] // tensor} data x {tensor} tensor-parallel)"


def evaluate_run(run: dict, paths: RunPaths, logs_dir: str) -> dict:
    """Publish the evaluation the training job made of this very model and eval config (no
    second job: one allocation per run); otherwise (eval.in_train off, an edited eval
    section, eval_metrics.json deleted after its publication) score the model in a job."""
    result = _publish_evaluation_from_training(run, paths)
    where = "by the training job, no job of its own"
    if result is None:
        placed, exclude = submit.placed(run, paths, "evaluate")
        if run["eval"]["batch_size"] == "auto":  # the batch it chooses on this placement
            admit(placed, read_manifest(paths.staged), EARLY_CACHE, paths.work)
        result = submit.submit_and_wait(EvalJob, "evaluate", placed, paths, logs_dir, exclude)[0]
        workspace.remove_rendezvous_files(paths.work)
        where = "in a job of its own"
    text = describe(result)
    log.info(
        "evaluate %r on the %s split: %s (evaluated %s)", run["name"], result["split"], text, where
    )
    return result


def _publish_evaluation_from_training(run: dict, paths: RunPaths) -> dict | None:
    """The training job's evaluation as eval_metrics.json, if it scored the model.pt that is
    there now with the current eval config; it is published once (moved), so a deleted
    eval_metrics.json is scored anew. None where there is none to publish (and why)."""
    kept = Path(paths.work) / EVAL_FROM_TRAIN
    if not run["eval"]["in_train"] or not kept.is_file():
        return None
    try:
        record = json.loads(kept.read_text())
        sha, key = record.pop("model_sha256"), record.pop("eval_key")
    except (OSError, ValueError, KeyError) as err:
        log.info("the training job's evaluation is unreadable (%s): evaluating anew", err)
        record = None
    if record is None:
        pass
    elif key != config_hash(evaluation_fingerprint(run)):
        log.info("the eval section changed since the training job evaluated: evaluating anew")
    elif sha != runtime.sha256_file(Path(paths.model)):
        log.info("model.pt is not the model the training job evaluated: evaluating anew")
    else:
        runtime.atomic_write_json(paths.eval_metrics, record)
        kept.unlink()
        return published(record)
    kept.unlink(missing_ok=True)  # stale either way
    return None


def build_report(results_dir: str, run_names: list[str], sweeps: list[dict | None]) -> dict:
    """The report of every run, into results_dir/report: the report rule's (scripts/report.py)
    and `python -m ddpflow report`'s, one function with the same inputs. It reads each run's
    records under results_dir/runs/<run>/ (the files the report rule declares as its
    inputs), the bad-node ledger's nodes if there are any, and each run's sweep point
    (sweeps, in the order of run_names; None for a run written under `runs:`)."""
    runs = []
    for name, sweep in zip(run_names, sweeps, strict=True):
        folder = run_dir(results_dir, name)
        runs.append(
            {
                "name": name,
                "train_metrics": str(folder / RUN_FILES["train_metrics"]),
                "eval_metrics": str(folder / RUN_FILES["eval_metrics"]),
                "tracking": str(folder / TRACKING_FILE),
                "sweep": sweep,
            }
        )
    from ddpflow.report.build import build_report  # matplotlib: only the report rule needs it

    ledger = bad_nodes_file(results_dir)
    bad_nodes = nodes.read_ledger(ledger)
    if bad_nodes:
        log.warning("%s (%s)", outcome.bad_nodes_line(bad_nodes), nodes.shown(ledger))
    return build_report(runs, report_dir(results_dir), bad_nodes=bad_nodes)


def clean_work(work_root: str) -> list[str]:
    """Every run folder under results/work/: see ddpflow.training.workspace.clean. The bad-node
    ledger beside them stays (snakemake clean_bad_nodes clears it)."""
    removed: list[str] = []
    for work in sorted(p for p in Path(work_root).glob("*") if p.is_dir()):
        removed += [str(path) for path in workspace.clean(work)]
    log.info(
        "clean_work removed %s%s",
        counted(len(removed), "item"),
        "".join(f"\n  {r}" for r in removed),
    )
    return removed


def clean_bad_nodes(ledger: str) -> list[dict]:
    """Empty the bad-node ledger (ddpflow.cluster.nodes): its nodes were repaired."""
    removed = nodes.clear_ledger(ledger)
    said = (
        f"forgot {counted(len(removed), 'node')} of {ledger}"
        if removed
        else f"no bad nodes recorded ({ledger})"
    )
    log.info("clean_bad_nodes: %s%s", said,
             "".join(f"\n  {e['node']}: {e.get('reason', '?')}" for e in removed))  # fmt: skip
    return removed


def run_rule(function, log_file: str | None, *args, failures: tuple[str, str] | None = None):
    """Run one rule's function with logging to the rule's log file and stderr; a failure is
    logged there too (Snakemake shows the log of a failed rule) and exits non-zero.
    failures=(work folder, stage): a failure is also recorded there for the report of the
    other runs (ddpflow.report.outcome); a start clears the last one."""
    runtime.setup_logging()
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(log_file, mode="w")
        handler.setFormatter(logging.getLogger().handlers[0].formatter)
        logging.getLogger().addHandler(handler)
    if failures:
        outcome.clear_failure(failures[0])
    try:
        return function(*args)
    except KeyboardInterrupt as exc:
        # Ctrl-C, or Snakemake's SIGTERM (cluster.interrupts): the job was cancelled or left
        # running (cluster.launch); one line, no traceback; onerror says how to continue
        log.warning("%s stopped (Ctrl-C or a signal)", function.__name__)
        if failures:
            outcome.record_failure(*failures, exc, log_file)
        raise SystemExit(130) from None
    except UserError as exc:
        # the message names what to fix: a traceback would only bury it
        log.error("%s failed:\n%s", function.__name__, exc)
        if failures:
            outcome.record_failure(*failures, exc, log_file)
        raise SystemExit(1) from None
    except BaseException as exc:
        log.exception("%s failed", function.__name__)
        if failures:
            outcome.record_failure(*failures, exc, log_file)
        raise
