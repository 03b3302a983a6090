"""`DRIFTSearch`: primer, follow-up epochs of local searches, reduce.

Per query: a fresh `QueryState`, one `BoundedChat` (the `concurrency` semaphore and the timeout
shared by every LLM call of the query) and one RNG (seeded by `config.seed`). Actions of an epoch
run in a TaskGroup, so cancelling the query cancels every in-flight call; an action that fails is
marked (score -inf, `metadata["error"]`) and the query goes on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import polars as pl

from drift_lance._arguments import check_open_store
from drift_lance._opening import opening
from drift_lance.config import checked_config
from drift_lance.config.drift import DRIFTSearchConfig
from drift_lance.config.ingest import StoreConfig
from drift_lance.config.local import LocalSearchConfig
from drift_lance.config.models import ModelSettings
from drift_lance.drift.action import ActionAnswer, DriftAction, follow_ups_kept
from drift_lance.drift.callbacks import DriftCallbacks, as_callback_list, emit
from drift_lance.drift.llm import BoundedChat
from drift_lance.drift.primer import DRIFTPrimer, check_embedder, failed_call_usage
from drift_lance.drift.prompts import DriftPrompts, load_prompts
from drift_lance.drift.result import STAGES, SearchResult, to_jsonable
from drift_lance.drift.state import QueryState
from drift_lance.errors import ConfigError, StoreError, checked_question
from drift_lance.models.base import (
    ChatModel,
    ChatParams,
    Embedder,
    GeneratorStream,
    Message,
    Usage,
    aclose_models,
    check_answered,
    check_model_argument,
    fit_to_window,
)
from drift_lance.models.limits import calls_ranked_from
from drift_lance.store import IndexStore, raise_if_store_failed

__all__ = ["ContextBuilder", "DRIFTSearch", "DriftStream", "local_config_for_drift", "open_drift_search"]

log = logging.getLogger(__name__)

# Share of `time_budget` the follow-ups may use; the reduce call has the rest.
FOLLOW_UP_SHARE = 0.75
REDUCE = "DRIFT reduce"  # names the reduce call in its errors
_NOTE_SEPARATOR = "\n\n"  # between the reduce's intermediate answers
# Intermediate answers longer than this in all are counted for the reduce on a worker thread (the
# tokenizer releases the GIL): five 10 MB answers cost 1.8 s of counting, the event loop held 2.5 s.
_NOTES_OFF_LOOP_CHARS = 256 * 1024


class LocalContextLike(Protocol):
    context_text: str
    records: dict[str, pl.DataFrame]


class ContextBuilder(Protocol):
    """What DRIFT needs from local search: `drift_lance.local.LocalContextBuilder` fits. A builder
    may also offer `select_entities(vectors) -> list` (one batched entity search per epoch, each
    result passed back to `build` as `selected_entities`) and `prefetch(selections)` (the epoch's
    row lookups in one round, passed to every `build` as `candidates`). With a chat model of a small
    fixed window `build` also gets `max_context_tokens`."""

    async def build(self, query: str, *, query_vector: Any = None, embedder: Embedder | None = None, **overrides: Any) -> LocalContextLike: ...


@dataclass(slots=True)
class _Run:
    """Everything one query owns."""

    query: str
    chat: BoundedChat
    rng: random.Random
    callbacks: Sequence[DriftCallbacks]
    context_slots: asyncio.Semaphore
    state: QueryState = field(default_factory=QueryState)
    usage: dict[str, Usage] = field(default_factory=lambda: {stage: Usage() for stage in STAGES})
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STAGES, 0))
    started: float = field(default_factory=time.perf_counter)
    graph: dict[str, Any] | None = None
    # A follow-up's read failed: whether the store was checked for a missing file, and what it found.
    store_check: asyncio.Lock = field(default_factory=asyncio.Lock)
    store_checked: bool = False
    unreadable: StoreError | None = None

    def action_graph(self) -> dict[str, Any]:
        """The action graph without contexts, serialized once: exploring has ended when it is asked
        for (reduce start, the result), so it no longer changes."""
        if self.graph is None:
            self.graph = self.state.serialize(include_context=False)
        return self.graph


class DRIFTSearch:
    """DRIFT search on one opened index. Build it with `await open_drift_search(db)`; construct it
    directly to bring your own store, models or context builder. One object serves any number of
    concurrent queries (`asyncio.gather(search.search(a), search.search(b))`): each query has its
    own state and its own `concurrency` bound, and the models' limits are shared.

        result = await search.search(question)              # SearchResult
        async with search.stream_search(question) as stream:
            async for token in stream: ...                  # then stream.result
        await search.close()                                # or `async with search:`
    """

    def __init__(
        self,
        *,
        store: IndexStore,
        chat_model: ChatModel,
        embedder: Embedder,
        context_builder: ContextBuilder,
        tokenizer: Any,
        config: DRIFTSearchConfig | Mapping[str, Any] | None = None,
        prompts: DriftPrompts | None = None,
        callbacks: DriftCallbacks | Sequence[DriftCallbacks] = (),
        owns_store: bool = False,
        owned_models: Sequence[object] = (),
    ):
        _check_parts(store, chat_model, embedder, context_builder, tokenizer)
        self.store = store
        self.chat_model = chat_model
        self.embedder = embedder
        self.context_builder = context_builder
        self.tokenizer = tokenizer
        config = checked_config(config, DRIFTSearchConfig, "config") or DRIFTSearchConfig()
        self.config, self._follow_up_budget = _fit_budgets_to_model(config, chat_model)
        self.prompts = prompts or load_prompts(self.config)
        self.callbacks = as_callback_list(callbacks)
        self._owns_store = owns_store
        self._owned_models = list(owned_models)
        self._closed = False
        check_embedder(store, embedder)

    # ------------------------------------------------------------------ public API
    async def search(
        self, query: str, *, reduce: bool = True, callbacks: DriftCallbacks | Sequence[DriftCallbacks] = ()
    ) -> SearchResult:
        """Run the whole query (HyDE, primer, `n_depth` epochs of follow-ups, reduce) and return its
        SearchResult; with `reduce=False` the response is the action graph. `callbacks`: progress
        callbacks for this query, after the search's own. Raises ConfigError (empty question, closed
        search), StoreError (IndexUnreadableError naming the table for a file that cannot be read), EmbeddingMismatchError or ModelError (every primer fold or the reduce
        failed for good; an empty reduce answer is an EmptyAnswerError; a failed HyDE call falls
        back to the question, a failed follow-up only marks its action: see `result.failures`)."""
        if not isinstance(reduce, bool):  # reduce="no" (a form's value) reduced, reduce=None did not
            raise ConfigError(f"reduce: expected True or False, got {type(reduce).__name__} {reduce!r}")
        with calls_ranked_from():  # under load, an earlier query's model calls go first
            try:
                return await self._search(query, reduce=reduce, callbacks=callbacks)
            except Exception as exc:
                self._raise_if_closed(exc)
                await raise_if_store_failed(self.store, exc)
                raise

    async def _search(self, query: str, *, reduce: bool, callbacks: DriftCallbacks | Sequence[DriftCallbacks]) -> SearchResult:
        run = self._new_run(query, callbacks)
        await self._explore(run)
        if not reduce:
            return self._result(run, response=run.action_graph())
        messages, params = await self._start_reduce(run)
        result = await run.chat.complete(messages, params=params)
        run.usage["reduce"] = run.usage["reduce"] + result.usage.of_one_call()
        check_answered(result.text, result.usage, what=REDUCE, model=self.chat_model)  # the reduce has no fallback
        await emit(run.callbacks, "on_reduce_end", result.text)
        return self._result(run, response=result.text)

    def stream_search(self, query: str, *, callbacks: DriftCallbacks | Sequence[DriftCallbacks] = ()) -> DriftStream:
        """The query of `search`, with the reduce streamed: `async for token in stream` yields its
        deltas, and `stream.result` is the full SearchResult once the stream is exhausted (None
        before). Nothing runs until iteration starts; use `async with` (or `await stream.aclose()`)
        so that leaving early ends the model call at once. `await stream.text()`: the whole answer."""
        return DriftStream(self, query, callbacks)

    async def close(self) -> None:
        """Close what `open_drift_search` opened: the store and the models it built. A search
        after this raises ConfigError instead of quietly reopening what nothing would close."""
        self._closed = True
        try:
            await aclose_models(*self._owned_models)
        finally:
            if self._owns_store:
                await self.store.close()

    def _raise_if_closed(self, exc: Exception) -> None:
        """A search that fails because `close()` shut its models meanwhile says so, instead of
        reporting the closed client as the model's failure."""
        if self._closed and not isinstance(exc, ConfigError):  # a search started after close() says that itself
            raise ConfigError(f"this DRIFTSearch on {self.store.uri} was closed while the search ran") from exc

    async def __aenter__(self) -> DRIFTSearch:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ stages
    def _new_run(self, query: str, callbacks: DriftCallbacks | Sequence[DriftCallbacks]) -> _Run:
        if self._closed:
            raise ConfigError(f"this DRIFTSearch on {self.store.uri} is closed")
        query = checked_question(query)
        cfg = self.config
        return _Run(
            query=query,
            chat=BoundedChat(self.chat_model, concurrency=cfg.concurrency, timeout=cfg.llm_timeout),
            rng=random.Random(cfg.seed),
            callbacks=[*self.callbacks, *as_callback_list(callbacks)],
            context_slots=asyncio.Semaphore(cfg.context_concurrency),
        )

    async def _explore(self, run: _Run) -> None:
        """Primer, then `n_depth` epochs of follow-up actions."""
        primer = DRIFTPrimer(
            store=self.store,
            chat=run.chat,
            embedder=self.embedder,
            tokenizer=self.tokenizer,
            config=self.config,
            prompts=self.prompts,
            rng=run.rng,
            # graphrag reads the reports at or under the query's community level, as its local
            # contexts do: the follow-ups' builder carries that level
            community_level=getattr(getattr(self.context_builder, "config", None), "community_level", None),
        )
        outcome = await primer.run(run.query)
        run.usage["build_context"] = outcome.build_context_usage
        run.usage["primer"] = outcome.primer_usage
        run.failures["build_context"] = int(outcome.hyde_fell_back)
        run.failures["primer"] = len(outcome.fold_errors)
        root = run.state.add_action(outcome.root)
        run.state.add_all_follow_ups(root, root.follow_ups)
        await emit(run.callbacks, "on_primer_done", root, to_jsonable(outcome.reports.drop("full_content", strict=False)))

        scorer = run.state.parent_score if self.config.action_ranking == "parent_score" else None
        follow_ups_until = self._follow_ups_deadline(run)
        for epoch in range(1, self.config.n_depth + 1):
            batch = run.state.rank_incomplete_actions(scorer, run.rng)[: self.config.drift_k_followups]
            if not batch:
                log.info("DRIFT: no open actions left after %d epoch(s)", epoch - 1)
                break
            if follow_ups_until is not None and asyncio.get_running_loop().time() >= follow_ups_until:
                # the primer (or an earlier epoch) used the follow-ups' share: none are sent, none failed
                log.warning("DRIFT: time budget (%g s) used up before epoch %d; reducing without its %d follow-up(s)",
                            self.config.time_budget, epoch, len(batch))
                break
            await emit(run.callbacks, "on_epoch_start", epoch, batch)
            try:
                async with asyncio.timeout_at(follow_ups_until):
                    await self._run_epoch(run, batch, epoch)
            except TimeoutError:
                # A stuck follow-up must not cost the whole answer: the reduce uses what is in.
                await self._fail_unanswered(run, batch, epoch)
                break
            finally:
                # Follow-ups join the graph in batch order, so node ids do not depend on timing.
                for action in batch:
                    run.state.add_all_follow_ups(action, action.follow_ups)
        run.usage["action"] = _usage_from_counts(run.state.action_token_ct())

    def _follow_ups_deadline(self, run: _Run) -> float | None:
        """Event-loop time by which the follow-ups stop (`time_budget`), or None."""
        budget = self.config.time_budget
        if budget is None:
            return None
        elapsed = time.perf_counter() - run.started
        return asyncio.get_running_loop().time() + FOLLOW_UP_SHARE * budget - elapsed

    async def _run_epoch(self, run: _Run, batch: list[DriftAction], epoch: int) -> None:
        vectors = await self._embed_queries(batch)
        prepared = await self._prepare_contexts(vectors)
        async with asyncio.TaskGroup() as group:
            for action, vector, extra in zip(batch, vectors, prepared, strict=True):
                group.create_task(self._run_action(run, action, epoch, vector, extra))
        if run.unreadable is not None:  # a file of the index is gone: the rest would fail the same way
            raise run.unreadable

    async def _fail_unanswered(self, run: _Run, batch: list[DriftAction], epoch: int) -> None:
        budget = self.config.time_budget
        unanswered = [action for action in batch if not action.is_complete]
        log.warning("DRIFT: %d follow-up(s) of epoch %d not answered within %g s of the %g s time budget; reducing without them",
                    len(unanswered), epoch, FOLLOW_UP_SHARE * budget, budget)
        for action in unanswered:
            action.mark_failed(f"TimeoutError: not answered within the time budget ({FOLLOW_UP_SHARE:g} of time_budget={budget:g}s)")
            await emit(run.callbacks, "on_action_completed", action, epoch)

    async def _embed_queries(self, batch: list[DriftAction]) -> list[Any]:
        """One embedding request for the whole epoch instead of one per action. On failure each
        action embeds its own query (and fails alone if that fails too)."""
        try:
            matrix = await self.embedder.embed([action.query for action in batch], kind="query")
        except Exception as exc:  # noqa: BLE001 - degrade to per-action embedding
            log.warning("DRIFT: batched query embedding failed (%s); embedding per action", exc)
            return [None] * len(batch)
        return list(matrix)

    async def _prepare_contexts(self, vectors: list[Any]) -> list[dict[str, Any]]:
        """Extra `build` arguments per action: the epoch's entity searches as one batch (one
        matrix product for exactly searched tables) and its row lookups as one round
        (`select_entities` / `prefetch`, where the builder offers them and every query has a
        vector). Without them, or if they fail, each build searches and looks up on its own."""
        none: list[dict[str, Any]] = [{} for _ in vectors]
        builder = self.context_builder
        select_entities = getattr(builder, "select_entities", None)
        if select_entities is None or not vectors or any(vector is None for vector in vectors):
            return none
        try:
            selections = list(await select_entities(np.stack(vectors)))
        except Exception as exc:  # noqa: BLE001 - each action then searches (and fails) alone
            log.warning("DRIFT: batched entity search failed (%s); searching per action", exc)
            return none
        prepared: list[dict[str, Any]] = [{"selected_entities": selected} for selected in selections]
        prefetch = getattr(builder, "prefetch", None)
        if prefetch is not None:
            try:
                candidates = await prefetch(selections)
            except Exception as exc:  # noqa: BLE001 - each build then looks its rows up itself
                log.warning("DRIFT: batched row lookup failed (%s); looking up per action", exc)
            else:
                for extra in prepared:
                    extra["candidates"] = candidates
        return prepared

    async def _run_action(
        self, run: _Run, action: DriftAction, epoch: int, query_vector: Any = None, extra: dict[str, Any] | None = None
    ) -> None:
        """Local search for one follow-up. Never raises (except cancellation): failures mark the action."""
        llm_started = False  # the model was called: a follow-up cut off while waiting for a slot made no call

        def call_started() -> None:
            nonlocal llm_started
            llm_started = True

        try:
            # a model with a small fixed window: each follow-up's context is built to fit it
            budget = {} if self._follow_up_budget is None else {"max_context_tokens": self._follow_up_budget}
            async with run.context_slots:
                # A build from prefetched rows never suspends, so without this turn of the loop the
                # epoch's requests would all reach the wire after its last build (aiohttp writes
                # each body from a task of its own): each call now leaves while later ones build.
                await asyncio.sleep(0)
                if query_vector is None:
                    context = await self.context_builder.build(action.query, embedder=self.embedder, **budget)
                else:
                    context = await self.context_builder.build(action.query, query_vector=query_vector, **(extra or {}), **budget)
            action.metadata["context_data"] = context.records  # kept lazy: serialized from its rows
            action.metadata["context_text"] = context.context_text
            cfg = self.config
            system = self.prompts.local.format(
                global_query=run.query,
                followups=cfg.drift_k_followups,
                context_data=context.context_text,
                response_type=cfg.response_type,
            )
            params = ChatParams(
                temperature=cfg.local_search_temperature,
                top_p=cfg.local_search_top_p,
                n=cfg.local_search_n,
                max_tokens=cfg.action_output_cap,
                seed=cfg.seed,
            )
            result = await run.chat.complete(
                [Message("system", system), Message("user", action.query)], params=params, response_model=ActionAnswer,
                on_call=call_started,
            )
            usage = result.usage.of_one_call()
            action.record_usage(llm_calls=usage.calls, prompt_tokens=usage.prompt_tokens, output_tokens=usage.output_tokens)
            if not isinstance(result.parsed, ActionAnswer):
                raise ValueError("the model returned no structured answer")
            action.apply_answer(result.parsed, max_follow_ups=follow_ups_kept(cfg.drift_k_followups))
        except asyncio.CancelledError as exc:  # the time budget or the whole query: the call was made
            self._count_failed_call(action, exc, llm_started)
            raise
        except Exception as exc:  # noqa: BLE001 - one bad action must not fail the query
            self._count_failed_call(action, exc, llm_started)
            action.mark_failed(f"{type(exc).__name__}: {' '.join(str(exc).split())}")
            log.warning("DRIFT action %r failed: %s", action.query, action.metadata["error"])
            if not llm_started:
                await self._check_store(run, exc)
        await emit(run.callbacks, "on_action_completed", action, epoch)

    async def _check_store(self, run: _Run, exc: Exception) -> None:
        """After a follow-up's context failed reading the index: whether a file of it is missing or
        truncated (deleted or cut after the search opened it), once per query. Then the epoch ends
        with that StoreError naming the table, instead of an answer from the primer alone that only
        said it was degraded. A failure the check does not confirm (a timeout) leaves the query
        degraded around that follow-up, as before."""
        check = getattr(self.store, "unreadable_error", None)  # LanceDB stores; a test store has none
        if check is None:
            return
        async with run.store_check:
            if run.store_checked:
                return
            run.store_checked = True
            try:
                run.unreadable = await check(exc)
            except Exception as failed:  # noqa: BLE001 - the check must not fail a query it would not
                log.warning("DRIFT: checking the index after a failed follow-up failed: %s", failed)

    @staticmethod
    def _count_failed_call(action: DriftAction, exc: BaseException, llm_started: bool) -> None:
        if llm_started and action.metadata["llm_calls"] == 0:  # the call failed: count what it cost
            usage = failed_call_usage(exc)
            action.record_usage(llm_calls=usage.calls, prompt_tokens=usage.prompt_tokens, output_tokens=usage.output_tokens)

    async def _start_reduce(self, run: _Run) -> tuple[list[Message], ChatParams]:
        await emit(run.callbacks, "on_reduce_start", run.action_graph())
        cfg = self.config
        answers = sum(len(node.answer) for node in run.state.graph.nodes if node.answer)
        notes = (self._reduce_notes(run.state) if answers < _NOTES_OFF_LOOP_CHARS
                 else await asyncio.to_thread(self._reduce_notes, run.state))
        system = self.prompts.reduce.format(context_data=notes, response_type=cfg.response_type)
        params = ChatParams(temperature=cfg.reduce_temperature, max_tokens=cfg.reduce_output_cap, seed=cfg.seed)
        return [Message("system", system), Message("user", run.query)], params

    def _reduce_notes(self, state: QueryState) -> str:
        """Intermediate answers within `data_max_tokens`: best scores are kept first, then the
        kept notes are written in graph order (the primer's answer first)."""
        answered = [(index, node) for index, node in enumerate(state.graph.nodes) if node.answer and not node.failed]
        budget = self.config.data_max_tokens
        kept: list[tuple[int, str]] = []
        for index, node in sorted(answered, key=lambda item: item[1].sort_score, reverse=True):
            note = f"## {node.query}\n\n{node.answer.strip()}"
            # With the separator that follows it: "\n\n" is a token of its own after a word, and
            # the "##" after it starts a new one, so the joined notes cost no more than these sums.
            cost = self.tokenizer.count(note + _NOTE_SEPARATOR)
            if cost > budget:
                continue
            kept.append((index, note))
            budget -= cost
        if not kept and answered:  # even the best note is over budget: send it cut to size
            index, node = max(answered, key=lambda item: item[1].sort_score)
            kept.append((index, self.tokenizer.truncate(f"## {node.query}\n\n{node.answer}", self.config.data_max_tokens)))
        return _NOTE_SEPARATOR.join(note for _, note in sorted(kept))

    def _result(self, run: _Run, *, response: Any) -> SearchResult:
        context_data, context_text = run.state.contexts()
        calls = {stage: run.usage[stage].calls for stage in STAGES}
        prompt = {stage: run.usage[stage].prompt_tokens for stage in STAGES}
        output = {stage: run.usage[stage].output_tokens for stage in STAGES}
        failures = {**run.failures, "action": sum(1 for action in run.state.graph.nodes if action.failed)}
        return SearchResult(
            response=response,
            context_data=context_data,
            context_text=context_text,
            completion_time=time.perf_counter() - run.started,
            llm_calls=sum(calls.values()),
            prompt_tokens=sum(prompt.values()),
            output_tokens=sum(output.values()),
            llm_calls_categories=calls,
            prompt_tokens_categories=prompt,
            output_tokens_categories=output,
            failures=sum(failures.values()),
            failures_categories=failures,
            state=run.action_graph(),
        )


class DriftStream(GeneratorStream):
    """Reduce deltas of one DRIFT query; `result` is set once the stream has been exhausted."""

    _closed_when_dropped = True  # left by `break` without `async with`: its model call ends at once

    def __init__(self, search: DRIFTSearch, query: str, callbacks: DriftCallbacks | Sequence[DriftCallbacks]):
        super().__init__()
        self._search = search
        self._query = query
        self._callbacks = callbacks
        self.result: SearchResult | None = None

    async def _run(self) -> AsyncIterator[str]:
        with calls_ranked_from():  # under load, an earlier query's model calls go first
            async with aclosing(self._deltas()) as deltas:  # a stream left early closes its model call now
                try:
                    async for delta in deltas:
                        yield delta
                except Exception as exc:
                    self._search._raise_if_closed(exc)
                    await raise_if_store_failed(self._search.store, exc)
                    raise

    async def _deltas(self) -> AsyncIterator[str]:
        search = self._search
        run = search._new_run(self._query, self._callbacks)
        await search._explore(run)
        messages, params = await search._start_reduce(run)
        stream = run.chat.stream(messages, params=params)
        parts: list[str] = []
        try:
            async for delta in stream:
                parts.append(delta)
                await emit(run.callbacks, "on_token", delta)
                yield delta
        finally:
            await stream.aclose()
        run.usage["reduce"] = run.usage["reduce"] + stream.usage.of_one_call()
        text = "".join(parts)
        check_answered(text, stream.usage, what=REDUCE, model=search.chat_model)  # as the blocking answer is
        await emit(run.callbacks, "on_reduce_end", text)
        self.result = search._result(run, response=text)


def _usage_from_counts(counts: dict[str, int]) -> Usage:
    return Usage(counts["prompt_tokens"], counts["output_tokens"], counts["llm_calls"])



def _fit_budgets_to_model(config: DRIFTSearchConfig, chat_model: Any) -> tuple[DRIFTSearchConfig, int | None]:
    """`config` with its token budgets lowered to what fits a model with a small fixed context window
    (the embedded llama.cpp model: 8192), and the follow-ups' context budget when it was lowered."""
    fitted = {
        "primer_llm_max_tokens": fit_to_window(chat_model, config.primer_llm_max_tokens, None),
        "local_search_max_data_tokens": fit_to_window(chat_model, config.local_search_max_data_tokens, config.action_output_cap),
        "data_max_tokens": fit_to_window(chat_model, config.data_max_tokens, config.reduce_output_cap),
    }
    lowered = {name: value for name, value in fitted.items() if value < getattr(config, name)}
    if not lowered:
        return config, None
    log.info("DRIFT: token budgets lowered to fit the chat model's context window: %s", lowered)
    return config.model_copy(update=lowered), lowered.get("local_search_max_data_tokens")


def local_config_for_drift(config: DRIFTSearchConfig, base: Any = None) -> Any:
    """The LocalSearchConfig each follow-up uses: `base` (or defaults) with DRIFT's local_search_*
    fields applied, as graphrag's DRIFT does for its local context builder. graphrag's DRIFT gives
    its local searches no claims (covariates), so neither do we."""
    data = (base or LocalSearchConfig()).model_dump()
    data.update(
        text_unit_prop=config.local_search_text_unit_prop,
        community_prop=config.local_search_community_prop,
        top_k_entities=config.local_search_top_k_mapped_entities,
        top_k_relationships=config.local_search_top_k_relationships,
        max_context_tokens=config.local_search_max_data_tokens,
        response_type=config.response_type,
        include_claims=False,
    )
    if config.community_level is not None:  # graphrag's --community-level, set for this DRIFT search
        data["community_level"] = config.community_level
    return LocalSearchConfig.model_validate(data)


def _check_parts(store: object, chat_model: object, embedder: object, context_builder: object, tokenizer: object) -> None:
    """Each would fail in the search as an AttributeError; a wrong context builder not even that:
    every follow-up failed and the answer came from the primer alone."""
    check_open_store(store)
    for value, argument in ((chat_model, "chat_model"), (embedder, "embedder")):
        if value is None:
            raise ConfigError(f"{argument}: required, got None")
    check_model_argument(chat_model, "chat_model", "complete", "chat_model")
    check_model_argument(embedder, "embedder", "embed", "embedding_model")
    if not callable(getattr(context_builder, "build", None)):
        raise ConfigError(f"context_builder: expected an object with an async build() method "
                          f"(`LocalContextBuilder(store)`), got {type(context_builder).__name__}")
    if not callable(getattr(tokenizer, "count", None)) or not callable(getattr(tokenizer, "truncate", None)):
        raise ConfigError(f"tokenizer: expected a tokenizer (`get_tokenizer('o200k_base')`), got {type(tokenizer).__name__}")


@opening
async def open_drift_search(
    db_uri: str | os.PathLike[str],
    *,
    config: DRIFTSearchConfig | Mapping[str, Any] | None = None,
    chat_model: ChatModel | None = None,
    embedder: Embedder | None = None,
    storage_options: dict[str, str] | None = None,
    model_settings: ModelSettings | Mapping[str, Any] | None = None,
    local_config: LocalSearchConfig | Mapping[str, Any] | None = None,
    callbacks: DriftCallbacks | Sequence[DriftCallbacks] = (),
    store_config: StoreConfig | Mapping[str, Any] | None = None,
) -> DRIFTSearch:
    """A ready DRIFTSearch on the index at `db_uri`. Models not given are built from
    `model_settings` (default: from the environment; embedded offline models when no OpenAI endpoint
    is configured). `store_config`: how the index is read (ANN probes, caches, storage options), as
    `Settings.store` sets it for the CLI and the service. Each settings argument also takes a dict
    of its fields; a bad one is a ConfigError naming it. Opens the store and reads its manifest;
    nothing is loaded per report or entity.

        search = await open_drift_search(db)           # close it with `await search.close()`
        async with open_drift_search(db) as search:    # or let the block close it
            ...

    Nothing is opened until it is awaited or entered."""
    from drift_lance._lance_store import open_store
    from drift_lance.local.context import LocalContextBuilder
    from drift_lance.models import get_chat_model, get_embedder
    from drift_lance.models.tokens import get_tokenizer

    config = checked_config(config, DRIFTSearchConfig, "config") or DRIFTSearchConfig()
    model_settings = checked_config(model_settings, ModelSettings, "model_settings")
    local_config = checked_config(local_config, LocalSearchConfig, "local_config")
    store_config = checked_config(store_config, StoreConfig, "store_config")
    check_model_argument(chat_model, "chat_model", "complete", "chat_model")
    check_model_argument(embedder, "embedder", "embed", "embedding_model")
    prompts = load_prompts(config)  # fail on a bad prompt file before touching the store
    store = await open_store(db_uri, config=store_config, storage_options=storage_options)
    built: list[object] = []
    try:
        await store.open_tables()  # a table missing from the database fails here, not in every follow-up
        local = local_config_for_drift(config, local_config)
        tokenizer = get_tokenizer(local.encoding)
        if chat_model is None:
            chat_model = get_chat_model(model_settings)
            built.append(chat_model)
        if embedder is None:
            embedder = get_embedder(model_settings)
            built.append(embedder)
        return DRIFTSearch(
            store=store,
            chat_model=chat_model,
            embedder=embedder,
            context_builder=LocalContextBuilder(store, tokenizer=tokenizer, config=local),
            tokenizer=tokenizer,
            config=config,
            prompts=prompts,
            callbacks=callbacks,
            owns_store=True,
            owned_models=built,
        )
    except BaseException:
        await aclose_models(*built)
        await store.close()
        raise
