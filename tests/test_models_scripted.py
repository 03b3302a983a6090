"""The test doubles other suites rely on: ScriptedChatModel and the deterministic embedders."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from pydantic import BaseModel

from drift_lance.models import ChatModel, ChatParams, Embedder, Message, ModelError, StructuredOutputError
from drift_lance.testing import HashEmbedder, ScriptedChatModel, ScriptedEmbedder, split_deltas


class Score(BaseModel):
    score: int


def test_doubles_satisfy_the_protocols():
    assert isinstance(ScriptedChatModel(), ChatModel)
    assert isinstance(HashEmbedder(), Embedder) and isinstance(ScriptedEmbedder(), Embedder)


async def test_queue_answers_in_order_records_calls_and_raises_scripted_errors():
    model = ScriptedChatModel(["one", {"score": 2}, Score(score=3), TimeoutError("slow")])
    assert (await model.complete([Message("user", "a")])).text == "one"
    assert (await model.complete([Message("user", "b")], response_model=Score)).parsed == Score(score=2)
    assert (await model.complete([Message("user", "c")], response_model=Score)).parsed == Score(score=3)
    with pytest.raises(TimeoutError):
        await model.complete([Message("user", "d")], params=ChatParams(temperature=0))
    with pytest.raises(ModelError, match="call #5"):
        await model.complete([Message("user", "e")])
    assert [c.prompt for c in model.calls] == ["a", "b", "c", "d", "e"]
    assert model.calls[3].params.temperature == 0 and model.calls[1].response_model is Score
    assert model.calls[0].text == "one" and model.calls[3].text is None


async def test_function_responder_may_be_async_and_sees_the_call():
    async def answer(messages, params, response_model):
        await asyncio.sleep(0)
        return {"score": len(messages[-1].content)}

    model = ScriptedChatModel(answer)
    result = await model.complete([Message("user", "four")], response_model=Score)
    assert result.parsed == Score(score=4)
    assert result.usage.calls == 1 and result.usage.counted and result.usage.prompt_tokens == 1


async def test_structured_output_goes_through_repair_and_validation():
    model = ScriptedChatModel(["```json\n{'score': 5,}\n```", '{"score": "high"}'])
    assert (await model.complete([Message("user", "x")], response_model=Score)).parsed == Score(score=5)
    with pytest.raises(StructuredOutputError, match="score"):
        await model.complete([Message("user", "x")], response_model=Score)


async def test_tracks_max_in_flight_with_delay():
    model = ScriptedChatModel(default="ok", delay=0.01)
    await asyncio.gather(*(model.complete([Message("user", str(i))]) for i in range(8)))
    assert model.max_in_flight == 8 and model.in_flight == 0
    assert all(c.finished_at >= c.started_at for c in model.calls)


async def test_stream_splits_text_and_reports_usage_when_done():
    model = ScriptedChatModel(["Hello  big\nworld "])
    stream = model.stream([Message("user", "hi")])
    deltas = [d async for d in stream]
    assert "".join(deltas) == "Hello  big\nworld " and len(deltas) == 3
    assert stream.usage.output_tokens > 0 and model.calls[0].kind == "stream"
    assert split_deltas("") == []


async def test_hash_embedder_is_deterministic_normalised_and_word_sensitive():
    embedder = HashEmbedder(32)
    m = await embedder.embed(["red apple pie", "red apple pie", "quantum physics", ""], kind="query")
    assert m.shape == (4, 32) and m.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(m, axis=1), 1.0, rtol=1e-6)
    assert m[0] @ m[1] == pytest.approx(1.0)
    assert m[0] @ (await embedder.embed(["red apple"]))[0] > m[0] @ m[2]
    assert embedder.calls[0].kind == "query"


async def test_scripted_embedder_uses_fixed_vectors_and_checks_shapes():
    embedder = ScriptedEmbedder({"north": [1, 0, 0], "south": [-2, 0, 0]})
    m = await embedder.embed(["north", "south", "other"])
    np.testing.assert_allclose(m[:2], [[1, 0, 0], [-1, 0, 0]])
    assert embedder.dimension == 3
    with pytest.raises(ValueError, match="different dimensions"):
        ScriptedEmbedder({"a": [1, 0], "b": [1, 0, 0]})
