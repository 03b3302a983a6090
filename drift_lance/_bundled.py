"""The prompt templates shipped with drift-lance (the repository's top-level `prompts/`, installed
next to the `drift_lance` package).

They are read by path from beside this package, not imported as the package `prompts`: a
`prompts/` folder in the working directory or the script's (graphrag's `init` makes one in every
project) comes first on `sys.path` and would shadow ours."""

from __future__ import annotations

from pathlib import Path

__all__ = ["bundled_prompt"]

_PROMPTS_DIR = Path(__file__).resolve().parent.parent / "prompts"


def bundled_prompt(name: str) -> str:
    """The text of the bundled prompt file `name`."""
    return (_PROMPTS_DIR / name).read_text(encoding="utf-8")
