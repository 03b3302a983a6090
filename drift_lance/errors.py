"""Error types shared across the package. Messages name the file, table, column or field at fault."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class DriftLanceError(Exception):
    """Base class of drift-lance's own errors."""


class ConfigError(DriftLanceError, ValueError):
    """A setting is invalid; the message names the field."""


class IngestError(DriftLanceError):
    """The GraphRAG input is unusable; the message names the file and column."""


class EmbeddingMismatchError(DriftLanceError):
    """Query embeddings would not be comparable with the stored vectors."""


class StoreError(DriftLanceError):
    """Opening or reading the index failed (missing database or table, no complete ingest, dimension
    mismatch); the message names the URI / table / column."""


class IndexUnreadableError(StoreError):
    """A file of the opened index is missing, truncated or cannot be read (a partial copy or sync, a
    deleted file): the database's storage is at fault, not the request, so the service answers 503."""


# Errors that are the user's to fix: the CLI exits 2 for these, the service answers 4xx.
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, IngestError, EmbeddingMismatchError, StoreError)


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """`"; did you mean 'x'?"` for the candidate closest to a misspelt `word` (or one it abbreviates),
    or "" when none is close."""
    candidates = list(candidates)
    close = [c for c in candidates if word and c.startswith(word)] or difflib.get_close_matches(word, candidates, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def first_cause(exc: BaseException) -> BaseException:
    """The first exception inside (nested) exception groups, or `exc` itself: a TaskGroup's
    "unhandled errors in a TaskGroup" says nothing about what went wrong."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def checked_question(query: str) -> str:
    """`query` stripped; ConfigError when it is empty or not Unicode text (a lone surrogate: bytes
    that were not UTF-8 in a command-line argument, or a cut JSON escape), which no model request
    can carry."""
    if query is not None and not isinstance(query, str):  # bytes, a number, a list of questions
        raise ConfigError(f"the question must be text (str), got {type(query).__name__}")
    if not query or not query.strip():
        raise ConfigError("the question is empty")
    try:
        query.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("the question is not valid UTF-8 text") from None
    return query.strip()
