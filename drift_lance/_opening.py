"""`Opening`: what the public `open_*` functions return, usable both ways.

    search = await open_drift_search(db)             # then `await search.close()`
    async with open_drift_search(db) as search:      # closed on leaving the block
        ...

`async with open_drift_search(db)` (without `await`) failed with "'coroutine' object does not
support the asynchronous context manager protocol" and a "coroutine was never awaited" warning.
Nothing runs until the object is awaited or entered, so one that is never used opens nothing and
leaves no warning. It is a coroutine as far as asyncio is concerned (`asyncio.run`, `create_task`,
`gather` and `wait_for` take it), and like a coroutine it can be awaited once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Generic, ParamSpec, Protocol, TypeVar

__all__ = ["Opening", "opening"]


class _Closable(Protocol):
    async def close(self) -> None: ...


T = TypeVar("T", bound=_Closable)
P = ParamSpec("P")


class Opening(Coroutine[Any, Any, T], Generic[T]):
    """An awaitable that opens a `T` (`await` it), and an async context manager that opens it on
    entry and closes it on exit (`async with`). `opener` makes the coroutine that opens it; it is only
    called when the object is first awaited or entered."""

    __slots__ = ("_opener", "_coroutine", "_entered")

    def __init__(self, opener: Callable[[], Coroutine[Any, Any, T]]) -> None:
        self._opener: Callable[[], Coroutine[Any, Any, T]] | None = opener
        self._coroutine: Coroutine[Any, Any, T] | None = None
        self._entered: T | None = None

    def _started(self) -> Coroutine[Any, Any, T]:
        if self._coroutine is None:
            assert self._opener is not None
            self._coroutine, self._opener = self._opener(), None
        return self._coroutine  # awaited a second time, it says "cannot reuse already awaited coroutine"

    def __await__(self) -> Generator[Any, None, T]:
        return self._started().__await__()

    def send(self, value: Any) -> Any:
        return self._started().send(value)

    def throw(self, *args: Any) -> Any:
        return self._started().throw(*args)

    def close(self) -> None:
        """Close the opening coroutine (the coroutine protocol; nothing to do if it never started).
        This does not close what it opened: `async with` does that, or the opened object's own
        `close()`."""
        if self._coroutine is not None:
            self._coroutine.close()

    async def __aenter__(self) -> T:
        self._entered = await self
        return self._entered

    async def __aexit__(self, *exc: object) -> None:
        opened, self._entered = self._entered, None
        if opened is not None:
            await opened.close()


def opening(open_: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Opening[T]]:
    """Decorate an `async def open_*` so that calling it returns an `Opening` (same arguments and
    docstring), which runs the function only once awaited or entered."""

    @functools.wraps(open_)
    def opener(*args: P.args, **kwargs: P.kwargs) -> Opening[T]:
        return Opening(lambda: open_(*args, **kwargs))

    return opener
