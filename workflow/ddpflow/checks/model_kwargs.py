"""model.kwargs of the built-in gpt, checked while the config is parsed (no torch): a model
that cannot be built is a configuration error, refused before any job like the others, not
a failure on every rank after the job has waited in the queue.

    check_gpt_kwargs("runs ('lm')", {"n_embd": 30, "n_head": 4})   # raises ConfigError

The keys and defaults are training.gpt.DEFAULTS' (tests/test_config.py holds them equal).
"""

from __future__ import annotations

import difflib

from ddpflow.config.schema import ConfigError

# nanoGPT's names; what GPT(...) takes besides the data's vocab_size and block_size
GPT_SIZES = ("n_layer", "n_head", "n_embd")
GPT_DEFAULTS = {"n_layer": 4, "n_head": 4, "n_embd": 128, "dropout": 0.0, "bias": True}


def check_gpt_kwargs(where: str, kwargs: dict) -> None:
    """Refuse, naming model.kwargs and the fix, gpt kwargs that do not build a model."""
    unknown = sorted(set(kwargs) - set(GPT_DEFAULTS))
    if unknown:
        close = {key: difflib.get_close_matches(key, GPT_DEFAULTS, n=1) for key in unknown}
        hint = "".join(f"; did you mean {c[0]!r} for {k!r}?" for k, c in close.items() if c)
        raise ConfigError(
            f"{where}: model.kwargs {unknown} are not gpt's; it takes "
            f"{', '.join(GPT_DEFAULTS)}{hint}"
        )
    given = {**GPT_DEFAULTS, **kwargs}
    for key in GPT_SIZES:
        value = given[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"{where}: model.kwargs.{key} is {value!r}; it must be a whole number >= 1 "
                f"(gpt's default is {GPT_DEFAULTS[key]})"
            )
    dropout = given["dropout"]
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ConfigError(
            f"{where}: model.kwargs.dropout is {dropout!r}; it must be a number from 0 "
            "(no dropout) up to, not including, 1"
        )
    if not isinstance(given["bias"], bool):
        raise ConfigError(f"{where}: model.kwargs.bias is {given['bias']!r}; write true or false")
    _check_heads(where, given["n_embd"], given["n_head"])


def _check_heads(where: str, n_embd: int, n_head: int) -> None:
    """Each attention head takes n_embd / n_head channels: a whole number of them."""
    if n_embd % n_head == 0:
        return
    lower, upper = n_embd // n_head * n_head, (n_embd // n_head + 1) * n_head
    embd = f"{upper}" if lower == 0 else f"{lower} or {upper}"
    heads = [h for h in range(1, n_embd + 1) if n_embd % h == 0 and h <= 4 * n_head]
    raise ConfigError(
        f"{where}: model.kwargs n_embd {n_embd} is not divisible by n_head {n_head}: each "
        f"attention head takes n_embd / n_head channels; set n_embd to a multiple of {n_head} "
        f"(e.g. {embd}) or n_head to a divisor of {n_embd} ({', '.join(map(str, heads))})"
    )
