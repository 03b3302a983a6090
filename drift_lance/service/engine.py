"""`EngineBackend`: the real search engine behind the service (LanceDB store, models, DRIFT/local).

The store and models are opened once at startup and shared by every request; each request gets its
own DRIFTSearch/LocalSearch built from the request's config (cheap: no I/O beyond prompt files).
The store follows the index: every `store.reload_interval_seconds` (and on `reload()`) a newer
manifest generation is switched to; a search keeps the store it started with (see `generations`).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import Counter
from pydantic import BaseModel

from drift_lance._gc import freeze_long_lived_objects
from drift_lance.config.settings import Settings
from drift_lance.drift.action import DriftAction
from drift_lance.drift.callbacks import DriftCallbacks
from drift_lance.drift.result import SearchResult
from drift_lance.errors import ConfigError
from drift_lance.models.base import ChatModel, Embedder, aclose_models
from drift_lance.service.backend import EventSink, Method, Readiness
from drift_lance.service.errors import ApiError
from drift_lance.service.events import ActionEvent, PrimerEvent, TokenEvent, search_event
from drift_lance.service.generations import ReloadResult, ServingStores, same_manifest
from drift_lance.service.metrics import CountedChat
from drift_lance.store import IndexStore, Manifest

log = logging.getLogger(__name__)


class EngineBackend:
    """SearchBackend over an ingested index. `chat_model` / `embedder` replace the configured models
    (tests pass scripted doubles here; everything else is the production path). A `store` passed in
    is served as is (no reloads); otherwise the backend opens `settings.db` and follows its newest
    manifest generation."""

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
        self._fixed_store = store
        self._stores = ServingStores(self._open_store) if store is None else None
        self._reload_task: asyncio.Task | None = None
        self._models_ready = chat_model is not None and embedder is not None
        self._built_models: list[object] = []  # built in start(), closed in close()
        self._model_failures: Counter | None = None

    async def start(self) -> None:
        from drift_lance.models.registry import get_chat_model, get_embedder

        if self._stores is not None and self._stores.current is None:
            await self._stores.start()
            interval = self.settings.store.reload_interval_seconds
            if interval > 0:
                self._reload_task = asyncio.create_task(self._stores.run_periodic(interval), name="drift-lance-reload")
        # Model construction may load weights (llama.cpp, e5): keep the event loop free meanwhile.
        if self._chat is None:
            self._chat = await asyncio.to_thread(get_chat_model, self.settings.models)
            self._built_models.append(self._chat)
        if self._embedder is None:
            self._embedder = await asyncio.to_thread(get_embedder, self.settings.models)
            self._built_models.append(self._embedder)
        self._check_serveable()
        await self._warn_about_uncacheable_indexes()
        if self._model_failures is not None and not isinstance(self._chat, CountedChat):
            self._chat = CountedChat(self._chat, self._model_failures)
        self._models_ready = True
        freeze_long_lived_objects()  # no 0.1 s full collections of start-up objects mid-search

    def _check_serveable(self) -> None:
        """What would fail every search fails the start instead (/readyz "failed", naming it): a
        prompt file that is missing or malformed, or a query embedder the index's vectors do not
        fit. Otherwise the service reported ready and answered each search 4xx for its own setup."""
        from drift_lance.drift.prompts import load_prompts
        from drift_lance.local import load_local_prompt

        load_prompts(self.settings.drift)
        load_local_prompt(self.settings.local.prompt)
        store = self._current_store
        assert store is not None
        self._check_embedder_fits(store)

    async def _warn_about_uncacheable_indexes(self) -> None:
        """A vector index larger than the store's index cache makes every search slow, not failed:
        said once at start, where an operator reads it."""
        store = self._current_store
        check = getattr(store, "index_cache_warning", None)  # LanceDB stores; a test store has no index cache
        if store is None or check is None:
            return
        for table in store.manifest.tables:
            if (warning := await check(table)) is not None:
                log.warning("%s: %s", store.uri, warning)

    def _check_embedder_fits(self, store: IndexStore) -> None:
        from drift_lance.models.compat import check_embedding_compatibility

        assert self._embedder is not None
        for info in store.manifest.vectors.values():
            check_embedding_compatibility(info, self._embedder, uri=store.uri)

    async def _open_store(self, generation: int | None, previous: Any) -> Any:
        from drift_lance._lance_store import open_store

        store = await open_store(
            self.settings.db,
            config=self.settings.store,
            generation=generation,
            # The new generation shares the old one's LanceDB caches, so their bound holds across switches.
            session=previous.session if previous is not None else None,
        )
        if self._embedder is not None:  # a reload: a generation embedded with another model is not switched to
            try:
                self._check_embedder_fits(store)
            except BaseException:
                await store.close()
                raise
        return store

    @property
    def _current_store(self) -> IndexStore | None:
        return self._fixed_store if self._stores is None else self._stores.current

    def readiness(self) -> Readiness:
        return Readiness(store=self._current_store is not None, models=self._models_ready)

    def manifest(self) -> Manifest:
        store = self._current_store
        assert store is not None, "manifest() before start()"
        return store.manifest

    def open_generations(self) -> list[int]:
        """Manifest generations this backend has open (current first; then ones still finishing searches)."""
        if self._stores is None:
            return [self.manifest().generation] if self._fixed_store is not None else []
        return self._stores.open_generations()

    def count_model_failures(self, failures: Counter) -> None:
        """Count the chat model's calls that fail for good in `failures`, by kind (from start())."""
        self._model_failures = failures

    def observe_reloads(self, callback: Callable[[str], None]) -> None:
        """Tell `callback` the outcome of every reload check (periodic, asked for, or after a
        deleted generation): "switched", "unchanged" or "failed". A store given by the caller is
        never reloaded."""
        if self._stores is not None:
            self._stores.on_reload = callback

    async def reload(self) -> ReloadResult:
        """Switch to the newest complete manifest generation, if newer than the one served."""
        if self._stores is None:
            generation = self.manifest().generation
            return ReloadResult(generation, generation, generation)  # a store given by the caller stays
        return await self._stores.reload()

    @asynccontextmanager
    async def _lease_store(self) -> AsyncIterator[IndexStore]:
        if self._stores is None:
            assert self._fixed_store is not None
            yield self._fixed_store
            return
        async with self._stores.lease() as store:
            yield store

    def base_config(self, method: Method) -> BaseModel:
        return self.settings.drift if method == "drift" else self.settings.local

    async def search(
        self, query: str, method: Method, config: BaseModel, on_event: EventSink | None = None
    ) -> SearchResult:
        # The whole search runs on one generation, even if a reload switches meanwhile.
        async with self._lease_store() as store:
            try:
                if method == "drift":
                    return await self._drift(store, query, config, on_event)
                return await self._local(store, query, config, on_event)
            except Exception as exc:
                if isinstance(self._chat, CountedChat):
                    self._chat.count_search_failure(exc)
                await self._raise_if_generation_gone(store, exc)
                raise

    async def _raise_if_generation_gone(self, store: IndexStore, exc: Exception) -> None:
        """A search that failed because a later ingest's cleanup deleted the generation it ran on
        (a replica that had not reloaded for longer than ingest.keep_replaced_seconds), or because
        the database was deleted and ingested anew: switch to the newest generation now and answer
        503, so the client's retry runs on data that exists."""
        served = store.manifest.generation
        try:
            gone = not any(same_manifest(m, store.manifest) for m in await store.manifests())
        except Exception:  # noqa: BLE001 - the manifest table unreadable too: report the search's own error
            return
        if not gone:
            return
        result = await self.reload()
        raise ApiError(
            503, "generation_gone",
            f"generation {served} was deleted by a later ingest while this replica served it; now serving generation "
            f"{result.generation}, retry the search",
            headers={"Retry-After": "0"},
        ) from exc

    async def close(self) -> None:
        if self._reload_task is not None:
            self._reload_task.cancel()
            await asyncio.gather(self._reload_task, return_exceptions=True)
            self._reload_task = None
        if self._stores is not None:
            await self._stores.close()
        built, self._built_models = self._built_models, []
        await aclose_models(*built)

    # ------------------------------------------------------------------ methods

    async def _drift(self, store: IndexStore, query: str, config: Any, on_event: EventSink | None) -> SearchResult:
        from drift_lance.drift.search import DRIFTSearch, local_config_for_drift
        from drift_lance.local import LocalContextBuilder
        from drift_lance.models.tokens import get_tokenizer

        local_config = local_config_for_drift(config, self.settings.local)
        tokenizer = get_tokenizer(local_config.encoding)
        search = DRIFTSearch(
            store=store,
            chat_model=self._chat,
            embedder=self._embedder,
            context_builder=LocalContextBuilder(store, tokenizer=tokenizer, config=local_config),
            tokenizer=tokenizer,
            config=config,
        )
        if on_event is None:
            return await search.search(query)
        async with search.stream_search(query, callbacks=[_EventCallbacks(on_event)]) as stream:
            async for _ in stream:
                pass  # tokens reach the client through on_token
        assert stream.result is not None
        return stream.result

    async def _local(self, store: IndexStore, query: str, config: Any, on_event: EventSink | None) -> SearchResult:
        from drift_lance.local import LocalContextBuilder, LocalSearch
        from drift_lance.models.tokens import get_tokenizer

        builder = LocalContextBuilder(store, tokenizer=get_tokenizer(config.encoding), config=config)
        search = LocalSearch(self._chat, builder, embedder=self._embedder, config=config)
        if on_event is None:
            return await search.search(query)
        return await _stream_local(search, query, on_event)


async def _stream_local(search: Any, query: str, on_event: EventSink) -> SearchResult:
    """A streamed local search: token events, then the stream's SearchResult."""
    async with search.stream_search(query) as stream:
        async for delta in stream:
            on_event(search_event(TokenEvent(text=delta)))
    assert stream.result is not None
    return stream.result


class _EventCallbacks(DriftCallbacks):
    """DRIFT progress -> SearchEvents for the SSE stream."""

    def __init__(self, sink: EventSink):
        self._sink = sink

    def on_primer_done(self, root: DriftAction, reports: list[dict[str, Any]]) -> None:
        self._sink(search_event(PrimerEvent(query=root.query, score=_finite(root.score), follow_ups=list(root.follow_ups),
                                            reports=len(reports))))

    def on_action_completed(self, action: DriftAction, epoch: int) -> None:
        self._sink(search_event(ActionEvent(epoch=epoch, query=action.query, score=_finite(action.score),
                                            failed=action.failed, follow_ups=list(action.follow_ups))))

    def on_token(self, token: str) -> None:
        self._sink(search_event(TokenEvent(text=token)))


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
