"""The peer of bench/lm.py: a language model's training loop as nanoGPT's train.py runs it,
written for the benchmark (no nanoGPT code is copied or imported).

Per optimizer step (one micro-batch per rank, no gradient accumulation):

    lr into every param group (warmup + cosine, set by hand each iteration)
    with autocast (bf16) or nothing (fp32):
        logits = model(x); loss = F.cross_entropy(logits.view(-1, V), y.view(-1))
    x, y = get_batch()          # the next batch, drawn right after the forward
    loss.backward()             # DDP all-reduces the gradients when there are 2+ ranks
    optimizer.step(); optimizer.zero_grad(set_to_none=True)
    loss.item() every log_interval steps on rank 0 (nanoGPT's logging)

get_batch: B random offsets into the token array (a memory map of the split), each row
tokens[i : i + T] and its next tokens [i + 1 : i + T + 1] copied to int64 and stacked; on
CUDA pinned and copied non-blocking (nanoGPT opens the memory map anew for every batch;
here it is opened once, which can only favour this loop). The model is wrapped in DDP at
world size > 1 only (a single process trains it bare, as nanoGPT's train.py does without
torchrun). AdamW's fused kernel on CUDA only (nanoGPT's configure_optimizers), its default
implementation elsewhere unless `fused` says otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What nanoGPT's train.py reads from its config: `batch` rows of `block` tokens per rank
    and step, `steps` per epoch, AdamW (lr x lr_factor(step), betas, weight decay; its fused
    kernel where `fused`, None: on CUDA only), the precision, the logging interval."""

    block: int
    batch: int
    steps: int
    lr: float
    lr_factor: Callable[[int], float]
    betas: tuple[float, float]
    weight_decay: float
    precision: str
    fused: bool | None = None
    log_interval: int = 10


class NanoGPTLoop:
    """The loop over `tokens` (uint16/uint32 [n], a memory map) for `model` on `device`, as
    `recipe` says; epoch() runs `recipe.steps` iterations."""

    def __init__(
        self,
        model: nn.Module,
        tokens: np.ndarray,
        recipe: Recipe,
        device: torch.device,
        world_size: int,
        seed: int,
        master: bool = True,
    ):
        self.tokens, self.block, self.batch = tokens, recipe.block, recipe.batch
        self.steps = recipe.steps
        self.device, self.world_size, self.log_interval = device, world_size, recipe.log_interval
        self.master = master  # logs the loss (nanoGPT's master_process)
        self.lr, self.lr_factor = recipe.lr, recipe.lr_factor
        self.raw = model.to(device)
        self.model = DDP(self.raw) if world_size > 1 else self.raw
        fused = device.type == "cuda" if recipe.fused is None else recipe.fused
        adamw = {"lr": recipe.lr, "betas": tuple(recipe.betas), "weight_decay": recipe.weight_decay}
        self.optimizer = torch.optim.AdamW(
            self.raw.parameters(), **adamw, **({"fused": True} if fused else {})
        )
        self.ctx = (
            torch.autocast(device.type, dtype=torch.bfloat16)
            if recipe.precision == "bf16"
            else contextlib.nullcontext()
        )
        # each rank its own draws (nanoGPT seeds 1337 + rank); a generator of its own, so
        # that another loop in the process reseeding the global one changes nothing here
        self.generator = torch.Generator().manual_seed(1337 + seed)
        self.iter_num = 0
        self.x, self.y = self.get_batch()

    def get_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        data, block = self.tokens, self.block
        ix = torch.randint(len(data) - block, (self.batch,), generator=self.generator).tolist()
        x = torch.stack([torch.from_numpy(data[i : i + block].astype(np.int64)) for i in ix])
        y = torch.stack(
            [torch.from_numpy(data[i + 1 : i + 1 + block].astype(np.int64)) for i in ix]
        )
        if self.device.type == "cuda":
            x, y = (t.pin_memory().to(self.device, non_blocking=True) for t in (x, y))
        return x, y

    def epoch(self) -> dict:
        """`steps` optimizer steps; the tokens all ranks trained on, the logged losses and
        the last step's loss (read once the repeat is over)."""
        self.model.train()
        logged = []
        for _ in range(self.steps):
            lr = self.lr * self.lr_factor(self.iter_num)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            with self.ctx:
                logits = self.model(self.x)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), self.y.view(-1))
            self.x, self.y = self.get_batch()
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.master and self.iter_num % self.log_interval == 0:
                logged.append(loss.item())
            self.iter_num += 1
        tokens = self.steps * self.batch * self.block * self.world_size
        return {"samples": tokens, "logged_losses": logged, "last_loss": loss.item()}
