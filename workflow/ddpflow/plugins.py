"""Your code, named in the config as "package.module:function" (model.name, data.source,
task): imported from the working directory (where a user's file lives, and where the ranks
run) or the environment, and called by call_plugin, which turns every failure into the
caller's error naming the key. Imports no torch."""

from __future__ import annotations

import importlib
import os
import sys

from ddpflow.errors import UserError


def is_plugin(name: str) -> bool:
    """Whether a config name (model.name, data.source) names your code, not a built-in."""
    return ":" in name


def import_factory(spec: str, key: str, error: type[UserError] = UserError):
    """'package.module:function' -> the function, or `error` naming the config key, what
    failed and the fix."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise error(f"{key} {spec!r}: a plug-in is written 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if os.getcwd() in sys.path or err.name != module_name.split(".")[0]:
            raise error(f"{key} {spec!r}: cannot import {module_name!r} ({err}); put "
                        f"{module_name.replace('.', '/')}.py in the working directory "
                        f"({os.getcwd()}) or install its package") from err  # fmt: skip
        sys.path.insert(0, os.getcwd())
        return import_factory(spec, key, error)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise error(f"{key} {spec!r}: {module_name} ({module.__file__}) has no "
                    f"function {attr!r}")  # fmt: skip
    return factory


def call_plugin(
    spec: str,
    key: str,
    error: type[UserError],
    *args,
    kwargs: dict | None = None,
    given: str,
    what: str = "function",
):
    """Import 'package.module:function' (the config key `key`), call it with args and kwargs
    and return what it returns; its import failure or its exception becomes `error` naming
    the key, the exception and `given` (what it was called with: "data.kwargs {...}");
    `what` names the function in that message ("factory": a model's)."""
    factory = import_factory(spec, key, error)
    try:
        return factory(*args, **(kwargs or {}))
    except Exception as err:
        raise error(
            f"{key} {spec!r}: the {what} raised {type(err).__name__}: {err} (called with {given})"
        ) from err
