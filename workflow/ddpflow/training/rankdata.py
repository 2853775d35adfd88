"""A rank's data: the splits its job uses (in memory or streamed from the staged shards), the
feed that serves the training batches, and what the staged manifest says about them.
load_data builds it, checked against the manifest first."""

from __future__ import annotations

import functools
import logging
import socket
from dataclasses import dataclass, field

import torch

from ddpflow.checks.weight_files import input_normalisation
from ddpflow.cluster import distenv
from ddpflow.cluster.distenv import DistEnv
from ddpflow.config.typed import RunSpec
from ddpflow.data import feed, tokenizer
from ddpflow.data.staged import DataError, choose_in_memory, open_split, read_manifest
from ddpflow.data.text import open_tokens
from ddpflow.data.tokenizer import ByteLevelBPE, ByteTokenizer
from ddpflow.data.windows import TokenBlocks, TokenFeed
from ddpflow.task import DEFAULT_TASK, Task, get_task, run_task
from ddpflow.training.evaluate import Scoring
from ddpflow.training.schedule import window_offset
from ddpflow.words import counted

log = logging.getLogger(__name__)


@dataclass
class Split:
    """One split's samples: the model's inputs (images uint8 [n, C, H, W]: a tensor on the
    device, or feed.StreamedImages reading the staged shards; a language model's TokenBlocks)
    and their targets on the device, as the task stages them (classification: int64 [n];
    multilabel: uint8 [n, K]; regression: float32 [n, K]; language model: none, [n, 0])."""

    inputs: torch.Tensor | feed.StreamedImages | TokenBlocks
    labels: torch.Tensor


@dataclass
class RankData:
    """What a rank trains and scores on (load_data; tests build one from tensors)."""

    splits: dict[str, Split]  # by split name: train, val, and the eval split where loaded
    norm: tuple[torch.Tensor, torch.Tensor]  # the train split's mean, std: [1, C, 1, 1]
    num_classes: int
    shape: list[int]  # one image's [C, H, W]
    # the training batches (feed.MemoryFeed or feed.StreamFeed); None until Loop makes a
    # MemoryFeed over train's inputs (tensors given directly) or where no train split is
    feed: feed.MemoryFeed | feed.StreamFeed | TokenFeed | None = None
    manifest: dict = field(default_factory=dict)  # the staged data's manifest.json
    in_memory: bool = True  # the splits loaded whole (else streamed)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    task: Task = field(default_factory=get_task)  # what the targets are (ddpflow.task)
    tokens: bool = False  # a language model's token windows (ddpflow.data.windows), not images
    # text: the tokenizer of its ids (ddpflow.data.tokenizer): samples decode with it, and
    # its bytes per id count the bytes that bits per byte divides by
    tokenizer: ByteTokenizer | ByteLevelBPE | None = None

    @property
    def task_manifest(self) -> dict:
        """The manifest as the task reads it (tests' data has none: the class count only),
        with the tokenizer's bytes per id for text."""
        found = {**self.manifest, "num_classes": self.num_classes}
        if self.tokenizer is not None:
            found["token_bytes"] = self.tokenizer.token_bytes()
        return found

    def scoring(self, batch_size: int, autocast=None, stride: int | None = None) -> Scoring:
        """How this data's splits are scored (evaluate.evaluate_split); stride: a language
        model's sliding windows (eval.stride; None: non-overlapping, training's validation)."""
        return Scoring(
            self.task, self.task_manifest, self.norm, batch_size, autocast, self.tokens, stride
        )

    @property
    def train(self) -> Split:
        return self.splits["train"]

    @property
    def val(self) -> Split:
        return self.splits["val"]

    def split(self, name: str) -> Split:
        return self.splits[name]


def load_data(run: RunSpec, staged: str, env: DistEnv, device, splits=("train", "val")) -> RankData:
    """The splits this job uses, in memory or streamed (data.loading; feed.py), each checked
    against the manifest first (sha256 of every file: bad data fails before the work).
    data.loading.node_local_dir: read from a per-node copy (one rank per node copies it)."""
    loading = run.data.loading
    verify = env.local_rank == 0  # one rank per node hashes the files, the others check sizes
    if loading.node_local_dir:  # the copy was verified as it was made or reused
        staged, verify = feed.node_local_copy(staged, loading.node_local_dir, env), False
    task = run_task(run)
    if read_manifest(staged).get("kind") == "tokens":
        return _token_data(run, staged, env, device, splits, verify, task)
    opened = _open_verified(staged, splits, env, lambda split: open_split(staged, split, verify))
    manifest = next(iter(opened.values()))[2]
    staged_task = manifest.get("task", DEFAULT_TASK)
    if staged_task != task.name:
        mismatch = f"staged for task {staged_task}, the run's task is {task.name}"
        raise DataError(f"{staged}: {mismatch}; delete {staged} and restage")
    nbytes = sum(images.nbytes for images, _, _ in opened.values())
    in_memory, why = choose_in_memory(run, nbytes)
    data = RankData(
        splits={
            s: _split(images, labels, in_memory, device)
            for s, (images, labels, _) in opened.items()
        },
        norm=normalisation(manifest, device, run.resolved["model"]),
        num_classes=manifest["num_classes"],
        shape=manifest["shape"],
        manifest=manifest,
        in_memory=in_memory,
        device=device,
        task=task,
    )
    train = data.train.inputs if "train" in opened else None
    if isinstance(train, torch.Tensor):
        data.feed = feed.MemoryFeed(train)
    elif train is not None:  # streamed from the staged shards
        data.feed = feed.StreamFeed(opened["train"][0], device, loading.workers, loading.prefetch)
    if env.is_master:
        workers = counted(loading.workers, "DataLoader worker")
        ahead = counted(loading.prefetch, "batch", "batches")
        streamed = f"streamed from {staged} ({workers} per rank, {ahead} ahead each)"
        log.info("data %s: %s (%s)", "+".join(opened), "in memory" if in_memory else streamed, why)
    return data


def _token_data(run: RunSpec, staged: str, env: DistEnv, device, splits, verify, task) -> RankData:
    """A language model's splits: token windows read by memory map (never loaded whole),
    checked against the manifest first (ddpflow.data.text); under train.fresh_windows the
    training blocks start at the epoch's offset (ddpflow.data.windows)."""
    manifest = read_manifest(staged)
    block, fresh = manifest["block_size"], run.train.fresh_windows

    def opened(split: str) -> Split:
        tokens = open_tokens(staged, split, manifest, verify)
        train = split == "train"
        blocks = TokenBlocks(tokens, block, not train, device, fresh=fresh and train)
        return Split(blocks, torch.empty((len(blocks), 0), device=device))

    found = _open_verified(staged, splits, env, opened)
    made = None
    if manifest.get("source") == "text":  # its tokenizer, checked as the splits are
        loaded = _open_verified(
            staged, ("tokenizer",), env, lambda _: tokenizer.load(staged, manifest, verify)
        )
        made = loaded["tokenizer"]
    one = torch.zeros(1, device=device)
    data = RankData(
        splits=found,
        norm=(one, one),
        num_classes=manifest["num_classes"],
        shape=manifest["shape"],
        manifest=manifest,
        in_memory=False,
        device=device,
        task=task,
        tokens=True,
        tokenizer=made,
    )
    if "train" in found:
        assert isinstance(found["train"].inputs, TokenBlocks)
        offsets = functools.partial(window_offset, run.train.seed, block=block) if fresh else None
        data.feed = TokenFeed(found["train"].inputs, offsets)
    if env.is_master:
        counts = ", ".join(f"{s} {manifest['tokens'][s]:,}" for s in found)
        log.info(
            "data %s: tokens by memory map (%s tokens; block_size %d%s)",
            "+".join(found),
            counts,
            block,
            "; fresh windows each epoch" if fresh else "",
        )
    return data


def _open_verified(staged: str, splits, env: DistEnv, open_one) -> dict:
    """Each split once (eval.split may be val), opened and checked by open_one(split); a
    check that failed on any rank fails every rank (no rank trains on bad data)."""
    opened, failed = {}, None
    try:
        for split in dict.fromkeys(splits):
            opened[split] = open_one(split)
    except DataError as exc:
        log.error("rank %d on %s: %s", env.rank, socket.gethostname(), exc)
        failed = exc
    if distenv.any_rank(env.processes, failed is not None):
        raise failed or DataError(
            f"the staged data {staged} failed its check on another rank (its log names the "
            "file); delete it and restage"
        )
    return opened


def _split(images, labels, in_memory: bool, device) -> Split:
    x: torch.Tensor | feed.StreamedImages
    if in_memory:
        x = torch.from_numpy(images.load()).to(device)
        images.close()
    else:
        x = feed.StreamedImages(images, device)
    return Split(x, torch.from_numpy(labels).to(device))


def normalisation(manifest: dict, device, model: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel mean and std the model's inputs are normalised with, shaped
    [1, C, 1, 1] on device: the train split's, or torchvision weights' own
    (checks.weight_files.input_normalisation)."""
    mean, std, _ = input_normalisation(model, manifest)
    shape = [1, len(mean), 1, 1]
    return (
        torch.tensor(mean, device=device).view(shape),
        torch.tensor(std, device=device).view(shape),
    )
