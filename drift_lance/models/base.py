"""The model boundary: one chat protocol and one embedder protocol.

Everything above this module (primer, local search, reduce, service) talks to models only through
these types, so backends (OpenAI-compatible HTTP, in-process llama.cpp, scripted test doubles) are
interchangeable and selected by name from config.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, Self, runtime_checkable

import numpy as np
from pydantic import BaseModel

from drift_lance.errors import ConfigError, DriftLanceError

Role = Literal["system", "user", "assistant"]
# What a text is, for embedders that embed queries and documents differently (e5's "query: " /
# "passage: " prefixes). Embedders without such a distinction ignore it.
EmbedKind = Literal["query", "document"]


@dataclass(frozen=True, slots=True)
class Message:
    role: Role
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(slots=True)
class Usage:
    """Token usage of one or more calls. `counted` is True when tokens were counted locally
    because the server did not report usage."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    calls: int = 0
    counted: bool = False
    cached: bool = False  # one call's usage only: answered from the response cache, no model call

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.output_tokens + other.output_tokens,
            self.calls + other.calls,
            self.counted or other.counted,
        )

    def of_one_call(self) -> Usage:
        """This as the usage of one call: no call when it came from the cache, else one call
        (models that do not count calls report 0)."""
        return Usage(self.prompt_tokens, self.output_tokens, 0 if self.cached else max(self.calls, 1), self.counted)


@dataclass(slots=True)
class ChatResult:
    text: str
    usage: Usage
    parsed: BaseModel | None = None  # set when a response_model was asked for and validated
    model: str = ""
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ChatParams:
    """Per-call generation parameters. None means: the backend's / server's default."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    n: int | None = None
    seed: int | None = None


class ModelError(DriftLanceError, RuntimeError):
    """A model call failed for good (after retries) or returned output that could not be used.
    A DriftLanceError, so `except DriftLanceError` also catches a model endpoint that is down."""


RequestFailure = Literal["status", "timeout", "connection", "malformed", "too_large", "other"]


class ModelRequestError(ModelError):
    """An HTTP call to the model endpoint failed for good. `status` is the HTTP status (None for
    timeouts and connection errors); `failure` what kind of failure it was (an HTTP error status, a
    timeout, a refused or dropped connection, a response body that is not what the protocol says, or
    something else), for callers that report it without the message, which names the endpoint and
    may quote its error body; `attempts` how many requests were made."""

    def __init__(self, message: str, *, status: int | None = None, failure: RequestFailure | None = None, attempts: int = 1):
        super().__init__(message)
        self.status = status
        self.failure: RequestFailure = failure or ("status" if status is not None else "other")
        self.attempts = attempts


class StructuredOutputError(ModelError):
    """The model answered, but no valid JSON for the requested schema could be recovered."""

    def __init__(self, message: str, *, text: str = "", usage: Usage | None = None):
        super().__init__(message)
        self.text = text
        self.usage = usage or Usage()


class EmptyAnswerError(ModelError):
    """The model answered with no text, and said why: its provider's content filter blocked the
    answer, the output cap ran out before any answer text (a reasoning model can spend it all on
    reasoning), or it refused. `usage` is what the call cost."""

    def __init__(self, message: str, *, usage: Usage | None = None):
        super().__init__(message)
        self.usage = usage or Usage()


def check_answered(text: str, usage: Usage, *, what: str, model: object) -> None:
    """EmptyAnswerError when a search's answer (`what`: "DRIFT reduce", "local search answer") is
    empty or only whitespace, whatever the reason: the answer has no fallback, and a blank one (exit
    status 0, HTTP 200) would pass for an answer. `usage` is what the call cost."""
    if not text.strip():
        name = getattr(model, "model_id", None) or type(model).__name__
        raise EmptyAnswerError(f"{what}: chat model {name!r} returned an empty answer "
                               f"({'nothing' if not text else 'only whitespace'})", usage=usage)


def check_model_argument(model: object, argument: str, method: str, setting: str) -> None:
    """A model name where a model object goes (`chat_model="gpt-4o"`) would only fail at the first
    call, as an AttributeError: say at once how to name a model."""
    if model is not None and not callable(getattr(model, method, None)):
        build = "get_chat_model" if method == "complete" else "get_embedder"
        hint = f"; to name a model, build it: {build}(ModelSettings({setting}={model!r}))" if isinstance(model, str) else ""
        raise ConfigError(f"{argument}: expected an object with an async {method}() method, got {type(model).__name__}{hint}")


async def aclose_models(*models: object) -> None:
    """Close the models that hold connections (the OpenAI backend's HTTP sessions); models without
    `aclose` hold none. Each is closed even if an earlier one fails."""
    errors = []
    for model in models:
        close = getattr(model, "aclose", None)
        if close is None:
            continue
        try:
            await close()
        except Exception as exc:  # noqa: BLE001 - close the rest, then report
            errors.append(exc)
    if errors:
        raise errors[0]


class ChatStream(Protocol):
    """An async iterator of text deltas; `usage` is complete once iteration has finished.
    `aclose()` cancels the underlying request."""

    usage: Usage

    def __aiter__(self) -> AsyncIterator[str]: ...

    async def aclose(self) -> None: ...


class GeneratorStream:
    """A ChatStream driven by one async generator, `_run()`, that yields the deltas and sets
    `usage` when done. Started on first iteration; `aclose()` closes it (its `finally` blocks run)."""

    # A search's stream (the caller's, not a model's) holds its generator weakly outside `async with`.
    # The generator's frame refers to the stream, so holding it strongly made a cycle: a stream left
    # by `break` kept its model call and concurrency slot until a garbage collection ran (20 s for
    # the next search with max_concurrency=1). Held weakly, the loop dropping it closes it at once
    # (asyncio's async-generator finaliser). Model streams stay held: the engine closes each one in
    # a `finally` and relies on that close having finished.
    _closed_when_dropped: ClassVar[bool] = False

    def __init__(self) -> None:
        self.usage = Usage()
        self._gen: AsyncIterator[str] | None = None  # held (a model stream, or inside `async with`)
        self._gen_ref: weakref.ref[AsyncIterator[str]] | None = None
        self._held = not self._closed_when_dropped

    def _run(self) -> AsyncIterator[str]:
        raise NotImplementedError

    def __aiter__(self) -> AsyncIterator[str]:
        gen = self._generator()
        if gen is None:
            if self._gen_ref is not None:  # ran, then dropped and closed: a stream is read once
                return _no_deltas()
            gen = self._run()
            self._gen_ref = weakref.ref(gen)
            if self._held:
                self._gen = gen
        return gen

    def _generator(self) -> AsyncIterator[str] | None:
        if self._gen is not None:
            return self._gen
        return self._gen_ref() if self._gen_ref is not None else None

    async def aclose(self) -> None:
        gen = self._generator()
        if gen is not None:
            await gen.aclose()  # type: ignore[attr-defined]

    # `async with search.stream_search(q) as stream:` closes it however the loop is left, before
    # the block's end returns. Self: a type checker then knows `stream` as the subclass, with its
    # `result` and `text()`.
    async def __aenter__(self) -> Self:
        self._held = True
        self._gen = self._generator()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def text(self) -> str:
        """Consume the whole stream and return the answer."""
        return "".join([delta async for delta in self])


async def _no_deltas() -> AsyncIterator[str]:
    return
    yield  # an async generator that yields nothing


# Share of a model's free window a context may fill: budgets count o200k tokens, the model counts
# its own, and the two differ by a few percent either way.
WINDOW_SHARE = 0.8
PROMPT_RESERVE = 1024  # a prompt template and the question, in tokens


def fit_to_window(model: Any, budget: int, answer_tokens: int | None) -> int:
    """`budget` (tokens of context data), lowered to what fits the model's context window when the
    model has a fixed one (`n_ctx`, e.g. the embedded llama.cpp model's 8192) next to the prompt and
    the answer. Remote models declare none: `budget` as configured."""
    window = getattr(model, "n_ctx", None)
    if not isinstance(window, int) or window <= 0:
        return budget
    free = window - PROMPT_RESERVE - (answer_tokens or 512)
    return max(0, min(budget, int(free * WINDOW_SHARE)))


@runtime_checkable
class ChatModel(Protocol):
    """An async chat model. Implementations must be safe to call concurrently."""

    model_id: str

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        params: ChatParams | None = None,
        response_model: type[BaseModel] | None = None,
    ) -> ChatResult:
        """One completion. With `response_model`, the result's `parsed` is a validated instance
        (or StructuredOutputError is raised)."""
        ...

    def stream(self, messages: Sequence[Message], *, params: ChatParams | None = None) -> ChatStream:
        """Text deltas of one completion; the returned stream's `usage` is filled in once it is
        exhausted."""
        ...


@runtime_checkable
class Embedder(Protocol):
    model_id: str
    dimension: int

    async def embed(self, texts: Sequence[str], *, kind: EmbedKind = "document") -> np.ndarray:
        """Return a float32 matrix of shape (len(texts), dimension), L2-normalised rows. Pass
        kind="query" for search queries (including HyDE answers used as queries)."""
        ...


def well_formed(text: str) -> str:
    """`text` with lone UTF-16 surrogates replaced by U+FFFD (and split pairs joined). A model's
    JSON can escape half an emoji (`"\\ud83d"`, its output cut by max_tokens); such a string cannot
    be encoded into the next request, so it must not get that far."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text
