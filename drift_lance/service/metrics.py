"""Prometheus metrics of one service app (`GET /metrics`).

Each app has its own CollectorRegistry (never prometheus_client's global one), so several apps in
one process, as in tests or an embedding application, count separately. Labels take values from
small fixed sets only (the search method, a pipeline stage, an error code, a failure kind): never
the query, a request id or anything else a client chooses.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextvars import ContextVar
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from drift_lance import __version__
from drift_lance.drift.result import SearchResult
from drift_lance.errors import first_cause
from drift_lance.models.base import (
    ChatModel, ChatParams, ChatResult, ChatStream, EmptyAnswerError, GeneratorStream, Message, ModelError,
    ModelRequestError, StructuredOutputError, Usage,
)

METHODS = ("drift", "local")
# The `stage` of the model calls of a search that was not answered: its result, and with it the
# per-stage counts, never came.
FAILED_STAGE = "failed"
# From a DRIFT primer of a second to a search that runs into the default 300 s search timeout.
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 180, 240, 300)


def model_failure_kind(exc: ModelError) -> str:
    """A model failure's kind, for a label: ModelRequestError's `failure` (status, timeout,
    connection, malformed, too_large, other), `structured_output`, `empty_answer` or `model_error`."""
    if isinstance(exc, ModelRequestError):
        return exc.failure
    if isinstance(exc, StructuredOutputError):
        return "structured_output"
    if isinstance(exc, EmptyAnswerError):
        return "empty_answer"
    return "model_error"


class SearchUsage:
    """The model calls one search has made so far. A search that fails (a model error, a timeout, a
    client that left) has no result to count its tokens from: these are what it cost. A call counts
    from its start, so one still running when the search ends (cut short by the search's timeout or
    its client leaving) is a call without tokens, as a follow-up the time budget cut off is in a
    result; its tokens are added as it ends, and an answer from the response cache is no call."""

    def __init__(self) -> None:
        self.total = Usage()

    def started(self) -> None:
        self.total = self.total + Usage(calls=1)

    def ended(self, usage: Usage | None) -> None:
        one = (usage or Usage()).of_one_call()
        self.total = self.total + Usage(one.prompt_tokens, one.output_tokens, one.calls - 1, one.counted)


_search_usage: ContextVar[SearchUsage | None] = ContextVar("drift_lance_search_usage", default=None)


async def tallied(search: Callable[[], Awaitable[SearchResult]], usage: SearchUsage) -> SearchResult:
    """Run `search()` (as its own task) with `usage` tallying its model calls; the tasks the search
    starts inherit it. A callable, not a coroutine: a task cancelled before it ran leaves none unawaited."""
    _search_usage.set(usage)
    return await search()


def _call_started() -> SearchUsage | None:
    """The running search's tally (None outside a search), with the starting call counted."""
    if (tally := _search_usage.get()) is not None:
        tally.started()
    return tally


# Set on a ModelError once counted, so the search that fails with it does not count it again.
_COUNTED = "_drift_lance_model_failure_counted"


class CountedChat:
    """A chat model whose calls that fail for good (after the model's own retries) are counted by
    kind, and whose calls go to the running search's `SearchUsage`, however they end. Everything
    else (`model_id`, `n_ctx`, ...) is the model's."""

    def __init__(self, model: ChatModel, failures: Counter):
        self._model = model  # not `model`: a model's own attribute of that name stays visible
        self._failures = failures

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def count(self, exc: BaseException) -> None:
        """A call that raised: a ModelError is a model failure (one cut by llm_timeout or by the
        search's end is not)."""
        if isinstance(exc, ModelError):
            self._count_once(exc)

    def count_search_failure(self, exc: BaseException) -> None:
        """A search that failed with `exc`: an empty final answer (a DRIFT reduce, a local answer),
        which the search's own check raises after a call that succeeded, is a model failure of kind
        `empty_answer` too; one the model's call raised was counted then, not again."""
        exc = first_cause(exc)
        if isinstance(exc, EmptyAnswerError):
            self._count_once(exc)

    def _count_once(self, exc: ModelError) -> None:
        if not getattr(exc, _COUNTED, False):
            self._failures.labels(model_failure_kind(exc)).inc()
            setattr(exc, _COUNTED, True)

    async def complete(self, messages: Sequence[Message], *, params: ChatParams | None = None,
                       response_model: Any = None) -> ChatResult:
        tally = _call_started()
        try:
            result = await self._model.complete(messages, params=params, response_model=response_model)
        except BaseException as exc:
            self.count(exc)
            if tally is not None:
                tally.ended(getattr(exc, "usage", None))  # an unusable structured answer still cost its tokens
            raise
        if tally is not None:
            tally.ended(result.usage)
        return result

    def stream(self, messages: Sequence[Message], *, params: ChatParams | None = None) -> ChatStream:
        return _CountedStream(self, self._model.stream(messages, params=params))


class _CountedStream(GeneratorStream):
    def __init__(self, chat: CountedChat, inner: ChatStream):
        super().__init__()
        self._chat = chat
        self._inner = inner

    async def _run(self) -> AsyncIterator[str]:
        tally = _call_started()
        try:
            async for delta in self._inner:
                yield delta
        except BaseException as exc:  # a stream closed or cancelled before its end too
            self._chat.count(exc)
            if tally is not None:
                tally.ended(getattr(exc, "usage", None))
            raise
        finally:
            await self._inner.aclose()
        self.usage = self._inner.usage
        if tally is not None:
            tally.ended(self.usage)


class ServiceMetrics:
    """The service's metrics on their own registry. `generation` reads the served manifest
    generation (None while no store is open) and `in_flight` the running searches, at scrape time."""

    def __init__(self, *, generation: Callable[[], int | None], in_flight: Callable[[], int], slots: int):
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        Info("drift_lance_build", "drift-lance version", registry=registry).info({"version": __version__})

        self.started = Counter("drift_lance_searches_started", "Searches that got a slot and started",
                               ["method"], registry=registry)
        self.finished = Counter("drift_lance_searches_finished",
                                "Searches that ended, by outcome: ok, or the error code the client got",
                                ["method", "outcome"], registry=registry)
        self.duration = Histogram("drift_lance_search_duration_seconds", "Wall time of a search, from its start to its end",
                                  ["method"], buckets=DURATION_BUCKETS, registry=registry)
        self.rejected = Counter("drift_lance_searches_rejected", "Searches refused with 429: every slot was taken",
                                ["method"], registry=registry)
        self.degraded = Counter("drift_lance_searches_degraded",
                                "Searches answered without some of their steps (result.failures > 0)",
                                ["method"], registry=registry)
        self.step_failures = Counter("drift_lance_search_step_failures",
                                     "Steps an answered search had to do without, by stage", ["method", "stage"],
                                     registry=registry)
        by_stage = "of searches, by stage (`failed`: of searches not answered)"
        self.llm_calls = Counter("drift_lance_llm_calls", f"LLM calls {by_stage}", ["method", "stage"], registry=registry)
        self.prompt_tokens = Counter("drift_lance_llm_prompt_tokens", f"Prompt tokens {by_stage}", ["method", "stage"],
                                     registry=registry)
        self.output_tokens = Counter("drift_lance_llm_output_tokens", f"Output tokens {by_stage}", ["method", "stage"],
                                     registry=registry)
        self.model_failures = Counter("drift_lance_model_failures",
                                      "Chat model calls that failed for good (after retries), by the failure's kind",
                                      ["kind"], registry=registry)
        self.reloads = Counter("drift_lance_index_reloads",
                               "Checks for a newer index generation, by outcome: switched, unchanged, failed",
                               ["outcome"], registry=registry)
        self.requests = Counter("drift_lance_http_requests",
                                "HTTP answers by route (`other` for a path the service does not serve) and status",
                                ["route", "status"], registry=registry)
        self.streams_open = Gauge("drift_lance_sse_streams_open", "Server-Sent Events streams being sent",
                                  registry=registry)
        Gauge("drift_lance_searches_in_flight", "Searches running now", registry=registry).set_function(in_flight)
        Gauge("drift_lance_search_slots", "Searches that may run at once (max_concurrent_searches)",
              registry=registry).set(slots)
        registry.register(_GenerationCollector(generation))
        for method in METHODS:  # series exist from the start, so rate() and absent() work at once
            for metric in (self.started, self.rejected, self.degraded, self.duration):
                metric.labels(method)
            self.finished.labels(method, "ok")
        for outcome in ("switched", "unchanged", "failed"):
            self.reloads.labels(outcome)

    def search_ended(self, method: str, started: float, outcome: str, result: SearchResult | None = None,
                     usage: SearchUsage | None = None) -> None:
        """Count a search that ended with `outcome` ("ok" and its result, or the error code sent);
        `started` is its time.perf_counter() at start. A search without a result is counted with
        the model calls it made (`usage`), under stage "failed"."""
        self.duration.labels(method).observe(time.perf_counter() - started)
        self.finished.labels(method, outcome).inc()
        if result is None:
            if usage is not None and (usage.total.calls or usage.total.prompt_tokens or usage.total.output_tokens):
                self._count_calls(method, FAILED_STAGE, usage.total)
            return
        for counter, per_stage in ((self.llm_calls, result.llm_calls_categories),
                                   (self.prompt_tokens, result.prompt_tokens_categories),
                                   (self.output_tokens, result.output_tokens_categories),
                                   (self.step_failures, result.failures_categories)):
            for stage, count in per_stage.items():  # a stage that made no call too: its series exists
                counter.labels(method, stage).inc(count)
        if result.failures > 0:
            self.degraded.labels(method).inc()

    def _count_calls(self, method: str, stage: str, usage: Usage) -> None:
        self.llm_calls.labels(method, stage).inc(usage.calls)
        self.prompt_tokens.labels(method, stage).inc(usage.prompt_tokens)
        self.output_tokens.labels(method, stage).inc(usage.output_tokens)

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The metrics and their content type, in the format the `Accept` header asks for
        (Prometheus' text format, or OpenMetrics)."""
        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type


class CountRequests:
    """ASGI middleware: every HTTP answer counted by route and status. A path the app does not
    serve (a scanner's guesses) counts as `other`, so clients cannot add series."""

    def __init__(self, app: Any, *, metrics: ServiceMetrics, routes: Iterable[str]):
        self.app = app
        self._requests = metrics.requests
        self._routes = frozenset(routes)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def send_counted(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            if status:  # else no answer was sent (the connection went first)
                route = scope["path"] if scope["path"] in self._routes else "other"
                self._requests.labels(route, str(status)).inc()


class _GenerationCollector(Collector):
    """The served manifest generation, read at scrape time; no sample while no store is open."""

    def __init__(self, generation: Callable[[], int | None]):
        self._generation = generation

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily("drift_lance_index_generation", "Manifest generation new searches are served from")
        served = self._generation()
        if served is not None:
            family.add_metric([], served)
        yield family
