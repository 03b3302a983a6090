"""`llm_timeout` for one chat call or for each wait on a streamed one, shared by DRIFT and local
search. The deadline's own expiry is an LLMTimeoutError naming the setting; a TimeoutError the
model raises itself (its HTTP client's timeout, say) is the model's failure and reported as such,
whether `llm_timeout` is set or not.

The clock stops while the call waits for one of the process's concurrency slots (`paused_while_queued`,
which `ConcurrencyLimiter` enters): a call queued behind other searches' calls has not reached the
model, and under load `llm_timeout` failed follow-ups that no model had taken long to answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

from drift_lance.models.base import ModelError

__all__ = ["LLMTimeoutError", "deltas_within", "paused_while_queued", "time_left", "within"]

T = TypeVar("T")

# The `llm_timeout` of the call running in this context, with the task it cancels.
_call_deadline: ContextVar[tuple[asyncio.Task, asyncio.Timeout] | None] = ContextVar(
    "drift_lance_call_deadline", default=None
)


class LLMTimeoutError(ModelError):
    """One LLM call took longer than the configured `llm_timeout`."""


async def within(call: Awaitable[T], timeout: float | None, what: str) -> T:
    """Await `call` for at most `timeout` seconds (None: no limit). `what` names the call."""
    if timeout is None:  # no deadline to keep or pause: spares a Timeout's enter and exit per call
        try:
            return await call
        except TimeoutError as exc:
            raise _model_timed_out(exc) from None
    # asyncio.timeout, not wait_for: no extra task per call (62 calls per DRIFT query)
    deadline = asyncio.timeout(timeout)
    try:
        async with deadline:
            with _timing(deadline):
                return await call
    except TimeoutError as exc:
        if not deadline.expired():
            raise _model_timed_out(exc) from None
        raise LLMTimeoutError(f"{what} timed out after {timeout:g} s (llm_timeout)") from None


async def deltas_within(deltas: AsyncIterator[str], timeout: float | None, what: str) -> AsyncIterator[str]:
    """`deltas`, each waited for at most `timeout` seconds (None: no limit)."""
    while True:
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                with _timing(deadline):
                    delta = await anext(deltas)
        except StopAsyncIteration:
            return
        except TimeoutError as exc:
            if not deadline.expired():
                raise _model_timed_out(exc) from None
            raise LLMTimeoutError(f"{what} sent nothing for {timeout:g} s (llm_timeout)") from None
        yield delta


def time_left() -> float | None:
    """Seconds the current call has left of its `llm_timeout` (None: no limit)."""
    deadline = _running_deadline()
    return None if deadline is None else deadline.when() - asyncio.get_running_loop().time()  # type: ignore[operator]


@contextmanager
def paused_while_queued() -> Iterator[None]:
    """Stop the clock of the current call's `llm_timeout` while inside (a wait for a concurrency
    slot); it restarts with the time it had left."""
    deadline = _running_deadline()
    if deadline is None or deadline.expired():
        yield
        return
    left = time_left()
    deadline.reschedule(None)
    try:
        yield
    finally:
        deadline.reschedule(asyncio.get_running_loop().time() + left)  # type: ignore[operator]


def _running_deadline() -> asyncio.Timeout | None:
    """The `llm_timeout` of the call running in this task, when it has one; None otherwise, e.g. in
    a task the call started, which inherits the context."""
    current = _call_deadline.get()
    if current is None or current[0] is not asyncio.current_task():
        return None
    return None if current[1].when() is None else current[1]


@contextmanager
def _timing(deadline: asyncio.Timeout) -> Iterator[None]:
    """Make `deadline` the current call's, for `paused_while_queued`."""
    if deadline.when() is None:  # no llm_timeout: nothing to pause
        yield
        return
    token = _call_deadline.set((asyncio.current_task(), deadline))  # type: ignore[arg-type]
    try:
        yield
    finally:
        _call_deadline.reset(token)


def _model_timed_out(exc: TimeoutError) -> ModelError:
    return ModelError(f"the chat model timed out: {' '.join(str(exc).split()) or type(exc).__name__}")
