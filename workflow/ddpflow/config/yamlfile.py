"""Reading a config file: a YAML error names the file, line and column and the key it is
under, and a key given twice in one mapping (YAML keeps the last silently) is an error naming
both lines. Snakemake's own reader says only "Config file is not valid JSON or YAML".

    read_config_file("config/config.yaml")   # -> dict, or ConfigError
"""

from __future__ import annotations

from pathlib import Path

import yaml

from ddpflow.config.schema import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping key given twice."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    f"while reading the mapping of line {node.start_mark.line + 1}",
                    node.start_mark,
                    f"{key!r} is given twice (first on line {seen[key] + 1}): YAML would keep the "
                    "last one silently; delete one",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def read_config_file(path: str | Path) -> dict:
    """The config file as a dict, or a ConfigError that says where it is wrong."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(_where(path, text, exc)) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of keys (data:, model:, train:, ...), "
            f"not a {type(raw).__name__}"
        )
    return raw


def _where(path: Path, text: str, exc: yaml.MarkedYAMLError) -> str:
    mark = exc.problem_mark or exc.context_mark
    if mark is None:
        return f"{path}: not valid YAML: {exc}"
    lines = text.splitlines()
    under = _key_path(lines, mark.line)
    out = [
        f"{path}:{mark.line + 1}:{mark.column + 1}: not valid YAML"
        f"{f' (under {under})' if under else ''}: {exc.problem or exc.context}{_hint(exc)}",
        *_pointer(lines, mark),
    ]
    opened = exc.context_mark
    if exc.context and opened is not None and opened.line != mark.line:
        # an unclosed bracket or quote: where it was opened is where to look
        where = f"line {opened.line + 1}, column {opened.column + 1}"
        out.append(f"  {exc.context}, which starts at {where}:")
        out += _pointer(lines, opened)
    return "\n".join(out)


def _hint(exc: yaml.MarkedYAMLError) -> str:
    tab = "'\\t'" in str(exc.problem)  # PyYAML shows the character as '\t'
    return " (YAML indents with spaces, never tabs)" if tab else ""


def _pointer(lines: list[str], mark) -> list[str]:
    shown = lines[mark.line] if mark.line < len(lines) else ""
    number = str(mark.line + 1)
    return [f"  {number} | {shown}", f"  {' ' * len(number)} | {' ' * mark.column}^"]


def _key_path(lines: list[str], line: int) -> str:
    """The keys enclosing `line`, from the indentation of the lines above (block style)."""
    keys, indent = [], None
    for above in reversed(lines[: line + 1]):
        stripped = above.strip()
        if not stripped or stripped.startswith("#") or ":" not in stripped:
            continue
        width = len(above) - len(above.lstrip())
        if indent is None or width < indent:
            key = stripped.split(":", 1)[0].strip().lstrip("- ").strip("'\"")
            keys.append(key)
            indent = width
            if width == 0:
                break
    return ".".join(reversed(keys))
