"""Models: the tutorials' MLP, a small CNN and ResNets adapted to small images (built in),
any torchvision classification model by name, or the user's own through a plug-in
("package.module:function", importable from the working directory or the environment).

    model = build_model({"name": "mobilenet_v3_small", "kwargs": {}}, [3, 32, 32], 10)
    check_model(model_cfg, shape, num_classes)   # before submission: a clear UserError
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ddpflow.checks.weight_files import kind as weights_kind
from ddpflow.config import BUILT_IN_MODELS
from ddpflow.errors import UserError
from ddpflow.plugins import call_plugin, is_plugin

BUILT_IN = tuple(BUILT_IN_MODELS)


class ModelError(UserError):
    """model.name does not give a usable model (names the cause and the fix)."""


def build_model(model_cfg: Mapping[str, Any], shape: list[int], num_classes: int) -> nn.Module:
    """model_cfg is the model section as a dict (a plug-in gets its kwargs as the config wrote
    them); shape is the staged [C, H, W]; the model adapts its input layer to it."""
    name = model_cfg["name"]
    if is_token_shape(shape):  # a language model: shape is [block_size], classes the vocabulary
        return _language_model(model_cfg, shape[0], num_classes)
    channels, height, width = shape
    imagenet = imagenet_architecture(model_cfg)
    if name == "mlp":
        return mlp(channels * height * width, model_cfg["mlp_hidden"], num_classes)
    if name == "cnn":
        return small_cnn(channels, model_cfg["cnn_channels"], num_classes)
    if name in ("resnet18", "resnet34") and not imagenet:
        return small_resnet(name, channels, num_classes)
    kwargs = dict(model_cfg.get("kwargs") or {})
    if is_plugin(name):
        called = f"input shape {list(shape)}, {num_classes} classes"
        return _plugin(name, (list(shape), num_classes), called, kwargs)
    small_stem = model_cfg.get("small_input_stem", True) and not imagenet
    return zoo_model(name, channels, num_classes, kwargs, small_stem)


def is_token_shape(shape) -> bool:
    """A language model's staged shape is [block_size] (images' is [C, H, W])."""
    return len(shape) == 1


def _language_model(model_cfg: Mapping[str, Any], block_size: int, vocab_size: int) -> nn.Module:
    """gpt, or a plug-in called with (vocab_size, block_size, **model.kwargs)."""
    name, kwargs = model_cfg["name"], dict(model_cfg.get("kwargs") or {})
    if name == "gpt":
        from ddpflow.training.gpt import gpt

        try:
            return gpt(vocab_size, block_size, kwargs)
        except (TypeError, ValueError) as err:
            raise ModelError(f"model.name gpt with model.kwargs {kwargs}: {err}") from err
    if not is_plugin(name):
        raise ModelError(
            f"model.name {name!r}: a language model is gpt or your own "
            "'package.module:function' called with (vocab_size, block_size)"
        )
    called = f"vocab_size {vocab_size}, block_size {block_size}"
    return _plugin(name, (vocab_size, block_size), called, kwargs)


def imagenet_architecture(model_cfg: Mapping[str, Any]) -> bool:
    """torchvision weights (model.weights a torchvision name) load into the architecture they
    were trained with: the ImageNet stem, whatever small_input_stem says (the built-in
    resnet18/34 too, which are then torchvision's)."""
    spec = model_cfg.get("weights")
    return isinstance(spec, str) and weights_kind(spec) == "torchvision"


def _plugin(spec: str, args: tuple, called: str, kwargs: dict) -> nn.Module:
    """The plug-in's factory(*args, **model.kwargs), checked; `called` says the args."""
    given = f"{called}, model.kwargs {kwargs}"
    model = call_plugin(
        spec, "model.name", ModelError, *args, kwargs=kwargs, given=given, what="factory"
    )
    if not isinstance(model, nn.Module):
        raise ModelError(f"model.name {spec!r}: the factory returned a "
                         f"{type(model).__name__}, not a torch.nn.Module")  # fmt: skip
    return model


def zoo_model(name, channels: int, num_classes: int, kwargs: dict, small_stem: bool):
    """A torchvision classification model, randomly initialised (weights=None: nothing is
    downloaded), its first convolution taking the data's channel count."""
    import torchvision

    names = torchvision.models.list_models(module=torchvision.models)
    if name not in names:
        known = list(dict.fromkeys([*BUILT_IN, *names]))  # resnet18 is in both
        close = difflib.get_close_matches(name, known, n=4, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        kinds = f"a built-in model ({', '.join(BUILT_IN)}), a torchvision classification model"
        raise ModelError(f"model.name {name!r}: not {kinds} or a 'module:function' plug-in{hint}")
    try:
        model = torchvision.models.get_model(name, weights=None, num_classes=num_classes, **kwargs)
    except (TypeError, ValueError) as err:
        raise ModelError(f"model.name {name!r} with model.kwargs {kwargs}: {err}") from err
    resnet_like = isinstance(getattr(model, "conv1", None), nn.Conv2d) and isinstance(
        getattr(model, "maxpool", None), nn.MaxPool2d
    )
    if small_stem and resnet_like:  # the ResNet family
        model.conv1 = nn.Conv2d(channels, model.conv1.out_channels, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    _adapt_input_channels(model, channels)
    return model


def _adapt_input_channels(model: nn.Module, channels: int) -> None:
    """Replace the first convolution by one with `channels` inputs (same shape otherwise)."""
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                if child.in_channels != channels:
                    setattr(parent, child_name, _conv_like(child, channels))
                return


def _conv_like(conv: nn.Conv2d, channels: int) -> nn.Conv2d:
    """A new convolution shaped like `conv` (randomly initialised) taking `channels` inputs."""
    padding = conv.padding if isinstance(conv.padding, str) else _pair(conv.padding)
    return nn.Conv2d(
        channels,
        conv.out_channels,
        kernel_size=_pair(conv.kernel_size),
        stride=_pair(conv.stride),
        padding=padding,
        dilation=_pair(conv.dilation),
        groups=conv.groups,
        bias=conv.bias is not None,
    )


def _pair(size: tuple[int, ...]) -> tuple[int, int]:
    """A Conv2d's stored size: always two ints (its stubs say a tuple of any length)."""
    height, width = size
    return height, width


def check_model(
    model_cfg: dict, shape: list[int], num_classes: int, channels_last: bool = False
) -> int:
    """Build the model on the CPU and run one forward of two dummy samples: a factory that
    fails, a model that cannot take the data's shape, or logits of the wrong width are
    refused here, before any job is queued. channels_last (the run's layout): a model with
    convolutions runs once more in that layout, where a .view() of a convolution's output
    fails. Returns the parameter count."""
    model = build_model(model_cfg, shape, num_classes)
    name = model_cfg["name"]
    tokens = is_token_shape(shape)  # token ids in, logits per position out
    sample = torch.zeros(2, *shape, dtype=torch.int64 if tokens else torch.float32)
    expected = (2, *shape, num_classes) if tokens else (2, num_classes)
    dims = ", ".join(map(str, shape))
    for mode in ("training", "evaluation"):  # some models answer differently in each
        model.train(mode == "training")
        try:
            with torch.no_grad():
                out = model(sample)
        except Exception as err:
            failed = f"a forward pass of the data's shape [N, {dims}] failed in {mode} mode"
            raise ModelError(f"model.name {name!r}: {failed}: {type(err).__name__}: {err}") from err
        if not isinstance(out, torch.Tensor):
            returned = f"in {mode} mode the model returns a {type(out).__name__}"
            raise ModelError(f"model.name {name!r}: {returned}, not a tensor of logits ({_AUX})")
        if tuple(out.shape) != expected:
            raise ModelError(
                f"model.name {name!r}: in {mode} mode the model returns "
                f"{tuple(out.shape)} for 2 samples; expected logits of shape "
                f"{expected}, one per " + ("position and token id" if tokens else "class")
            )
    if channels_last and not tokens:
        place(model, torch.device("cpu"), True, move=False)  # a no-op without convolutions
        try:
            with torch.no_grad():
                model(torch.zeros(2, *shape))
        except Exception as err:
            why = f"its forward fails in {_CHANNELS_LAST} ({type(err).__name__}: {err})"
            raise ModelError(f"model.name {name!r}: {why}; {_VIEW_FIX}") from err
    return count_parameters(model)


_AUX = "a model with auxiliary outputs: switch them off in model.kwargs, e.g. aux_logits: false"
_CHANNELS_LAST = (
    "the channels_last layout that train.channels_last: true gives models with convolutions"
)
_VIEW_FIX = (
    "in the model use .reshape() or torch.flatten() where it calls .view() on a convolution's "
    "output, or set train.channels_last: false"
)


def mlp(in_features: int, hidden: list[int], num_classes: int) -> nn.Module:
    """The DDP tutorial's MLP (784-200-200-10 on 28x28), sized to the input."""
    layers: list[nn.Module] = [nn.Flatten()]
    for width in hidden:
        layers += [nn.Linear(in_features, width), nn.ReLU(inplace=True)]
        in_features = width
    layers.append(nn.Linear(in_features, num_classes))
    return nn.Sequential(*layers)


def small_cnn(in_channels: int, width: int, num_classes: int) -> nn.Module:
    """Two conv blocks + global average pooling: input-size agnostic, fast on CPU."""

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [
            nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        ]

    return nn.Sequential(
        *block(in_channels, width),
        *block(width, width),
        nn.MaxPool2d(2),
        *block(width, 2 * width),
        *block(2 * width, 2 * width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, num_classes),
    )


def small_resnet(name: str, in_channels: int, num_classes: int) -> nn.Module:
    """torchvision's ResNet with the CIFAR stem: a 3x3 stride-1 first conv and no max-pool,
    since the ImageNet stem would shrink a 32x32 image to 8x8 before the first block."""
    import torchvision

    model = getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def place(model: nn.Module, device: torch.device, channels_last: bool, move=True) -> nn.Module:
    """Move the model to its device; convolutional models in channels_last: cuDNN and oneDNN
    then pick their NHWC kernels (the inputs follow the weights' layout; on a CPU mostly
    faster, not for ResNets on tiny images: bench/layout.py). move=False (strategy
    fsdp): the model stays in host memory, and fully_shard moves it block by block, already
    sharded, so that the whole model never has to fit on one device."""
    if move:
        model = model.to(device)
    has_conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    if channels_last and has_conv:
        model = model.to(memory_format=torch.channels_last)
    return model


def from_checkpoint(checkpoint: dict, device: torch.device, channels_last: bool) -> nn.Module:
    """The trained model of a model.pt (its weights_only dict), placed, in eval mode."""
    model = build_model(checkpoint["model"], checkpoint["shape"], checkpoint["num_classes"])
    model.load_state_dict(checkpoint["state_dict"])
    return place(model, device, channels_last).eval()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
