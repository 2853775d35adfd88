"""A language model's windows, checked before anything is submitted: eval.stride (sliding
evaluation windows) and train.fresh_windows (a new block offset each epoch) act on token data
only, and a stride lies in [1, data.block_size] (ddpflow.data.windows)."""

from __future__ import annotations

from ddpflow.config.fingerprint import TOKEN_SOURCES
from ddpflow.config.schema import ConfigError


def check_token_windows(where: str, run: dict) -> None:
    """Refuse, naming the key and the fix, a stride or fresh windows that cannot apply."""
    data, stride = run["data"], run["eval"].get("stride")
    fresh = run["train"].get("fresh_windows", False)
    if data["source"] not in TOKEN_SOURCES:
        if stride is not None:
            raise ConfigError(
                f"{where}: eval.stride {stride} slides a language model's evaluation windows; "
                f"data.source {data['source']} holds samples, each scored whole: remove it"
            )
        if fresh:
            raise ConfigError(
                f"{where}: train.fresh_windows moves a language model's block boundaries each "
                f"epoch; data.source {data['source']} holds samples, not a token stream: "
                "remove it"
            )
        return
    block = data["block_size"]
    if stride is not None and not 1 <= stride <= block:
        raise ConfigError(
            f"{where}: eval.stride {stride} is outside [1, data.block_size {block}]: a larger "
            "stride would skip tokens between windows; set eval.stride to at most "
            f"{block} (e.g. {max(block // 2, 1)}: every token scored with at least "
            f"{block - max(block // 2, 1)} tokens of context) or remove it for "
            "non-overlapping windows"
        )
