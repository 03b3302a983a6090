"""`local` search: graphrag's LocalSearch (one context, one answer) on the LanceDB context builder.

The system prompt is the local-search prompt with the context tables in `{context_data}` and the
answer format in `{response_type}`; the user message is the query. Blocking (`search`) and streamed
(`stream_search`) answers; both honour `llm_timeout` (streams: the wait for each delta).
"""

from __future__ import annotations

import string
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

import numpy as np

from drift_lance._bundled import bundled_prompt
from drift_lance.config import checked_config
from drift_lance.config.local import LocalSearchConfig
from drift_lance.drift.result import SearchResult, to_jsonable
from drift_lance.errors import ConfigError, checked_question
from drift_lance.local.context import LocalContext, LocalContextBuilder
from drift_lance.models.base import (
    ChatModel,
    ChatParams,
    Embedder,
    GeneratorStream,
    Message,
    Usage,
    check_answered,
    check_model_argument,
    fit_to_window,
)
from drift_lance.models.deadline import deltas_within, within
from drift_lance.store import raise_if_store_failed

__all__ = ["LocalSearch", "load_local_prompt"]

PROMPT_FILE = "local_search_system_prompt.txt"
_PLACEHOLDERS = frozenset({"context_data", "response_type"})
ANSWER = "local search answer"  # names the answer call in its errors


def load_local_prompt(path: str | Path | None = None) -> str:
    """The bundled prompt, or the file at `path`; ConfigError naming the file when it uses
    placeholders other than {context_data} / {response_type} or lacks {context_data}."""
    if path is None:
        text, where = bundled_prompt(PROMPT_FILE), f"bundled prompt {PROMPT_FILE}"
    else:
        try:
            text, where = Path(path).read_text(encoding="utf-8"), f"local search prompt file {path}"
        except OSError as exc:
            raise ConfigError(f"local search prompt file {path}: {exc.strerror or exc}") from None
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc} (write literal braces doubled: {{{{ }}}})") from None
    if unknown := names - _PLACEHOLDERS:
        raise ConfigError(f"{where}: unknown placeholder(s) {', '.join(sorted(unknown))}; allowed: context_data, response_type")
    if "context_data" not in names:
        raise ConfigError(f"{where}: the prompt must contain {{context_data}}")
    return text


class LocalSearch:
    """Context from `builder`, answer from `model`. Construct once, call concurrently."""

    def __init__(
        self,
        model: ChatModel,
        builder: LocalContextBuilder,
        *,
        embedder: Embedder | None = None,
        config: LocalSearchConfig | Mapping[str, Any] | None = None,
        params: ChatParams | None = None,
    ):
        # Each would fail only at the first search, as an AttributeError.
        if model is None:
            raise ConfigError("model: a chat model is required, got None (build one with get_chat_model())")
        check_model_argument(model, "model", "complete", "chat_model")
        check_model_argument(embedder, "embedder", "embed", "embedding_model")
        if not callable(getattr(builder, "build", None)):
            raise ConfigError(f"builder: expected a LocalContextBuilder (`LocalContextBuilder(store)`), got {type(builder).__name__}")
        self.model = model
        self.builder = builder
        self.embedder = embedder
        self.config = checked_config(config, LocalSearchConfig, "config") or builder.config
        self.params = params
        self.system_prompt = load_local_prompt(self.config.prompt)

    async def build_context(
        self, query: str, *, query_vector: np.ndarray | Sequence[float] | None = None, conversation_history: Any = None, **overrides: Any
    ) -> LocalContext:
        """The context `search` would send, without calling the model. `overrides`: LocalSearchConfig fields for this call."""
        overrides = {**self._config_overrides(), **overrides}
        budget = overrides.get("max_context_tokens", self.builder.config.max_context_tokens)
        fitted = fit_to_window(self.model, budget, self.params.max_tokens if self.params else None)
        if fitted < budget:  # a model with a small fixed window (the embedded one): the context must fit it
            overrides["max_context_tokens"] = fitted
        try:
            return await self.builder.build(
                query,
                query_vector=query_vector,
                embedder=self.embedder,
                conversation_history=conversation_history,
                **overrides,
            )
        except Exception as exc:
            await raise_if_store_failed(self.builder.store, exc)
            raise

    def _config_overrides(self) -> dict[str, Any]:
        # The builder already holds its own config; pass ours only when it is a different one.
        return {} if self.config is self.builder.config else self.config.model_dump()

    def call_config(self, overrides: dict[str, Any]) -> LocalSearchConfig:
        """The settings of one call: ours with its overrides (ConfigError naming a bad one)."""
        return self.builder.resolve_config({**self._config_overrides(), **overrides}) if overrides else self.config

    def messages(
        self, query: str, context: LocalContext, response_type: str | None = None, *, config: LocalSearchConfig | None = None
    ) -> list[Message]:
        """System prompt with the context and answer format, then the query. `config` (from
        `call_config`) may name another prompt file or response_type than the search's own."""
        config = config or self.config
        template = self.system_prompt if config.prompt == self.config.prompt else load_local_prompt(config.prompt)
        prompt = template.format(context_data=context.context_text, response_type=response_type or config.response_type)
        return [Message("system", prompt), Message("user", query)]

    async def search(
        self,
        query: str,
        *,
        query_vector: np.ndarray | Sequence[float] | None = None,
        conversation_history: Any = None,
        response_type: str | None = None,
        **overrides: Any,
    ) -> SearchResult:
        """Build the context for `query` (mapped to entities by `query_vector`, else by the search's
        embedder) and answer it with one model call. `overrides`: LocalSearchConfig fields for this
        call (`top_k_entities=5`, `llm_timeout=30`, ...); `conversation_history` opens the context.
        An empty or whitespace-only answer raises EmptyAnswerError (a ModelError)."""
        started = time.perf_counter()
        query = checked_question(query)
        config = self._answer_config(overrides, response_type)  # per-call llm_timeout / prompt / response_type are the answer's
        context = await self.build_context(query, query_vector=query_vector, conversation_history=conversation_history, **overrides)
        messages = self.messages(query, context, config=config)
        result = await within(self.model.complete(messages, params=self.params), config.llm_timeout, "local search answer")
        check_answered(result.text, result.usage, what=ANSWER, model=self.model)
        return _result(result.text, context, result.usage, started)

    def stream_search(
        self,
        query: str,
        *,
        query_vector: np.ndarray | Sequence[float] | None = None,
        conversation_history: Any = None,
        response_type: str | None = None,
        **overrides: Any,
    ) -> LocalStream:
        """Answer text deltas; the stream's `result` is set once it is exhausted. The context is
        built before the first delta; closing the stream early cancels the model call. An answer
        that streamed nothing but whitespace raises EmptyAnswerError at its end (no `result`)."""
        return LocalStream(
            self, checked_question(query), query_vector=query_vector, conversation_history=conversation_history,
            overrides=overrides, config=self._answer_config(overrides, response_type),
        )

    def _answer_config(self, overrides: dict[str, Any], response_type: str | None) -> LocalSearchConfig:
        # Checked as the setting it overrides: a number went into the prompt as is, and "" silently
        # meant the configured format.
        return self.call_config(overrides if response_type is None else {**overrides, "response_type": response_type})


class LocalStream(GeneratorStream):
    """Text deltas of one local search; `result` (a SearchResult) is set once it is exhausted."""

    _closed_when_dropped = True  # left by `break` without `async with`: its model call ends at once

    def __init__(self, search: LocalSearch, query: str, *, query_vector: Any, conversation_history: Any,
                 overrides: dict[str, Any], config: LocalSearchConfig):
        super().__init__()
        self._search = search
        self._query = query
        self._kwargs = dict(query_vector=query_vector, conversation_history=conversation_history, **overrides)
        self._config = config
        self.result: SearchResult | None = None

    async def _run(self) -> AsyncIterator[str]:
        search = self._search
        started = time.perf_counter()
        context = await search.build_context(self._query, **self._kwargs)
        messages = search.messages(self._query, context, config=self._config)
        stream = search.model.stream(messages, params=search.params)
        parts: list[str] = []
        try:
            async with aclosing(deltas_within(aiter(stream), self._config.llm_timeout, "local search stream")) as deltas:
                async for delta in deltas:
                    parts.append(delta)
                    yield delta
        finally:
            await stream.aclose()
        text = "".join(parts)
        check_answered(text, stream.usage, what=ANSWER, model=search.model)  # as the blocking answer is
        self.result = _result(text, context, stream.usage, started)


def _result(text: str, context: LocalContext, usage: Usage, started: float) -> SearchResult:
    usage = usage.of_one_call()
    return SearchResult(
        response=text,
        context_data=to_jsonable(context.records),
        context_text=context.context_text,
        completion_time=time.perf_counter() - started,
        llm_calls=usage.calls,
        prompt_tokens=usage.prompt_tokens,
        output_tokens=usage.output_tokens,
        llm_calls_categories={"build_context": 0, "response": usage.calls},
        prompt_tokens_categories={"build_context": 0, "response": usage.prompt_tokens},
        output_tokens_categories={"build_context": 0, "response": usage.output_tokens},
    )
