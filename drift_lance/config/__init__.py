"""All configuration models and their defaults, in one package.

One module per area (models, ingest, local, drift, service); `settings.Settings` composes them into
the one model the CLI and the service load (file + DRIFT_LANCE_* environment variables). The public
names are re-exported here lazily, so importing one area's module does not import every other area.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from drift_lance.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    from pydantic import BaseModel

    Model = TypeVar("Model", bound=BaseModel)

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

__all__ = sorted([*_EXPORTS, "checked_config"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"drift_lance.config.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'drift_lance.config' has no attribute {name!r}")


def checked_config(value: Any, cls: type[Model], argument: str) -> Model | None:
    """A settings argument of the Python API as a `cls`: an instance as is, a mapping validated as
    its fields (what a notebook user writes), None as None (the caller's default). Anything else,
    or a mapping with a bad field, is a ConfigError naming the argument, not an AttributeError from
    deep inside the first use."""
    from pydantic import ValidationError

    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        # the whole Settings (Settings.load(...)) where one of its sections goes: name the section
        section = next((name for name, item in getattr(value, "__dict__", {}).items() if isinstance(item, cls)), None)
        hint = f"; pass its .{section}" if section else ""
        raise ConfigError(f"{argument}: expected {cls.__name__} (or a dict of its fields), got {type(value).__name__} {value!r:.80}{hint}")
    try:
        return cls(**{str(key): item for key, item in value.items()})
    except ValidationError as exc:
        problems = "; ".join(_describe(error, cls) for error in exc.errors())
        raise ConfigError(f"{argument}: {problems}") from None


def _describe(error: Any, cls: type[BaseModel]) -> str:
    field = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"unknown {cls.__name__} field {field!r}{did_you_mean(field, cls.model_fields)}"
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"field {field!r}: {message}, got {error['input']!r:.80}" if field else message
