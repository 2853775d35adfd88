"""task: language_model: next-token prediction on token data (data.source text or tokens,
ddpflow.data.text). The model maps block_size token ids [B, T] to logits [B, T, V]; the
loss is cross-entropy over every position (padding, PAD = -1, ignored). Its metrics come
from sums over every scored position of the split, all-reduced exactly (a float64 loss sum,
int64 token and correct counts), so they do not depend on the world size or the batch:

    loss = sum of -log p(target) / tokens     (nats per token: the token-weighted mean)
    perplexity = exp(loss)                    token_accuracy = correct / tokens
    bits_per_byte = sum of -log p(target) / (ln 2 * bytes)         (text only)

never the mean of per-batch values (a last partial batch would weigh as much as a full one).
bytes: the UTF-8 bytes the scored targets stand for, an int64 sum of the tokenizer's bytes
per id (the manifest's "token_bytes", ddpflow.data.tokenizer): the figure that compares
across tokenizers. The validation perplexity selects (lower is better)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ddpflow.errors import DataError
from ddpflow.task.base import Selection, Task
from ddpflow.task.builtin_views import LanguageModelView

if TYPE_CHECKING:
    from ddpflow.config.typed import TrainSpec

PAD = -1  # ddpflow.data.windows.PAD: a target that is not scored


class LanguageModel(LanguageModelView, Task):
    name = "language_model"
    selection = Selection("val_perplexity", False, "validation perplexity")
    # bits_per_byte: text only (token files carry no bytes): n/a for token data
    headline = ("perplexity", "bits_per_byte", "loss", "token_accuracy")
    reads = "tokens"
    exports = ("safetensors",)  # the traced formats take an image batch
    no_prediction = (
        "is a language model; snakemake predict applies image models to images. Continue "
        "text with snakemake generate (generate.prompts: docs/language-models.md), or name "
        "other runs in predict.runs"
    )

    def stage_targets(self, labels, names, where: str):
        raise DataError(f"task language_model: {where} holds images and labels; it learns "
                        "from data.source text or tokens (docs/language-models.md)")  # fmt: skip

    def outputs(self, manifest: dict) -> int:
        return int(manifest["vocab_size"])

    def loss(self, manifest: dict, train: TrainSpec):
        return NextTokenLoss(train.label_smoothing)

    def new_state(self, manifest: dict, device) -> dict:
        import torch

        def count():
            return torch.zeros((), dtype=torch.int64, device=device)

        state = {
            "loss": torch.zeros((), dtype=torch.float64, device=device),
            "tokens": count(),
            "correct": count(),
            "blocks": count(),
        }
        if manifest.get("token_bytes") is not None:  # text: its tokenizer's bytes per id
            state["bytes"] = count()
            state["_token_bytes"] = torch.as_tensor(
                manifest["token_bytes"], dtype=torch.int64, device=device
            )
        return state

    def update(self, state: dict, outputs, targets) -> None:
        import torch.nn.functional as F

        logits = outputs.float().reshape(-1, outputs.shape[-1])
        flat = targets.reshape(-1)
        scored = flat != PAD
        losses = F.cross_entropy(logits, flat, ignore_index=PAD, reduction="none")
        state["loss"] += losses.double().sum()
        state["tokens"] += scored.sum()
        state["correct"] += ((logits.argmax(dim=1) == flat) & scored).sum()
        state["blocks"] += targets.shape[0]
        if "bytes" in state:  # the UTF-8 bytes of the scored text
            state["bytes"] += state["_token_bytes"][flat[scored]].sum()

    def metrics(self, state: dict, manifest: dict) -> dict:
        tokens = int(state["tokens"])
        loss = float(state["loss"]) / tokens if tokens else 0.0
        found = {
            "loss": loss,
            "perplexity": math.exp(loss) if tokens else None,
            "token_accuracy": int(state["correct"]) / tokens if tokens else 0.0,
            "tokens": tokens,
            "samples_evaluated": int(state["blocks"]),
        }
        if "bytes" in state:  # text: the loss in bits per UTF-8 byte of the scored text
            scored = found["bytes"] = int(state["bytes"])
            bits = float(state["loss"]) / (math.log(2) * scored) if scored else None
            found["bits_per_byte"] = bits
        return found

    def validation(self, metrics: dict) -> dict:
        found = {
            "val_perplexity": metrics["perplexity"],
            "val_loss": metrics["loss"],
            "val_token_accuracy": metrics["token_accuracy"],
        }
        if metrics.get("bits_per_byte") is not None:  # text
            found["val_bits_per_byte"] = metrics["bits_per_byte"]
        return found

    def describe(self, metrics: dict) -> str:
        bits = metrics.get("bits_per_byte")
        return (
            f"perplexity {metrics['perplexity']:.4f}, loss {metrics['loss']:.4f} nats/token, "
            + (f"{bits:.4f} bits/byte, " if bits is not None else "")
            + f"token accuracy {metrics['token_accuracy']:.4f} ({metrics['tokens']:,} tokens)"
        )

    def train_record(self, loop, generated) -> dict:
        """train_summary's "language_model": the block and the vocabulary, the tokens of each
        split and those trained on, the training tokens/s, and for text, `generated`:
        samples from a fixed prompt with fixed seeds (training.gpt), and its tokenizer."""
        data = loop.data
        if not data.tokens:
            return {}
        block, records = int(data.shape[0]), loop.history
        trained = sum(r["samples"] for r in records) * block
        seconds = sum(r["seconds"]["train"] for r in records)
        record = {
            "block_size": block,
            "vocab_size": int(data.num_classes),
            "tokens": data.manifest["tokens"],
            "tokens_trained": trained,
            "tokens_per_s": trained / seconds if seconds else 0.0,
            "generated": generated,
        }
        if "tokenizer" in data.manifest:  # text: which tokenizer (kind, sha256)
            record["tokenizer"] = data.manifest["tokenizer"]
        return {self.train_record_key: record}

    def throughput(self, summary: dict) -> str:
        lm = summary.get(self.train_record_key)
        return f"{lm['tokens_per_s']:.0f} tokens/s" if lm else super().throughput(summary)


def NextTokenLoss(label_smoothing: float = 0.0):
    """Training's loss: the mean cross-entropy over the micro-batch's scored positions."""
    import torch.nn.functional as F
    from torch import nn

    class _Loss(nn.Module):
        def forward(self, outputs, targets):
            return F.cross_entropy(
                outputs.reshape(-1, outputs.shape[-1]).float(),
                targets.reshape(-1),
                ignore_index=PAD,
                label_smoothing=label_smoothing,
            )

    return _Loss()
