"""A worked example of a data plug-in (README: "Your own data").

Copy this file into the directory you run snakemake from and name its function in
config.yaml:

    cp config/examples/my_data.py .
    data:
      source: "my_data:shapes"
      kwargs: {count: 600, size: 24}

ddpflow imports the module when it stages the data (importable from the working directory or
the environment) and calls shapes(**kwargs). A plug-in returns the training data, or a dict
{"train": ..., "test": ..., "class_names": [...]} (test and class_names optional: without a
test set, one is carved out with data.test_fraction). Each is a map-style Dataset (anything
with __len__ and __getitem__, e.g. a torch.utils.data.Dataset) of (image, label) pairs, where
an image is a PIL image or a uint8 (or 0..1 float) array/tensor [C, H, W] or [H, W], or a pair
(images, labels) of arrays. Staging reads it once into ddpflow's staged format; editing this
file restages and retrains the runs that use it.
"""

from __future__ import annotations

import random

from PIL import Image, ImageDraw

CLASSES = ["circle", "square", "triangle"]


class Shapes:
    """Filled shapes of random size and position on a noisy grey background, drawn on demand:
    a map-style dataset of (PIL image, label)."""

    def __init__(self, count: int, size: int, seed: int):
        self.count, self.size, self.seed = count, size, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        rng = random.Random(self.seed * 1_000_003 + index)  # the same image every time
        label = index % len(CLASSES)
        image = Image.new("L", (self.size, self.size), color=rng.randint(60, 100))
        draw = ImageDraw.Draw(image)
        extent = rng.randint(self.size // 2, self.size - 4)
        x, y = rng.randint(1, self.size - extent - 1), rng.randint(1, self.size - extent - 1)
        box = (x, y, x + extent, y + extent)
        shade = rng.randint(180, 255)
        if CLASSES[label] == "circle":
            draw.ellipse(box, fill=shade)
        elif CLASSES[label] == "square":
            draw.rectangle(box, fill=shade)
        else:
            draw.polygon([(x, y + extent), (x + extent, y + extent), (x + extent // 2, y)],
                         fill=shade)  # fmt: skip
        return image, label


def shapes(count: int = 600, size: int = 24, seed: int = 0) -> dict:
    return {
        "train": Shapes(count, size, seed),
        "test": Shapes(count // 4, size, seed + 1),
        "class_names": CLASSES,
    }
