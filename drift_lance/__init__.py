"""drift-lance: GraphRAG DRIFT search on LanceDB.

The public API, imported lazily so `import drift_lance` stays cheap (lancedb alone takes seconds):

    from drift_lance import open_drift_search, DRIFTSearchConfig, open_store, build_local_context
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # search
    "open_drift_search": "drift_lance.drift",
    "DRIFTSearch": "drift_lance.drift",
    "SearchResult": "drift_lance.drift",
    "DriftAction": "drift_lance.drift",
    "QueryState": "drift_lance.drift",
    "DriftCallbacks": "drift_lance.drift",
    "LocalSearch": "drift_lance.local",
    "LocalContextBuilder": "drift_lance.local",
    "build_local_context": "drift_lance.local",
    # configuration
    "DRIFTSearchConfig": "drift_lance.config",
    "LocalSearchConfig": "drift_lance.config",
    "ModelSettings": "drift_lance.config",
    "IngestConfig": "drift_lance.config",
    "StoreConfig": "drift_lance.config",
    "Settings": "drift_lance.config",
    # storage and models
    "open_store": "drift_lance._lance_store",
    "IndexStore": "drift_lance.store",
    "Manifest": "drift_lance.store",
    "get_chat_model": "drift_lance.models",
    "get_embedder": "drift_lance.models",
    "get_tokenizer": "drift_lance.models",
    "freeze_long_lived_objects": "drift_lance._gc",
    # errors
    "DriftLanceError": "drift_lance.errors",
    "ConfigError": "drift_lance.errors",
    "IngestError": "drift_lance.errors",
    "StoreError": "drift_lance.errors",
    "IndexUnreadableError": "drift_lance.errors",
    "EmbeddingMismatchError": "drift_lance.errors",
    "ModelError": "drift_lance.models.base",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'drift_lance' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
