"""End to end: DRIFT on the ingested dulce index through the real `openai` client and HTTP on 127.0.0.1.

The chat model is the production OpenAI backend talking to FakeOpenAIServer; the embedder returns
vectors from the index's own 3072-d space (a stored report vector for the HyDE text, the golden
query vectors of graphrag's reference contexts for the follow-ups), so the test can check that the
server receives the expected top report in the primer prompt and graphrag's own context sections
in the follow-up prompts.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import numpy as np
import pytest

from drift_lance.config.drift import DRIFTSearchConfig
from drift_lance.drift import open_drift_search
from drift_lance.errors import StoreError
from drift_lance.models import get_chat_model
from drift_lance.testing import Reply, ScriptedChatModel

QUERY = "How is the Dulce base operation commanded?"
HYDE_TEXT = "# Dulce Base Operational Command\n\nA hypothetical report about who commands the operation."
FOLLOW_REPORTS = "What does the Dulce Base community report say about the operation?"  # golden q01
FOLLOW_SOURCES = "What happens in the first chapter of Operation: Dulce?"  # golden q09
FINAL = "The operation is commanded from the Dulce base [Data: Reports (4); Sources (0, 3)]."
TEMPLATE_REPORT = 5  # human_readable_id of the report whose vector stands for the HyDE text


class IndexSpaceEmbedder:
    """Fixed vectors from the index's own embedding space, by exact text."""

    model_id = "dulce-index-vectors"

    def __init__(self, vectors: dict[str, np.ndarray]):
        self.vectors = vectors
        self.dimension = len(next(iter(vectors.values())))
        self.texts: list[str] = []

    async def embed(self, texts, *, kind="document"):
        self.texts.extend(texts)
        missing = [t for t in texts if t not in self.vectors]
        assert not missing, f"unexpected text to embed: {missing}"
        return np.stack([self.vectors[t] for t in texts]).astype(np.float32)


def _golden_case(golden: dict, query_id: str) -> dict:
    return next(c for c in golden["cases"] if c["profile"] == "drift_default" and c["query_id"] == query_id)


def _section(context_text: str, name: str) -> str:
    """One `-----Name-----` section of a graphrag context (header and rows)."""
    match = re.search(rf"-----{name}-----\n.*?(?=\n\s*-----\w+-----|\Z)", context_text, re.S)
    assert match, f"no {name} section in the golden context"
    return match.group(0).strip()


@pytest.fixture
def golden(shared_dir):
    return json.loads((shared_dir / "golden" / "local_context_dulce_v3.json").read_text())


@pytest.fixture
async def reports(dulce_store):
    frame = await dulce_store.scan("community_reports", columns=["human_readable_id", "title", "full_content", "vector"])
    return {row["human_readable_id"]: row for row in frame.to_dicts()}


@pytest.fixture
def embedder(reports, golden):
    return IndexSpaceEmbedder(
        {
            HYDE_TEXT: np.asarray(reports[TEMPLATE_REPORT]["vector"], dtype=np.float32),
            FOLLOW_REPORTS: np.asarray(_golden_case(golden, "q01")["query_vector"], dtype=np.float32),
            FOLLOW_SOURCES: np.asarray(_golden_case(golden, "q09")["query_vector"], dtype=np.float32),
        }
    )


def answer_like_a_model(request) -> Reply:
    """The fake server's model: recognise each DRIFT stage by its prompt."""
    messages = request.messages
    system = messages[0]["content"] if messages[0]["role"] == "system" else ""
    user = messages[-1]["content"]
    if user.startswith("Write a hypothetical answer"):
        return Reply(text=HYDE_TEXT)
    if "---Community reports---" in user:
        return Reply(json={
            "intermediate_answer": "The reports describe the Dulce base operation.",
            "score": 70,
            "follow_up_queries": [FOLLOW_REPORTS, FOLLOW_SOURCES],
        })
    if "---Data tables---" in system and "follow_up_queries" in system:  # DRIFT follow-up, not local search
        return Reply(json={"response": f"Finding for: {user}", "score": 60, "follow_up_queries": []})
    if "---Research notes---" in system:
        return Reply(text=FINAL)
    return Reply.bad_request(f"unexpected prompt: {user[:80]}")


async def test_open_drift_search_reads_the_index_as_its_store_config_says(dulce_db_uri, embedder):
    # The Python API's way to the settings the CLI and service take from Settings.store
    # (probes, caches, storage options): without it the index was always read with the defaults.
    from drift_lance import StoreConfig

    store_config = StoreConfig(fetch_chunk_size=3, table_cache_bytes=0)
    chat = ScriptedChatModel(lambda messages, params, response_model: "unused")
    search = await open_drift_search(dulce_db_uri, chat_model=chat, embedder=embedder, store_config=store_config)
    try:
        assert search.store.config == store_config
        titles = ["ALEX MERCER", "TAYLOR CRUZ", "JORDAN HAYES", "SAM RIVERA"]
        rows = await search.store.fetch("entities", "title", titles, columns=["title"])  # in IN lists of 3
        assert sorted(rows["title"].to_list()) == sorted(titles)
    finally:
        await search.close()


@pytest.mark.parametrize("streamed", [False, True], ids=["blocking", "streamed"])
async def test_drift_end_to_end_over_http(
    streamed, dulce_db_uri, openai_server, openai_settings, embedder, reports, golden, no_network
):
    openai_server.on_chat = answer_like_a_model
    config = DRIFTSearchConfig(drift_k_followups=4, primer_folds=2, n_depth=2, concurrency=4, seed=3)
    search = await open_drift_search(
        dulce_db_uri, config=config, chat_model=get_chat_model(openai_settings), embedder=embedder
    )
    try:
        if streamed:
            stream = search.stream_search(QUERY)
            deltas = [delta async for delta in stream]
            result = stream.result
            assert len(deltas) > 1 and "".join(deltas) == FINAL
        else:
            result = await search.search(QUERY)
    finally:
        await search.close()

    assert result.response == FINAL
    requests = openai_server.chat_requests
    # HyDE + 2 primer folds + 2 follow-ups (both folds proposed the same two: merged) + reduce;
    # depth 2 finds nothing left to run because the follow-ups proposed none.
    assert result.llm_calls_categories == {"build_context": 1, "primer": 2, "action": 2, "reduce": 1}
    assert len(requests) == result.llm_calls == 6
    assert requests[-1].stream is streamed

    hyde, primer_calls, actions, reduce = requests[0], requests[1:3], requests[3:5], requests[5]
    # HyDE: the query plus one stored report as the template.
    hyde_prompt = hyde.messages[-1]["content"]
    assert QUERY in hyde_prompt and any(r["full_content"] in hyde_prompt for r in reports.values())

    # Primer: the ANN query with the HyDE vector ranks the template report first; the top 4 reports
    # are split over the two folds, each asked for structured output.
    top = [r["human_readable_id"] for r in result.context_data[QUERY]["reports"]]
    assert len(top) == 4 and top[0] == TEMPLATE_REPORT
    primer_prompts = [r.messages[-1]["content"] for r in primer_calls]
    assert all(QUERY in p for p in primer_prompts)
    folds = sorted([sum(reports[h]["full_content"] in p for h in top) for p in primer_prompts])
    assert folds == [2, 2]
    assert any(reports[TEMPLATE_REPORT]["full_content"] in p for p in primer_prompts)
    assert all(r.response_format is not None for r in primer_calls)

    # Follow-ups: graphrag's own context sections for these query vectors, with the global query.
    by_query = {r.messages[-1]["content"]: r.messages[0]["content"] for r in actions}
    assert set(by_query) == {FOLLOW_REPORTS, FOLLOW_SOURCES}
    q01, q09 = _golden_case(golden, "q01")["context_text"], _golden_case(golden, "q09")["context_text"]
    assert _section(q01, "Reports") in by_query[FOLLOW_REPORTS]
    assert _section(q01, "Sources") in by_query[FOLLOW_REPORTS]
    assert _section(q09, "Sources") in by_query[FOLLOW_SOURCES]
    assert all(QUERY in system for system in by_query.values())
    assert "-----Claims-----" not in by_query[FOLLOW_REPORTS]  # DRIFT's local searches use no claims

    # Reduce: every intermediate answer, the user's query as the user message.
    notes = reduce.messages[0]["content"]
    assert "The reports describe the Dulce base operation." in notes
    assert f"Finding for: {FOLLOW_REPORTS}" in notes and f"Finding for: {FOLLOW_SOURCES}" in notes
    assert reduce.messages[-1]["content"] == QUERY

    # Token accounting: the server's reported usage, summed per stage.
    assert result.prompt_tokens == sum(result.prompt_tokens_categories.values()) > 0
    assert result.output_tokens == sum(result.output_tokens_categories.values()) > 0
    assert json.loads(json.dumps(result.model_dump(), allow_nan=False))["state"]["nodes"][0]["query"] == QUERY


async def test_bad_follow_up_answer_over_http_does_not_fail_the_query(
    dulce_db_uri, openai_server, openai_settings, embedder
):
    def answer(request):
        reply = answer_like_a_model(request)
        if request.messages[-1]["content"] == FOLLOW_SOURCES:
            return Reply(text="Sorry, I cannot answer in JSON.")
        return reply

    openai_server.on_chat = answer
    config = DRIFTSearchConfig(drift_k_followups=4, primer_folds=1, n_depth=1, seed=1)
    search = await open_drift_search(dulce_db_uri, config=config, chat_model=get_chat_model(openai_settings), embedder=embedder)
    try:
        result = await search.search(QUERY)
    finally:
        await search.close()
    assert result.response == FINAL
    failed = next(n for n in result.state["nodes"] if n["query"] == FOLLOW_SOURCES)
    assert failed["score"] == "-inf" and failed["metadata"]["error"]
    reduce_notes = openai_server.chat_requests[-1].messages[0]["content"]
    assert f"Finding for: {FOLLOW_REPORTS}" in reduce_notes and "cannot answer in JSON" not in reduce_notes


async def test_llm_timeout_does_not_count_the_wait_for_a_concurrency_slot(
    dulce_db_uri, openai_server, openai_settings, embedder, no_network
):
    """Three searches share one model slot (`max_concurrency` 1), so most calls wait for it far
    longer than `llm_timeout`; none takes that long at the model. Every follow-up answers: the
    timeout bounds a call's time at the model, not its wait behind other searches' calls (before,
    7 of 12 follow-ups failed as timed out when 4 searches shared 2 slots)."""

    def slow_model(request):
        reply = answer_like_a_model(request)
        reply.delay = 0.2
        return reply

    openai_server.on_chat = slow_model
    chat = get_chat_model(openai_settings.model_copy(update={"max_concurrency": 1}))
    config = DRIFTSearchConfig(drift_k_followups=4, primer_folds=1, n_depth=1, seed=0, llm_timeout=0.8)
    search = await open_drift_search(dulce_db_uri, config=config, chat_model=chat, embedder=embedder)
    try:
        results = await asyncio.gather(*(search.search(QUERY) for _ in range(3)), return_exceptions=True)
    finally:
        await search.close()
    assert not [r for r in results if isinstance(r, BaseException)]  # a timed-out HyDE embeds the query: not in the index's space
    assert openai_server.max_concurrent == 1 and len(openai_server.chat_requests) == 15  # 5 calls each, one at a time
    for result in results:
        assert result.failures == 0 and result.response == FINAL
        assert result.llm_calls_categories == {"build_context": 1, "primer": 1, "action": 2, "reduce": 1}


class SlowBuilds:
    """The search's context builder with each build holding the event loop for `seconds` after it
    is done, as a CPU-heavy build does; records when each build ended (server clock)."""

    def __init__(self, builder, seconds: float):
        self.builder, self.seconds, self.ended = builder, seconds, []

    def __getattr__(self, name):
        return getattr(self.builder, name)

    async def build(self, *args, **kwargs):
        context = await self.builder.build(*args, **kwargs)
        time.sleep(self.seconds)  # blocks the loop; the fake server's thread still runs
        self.ended.append(time.monotonic())
        return context


async def test_each_follow_up_request_leaves_while_later_contexts_build(
    dulce_db_uri, openai_server, openai_settings, embedder, no_network
):
    """A follow-up's request reaches the server as soon as its context is built, not after the
    epoch's last build: the LLM starts on it while the engine builds the rest."""
    openai_server.on_chat = answer_like_a_model
    config = DRIFTSearchConfig(drift_k_followups=2, primer_folds=1, n_depth=1, context_concurrency=1, seed=0)
    search = await open_drift_search(dulce_db_uri, config=config, chat_model=get_chat_model(openai_settings), embedder=embedder)
    search.context_builder = slow = SlowBuilds(search.context_builder, seconds=0.3)
    try:
        result = await search.search(QUERY)
    finally:
        await search.close()
    assert result.llm_calls_categories["action"] == 2 and len(slow.ended) == 2
    first_action = openai_server.chat_requests[2]  # after HyDE and the primer's fold
    assert "follow_up_queries" in first_action.messages[0]["content"]
    assert first_action.started_at < slow.ended[1], "the first follow-up's request waited for the second build"


async def test_embedding_model_of_unknown_dimension_is_checked_on_its_first_vectors(
    dulce_db_uri, openai_server, openai_settings, no_network
):
    """A self-hosted embedding model the client knows no dimension for (vLLM, Ollama, llama.cpp)
    opens and answers; one whose vectors do not fit the index fails the query, naming the table."""
    openai_server.on_chat = answer_like_a_model
    settings = openai_settings.model_copy(update={"embedding_model": "nomic-embed-text"})
    config = DRIFTSearchConfig(drift_k_followups=2, primer_folds=1, n_depth=1, seed=0)
    for server_dimension in (3072, 64):
        openai_server.embedding_dim = server_dimension
        search = await open_drift_search(dulce_db_uri, config=config, model_settings=settings)
        try:
            assert search.embedder.dimension == 0  # not known until its first vectors
            if server_dimension == 3072:
                result = await search.search(QUERY)
                assert result.response == FINAL and result.llm_calls_categories["action"] == 2
            else:
                with pytest.raises(StoreError, match=r"dimension 64 but table 'community_reports'.*3072"):
                    await search.search(QUERY)
        finally:
            await search.close()


async def test_a_model_endpoint_that_fails_is_a_drift_lance_error(dulce_db_uri, openai_server, openai_settings, no_network):
    """`except DriftLanceError` around a search catches every failure of ours, a model endpoint that
    keeps failing too (ModelError used to be a bare RuntimeError, outside the exported hierarchy)."""
    from drift_lance import DriftLanceError, ModelError
    from drift_lance.testing import HashEmbedder

    embedder = HashEmbedder(3072)  # HyDE fails too and falls back to embedding the question
    openai_server.on_chat = lambda request: Reply.server_error(500)
    config = DRIFTSearchConfig(drift_k_followups=2, primer_folds=1, n_depth=1)
    async with await open_drift_search(dulce_db_uri, config=config, model_settings=openai_settings, embedder=embedder) as search:
        with pytest.raises(DriftLanceError, match=r"chat model 'test-chat' at http://127\.0\.0\.1:\d+/v1 failed after 3 attempts: HTTP 500") as caught:
            await search.search(QUERY)
    assert isinstance(caught.value, ModelError)


async def test_open_drift_search_takes_settings_as_dicts_and_names_a_wrong_argument(dulce_db_uri):
    """What a notebook user writes: dicts for the settings and a model's name for the model. Dicts
    are validated as the settings' fields; anything else is a ConfigError naming the argument
    (it was an AttributeError from deep inside: "'dict' object has no attribute 'hyde_prompt'")."""
    from pathlib import Path

    from drift_lance import Settings
    from drift_lance.errors import ConfigError
    from drift_lance.testing import HashEmbedder

    chat = ScriptedChatModel(lambda messages, params, response_model: "unused")
    search = await open_drift_search(
        Path(dulce_db_uri), config={"n_depth": 2}, local_config={"community_level": 1},
        store_config={"fetch_chunk_size": 3}, chat_model=chat, embedder=HashEmbedder(3072),
    )
    async with search:
        assert search.config.n_depth == 2
        assert search.context_builder.config.community_level == 1
        assert search.store.config.fetch_chunk_size == 3
    wrong = [
        ({"config": {"n_dept": 2}}, r"^config: unknown DRIFTSearchConfig field 'n_dept'; did you mean 'n_depth'\?$"),
        ({"config": "n_depth=2"}, r"^config: expected DRIFTSearchConfig \(or a dict of its fields\), got str 'n_depth=2'$"),
        ({"store_config": {"index_cache_bytes": "lots"}}, r"^store_config: field 'index_cache_bytes': Input should be a valid integer"),
        ({"model_settings": ["gpt-4o"]}, r"^model_settings: expected ModelSettings \(or a dict of its fields\), got list"),
        ({"store_config": Settings.load()}, r"^store_config: expected StoreConfig \(or a dict of its fields\), got Settings .*; pass its \.store$"),
        ({"chat_model": "gpt-4o"}, r"^chat_model: expected an object with an async complete\(\) method, got str; "
                                   r"to name a model, build it: get_chat_model\(ModelSettings\(chat_model='gpt-4o'\)\)$"),
    ]
    for arguments, message in wrong:
        with pytest.raises(ConfigError, match=message):
            await open_drift_search(dulce_db_uri, **{"chat_model": chat, "embedder": HashEmbedder(3072), **arguments})
