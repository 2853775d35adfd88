"""A training step's memory, measured without allocating it: the model built and one step
run under torch's FakeTensorMode (tensors with shapes and no storage) while torch's
MemTracker counts every storage by what it holds. Runs on the login node's CPU, before
anything is queued (ddpflow.checks.early's subprocess); ddpflow.checks.memory turns the figures into
a rank's peak at the run's world size and strategy and compares it with the memory a rank has.

What is measured, for one unsharded model on one process at the run's micro-batch, precision
(autocast as the ranks run it) and activation checkpointing:

* parameters, buffers and gradients (bytes of each, exactly);
* optimizer state after a step (the configured optimizer's own tensors);
* activations: the largest amount of forward activations and backward temporaries alive at
  once, with every gradient already allocated (DDP's gradients are views of buckets that
  live from the wrapper's creation, so they coexist with the activations); once at the
  micro-batch and once at micro-batch 2 (what does not grow with it);
* evaluation: the activations of one forward without gradients in eval mode at the
  evaluation's batch (the validation after each epoch and the evaluation a training job
  adds at its end score eval.batch_size inputs per forward, or the rank's whole shard where
  that is smaller): at 512 images they outgrow a training micro-batch's activations;
* the largest FSDP unit's parameters (ddpflow.training.sharding.units): what FSDP gathers
  whole for a block's forward and backward;
* the arithmetic of one micro-batch's forward and backward (torch's FlopCounterMode on the
  same fake tensors): "model_flops", the model's own (counted before activation
  checkpointing wraps it), and "hardware_flops", what the ranks compute (with checkpointing,
  the forward its backward recomputes too). ddpflow.monitoring.flops turns them into a run's
  TFLOP/s and MFU.

    figures = measure(model_cfg, [3, 32, 32], 10, micro_batch=256, precision="fp32",
                      device_type="cpu", checkpointing=False, optimizer=opt_cfg)
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpflow.training.build import make_optimizer
from ddpflow.training.models import build_model

FIGURES = (
    "parameters",
    "buffers",
    "gradients",
    "optimizer",
    "activations",
    "activations_at_2",
    "evaluation",
    "largest_unit",
    "model_flops",
    "hardware_flops",
)


def measure(
    model_cfg: dict,
    shape: list[int],
    outputs: int,
    micro_batch: int,
    precision: str,
    device_type: str,
    checkpointing: bool,
    optimizer: Any,
    eval_batch: int = 0,
) -> dict[str, int]:
    """The figures (FIGURES, bytes) of one training step, measured on fake tensors.
    precision/device_type: autocast as the ranks use it (fp16 on a CPU rank trains in fp32);
    optimizer: the train.optimizer section (a SectionView or dict with its keys);
    eval_batch: the inputs of one evaluation forward (0: no evaluation measured)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ddpflow.config.typed import OptimizerSpec

    opt_cfg = optimizer if isinstance(optimizer, OptimizerSpec) else _optimizer_spec(optimizer)
    with warnings.catch_warnings(), FakeTensorMode():
        warnings.simplefilter("ignore")  # MemTracker's notes on hooks: not the user's concern
        with _no_init():
            model = build_model(model_cfg, shape, outputs)
        autocast = _autocast(precision, device_type)
        x = _inputs(micro_batch, shape)
        model_flops, hardware_flops = _flops_both(model, x, autocast, checkpointing)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_optimizer(params, opt_cfg, 0.01, torch.device("cpu"))
        small = min(2, micro_batch)  # BatchNorm needs 2 samples where a map is 1x1
        _step(model, opt, _inputs(small, shape), autocast)  # gradients, optimizer state
        at_two = _tracked_step(model, opt, small, shape, autocast)
        peak = _tracked_step(model, opt, micro_batch, shape, autocast)
        evaluation = _tracked_evaluation(model, eval_batch, shape, autocast)
    return {
        "parameters": sum(_nbytes(p) for p in model.parameters()),
        "buffers": sum(_nbytes(b) for b in model.buffers()),
        "gradients": sum(_nbytes(p) for p in params),
        "optimizer": peak.get("Optstate", 0),
        "activations": peak.get("Activation", 0) + peak.get("Temp", 0),
        # at micro-batch 2: with `activations`, what grows with the micro-batch (checks.memory)
        "activations_at_2": at_two.get("Activation", 0) + at_two.get("Temp", 0),
        "evaluation": evaluation,
        "eval_batch": eval_batch,  # what `evaluation` was measured at (memory_knobs scales it)
        "largest_unit": _largest_unit(model),
        "model_flops": model_flops,  # one micro-batch's forward and backward
        "hardware_flops": hardware_flops,
    }


def _largest_unit(model: nn.Module) -> int:
    """The bytes of the largest FSDP unit's parameters (sharding.units)."""
    from ddpflow.training import sharding

    units = sharding.units(model)
    return max((sum(_nbytes(p) for p in unit.parameters()) for unit in units), default=0)


def _flops_both(model: nn.Module, x: torch.Tensor, autocast, checkpointing: bool):
    """(model FLOPs, hardware FLOPs) of one forward and backward on x; with checkpointing,
    the model is left wrapped by it (sharding.checkpoint_activations) and the hardware's
    count has the forward its backward recomputes."""
    from ddpflow.training import sharding

    model_flops = count_flops(model, x, autocast)
    if not checkpointing:
        return model_flops, model_flops
    sharding.checkpoint_activations(model)
    return model_flops, count_flops(model, x, autocast)


def count_flops(model: nn.Module, x: torch.Tensor, autocast=None) -> int:
    """The floating-point operations of one forward and backward of model on x (a
    multiply-add is two), counted by torch's FlopCounterMode from the shapes of the matrix
    products, convolutions and attention: on fake or meta tensors as on real ones. Causal
    attention counts as full attention (the convention of the 6N + 12LHQT formula). The
    gradients it leaves are zeroed in place."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping=_cpu_attention()) as counter:
        with autocast() if autocast else contextlib.nullcontext():
            out = model(x)
        out.float().sum().backward()
    for parameter in model.parameters():
        if parameter.grad is not None:
            parameter.grad.zero_()
    return int(counter.get_total_flops())


def _cpu_attention() -> dict:
    """FlopCounterMode's formulas for the CPU's fused attention kernels, which it counts on
    GPUs (flash, memory-efficient, cuDNN) but not on a CPU, where the login node counts."""
    from torch.utils import flop_counter

    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is None or backward is None:
        return {}

    def counted_forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_flop_count(query, key, value)

    def counted_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)

    return {forward: counted_forward, backward: counted_backward}


def _tracked_step(model: nn.Module, opt, micro_batch: int, shape, autocast) -> dict[str, int]:
    """The bytes by kind (Parameter, Gradient, Activation, Temp, Optstate, ...) alive at the
    peak of one step at this micro-batch."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        _step(model, opt, _inputs(micro_batch, shape), autocast)
    peak = tracker.get_tracker_snapshot("peak")
    return {
        str(getattr(kind, "value", kind)): nbytes
        for device in peak.values()
        for kind, nbytes in device.items()
    }


def _tracked_evaluation(model: nn.Module, batch: int, shape, autocast) -> int:
    """The activations alive at the peak of one evaluation forward (no gradients, eval mode:
    each layer's input is freed once its output exists) at this batch; 0 for batch 0."""
    from torch.distributed._tools.mem_tracker import MemTracker

    if batch <= 0:
        return 0
    model.eval()
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker, torch.no_grad(), autocast() if autocast else contextlib.nullcontext():
        model(_inputs(batch, shape))
    model.train()
    peak = tracker.get_tracker_snapshot("peak")
    kinds = {
        str(getattr(kind, "value", kind)): n for dev in peak.values() for kind, n in dev.items()
    }
    return kinds.get("Activation", 0) + kinds.get("Temp", 0)


def _inputs(n: int, shape) -> torch.Tensor:
    """A batch of n inputs: images [n, C, H, W], or a language model's token ids [n, T]."""
    if len(shape) == 1:
        return torch.zeros(n, *shape, dtype=torch.int64)
    return torch.empty(n, *shape)


def _step(model: nn.Module, opt, x: torch.Tensor, autocast) -> None:
    """A forward, backward and optimizer step; the gradients are zeroed, not freed, so that
    the next step's activations are counted beside them (DDP's bucket views)."""
    with autocast() if autocast else contextlib.nullcontext():
        out = model(x)
    out.float().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def _autocast(precision: str, device_type: str):
    """The ranks' autocast (ddpflow.training.build.autocast_factory), run on the CPU: bf16
    and fp16 as on a GPU rank; a CPU rank trains fp16 in fp32."""
    if precision == "fp32" or (precision == "fp16" and device_type != "cuda"):
        return None
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast("cpu", dtype=dtype)


@contextlib.contextmanager
def _no_init():
    """torch.nn.init's in-place initialisers as no-ops while the model is built: their values
    do not change its memory, and some (trunc_normal_) ask a fake tensor for data."""
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(nn.init, n) for n in names}
    for name in names:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _optimizer_spec(section):
    from ddpflow.config.typed import OptimizerSpec

    fields = {k: section[k] for k in OptimizerSpec.__dataclass_fields__ if k in section}
    return OptimizerSpec(**{**fields, "betas": tuple(fields.get("betas", (0.9, 0.999)))})


def process_memory(status: str = "/proc/self/status") -> dict[str, int]:
    """A CPU rank's process before its model: this process's resident memory after importing
    what a rank imports and training a tiny model for a few real steps (which loads the
    kernels, thread pools and allocator arenas a rank's first step loads). Anonymous (the
    process's own) and file-backed (library pages: shared by the node's ranks, and page
    cache the kernel can drop) bytes, from /proc (0 where unknown)."""
    import ddpflow.cluster.jobs  # what a rank imports
    import ddpflow.training.entry  # noqa: F401

    model = build_model({"name": "cnn", "cnn_channels": 8}, [1, 8, 8], 2)
    opt = torch.optim.Adam(model.parameters(), fused=True)
    for _ in range(3):
        model(torch.randn(2, 1, 8, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    found = {"anon": 0, "file": 0}
    try:
        for line in Path(status).read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                found[key[3:].lower()] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return found


def local_gpu_bytes() -> int | None:
    """The memory of this machine's first GPU (what the local launcher's GPU ranks get)."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)
