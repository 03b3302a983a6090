"""OpenAI-compatible chat and embeddings (OpenAI, Azure OpenAI, vLLM, llama.cpp server, Ollama, ...).

Call policy, all ours (the SDK's own retries are off so there is exactly one policy):
- retries with exponential backoff and full jitter on 429, 408/409, 5xx, timeouts and connection
  errors, honouring Retry-After / retry-after-ms (capped at retry_max_wait);
- a total per-request timeout (request_timeout) on top of the SDK's per-read timeout;
- one concurrency limiter per (endpoint, model), shared by everything in the process; a slot is
  held only while a request is on the wire, not while backing off;
- structured output: json_schema (strict) -> json_object with the schema (llama.cpp's server
  accepts that and constrains generation with it) -> json_object -> prompt-only, then tolerant
  JSON repair and pydantic validation. The step a server accepted is remembered per (endpoint,
  model), so later calls skip steps that failed;
- usage from the response, else counted locally with the model's tiktoken encoding.

Transport: non-streamed calls go through the client's `post` with a plain JSON body and come back as
the raw JSON (the SDK's typed request transform and response models cost ~3 ms of CPU per call, a
DRIFT query makes ~60), over aiohttp (`openai[aiohttp]`: about half httpx's CPU per request) unless
a proxy is configured in the environment, which only httpx honours.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import email.utils
import functools
import json
import logging
import os
import random
import re
import ssl
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import httpx2
import numpy as np
import openai
from pydantic import BaseModel
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt
from tenacity.stop import stop_base
from tenacity.wait import wait_base

from drift_lance.config.models import ModelSettings
from drift_lance.errors import ConfigError, first_cause
from drift_lance.models.base import (
    ChatParams, ChatResult, EmbedKind, EmptyAnswerError, GeneratorStream, Message, ModelError, ModelRequestError,
    RequestFailure, StructuredOutputError, Usage, well_formed,
)
from drift_lance.models.compat import native_dimension
from drift_lance.models.deadline import time_left
from drift_lance.models.limits import ConcurrencyLimiter, shared_limiter
from drift_lance.models.structured import parse_structured, response_format_for, schema_instruction
from drift_lance.models.tokens import tokenizer_for_model

log = logging.getLogger(__name__)

T = TypeVar("T")

OPENAI_DEFAULT_ENDPOINT = "https://api.openai.com/v1"
_NO_KEY = "sk-no-key-required"  # the SDK insists on a key; local servers ignore it
_RETRYABLE_STATUS = {408, 409, 429}
_MODE_UNSUPPORTED_STATUS = {400, 422}

# Structured-output steps, most to least constrained; each is (name, response_format kind).
_STEPS = ("json_schema", "json_object_schema", "json_object", "prompt")
_STEPS_FOR_MODE = {
    "auto": _STEPS,
    "json_schema": ("json_schema",),
    "json_object": ("json_object_schema", "json_object"),
    "prompt": ("prompt",),
}
# (endpoint, model) -> first structured step that worked / whether stream_options is rejected
_structured_step: dict[tuple[str, str], str] = {}
_no_stream_options: set[tuple[str, str]] = set()
# (endpoint, model) -> the step a call fell back to after a refusal that did not name the format
_unexplained_fallback: dict[tuple[str, str], str] = {}
# (endpoint, model)s that want the output cap as max_completion_tokens (OpenAI's reasoning models
# reject max_tokens); everything else gets max_tokens, which every OpenAI-compatible server reads.
_wants_max_completion_tokens: set[tuple[str, str]] = set()
# (endpoint, model) -> sampling parameters the model refused (OpenAI's reasoning models: temperature
# other than 1, top_p); they are left out from then on, so the server's default applies.
_refused_params: dict[tuple[str, str], frozenset[str]] = {}
_memory_lock = threading.Lock()
# Parameters a call may go without: the server's default is what a refusing model would use anyway.
_DROPPABLE_PARAMS = frozenset({"temperature", "top_p", "n", "seed"})
# OpenAI's wording (Azure's too): "Unsupported value: 'temperature' does not support 0.0 with this
# model. Only the default (1) value is supported." / "Unsupported parameter: 'top_p' is not supported
# with this model."
_UNSUPPORTED_PARAM = re.compile(r"unsupported (?:parameter|value):\s*'(\w+)'", re.IGNORECASE)


_HTML_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)
_HTML_TAG = re.compile(r"<[^>]*>")
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f]")  # C0/C1 controls (ANSI escapes), not whitespace


# "format" covers response_format, "schema" json_schema / json schema
_FORMAT_WORDS = ("format", "schema", "json_object", "structured", "grammar")


def _about_output_format(message: str) -> bool:
    """Whether a server's refusal is about the requested output format (what a fall back fixes)."""
    text = message.lower()
    return any(word in text for word in _FORMAT_WORDS)


# ---------------------------------------------------------------- retry policy


def _is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, (openai.APITimeoutError, openai.APIConnectionError, TimeoutError)):
        return True
    if isinstance(exc, (json.JSONDecodeError, openai.APIResponseValidationError, _UnreadableResponse)):
        return True  # a garbled body (proxy hiccup, truncated response): worth another try
    if isinstance(exc, openai.APIStatusError):
        if _refuses_response_format(exc.status_code, _error_message(exc)):
            return False  # asking again gets the same refusal; the structured chain falls back
        return exc.status_code in _RETRYABLE_STATUS or exc.status_code >= 500
    return False


def _refuses_response_format(status: int | None, message: str) -> bool:
    """Whether an error is a server refusing the response_format: a 400/422, or a 5xx that names it
    (llama.cpp's server before json_schema support, and ik_llama.cpp, answer json_schema with a 500
    'response_format type must be one of "text" or "json_object", but got: json_schema')."""
    if status in _MODE_UNSUPPORTED_STATUS:
        return True
    return status is not None and status >= 500 and "response_format" in message


def retry_after_seconds(exc: BaseException) -> float | None:
    """Seconds the server asked us to wait (retry-after-ms, retry-after seconds or HTTP date)."""
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    if not headers:
        return None
    try:
        if (ms := headers.get("retry-after-ms")) is not None:
            return max(float(ms) / 1000.0, 0.0)
        value = headers.get("retry-after")
        if value is None:
            return None
        try:
            return max(float(value), 0.0)
        except ValueError:
            when = email.utils.parsedate_to_datetime(value)
            return max(when.timestamp() - time.time(), 0.0)
    except (TypeError, ValueError, OverflowError):
        return None


class _BackoffWait(wait_base):
    """Retry-After when the server sent one, else exponential backoff with full jitter."""

    def __init__(self, base: float, cap: float):
        self.base = base
        self.cap = cap

    def __call__(self, retry_state: RetryCallState) -> float:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        hinted = retry_after_seconds(exc) if exc is not None else None
        if hinted is not None:
            # honour the hint; a little jitter spreads out callers told the same instant
            return min(hinted, self.cap) + random.uniform(0, min(0.1 * hinted, 1.0))
        exp = self.base * (2 ** (retry_state.attempt_number - 1))
        return random.uniform(0, min(exp, self.cap))


class _ConnectionFailures(stop_base):
    """Stop once `attempts` attempts of one call have failed to connect at all: nothing answered,
    so waiting through every backoff of `max_retries` (minutes) would only delay the error."""

    def __init__(self, attempts: int, timeout: float):
        self.attempts = attempts
        self.timeout = timeout
        self.failures = 0  # one instance per call (`_Endpoint._retried` builds its AsyncRetrying)

    def __call__(self, retry_state: RetryCallState) -> bool:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        if exc is not None and _describe(exc, self.timeout)[2] == "connection":
            self.failures += 1
        return self.failures >= self.attempts


class _WaitPastDeadline(stop_base):
    """Stop when the wait before the next attempt would outlast the call's `llm_timeout`: the retry
    could not be made anyway, and the error then names what failed (a 429 asking for a longer wait,
    a 5xx) instead of the timeout, without idling until it."""

    def __init__(self) -> None:
        self.wait: float | None = None  # the wait that was not made

    def __call__(self, retry_state: RetryCallState) -> bool:
        left = time_left()
        if left is None or retry_state.upcoming_sleep < left:
            return False
        self.wait = retry_state.upcoming_sleep
        return True


def _describe(exc: BaseException, timeout: float) -> tuple[str, int | None, RequestFailure]:
    """(reason for the log and the error message, HTTP status or None, kind of failure)."""
    if isinstance(exc, (openai.APITimeoutError, TimeoutError)):
        # The SDK's aiohttp transport reports a refused or dropped connection, and a host name that
        # does not resolve (socket.gaierror), as a connect timeout.
        refused = _connection_failure_in(exc)
        if refused is not None:
            return f"connection failed: {refused}", None, "connection"
        return f"request timed out after {timeout:g}s", None, "timeout"
    if isinstance(exc, (_WebPageResponse, _NestedTooDeep, _UnreadableResponse)):
        return str(exc), None, "malformed"
    if isinstance(exc, _ResponseTooLarge):
        return str(exc), None, "too_large"
    if isinstance(exc, _StreamTooLong):
        return str(exc), None, "timeout"
    if isinstance(exc, (json.JSONDecodeError, openai.APIResponseValidationError)):
        return f"malformed response body: {exc}", None, "malformed"
    if isinstance(exc, openai.APIStatusError):
        return f"HTTP {exc.status_code}: {_error_message(exc)}", exc.status_code, "status"
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__ or exc
        return f"connection failed: {cause}", None, "connection"
    return f"{type(exc).__name__}: {exc}", None, "other"


def _connection_failure_in(exc: BaseException) -> BaseException | None:
    """The innermost exception under `exc` that says the connection failed (an OSError that is not a
    timeout, or aiohttp's own), or None. Walks causes first: an exception's context can be an
    unrelated one that was being handled when it was raised (a RuntimeError from a loop lookup)."""
    found = None
    seen = {id(exc)}
    while (inner := exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)) is not None:
        if id(inner) in seen:
            break
        seen.add(id(inner))
        exc = inner
        failed = isinstance(exc, OSError) or type(exc).__module__.startswith("aiohttp")
        if failed and not isinstance(exc, TimeoutError):
            found = exc
    return found


class _WebPageResponse(Exception):
    """A 200 whose body is a web page, not the API's JSON: the base URL points at a web UI, a login
    page or a proxy's portal. Asking again gets the same page, so it is not retried."""

    def __init__(self, endpoint: str, page: str):
        title = _HTML_TITLE.search(page)
        named = f" ({' '.join(title.group(1).split())[:100]!r})" if title else ""
        super().__init__(f"the endpoint answered with a web page{named}, not the API's JSON: is {endpoint} the "
                         "OpenAI-compatible API's base URL (usually ending in /v1)?")


class _NestedTooDeep(Exception):
    """A response body nested deeper than Python's JSON decoder recurses; asking again gets the same."""


class _UnreadableResponse(Exception):
    """aiohttp's HTTP parser refused the response (a malformed status line, header or chunk, as a
    broken proxy sends): the SDK's aiohttp transport passes that error on unwrapped, where it
    failed a search as an internal error rather than the model's. Retried as a garbled body."""

    def __init__(self, exc: Exception):
        words = getattr(exc, "message", None) or str(exc) or type(exc).__name__
        super().__init__(f"malformed response: the HTTP response could not be read: {' '.join(str(words).split())}")


def _unreadable(exc: Exception) -> bool:
    """Whether `exc` is an aiohttp client error the SDK left unwrapped (without importing aiohttp)."""
    return type(exc).__module__.startswith("aiohttp.") and not isinstance(exc, (openai.APIError, TimeoutError))


# An event stream frames every token in a JSON chunk (~200 bytes at OpenAI, ~600 with Azure's filter
# results), so its bytes on the wire may be this many times max_response_bytes; its text may not.
_STREAM_FRAMING = 8


class _ResponseTooLarge(openai.OpenAIError):
    """A response past `max_response_bytes`: a server generating without end, or a hostile one. Raised
    while the body arrives (an OpenAIError, so the SDK passes it on as it is); not retried."""

    def __init__(self, limit: int, what: str = "bytes"):
        super().__init__(f"response too large: more than {limit:,} {what} (max_response_bytes)")


class _StreamTooLong(openai.OpenAIError):
    """An event stream still going at `stream_timeout`: the read timeout only bounds the wait for
    the next byte, so a server sending one a second held a stream forever."""

    def __init__(self, seconds: float):
        super().__init__(f"the answer stream did not end within {seconds:g}s (stream_timeout); a model that does not "
                         "stop, or a server sending a byte at a time?")


class _CappedStream(httpx2.AsyncByteStream):
    """A response's raw bytes, failing once more than `limit` have arrived (or, with `seconds`, once
    it has lasted that long): every body the SDK reads (answers, error pages, event streams) is
    read through one."""

    def __init__(self, inner: httpx2.AsyncByteStream, limit: int, what: str, seconds: float | None = None):
        self._inner = inner
        self._limit = limit
        self._what = what
        self._seconds = seconds

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        clock = asyncio.get_running_loop().time
        until = None if self._seconds is None else clock() + self._seconds
        async for chunk in self._inner:
            seen += len(chunk)
            if seen > self._limit:
                raise _ResponseTooLarge(self._limit, self._what)
            if until is not None and clock() > until:
                raise _StreamTooLong(self._seconds)  # type: ignore[arg-type]
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


# What a model call can fail with, request or stream, each described by `_describe`: the SDK's errors,
# timeouts, and bodies that are not what the protocol says.
_CALL_FAILURES = (openai.APIError, TimeoutError, json.JSONDecodeError, _WebPageResponse, _NestedTooDeep,
                  _UnreadableResponse, _ResponseTooLarge, _StreamTooLong)


def _is_event_stream(response: httpx2.Response) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


def _is_web_page(response: httpx2.Response, content: bytes) -> bool:
    return "html" in response.headers.get("content-type", "") or content.lstrip()[:1] == b"<"


def _error_message(exc: openai.APIStatusError) -> str:
    """The server's own words, on one line of printable text: they reach the log, where a newline
    or an ANSI escape in an error body wrote forged log lines."""
    return " ".join(_CONTROL.sub("?", _server_words(exc)).split())


def _server_words(exc: openai.APIStatusError) -> str:
    """OpenAI's error.message, FastAPI's detail (vLLM), or a plain-text or HTML body (Ollama's
    "404 page not found", a proxy's 502 page); the SDK's message says only "Error code: 404" for
    those."""
    body = exc.body
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if isinstance(body.get("detail"), str):
            return body["detail"]
    if isinstance(body, str) and body.strip():
        title = _HTML_TITLE.search(body)
        text = title.group(1) if title else _HTML_TAG.sub(" ", body)
        return " ".join(text.split())[:200]
    return str(exc.message)


# ---------------------------------------------------------------- shared plumbing


class _Endpoint:
    """One OpenAI-compatible endpoint + model: client per event loop, limiter, retry policy."""

    def __init__(self, settings: ModelSettings, *, model: str, embeddings: bool):
        self.settings = settings
        self.model = model
        self.azure = (settings.embedding_backend if embeddings else settings.chat_backend) == "azure"
        base_url = (settings.embedding_base_url or settings.base_url) if embeddings else settings.base_url
        self.base_url = base_url
        api_key = (settings.embedding_api_key or settings.api_key) if embeddings else settings.api_key
        self._api_key = api_key.get_secret_value() if api_key else None
        self.endpoint = (settings.azure_endpoint if self.azure else base_url) or OPENAI_DEFAULT_ENDPOINT
        self.embeddings = embeddings
        self._check_configured(model, embeddings)
        self.limiter: ConcurrencyLimiter = shared_limiter(self.endpoint, model, settings.max_concurrency)
        # httpx connection pools belong to the loop that opened them: one client per loop.
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, openai.AsyncOpenAI] = (
            weakref.WeakKeyDictionary()
        )
        self._closers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncIterator[None]] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def key(self) -> tuple[str, str]:
        return (self.endpoint, self.model)

    def _check_configured(self, model: str, embeddings: bool) -> None:
        """ConfigError now, naming what is missing, rather than at the first call of a query (a
        service would report ready and fail every search)."""
        what = f"{'embedding' if embeddings else 'chat'} model {model!r}"
        if self.azure:
            missing = [name for name, value in (("azure_endpoint (AZURE_OPENAI_ENDPOINT)", self.settings.azure_endpoint),
                                                ("api_version (OPENAI_API_VERSION)", self.settings.api_version)) if not value]
            if missing:
                raise ConfigError(f"{what}: the azure backend needs {' and '.join(missing)}")
            if not self._api_key:
                raise ConfigError(f"{what}: no API key for Azure OpenAI at {self.endpoint}: set AZURE_OPENAI_API_KEY "
                                  "(or DRIFT_LANCE_MODEL_API_KEY)")
        elif not self._api_key and not self.base_url:
            raise ConfigError(f"{what}: no API key for {OPENAI_DEFAULT_ENDPOINT}: set OPENAI_API_KEY (or "
                              "DRIFT_LANCE_MODEL_API_KEY), or point OPENAI_BASE_URL at an OpenAI-compatible server")

    def client(self) -> openai.AsyncOpenAI:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = self._clients[loop] = self._make_client()
            self._closers[loop] = _close_at_loop_shutdown(loop, client)
        return client

    def _make_client(self) -> openai.AsyncOpenAI:
        s = self.settings
        common: dict[str, Any] = {"timeout": s.request_timeout, "max_retries": 0, "http_client": self._http_client()}
        if self.azure:  # _check_configured made sure of the endpoint, version and key
            return openai.AsyncAzureOpenAI(
                azure_endpoint=s.azure_endpoint,
                api_version=s.api_version,
                api_key=self._api_key,
                **common,
            )
        api_key = self._api_key or (_NO_KEY if self.base_url else None)
        return openai.AsyncOpenAI(api_key=api_key, base_url=self.base_url, organization=s.organization, **common)

    def _http_client(self) -> httpx2.AsyncClient:
        """The HTTP client under the SDK: aiohttp's transport unless settings ask for httpx or a
        proxy is set in the environment (httpx reads HTTP(S)_PROXY / ALL_PROXY, aiohttp's transport
        would silently ignore them). Both with the SDK's defaults and one shared TLS context."""
        choice = self.settings.http_client
        timeout = self.settings.request_timeout
        hooks = {"response": [self._cap_response]}
        if choice == "httpx" or (choice == "auto" and _proxy_in_environment()):
            return openai.DefaultAsyncHttpxClient(timeout=timeout, verify=_tls_context(), event_hooks=hooks)
        return openai.DefaultAioHttpClient(timeout=timeout, verify=_tls_context(), event_hooks=hooks)

    async def _cap_response(self, response: httpx2.Response) -> None:
        """Bound the bytes of every response (read by the SDK or by us) before its body is read: an
        endless or multi-GB body, answer or error page, fails the call instead of filling memory."""
        streamed = _is_event_stream(response)
        limit = self.settings.max_response_bytes * (_STREAM_FRAMING if streamed else 1)
        what = f"bytes of event stream ({_STREAM_FRAMING} x the answer's bound)" if streamed else "bytes"
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _ResponseTooLarge(limit, f"{what} ({int(declared):,} declared)")
        seconds = self.settings.stream_timeout if streamed else None  # a whole request: request_timeout
        response.stream = _CappedStream(response.stream, limit, what, seconds)

    async def post_json(self, client: openai.AsyncOpenAI, path: str, body: dict[str, Any]) -> Any:
        """POST `body` to `path` through the SDK (base URL, auth, Azure deployment routing, status
        errors) and return the decoded JSON response."""
        response = await client.post(path, body=body, cast_to=httpx2.Response, stream=True)
        try:
            content = await self._read_body(response)
        finally:
            await response.aclose()
        try:
            return json.loads(content)
        except json.JSONDecodeError:
            if _is_web_page(response, content):
                raise _WebPageResponse(self.endpoint, content.decode("utf-8", "replace")) from None
            raise
        except RecursionError:  # escaped the model's error handling: the search failed as a bug (500)
            raise _NestedTooDeep(f"malformed response body: JSON nested too deeply to decode ({len(content)} "
                                 "bytes)") from None

    async def _read_body(self, response: httpx2.Response) -> bytes:
        """The body as decoded (unzipped), bounded as it unpacks: the raw bytes' cap alone would let a
        small compressed body expand without limit."""
        limit = self.settings.max_response_bytes
        parts: list[bytes] = []
        size = 0
        async for part in response.aiter_bytes():
            size += len(part)
            if size > limit:
                raise _ResponseTooLarge(limit, "bytes unpacked")
            parts.append(part)
        return b"".join(parts)

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        client = self._clients.pop(loop, None)
        self._closers.pop(loop, None)
        if client is not None:
            await client.close()

    async def call(
        self, what: str, request: Callable[[openai.AsyncOpenAI], Awaitable[T]], *, hold_slot: bool = True
    ) -> T:
        """Run `request` under the limiter and the retry policy; ModelRequestError when it fails for
        good. With hold_slot=False the caller already holds a limiter slot."""
        client = self.client()
        # The first attempt runs outside tenacity: building and stepping an AsyncRetrying took ~20 us
        # of loop CPU a call, for calls that nearly all succeed at once. A failure is handed to the
        # policy as its first attempt, so retries, stops, waits, logs and errors are as before.
        try:
            return await self._attempt(client, request, hold_slot)
        except Exception as exc:
            failed = exc
        return await self._retried(what, client, request, hold_slot, failed)

    async def _attempt(
        self, client: openai.AsyncOpenAI, request: Callable[[openai.AsyncOpenAI], Awaitable[T]], hold_slot: bool
    ) -> T:
        """One request, holding a limiter slot (unless the caller does) and bounded by request_timeout."""
        async with self.limiter.slot() if hold_slot else contextlib.nullcontext():
            async with asyncio.timeout(self.settings.request_timeout):
                try:
                    return await request(client)
                except Exception as exc:
                    if _unreadable(exc):
                        raise _UnreadableResponse(exc) from exc
                    raise

    async def _retried(
        self, what: str, client: openai.AsyncOpenAI, request: Callable[[openai.AsyncOpenAI], Awaitable[T]],
        hold_slot: bool, failed: Exception,
    ) -> T:
        """The retry policy over a call whose first attempt failed with `failed`."""
        s = self.settings
        past_deadline = _WaitPastDeadline()
        retrying = AsyncRetrying(
            stop=(stop_after_attempt(s.max_retries + 1) | _ConnectionFailures(s.connect_retries + 1, s.request_timeout)
                  | past_deadline),
            wait=_BackoffWait(s.retry_base_wait, s.retry_max_wait),
            retry=retry_if_exception(_is_retryable),
            before_sleep=self._log_retry,
            reraise=True,
        )
        first: Exception | None = failed
        try:
            async for attempt in retrying:
                with attempt:
                    if first is not None:
                        replayed, first = first, None
                        raise replayed  # the first attempt's failure, as the policy's first attempt
                    return await self._attempt(client, request, hold_slot)
        except _CALL_FAILURES as exc:
            attempts = retrying.statistics.get("attempt_number", 1)
            reason, status, failure = _describe(exc, s.request_timeout)
            tries = f" after {attempts} attempts" if attempts > 1 else ""
            cut = "" if past_deadline.wait is None else (
                f" (not retried: waiting {past_deadline.wait:.1f} s would outlast llm_timeout)")
            raise ModelRequestError(
                f"{what} {self.model!r} at {self.endpoint} failed{tries}: {reason}{self._hint(status, failure)}{cut}",
                status=status, failure=failure,
                attempts=attempts,
            ) from exc
        raise AssertionError("unreachable: tenacity either returns or raises")

    def _hint(self, status: int | None, failure: RequestFailure) -> str:
        """What to check when a server has no such route (the usual cause is a base URL without /v1:
        vLLM, Ollama and llama.cpp's server serve the OpenAI API under /v1), or answers too much."""
        if failure == "too_large":
            if self.embeddings:  # ~20 bytes a float in a JSON list: 16 MiB holds ~270 3072-d vectors
                return "; for batches this large raise max_response_bytes or lower embedding_batch_size"
            return "; a model that does not stop generating?"
        if status != 404 or self.azure or "/v1" in httpx2.URL(self.endpoint).path:
            return ""
        return f"; is /v1 missing from the base URL (OPENAI_BASE_URL / base_url)? try {self.endpoint}/v1"

    def _log_retry(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        reason = _describe(exc, self.settings.request_timeout)[0] if exc else "?"
        wait = state.next_action.sleep if state.next_action else 0.0
        log.warning("%s at %s: %s; retry %d in %.2fs", self.model, self.endpoint, reason, state.attempt_number, wait)


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context (the SDK's default: system or certifi CAs, SSL_CERT_FILE/DIR honoured) for
    every client: loading the CA bundle costs ~40 ms per client, and a query opens two (chat,
    embeddings), one per event loop."""
    return httpx2.create_ssl_context()


def _close_at_loop_shutdown(loop: asyncio.AbstractEventLoop, client: openai.AsyncOpenAI) -> AsyncIterator[None]:
    """Close `client` when its event loop shuts down, for models nobody closed: a model used from
    several `asyncio.run` calls gets one client per loop, and an aiohttp session left open warns when
    collected. The loop finalizes async generators it saw start (`asyncio.run` and pytest-asyncio
    do, before closing); the caller keeps the generator alive until then."""

    async def closer() -> AsyncIterator[None]:
        try:
            yield
        finally:
            await client.close()

    generator = closer()
    loop.create_task(anext(generator))  # first step registers it with the loop's asyncgen hooks
    return generator


# ---------------------------------------------------------------- chat


class OpenAIChatModel:
    """ChatModel over any OpenAI-compatible /chat/completions endpoint (or Azure OpenAI)."""

    def __init__(self, settings: ModelSettings):
        settings = settings.resolve()
        model = (settings.deployment if settings.chat_backend == "azure" else None) or settings.chat_model
        if not model:
            raise ConfigError("chat_model: no chat model configured for the openai backend")
        self.model_id = model
        self.settings = settings
        self._endpoint = _Endpoint(settings, model=model, embeddings=False)
        self._tokenizer = tokenizer_for_model(model)

    @property
    def limiter(self) -> ConcurrencyLimiter:
        return self._endpoint.limiter

    @property
    def endpoint(self) -> str:
        """The base URL, or the Azure resource (whose deployment is `model_id`)."""
        return self._endpoint.endpoint

    async def aclose(self) -> None:
        await self._endpoint.aclose()

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        params: ChatParams | None = None,
        response_model: type[BaseModel] | None = None,
    ) -> ChatResult:
        payload = [m.as_dict() for m in messages]
        kwargs = _params_kwargs(params)
        if response_model is None:
            response = await self._create(payload, kwargs)
            result = await self._result(payload, response)
            if (why := _why_no_text(result.text, *_finish_and_refusal(response))) is not None:
                raise EmptyAnswerError(self._no_answer(why), usage=result.usage)
            return result
        return await self._complete_structured(payload, kwargs, response_model)

    def stream(self, messages: Sequence[Message], *, params: ChatParams | None = None) -> OpenAIChatStream:
        return OpenAIChatStream(self, [m.as_dict() for m in messages], _params_kwargs(params))

    # -- structured output

    def _steps(self) -> tuple[str, ...]:
        steps = _STEPS_FOR_MODE[self.settings.structured_output]
        remembered = _structured_step.get(self._endpoint.key)
        if remembered in steps:
            return steps[steps.index(remembered) :]
        return steps

    async def _complete_structured(
        self, payload: list[dict], kwargs: dict[str, Any], response_model: type[BaseModel]
    ) -> ChatResult:
        steps = self._steps()
        format_rejected = False  # a step was refused with a message about the output format
        for i, step in enumerate(steps):
            request_kwargs = dict(kwargs)
            messages = payload
            if step != "json_schema":
                messages = _with_instruction(payload, schema_instruction(response_model))
            response_format = _response_format(step, response_model)
            if response_format is not None:
                request_kwargs["response_format"] = response_format
            try:
                response = await self._create(messages, request_kwargs)
            except ModelRequestError as exc:
                if _refuses_response_format(exc.status, str(exc)) and i + 1 < len(steps):
                    log.info("%s at %s rejected %s (%s); trying %s", self.model_id, self._endpoint.endpoint,
                             step, exc, steps[i + 1])
                    format_rejected = format_rejected or _about_output_format(str(exc))
                    continue
                raise
            self._remember_step(steps, step, format_rejected)
            result = await self._result(messages, response)
            if (why := _why_no_text(result.text, *_finish_and_refusal(response))) is not None:
                raise StructuredOutputError(self._no_answer(why), text="", usage=result.usage)
            result.parsed = await _off_loop_if_long(result.text, parse_structured, result.text, response_model,
                                                    usage=result.usage)
            return result
        raise AssertionError("unreachable: the last step either returns or raises")

    def _remember_step(self, steps: tuple[str, ...], step: str, format_rejected: bool) -> None:
        """Remember the step that answered, so later calls start there. A fall back after a refusal
        that names the output format is remembered at once; after one that does not (a context-length
        error, a transient 400 from a proxy) only when the next call falls back the same way, so one
        stray 400 does not cost a long-running service strict json_schema for good."""
        key = self._endpoint.key
        with _memory_lock:
            fell_back = step != steps[0]
            if not fell_back or format_rejected or _unexplained_fallback.get(key) == step:
                _structured_step[key] = step
                _unexplained_fallback.pop(key, None)
            else:
                _unexplained_fallback[key] = step

    # -- plumbing

    async def with_accepted_params(self, kwargs: dict[str, Any], send: Callable[[dict[str, Any]], Awaitable[T]]) -> T:
        """`send(kwargs)` with the parameters this endpoint and model accept: the output cap as
        max_tokens, or as max_completion_tokens once the server has said so, and without sampling
        parameters the model refused (OpenAI's reasoning models take neither temperature 0 nor
        top_p). What a refusal taught is remembered per endpoint and model."""
        key = self._endpoint.key

        def accepted() -> dict[str, Any]:
            refused = _refused_params.get(key, frozenset())
            named = {k: v for k, v in kwargs.items() if k not in refused}
            if "max_tokens" in named and key in _wants_max_completion_tokens:
                named["max_completion_tokens"] = named.pop("max_tokens")
            return named

        while True:
            sent = accepted()
            try:
                return await send(sent)
            except ModelRequestError as exc:
                if not self._learn_from_refusal(exc, sent):
                    raise

    def _learn_from_refusal(self, exc: ModelRequestError, sent: dict[str, Any]) -> bool:
        """Whether `exc` refused a parameter of `sent` that the call can do without (now remembered)."""
        if exc.status != 400:
            return False
        key = self._endpoint.key
        if "max_tokens" in sent and "max_completion_tokens" in str(exc):
            log.info("%s at %s wants max_completion_tokens; sending the cap under that name",
                     self.model_id, self._endpoint.endpoint)
            with _memory_lock:
                _wants_max_completion_tokens.add(key)
            return True
        param = _refused_param(exc)
        if param in _DROPPABLE_PARAMS and param in sent:
            log.info("%s at %s does not take %s=%r; leaving it to the model's default",
                     self.model_id, self._endpoint.endpoint, param, sent[param])
            with _memory_lock:
                _refused_params[key] = _refused_params.get(key, frozenset()) | {param}
            return True
        return False

    async def _create(self, messages: list[dict], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The JSON body of one /chat/completions response."""
        endpoint = self._endpoint

        async def send(named: dict[str, Any]) -> Any:
            body = {"model": self.model_id, "messages": messages, **named}

            async def request(client: openai.AsyncOpenAI) -> Any:
                return await endpoint.post_json(client, "/chat/completions", body)

            return await endpoint.call("chat model", request)

        response = await self.with_accepted_params(kwargs, send)
        if not isinstance(response, dict):
            raise ModelRequestError(
                f"chat model {self.model_id!r} at {endpoint.endpoint} failed: malformed response body: "
                f"expected a JSON object, got {type(response).__name__}", failure="malformed"
            )
        return response

    async def _result(self, messages: list[dict], response: dict[str, Any]) -> ChatResult:
        text = _completion_text(response)
        usage = _usage_from(response.get("usage")) or await _off_loop_if_long(text, self._count, messages, text)
        return ChatResult(text=text, usage=usage, model=str(response.get("model") or self.model_id), raw=response)

    def _no_answer(self, why: str) -> str:
        return f"chat model {self.model_id!r} at {self._endpoint.endpoint} returned no text: {why}"

    def _count(self, messages: list[dict], text: str) -> Usage:
        prompt = sum(self._tokenizer.count(m["content"]) for m in messages)
        return Usage(prompt, self._tokenizer.count(text), 1, counted=True)


# Answers longer than this are parsed and counted on a worker thread: JSON repair takes 0.2-0.4 s a
# MB in Python, counting 0.04 s (tiktoken) to 0.5 s (pure Python); a 5 MB unterminated JSON answer
# held the event loop 2.1 s. The thread takes turns at the GIL, so the loop runs every few ms.
_OFF_LOOP_CHARS = 256 * 1024


async def _off_loop_if_long(text: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    if len(text) < _OFF_LOOP_CHARS:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


def _refused_param(exc: ModelRequestError) -> str | None:
    """The parameter a server's "Unsupported parameter/value: 'x'" refusal names, or None."""
    found = _UNSUPPORTED_PARAM.search(str(exc))
    return found.group(1) if found else None


def _refuses_a_call_parameter(exc: ModelRequestError) -> bool:
    """Whether a refusal is about the output cap's name or a droppable sampling parameter."""
    return "max_completion_tokens" in str(exc) or _refused_param(exc) in _DROPPABLE_PARAMS


_PARAM_FIELDS = tuple(field.name for field in dataclasses.fields(ChatParams))


def _params_kwargs(params: ChatParams | None) -> dict[str, Any]:
    if params is None:
        return {}
    # In ChatParams' field order, not a set's: the body is the same bytes in every process.
    return {name: value for name in _PARAM_FIELDS if (value := getattr(params, name)) is not None}


@functools.cache
def _response_format(step: str, response_model: type[BaseModel]) -> dict[str, Any] | None:
    """The request's response_format for `step`, built once per step and response model (the strict
    schema's copy and walk took ~10 us of loop CPU a call); shared, so read-only: the SDK only
    serializes it."""
    if step == "json_schema":
        return response_format_for("json_schema", response_model)
    if step == "json_object_schema":
        return response_format_for("json_object", response_model)
    if step == "json_object":
        return {"type": "json_object"}
    return None


def _with_instruction(payload: list[dict], instruction: str) -> list[dict]:
    """Add the JSON instruction to the (first) system message, creating one if needed: several chat
    templates accept only a single, leading system message."""
    if payload and payload[0]["role"] == "system":
        first = dict(payload[0])
        first["content"] = f"{first['content']}\n\n{instruction}"
        return [first, *payload[1:]]
    return [{"role": "system", "content": instruction}, *payload]


def _completion_text(response: dict[str, Any]) -> str:
    """The first choice's message text ("" when the server sent no choice or no content)."""
    choices = response.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    return well_formed(content) if isinstance(content, str) else ""


def _finish_and_refusal(response: dict[str, Any]) -> tuple[Any, Any]:
    """The first choice's finish_reason and message.refusal (None where absent)."""
    choices = response.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = choice.get("message")
    return choice.get("finish_reason"), message.get("refusal") if isinstance(message, dict) else None


def _why_no_text(text: str, finish_reason: Any, refusal: Any) -> str | None:
    """Why an answer has no text, when the server said so; None when there is text (or no reason).
    A blank answer would otherwise pass for one: an empty DRIFT answer, with exit status 0."""
    if text.strip():
        return None
    if isinstance(refusal, str) and refusal.strip():
        return f"the model refused: {' '.join(refusal.split())[:300]}"
    if finish_reason == "content_filter":
        return "the provider's content filter blocked the answer (finish_reason content_filter)"
    if finish_reason == "length":
        return ("the output cap ran out before any answer text (finish_reason length); a reasoning model "
                "may have spent it on reasoning: raise the cap or leave it unset")
    return None


def _usage_from(usage: Any) -> Usage | None:
    """Usage from a response's `usage` (a dict from a raw body, or the SDK's object from a stream)."""
    if isinstance(usage, dict):
        prompt, output = usage.get("prompt_tokens"), usage.get("completion_tokens")
    else:
        prompt, output = getattr(usage, "prompt_tokens", None), getattr(usage, "completion_tokens", None)
    if prompt is None:
        return None
    try:
        return Usage(int(prompt), int(output or 0), 1)
    except (TypeError, ValueError):
        return None


def _proxy_in_environment() -> bool:
    return any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy",
                                                 "ALL_PROXY", "all_proxy"))


class OpenAIChatStream(GeneratorStream):
    """Text deltas of one streamed completion. Holds a concurrency slot while open; `aclose()`
    closes the HTTP response (the server sees the disconnect)."""

    def __init__(self, model: OpenAIChatModel, messages: list[dict], kwargs: dict[str, Any]):
        super().__init__()
        self._model = model
        self._messages = messages
        self._kwargs = kwargs

    async def _open(self) -> Any:
        return await self._model.with_accepted_params(self._kwargs, self._open_with)

    async def _open_with(self, kwargs: dict[str, Any]) -> Any:
        model = self._model
        endpoint = model._endpoint
        with_usage = endpoint.key not in _no_stream_options

        async def request(client: openai.AsyncOpenAI) -> Any:
            extra = {"stream_options": {"include_usage": True}} if with_usage else {}
            return await client.chat.completions.create(
                model=model.model_id, messages=self._messages, stream=True, **kwargs, **extra
            )

        try:
            return await endpoint.call("chat model", request, hold_slot=False)
        except ModelRequestError as exc:
            if not (with_usage and exc.status in _MODE_UNSUPPORTED_STATUS) or _refuses_a_call_parameter(exc):
                raise  # not about stream_options; a refused call parameter is handled by the caller
            log.info("%s at %s rejected stream_options; streaming without", model.model_id, endpoint.endpoint)
            with _memory_lock:
                _no_stream_options.add(endpoint.key)
            return await self._open_with(kwargs)

    async def _run(self) -> AsyncIterator[str]:
        model = self._model
        parts: list[str] = []
        reported: Usage | None = None
        finish_reason = refusal = None
        limit, size = model.settings.max_response_bytes, 0
        chunks = 0
        # The slot is held for the whole stream: the server is busy until the last chunk.
        async with model.limiter.slot():
            sdk_stream = await self._open()
            try:
                async for chunk in sdk_stream:
                    chunks += 1
                    if not chunks % 64:  # a server sending faster than we parse never lets the read wait:
                        await asyncio.sleep(0)  # give the loop a turn (an endless stream held it ~1 s at a time)
                    if getattr(chunk, "usage", None) is not None:
                        reported = _usage_from(chunk.usage)
                    for choice in chunk.choices or ():
                        finish_reason = getattr(choice, "finish_reason", None) or finish_reason
                        if choice.delta:  # Azure's content-filter chunks come without one
                            refusal = getattr(choice.delta, "refusal", None) or refusal
                        delta = choice.delta.content if choice.delta else None
                        if delta:
                            delta = well_formed(delta)
                            size += len(delta)
                            if size > limit:  # a model that does not stop: the answer, not just memory, is at stake
                                raise _ResponseTooLarge(limit, "characters of answer")
                            parts.append(delta)
                            yield delta
            except _CALL_FAILURES as exc:  # a JSONDecodeError: a chunk whose data is not JSON
                reason, status, failure = _describe(exc, model.settings.request_timeout)
                raise ModelRequestError(
                    f"chat model {model.model_id!r} stream failed: {reason}{model._endpoint._hint(status, failure)}",
                    status=status, failure=failure
                ) from exc
            except RecursionError:  # a chunk the SDK's JSON decoder cannot go deep enough for
                raise ModelRequestError(f"chat model {model.model_id!r} stream failed: malformed response body: a "
                                        "chunk's JSON is nested too deeply to decode", failure="malformed") from None
            finally:
                await sdk_stream.close()
        self.usage = reported or model._count(self._messages, "".join(parts))
        if (why := _why_no_text("".join(parts), finish_reason, refusal)) is not None:
            raise EmptyAnswerError(model._no_answer(why), usage=self.usage)


# ---------------------------------------------------------------- embeddings


class OpenAIEmbedder:
    """Embedder over an OpenAI-compatible /embeddings endpoint. Batches run concurrently under the
    shared limiter; rows come back in input order, L2-normalised float32."""

    def __init__(self, settings: ModelSettings):
        settings = settings.resolve()
        model = (settings.embedding_deployment if settings.embedding_backend == "azure" else None) or (
            settings.embedding_model
        )
        if not model:
            raise ConfigError("embedding_model: no embedding model configured for the openai backend")
        self.model_id = settings.embedding_model or model
        self._request_model = model
        self.settings = settings
        self.batch_size = settings.embedding_batch_size
        self._endpoint = _Endpoint(settings, model=model, embeddings=True)
        self._float_only = False  # set when the server rejects encoding_format=base64
        # 0 = not known until the first response (an unlisted model on a custom server)
        self.dimension = settings.embedding_dimension or native_dimension(model) or 0

    async def aclose(self) -> None:
        await self._endpoint.aclose()

    async def embed(self, texts: Sequence[str], *, kind: EmbedKind = "document") -> np.ndarray:
        texts = list(texts)
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        batches = [texts[i : i + self.batch_size] for i in range(0, len(texts), self.batch_size)]
        try:
            async with asyncio.TaskGroup() as group:  # one failure cancels the other batches
                tasks = [group.create_task(self._embed_batch(batch)) for batch in batches]
        except BaseExceptionGroup as failed:  # callers catch ModelError, not a group of them
            raise first_cause(failed) from None
        parts = [t.result() for t in tasks]
        if len({part.shape[1] for part in parts}) > 1:  # np.concatenate's ValueError would name no model
            raise ModelError(f"embedding model {self.model_id!r} at {self._endpoint.endpoint} returned vectors of "
                             f"{sorted({part.shape[1] for part in parts})} dimensions in different batches")
        matrix = np.concatenate(parts, axis=0)
        if self.dimension and matrix.shape[1] != self.dimension:
            raise ModelError(
                f"embedding model {self.model_id!r} at {self._endpoint.endpoint} returned "
                f"{matrix.shape[1]}-d vectors, expected {self.dimension}"
            )
        self.dimension = matrix.shape[1]
        return _l2_normalise(matrix)

    async def _embed_batch(self, batch: list[str]) -> np.ndarray:
        # base64 float32 (what OpenAI's own client asks for): the openai client turns a float list
        # into one pydantic value per float, ~15 ms per 20 x 1536 batch; decoding the raw JSON
        # ourselves takes microseconds. Servers that ignore it and send floats are read as well.
        extra: dict[str, Any] = {"encoding_format": "float" if self._float_only else "base64"}
        if self.settings.embedding_dimension:
            extra["dimensions"] = self.settings.embedding_dimension
        # Several servers reject empty strings; a space embeds as "nothing" just as well.
        inputs = [t if t.strip() else " " for t in batch]

        body = {"model": self._request_model, "input": inputs, **extra}

        async def request(client: openai.AsyncOpenAI) -> Any:
            return await self._endpoint.post_json(client, "/embeddings", body)

        try:
            body = await self._endpoint.call("embedding model", request)
        except ModelError as exc:
            if self._float_only or "encoding_format" not in str(exc):
                raise
            self._float_only = True  # a server that rejects base64: ask for floats from now on
            return await self._embed_batch(batch)
        return _embedding_matrix(body, len(batch), self.model_id)


def _embedding_matrix(body: Any, expected: int, model_id: str) -> np.ndarray:
    """The vectors of an embeddings response body (base64 float32 or float lists), in input order:
    one finite, non-empty vector per input, all of one length. Otherwise an input got another's
    vector (a repeated index), or the store or ingest refused a NaN vector naming a table, not the model."""
    try:
        data = body["data"]
        if isinstance(data, list) and len(data) != expected:  # before decoding 350,000 of them (0.5 s)
            raise ModelError(f"embedding model {model_id!r} returned {len(data)} vectors for {expected} inputs")
        rows = sorted(data, key=lambda d: d["index"])
        with np.errstate(over="ignore"):  # a float past float32's range becomes inf, refused below
            vectors = [
                np.frombuffer(base64.b64decode(r["embedding"]), dtype="<f4") if isinstance(r["embedding"], str)
                else np.asarray(r["embedding"], dtype=np.float32)
                for r in rows
            ]
        indices = [r["index"] for r in rows]
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"embedding model {model_id!r} returned an unreadable response: {exc}") from exc
    if indices != list(range(expected)):  # a repeated or missing index would give an input another's vector
        raise ModelError(f"embedding model {model_id!r} returned vectors for inputs {indices[:10]}, expected 0 to "
                         f"{expected - 1} once each")
    if any(v.ndim != 1 or not v.size for v in vectors):
        raise ModelError(f"embedding model {model_id!r} returned a vector that is empty or not a list of numbers")
    if len({len(v) for v in vectors}) > 1:
        raise ModelError(f"embedding model {model_id!r} returned vectors of different lengths")
    matrix = np.stack(vectors).astype(np.float32, copy=False) if vectors else np.zeros((0, 0), dtype=np.float32)
    if not np.isfinite(matrix).all():
        row = int(np.flatnonzero(~np.isfinite(matrix).all(axis=1))[0])
        raise ModelError(f"embedding model {model_id!r} returned a vector with NaN or infinite values (input {row} "
                         "of a request)")
    return matrix


def _l2_normalise(matrix: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    return (matrix / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)
