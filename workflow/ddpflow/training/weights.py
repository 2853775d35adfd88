"""Fine-tuning on a rank: start the model from model.weights (strictly: only the classifier
head may differ, and then only in shape), freeze what train.freeze names, and give each
trainable parameter its learning-rate factor (train.optimizer.lr_mult).

    loaded = load_weights(model, run.weights, num_classes)   # {"head": ..., "sha256": ...}
    frozen = apply_freeze(model, run.train.freeze)           # names of the frozen parameters
    groups = param_groups(model, lr_mult)                    # the optimizer's, trainable only
    keep_frozen_statistics(model)                            # after every model.train()
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpflow.errors import UserError
from ddpflow.runtime import safe_torch_load, sha256_file

log = logging.getLogger(__name__)
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP's and torch.compile's
SHOWN = 8  # keys listed per kind in an error


class WeightsError(UserError):
    """model.weights cannot start this model (names the file, the keys and the fix)."""


def head_name(model: nn.Module) -> str:
    """The classifier head: the model's last nn.Linear (fc, classifier.3, heads.head)."""
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not linears:
        raise WeightsError(
            "the model has no nn.Linear layer to take as its classifier "
            "head; name the frozen parameters in train.freeze instead of "
            "backbone"
        )
    return linears[-1]


def read_state(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict from a .safetensors file, a ddpflow model.pt or a torch-saved state dict
    (weights_only: no code runs), with DDP's and torch.compile's prefixes taken off."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state: Any = load_file(str(path))
    else:
        state = safe_torch_load(str(path), torch.device("cpu"))
        if isinstance(state, Mapping) and isinstance(state.get("state_dict"), Mapping):
            state = state["state_dict"]  # a ddpflow model.pt or a {"state_dict": ...} file
        elif isinstance(state, Mapping) and isinstance(state.get("model"), Mapping):
            state = state["model"]
    if not isinstance(state, Mapping) or not all(
        isinstance(v, torch.Tensor) for v in state.values()
    ):
        raise WeightsError(
            f"{path}: not a state dict (a mapping of parameter names to "
            "tensors), a ddpflow model.pt or a .safetensors file"
        )
    return {_strip(key): value for key, value in state.items()}


def _strip(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key, changed = key[len(prefix) :], True
    return key.replace("._orig_mod.", ".")


def load_weights(model: nn.Module, weights: Mapping[str, Any], num_classes: int) -> dict:
    """Load weights["path"] into model strictly; a head that differs only in shape keeps its
    fresh initialisation. The file's sha256 is checked against the one the login node found
    (a file replaced since then is refused). Returns what was done, for the records."""
    path = Path(weights["path"])
    if not path.is_file():
        raise WeightsError(f"model.weights {weights['spec']!r}: no file {path} on {_host()}")
    found = sha256_file(path)
    expected = weights.get("sha256")
    if expected and found != expected:
        raise WeightsError(
            f"model.weights {weights['spec']!r}: {path} has sha256 {found} "
            f"on {_host()}, not the {expected} found before the job was "
            "submitted: the file changed meanwhile; rerun to train from the "
            "new file"
        )
    state = read_state(path)
    head, changed = check_keys(model, state, weights["spec"])
    model.load_state_dict({k: v for k, v in state.items() if k not in changed}, strict=False)
    record = {"spec": weights["spec"], "path": str(path), "sha256": found, "head": None}
    if changed:
        old = state[f"{head}.weight"].shape[0] if f"{head}.weight" in state else "?"
        record["head"] = f"head {head} re-initialised: {old} -> {num_classes} classes"
    return record


def check_keys(model: nn.Module, state: Mapping[str, torch.Tensor], spec: str):
    """(the head's name, the head keys whose shape differs); any other missing, unexpected
    or mis-shaped key is a WeightsError listing them."""
    own = model.state_dict()
    head = head_name(model)
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shaped = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    head_keys = [k for k in shaped if k.rpartition(".")[0] == head]
    others = [k for k in shaped if k not in head_keys]
    if missing or unexpected or others:
        parts = [
            f"{len(missing)} missing: {_listed(missing)}" if missing else "",
            f"{len(unexpected)} unexpected: {_listed(unexpected)}" if unexpected else "",
            f"{len(others)} of another shape: "
            + _listed(
                [
                    f"{k} {tuple(state[k].shape)} in the file, {tuple(own[k].shape)} here"
                    for k in others
                ]
            )
            if others
            else "",
        ]
        raise WeightsError(
            f"model.weights {spec!r} does not fit this model ({'; '.join(p for p in parts if p)}); "
            "it was saved from another architecture or model.kwargs: use the model it was "
            "trained as (model.name, kwargs, small_input_stem, data.channels), or a file for "
            "this one. Only the classifier head may differ, in its class count"
        )
    return head, head_keys


def _listed(keys: list[str]) -> str:
    more = f", ... ({len(keys) - SHOWN} more)" if len(keys) > SHOWN else ""
    return ", ".join(keys[:SHOWN]) + more


def frozen_names(model: nn.Module, freeze: str | Iterable[str]) -> list[str]:
    """The parameters train.freeze names: every one but the head's (backbone), or those
    under a prefix ("layer1" names layer1.*, not layer10.*)."""
    names = [name for name, _ in model.named_parameters()]
    if freeze == "backbone":
        head = head_name(model)
        return [n for n in names if not _under(n, head)]
    prefixes = list(freeze)
    unused = [p for p in prefixes if not any(_under(n, p) for n in names)]
    if unused:
        raise WeightsError(
            f"train.freeze: no parameter is named {_listed(unused)}; the "
            f"model's are {_listed(names)}"
        )
    return [n for n in names if any(_under(n, p) for p in prefixes)]


def _under(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def apply_freeze(model: nn.Module, frozen: Iterable[str]) -> None:
    """requires_grad off for the frozen parameters, on for every other: before DDP, ZeRO or
    fully_shard wrap the model, which then leave frozen parameters out of their buckets."""
    frozen = set(frozen)
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)


def freeze(model: nn.Module, spec: str | Iterable[str]) -> list[str]:
    """Freeze what train.freeze names (nothing for []); returns the frozen names."""
    frozen = frozen_names(model, spec) if spec else []
    apply_freeze(model, frozen)
    return frozen


def keep_frozen_statistics(model: nn.Module) -> None:
    """BatchNorm layers whose parameters are all frozen back in eval mode, after
    model.train() (which would otherwise update their running statistics)."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            params = list(module.parameters(recurse=False))
            if params and not any(p.requires_grad for p in params):
                module.eval()


def param_groups(model: nn.Module, lr_mult: Mapping[str, float]) -> list[dict]:
    """The trainable parameters in groups of one lr factor each (the longest lr_mult prefix
    that matches a name; 1.0 where none does); "lr_mult" in each group, which the schedule
    scales (a factor 0 leaves the group's parameters where they are)."""
    unused = [
        p for p in lr_mult if p and not any(_under(n, p) for n, _ in model.named_parameters())
    ]
    if unused:
        raise WeightsError(f"train.optimizer.lr_mult: no parameter is named {_listed(unused)}")
    groups: dict[float, list] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        matches = [p for p in lr_mult if _under(name, p)]
        factor = float(lr_mult[max(matches, key=len)]) if matches else 1.0
        groups.setdefault(factor, []).append(param)
    return [{"params": params, "lr_mult": factor} for factor, params in groups.items()]


def _host() -> str:
    import socket

    return socket.gethostname()


def log_fine_tuning(loop) -> None:
    """Rank 0's lines on what the run starts from and what does not train."""
    if loop.loaded:
        loaded = loop.loaded
        head = f"; {loaded['head']}" if loaded["head"] else ""
        log.info(
            "model.weights %s: loaded %s (sha256 %s)%s",
            loaded["spec"],
            loaded["path"],
            loaded["sha256"][:16],
            head,
        )
    if loop.frozen:
        total = sum(1 for _ in loop.model.parameters())
        until = loop.tcfg.unfreeze_at_epoch
        log.info(
            "train.freeze %s: %d of %d parameter tensors frozen%s",
            loop.tcfg.freeze,
            len(loop.frozen),
            total,
            f" until epoch {until}" if until else "",
        )


def check_fine_tuning(check: Mapping[str, Any]) -> list[str]:
    """Before any job: model.weights fit the model (strictly, but for the head's class
    count) and every train.freeze and lr_mult prefix names a parameter (a WeightsError names
    what does not). check: model, shape, num_classes and the weights, freeze and lr_mult
    that apply. Returns what the training will do, as lines for the terminal."""
    from ddpflow.training.models import build_model

    model = build_model(check["model"], check["shape"], check["num_classes"])
    lines = []
    if check.get("weights"):
        spec, path = check["weights"]["spec"], check["weights"]["path"]
        state = read_state(path)
        head, changed = check_keys(model, state, spec)
        lines.append(f"model.weights {spec}: {len(state)} tensors from {path} fit the model")
        if changed:
            classes = state[f"{head}.weight"].shape[0] if f"{head}.weight" in state else "?"
            lines.append(f"head {head} re-initialised: {classes} -> {check['num_classes']} classes")
    if check.get("freeze"):
        frozen = frozen_names(model, check["freeze"])
        apply_freeze(model, frozen)
        total = sum(1 for _ in model.parameters())
        lines.append(
            f"train.freeze {check['freeze']}: {len(frozen)} of {total} parameter tensors frozen"
        )
    if check.get("lr_mult"):
        groups = param_groups(model, check["lr_mult"])
        lines.append(
            "train.optimizer.lr_mult: "
            + ", ".join(f"{len(g['params'])} tensors at {g['lr_mult']:g} x lr" for g in groups)
        )
    return lines
