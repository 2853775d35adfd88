"""model.name: gpt, the built-in language model: a decoder-only transformer as nanoGPT writes
it (pre-LayerNorm blocks, causal scaled_dot_product_attention, GELU MLP, learned positions,
the output layer tied to the token embedding), sized by model.kwargs with nanoGPT's names:

    model: {name: gpt, kwargs: {n_layer: 4, n_head: 4, n_embd: 128, dropout: 0.0}}

Each GPTBlock is one unit of FSDP2 sharding and activation checkpointing
(ddpflow.training.sharding.BLOCK_TYPES). Input: token ids [B, T] (T <= block_size); output:
logits [B, T, vocab_size]."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

DEFAULTS = {"n_layer": 4, "n_head": 4, "n_embd": 128, "dropout": 0.0, "bias": True}


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head, self.dropout = n_head, dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            part.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
            for part in self.qkv(x).split(c, dim=2)
        )
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class GPTBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd, bias=bias),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd, bias=bias),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
    ):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd {n_embd} is not a multiple of n_head {n_head}")
        self.vocab_size, self.block_size = vocab_size, block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(GPTBlock(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.wte.weight  # weight tying
        self.apply(_init)
        for name, parameter in self.named_parameters():  # GPT-2's scaled residual projections
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(parameter, 0.0, 0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, 0.0, 0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, 0.0, 0.02)


def gpt(vocab_size: int, block_size: int, kwargs: dict) -> GPT:
    unknown = sorted(set(kwargs) - set(DEFAULTS))
    if unknown:  # models.build_model names the key
        raise TypeError(f"{unknown} are not its keys; gpt takes {', '.join(DEFAULTS)}")
    return GPT(vocab_size, block_size, **{**DEFAULTS, **kwargs})


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: list[int],
    new_tokens: int,
    block_size: int,
    seed: int,
    temperature: float = 1.0,
    top_k: int | None = 40,
) -> list[int]:
    """Sample new_tokens after prompt, from a generator seeded with `seed` (the same tokens
    on every rank and at every world size, for the same weights). Collective under FSDP:
    every rank calls it."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.tensor([prompt], dtype=torch.int64, device=device)
    for _ in range(new_tokens):
        logits = model(idx[:, -block_size:])[0, -1].float().cpu() / temperature
        if top_k is not None:
            cut = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits[logits < cut] = -float("inf")
        token = torch.multinomial(logits.softmax(dim=0), 1, generator=generator)
        idx = torch.cat([idx, token.to(device).view(1, 1)], dim=1)
    model.train(was_training)
    return idx[0, len(prompt) :].tolist()


PROMPT_TOKENS = 32  # the prompt: the validation split's first tokens (at most block_size)
NEW_TOKENS = 200
SAMPLES = 3


def text_samples(model: nn.Module, data, seed: int, every_rank: bool, is_master: bool):
    """A few continuations of a fixed prompt (the validation split's first PROMPT_TOKENS
    bytes), sampled with seeds seed, seed + 1, ..., decoded as UTF-8 (for data.source text:
    its tokens are bytes); None for token data or on a rank that does not record them.
    every_rank: the model's forward is a collective (FSDP), so every rank samples too."""
    if data.manifest.get("source") != "text" or not (every_rank or is_master):
        return None
    from ddpflow.data.text import EOD

    block = int(data.manifest["block_size"])
    prompt = [int(t) for t in data.val.inputs.tokens[: min(PROMPT_TOKENS, block)]]

    def text(tokens: list[int]) -> str:
        raw = b"".join(b"\n" if t == EOD else bytes([t]) for t in tokens if t <= EOD)
        decoded = raw.decode("utf-8", errors="replace")
        # control characters (NUL, escapes) shown as U+FFFD: the text goes into the report
        return "".join(c if c in "\n\t" or c.isprintable() else "\ufffd" for c in decoded)

    samples = [
        {"seed": seed + k, "text": text(generate(model, prompt, NEW_TOKENS, block, seed + k))}
        for k in range(SAMPLES)
    ]
    return {"prompt": text(prompt), "new_tokens": NEW_TOKENS, "samples": samples}
