"""model.name: gpt, the built-in language model: a decoder-only transformer as nanoGPT writes
it (pre-LayerNorm blocks, causal scaled_dot_product_attention, GELU MLP, learned positions,
the output layer tied to the token embedding), sized by model.kwargs with nanoGPT's names:

    model: {name: gpt, kwargs: {n_layer: 4, n_head: 4, n_embd: 128, dropout: 0.0}}

Each GPTBlock is one unit of FSDP2 sharding and activation checkpointing
(ddpflow.training.sharding.BLOCK_TYPES). Input: token ids [B, T] (T <= block_size); output:
logits [B, T, vocab_size]. Decoding passes a KVCache (ddpflow.training.kvcache, from
GPT.new_cache) to forward: the positions it holds are not computed again; training passes
none, and its forward is unchanged."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ddpflow.training.kvcache import KVCache, LayerCache

DEFAULTS = {"n_layer": 4, "n_head": 4, "n_embd": 128, "dropout": 0.0, "bias": True}


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head, self.dropout = n_head, dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        b, t, c = x.shape
        qkv = self.qkv(x)
        # this rank's share of the heads: all of them, or 1/N under tensor parallelism
        # (ddpflow.training.tensor_parallel), where qkv holds the same heads of q, k and v
        local = qkv.shape[-1] // 3
        heads = self.n_head * local // c
        q, k, v = (
            part.view(b, t, heads, local // heads).transpose(1, 2)
            for part in qkv.split(local, dim=2)
        )
        if cache is None:
            drop = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        else:  # decoding (eval mode: no dropout)
            y = cache.attend(q, k, v)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, t, local)))


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

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache)
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
        self.n_head, self.n_embd = n_head, n_embd
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

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] of token ids [B, T]; with a cache, the ids continue the
        positions it holds (and are held after the call)."""
        start = 0
        if cache is not None:
            cache.check_room(idx.shape[1])
            start = cache.length
        positions = torch.arange(start, start + idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for i, block in enumerate(self.blocks):
            x = block(x) if cache is None else block(x, cache.layer(i))
        if cache is not None:
            cache.advance(idx.shape[1])
        return self.head(self.ln_f(x))

    def new_cache(self, batch: int = 1) -> KVCache:
        """An empty KV cache with room for block_size positions, on the weights' device."""
        weight = self.wte.weight
        return KVCache(
            len(self.blocks),
            self.n_head,
            self.n_embd // self.n_head,
            self.block_size,
            batch=batch,
            device=weight.device,
            dtype=weight.dtype,
        )


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
    cache: bool = True,
) -> list[int]:
    """Sample new_tokens after prompt, from a generator seeded with `seed` (the same tokens
    on every rank and at every world size, for the same weights); temperature 0 takes the
    most likely token (no draw). The context is the last block_size tokens. cache: a GPT
    keeps its keys and values (KVCache) while the context fits in block_size, the same
    tokens as computing the whole context at every step (up to float rounding) at a
    fraction of the work; once it is longer, every step reads its last block_size tokens
    anew (the learned positions shift). Another model (a plug-in) always reads the whole
    context. Collective under FSDP: every rank calls it."""
    if not prompt:
        raise ValueError("generate: the prompt is empty; give at least one token")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    held = model.new_cache() if cache and isinstance(model, GPT) else None
    tokens = list(prompt)
    for _ in range(new_tokens):
        logits = _next_logits(model, tokens, block_size, held, device)
        tokens.append(_draw(logits, temperature, top_k, generator))
    model.train(was_training)
    return tokens[len(prompt) :]


def _next_logits(model, tokens: list[int], block_size: int, held: KVCache | None, device):
    """The logits of the token after `tokens`: from the cache while the context fits in it
    (the positions not yet held are read), else from the last block_size tokens."""
    if held is not None and len(tokens) <= min(held.capacity, block_size):
        new = torch.tensor([tokens[held.length :]], dtype=torch.int64, device=device)
        return model(new, cache=held)[0, -1]
    idx = torch.tensor([tokens[-block_size:]], dtype=torch.int64, device=device)
    return model(idx)[0, -1]


def _draw(logits: torch.Tensor, temperature: float, top_k: int | None, generator) -> int:
    """The next token: the most likely at temperature 0, else a draw from the generator
    among the top_k most likely (None: all), their logits divided by temperature."""
    if temperature == 0:
        return int(logits.float().argmax())
    logits = logits.float().cpu() / temperature
    if top_k is not None:
        cut = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits[logits < cut] = -float("inf")
    return int(torch.multinomial(logits.softmax(dim=0), 1, generator=generator))


PROMPT_TOKENS = 32  # the prompt: the validation split's first tokens (at most block_size)
NEW_TOKENS = 200
SAMPLES = 3


def text_samples(model: nn.Module, data, seed: int, every_rank: bool, is_master: bool):
    """A few continuations of a fixed prompt (the validation split's first PROMPT_TOKENS
    tokens), sampled with seeds seed, seed + 1, ..., decoded by the data's tokenizer (for
    data.source text: data.tokenizer, ddpflow.data.tokenizer); None for token data or on a
    rank that does not record them. every_rank: the model's forward is a collective (FSDP),
    so every rank samples too."""
    if data.manifest.get("source") != "text" or not (every_rank or is_master):
        return None
    block = int(data.manifest["block_size"])
    prompt = [int(t) for t in data.val.inputs.tokens[: min(PROMPT_TOKENS, block)]]

    def text(tokens: list[int]) -> str:
        decoded = data.tokenizer.decode(tokens)
        # control characters (NUL, escapes) shown as U+FFFD: the text goes into the report
        return "".join(c if c in "\n\t" or c.isprintable() else "\ufffd" for c in decoded)

    samples = [
        {
            "seed": seed + k,
            "text": text(generate(model, prompt, NEW_TOKENS, block, seed + k, cache=False)),
        }
        for k in range(SAMPLES)
    ]
    return {"prompt": text(prompt), "new_tokens": NEW_TOKENS, "samples": samples}
