"""DRIFTSearch loop logic with a scripted chat model on the real ingested dulce index.

The chat model is scripted (the model boundary); the store is the real LanceDB index; follow-up
contexts come from a small stand-in builder so the tests pin DRIFT's loop, not local search.
"""

from __future__ import annotations

import asyncio
import gc
import json
from dataclasses import dataclass

import numpy as np
import polars as pl
import pytest

from drift_lance.config.drift import DRIFTSearchConfig
from drift_lance.config.local import LocalSearchConfig
from drift_lance.drift import DRIFTSearch, DriftCallbacks
from drift_lance.drift.action import ActionAnswer, PrimerFoldAnswer
from drift_lance.errors import ConfigError, EmbeddingMismatchError
from drift_lance.models.tokens import get_tokenizer
from drift_lance.testing import HashEmbedder, ScriptedChatModel

REDUCE_TEXT = "Final answer: Dulce is led by Alex Mercer [Data: Reports (1)]."


@dataclass
class _Context:
    context_text: str
    records: dict[str, pl.DataFrame]


class StubContextBuilder:
    """Stands in for LocalContextBuilder: a recognisable context per follow-up query."""

    def __init__(self, fail_on: str | None = None):
        self.queries: list[str] = []
        self.fail_on = fail_on

    async def build(self, query, *, query_vector=None, embedder=None):
        self.queries.append(query)
        if query == self.fail_on:
            raise RuntimeError(f"context build failed for {query}")
        table = pl.DataFrame({"id": ["1"], "entity": [f"entity for {query}"]})
        return _Context(f"-----Entities-----\nid|entity\n1|entity for {query}", {"entities": table})


def stage_of(messages, response_model) -> str:
    if response_model is PrimerFoldAnswer:
        return "primer"
    if response_model is ActionAnswer:
        return "action"
    if messages[0].role == "system":
        return "reduce"
    return "hyde"


def drift_responder(children: int = 2, *, fail: set[str] = frozenset(), scores: dict[str, int] | None = None):
    """Primer folds propose P<fold>-<i>; action `q` proposes `q/<i>`; `fail` queries answer junk."""
    fold_counter = iter(range(1000))

    def respond(messages, params, response_model):
        stage = stage_of(messages, response_model)
        if stage == "hyde":
            return "# Hypothetical report\n\nDulce base leadership overview."
        if stage == "primer":
            fold = next(fold_counter)
            return {
                "intermediate_answer": f"primer answer {fold}",
                "score": 50 + fold,
                "follow_up_queries": [f"P{fold}-{i}" for i in range(children)],
            }
        if stage == "action":
            query = messages[-1].content
            if query in fail:
                return "this is not JSON at all"
            return {
                "response": f"answer to {query}",
                "score": (scores or {}).get(query, 40),
                "follow_up_queries": [f"{query}/{i}" for i in range(children)],
            }
        return REDUCE_TEXT

    return respond


@pytest.fixture
def store(dulce_store):
    return dulce_store


def make_search(store, chat, *, builder=None, **config) -> DRIFTSearch:
    dim = store.manifest.vectors["community_reports"].dimension
    return DRIFTSearch(
        store=store,
        chat_model=chat,
        embedder=HashEmbedder(dim),
        context_builder=builder or StubContextBuilder(),
        tokenizer=get_tokenizer("o200k_base"),
        config=DRIFTSearchConfig(**{"seed": 1, **config}),
    )


async def searched(search: DRIFTSearch, streamed: bool, query: str = "Who leads the Dulce base?"):
    """The query's SearchResult, from `search` or from a drained `stream_search`."""
    if not streamed:
        return await search.search(query)
    stream = search.stream_search(query)
    await stream.text()
    return stream.result


def stages(chat: ScriptedChatModel) -> list[str]:
    return [stage_of(call.messages, call.response_model) for call in chat.calls]


@pytest.mark.parametrize(
    ("k", "folds", "depth", "expected"),
    [
        # HyDE 1 + one primer call per fold + k actions per epoch (every answer proposes 3
        # follow-ups, so at least k are always open) + reduce 1
        (2, 2, 2, {"build_context": 1, "primer": 2, "action": 4, "reduce": 1}),
        (3, 1, 1, {"build_context": 1, "primer": 1, "action": 3, "reduce": 1}),
        (5, 1, 0, {"build_context": 1, "primer": 1, "action": 0, "reduce": 1}),
        (2, 5, 1, {"build_context": 1, "primer": 2, "action": 2, "reduce": 1}),  # folds > reports: one per report
        (4, 2, 3, {"build_context": 1, "primer": 2, "action": 12, "reduce": 1}),
    ],
)
async def test_exact_llm_calls_per_stage(store, k, folds, depth, expected):
    chat = ScriptedChatModel(drift_responder(children=3))
    search = make_search(store, chat, drift_k_followups=k, primer_folds=folds, n_depth=depth)
    result = await search.search("Who leads the Dulce base?")
    assert result.llm_calls_categories == expected
    assert result.llm_calls == sum(expected.values()) == len(chat.calls)
    counted = {stage: stages(chat).count(stage) for stage in ("hyde", "primer", "action", "reduce")}
    assert list(counted.values()) == [expected["build_context"], expected["primer"], expected["action"], expected["reduce"]]
    assert result.response == REDUCE_TEXT


async def test_loop_stops_when_no_open_actions_remain(store):
    chat = ScriptedChatModel(drift_responder(children=0))  # nothing proposes follow-ups
    search = make_search(store, chat, drift_k_followups=3, primer_folds=1, n_depth=3)
    result = await search.search("Who leads the Dulce base?")
    assert result.llm_calls_categories["action"] == 0  # primer proposed none either
    assert result.state["nodes"][0]["answer"] == "primer answer 0"


async def test_concurrency_bound_holds_across_the_query(store):
    chat = ScriptedChatModel(drift_responder(children=4), delay=0.02)
    search = make_search(store, chat, drift_k_followups=8, primer_folds=4, n_depth=2, concurrency=3)
    result = await search.search("Who leads the Dulce base?")
    assert result.llm_calls_categories["action"] == 16
    assert chat.max_in_flight == 3  # reached (calls do overlap) and never exceeded

    serial = ScriptedChatModel(drift_responder(children=4), delay=0.005)
    await make_search(store, serial, drift_k_followups=8, primer_folds=4, n_depth=1, concurrency=1).search("q")
    assert serial.max_in_flight == 1


class SlowContextBuilder(StubContextBuilder):
    """Records how many builds run at once and when each follow-up's LLM call could start."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = self.max_in_flight = 0

    async def build(self, query, *, query_vector=None, embedder=None):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.01)
            return await super().build(query, query_vector=query_vector, embedder=embedder)
        finally:
            self.in_flight -= 1


@pytest.mark.parametrize("bound", [1, 2, 5])
async def test_context_builds_are_bounded_and_calls_leave_as_contexts_finish(store, bound):
    builder = SlowContextBuilder()
    chat = ScriptedChatModel(drift_responder(children=4), delay=0.05)
    search = make_search(store, chat, builder=builder, drift_k_followups=8, primer_folds=2, n_depth=1,
                         context_concurrency=bound)
    result = await search.search("Who leads the Dulce base?")
    assert result.llm_calls_categories["action"] == 8
    assert builder.max_in_flight == bound  # reached and never exceeded
    # the first follow-up call is under way while later contexts are still being built
    assert chat.max_in_flight >= 2


async def test_graph_shape_and_serialization(store):
    chat = ScriptedChatModel(drift_responder())
    search = make_search(store, chat, drift_k_followups=2, primer_folds=2, n_depth=2)
    result = await search.search("Who leads the Dulce base?")
    state = result.state
    nodes = {n["id"]: n for n in state["nodes"]}
    # root + 4 primer follow-ups + 2x2 (epoch 1) + 2x2 (epoch 2) children
    assert len(nodes) == 1 + 4 + 4 + 4
    assert nodes[0]["query"] == "Who leads the Dulce base?" and nodes[0]["depth"] == 0
    assert sum(1 for e in state["edges"] if e["source"] == 0) == 4
    answered = [n for n in nodes.values() if n["answer"] and n["id"] != 0]
    assert len(answered) == 4
    for node in answered:  # each answered action links to its two follow-ups, one level deeper
        children = [nodes[e["target"]] for e in state["edges"] if e["source"] == node["id"]]
        assert sorted(c["query"] for c in children) == [f"{node['query']}/0", f"{node['query']}/1"]
        assert all(c["depth"] == node["depth"] + 1 for c in children)
        assert node["metadata"]["llm_calls"] == 1
    dumped = json.loads(json.dumps(result.model_dump(), allow_nan=False))
    assert dumped["context_data"]["Who leads the Dulce base?"]["reports"][0]["title"]
    some_action = answered[0]["query"]
    assert dumped["context_data"][some_action]["entities"] == [{"id": "1", "entity": f"entity for {some_action}"}]
    assert "-----Entities-----" in dumped["context_text"][some_action]


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"store": None}, "store: expected an open store (`await open_store(uri)`), got NoneType"),
        ({"chat_model": None}, "chat_model: required, got None"),
        ({"embedder": None}, "embedder: required, got None"),
        ({"context_builder": None}, "context_builder: expected an object with an async build() method (`LocalContextBuilder(store)`), got NoneType"),
        ({"context_builder": "store"}, "context_builder: expected an object with an async build() method (`LocalContextBuilder(store)`), got LanceStore"),
        ({"tokenizer": None}, "tokenizer: expected a tokenizer (`get_tokenizer('o200k_base')`), got NoneType"),
    ],
)
def test_a_missing_or_wrong_part_of_a_drift_search_is_refused_at_construction(store, part, message):
    # A store given as the context builder (or None) answered from the primer alone, every
    # follow-up failing with "'LanceStore' object has no attribute 'build'"; the others failed in
    # the search as AttributeErrors (a None chat model as "all 5 primer calls failed").
    chat = ScriptedChatModel(drift_responder())
    parts = {
        "store": store, "chat_model": chat, "embedder": HashEmbedder(store.manifest.vectors["community_reports"].dimension),
        "context_builder": StubContextBuilder(), "tokenizer": get_tokenizer("o200k_base"),
    }
    parts.update({name: store if value == "store" else value for name, value in part.items()})
    with pytest.raises(ConfigError) as caught:
        DRIFTSearch(**parts)
    assert str(caught.value) == message


@pytest.mark.parametrize("reduce", ["no", None, 0])
async def test_reduce_that_is_not_a_bool_is_refused_before_any_model_call(store, reduce):
    # reduce="no" ran the whole search and reduced it; reduce=None skipped the reduce.
    chat = ScriptedChatModel(drift_responder())
    search = make_search(store, chat, n_depth=1)
    with pytest.raises(ConfigError) as caught:
        await search.search("Who leads the Dulce base?", reduce=reduce)
    assert str(caught.value) == f"reduce: expected True or False, got {type(reduce).__name__} {reduce!r}"
    assert chat.calls == []
    assert isinstance((await search.search("Who leads the Dulce base?", reduce=False)).response, dict)


async def test_a_results_repr_shows_the_answer_and_its_cost_not_the_contexts(store):
    # Shown in a notebook cell or a log line: it was every context and the graph, ~100 kB here.
    from drift_lance.drift import SearchResult

    search = make_search(store, ScriptedChatModel(drift_responder()), drift_k_followups=2, primer_folds=2, n_depth=2)
    result = await search.search("Who leads the Dulce base?")
    text = repr(result)
    assert text.startswith(f"SearchResult(response={REDUCE_TEXT!r}, completion_time=")
    assert "llm_calls_categories={'build_context': 1, 'primer': 2, 'action': 4, 'reduce': 1}" in text
    assert "failures=0" in text and len(text) < 1000
    assert "context_data" not in text and "state=" not in text
    # help(SearchResult) documents every field
    assert all(f"`{name}`" in SearchResult.__doc__ for name in SearchResult.model_fields)


async def test_duplicate_follow_ups_run_once(store):
    def respond(messages, params, response_model):
        stage = stage_of(messages, response_model)
        if stage == "primer":
            return {"intermediate_answer": "p", "score": 50, "follow_up_queries": ["A", "B", "a "]}
        if stage == "action":
            return {"response": "x", "score": 10, "follow_up_queries": ["Shared", "shared"]}
        return "text"

    chat = ScriptedChatModel(respond)
    search = make_search(store, chat, drift_k_followups=10, primer_folds=1, n_depth=2)
    result = await search.search("Who leads the Dulce base?")
    queries = [n["query"] for n in result.state["nodes"]]
    assert queries == ["Who leads the Dulce base?", "A", "B", "Shared"]
    # epoch 1 runs A and B, epoch 2 runs the merged "Shared" once
    assert [c.messages[-1].content for c in chat.calls if stage_of(c.messages, c.response_model) == "action"].count("Shared") == 1
    shared_id = queries.index("Shared")
    assert sorted(e["source"] for e in result.state["edges"] if e["target"] == shared_id) == [1, 2]


async def test_an_answer_listing_thousands_of_follow_ups_adds_only_the_first_hundred(store):
    """Every follow-up question a model listed joined the graph: at 10^5 per answer (JSON well within
    the response bound) two epochs made 10^6 nodes, 3 GB and held the event loop 25 s. The first
    max(drift_k_followups, 100) of each answer are kept; a usual answer's few are all kept, as
    graphrag keeps them (see test_drift_cli's 3 follow-ups at drift_k_followups=2)."""
    chat = ScriptedChatModel(drift_responder(children=5000))
    search = make_search(store, chat, drift_k_followups=3, primer_folds=2, n_depth=2)
    result = await search.search("Who leads the Dulce base?")
    nodes, edges = result.state["nodes"], result.state["edges"]
    assert len(nodes) == 1 + 2 * 100 + 3 * 100 + 3 * 100  # root, 100 per primer fold, 100 per action of two epochs
    assert sorted(n["query"] for n in nodes[1:201]) == sorted(f"P{f}-{i}" for f in range(2) for i in range(100))
    answered = [n for n in nodes if n["answer"] and n["id"] != 0]
    assert len(answered) == 6
    for node in answered:
        children = sorted(nodes[e["target"]]["query"] for e in edges if e["source"] == node["id"])
        assert children == sorted(f"{node['query']}/{i}" for i in range(100))


async def test_failing_actions_do_not_fail_the_query(store):
    chat = ScriptedChatModel(drift_responder(fail={"P0-0"}))
    builder = StubContextBuilder(fail_on="P0-1")
    search = make_search(store, chat, builder=builder, drift_k_followups=4, primer_folds=2, n_depth=1)
    result = await search.search("Who leads the Dulce base?")
    assert result.response == REDUCE_TEXT
    nodes = {n["query"]: n for n in result.state["nodes"]}
    junk, no_context = nodes["P0-0"], nodes["P0-1"]
    assert junk["score"] == "-inf" and "StructuredOutputError" in junk["metadata"]["error"]
    assert junk["metadata"]["llm_calls"] == 1 and junk["metadata"]["prompt_tokens"] > 0  # the failed call still counts
    assert no_context["score"] == "-inf" and "context build failed" in no_context["metadata"]["error"]
    assert no_context["metadata"]["llm_calls"] == 0  # never reached the model
    assert result.llm_calls_categories["action"] == 3
    reduce_prompt = chat.calls[-1].messages[0].content
    assert "answer to P1-0" in reduce_prompt and "answer to P0-0" not in reduce_prompt


@pytest.mark.parametrize("table", ["entities", "relationships", "text_units"])
async def test_a_data_file_deleted_after_open_fails_the_query_naming_the_table(dulce_db_uri, tmp_path, table):
    """A data file of a table the follow-ups read, deleted after the search opened (a sync that
    removed it, a cleanup by hand): every follow-up's local context failed and the answer came from
    the primer alone, reported only as degraded. The first failure now checks the store, and the
    query ends with a StoreError naming the table and the file, before any follow-up or reduce call."""
    import shutil

    from drift_lance.drift import open_drift_search
    from drift_lance.errors import StoreError

    copy = tmp_path / "copy"
    shutil.copytree(dulce_db_uri, copy)
    chat = ScriptedChatModel(drift_responder())
    async with await open_drift_search(copy, chat_model=chat, embedder=HashEmbedder(3072),
                                       config={"seed": 1, "drift_k_followups": 2, "primer_folds": 1}) as search:
        (data_file,) = (copy / f"{table}.lance" / "data").iterdir()
        data_file.unlink()
        with pytest.raises(StoreError, match=rf"table '{table}' at version \d+ cannot be read: file {data_file} is missing"):
            await search.search("Who leads the Dulce base?")
    assert stages(chat) == ["hyde", "primer"]


async def test_a_reports_file_deleted_after_open_fails_the_python_api_naming_the_table(dulce_db_uri, tmp_path):
    """community_reports' data deleted after the search opened: DRIFTSearch.search, stream_search
    and LocalSearch raised LanceDB's bare "RuntimeError: lance error: Not found: ..." from the primer
    (the CLI named the table). Now the IndexUnreadableError the CLI reports (503 in the service)."""
    import shutil

    from drift_lance.drift import open_drift_search
    from drift_lance.errors import IndexUnreadableError
    from drift_lance.local import LocalContextBuilder, LocalSearch

    copy = tmp_path / "copy"
    shutil.copytree(dulce_db_uri, copy)
    chat = ScriptedChatModel(drift_responder())
    async with await open_drift_search(copy, chat_model=chat, embedder=HashEmbedder(3072),
                                       config={"seed": 1, "drift_k_followups": 2, "primer_folds": 1},
                                       store_config={"table_cache_bytes": 0, "vector_cache_bytes": 0}) as search:
        shutil.rmtree(copy / "community_reports.lance" / "data")
        unreadable = r"table 'community_reports' at version \d+ cannot be read"
        with pytest.raises(IndexUnreadableError, match=unreadable) as info:
            await search.search("Who leads the Dulce base?")
        assert "Not found" in str(info.value.__cause__)  # LanceDB's own error stays as the cause
        with pytest.raises(IndexUnreadableError, match=unreadable):
            await search.stream_search("Who leads the Dulce base?").text()
        local = LocalSearch(ScriptedChatModel(["answer"]), LocalContextBuilder(search.store), embedder=HashEmbedder(3072))
        with pytest.raises(IndexUnreadableError, match=unreadable):
            await local.search("Who leads the Dulce base?")
        with pytest.raises(IndexUnreadableError, match=unreadable):
            await local.stream_search("Who leads the Dulce base?").text()
    assert "reduce" not in stages(chat)


async def test_action_timeout_marks_the_action_and_the_search_goes_on(store):
    base = drift_responder()

    async def respond(messages, params, response_model):
        if response_model is ActionAnswer and messages[-1].content == "P0-0":
            await asyncio.sleep(5)
        return base(messages, params, response_model)

    chat = ScriptedChatModel(respond)
    search = make_search(store, chat, drift_k_followups=4, primer_folds=2, n_depth=1, llm_timeout=0.2)
    result = await search.search("Who leads the Dulce base?")
    slow = next(n for n in result.state["nodes"] if n["query"] == "P0-0")
    assert "LLMTimeoutError" in slow["metadata"]["error"]
    assert result.response == REDUCE_TEXT
    assert chat.in_flight == 0


async def test_a_stuck_follow_up_is_cut_off_by_the_time_budget_and_the_reduce_answers(store):
    """No per-call timeout: one follow-up never answers. At 3/4 of `time_budget` it is cancelled and
    marked failed, the epochs stop, and the reduce answers from the others."""
    base = drift_responder()

    async def respond(messages, params, response_model):
        if response_model is ActionAnswer and messages[-1].content == "P0-0":
            await asyncio.Event().wait()  # never answers
        return base(messages, params, response_model)

    chat = ScriptedChatModel(respond)
    updates: list[tuple[str, int]] = []

    class Record(DriftCallbacks):
        async def on_action_completed(self, action, epoch):
            updates.append((action.query, epoch))

    search = make_search(store, chat, drift_k_followups=4, primer_folds=2, n_depth=3, time_budget=1.0)
    async with asyncio.timeout(30):  # a failure here would otherwise hang the suite
        result = await search.search("Who leads the Dulce base?", callbacks=Record())
    assert result.response == REDUCE_TEXT and chat.in_flight == 0
    assert result.failures_categories["action"] == 1
    nodes = {n["query"]: n for n in result.state["nodes"]}
    stuck = nodes["P0-0"]
    assert stuck["score"] == "-inf" and "time budget" in stuck["metadata"]["error"]
    assert stuck["metadata"]["llm_calls"] == 1  # the request was made
    assert all(nodes[q]["answer"] == f"answer to {q}" for q in ("P0-1", "P1-0", "P1-1"))
    assert {epoch for _, epoch in updates} == {1} and len(updates) == 4  # every action reported, no second epoch
    reduce_prompt = chat.calls[-1].messages[0].content
    assert "answer to P1-0" in reduce_prompt and stage_of(chat.calls[-1].messages, None) == "reduce"


@pytest.mark.parametrize("streamed", [False, True], ids=["search", "stream_search"])
async def test_follow_ups_cut_off_while_waiting_for_a_slot_made_no_model_call(store, streamed):
    """With `concurrency` 1, the follow-ups queued behind a stuck one were cut off by the time budget
    before they reached the model, yet each was reported as an LLM call (action: 3 calls, the model
    got 1). Only calls the model got count."""
    base = drift_responder(children=3)
    stuck: list[str] = []

    async def respond(messages, params, response_model):
        if response_model is ActionAnswer and not stuck:
            stuck.append(messages[-1].content)
            await asyncio.Event().wait()  # the first follow-up never answers; the rest wait for its slot
        return base(messages, params, response_model)

    chat = ScriptedChatModel(respond)
    search = make_search(store, chat, drift_k_followups=3, primer_folds=2, n_depth=2, concurrency=1, time_budget=1.0)
    async with asyncio.timeout(30):
        result = await searched(search, streamed)
    assert stages(chat) == ["hyde", "primer", "primer", "action", "reduce"]
    assert result.llm_calls_categories == {"build_context": 1, "primer": 2, "action": 1, "reduce": 1}
    assert result.llm_calls == len(chat.calls) and result.failures_categories["action"] == 3  # all three cut off
    nodes = {node["query"]: node for node in result.state["nodes"]}
    assert {query: nodes[query]["metadata"]["llm_calls"] for query in nodes if nodes[query]["score"] == "-inf"} == {
        query: int(query == stuck[0]) for query in nodes if nodes[query]["score"] == "-inf"}


async def test_follow_ups_are_not_started_once_the_primer_used_their_time_budget(store):
    base = drift_responder()

    async def respond(messages, params, response_model):
        if response_model is PrimerFoldAnswer:
            await asyncio.sleep(0.3)
        return base(messages, params, response_model)

    chat = ScriptedChatModel(respond)
    search = make_search(store, chat, drift_k_followups=2, primer_folds=1, n_depth=2, time_budget=0.2)
    result = await search.search("q")
    assert result.response == REDUCE_TEXT and stages(chat) == ["hyde", "primer", "reduce"]
    assert result.failures == 0  # nothing was tried and failed: the follow-ups stay open in the graph
    assert [n["answer"] for n in result.state["nodes"][1:]] == [None, None]


async def test_cancelling_the_search_cancels_in_flight_calls(store):
    started = asyncio.Event()
    base = drift_responder(children=4)

    async def respond(messages, params, response_model):
        if response_model is ActionAnswer:
            started.set()
            await asyncio.sleep(30)
        return base(messages, params, response_model)

    chat = ScriptedChatModel(respond)
    search = make_search(store, chat, drift_k_followups=4, primer_folds=1, n_depth=1)
    task = asyncio.create_task(search.search("Who leads the Dulce base?"))
    await asyncio.wait_for(started.wait(), 10)
    assert chat.in_flight >= 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert chat.in_flight == 0  # every in-flight action call was cancelled, none left running


async def test_streamed_and_blocking_reduce_match_and_tokens_add_up(store):
    class Recorder(DriftCallbacks):
        def __init__(self):
            self.events: list[str] = []
            self.tokens: list[str] = []

        def on_primer_done(self, root, reports):
            self.events.append("primer")

        def on_action_completed(self, action, epoch):
            self.events.append(f"action{epoch}")

        def on_reduce_start(self, state):
            self.events.append("reduce_start")
            self.graph = state

        async def on_token(self, token):
            self.tokens.append(token)

        def on_reduce_end(self, response):
            self.events.append("reduce_end")

    config = dict(drift_k_followups=2, primer_folds=2, n_depth=2)
    blocking_chat = ScriptedChatModel(drift_responder())
    blocking = await make_search(store, blocking_chat, **config).search("Who leads the Dulce base?")

    stream_chat = ScriptedChatModel(drift_responder())
    recorder = Recorder()
    stream = make_search(store, stream_chat, **config).stream_search("Who leads the Dulce base?", callbacks=[recorder])
    deltas = [delta async for delta in stream]
    streamed = stream.result

    assert len(deltas) > 1 and "".join(deltas) == blocking.response == streamed.response == REDUCE_TEXT
    assert "".join(recorder.tokens) == REDUCE_TEXT
    assert recorder.events == ["primer", "action1", "action1", "action2", "action2", "reduce_start", "reduce_end"]
    assert recorder.graph == streamed.state and streamed.state["nodes"]  # reduce saw the final graph
    assert streamed.llm_calls_categories == blocking.llm_calls_categories
    assert streamed.prompt_tokens_categories == blocking.prompt_tokens_categories
    assert streamed.output_tokens_categories == blocking.output_tokens_categories
    for result, chat in ((blocking, blocking_chat), (streamed, stream_chat)):
        assert result.prompt_tokens == sum(result.prompt_tokens_categories.values()) == chat.usage.prompt_tokens
        assert result.output_tokens == sum(result.output_tokens_categories.values()) == chat.usage.output_tokens
        assert result.llm_calls == sum(result.llm_calls_categories.values()) == len(chat.calls)
        assert all(result.prompt_tokens_categories[s] > 0 for s in ("build_context", "primer", "action", "reduce"))


STAGE_OF_CALL = {"hyde": "build_context", "primer": "primer", "action": "action", "reduce": "reduce"}


def model_side_counts(chat: ScriptedChatModel) -> dict[str, tuple[int, int, int]]:
    """(calls, prompt tokens, output tokens) per stage, as the model was called and reported them."""
    counts = dict.fromkeys(STAGE_OF_CALL.values(), (0, 0, 0))
    for call in chat.calls:
        stage = STAGE_OF_CALL[stage_of(call.messages, call.response_model)]
        calls, prompt, output = counts[stage]
        usage = call.usage
        counts[stage] = (calls + 1, prompt + (usage.prompt_tokens if usage else 0), output + (usage.output_tokens if usage else 0))
    return counts


@pytest.mark.parametrize("streamed", [False, True], ids=["search", "stream_search"])
@pytest.mark.parametrize("failing", ["nothing", "hyde", "primer_fold", "follow_up_junk", "follow_up_raises"])
async def test_each_stage_reports_the_calls_and_tokens_the_model_got_and_reported(store, failing, streamed):
    """What a result says a query cost, per stage and in total, is what the chat model was called
    with and reported, failed calls included (one that answered unusable JSON cost its tokens, one
    that raised a call without tokens)."""
    base = drift_responder(children=3)
    folds, follow_ups = iter(range(100)), iter(range(100))

    def respond(messages, params, response_model):
        stage = stage_of(messages, response_model)
        if stage == "hyde" and failing == "hyde":
            raise RuntimeError("hyde broke")
        if stage == "primer" and failing == "primer_fold" and next(folds) == 0:
            return "not JSON"
        if stage == "action" and next(follow_ups) == 0:
            if failing == "follow_up_junk":
                return "not JSON"
            if failing == "follow_up_raises":
                raise RuntimeError("follow-up broke")
        return base(messages, params, response_model)

    chat = ScriptedChatModel(respond)
    search = make_search(store, chat, drift_k_followups=3, primer_folds=2, n_depth=2)
    result = await searched(search, streamed)
    assert result.failures == (failing != "nothing")
    reported = {stage: (result.llm_calls_categories[stage], result.prompt_tokens_categories[stage],
                        result.output_tokens_categories[stage]) for stage in STAGE_OF_CALL.values()}
    assert reported == model_side_counts(chat)
    assert (result.llm_calls, result.prompt_tokens, result.output_tokens) == (
        len(chat.calls), chat.usage.prompt_tokens, chat.usage.output_tokens)
    assert all(result.prompt_tokens_categories[s] > 0 for s in ("primer", "action", "reduce"))


@pytest.mark.parametrize("streamed", [False, True], ids=["search", "stream_search"])
async def test_a_query_answered_from_the_response_cache_reports_no_calls_or_tokens(store, tmp_path, streamed):
    """README: a response cache hit costs no call and reports zero usage; a repeated query's result
    says so in every stage."""
    from drift_lance.models.cache import CachedChatModel

    chat = ScriptedChatModel(drift_responder(children=3))
    cached = CachedChatModel(chat, tmp_path)
    results = []
    for _ in range(2):
        search = make_search(store, cached, drift_k_followups=2, primer_folds=2, n_depth=2)
        results.append(await searched(search, streamed))
    first, repeated = results
    assert first.llm_calls == len(chat.calls) == 8 and first.prompt_tokens == chat.usage.prompt_tokens
    assert repeated.response == first.response
    assert [n["query"] for n in repeated.state["nodes"]] == [n["query"] for n in first.state["nodes"]]
    assert len(chat.calls) == 8  # every call of the repeat was a hit
    for counts in (repeated.llm_calls_categories, repeated.prompt_tokens_categories, repeated.output_tokens_categories):
        assert counts == dict.fromkeys(STAGE_OF_CALL.values(), 0)
    assert (repeated.llm_calls, repeated.prompt_tokens, repeated.output_tokens) == (0, 0, 0)


@pytest.mark.parametrize("streamed", [False, True], ids=["search", "stream_search"])
@pytest.mark.parametrize("answer", ["", " \n\t "], ids=["empty", "whitespace"])
async def test_an_empty_reduce_answer_fails_the_search(store, answer, streamed):
    """A reduce answer of nothing or only whitespace was returned as the response (a blank CLI answer,
    exit status 0): the reduce call now counts as failed, as an empty HyDE or primer answer is unusable."""
    from drift_lance.models import EmptyAnswerError, ModelError

    responder = drift_responder()
    ended: list[str] = []

    class Ends(DriftCallbacks):
        def on_reduce_end(self, response):
            ended.append(response)

    def respond(messages, params, response_model):
        return answer if stage_of(messages, response_model) == "reduce" else responder(messages, params, response_model)

    search = make_search(store, ScriptedChatModel(respond), drift_k_followups=2, primer_folds=1, n_depth=1)
    with pytest.raises(EmptyAnswerError) as info:
        if streamed:
            async with search.stream_search("Who leads the Dulce base?", callbacks=Ends()) as stream:
                async for _ in stream:
                    pass
        else:
            await search.search("Who leads the Dulce base?", callbacks=Ends())
    assert isinstance(info.value, ModelError)
    assert str(info.value).startswith("DRIFT reduce: chat model 'scripted' returned an empty answer")
    assert info.value.usage.calls == 1  # what the call cost
    assert ended == [] and (not streamed or stream.result is None)


async def test_callbacks_may_be_one_object_or_a_list(store):
    """`callbacks=` takes one callbacks object as well as a sequence, on the search and per query."""
    class Counter(DriftCallbacks):
        def __init__(self):
            self.reduced = 0

        def on_reduce_end(self, response):
            self.reduced += 1

    on_search, per_query, in_list = Counter(), Counter(), Counter()
    search = make_search(store, ScriptedChatModel(drift_responder()), drift_k_followups=1, primer_folds=1, n_depth=1)
    search.callbacks = [on_search]
    await search.search("Who leads the Dulce base?", callbacks=per_query)
    stream = search.stream_search("Who leads the Dulce base?", callbacks=per_query)
    _ = [delta async for delta in stream]
    await search.search("Who leads the Dulce base?", callbacks=(in_list,))
    assert (on_search.reduced, per_query.reduced, in_list.reduced) == (3, 2, 1)
    one = DRIFTSearch(store=store, chat_model=ScriptedChatModel(drift_responder()), embedder=search.embedder,
                      context_builder=search.context_builder, tokenizer=search.tokenizer, config=search.config,
                      callbacks=Counter())
    assert len(one.callbacks) == 1


async def test_a_function_given_as_callbacks_is_refused_not_silently_never_called(store):
    # `callbacks=print` (or a lambda) was accepted and never called: no event has that name.
    chat = ScriptedChatModel(drift_responder())
    search = make_search(store, chat, drift_k_followups=1, primer_folds=1, n_depth=1)
    seen = []
    with pytest.raises(ConfigError, match=r"^callbacks: function test_.*<lambda> has none of the methods on_primer_done, .*on_reduce_end; subclass"):
        await search.search("Who leads the Dulce base?", callbacks=lambda *event: seen.append(event))
    with pytest.raises(ConfigError, match=r"^callbacks: builtin_function_or_method print has none"):
        DRIFTSearch(store=store, chat_model=chat, embedder=search.embedder, context_builder=search.context_builder,
                    tokenizer=search.tokenizer, callbacks=[print])
    with pytest.raises(ConfigError, match=r"^callbacks: str has none"):  # was "str  has none" (no __qualname__)
        await search.search("Who leads the Dulce base?", callbacks=["on_token"])
    assert chat.calls == []

    class OnlyTokens:  # any object with one of the events' methods will do
        def on_token(self, token):
            seen.append(token)

    async with search.stream_search("Who leads the Dulce base?", callbacks=OnlyTokens()) as stream:
        answer = await stream.text()
    assert "".join(seen) == answer == REDUCE_TEXT


async def test_every_model_call_of_a_query_carries_the_query_start_as_its_rank(store):
    """What the process-wide limiter serves oldest first: one rank per query, HyDE to reduce."""
    from drift_lance.models.limits import _search_started

    class RankRecorder:
        def __init__(self):
            self.inner = ScriptedChatModel(drift_responder())
            self.model_id = self.inner.model_id
            self.ranks: list[float | None] = []

        async def complete(self, messages, **kwargs):
            self.ranks.append(_search_started.get())
            return await self.inner.complete(messages, **kwargs)

        def stream(self, messages, **kwargs):
            self.ranks.append(_search_started.get())
            return self.inner.stream(messages, **kwargs)

    chat = RankRecorder()
    search = make_search(store, chat, drift_k_followups=2, primer_folds=2, n_depth=1)
    await search.search("Who leads the Dulce base?")
    first = list(chat.ranks)
    chat.ranks.clear()
    _ = [delta async for delta in search.stream_search("Who leads the Dulce base?")]
    second = chat.ranks
    assert len(first) >= 5 and len(set(first)) == 1 and first[0] is not None
    assert len(second) >= 5 and len(set(second)) == 1 and second[0] > first[0]
    assert _search_started.get() is None  # nothing left set after the queries


async def test_settings_reach_the_model_calls_and_prompts(store):
    chat = ScriptedChatModel(drift_responder())
    search = make_search(
        store, chat, drift_k_followups=2, primer_folds=1, n_depth=1,
        local_search_temperature=0.4, local_search_top_p=0.8, local_search_n=1,
        local_search_llm_max_gen_tokens=700, local_search_llm_max_gen_completion_tokens=300,
        reduce_temperature=0.3, reduce_max_tokens=900, response_type="one short paragraph",
    )
    await search.search("Who leads the Dulce base?")
    action = next(c for c in chat.calls if c.response_model is ActionAnswer)
    assert (action.params.temperature, action.params.top_p, action.params.max_tokens) == (0.4, 0.8, 300)
    system = action.messages[0].content
    assert "Who leads the Dulce base?" in system  # {global_query}
    assert f"entity for {action.messages[-1].content}" in system  # {context_data}
    assert "one short paragraph" in system and "up to 2 follow-up" in system  # {response_type}, {followups}
    reduce = chat.calls[-1]
    assert (reduce.params.temperature, reduce.params.max_tokens) == (0.3, 900)
    assert reduce.messages[-1].content == "Who leads the Dulce base?"
    primer = next(c for c in chat.calls if c.response_model is PrimerFoldAnswer)
    hyde = chat.calls[0]
    assert "Who leads the Dulce base?" in primer.prompt and "Who leads the Dulce base?" in hyde.prompt


async def test_token_budgets_limit_primer_reports_and_reduce_notes(store):
    chat = ScriptedChatModel(drift_responder())
    await make_search(store, chat, drift_k_followups=3, primer_folds=1, n_depth=1, primer_llm_max_tokens=50).search("q")
    primer = next(c for c in chat.calls if c.response_model is PrimerFoldAnswer)
    tokenizer = get_tokenizer("o200k_base")
    wide = ScriptedChatModel(drift_responder())
    await make_search(store, wide, drift_k_followups=3, primer_folds=1, n_depth=1).search("q")
    wide_primer = next(c for c in wide.calls if c.response_model is PrimerFoldAnswer)
    assert tokenizer.count(wide_primer.prompt) - tokenizer.count(primer.prompt) > 100

    # Reduce keeps the best-scored notes that fit data_max_tokens.
    scores = {"P0-0": 90, "P0-1": 10}
    chat = ScriptedChatModel(drift_responder(scores=scores))
    await make_search(store, chat, drift_k_followups=2, primer_folds=1, n_depth=1, data_max_tokens=25).search("q")
    notes = chat.calls[-1].messages[0].content
    assert "answer to P0-0" in notes and "answer to P0-1" not in notes


def _filled_in(prompt: str, template: str, field: str, **others) -> str:
    """What `template` got for `field` in `prompt` (the template formatted with the other fields)."""
    before, after = template.format(**{field: "\0"}, **others).split("\0")
    assert prompt.startswith(before) and prompt.endswith(after)
    return prompt[len(before) : len(prompt) - len(after)]


@pytest.mark.parametrize("budget", [60, 150, 400, 900])
async def test_reduce_notes_and_primer_reports_stay_within_their_budgets_separators_included(store, budget):
    """The notes (and a fold's reports) are joined with blank lines; those tokens used to be left
    out of the budget, so answers ending in a word went over it by a token per note."""
    from drift_lance.drift.prompts import load_prompts

    def respond(messages, params, response_model):
        reply = drift_responder(children=4)(messages, params, response_model)
        if isinstance(reply, dict) and "response" in reply:
            reply["response"] = f"the answer names {messages[-1].content} and ends in a word"
        return reply

    chat = ScriptedChatModel(respond)
    search = make_search(store, chat, drift_k_followups=8, primer_folds=1, n_depth=2,
                         data_max_tokens=budget, primer_llm_max_tokens=budget * 4)
    await search.search("Who leads the Dulce base?")
    count = get_tokenizer("o200k_base").count
    prompts = load_prompts(search.config)
    notes = _filled_in(chat.calls[-1].messages[0].content, prompts.reduce, "context_data", response_type="multiple paragraphs")
    assert notes.count("## ") > 1 and count(notes) <= budget
    primer = next(c for c in chat.calls if c.response_model is PrimerFoldAnswer)
    reports = _filled_in(primer.prompt, prompts.primer, "community_reports", query="Who leads the Dulce base?", followups=5)
    assert count(reports) <= budget * 4


async def test_parent_score_ranking_follows_the_best_branch(store):
    scores = {"P0-0": 95, "P0-1": 5}
    chat = ScriptedChatModel(drift_responder(scores=scores))
    search = make_search(store, chat, drift_k_followups=2, primer_folds=1, n_depth=2, action_ranking="parent_score")
    await search.search("Who leads the Dulce base?")
    actions = [c.messages[-1].content for c in chat.calls if c.response_model is ActionAnswer]
    assert actions[:2] == ["P0-0", "P0-1"]  # both children of the root share its score: insertion order
    assert sorted(actions[2:]) == ["P0-0/0", "P0-0/1"]  # epoch 2 follows the 95-point branch


async def test_seed_makes_random_order_reproducible(store):
    runs = []
    for _ in range(2):
        chat = ScriptedChatModel(drift_responder(children=3))
        await make_search(store, chat, drift_k_followups=2, primer_folds=2, n_depth=2).search("q")
        runs.append([c.messages[-1].content for c in chat.calls if c.response_model is ActionAnswer])
    assert runs[0] == runs[1]


async def test_any_failing_call_degrades_hyde_falls_back_a_fold_and_a_follow_up_are_skipped(store):
    """A custom chat model may raise anything: the HyDE call falls back to the query, a fold and a
    follow-up are skipped, and a TimeoutError of the model's own (llm_timeout unset) says so."""
    folds = iter([RuntimeError("fold broke"), {"intermediate_answer": "ok", "score": 70, "follow_up_queries": ["F", "G"]}])
    responder = drift_responder(children=0)

    def respond(messages, params, response_model):
        stage = stage_of(messages, response_model)
        if stage == "hyde":
            raise TimeoutError("read timed out")
        if stage == "primer":
            item = next(folds)
            if isinstance(item, Exception):
                raise item
            return item
        if stage == "action" and messages[-1].content == "G":
            raise TimeoutError("read timed out")
        return responder(messages, params, response_model)

    search = make_search(store, ScriptedChatModel(respond), drift_k_followups=2, primer_folds=2, n_depth=1, llm_timeout=None)
    result = await search.search("q")
    root, *follow_ups = result.state["nodes"]
    assert root["metadata"]["hyde_query"] == "q" and root["answer"] == "ok"
    assert root["metadata"]["fold_errors"] == ["RuntimeError: fold broke"]
    failed = next(node for node in follow_ups if node["query"] == "G")
    assert failed["score"] == "-inf" and failed["metadata"]["error"] == "ModelError: the chat model timed out: read timed out"
    assert next(node for node in follow_ups if node["query"] == "F")["answer"]
    assert result.llm_calls_categories == {"build_context": 1, "primer": 2, "action": 2, "reduce": 1}
    # what the answer had to do without, at the top of the result
    assert result.failures_categories == {"build_context": 1, "primer": 1, "action": 1, "reduce": 0}
    assert result.failures == 3


@pytest.mark.parametrize("level", [0, 1])
async def test_the_primer_reads_reports_at_or_under_the_community_level(store, level):
    """graphrag's DRIFT reads the reports of levels <= community_level (its default 2) for the HyDE
    template and the top-k reports, as the follow-ups' local contexts do."""
    builder = StubContextBuilder()
    builder.config = LocalSearchConfig(community_level=level)
    reports = await store.scan("community_reports", columns=["level", "full_content"])
    chat = ScriptedChatModel(drift_responder())
    result = await make_search(store, chat, builder=builder, drift_k_followups=20, primer_folds=1, n_depth=0).search("q")
    primed = result.context_data["q"]["reports"]
    assert {r["level"] for r in primed} == ({0} if level == 0 else {0, 1})
    assert len(primed) == reports.filter(pl.col("level") <= level).height  # every report there, no other
    hyde = chat.calls[0].messages[-1].content
    allowed = reports.filter(pl.col("level") <= level)["full_content"].to_list()
    assert any(text in hyde for text in allowed)


@pytest.fixture(scope="module")
def few_top_level_reports_db(tmp_path_factory) -> str:
    """An ingested synthetic graphrag index where level 0 holds 10 of its 200 reports."""
    import ingest
    from ingest.synthetic import generate_index

    root = tmp_path_factory.mktemp("synth-levels")
    src = generate_index(root / "idx", n_entities=3200, dim=48, seed=7)
    uri = str(root / "db")
    asyncio.run(ingest.run_ingest(src, uri, progress=False))
    return uri


async def test_the_hyde_template_is_a_random_report_of_the_level_even_when_few_are_there(few_top_level_reports_db):
    """graphrag shapes the HyDE expansion like `secrets.choice(reports)` at the level. With 10 of
    200 reports at level 0, most random ids miss the level: the fallback must draw among those
    there, not take the first one (which then shaped about two thirds of all expansions)."""
    from drift_lance._lance_store import open_store

    store = await open_store(few_top_level_reports_db)
    try:
        reports = await store.scan("community_reports", columns=["level", "full_content"])
        level_zero = reports.filter(pl.col("level") == 0)["full_content"].to_list()
        assert len(level_zero) == 10 and reports.height == 200
        picked = []
        for seed in range(60):
            builder = StubContextBuilder()
            builder.config = LocalSearchConfig(community_level=0)
            chat = ScriptedChatModel(drift_responder())
            search = make_search(store, chat, builder=builder, drift_k_followups=3, primer_folds=1, n_depth=0, seed=seed)
            await search.search("q")
            hyde = chat.calls[0].messages[-1].content
            picked.append(next(i for i, text in enumerate(level_zero) if text in hyde))
    finally:
        await store.close()
    counts = [picked.count(i) for i in range(10)]
    assert max(counts) <= 15, counts  # uniform: about 6 each; the first report alone took ~40
    assert sum(1 for c in counts if c) >= 8, counts


async def test_primer_survives_one_bad_fold_and_embedder_dimension_is_checked(store):
    answers = iter(["not json", {"intermediate_answer": "ok", "score": 70, "follow_up_queries": ["F"]}])

    def respond(messages, params, response_model):
        stage = stage_of(messages, response_model)
        if stage == "primer":
            return next(answers)
        return drift_responder()(messages, params, response_model)

    chat = ScriptedChatModel(respond)
    search = make_search(store, chat, drift_k_followups=2, primer_folds=2, n_depth=0)
    result = await search.search("q")
    root = result.state["nodes"][0]
    assert root["answer"] == "ok" and root["score"] == 70 and "fold_errors" in root["metadata"]
    assert result.llm_calls_categories["primer"] == 2

    with pytest.raises(EmbeddingMismatchError, match=r"table 'community_reports' column 'vector' holds \d+-d vectors.*produces 64-d"):
        DRIFTSearch(
            store=store, chat_model=chat, embedder=HashEmbedder(64), context_builder=StubContextBuilder(),
            tokenizer=get_tokenizer("o200k_base"),
        )


class ZeroEmbedder(HashEmbedder):
    def embed_sync(self, texts):
        return np.zeros((len(texts), self._size), dtype=np.float32)


async def test_an_all_zero_query_vector_stops_the_primer_with_a_clear_error(store):
    # An exact table would otherwise hand the primer its first reports in table order, an ANN
    # table none at all ("returned no reports"): neither says the embedder is at fault.
    chat = ScriptedChatModel(drift_responder())
    search = make_search(store, chat, drift_k_followups=2, primer_folds=1, n_depth=1)
    search.embedder = ZeroEmbedder(store.manifest.vectors["community_reports"].dimension)
    with pytest.raises(EmbeddingMismatchError, match="all-zero vector for the expanded query"):
        await search.search("q")
    assert stages(chat) == ["hyde"]


async def test_each_epoch_embeds_its_action_queries_in_one_request(store):
    chat = ScriptedChatModel(drift_responder(children=3))
    search = make_search(store, chat, drift_k_followups=3, primer_folds=1, n_depth=2)
    await search.search("Who leads the Dulce base?")
    query_calls = [call for call in search.embedder.calls if call.kind == "query"]
    # the HyDE text, then one batch per epoch holding that epoch's three action queries
    assert [len(call.texts) for call in query_calls] == [1, 3, 3]


class _CountingBuilder:
    """The real LocalContextBuilder, recording how entities were selected."""

    def __init__(self, store, *, fail_batch: bool = False):
        from drift_lance.local import LocalContextBuilder

        self.inner = LocalContextBuilder(store)
        self.fail_batch = fail_batch
        self.batches: list[int] = []
        self.prefetches: list[int] = []
        self.builds_with_selections = 0
        self.builds_searching = 0
        self.builds_with_candidates = 0

    async def select_entities(self, vectors):
        if self.fail_batch:
            raise RuntimeError("entity table unavailable")
        self.batches.append(len(vectors))
        return await self.inner.select_entities(vectors)

    async def prefetch(self, selections):
        self.prefetches.append(len(selections))
        return await self.inner.prefetch(selections)

    async def build(self, query, *, query_vector=None, embedder=None, selected_entities=None, candidates=None):
        if selected_entities is None:
            self.builds_searching += 1
        else:
            self.builds_with_selections += 1
        self.builds_with_candidates += candidates is not None
        return await self.inner.build(query, query_vector=query_vector, embedder=embedder,
                                      selected_entities=selected_entities, candidates=candidates)


@pytest.mark.parametrize("fail_batch", [False, True])
async def test_each_epoch_maps_its_follow_ups_with_one_batched_entity_search(dulce_db_uri, fail_batch):
    """One store search and one round of row lookups per epoch instead of one per action (one
    matrix product on exactly searched tables); if the batch fails, each action searches and looks
    up on its own and the query still completes."""
    from drift_lance._lance_store import open_store

    store = await open_store(dulce_db_uri)
    try:
        embedder = HashEmbedder(store.manifest.vectors["entities"].dimension)
        builder = _CountingBuilder(store, fail_batch=fail_batch)
        chat = ScriptedChatModel(drift_responder(children=3))
        search = DRIFTSearch(store=store, chat_model=chat, embedder=embedder, context_builder=builder,
                             tokenizer=get_tokenizer("o200k_base"),
                             config=DRIFTSearchConfig(seed=1, drift_k_followups=3, primer_folds=1, n_depth=2))
        result = await search.search("Who leads the Dulce base?")
    finally:
        await store.close()
    assert result.llm_calls_categories["action"] == 6
    assert all("-----Entities-----" in text for query, text in result.context_text.items() if "/" in query or "-" in query)
    if fail_batch:
        assert builder.batches == builder.prefetches == []
        assert (builder.builds_searching, builder.builds_with_selections, builder.builds_with_candidates) == (6, 0, 0)
    else:
        assert builder.batches == builder.prefetches == [3, 3]
        assert (builder.builds_searching, builder.builds_with_selections, builder.builds_with_candidates) == (0, 6, 6)


async def test_open_drift_search_may_be_awaited_or_used_in_async_with(dulce_db_uri):
    """`async with open_drift_search(db) as search:` failed with "'coroutine' object does not support
    the asynchronous context manager protocol" and a never-awaited warning: it now opens the search
    and closes it (and the store it opened) on leaving the block, even on an error."""
    import warnings

    from drift_lance import open_drift_search, open_store

    dim = 3072
    parts = {"chat_model": ScriptedChatModel(drift_responder()), "embedder": HashEmbedder(dim),
             "config": {"n_depth": 0, "primer_folds": 1, "seed": 1}}
    async with open_drift_search(dulce_db_uri, **parts) as search:
        assert isinstance(search, DRIFTSearch)
        assert (await search.search("Who leads the Dulce base?")).response == REDUCE_TEXT
    with pytest.raises(ConfigError, match="is closed"):
        await search.search("again?")
    assert search.store._closed
    with pytest.raises(RuntimeError, match="in the block"):
        async with open_drift_search(dulce_db_uri, **parts) as failing:
            raise RuntimeError("in the block")
    assert failing.store._closed
    awaited = await open_drift_search(dulce_db_uri, **parts)  # the awaited form is unchanged, and left open
    assert isinstance(awaited, DRIFTSearch) and not awaited.store._closed
    await awaited.close()
    # made and dropped unused: nothing is opened (a missing database is not even looked at), no warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        open_drift_search("/no/such/database", **parts)
        open_store("/no/such/database")
        gc.collect()
    assert [str(w.message) for w in caught] == []


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_search_failing_because_close_ran_meanwhile_says_so(store, streamed):
    """close() shuts the models a search uses; the search then fails naming the close, not as
    the model's failure."""
    from drift_lance.models.base import ModelError

    closed = asyncio.Event()
    base = drift_responder()

    async def respond(messages, params, response_model):
        if stage_of(messages, response_model) == "primer":
            await closed.wait()
            raise ModelError("Cannot send a request, as the client has been closed.")
        return base(messages, params, response_model)

    search = make_search(store, ScriptedChatModel(respond), drift_k_followups=2, primer_folds=1, n_depth=1)
    run = search.stream_search("q").text() if streamed else search.search("q")
    task = asyncio.create_task(run)
    await asyncio.sleep(0.05)
    await search.close()
    closed.set()
    with pytest.raises(ConfigError, match="was closed while the search ran"):
        await task


async def test_close_closes_the_models_the_search_owns_and_nothing_else(store):
    class Closable(ScriptedChatModel):
        closed = 0

        async def aclose(self):
            self.closed += 1

    owned, given = Closable(drift_responder()), Closable(drift_responder())
    search = DRIFTSearch(store=store, chat_model=given, embedder=HashEmbedder(store.manifest.vectors["community_reports"].dimension),
                         context_builder=StubContextBuilder(), tokenizer=get_tokenizer("o200k_base"), owned_models=[owned])
    await search.close()
    assert (owned.closed, given.closed) == (1, 0)


async def test_a_stream_left_early_in_async_with_is_closed_and_a_closed_search_refuses(store):
    chat = ScriptedChatModel(drift_responder())
    search = make_search(store, chat, drift_k_followups=2, primer_folds=1, n_depth=1)
    async with search.stream_search("q") as stream:
        async for _ in stream:
            break  # the reduce is still streaming
    assert chat.in_flight == 0  # closed on leaving the block, not when collected
    await search.close()
    with pytest.raises(ConfigError, match="is closed"):
        await search.search("q")
    with pytest.raises(ConfigError, match="is closed"):
        async for _ in search.stream_search("q"):
            pass


@pytest.mark.parametrize("kept", [False, True], ids=["loop-only", "kept-in-a-variable"])
async def test_a_stream_left_by_break_without_async_with_ends_its_model_call_at_once(store, kept):
    # The stream and its generator referred to each other, so the abandoned call (and its
    # concurrency slot) lived until a garbage collection: with max_concurrency=1 the next search
    # waited 20 s. With the collector off, only the reference drop can close it.
    chat = ScriptedChatModel(drift_responder())
    search = make_search(store, chat, drift_k_followups=2, primer_folds=1, n_depth=1)
    gc.disable()
    try:
        stream = search.stream_search("q")
        async for _ in stream if kept else search.stream_search("q"):
            break  # the reduce is still streaming
        for _ in range(50):
            if chat.in_flight == 0:
                break
            await asyncio.sleep(0)
        assert chat.in_flight == 0
        if kept:  # a stream left early stays ended: iterating it again starts no second search
            calls = len(chat.calls)
            assert [delta async for delta in stream] == [] and len(chat.calls) == calls
    finally:
        gc.enable()


def test_async_with_a_stream_types_it_as_the_stream_itself():
    # `async with search.stream_search(q) as stream: ...; stream.result` (the README's own example):
    # __aenter__ was annotated as the base GeneratorStream, which has no `result` nor `text()`, so a
    # type checker reading py.typed flagged both. (No checker is installed here: read the hints.)
    from typing import Self, get_type_hints

    from drift_lance.drift import DriftStream
    from drift_lance.local import LocalStream

    for stream_class in (DriftStream, LocalStream):
        assert get_type_hints(stream_class.__aenter__)["return"] is Self


async def test_drift_budgets_fit_a_model_with_a_small_fixed_window(store):
    from drift_lance.local import LocalContextBuilder
    from drift_lance.models import get_tokenizer

    chat = ScriptedChatModel(drift_responder())
    chat.n_ctx = 4096
    builder = LocalContextBuilder(store)
    search = make_search(store, chat, builder=builder, drift_k_followups=2, primer_folds=1, n_depth=1)
    assert (search.config.local_search_max_data_tokens, search.config.primer_llm_max_tokens, search.config.data_max_tokens) == (2048, 2048, 2048)
    result = await search.search("q")
    count = get_tokenizer("o200k_base").count
    contexts = [text for query, text in result.context_text.items() if query != "q"]
    assert contexts and all(0 < count(text) <= 2048 for text in contexts)



async def test_a_search_kept_open_past_its_generations_cleanup_says_to_reopen(dulce_dir, tmp_path):
    """A long-lived search object (a notebook, an app that embeds the engine) on a database that a
    later ingest cleaned up failed with LanceDB's bare "RuntimeError: lance error: Not found:
    .../data/....lance"; now a StoreError names the generation and says to open the index again."""
    import ingest
    from drift_lance import IngestConfig
    from drift_lance.drift import open_drift_search
    from drift_lance.errors import StoreError
    from drift_lance.local import LocalContextBuilder, LocalSearch

    uri = str(tmp_path / "db")
    replace_at_once = IngestConfig(keep_replaced_seconds=0)
    await ingest.run_ingest(dulce_dir, uri, config=replace_at_once, progress=False)
    search = await open_drift_search(
        uri, config={"drift_k_followups": 2, "primer_folds": 1, "n_depth": 1, "seed": 1},
        store_config={"table_cache_bytes": 0, "vector_cache_bytes": 0},  # every search reads the files
        chat_model=ScriptedChatModel(drift_responder()), embedder=HashEmbedder(3072),
    )
    async with search:
        assert (await search.search("Who leads the Dulce base?")).response == REDUCE_TEXT
        for _ in range(2):  # generation 1 stays as the previous one, then goes
            await ingest.run_ingest(dulce_dir, uri, config=replace_at_once, progress=False)
        gone = rf"^{uri}: generation 1, which this store was opened on, was deleted by a later ingest \(the newest is generation 3\); open the index again"
        with pytest.raises(StoreError, match=gone):
            await search.search("Who leads the Dulce base?")
        with pytest.raises(StoreError, match=gone):
            await search.stream_search("Who leads the Dulce base?").text()
        local = LocalSearch(ScriptedChatModel(["answer"]), LocalContextBuilder(search.store), embedder=HashEmbedder(3072))
        with pytest.raises(StoreError, match=gone):
            await local.search("Who leads the Dulce base?")
    async with await open_drift_search(uri, chat_model=ScriptedChatModel(drift_responder()), embedder=HashEmbedder(3072),
                                       config={"drift_k_followups": 2, "primer_folds": 1, "n_depth": 1}) as reopened:
        assert reopened.store.manifest.generation == 3
        assert (await reopened.search("Who leads the Dulce base?")).response == REDUCE_TEXT


async def test_open_drift_search_refuses_a_missing_data_file_before_any_model_call(dulce_db_uri, tmp_path):
    """A copy whose text_units data file is missing (a partial sync) opened, and every DRIFT query
    answered from the primer alone: each follow-up's local context failed, reported as degraded."""
    import shutil

    from drift_lance.drift import open_drift_search
    from drift_lance.errors import StoreError

    partial = tmp_path / "partial"
    shutil.copytree(dulce_db_uri, partial)
    for data_file in (partial / "text_units.lance" / "data").iterdir():
        data_file.unlink()
    chat, embedder = ScriptedChatModel(drift_responder()), HashEmbedder(3072)
    with pytest.raises(StoreError, match=r"table 'text_units' at version \d+ cannot be read: file .*text_units.lance/data/.* is missing"):
        await open_drift_search(partial, chat_model=chat, embedder=embedder)
    assert chat.calls == [] and embedder.calls == []


async def test_open_drift_search_refuses_a_database_missing_a_table(dulce_db_uri, tmp_path):
    """Opened on a copy without its entities table, every search answered from the primer alone (each
    follow-up failed opening the table) and only reported itself degraded."""
    import shutil

    from drift_lance.drift import open_drift_search
    from drift_lance.errors import StoreError

    partial = tmp_path / "partial"
    shutil.copytree(dulce_db_uri, partial)
    shutil.rmtree(partial / "entities.lance")
    with pytest.raises(StoreError, match=r"cannot open table 'entities'"):
        await open_drift_search(partial, chat_model=ScriptedChatModel(drift_responder()), embedder=HashEmbedder(3072))
