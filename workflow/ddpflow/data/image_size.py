"""data.image_size for your own images (an image folder, PIL images from a plug-in): each
image resized and centre-cropped to it, and those smaller than it counted, then upscaled,
skipped or refused as data.on_small says."""

from __future__ import annotations

import logging

import numpy as np

from ddpflow.data.raw import DataError
from ddpflow.words import counted

log = logging.getLogger(__name__)
SHOWN = 5  # file names listed in a message before "and N more"


class SmallImages:
    """The images smaller than data.image_size, per split: counted while staging reads them,
    told once when it is done (data.on_small: upscale or skip), or refused (error)."""

    def __init__(self, cfg: dict, where: str = "image_folder"):
        from ddpflow.config import on_small

        self.on_small, self.where = on_small(cfg), where
        self.height, self.width = cfg["image_size"]
        self.small: dict[str, list[str]] = {}  # split -> "path (WxH)" of each small image
        self.fits: dict[str, list[float]] = {}  # split -> min(h / H, w / W) of each image

    def count(self, split: str, name: str, size: tuple[int, int]) -> bool:
        """Count an image of size (width, height) read for split; whether it is small."""
        width, height = size
        fit = min(height / self.height, width / self.width)
        self.fits.setdefault(split, []).append(fit)
        if fit < 1:
            self.small.setdefault(split, []).append(f"{name} ({width}x{height})")
        return fit < 1

    def names(self) -> list[str]:
        return [name for names in self.small.values() for name in names]

    def refusal(self) -> str | None:
        """Why staging stops (data.on_small: error and images smaller than image_size)."""
        names = self.names()
        if not (names and self.on_small == "error"):
            return None
        return (
            f"{counted(len(names), 'image')} smaller than data.image_size [{self.height}, "
            f"{self.width}] (width x height shown): {some_names(names)}; set data.on_small: "
            "upscale to resize them up (or skip to leave them out; both are counted in "
            "the manifest), lower data.image_size, or remove them"
        )

    def tell(self) -> None:
        """Refuse them (error), or say once how many were upscaled or skipped, and warn for
        each split where they were more than half: a smaller image_size would suit it."""
        refusal = self.refusal()
        if refusal:
            raise DataError(refusal)
        names = self.names()
        if not names:
            return
        seen = sum(len(fits) for fits in self.fits.values())
        small = f"{len(names):,} of {seen:,} images were smaller than {self._size()}"
        done = f"were {self._done()} (data.on_small: {self.on_small})"
        log.info("%s: %s and %s: %s", self.where, small, done, some_names(names))
        mostly = [s for s, fits in self.fits.items() if len(self.small.get(s, [])) * 2 > len(fits)]
        if mostly:
            log.warning(self._mostly_small(mostly))

    def _mostly_small(self, splits: list[str]) -> str:
        """One warning for the splits where more than half of the images were small."""
        counts = [f"{s} {len(self.small[s]):,} of {len(self.fits[s]):,}" for s in splits]
        # at least half of these images reach image_size scaled by their median fit
        factor = float(np.median([fit for split in splits for fit in self.fits[split]]))
        size = [max(4, int(self.height * factor)), max(4, int(self.width * factor))]
        upscaled = self.on_small == "upscale"
        return (
            f"{self.where}: more than half of the images of a split were smaller than "
            f"{self._size()} and were {self._done()} ({', '.join(counts)})"
            f"{'; upscaling adds pixels, not detail' if upscaled else ''}: consider a smaller "
            f"data.image_size, e.g. {size}, which at least half of them reach"
            f"{'' if upscaled else ', or data.on_small: upscale'}"
        )

    def _size(self) -> str:
        square = self.height == self.width
        return f"{self.width}x{self.height}" + ("" if square else " (width x height)")

    def _done(self) -> str:
        return "upscaled" if self.on_small == "upscale" else "skipped"

    def manifest(self) -> dict:
        """The counts for the manifest and the report's provenance."""
        names = self.names()
        return {
            "on_small": self.on_small,
            "image_size": [self.height, self.width],
            "upscaled_small": len(names) if self.on_small == "upscale" else 0,
            "skipped_small": len(names) if self.on_small == "skip" else 0,
            "small_per_split": {split: len(found) for split, found in self.small.items()},
            "small_files": names[:100],
        }


def fit_image(image, height: int, width: int) -> np.ndarray:
    """Resize (bilinear, antialiased) so the image covers height x width, then centre-crop:
    down, or up for an image smaller than that (data.on_small: upscale)."""
    from PIL import Image

    scale = max(height / image.height, width / image.width)
    size = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
    if size != image.size:
        image = image.resize(size, Image.Resampling.BILINEAR)
    left, top = (image.width - width) // 2, (image.height - height) // 2
    return np.asarray(image.crop((left, top, left + width, top + height)), dtype=np.uint8)


def some_names(items: list[str]) -> str:
    """The first SHOWN items, comma-separated, then "and N more"."""
    more = f" and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more
