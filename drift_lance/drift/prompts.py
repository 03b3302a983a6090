"""DRIFT prompt templates: the bundled `prompts/drift_*.txt`, or files named in the config.

Templates use `str.format` placeholders; a literal brace is written doubled (`{{`). Loading checks
that a template names only the placeholders its stage fills, so a typo fails at start-up, naming
the file, instead of in the middle of a query.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

from drift_lance._bundled import bundled_prompt
from drift_lance.config.drift import DRIFTSearchConfig
from drift_lance.errors import ConfigError

__all__ = ["DriftPrompts", "load_prompts"]

# field -> (bundled file, placeholders the stage fills, placeholders the template must use)
_SPECS: dict[str, tuple[str, frozenset[str], frozenset[str]]] = {
    "hyde_prompt": ("drift_hyde.txt", frozenset({"query", "template"}), frozenset({"query"})),
    "primer_prompt": (
        "drift_primer.txt",
        frozenset({"query", "community_reports", "followups"}),
        frozenset({"query", "community_reports"}),
    ),
    "prompt": (
        "drift_local.txt",
        frozenset({"global_query", "followups", "context_data", "response_type"}),
        frozenset({"context_data"}),
    ),
    "reduce_prompt": ("drift_reduce.txt", frozenset({"context_data", "response_type"}), frozenset({"context_data"})),
}


@dataclass(frozen=True, slots=True)
class DriftPrompts:
    hyde: str
    primer: str
    local: str
    reduce: str


def load_prompts(config: DRIFTSearchConfig) -> DriftPrompts:
    return DriftPrompts(
        hyde=_load("hyde_prompt", config.hyde_prompt),
        primer=_load("primer_prompt", config.primer_prompt),
        local=_load("prompt", config.prompt),
        reduce=_load("reduce_prompt", config.reduce_prompt),
    )


def _load(field: str, path: str | None) -> str:
    bundled, allowed, required = _SPECS[field]
    if path is None:
        text = bundled_prompt(bundled)
        where = f"bundled prompt {bundled}"
    else:
        where = f"drift config field {field!r}: prompt file {path}"
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read ({exc.strerror or exc})") from None
    _check_placeholders(text, allowed, required, where)
    return text


def _check_placeholders(text: str, allowed: frozenset[str], required: frozenset[str], where: str) -> None:
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    except ValueError as exc:
        raise ConfigError(f"{where}: invalid template ({exc}); write literal braces as {{{{ and }}}}") from None
    unknown = sorted(name for name in names if name not in allowed)
    if unknown:
        raise ConfigError(
            f"{where}: unknown placeholder(s) {', '.join('{' + n + '}' for n in unknown)}; "
            f"this prompt may use {', '.join('{' + n + '}' for n in sorted(allowed))}"
        )
    missing = sorted(required - names)
    if missing:
        raise ConfigError(f"{where}: missing placeholder(s) {', '.join('{' + n + '}' for n in missing)}")
