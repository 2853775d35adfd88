"""What every rank runs: the submitted callables for training and evaluation.

submitit pickles these objects by reference, which is why they live in the installed package.
A task discovers its rank once, sets up logging, device and the process group, does its work
and always tears the process group down (even on failure).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

import submitit
import torch
import torch.distributed as dist

from ddpflow import export, runtime
from ddpflow.checks.links import run_preflight
from ddpflow.cluster import distenv, in_job, private, software
from ddpflow.cluster.distenv import DistEnv
from ddpflow.config import config_hash, evaluation_fingerprint, uses_channels_last
from ddpflow.config.typed import RunSpec
from ddpflow.monitoring import sampler as monitor
from ddpflow.monitoring.flops import read_admitted
from ddpflow.paths import EVAL_FROM_TRAIN, LIVE_METRICS, RESTART_EVENTS, RunPaths
from ddpflow.training import evaluate, sharding, startup, summaries, tensor_parallel
from ddpflow.training.build import cpu_has_native_bf16, placed_model
from ddpflow.training.checkpoint import (
    Checkpointer,
    Preempted,
    hand_over_to_requeue,
    resumed_line,
    stop_on_signal,
)
from ddpflow.training.loop import Loop, fit, sync_buffers
from ddpflow.training.models import count_parameters, from_checkpoint
from ddpflow.training.progress_bar import progress_bar
from ddpflow.training.pruning import MedianPruner
from ddpflow.training.rankdata import RankData, load_data
from ddpflow.training.summaries import evaluation_record, published, train_summary
from ddpflow.training.weights import log_fine_tuning
from ddpflow.training.workspace import monitor_dir, publish_monitor
from ddpflow.words import counted

log = logging.getLogger(__name__)


def rank_context(spec: RunSpec, rendezvous_dir: str | None):
    """Discover the rank, then set up logging, threads, device and the process group."""
    env = distenv.discover()
    runtime.setup_logging(env.rank)
    machine = spec.machine
    # one rank per core budget: without this every rank spawns threads for all cores
    torch.set_num_threads(machine.cpus_per_task)
    if machine.gpus_per_node:
        runtime.configure_cuda(spec.train.deterministic)
    device = runtime.select_device(machine.gpus_per_node, env.local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    where = (env.rank, env.world_size, env.local_rank, env.node_rank, env.launcher, device, backend)
    log.info("rank %d/%d local %d node %d via %s on %s (%s)", *where)
    startup.timed_rendezvous(
        lambda: distenv.init_process_group(
            env, backend, machine.pg_timeout_s, rendezvous_dir, machine.network_interface
        )
    )
    return env, device


def gather_hosts(env: DistEnv, device) -> list[str]:
    """Every rank's host name in rank order, once their software agrees (cluster.software)."""
    hosts = distenv.all_gather_text(socket.gethostname(), env.world_size, device)
    return software.agreed(hosts, env.world_size, device)


class DistributedTask:
    """Base of the submitted callables: rank set-up, guaranteed teardown, rank-0 gating.
    The pickled job holds the resolved run dict (`run`, what older job pickles hold too);
    each rank builds the typed run (config.typed.RunSpec) from it once and reads only that."""

    def __init__(self, run: dict, paths: RunPaths, file_rendezvous: bool = True):
        # file_rendezvous: rank 0 publishes a self-bound port in the shared work folder
        # (submitit jobs); False uses MASTER_PORT or the job-id port (srun, torchrun).
        self.run, self.paths, self.file_rendezvous = run, paths, file_rendezvous

    def __call__(self) -> dict:
        spec = RunSpec.from_run(self.run)  # a key it does not know fails here, at once
        # 0700, and refused where others can write it, before a checkpoint is read from it
        private.make(self.paths.work, "work folder")
        rendezvous = self.paths.work if self.file_rendezvous else None
        env, device = rank_context(spec, rendezvous)
        done = False
        try:
            result = self.work(spec, env, device, gather_hosts(env, device))
            if env.world_size > 1:
                # no rank tears down while another is in the last collective; the abort at
                # exit (a teardown race) is distenv.leave_together's to prevent, not this
                dist.barrier()
            done = True
            return result
        finally:
            distenv.leave_together(env, wait=done)

    def work(self, spec: RunSpec, env: DistEnv, device, hosts) -> dict:
        raise NotImplementedError


class TrainTask(DistributedTask, submitit.helpers.Checkpointable):
    """Train one run, from the newest valid checkpoint. On USR2 (time limit, preemption) the
    ranks agree on a step, rank 0 saves and calls submitit's USR2 handler, which requeues the
    pickled cluster.jobs.TrainJob (its checkpoint(), never this class's); the new job resumes."""

    def work(self, spec: RunSpec, env: DistEnv, device, hosts) -> dict:
        paths = self.paths
        start = time.perf_counter()
        if spec.machine.preflight.enabled:
            run_preflight(spec.machine.preflight, env, device, hosts)
        # train.tensor_parallel: from here on, rank and world size are the data-parallel ones
        env, hosts = tensor_parallel.arrange(spec, env, device, hosts)
        in_train = spec.eval.in_train
        # the evaluation split too when this job evaluates at the end: loaded (and verified)
        # now, so that bad data fails before the training, not after it
        splits = ("train", "val", spec.eval.split) if in_train else ("train", "val")
        data = load_data(spec, paths.staged, env, device, splits)
        _warn_about_settings(spec, data, env, device)
        model, loaded = placed_model(spec, data.shape, data.num_classes, device)
        loop = Loop(spec, data, env, device, model, loaded)
        ckpt = Checkpointer(spec, paths.work, env)
        self._train(loop, ckpt, env, hosts)
        if env.processes > 1:  # every rank's monitor closed before rank 0 publishes it
            dist.barrier()
        summary = None
        weights = loop.full_model_state()  # collective under FSDP; the whole model on rank 0
        generated = None
        if data.tokens:  # a language model's samples (collective under FSDP)
            from ddpflow.training.gpt import text_samples

            every_rank = sharding.is_sharded(model) or env.tensor_parallel > 1
            generated = text_samples(model, data, spec.train.seed, every_rank, env.is_master)
        if env.is_master:
            outputs = (model, weights, env, hosts, loop, ckpt, start, generated)
            summary = self._write_outputs(*outputs)
        if in_train:
            self._evaluate(loop.run, model, data, env, hosts, summary)
        return summary or {"rank": env.rank, "host": socket.gethostname()}

    @property
    def live_metrics(self) -> Path:
        """The epoch records so far (rank 0 appends one per epoch)."""
        return Path(self.paths.work) / LIVE_METRICS

    def _train(self, loop: Loop, ckpt: Checkpointer, env: DistEnv, hosts) -> None:
        """Resume from the newest valid checkpoint, then train the remaining epochs under the
        run monitor; a stop signal saves and hands the job over to submitit's requeue."""
        run, resumed = loop.run, ckpt.restore(loop)
        loop.admitted = read_admitted(self.paths.work)  # FLOPs and memory estimate, to record
        ckpt.attempt = _next_attempt(Path(self.paths.work), resumed is not None, env)
        loop.begin_segment(hosts, ckpt.attempt, resumed.get("steps_redone") if resumed else None)
        in_job.note_restart(loop.segments[-1])  # a step its Slurm job's supervisor restarted
        if env.is_master:
            _start_log(run, loop.model, loop, resumed, ckpt.attempt, self.live_metrics)
        watch = monitor.RunMonitor(
            run, monitor_dir(self.paths.work), env, loop.device, hosts,
            resumed["step"] if resumed else None,
        )  # fmt: skip
        loop.watch_steps(watch.wrap_step(startup.noting_the_first_step(ckpt.on_step)))
        with stop_on_signal(ckpt):
            try:
                fit(loop, self._on_epoch(loop, ckpt, watch, env), progress_bar(run, env))
            except Preempted:
                hand_over_to_requeue(env, ckpt.submitit_handler)
                raise
            finally:
                ckpt.close()  # a background write finishes (or failed)
                watch.close()
                loop.feed.close()  # streamed: the DataLoader workers end here

    def _on_epoch(self, loop: Loop, ckpt: Checkpointer, watch, env: DistEnv):
        """What every rank does after an epoch: the monitor, the checkpoint, rank 0's log."""
        run, live_metrics = loop.run, self.live_metrics
        pruner = MedianPruner(run, self.paths.work, env, loop.device)
        selects = loop.data.task.selection.metric
        shown = "val_acc" if selects == "val_accuracy" else selects

        def on_epoch(record: dict) -> None:
            watch.on_epoch(record)  # every rank (a collective), before the checkpoint
            record.update(run=run.name, attempt=ckpt.attempt)
            # sweep pruning (a collective where due): its decision joins the record, and so
            # the checkpoint, and the fit loop stops after a pruned epoch
            pruner.on_epoch(record)
            ckpt.on_epoch(loop)  # before the record is logged: a resume never repeats it
            if env.is_master:
                runtime.append_jsonl(live_metrics, record)
                rate = record.get("tokens_per_s", record["samples_per_s"])
                log.info(
                    "epoch %d/%d loss %.4f %s %.4f %.0f %s/s",
                    record["epoch"],
                    run.train.epochs,
                    record["train_loss"],
                    shown,
                    record[selects],
                    rate,
                    "tokens" if "tokens_per_s" in record else "samples",
                )

        return on_epoch

    def _evaluate(self, run: RunSpec, model, data, env: DistEnv, hosts, summary) -> None:
        """Score the final model before the ranks are released (one allocation per run):
        the same exact evaluation as the evaluate job's, on the bare module (no autocast),
        so the counts are those a job of its own would get. Rank 0 keeps the result in the
        work folder, tied to model.pt's checksum and the eval config; the evaluate rule
        publishes it. A failure here is logged and leaves the evaluation to that rule."""
        split = run.eval.split
        sync_buffers(model, env.world_size)  # score the model rank 0 saved
        batch = evaluate.batch_size(run, read_admitted(self.paths.work))
        scoring = data.scoring(batch, stride=run.eval.stride)
        result = evaluate.evaluate_split(model, data.split(split), scoring, env, guard=True)
        if result is None:
            log.warning("the evaluation after training failed; the evaluate rule will score "
                        "the model in a job of its own")  # fmt: skip
            return
        if env.is_master:
            record = evaluation_record(
                run, result, data.manifest, env.processes, hosts, summary, "train job"
            )
            record["model_sha256"] = summary.pop("model_sha256")
            record["eval_key"] = config_hash(evaluation_fingerprint(run.resolved))
            runtime.atomic_write_json(Path(self.paths.work) / EVAL_FROM_TRAIN, record)
            log.info("evaluated on the %s split: %s in %.2fs", split,
                     data.task.describe(result), result["eval_seconds"])  # fmt: skip
            _tensorboard_final(run, self.paths, result, summary["steps"], data.task)

    def _write_outputs(self, model, weights, env: DistEnv, hosts, loop, ckpt, start, generated):
        run, paths, data = loop.run, self.paths, loop.data
        checkpoint = {
            "state_dict": weights,
            "model": run.resolved["model"],  # a dict: model.pt loads weights_only
            "shape": data.shape,
            "num_classes": data.num_classes,
        }
        sha256 = runtime.atomic_torch_save(checkpoint, paths.model)
        if export.wants_safetensors(run.resolved):  # the export rule then needs no torch
            export.prepare_safetensors(run.resolved, checkpoint, data.manifest, sha256, paths.work)
        loop.close_segment()
        in_job.annotate(loop.segments, Path(paths.work) / RESTART_EVENTS)
        summary = train_summary(
            run, loop, env, hosts, ckpt.attempt, time.perf_counter() - start,
            count_parameters(model), _slurm_job_id(env), generated,
        )  # fmt: skip
        summary["startup"] = startup.record(ckpt.save_seconds)
        summary["software"] = software.record()  # per host: its runtime, image and versions
        runtime.atomic_write_bytes(paths.train_metrics, self.live_metrics.read_bytes())
        runtime.atomic_write_json(paths.train_summary, summary)
        publish_monitor(paths.work, Path(paths.model).parent)
        return {**summary, "model_sha256": sha256}


def _warn_about_settings(run: RunSpec, data: RankData, env: DistEnv, device) -> None:
    """Settings that train, but likely not as meant on this data or machine."""
    augment = run.train.augment
    if env.is_master and augment.enabled and augment.crop_padding * 4 > min(data.shape[1:]):
        log.warning(
            "train.augment.crop_padding %d on %s images: a random crop can cut away up to "
            "half of an image; lower it (the CIFAR recipe pads 32x32 images by 4)",
            augment.crop_padding, "x".join(map(str, data.shape[1:])),
        )  # fmt: skip
    if (
        env.local_rank == 0
        and device.type == "cpu"
        and run.train.precision == "bf16"
        and not cpu_has_native_bf16()
    ):
        log.warning(
            "train.precision bf16 on %s, whose CPU has no bf16 instructions (AMX or "
            "AVX512-BF16): oneDNN emulates bf16 here, likely slower than fp32; set "
            "train.precision: fp32 for this machine", socket.gethostname(),
        )  # fmt: skip


def _slurm_job_id(env: DistEnv) -> str | None:
    """This job's id when Slurm runs it (the report asks sacct about it)."""
    return os.environ.get("SLURM_JOB_ID") if env.launcher == "slurm" else None


def _next_attempt(work: Path, resumed: bool, env: DistEnv) -> int:
    """Attempts of this run's training: counted across requeues and reruns, reset when no
    checkpoint exists (a fresh start). Every rank computes it; rank 0 records it."""
    counter = work / "attempts"
    try:
        previous = int(counter.read_text()) if resumed else 0
    except (OSError, ValueError):
        previous = 1 if resumed else 0
    distenv.barrier(env)  # everyone has read before rank 0 writes
    if env.is_master:
        runtime.atomic_write_bytes(counter, f"{previous + 1}\n".encode())
    return previous + 1


def _start_log(run: RunSpec, model, loop, resumed, attempt, live_metrics: Path) -> None:
    # the live metrics file always equals the checkpoint's history plus what follows
    lines = "".join(json.dumps(r, sort_keys=True) + "\n" for r in loop.history)
    runtime.atomic_write_bytes(live_metrics, lines.encode())
    train = run.train
    log.info(
        "model %s: %d parameters; lr %.4g (global batch %d = micro-batch %d x %s x %s); "
        "strategy %s; attempt %d",
        run.model.name, count_parameters(model), loop.lr, train.global_batch_size,
        train.micro_batch_size, counted(loop.env.world_size, _data_ranks(loop.env)),
        summaries.accumulation_words(loop), loop.strategy, attempt,
    )  # fmt: skip
    log_fine_tuning(loop)
    if restart := loop.segments[-1].get("restart_in_job"):
        log.warning(
            "restart %d inside Slurm job %s (machine.restarts_in_job): the ranks start again on %s",
            restart["restart"],
            restart["job"],
            ",".join(sorted(set(loop.segments[-1]["hosts"]))),
        )
    if resumed:
        log.info("RESUMED from attempt %d: %s", resumed["attempt"],
                 resumed_line(resumed, loop.env.processes, loop.env.tensor_parallel))  # fmt: skip


def _data_ranks(env: DistEnv) -> str:
    return "data-parallel rank" if env.tensor_parallel > 1 else "rank"


class EvalTask(DistributedTask):
    def work(self, spec: RunSpec, env: DistEnv, device, hosts) -> dict:
        paths = self.paths
        split = spec.eval.split
        data = load_data(spec, paths.staged, env, device, splits=(split,))
        checkpoint = runtime.safe_torch_load(paths.model, device)
        model = from_checkpoint(checkpoint, device, uses_channels_last(spec))
        batch = evaluate.batch_size(spec, read_admitted(paths.work))
        scoring = data.scoring(batch, stride=spec.eval.stride)
        result = evaluate.evaluate_split(model, data.split(split), scoring, env)
        if not env.is_master:
            return {"rank": env.rank, "host": socket.gethostname()}
        return self._write(spec, result, data, env, hosts)

    def _write(self, spec: RunSpec, result, data, env: DistEnv, hosts) -> dict:
        train = json.loads(Path(self.paths.train_summary).read_text())
        record = evaluation_record(
            spec, result, data.manifest, env.world_size, hosts, train, "evaluate job"
        )
        record["slurm_job_id"] = _slurm_job_id(env)
        runtime.atomic_write_json(self.paths.eval_metrics, record)
        _tensorboard_final(spec, self.paths, result, train.get("steps", 0), data.task)
        return published(record)


def _tensorboard_final(run: RunSpec, paths: RunPaths, result: dict, step: int, task) -> None:
    if run.train.monitor.tensorboard:
        log_dir = Path(paths.model).parent / monitor.TENSORBOARD_DIR
        monitor.log_final_metrics(log_dir, run.eval.split, result, step, task.headline)
