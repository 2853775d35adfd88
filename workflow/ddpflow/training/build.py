"""The objects a rank trains with, built in one place from the run's config: the placed
model, the strategy's wrapper (DDP, ZeRO's sharded optimizer, FSDP's sharded module; plain
on one rank), torch.compile, the optimizer, the lr schedule, mixed precision and its grad
scaler, and the loss."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpflow.cluster.distenv import DistEnv
from ddpflow.config import trains_sharded, uses_channels_last
from ddpflow.config.machine import SHARDED_STRATEGIES
from ddpflow.config.typed import OptimizerSpec, RunSpec, TrainDdpSpec, TrainSpec
from ddpflow.training import sharding, tensor_parallel
from ddpflow.training.batchnorm import only_batchnorm_buffers
from ddpflow.training.models import build_model, place
from ddpflow.training.schedule import effective_lr, lr_schedule
from ddpflow.training.weights import apply_freeze, load_weights, param_groups
from ddpflow.words import counted

log = logging.getLogger(__name__)


@dataclass
class TrainingParts:
    """What build_training makes for a Loop."""

    strategy: str  # the one this world size trains with (one rank: "ddp", plain training)
    model: nn.Module  # the module whose state a checkpoint holds (FSDP: sharded in place)
    # what the forward runs: DDP(model), FSDP's sharded model or, on one rank, the model
    # itself; compiled under train.compile
    wrapped: nn.Module
    lr: float  # the effective lr (effective_lr)
    optimizer: torch.optim.Optimizer  # ZeroRedundancyOptimizer under strategy zero
    scheduler: torch.optim.lr_scheduler.LambdaLR  # per optimizer step
    scaler: torch.amp.GradScaler  # enabled for fp16 on CUDA only
    autocast: Callable | None  # a context-manager factory; None: fp32
    loss_fn: nn.Module
    # tensor parallelism under ddp: the gradients' all-reduce over the data group, called
    # after each step's last backward (tensor_parallel.GradientSync); None elsewhere
    grad_sync: Callable[[], None] | None = None


def placed_model(run: RunSpec, shape, num_classes: int, device: torch.device):
    """(the run's model, what model.weights loaded into it or None): the same initial
    weights on every rank (DDP also broadcasts), on its device and memory layout; FSDP moves
    the shards itself (sharding.shard). model.weights are loaded on the host, strictly
    (training.weights); a resumed run's checkpoint then replaces them."""
    torch.manual_seed(run.train.seed)
    model = build_model(run.resolved["model"], shape, num_classes)  # a plug-in's kwargs as written
    loaded = load_weights(model, run.weights, num_classes) if run.weights else None
    # tensor parallelism splits the model where it is: on its device
    move = not trains_sharded(run) or run.train.tensor_parallel > 1
    return place(model, device, uses_channels_last(run), move=move), loaded


def build_training(
    run: RunSpec, env: DistEnv, device: torch.device, model, steps_per_epoch: int, loss_fn
):
    """The strategy's wrapper around model, and the optimizer, schedule and precision of
    run's train section, with the task's loss on the device (a TrainingParts)."""
    tcfg = run.train
    strategy = training_strategy(tcfg, env)
    model, wrapped = _wrap(model, strategy, env, device, tcfg)
    lr = effective_lr(tcfg)
    optimizer = _optimizer(model, tcfg, device, strategy)
    scheduler = _scheduler(optimizer, tcfg, steps_per_epoch)
    autocast = autocast_factory(tcfg.precision, device)
    scaler = torch.amp.GradScaler(
        "cuda", enabled=tcfg.precision == "fp16" and device.type == "cuda"
    )
    loss_fn = loss_fn.to(device)
    sync = wrapped.sync if isinstance(wrapped, tensor_parallel.GradientSync) else None
    return TrainingParts(
        strategy, model, wrapped, lr, optimizer, scheduler, scaler, autocast, loss_fn, sync
    )


def _scheduler(optimizer, tcfg: TrainSpec, steps_per_epoch: int, step: int = 0):
    """The lr schedule per optimizer step, at `step` (a rebuilt optimizer's lrs set there)."""
    total = steps_per_epoch * tcfg.epochs
    warmup = round(tcfg.warmup_epochs * steps_per_epoch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_schedule(tcfg.schedule, warmup, total)
    )
    if step:
        for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
            group["lr"] = group["initial_lr"] * factor(step)
        scheduler.last_epoch = step
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    return scheduler


def unfrozen(run: RunSpec, env: DistEnv, device, model, wrapped, steps_per_epoch: int, step: int):
    """(wrapped, optimizer, scheduler) once every parameter trains (train.unfreeze_at_epoch):
    DDP bucketed only the parameters that needed a gradient when it was built, so it is
    built again (and compiled again); FSDP's sharded parameters reduce-scatter whatever
    gradient they get. The new optimizer holds every parameter; its schedule is at `step`."""
    tcfg = run.train
    strategy = training_strategy(tcfg, env)
    apply_freeze(model, ())
    if strategy not in SHARDED_STRATEGIES and env.tensor_parallel == 1:  # GradientSync: any
        wrapped = wrap_ddp(model, device, tcfg.ddp) if env.world_size > 1 else model
        if tcfg.compile:
            wrapped = cast(nn.Module, torch.compile(wrapped))
    optimizer = _optimizer(model, tcfg, device, strategy)
    return wrapped, optimizer, _scheduler(optimizer, tcfg, steps_per_epoch, step)


def _wrap(model: nn.Module, strategy: str, env: DistEnv, device, tcfg: TrainSpec):
    """(the model, what the forward runs): activation checkpointing, then FSDP's sharding
    or DDP's wrapper (several ranks), then torch.compile."""
    if tcfg.activation_checkpointing:  # before sharding: FSDP's hooks wrap it
        blocks = sharding.checkpoint_activations(model)
        if env.is_master:
            what = "each forward recomputed in the backward"
            log.info("activation checkpointing: %s, %s", counted(blocks, "block"), what)
    if env.tensor_parallel > 1:  # in place: the blocks' projections become DTensor shards
        tensor_parallel.parallelize(model, env.mesh["tensor"])
    if strategy in SHARDED_STRATEGIES:  # in place: the model's parameters become DTensor shards
        shard_size = tcfg.hsdp.shard_size or env.local_world_size  # null: a node's ranks
        mesh = sharding.mesh_shape(strategy, env.world_size, shard_size)
        data = env.mesh["data"] if env.mesh is not None else None  # across tensor groups
        model = wrapped = sharding.shard(model, device, tcfg.fsdp, tcfg.precision, mesh, data)
        if env.is_master and strategy == "hsdp":
            log.info("hsdp mesh: %d replicas x %d shards", *mesh)
    elif env.tensor_parallel > 1:
        wrapped = tensor_parallel.GradientSync(model, env.group, env.world_size)
    else:
        wrapped = wrap_ddp(model, device, tcfg.ddp) if env.world_size > 1 else model
    if tcfg.compile:
        # the DDP module is compiled (not the model inside): dynamo then splits the graph
        # at DDP's bucket boundaries, so the all-reduce still overlaps the backward
        # a compiled module is an nn.Module (OptimizedModule); the stubs say a callable
        wrapped = cast(nn.Module, torch.compile(wrapped))
    return model, wrapped


def training_strategy(tcfg: TrainSpec, env: DistEnv) -> str:
    """The strategy this world size trains with: on one rank there is nothing to shard,
    and every strategy is plain training ("ddp")."""
    return tcfg.strategy if env.world_size > 1 else "ddp"


def _optimizer(model: nn.Module, tcfg: TrainSpec, device, strategy: str):
    """The run's optimizer over the model's trainable parameters (build.trainable)."""
    params = trainable(model, tcfg)
    zero, fsdp = strategy == "zero", strategy in SHARDED_STRATEGIES
    dtensors = fsdp or tcfg.tensor_parallel > 1  # every parameter a DTensor (tensor_parallel)
    return make_optimizer(params, tcfg.optimizer, effective_lr(tcfg), device, zero, dtensors)


def trainable(model: nn.Module, tcfg: TrainSpec):
    """What the optimizer holds: every parameter (a run that fine-tunes nothing, as before
    train.freeze existed), or the trainable ones in groups of one lr_mult each."""
    fine_tuned = tcfg.optimizer.lr_mult or any(not p.requires_grad for p in model.parameters())
    return param_groups(model, tcfg.optimizer.lr_mult) if fine_tuned else model.parameters()


def make_optimizer(
    params, opt_cfg: OptimizerSpec, lr: float, device: torch.device, sharded=False, dtensors=False
):
    """The configured optimizer; sharded: ZeRO stage 1 (each rank holds and updates the state
    of 1/N of the parameters, then broadcasts them: the same arithmetic per element);
    dtensors: FSDP's or tensor parallelism's DTensor parameters, which the fused kernels do
    not take (foreach)."""
    # fused kernels (one kernel for all parameters) exist for CUDA and CPU tensors; on CPU
    # the default per-tensor loop was 3-5x slower per step (bench/throughput.py, MLP/CNN)
    fast = {"foreach": True} if dtensors else {"fused": True}
    kwargs: dict[str, Any] = {"lr": lr, "weight_decay": opt_cfg.weight_decay, **fast}
    cls: type[torch.optim.Optimizer]
    if opt_cfg.name == "sgd":
        cls = torch.optim.SGD
        kwargs.update(momentum=opt_cfg.momentum, nesterov=opt_cfg.nesterov and opt_cfg.momentum > 0)
    else:
        cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[opt_cfg.name]
        kwargs.update(betas=tuple(opt_cfg.betas))
    params = list(params)
    if params and isinstance(params[0], dict):  # groups with their lr factor (lr_mult)
        params = [{**group, "lr": lr * group["lr_mult"]} for group in params]
    if sharded:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
    return cls(params, **kwargs)


def autocast_factory(precision: str, device: torch.device):
    """A context-manager factory for mixed precision; None means fp32. bf16 on CUDA and on
    CPU ranks (oneDNN's bf16 kernels: AMX / AVX512-BF16; bench/layout.py); fp16 on CUDA
    only (CPU ranks train it in fp32: fp16 needs loss scaling and few CPUs compute it
    natively)."""
    if precision == "fp32" or (precision == "fp16" and device.type != "cuda"):
        return None
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device.type, dtype=dtype)


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN computes bf16 in hardware here (AVX512-BF16 or AMX); without it
    bf16 autocast on a CPU is emulated and slower than fp32."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def wrap_ddp(model: nn.Module, device: torch.device, ddp_cfg: TrainDdpSpec) -> DDP:
    """DDP with the configured bucket size, bucket views, static graph and compression hook."""
    # BatchNorm statistics are equal on every rank after each step (training.batchnorm):
    # DDP's broadcast of rank 0's buffers before each step's forward is then redundant.
    # torch 2.14 names it forward_sync_buffers (broadcast_buffers warns: deprecated); both
    # sync them once at the start, where every rank holds the same buffers anyway
    sync = not only_batchnorm_buffers(model)
    renamed = "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    buffers: dict[str, Any] = {"forward_sync_buffers" if renamed else "broadcast_buffers": sync}
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=ddp_cfg.bucket_cap_mb,
        gradient_as_bucket_view=ddp_cfg.gradient_as_bucket_view,
        static_graph=ddp_cfg.static_graph,
        **buffers,
    )
    if ddp_cfg.comm_hook != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = {
            "bf16_compress": default_hooks.bf16_compress_hook,
            "fp16_compress": default_hooks.fp16_compress_hook,
        }[ddp_cfg.comm_hook]
        ddp.register_comm_hook(None, hook)
    return ddp
