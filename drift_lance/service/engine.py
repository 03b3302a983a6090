"""`EngineBackend`: the real search engine behind the service (LanceDB store, models, DRIFT/local).

The store and models are opened once at startup and shared by every request; each request gets its
own DRIFTSearch/LocalSearch built from the request's config (cheap: no I/O beyond prompt files).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from pydantic import BaseModel

from drift_lance.config.settings import Settings
from drift_lance.drift.action import DriftAction
from drift_lance.drift.callbacks import DriftCallbacks
from drift_lance.drift.result import SearchResult
from drift_lance.errors import ConfigError
from drift_lance.models.base import ChatModel, Embedder
from drift_lance.service.backend import EventSink, Method, Readiness, SearchEvent
from drift_lance.store import IndexStore, Manifest


class EngineBackend:
    """SearchBackend over an ingested index. `chat_model` / `embedder` replace the configured models
    (tests pass scripted doubles here; everything else is the production path)."""

    def __init__(
        self,
        settings: Settings,
        *,
        chat_model: ChatModel | None = None,
        embedder: Embedder | None = None,
        store: IndexStore | None = None,
    ):
        if settings.db is None and store is None:
            raise ConfigError("db: no database given (--db URI, `db` in the config file, or DRIFT_LANCE_DB)")
        self.settings = settings
        self._chat = chat_model
        self._embedder = embedder
        self._store = store
        self._owns_store = store is None
        self._models_ready = chat_model is not None and embedder is not None

    async def start(self) -> None:
        from drift_lance._lance_store import open_store
        from drift_lance.models.registry import get_chat_model, get_embedder

        if self._store is None:
            self._store = await open_store(self.settings.db, config=self.settings.store)
        # Model construction may load weights (llama.cpp, e5): keep the event loop free meanwhile.
        if self._chat is None:
            self._chat = await asyncio.to_thread(get_chat_model, self.settings.models)
        if self._embedder is None:
            self._embedder = await asyncio.to_thread(get_embedder, self.settings.models)
        self._models_ready = True

    def readiness(self) -> Readiness:
        return Readiness(store=self._store is not None, models=self._models_ready)

    def manifest(self) -> Manifest:
        assert self._store is not None, "manifest() before start()"
        return self._store.manifest

    def base_config(self, method: Method) -> BaseModel:
        return self.settings.drift if method == "drift" else self.settings.local

    async def search(
        self, query: str, method: Method, config: BaseModel, on_event: EventSink | None = None
    ) -> SearchResult:
        if method == "drift":
            return await self._drift(query, config, on_event)
        return await self._local(query, config, on_event)

    async def close(self) -> None:
        if self._owns_store and self._store is not None:
            await self._store.close()
            self._store = None

    # ------------------------------------------------------------------ methods

    async def _drift(self, query: str, config: Any, on_event: EventSink | None) -> SearchResult:
        from drift_lance.drift.search import DRIFTSearch, local_config_for_drift
        from drift_lance.local import LocalContextBuilder
        from drift_lance.models.tokens import get_tokenizer

        local_config = local_config_for_drift(config, self.settings.local)
        tokenizer = get_tokenizer(local_config.encoding)
        search = DRIFTSearch(
            store=self._store,
            chat_model=self._chat,
            embedder=self._embedder,
            context_builder=LocalContextBuilder(self._store, tokenizer=tokenizer, config=local_config),
            tokenizer=tokenizer,
            config=config,
        )
        if on_event is None:
            return await search.search(query)
        stream = search.stream_search(query, callbacks=[_EventCallbacks(on_event)])
        try:
            async for _ in stream:
                pass  # tokens reach the client through on_token
        finally:
            await stream.aclose()
        assert stream.result is not None
        return stream.result

    async def _local(self, query: str, config: Any, on_event: EventSink | None) -> SearchResult:
        from drift_lance.local import LocalContextBuilder, LocalSearch
        from drift_lance.models.tokens import get_tokenizer

        builder = LocalContextBuilder(self._store, tokenizer=get_tokenizer(config.encoding), config=config)
        search = LocalSearch(self._chat, builder, embedder=self._embedder, config=config)
        if on_event is None:
            return await search.search(query)
        return await _stream_local(search, query, on_event)


async def _stream_local(search: Any, query: str, on_event: EventSink) -> SearchResult:
    """A streamed local search: token events, then the stream's SearchResult."""
    stream = search.stream_search(query)
    try:
        async for delta in stream:
            on_event(SearchEvent("token", {"text": delta}))
    finally:
        await stream.aclose()
    assert stream.result is not None
    return stream.result


class _EventCallbacks(DriftCallbacks):
    """DRIFT progress -> SearchEvents for the SSE stream."""

    def __init__(self, sink: EventSink):
        self._sink = sink

    def on_primer_done(self, root: DriftAction, reports: list[dict[str, Any]]) -> None:
        self._sink(
            SearchEvent(
                "primer",
                {"query": root.query, "score": _finite(root.score), "follow_ups": list(root.follow_ups), "reports": len(reports)},
            )
        )

    def on_action_completed(self, action: DriftAction, epoch: int) -> None:
        self._sink(
            SearchEvent(
                "action",
                {
                    "epoch": epoch,
                    "query": action.query,
                    "score": _finite(action.score),
                    "failed": action.failed,
                    "follow_ups": list(action.follow_ups),
                },
            )
        )

    def on_token(self, token: str) -> None:
        self._sink(SearchEvent("token", {"text": token}))


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
