"""The keys and values of the tokens a GPT (ddpflow.training.gpt) has read, kept between calls
so that decoding one more token costs one position's work instead of the whole context's:

    cache = model.new_cache()                  # room for block_size positions
    logits = model(prompt_ids, cache=cache)    # reads the prompt, fills positions 0..P-1
    logits = model(next_id, cache=cache)       # one position: attends to all P + 1

Training never passes a cache: its forward is the one it always was. The buffers are
allocated once, [layers, batch, heads, capacity, head_dim] for keys and for values; a call
writes its positions after those already held and attends to all of them, causally."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache:
    """Keys and values of `length` positions per layer, room for `capacity`."""

    def __init__(
        self,
        layers: int,
        heads: int,
        head_dim: int,
        capacity: int,
        *,
        batch: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        shape = (layers, batch, heads, capacity, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity, self.length = capacity, 0

    def check_room(self, positions: int) -> None:
        """Refuse a call that would hold more than capacity positions (before any work)."""
        if self.length + positions > self.capacity:
            raise ValueError(
                f"the cache holds {self.capacity} positions (the model's block_size); "
                f"{self.length} are filled and {positions} more were given"
            )

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self, index)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Causal attention of q (the call's new positions) to every position held, after k
        and v are written at the new positions ([batch, heads, new, head_dim] each)."""
        start, stop = self.length, self.length + k.shape[2]
        self.keys[layer, :, :, start:stop] = k
        self.values[layer, :, :, start:stop] = v
        keys, values = self.keys[layer, :, :, :stop], self.values[layer, :, :, :stop]
        if start == 0:  # nothing before: the training forward's own causal attention
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True)
        mask = None  # one new position sees every position held
        if stop - start > 1:  # new position i sees positions 0 .. start + i
            seen = torch.arange(stop, device=q.device)
            mask = seen <= torch.arange(start, stop, device=q.device)[:, None]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

    def advance(self, positions: int) -> None:
        """After every layer wrote a call's positions: they are held."""
        self.length += positions


class LayerCache:
    """One layer's view of a KVCache (what a GPTBlock's attention is handed)."""

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache, self.index = cache, index

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.cache.attend(self.index, q, k, v)
