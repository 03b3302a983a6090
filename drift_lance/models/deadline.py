"""`llm_timeout` for one chat call or for each wait on a streamed one, shared by DRIFT and local
search. The deadline's own expiry is an LLMTimeoutError naming the setting; a TimeoutError the
model raises itself (its HTTP client's timeout, say) is the model's failure and reported as such,
whether `llm_timeout` is set or not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from drift_lance.models.base import ModelError

__all__ = ["LLMTimeoutError", "deltas_within", "within"]

T = TypeVar("T")


class LLMTimeoutError(ModelError):
    """One LLM call took longer than the configured `llm_timeout`."""


async def within(call: Awaitable[T], timeout: float | None, what: str) -> T:
    """Await `call` for at most `timeout` seconds (None: no limit). `what` names the call."""
    # asyncio.timeout, not wait_for: no extra task per call (62 calls per DRIFT query)
    deadline = asyncio.timeout(timeout)
    try:
        async with deadline:
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
                delta = await anext(deltas)
        except StopAsyncIteration:
            return
        except TimeoutError as exc:
            if not deadline.expired():
                raise _model_timed_out(exc) from None
            raise LLMTimeoutError(f"{what} sent nothing for {timeout:g} s (llm_timeout)") from None
        yield delta


def _model_timed_out(exc: TimeoutError) -> ModelError:
    return ModelError(f"the chat model timed out: {' '.join(str(exc).split()) or type(exc).__name__}")
