"""How a rank reads its data: in memory, or streamed from the staged shards.

`data.loading.in_memory` picks the path (auto: in memory if the splits the rank uses fit
`memory_budget_gb`). Both give every rank exactly the same samples in the same order (its
micro-batches of schedule.step_micro_batches), as the same uint8 values, so a run trains to
bitwise the same weights on either path, and resumes mid-epoch exactly on either.

* in memory: each split a uint8 tensor on the device; a batch is one index_select.
* streamed: the train split read batch by batch by DataLoader workers (positional reads from
  the shards, pinned memory, prefetching), copied to the device without blocking; validation
  and test read contiguous ranges as they are scored. Labels are always in memory (8 bytes
  per sample).

Augmentation (train.augment) is applied to the uint8 batch on the device, whichever path
delivered it: random crop with zero padding and horizontal flip, drawn from (seed, epoch,
step, micro-batch) alone: the same whichever rank computes the micro-batch.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ddpflow.data.staged import MANIFEST, DataError, StagedImages, read_manifest, verify_staged
from ddpflow.runtime import replace_dir

if TYPE_CHECKING:  # the rank's environment; imported where it runs (node_local_copy)
    from ddpflow.cluster.distenv import DistEnv
    from ddpflow.config.typed import TrainAugmentSpec

log = logging.getLogger(__name__)


class StreamedImages:
    """A split (or a contiguous part of one) read from the shards on demand, looking enough
    like the in-memory uint8 tensor for evaluation: shape, device, slicing (a lazy view) and
    rows(start, stop) (a tensor on the device)."""

    def __init__(self, staged: StagedImages, device, start: int = 0, stop=None):
        self.staged, self.device = staged, torch.device(device)
        self.start = start
        self.stop = len(staged) if stop is None else stop

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.stop - self.start, *self.staged.sample_shape)

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key):
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("streamed images take contiguous slices only; use rows()")
        start, stop, _ = key.indices(len(self))
        return StreamedImages(self.staged, self.device, self.start + start, self.start + stop)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        stop = min(stop, len(self))
        array = self.staged.read(self.start + start, self.start + stop)
        return _to_device(torch.from_numpy(array), self.device)


def rows(images, start: int, stop: int) -> torch.Tensor:
    """images[start:stop] as a tensor on its device, for in-memory and streamed splits (and a
    language model's token windows, ddpflow.data.windows.TokenBlocks)."""
    if isinstance(images, torch.Tensor):
        return images[start:stop]
    return images.rows(start, stop)


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x


class _Batches(torch.utils.data.Dataset):
    """Item i of the DataLoader's sampler is one whole batch: its index array in, its uint8
    images out (one positional read per image, in the sampler's order)."""

    def __init__(self, staged: StagedImages):
        self.staged = staged

    def __len__(self) -> int:
        return len(self.staged)

    def __getitem__(self, indices) -> torch.Tensor:
        return torch.from_numpy(self.staged.gather(indices))


class _EpochBatches(torch.utils.data.Sampler):
    """The current epoch's remaining batches, set before each epoch: the DataLoader's workers
    persist across epochs, the sampler (iterated in the rank itself) changes."""

    def __init__(self):
        self.batches: list[np.ndarray] = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class MemoryFeed:
    """Batches by index_select from the split held on the device (a plain gather, ~5x
    cheaper than advanced indexing per batch)."""

    streamed = False

    def __init__(self, images: torch.Tensor):
        self.images = images

    def epoch(self, batches: torch.Tensor, start: int, epoch: int = 0) -> Iterator[torch.Tensor]:
        """The uint8 batches of rows start.. of batches (a micro-batch's indices per row);
        the images are the same every epoch (a token feed's windows may not be)."""
        for index in range(start, len(batches)):
            yield self.images.index_select(0, batches[index])

    def close(self) -> None:
        pass


class StreamFeed:
    """Batches read from the shards by DataLoader workers, ahead of the training step."""

    streamed = True

    def __init__(self, staged: StagedImages, device, workers: int, prefetch: int):
        self.device = torch.device(device)
        self.sampler = _EpochBatches()
        self.loader: torch.utils.data.DataLoader | None = torch.utils.data.DataLoader(
            _Batches(staged),
            batch_size=None,  # each sampled item is a whole batch
            sampler=self.sampler,
            num_workers=workers,
            pin_memory=self.device.type == "cuda",
            prefetch_factor=prefetch if workers else None,
            persistent_workers=workers > 0,
        )

    def epoch(self, batches: torch.Tensor, start: int, epoch: int = 0) -> Iterator[torch.Tensor]:
        assert self.loader is not None, "the feed was closed"
        self.sampler.batches = [b.cpu().numpy() for b in batches[start:]]
        for x in self.loader:
            yield x.to(self.device, non_blocking=True)

    def close(self) -> None:
        # persistent workers end with the loader's iterator; drop it now, not at exit
        self.loader = None


def augment(x: torch.Tensor, cfg: TrainAugmentSpec, draws: int, part=(0, 1)):
    """Random crop (zero padding cfg.crop_padding each side, then a crop back to size) and
    horizontal flip of a uint8 [B, C, H, W] batch, in one gather on its device. The draws
    come from the micro-batch's seed `draws` alone (schedule.micro_batch_seed: seed, epoch,
    step, micro-batch): a resumed run, or one at another world size, draws what the
    uninterrupted one drew, on any path and device. part (index, of): x is that part of a
    normalisation batch `of` times its size (train.norm_batch_size held by a group of ranks):
    the draws are the whole batch's, sliced, as one rank computing all of it draws them."""
    if not cfg.enabled or x.shape[0] == 0:
        return x
    n, _, height, width = x.shape
    index, parts = part
    mine = slice(index * n, (index + 1) * n)
    pad = cfg.crop_padding
    generator = torch.Generator().manual_seed(draws)
    offsets = torch.randint(0, 2 * pad + 1, (n * parts, 2), generator=generator)[mine]
    if cfg.horizontal_flip:
        flips = (torch.rand(n * parts, generator=generator) < 0.5)[mine]
    else:
        flips = torch.zeros(n, dtype=torch.bool)
    if pad == 0 and not flips.any():
        return x
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad)) if pad else x
    across = torch.arange(width)
    cols = offsets[:, 1:2] + torch.where(flips[:, None], width - 1 - across, across)  # [n, W]
    rows_ = offsets[:, 0:1] + torch.arange(height)  # [n, H]
    # one gather over the flattened padded image: the result is plain NCHW (a permuted
    # result would look channels_last to the convolutions and change their kernels)
    flat = (rows_[:, :, None] * padded.shape[3] + cols[:, None, :]).view(n, 1, height * width)
    flat = flat.to(x.device).expand(n, x.shape[1], height * width)
    return padded.flatten(2).gather(2, flat).view(n, x.shape[1], height, width)


def node_local_copy(staged: str, target_root: str, env: DistEnv) -> str:
    """The staged directory copied to target_root (expanded on this node) by local rank 0 of
    each node, verified shard by shard; a verified copy already there is reused. Every rank
    returns the copy's path once every node has one (collective: all ranks call it)."""
    from ddpflow.cluster.distenv import any_rank

    root = Path(os.path.expandvars(os.path.expanduser(target_root)))
    source = Path(staged)
    target = root / source.name
    failed = False
    if env.local_rank == 0:
        try:
            began = time.perf_counter()
            reused = _copy_verified(source, target)
            done = "reused the verified copy" if reused else "copied to"
            took = time.perf_counter() - began
            log.info(
                "node-local data on %s: %s %s in %.1f s", socket.gethostname(), done, target, took
            )
        except (OSError, DataError) as exc:
            where = f"rank {env.rank} on {socket.gethostname()}"
            copy = f"could not copy the staged data to data.loading.node_local_dir {root}"
            log.error("%s: %s: %s", where, copy, exc)
            failed = True
    if any_rank(env.processes, failed):
        raise DataError(
            f"the staged data could not be copied to data.loading.node_local_dir {target_root} "
            "on at least one node (its rank's log names the host and cause); fix the path "
            "or set node_local_dir: null to read the staged data where it is"
        )
    return str(target)


VERIFIED = ".verified"


def _copy_verified(source: Path, target: Path) -> bool:
    """True if target already is a copy of source (same manifest) and verifies, else copy,
    verify and rename it into place (a crashed copy leaves only a temporary sibling, never a
    partial target). Either way every file's sha256 was checked on this node."""
    manifest = (source / MANIFEST).read_bytes()
    marker = target / VERIFIED
    if marker.is_file() and marker.read_bytes() == manifest:
        try:  # a copy of this very staging: hashed again (node-local disks fail too)
            verify_staged(target)
            return True
        except DataError as exc:
            log.warning("the node-local copy %s is damaged (%s); copying it again", target, exc)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.copy-", dir=target.parent))
    try:
        for name in [*read_manifest(source)["files"], MANIFEST]:
            shutil.copyfile(source / name, tmp / name)
        verify_staged(tmp)
        (tmp / VERIFIED).write_bytes(manifest)
        replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return False
