"""All configuration models and their defaults, in one package.

One module per area (models, ingest, local, drift, service); `settings.Settings` composes them into
the one model the CLI and the service load (file + DRIFT_LANCE_* environment variables). The public
names are re-exported here lazily, so importing one area's module does not import every other area.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DRIFTSearchConfig": "drift",
    "LocalSearchConfig": "local",
    "ModelSettings": "models",
    "IngestConfig": "ingest",
    "StoreConfig": "ingest",
    "ServiceConfig": "service",
    "RequestCaps": "service",
    "Settings": "settings",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"drift_lance.config.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'drift_lance.config' has no attribute {name!r}")
