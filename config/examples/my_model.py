"""A worked example of a model plug-in (README: "Your own model").

Copy this file into the directory you run snakemake from and name its factory in
config.yaml:

    cp config/examples/my_model.py .
    model:
      name: "my_model:build"
      kwargs: {width: 48, dropout: 0.1}

ddpflow imports the module on the login node (one CPU forward checks the output shape before
any job is queued) and on every rank, and calls build(input_shape, num_classes, **kwargs):
input_shape is the staged [channels, height, width], and the model must return logits of
shape [batch, num_classes]. Editing this file retrains the runs that use it.
"""

from __future__ import annotations

from torch import nn


def build(input_shape: list[int], num_classes: int, width: int = 32, dropout: float = 0.0):
    channels, height, _ = input_shape
    pool = 2 if height >= 8 else 1  # 8x8 digits -> 4x4 after the first block; 32x32 -> 16x16
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.GELU(),
        nn.MaxPool2d(pool),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.BatchNorm2d(2 * width),
        nn.GELU(),
        nn.AdaptiveAvgPool2d(2),  # any image size -> 2x2
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(8 * width, num_classes),  # the output layer is registered last
    )
