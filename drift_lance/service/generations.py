"""Serving one index across ingests: switch to a newer manifest generation without dropping queries.

A replica holds the store of generation G. `reload()` reads the manifest table; when a newer complete
generation exists it opens a store pinned to it, opens every object of every table (so a generation
with a missing or unreadable file is never switched to), then makes it current. Searches lease the
current store for their whole run (`async with stores.lease() as store`), so a search that started
on G finishes on G; the G store is closed once its last lease is returned. `run_periodic` repeats
the check on an interval.

Nothing here is shared between replicas: each one polls the same manifest table, so N replicas
behind a load balancer converge on the newest generation within one interval.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from drift_lance.store import same_manifest

log = logging.getLogger("drift_lance.service")

# Opens the store of `generation` (None = newest), reusing `previous`'s caches when given.
StoreOpener = Callable[[int | None, Any], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class ReloadResult:
    """What one reload check found."""

    previous_generation: int
    generation: int  # the generation now served
    newest_generation: int  # the newest complete generation in the database

    @property
    def switched(self) -> bool:
        return self.generation != self.previous_generation


class ServingStores:
    """The current store plus the retired ones that in-flight searches still hold."""

    def __init__(self, opener: StoreOpener):
        self._open = opener
        self._current: Any = None
        self._leases: dict[int, int] = {}  # id(store) -> searches running on it
        self._retired: dict[int, Any] = {}  # id(store) -> store waiting for its last lease
        self._reload_lock = asyncio.Lock()
        self.on_reload: Callable[[str], None] | None = None  # told each check's outcome: switched, unchanged, failed

    @property
    def current(self) -> Any:
        """The store new searches get (None before `start`)."""
        return self._current

    def open_generations(self) -> list[int]:
        """Generations with an open store: the current one first, then retired ones still in use."""
        stores = [self._current, *self._retired.values()]
        return [store.manifest.generation for store in stores if store is not None]

    async def start(self) -> None:
        """Open the newest generation that can be read whole: a replica started on a partial copy
        of the newest one serves the one before (and the periodic reload switches once it is whole),
        instead of reporting ready and failing every search."""
        store = await self._open(None, None)
        while True:
            try:
                await _open_every_table(store)
                break
            except Exception as exc:
                older = [g for g in await store.generations() if g < store.manifest.generation]
                await _close_quietly(store)
                if not older:
                    raise
                log.warning("%s: generation %d cannot be read whole (%s); serving generation %d",
                            store.uri, store.manifest.generation, exc, older[-1])
                store = await self._open(older[-1], None)
        self._current = store

    @asynccontextmanager
    async def lease(self) -> AsyncIterator[Any]:
        """The current store, kept open until the block exits even if a reload retires it."""
        store = self._current
        if store is None:
            raise RuntimeError("no store open (start() not called or already closed)")
        key = id(store)
        self._leases[key] = self._leases.get(key, 0) + 1
        try:
            yield store
        finally:
            self._leases[key] -= 1
            if self._leases[key] == 0:
                del self._leases[key]
                retired = self._retired.pop(key, None)
                if retired is not None:
                    await _close_quietly(retired)

    async def reload(self) -> ReloadResult:
        """Switch to the newest complete generation if it is newer than the current one."""
        try:
            result = await self._reload()
        except Exception:
            self._tell("failed")
            raise
        self._tell("switched" if result.switched else "unchanged")
        return result

    def _tell(self, outcome: str) -> None:
        if self.on_reload is not None:
            self.on_reload(outcome)

    async def _reload(self) -> ReloadResult:
        async with self._reload_lock:
            current = self._current
            if current is None:
                raise RuntimeError("no store open (start() not called or already closed)")
            before = current.manifest.generation
            manifests = await current.manifests()
            newest = manifests[-1].generation if manifests else before
            anew = ingested_anew(current.manifest, manifests)
            if newest <= before and not anew:
                return ReloadResult(before, before, newest)
            # A database ingested anew shares no file with the served one: no cache entry to hand on.
            fresh = await self._open(newest, None if anew else current)
            try:
                await _open_every_table(fresh)
            except BaseException:
                await _close_quietly(fresh)
                raise
            self._current = fresh
            await self._retire(current)
            log.info("%s: switched from generation %d to %d%s", fresh.uri, before, newest,
                     " (the database was ingested anew)" if anew else "")
            return ReloadResult(before, newest, newest)

    async def run_periodic(self, interval: float) -> None:
        """Reload every `interval` seconds until cancelled; a failed check keeps the current store."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self.reload()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep serving the generation we have
                log.warning("reload check failed, still serving the current generation: %s", exc)

    async def _retire(self, store: Any) -> None:
        if self._leases.get(id(store)):
            self._retired[id(store)] = store  # closed by the last lease's exit
        else:
            await _close_quietly(store)

    async def close(self) -> None:
        """Close every store, including retired ones still leased (shutdown has ended their searches)."""
        stores = [self._current, *self._retired.values()]
        self._current = None
        self._retired.clear()
        for store in stores:
            if store is not None:
                await _close_quietly(store)


def ingested_anew(served: Any, manifests: list[Any]) -> bool:
    """Whether the database was deleted and ingested again from scratch since the `served` manifest
    was opened: its generations start again at 1, so the newest is not newer than the served one.
    Told by the served generation being listed with another manifest, or missing while only older
    ones are listed. (A served generation that a later ingest's cleanup deleted has newer ones.)"""
    if not manifests:  # deleted and not ingested yet: nothing to switch to
        return False
    listed = next((m for m in manifests if m.generation == served.generation), None)
    if listed is None:
        return manifests[-1].generation < served.generation
    return not same_manifest(listed, served)


async def _open_every_table(store: Any) -> None:
    """Open every table at its pinned version and every object of it: a generation that cannot be
    read whole (a data or index file missing) is not switched to."""
    # Concurrently (on object storage each table costs one round trip per object), and every check
    # ends before the first failure is raised: no read still running against a store being closed.
    checks = await asyncio.gather(*(store.check_readable(t) for t in store.manifest.tables), return_exceptions=True)
    for failure in checks:
        if isinstance(failure, BaseException):
            raise failure


async def _close_quietly(store: Any) -> None:
    try:
        await store.close()
    except Exception as exc:  # noqa: BLE001 - closing must not fail a search or a reload
        log.warning("closing store %r failed: %s", store, exc)
