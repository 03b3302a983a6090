"""LLM calls of one DRIFT query: one semaphore bounds the calls in flight, each call has a timeout.

One `BoundedChat` is made per query, so `concurrency` holds across the HyDE call, the primer folds,
every follow-up action and the reduce, and cancelling the query cancels whatever is in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing

from pydantic import BaseModel

from drift_lance.models.base import ChatModel, ChatParams, ChatResult, Message, Usage
from drift_lance.models.deadline import LLMTimeoutError, deltas_within, within

__all__ = ["BoundedChat", "LLMTimeoutError"]


class BoundedChat:
    def __init__(self, model: ChatModel, *, concurrency: int, timeout: float | None):
        self.model = model
        self.timeout = timeout
        self._slots = asyncio.Semaphore(concurrency)

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        params: ChatParams | None = None,
        response_model: type[BaseModel] | None = None,
        on_call: Callable[[], None] | None = None,
    ) -> ChatResult:
        """The model's answer. `on_call` is called once a slot is free, as the model is called: a call
        cancelled while it waits for one never reached the model."""
        async with self._slots:
            if on_call is not None:
                on_call()
            call = self.model.complete(messages, params=params, response_model=response_model)
            return await within(call, self.timeout, "LLM call")

    def stream(self, messages: Sequence[Message], *, params: ChatParams | None = None) -> BoundedStream:
        return BoundedStream(self, messages, params)


class BoundedStream:
    """Text deltas of one streamed call, holding a concurrency slot while it runs. The timeout
    applies to each wait for the next delta. `usage` is set once the stream is exhausted."""

    def __init__(self, chat: BoundedChat, messages: Sequence[Message], params: ChatParams | None):
        self._chat = chat
        self._messages = list(messages)
        self._params = params
        self._gen: AsyncIterator[str] | None = None
        self.usage = Usage()

    def __aiter__(self) -> AsyncIterator[str]:
        if self._gen is None:
            self._gen = self._run()
        return self._gen

    async def _run(self) -> AsyncIterator[str]:
        chat = self._chat
        async with chat._slots:
            stream = chat.model.stream(self._messages, params=self._params)
            try:
                async with aclosing(deltas_within(aiter(stream), chat.timeout, "streamed LLM call")) as deltas:
                    async for delta in deltas:
                        yield delta
            finally:
                await stream.aclose()
            self.usage = stream.usage

    async def aclose(self) -> None:
        if self._gen is not None:
            await self._gen.aclose()  # type: ignore[attr-defined]
