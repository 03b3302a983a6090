"""In-process test doubles for the model boundary: a scripted chat model and deterministic embedders.

    model = ScriptedChatModel(['{"answer": "x"}', "plain text", TimeoutError("boom")])
    model = ScriptedChatModel(lambda messages, params, response_model: {"score": 50}, delay=0.01)
    result = await model.complete([Message("user", "hi")])
    model.calls[0].messages, model.calls[0].usage, model.max_in_flight

Responses are str (the answer text), dict / list / pydantic model (serialised to JSON), or an
Exception instance (raised from the call). A function may also be async.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
from pydantic import BaseModel

from drift_lance.models.base import (
    ChatParams,
    ChatResult,
    EmbedKind,
    GeneratorStream,
    Message,
    ModelError,
    Usage,
)
from drift_lance.models.structured import parse_structured
from drift_lance.models.tokens import get_tokenizer

ScriptedResponse = Union[str, dict, list, BaseModel, BaseException]
Responder = Callable[[list[Message], ChatParams, "type[BaseModel] | None"], Any]

_DELTA = re.compile(r"\s*\S+\s*|\s+")


@dataclass(slots=True)
class RecordedCall:
    """One call seen by a ScriptedChatModel."""

    messages: list[Message]
    params: ChatParams
    response_model: type[BaseModel] | None
    kind: str  # "complete" or "stream"
    started_at: float  # time.monotonic()
    finished_at: float | None = None
    text: str | None = None  # the answer given (None if the call raised)
    usage: Usage | None = None  # the usage the call reported (also an unusable structured answer's); None if it raised

    @property
    def prompt(self) -> str:
        """All message contents joined, handy for `assert "x" in call.prompt`."""
        return "\n".join(m.content for m in self.messages)


class ScriptedChatModel:
    """A ChatModel whose answers come from a queue or a function; records every call.

    Concurrency-safe: `in_flight` / `max_in_flight` show how many calls overlapped (use `delay` to
    make overlap observable). When the queue runs dry, `default` is answered if given, otherwise the
    call fails with ModelError naming the call number.
    """

    def __init__(
        self,
        responses: Iterable[ScriptedResponse] | Responder | None = None,
        *,
        model_id: str = "scripted",
        delay: float = 0.0,
        default: ScriptedResponse | None = None,
        encoding: str = "o200k_base",
    ):
        self.model_id = model_id
        self.delay = delay
        self.default = default
        self._responder: Responder | None = responses if callable(responses) else None
        self._queue: deque[ScriptedResponse] = deque(() if callable(responses) or responses is None else responses)
        self._tokenizer = get_tokenizer(encoding)
        self.calls: list[RecordedCall] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.usage = Usage()  # total over all calls

    def push(self, *responses: ScriptedResponse) -> None:
        """Append responses to the queue."""
        self._queue.extend(responses)

    @property
    def remaining(self) -> int:
        return len(self._queue)

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        params: ChatParams | None = None,
        response_model: type[BaseModel] | None = None,
    ) -> ChatResult:
        call = self._record(messages, params, response_model, "complete")
        self._enter()
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            text = await self._answer(call)
        finally:
            self._leave(call)
        usage = self._usage(call, text)
        parsed = parse_structured(text, response_model, usage=usage) if response_model else None
        return ChatResult(text=text, usage=usage, parsed=parsed, model=self.model_id)

    def stream(self, messages: Sequence[Message], *, params: ChatParams | None = None) -> ScriptedStream:
        call = self._record(messages, params, None, "stream")
        return ScriptedStream(self, call)

    # -- internals shared with ScriptedStream

    def _record(self, messages, params, response_model, kind) -> RecordedCall:
        call = RecordedCall(list(messages), params or ChatParams(), response_model, kind, time.monotonic())
        self.calls.append(call)
        return call

    def _enter(self) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _leave(self, call: RecordedCall) -> None:
        self.in_flight -= 1
        call.finished_at = time.monotonic()

    async def _answer(self, call: RecordedCall) -> str:
        if self._responder is not None:
            response = self._responder(call.messages, call.params, call.response_model)
            if inspect.isawaitable(response):
                response = await response
        elif self._queue:
            response = self._queue.popleft()
        elif self.default is not None:
            response = self.default
        else:
            raise ModelError(f"ScriptedChatModel: no scripted response left for call #{len(self.calls)}")
        if isinstance(response, BaseException):
            raise response
        text = _as_text(response)
        call.text = text
        return text

    def _usage(self, call: RecordedCall, text: str) -> Usage:
        prompt = sum(self._tokenizer.count(m.content) for m in call.messages)
        usage = call.usage = Usage(prompt, self._tokenizer.count(text), 1, counted=True)
        self.usage = self.usage + usage
        return usage


class ScriptedStream(GeneratorStream):
    """ChatStream of a ScriptedChatModel: the answer split into word deltas."""

    def __init__(self, model: ScriptedChatModel, call: RecordedCall):
        super().__init__()
        self._model = model
        self._call = call

    async def _run(self) -> AsyncIterator[str]:
        model = self._model
        model._enter()
        try:
            if model.delay:
                await asyncio.sleep(model.delay)
            text = await model._answer(self._call)
            for delta in split_deltas(text):
                yield delta
                await asyncio.sleep(0)  # let other tasks run between deltas, like a real stream
        finally:
            model._leave(self._call)
        self.usage = model._usage(self._call, text)


def split_deltas(text: str) -> list[str]:
    """Split text into stream deltas whose concatenation is exactly `text`."""
    return _DELTA.findall(text) if text else []


def _as_text(response: Any) -> str:
    if isinstance(response, str):
        return response
    if isinstance(response, BaseModel):
        return response.model_dump_json()
    return json.dumps(response, ensure_ascii=False)


# ---------------------------------------------------------------- embedders


@dataclass(slots=True)
class RecordedEmbedCall:
    texts: list[str]
    kind: EmbedKind


class HashEmbedder:
    """Deterministic embedder for tests: signed feature hashing of lower-cased words, L2-normalised.

    Texts sharing words get positive cosine similarity, identical texts identical vectors, so
    nearest-neighbour tests behave sensibly without a model. `kind` is recorded, not used.
    `dimension_known=False` behaves like a remote model the client has no dimension for: `dimension`
    is 0 until the first vectors are made.
    """

    def __init__(self, dimension: int = 64, *, model_id: str = "hash-embedder", dimension_known: bool = True):
        if dimension < 2:
            raise ValueError(f"HashEmbedder dimension must be >= 2, got {dimension}")
        self._size = dimension
        self.dimension = dimension if dimension_known else 0
        self.model_id = model_id
        self.calls: list[RecordedEmbedCall] = []

    async def embed(self, texts: Sequence[str], *, kind: EmbedKind = "document") -> np.ndarray:
        texts = list(texts)
        self.calls.append(RecordedEmbedCall(texts, kind))
        return self.embed_sync(texts)

    def embed_sync(self, texts: Sequence[str]) -> np.ndarray:
        self.dimension = self._size
        out = np.zeros((len(texts), self._size), dtype=np.float32)
        for row, text in enumerate(texts):
            out[row] = self._vector(text)
        return out

    def _vector(self, text: str) -> np.ndarray:
        vec = np.zeros(self._size, dtype=np.float64)
        for word in re.findall(r"\w+", text.lower()) or [""]:
            digest = hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest()
            h = int.from_bytes(digest, "little")
            vec[h % self._size] += 1.0 if (h >> 63) & 1 else -1.0
        norm = np.linalg.norm(vec)
        if norm == 0:  # words cancelled out: fall back to a fixed direction
            vec[0], norm = 1.0, 1.0
        return (vec / norm).astype(np.float32)


class ScriptedEmbedder(HashEmbedder):
    """HashEmbedder with fixed vectors for chosen texts (normalised on the way in)."""

    def __init__(
        self,
        vectors: dict[str, Sequence[float]] | None = None,
        dimension: int | None = None,
        *,
        model_id: str = "scripted-embedder",
    ):
        fixed = {k: np.asarray(v, dtype=np.float32) for k, v in (vectors or {}).items()}
        dims = {v.shape[-1] for v in fixed.values()}
        if len(dims) > 1:
            raise ValueError(f"ScriptedEmbedder vectors have different dimensions: {sorted(dims)}")
        super().__init__(dimension or (dims.pop() if dims else 64), model_id=model_id)
        for text, vec in fixed.items():
            if vec.shape != (self.dimension,):
                raise ValueError(f"ScriptedEmbedder vector for {text!r} has shape {vec.shape}, want ({self.dimension},)")
        self.vectors = {k: v / max(float(np.linalg.norm(v)), 1e-12) for k, v in fixed.items()}

    def _vector(self, text: str) -> np.ndarray:
        fixed = self.vectors.get(text)
        return fixed if fixed is not None else HashEmbedder._vector(self, text)


__all__ = [
    "HashEmbedder",
    "RecordedCall",
    "RecordedEmbedCall",
    "ScriptedChatModel",
    "ScriptedEmbedder",
    "ScriptedStream",
    "split_deltas",
]
