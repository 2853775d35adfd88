"""Models: the tutorials' MLP, a small CNN, and torchvision ResNets adapted to small images."""

from __future__ import annotations

import torch
from torch import nn


def build_model(model_cfg: dict, shape: list[int], num_classes: int) -> nn.Module:
    """shape is the staged [C, H, W]; the model adapts its input layer to it."""
    name = model_cfg["name"]
    channels, height, width = shape
    if name == "mlp":
        return mlp(channels * height * width, model_cfg["mlp_hidden"], num_classes)
    if name == "cnn":
        return small_cnn(channels, model_cfg["cnn_channels"], num_classes)
    if name in ("resnet18", "resnet34"):
        return small_resnet(name, channels, num_classes)
    raise ValueError(f"model.name: unknown model {name!r}")


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


def place(model: nn.Module, device: torch.device, channels_last: bool) -> nn.Module:
    """Move the model to its device; on CUDA, convolutional models in channels_last (cuDNN
    then picks NHWC kernels and the inputs follow the weights' layout)."""
    model = model.to(device)
    has_conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    if device.type == "cuda" and channels_last and has_conv:
        model = model.to(memory_format=torch.channels_last)
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def forward_flops(model: nn.Module, shape: list[int]) -> int:
    """Forward FLOPs of one sample (2 x multiply-adds), counted by torch's FLOP counter."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    was_training = model.training
    model.eval()
    with counter:
        model(torch.zeros(1, *shape))
    model.train(was_training)
    return int(counter.get_total_flops())
