"""Words for what the terminal, the logs and the report print: "1 run", "2 runs", never
"1 run(s)" or "(1 ranks)".

    counted(1, "run")               # "1 run"
    counted(3, "class", "classes")  # "3 classes"
"""

from __future__ import annotations


def counted(count: int, singular: str, plural: str | None = None) -> str:
    """The count and the noun in the number it takes."""
    return f"{count} {singular if count == 1 else plural or singular + 's'}"
