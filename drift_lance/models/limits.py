"""Process-wide concurrency limits per (endpoint, model).

asyncio.Semaphore binds to the event loop that first waits on it, which breaks when tests (or a
sync CLI wrapper) run several loops over a process's lifetime, or when two loops in different
threads share an endpoint. `ConcurrencyLimiter` keeps its count under a threading lock and wakes
waiters on their own loop, so one limit holds for everything in the process.

Waiters are served oldest search first: a search marks its model calls with its start time
(`calls_ranked_from`), and a freed slot goes to the waiting call of the earliest search (calls of
no search rank by when they asked). With 50 DRIFT queries sharing 25 slots, FIFO served every
query's epoch a little at a time, so all of them finished together at the end; oldest first
finishes them one after another, with the same throughput.

Time spent waiting for a slot does not count against the waiting call's `llm_timeout`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar

from drift_lance.models.deadline import paused_while_queued

__all__ = ["ConcurrencyLimiter", "calls_ranked_from", "shared_limiter"]

# The start time of the search whose model calls are made in this context (tasks inherit it).
_search_started: ContextVar[float | None] = ContextVar("drift_lance_search_started", default=None)


@contextmanager
def calls_ranked_from(started: float | None = None) -> Iterator[None]:
    """Rank the model calls made inside (and in tasks started inside) by `started` (default: now,
    monotonic clock) when they wait for a slot. An enclosing search's rank is kept."""
    if _search_started.get() is not None:
        yield
        return
    token = _search_started.set(time.monotonic() if started is None else started)
    try:
        yield
    finally:
        try:
            _search_started.reset(token)
        except ValueError:  # an async generator finalised in another context: nothing to undo there
            pass


class ConcurrencyLimiter:
    def __init__(self, limit: int, name: str = ""):
        if limit < 1:
            raise ValueError(f"concurrency limit must be >= 1, got {limit}")
        self.name = name
        self._limit = limit
        self._in_use = 0
        # heap of (rank, arrival, loop, future): the earliest search's call first, then arrival order
        self._waiters: list[tuple[float, int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()
        self._lock = threading.Lock()
        self.max_in_use = 0  # high-water mark, for tests and diagnostics

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def waiting(self) -> int:
        """Calls waiting for a slot (cancelled ones may still count until a slot passes them)."""
        return len(self._waiters)

    def set_limit(self, limit: int) -> None:
        """Change the limit; extra capacity is handed to waiters immediately."""
        if limit < 1:
            raise ValueError(f"concurrency limit must be >= 1, got {limit}")
        with self._lock:
            self._limit = limit
            while self._in_use < self._limit and self._hand_over_locked():
                self._take_locked()

    async def acquire(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._in_use < self._limit and not self._waiters:
                self._take_locked()
                return
            fut: asyncio.Future[None] = loop.create_future()
            rank = _search_started.get()
            entry = (time.monotonic() if rank is None else rank, next(self._arrivals), loop, fut)
            heapq.heappush(self._waiters, entry)
        try:
            with paused_while_queued():
                await fut
        except asyncio.CancelledError:
            with self._lock:
                if entry in self._waiters:
                    self._waiters.remove(entry)
                    heapq.heapify(self._waiters)
                    raise
            # A slot was handed to us while we were being cancelled: pass it on.
            if fut.done() and not fut.cancelled():
                self.release()
            raise

    def release(self) -> None:
        with self._lock:
            if self._hand_over_locked():
                return  # the slot moves straight to the next waiter
            self._in_use -= 1

    def _take_locked(self) -> None:
        self._in_use += 1
        self.max_in_use = max(self.max_in_use, self._in_use)

    def _hand_over_locked(self) -> bool:
        """Give one slot to the first live waiter (earliest search, then arrival). Caller holds the
        lock; `_in_use` unchanged."""
        while self._waiters:
            _, _, loop, fut = heapq.heappop(self._waiters)
            if loop.is_closed() or fut.done():
                continue
            loop.call_soon_threadsafe(self._grant, fut)
            return True
        return False

    def _grant(self, fut: asyncio.Future[None]) -> None:
        if fut.done():  # cancelled after the hand-over was scheduled
            self.release()
        else:
            fut.set_result(None)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()


_limiters: dict[tuple[str, str], ConcurrencyLimiter] = {}
_registry_lock = threading.Lock()


def shared_limiter(endpoint: str, model: str, limit: int) -> ConcurrencyLimiter:
    """The one limiter for (endpoint, model) in this process. A different `limit` from a later
    caller replaces the old one (the most recent configuration wins)."""
    key = (endpoint, model)
    with _registry_lock:
        limiter = _limiters.get(key)
        if limiter is None:
            limiter = _limiters[key] = ConcurrencyLimiter(limit, name=f"{model}@{endpoint}")
        elif limiter.limit != limit:
            limiter.set_limit(limit)
        return limiter
