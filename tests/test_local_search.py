"""`local` search: context from the LanceDB builder + one answer from the chat model (blocking and
streamed), with the local-search system prompt. The model is a scripted double; the store is the
real ingested dulce index."""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest

from drift_lance.config.local import LocalSearchConfig
from drift_lance.errors import ConfigError, EmbeddingMismatchError
from drift_lance.local import LocalContextBuilder, LocalSearch, build_local_context, load_local_prompt
from drift_lance.models.base import ModelError
from drift_lance.testing import HashEmbedder, ScriptedChatModel

ANSWER = "The squad runs Operation: Dulce [Data: Entities (4, 5); Relationships (4)]."


@pytest.fixture
def query_vector(golden_local_context) -> np.ndarray:
    return np.asarray(golden_local_context["cases"][12]["query_vector"], dtype=np.float32)


async def test_search_sends_context_in_system_prompt_and_returns_answer(dulce_store, query_vector):
    model = ScriptedChatModel([ANSWER])
    search = LocalSearch(model, LocalContextBuilder(dulce_store))
    result = await search.search("Who runs Operation: Dulce?", query_vector=query_vector, response_type="one paragraph")

    assert result.response == ANSWER
    context = await LocalContextBuilder(dulce_store).build("", query_vector=query_vector)
    assert result.context_text == context.context_text
    assert [r["id"] for r in result.context_data["entities"]] == context.record_ids("entities")
    (call,) = model.calls
    system, user = call.messages
    assert system.role == "system" and user.role == "user" and user.content == "Who runs Operation: Dulce?"
    assert context.context_text in system.content
    assert "---Target response length and format---\n\none paragraph\n" in system.content
    assert result.llm_calls == 1 and result.prompt_tokens > context.token_count and result.output_tokens > 0
    assert result.llm_calls_categories == {"build_context": 0, "response": 1}


async def test_stream_search_yields_the_answer_in_deltas(dulce_store, query_vector):
    model = ScriptedChatModel([ANSWER])
    search = LocalSearch(model, LocalContextBuilder(dulce_store))
    deltas = [d async for d in search.stream_search("Who runs it?", query_vector=query_vector)]
    assert len(deltas) > 1 and "".join(deltas) == ANSWER
    assert model.calls[0].kind == "stream"


async def test_a_stream_left_by_break_ends_its_model_call_without_waiting_for_a_collection(dulce_store, query_vector):
    model = ScriptedChatModel([ANSWER])
    search = LocalSearch(model, LocalContextBuilder(dulce_store))
    gc.disable()  # only dropping the loop's iterator may close it
    try:
        async for _ in search.stream_search("Who runs it?", query_vector=query_vector):
            break
        for _ in range(50):
            if model.in_flight == 0:
                break
            await asyncio.sleep(0)
        assert model.in_flight == 0
    finally:
        gc.enable()


async def test_an_empty_question_is_refused_before_any_model_call(dulce_store, query_vector):
    model = ScriptedChatModel([ANSWER])
    search = LocalSearch(model, LocalContextBuilder(dulce_store))
    with pytest.raises(ConfigError, match="the question is empty"):
        await search.search(" ", query_vector=query_vector)
    with pytest.raises(ConfigError, match="the question is empty"):
        search.stream_search("")
    assert model.calls == []


async def test_a_question_that_is_not_text_is_a_config_error(dulce_store, query_vector):
    model = ScriptedChatModel([ANSWER])
    search = LocalSearch(model, LocalContextBuilder(dulce_store))
    for question, kind in ((b"Who runs it?", "bytes"), (42, "int")):
        with pytest.raises(ConfigError, match=rf"the question must be text \(str\), got {kind}"):
            await search.search(question, query_vector=query_vector)
    assert model.calls == []


async def test_settings_may_be_a_dict_and_a_wrong_argument_is_named(dulce_store, dulce_db_uri, query_vector):
    # A dict where a config goes, or the database path where the open store goes, failed at the
    # first build with "'dict' object has no attribute 'prompt'" / "'str' object has no attribute 'manifest'".
    model = ScriptedChatModel([ANSWER])
    search = LocalSearch(model, LocalContextBuilder(dulce_store, config={"top_k_entities": 3}))
    assert search.config.top_k_entities == 3
    result = await search.search("Who runs it?", query_vector=query_vector)
    expected = await LocalContextBuilder(dulce_store, config=LocalSearchConfig(top_k_entities=3)).build("", query_vector=query_vector)
    assert result.response == ANSWER and result.context_text == expected.context_text
    with pytest.raises(ConfigError, match=r"^config: unknown LocalSearchConfig field 'top_k_entites'; did you mean 'top_k_entities'\?$"):
        LocalContextBuilder(dulce_store, config={"top_k_entites": 3})
    with pytest.raises(ConfigError, match=r"^config: expected LocalSearchConfig \(or a dict of its fields\), got str"):
        LocalSearch(model, LocalContextBuilder(dulce_store), config="top_k_entities=3")
    with pytest.raises(ConfigError, match=r"^model: expected an object with an async complete\(\) method, got str; to name a model, build it"):
        LocalSearch("gpt-4o", LocalContextBuilder(dulce_store))
    with pytest.raises(ConfigError, match=r"^store: expected an open store \(`await open_store\("):
        await build_local_context(dulce_db_uri, "Who runs it?", query_vector=query_vector)


def test_a_missing_model_or_store_or_a_store_given_as_the_builder_is_refused_at_once(dulce_store):
    # Each was accepted, then the first search failed with an AttributeError: "'NoneType' object has
    # no attribute 'complete'", "... no attribute 'manifest'", "'StoreConfig' object has no attribute 'prompt'".
    model = ScriptedChatModel([ANSWER])
    with pytest.raises(ConfigError, match=r"^model: a chat model is required, got None"):
        LocalSearch(None, LocalContextBuilder(dulce_store))
    with pytest.raises(ConfigError, match=r"^store: expected an open store \(`await open_store\(uri\)`\), got NoneType$"):
        LocalContextBuilder(None)
    with pytest.raises(ConfigError, match=r"^builder: expected a LocalContextBuilder \(`LocalContextBuilder\(store\)`\), got LanceStore$"):
        LocalSearch(model, dulce_store)
    assert model.calls == []


@pytest.mark.parametrize(("value", "message"), [(5, "Input should be a valid string, got 5"),
                                               ("", "String should have at least 1 character, got ''")])
async def test_a_response_type_argument_is_checked_as_the_setting(dulce_store, query_vector, value, message):
    # response_type=5 went into the prompt as "5", and "" silently meant the configured format.
    model = ScriptedChatModel([ANSWER])
    search = LocalSearch(model, LocalContextBuilder(dulce_store))
    expected = f"local search settings: response_type: {message}"
    with pytest.raises(ConfigError) as caught:
        await search.search("q", query_vector=query_vector, response_type=value)
    assert str(caught.value) == expected
    with pytest.raises(ConfigError) as caught:
        search.stream_search("q", query_vector=query_vector, response_type=value)
    assert str(caught.value) == expected
    assert model.calls == []
    stream = search.stream_search("q", query_vector=query_vector, response_type="one line")
    assert "".join([delta async for delta in stream]) == ANSWER
    assert "one line" in model.calls[0].messages[0].content


async def test_answer_timeout_raises_model_error(dulce_store, query_vector):
    model = ScriptedChatModel([ANSWER], delay=30)
    config = LocalSearchConfig(llm_timeout=0.05)
    search = LocalSearch(model, LocalContextBuilder(dulce_store, config=config))
    with pytest.raises(ModelError, match="llm_timeout"):
        await search.search("q", query_vector=query_vector)
    with pytest.raises(ModelError, match="llm_timeout"):
        async for _ in search.stream_search("q", query_vector=query_vector):
            pass
    assert model.in_flight == 0  # the timed-out calls were cancelled


async def test_per_call_answer_settings_are_honoured(dulce_store, query_vector, tmp_path):
    """search(..., llm_timeout=..., prompt=...) was validated and then ignored: the answer used the
    search's own timeout and prompt."""
    slow = ScriptedChatModel([ANSWER, ANSWER], delay=30)
    search = LocalSearch(slow, LocalContextBuilder(dulce_store))
    with pytest.raises(ModelError, match="llm_timeout"):
        await search.search("q", query_vector=query_vector, llm_timeout=0.05)
    with pytest.raises(ModelError, match="llm_timeout"):
        await search.stream_search("q", query_vector=query_vector, llm_timeout=0.05).text()
    assert slow.in_flight == 0

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Mine. {response_type}\n{context_data}")
    model = ScriptedChatModel([ANSWER, ANSWER])
    search = LocalSearch(model, LocalContextBuilder(dulce_store))
    await search.search("q", query_vector=query_vector, prompt=str(prompt))
    await search.stream_search("q", query_vector=query_vector, prompt=str(prompt)).text()
    assert [call.messages[0].content.startswith("Mine. multiple paragraphs\n-----") for call in model.calls] == [True, True]


@pytest.mark.parametrize("streamed", [False, True], ids=["search", "stream_search"])
async def test_the_result_reports_the_call_and_tokens_the_model_reported_and_none_for_a_cache_hit(
        dulce_store, query_vector, tmp_path, streamed):
    """The answer call as the model reported it (`response`; building the context calls no model);
    the same question again, answered from the response cache, costs no call and reports no tokens."""
    from drift_lance.models.cache import CachedChatModel

    model = ScriptedChatModel(default=ANSWER)
    search = LocalSearch(CachedChatModel(model, tmp_path), LocalContextBuilder(dulce_store))
    results = []
    for _ in range(2):
        if streamed:
            stream = search.stream_search("Who runs it?", query_vector=query_vector)
            assert await stream.text() == ANSWER
            results.append(stream.result)
        else:
            results.append(await search.search("Who runs it?", query_vector=query_vector))
    (call,) = model.calls
    first, repeated = results
    assert (first.llm_calls_categories, first.prompt_tokens_categories, first.output_tokens_categories) == (
        {"build_context": 0, "response": 1}, {"build_context": 0, "response": call.usage.prompt_tokens},
        {"build_context": 0, "response": call.usage.output_tokens})
    assert (first.llm_calls, first.prompt_tokens, first.output_tokens) == (1, call.usage.prompt_tokens, call.usage.output_tokens)
    assert repeated.response == ANSWER
    assert (repeated.llm_calls, repeated.prompt_tokens, repeated.output_tokens) == (0, 0, 0)
    assert repeated.llm_calls_categories == repeated.prompt_tokens_categories == {"build_context": 0, "response": 0}


@pytest.mark.parametrize("streamed", [False, True], ids=["search", "stream_search"])
@pytest.mark.parametrize("answer", ["", " \n\t "], ids=["empty", "whitespace"])
async def test_an_empty_answer_fails_the_search(dulce_store, query_vector, answer, streamed):
    """An answer of nothing or only whitespace was returned as the response (a blank CLI answer, exit
    status 0; HTTP 200), where a DRIFT reduce answer so empty fails: it fails here too."""
    from drift_lance.models import EmptyAnswerError

    search = LocalSearch(ScriptedChatModel([answer]), LocalContextBuilder(dulce_store))
    with pytest.raises(EmptyAnswerError) as info:
        if streamed:
            async with search.stream_search("Who runs it?", query_vector=query_vector) as stream:
                async for _ in stream:
                    pass
        else:
            await search.search("Who runs it?", query_vector=query_vector)
    assert isinstance(info.value, ModelError)
    said = "nothing" if not answer else "only whitespace"
    assert str(info.value) == f"local search answer: chat model 'scripted' returned an empty answer ({said})"
    assert info.value.usage.calls == 1 and info.value.usage.prompt_tokens > 0  # what the call cost
    assert not streamed or stream.result is None


@pytest.mark.parametrize("llm_timeout", [None, 60.0])
async def test_the_models_own_timeout_is_reported_as_the_models(dulce_store, query_vector, llm_timeout):
    model = ScriptedChatModel([TimeoutError("read timed out"), TimeoutError("read timed out")])
    search = LocalSearch(model, LocalContextBuilder(dulce_store, config=LocalSearchConfig(llm_timeout=llm_timeout)))
    with pytest.raises(ModelError, match="^the chat model timed out: read timed out$"):
        await search.search("q", query_vector=query_vector)
    with pytest.raises(ModelError, match="^the chat model timed out: read timed out$"):
        await search.stream_search("q", query_vector=query_vector).text()


async def test_conversation_history_opens_the_context(dulce_store, query_vector):
    model = ScriptedChatModel([ANSWER])
    search = LocalSearch(model, LocalContextBuilder(dulce_store))
    history = [
        {"role": "user", "content": "Who is Alex Mercer?"},
        {"role": "assistant", "content": "An agent."},
    ]
    result = await search.search("And his team?", query_vector=query_vector, conversation_history=history)
    assert result.context_text.startswith("-----Conversation History-----\nturn|content\nuser|Who is Alex Mercer?\n\n")
    with pytest.raises(ConfigError, match=r"conversation_history\[0\]\.role"):
        await search.search("q", query_vector=query_vector, conversation_history=[{"role": "bot", "content": "x"}])


async def test_history_turn_content_must_be_text(dulce_store, query_vector):
    """A turn's content went through str(): None became "None" and OpenAI content parts their
    Python repr, in the prompt and in the text mapped to entities."""
    builder = LocalContextBuilder(dulce_store)
    history = [{"role": "user", "content": "Who is Alex Mercer?"}, {"role": "assistant", "content": None}]
    context = await builder.build("q", query_vector=query_vector, conversation_history=history,
                                  conversation_history_user_turns_only=False)
    assert context.context_text.startswith("-----Conversation History-----\nturn|content\nuser|Who is Alex Mercer?\nassistant|\n\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Who is Alex Mercer?"}]}]
    with pytest.raises(ConfigError, match=r"^conversation_history\[0\]\.content: expected text, got list$"):
        await builder.build("q", query_vector=query_vector, conversation_history=parts)


async def test_embedder_must_match_the_index_vectors(dulce_store):
    search = LocalSearch(ScriptedChatModel([ANSWER]), LocalContextBuilder(dulce_store), embedder=HashEmbedder(64))
    with pytest.raises(EmbeddingMismatchError, match="3072"):
        await search.search("Who runs Operation: Dulce?")


async def test_embedder_of_unknown_dimension_is_checked_on_its_first_vector(dulce_store):
    search = LocalSearch(ScriptedChatModel([ANSWER]), LocalContextBuilder(dulce_store), embedder=HashEmbedder(3072, dimension_known=False))
    assert (await search.search("Who runs Operation: Dulce?")).response == ANSWER
    search = LocalSearch(ScriptedChatModel([ANSWER]), LocalContextBuilder(dulce_store), embedder=HashEmbedder(64, dimension_known=False))
    with pytest.raises(EmbeddingMismatchError, match="embedder 'hash-embedder' made a vector that has dimension 64 .*3072"):
        await search.search("Who runs Operation: Dulce?")


async def test_query_is_embedded_as_a_query_when_no_vector_is_given(dulce_store):
    embedder = HashEmbedder(3072)
    model = ScriptedChatModel([ANSWER])
    search = LocalSearch(model, LocalContextBuilder(dulce_store), embedder=embedder)
    result = await search.search("Who runs Operation: Dulce?")
    expected = await LocalContextBuilder(dulce_store).build(
        "", query_vector=(await embedder.embed(["Who runs Operation: Dulce?"], kind="query"))[0]
    )
    assert result.context_text == expected.context_text


def test_prompt_placeholders_are_checked(tmp_path):
    bundled = load_local_prompt()
    assert "{context_data}" in bundled and "{response_type}" in bundled
    bad = tmp_path / "prompt.txt"
    bad.write_text("Tables: {context_data} for {user}")
    with pytest.raises(ConfigError, match=r"prompt\.txt.*user"):
        load_local_prompt(bad)
    missing = tmp_path / "none.txt"
    missing.write_text("no tables")
    with pytest.raises(ConfigError, match="context_data"):
        load_local_prompt(missing)


async def test_a_model_with_a_small_fixed_window_gets_a_context_that_fits_it(dulce_store, query_vector):
    """The embedded llama.cpp model has an 8192-token window; the default 12000-token context
    overflowed it ("Requested tokens exceed context window"). Remote models declare no window."""
    from drift_lance.models import get_tokenizer

    roomy = await LocalSearch(ScriptedChatModel([ANSWER]), LocalContextBuilder(dulce_store)).search("q", query_vector=query_vector)
    small = ScriptedChatModel([ANSWER])
    small.n_ctx = 4096  # what LocalChatModel exposes
    fitted = await LocalSearch(small, LocalContextBuilder(dulce_store)).search("q", query_vector=query_vector)
    count = get_tokenizer("o200k_base").count
    assert count(roomy.context_text) > 2048 >= count(fitted.context_text) > 0  # (4096 - 1024 - 512) * 0.8

