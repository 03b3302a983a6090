"""Local search on LanceDB: graphrag 3.x's mixed local context, built from rows fetched by key."""

from drift_lance.local.context import (
    SECTIONS,
    CandidateRows,
    LocalContext,
    LocalContextBuilder,
    build_local_context,
    check_embedder_compatible,
)
from drift_lance.local.history import ConversationHistory
from drift_lance.local.search import LocalSearch, LocalStream, load_local_prompt

__all__ = [
    "SECTIONS",
    "CandidateRows",
    "ConversationHistory",
    "LocalContext",
    "LocalContextBuilder",
    "LocalSearch",
    "LocalStream",
    "build_local_context",
    "check_embedder_compatible",
    "load_local_prompt",
]
