"""Text to a staged language-model dataset's token ids and back, as its manifest says they
were made: what `snakemake generate` encodes its prompts with and decodes its completions
with (ddpflow.generate, ddpflow.training.generate_ranks). Imports no torch.

    codec = codec_for(manifest, staged_dir)
    ids = codec.encode("def load(")          # ValueError: text it cannot encode, and why
    text = codec.decode(ids)

- data.source text: the run's tokenizer (data.tokenizer: bytes, bpe or a tokenizer.json;
  ddpflow.data.tokenizer.load, the one seam samples decode with too).
- data.source tokens (your own tokenizer's ids, no tokenizer here): a prompt is its token
  ids, separated by spaces, and a completion is written the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from ddpflow.data import tokenizer


class Codec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class IdCodec:
    """Token ids written as numbers: data.source tokens carries no tokenizer."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(word) for word in text.split()]
        except ValueError:
            raise ValueError(
                "the run's data is token ids (data.source: tokens): write a prompt as its "
                "token ids separated by spaces"
            ) from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"token id {bad[0]} is outside the vocabulary (data.vocab_size "
                f"{self.vocab_size}: ids 0 to {self.vocab_size - 1})"
            )
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)


def codec_for(manifest: dict, staged_dir: str | Path) -> Codec:
    """The codec of a staged token dataset (its manifest.json, read): its tokenizer for
    text, token ids as numbers for token data."""
    if manifest.get("source") == "text":
        return tokenizer.load(staged_dir, manifest)
    return IdCodec(int(manifest["vocab_size"]))
