"""See inside a run while it trains: system usage per rank, stragglers, TensorBoard, profiles.

Config `train.monitor` and `train.profile` (config/config.yaml). Every rank samples its own
CPU use, resident memory and, on a GPU, NVML's utilisation, memory, power and temperature in
a background thread (`system_interval_s`) into results/runs/<run>/system/rank-<r>.jsonl. At
each epoch's end the ranks exchange one summary each (one all_gather of a float64 tensor per
epoch, nothing per step): the epoch record gets a `ranks` list, kept in train_metrics.jsonl
and checkpoints, for the report's per-rank table and `stragglers` (a rank holding others up).
Rank 0 writes TensorBoard scalars (results/runs/<run>/tensorboard; model TFLOP/s and MFU
too); with `train.profile.enabled` torch.profiler records a few steps (.../profile: a
Chrome/Perfetto trace per profiled rank and its top operators by self time). While a training
runs, all of it is written in its work folder (results/work/<run>/monitor/) and moved into
the run's folder when it finishes (training.workspace.publish_monitor): a stopped or failed
retrain leaves the finished run's files as they were.

    watch = RunMonitor(run, monitor_dir(work), env, device, hosts, resumed_step)
    loop.watch_steps(watch.wrap_step(ckpt.on_step))
    ... on_epoch: watch.on_epoch(record) ... finally: watch.close()
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import shutil
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ddpflow import runtime
from ddpflow.cluster.distenv import DistEnv
from ddpflow.config.typed import RunSpec, TrainProfileSpec
from ddpflow.monitoring.rankstats import (
    MEAN_KEYS,
    pack_summary,
    rank_summary,
    stragglers,
    unpack_summary,
)

log = logging.getLogger(__name__)

TENSORBOARD_DIR, SYSTEM_DIR, PROFILE_DIR = "tensorboard", "system", "profile"
TOP_OPS = "top_ops-rank{rank}.json"
TRACE = "trace-rank{rank}.json"
_STRAGGLER = "straggler: rank %d on %s holds the others up in epoch %d (%s)"


def _rss_mib() -> float:
    """Resident memory now (Linux /proc), else the peak (getrusage) elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _Gpu:
    """NVML (nvidia-ml-py) for this rank's device, found by the UUID torch reports, so that
    CUDA_VISIBLE_DEVICES and NVML's own numbering cannot disagree."""

    def __init__(self, device: torch.device):
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        props = torch.cuda.get_device_properties(device)
        uuid = str(getattr(props, "uuid", "") or "")
        uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        try:
            self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except pynvml.NVMLError:
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        self.name = pynvml.nvmlDeviceGetName(self.handle)

    def sample(self) -> dict:
        nvml, h, out = self.nvml, self.handle, {}
        readers = {
            "gpu_util_percent": lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu,
            "gpu_mem_mib": lambda: nvml.nvmlDeviceGetMemoryInfo(h).used / 2**20,
            "gpu_power_w": lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000,
            "gpu_temp_c": lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
        }
        for key, read in readers.items():
            # a field a board does not support is left out, not guessed
            with contextlib.suppress(nvml.NVMLError):
                out[key] = float(read())
        return out


def open_gpu(device: torch.device, rank: int) -> _Gpu | None:
    if device.type != "cuda":
        if rank == 0:
            log.info("system metrics: CPU and memory only (no GPU on this rank)")
        return None
    try:
        return _Gpu(device)
    except Exception as err:  # noqa: BLE001 - no NVML library or driver: say so, go on
        log.warning("rank %d: no GPU metrics (NVML unavailable: %s)", rank, err)
        return None


def _cpu_percent(cpu_s: float, wall_s: float) -> float:
    """100 = one core busy, at most every core this process may run on: the kernel brings a
    running thread's CPU time up to date only at its scheduler ticks, so over a short window
    (the CI machine, busy, 50 ms) the sum read a few ms ahead and gave 2 cores 210%."""
    return min(100 * cpu_s / max(wall_s, 1e-9), 100.0 * runtime.usable_cores())


class SystemSampler:
    """A background thread sampling this process every `interval_s` seconds; `take()` gives
    the window since the last call: CPU use (100 = one core busy, from the process's CPU
    time, exact whatever the interval), peak resident memory and the GPU figures (means of
    utilisation and power, maxima of memory and temperature). interval_s 0: no thread, the
    window's CPU use and the memory at `take()` only."""

    def __init__(self, device: torch.device, interval_s: float, rank: int, series=None):
        self.interval_s, self.series = interval_s, series
        self.gpu = open_gpu(device, rank) if interval_s > 0 else None
        self._lock = threading.Lock()
        self._window: list[dict] = []
        self._cpu, self._wall = self._cpu_seconds(), time.monotonic()
        self._stop = threading.Event()
        self._thread = None
        if interval_s > 0:
            self._thread = threading.Thread(target=self._run, name="ddpflow-system", daemon=True)
            self._thread.start()

    @staticmethod
    def _cpu_seconds() -> float:
        # every thread's user + system time at nanosecond resolution (os.times counts 10 ms
        # ticks: over a short interval that alone moved a 2-core figure past 200%)
        return time.process_time()

    def sample(self) -> dict:
        now = {"t": time.time(), "rss_mib": _rss_mib()}
        if self.gpu is not None:
            now.update(self.gpu.sample())
        return now

    def _run(self) -> None:
        cpu, wall = self._cpu_seconds(), time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = self.sample()
            cpu2, wall2 = self._cpu_seconds(), time.monotonic()
            now["cpu_percent"] = _cpu_percent(cpu2 - cpu, wall2 - wall)
            cpu, wall = cpu2, wall2
            with self._lock:
                self._window.append(now)
            if self.series is not None:
                try:
                    with open(self.series, "a") as f:
                        f.write(json.dumps(now) + "\n")
                except OSError as err:  # a full disk must not stop the training
                    why = f"cannot write {self.series} ({err})"
                    log.warning("system metrics: %s; not writing more", why)
                    self.series = None

    def take(self) -> dict:
        cpu, wall = self._cpu_seconds(), time.monotonic()
        with self._lock:
            window, self._window = self._window, []
        if self.gpu is not None and not window:  # an epoch shorter than the interval
            window = [self.sample()]
        stats = {
            "cpu_percent": _cpu_percent(cpu - self._cpu, wall - self._wall),
            "rss_mib": max([_rss_mib()] + [s["rss_mib"] for s in window]),
            **runtime.peak_memory_mib(),
        }
        self._cpu, self._wall = cpu, wall
        for key in ("gpu_util_percent", "gpu_mem_mib", "gpu_power_w", "gpu_temp_c"):
            values = [s[key] for s in window if key in s]
            if values:
                stats[key] = statistics.fmean(values) if key in MEAN_KEYS else max(values)
        return stats

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class TensorBoardLog:
    """Rank 0's TensorBoard events. A fresh start empties the folder; a resume purges what
    the interrupted attempt logged past the checkpoint it resumes from (purge_step), so the
    curves never show a step twice. The per-step loss stays on the device until the epoch
    ends or a checkpoint is written (`flush_every`: the checkpoint interval, which syncs the
    host anyway), so a resume from that checkpoint has every point up to it."""

    def __init__(self, log_dir: Path, every: int, resumed_step: int | None, flush_every=0):
        from torch.utils.tensorboard import SummaryWriter

        if resumed_step is None:
            shutil.rmtree(log_dir, ignore_errors=True)
        purge = resumed_step + 1 if resumed_step is not None else None
        self.writer = SummaryWriter(str(log_dir), purge_step=purge, flush_secs=10)
        self.every, self.flush_every = every, flush_every
        self._steps: list[tuple[int, torch.Tensor]] = []

    def on_step(self, loop) -> None:
        step = loop.scheduler.last_epoch
        if step % self.every == 0 and loop.last_loss is not None:
            self._steps.append((step, loop.last_loss.detach().clone()))
        if self.flush_every and step % self.flush_every == 0:
            self.flush_steps()

    def flush_steps(self) -> None:
        if self._steps:
            values = torch.stack([loss for _, loss in self._steps]).cpu().tolist()
            for (s, _), value in zip(self._steps, values, strict=True):
                self.writer.add_scalar("train/loss_step", value, s)
            self._steps = []
        self.writer.flush()

    def on_epoch(self, record: dict) -> None:
        w, step = self.writer, record["step"]
        self.flush_steps()
        scalars = {
            "train/loss": record["train_loss"],
            # the task's validation metrics (classification: val/loss, val/accuracy)
            **{
                f"val/{key[4:]}": value
                for key, value in record.items()
                if key.startswith("val_") and isinstance(value, (int, float))
            },
            "train/lr": record["lr"],
            "train/samples_per_s": record["samples_per_s"],
            **{f"train/{key}": record[key] for key in ("model_tflops", "mfu") if key in record},
            **{f"seconds/{phase}": v for phase, v in record["seconds"].items()},
        }
        for entry in record.get("ranks") or []:
            for key, value in entry.items():
                if key not in ("rank", "host"):
                    scalars[f"system/rank{entry['rank']}/{key}"] = value
        for tag, value in scalars.items():
            w.add_scalar(tag, value, step)
        w.flush()

    def close(self) -> None:
        # a failed or stopped attempt's points too: a resume purges those past its checkpoint
        self.flush_steps()
        self.writer.close()


def log_final_metrics(
    log_dir: Path, split: str, result: dict, step: int, headline=("accuracy",)
) -> None:
    """The evaluation's figures, as scalars at the training's last step (`<split>/...`)."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(log_dir)) as writer:
        for key in headline:
            if result.get(key) is not None:
                writer.add_scalar(f"{split}/final_{key}", result[key], step)
        writer.add_scalar(f"{split}/final_loss", result["loss"], step)
        writer.add_scalar(f"{split}/eval_seconds", result["eval_seconds"], step)


class StepProfiler:
    """torch.profiler over optimizer steps wait..wait+warmup+active of this attempt; the
    trace and the top operators are written when the recorded steps end (or at close(), if
    the run ends first)."""

    def __init__(self, cfg: TrainProfileSpec, out_dir: Path, rank: int, device: torch.device):
        from torch.profiler import ProfilerActivity, profile, schedule

        self.out_dir, self.rank, self.done = out_dir, rank, False
        self.cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(
            activities=activities,
            schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
            on_trace_ready=self._ready,
        )
        self.prof.start()

    def step(self) -> None:
        if not self.done:
            self.prof.step()

    def _ready(self, prof) -> None:
        self.done = True
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / TRACE.format(rank=self.rank)
        prof.export_chrome_trace(str(trace))
        top = top_operators(prof.key_averages(), self.cuda)
        (self.out_dir / TOP_OPS.format(rank=self.rank)).write_text(json.dumps(top, indent=1))
        viewers = "ui.perfetto.dev or chrome://tracing"
        log.info("profile: rank %d trace in %s (open in %s)", self.rank, trace, viewers)

    def close(self) -> None:
        try:
            self.prof.stop()  # writes the trace if the recorded steps were still running
        except Exception as err:  # noqa: BLE001 - a profiler failure must not fail the run
            log.warning("profile: stopping the profiler failed: %s", err)
        if not self.done:
            log.warning(
                "profile: the run ended before the profiled steps began "
                "(train.profile.wait + warmup is more than its optimizer steps)"
            )


def top_operators(averages, cuda: bool, limit: int = 15) -> dict:
    """The operators with the most self time (device time on a GPU, else CPU time)."""
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = [
        {
            "name": e.key,
            "calls": e.count,
            "self_cpu_ms": e.self_cpu_time_total / 1000,
            "cpu_total_ms": e.cpu_time_total / 1000,
            **({"self_device_ms": e.self_device_time_total / 1000} if cuda else {}),
        }
        for e in averages
    ]
    rows.sort(key=lambda r: r["self_device_ms" if cuda else "self_cpu_ms"], reverse=True)
    total = sum(getattr(e, key) for e in averages) / 1000
    return {"sorted_by": key, "total_ms": total, "ops": rows[:limit]}


class RunMonitor:
    """Everything above for one training attempt on one rank."""

    def __init__(
        self, run: RunSpec, run_dir, env: DistEnv, device, hosts, resumed_step: int | None
    ):
        cfg, profile = run.train.monitor, run.train.profile
        self.env, self.margin, self.hosts = env, cfg.straggler_margin, hosts
        self.device = device
        run_dir = Path(run_dir)
        series = None
        if cfg.system_interval_s > 0:
            (run_dir / SYSTEM_DIR).mkdir(parents=True, exist_ok=True)
            series = run_dir / SYSTEM_DIR / f"rank-{env.global_rank}.jsonl"
            if resumed_step is None:
                series.unlink(missing_ok=True)
        self.system = SystemSampler(device, cfg.system_interval_s, env.rank, series)
        self.tensorboard = None
        if env.is_master and cfg.tensorboard:
            board, flush = run_dir / TENSORBOARD_DIR, run.train.checkpoint.every_steps
            self.tensorboard = TensorBoardLog(board, cfg.log_every_steps, resumed_step, flush)
        self.profiler = None
        if env.is_master and resumed_step is None:  # a fresh start: no earlier run's trace
            shutil.rmtree(run_dir / PROFILE_DIR, ignore_errors=True)
        if profile.enabled and (env.is_master or profile.ranks == "all"):
            self.profiler = StepProfiler(profile, run_dir / PROFILE_DIR, env.global_rank, device)
        self._flagged: set[int] = set()

    def wrap_step(self, inner):
        def on_step(loop) -> None:
            if self.profiler is not None:
                self.profiler.step()
            if self.tensorboard is not None:
                self.tensorboard.on_step(loop)
            if inner is not None:
                inner(loop)

        return on_step

    def on_epoch(self, record: dict) -> None:
        """Every rank: add the per-rank summaries to the record (a collective)."""
        # tensor parallelism: the data group's members, named by their rank in the job
        env, tensor, me = self.env, self.env.tensor_parallel, self.env.global_rank
        mine = rank_summary(record, self.system.take(), me, self.hosts[me])
        ranks = [mine]
        if self.env.world_size > 1:  # one float64 tensor per rank: nothing pickled
            packed = torch.tensor(pack_summary(mine), dtype=torch.float64, device=self.device)
            parts = [torch.empty_like(packed) for _ in range(self.env.world_size)]
            dist.all_gather(parts, packed, group=self.env.group)
            members = [r * tensor + env.tensor_rank for r in range(len(parts))]
            ranks = [
                unpack_summary(part.cpu().tolist(), r, self.hosts[r])
                for r, part in zip(members, parts, strict=True)
            ]
        record["ranks"] = ranks
        if not self.env.is_master:
            return
        flagged = stragglers(ranks, self.margin)
        now = {f["rank"] for f in flagged}
        for f in flagged:
            if f["rank"] not in self._flagged:
                why = f"{f['reason']}; margin {100 * self.margin:.0f}%"
                log.warning(_STRAGGLER, f["rank"], f["host"], record["epoch"], why)
        self._flagged = now
        if self.tensorboard is not None:
            self.tensorboard.on_epoch(record)

    def close(self) -> None:
        self.system.close()
        if self.profiler is not None:
            self.profiler.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
