"""OpenAI-compatible backend, tested through real HTTP on 127.0.0.1 with the real openai client."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from pydantic import BaseModel, Field

from drift_lance.config.models import ModelSettings
from drift_lance.models import Message, ModelError, StructuredOutputError, get_chat_model, get_embedder, get_tokenizer
from drift_lance.models.openai_backend import ModelRequestError, OpenAIChatModel
from drift_lance.testing.openai_server import FakeOpenAIServer, Reply

USER = [Message("user", "What is DRIFT search?")]


class Primer(BaseModel):
    """The DRIFT primer's answer schema (graphrag's primer prompt)."""

    intermediate_answer: str
    score: int = Field(ge=0, le=100)
    follow_up_queries: list[str]


PRIMER = {"intermediate_answer": "A hybrid search.", "score": 80, "follow_up_queries": ["What is a community?"]}


def _chat(settings: ModelSettings, **overrides) -> OpenAIChatModel:
    model = get_chat_model(settings.model_copy(update=overrides))
    assert isinstance(model, OpenAIChatModel)
    return model


async def _eventually(predicate, seconds: float = 5.0) -> None:
    """Wait for a condition the server observes asynchronously (a disconnect)."""
    for _ in range(int(seconds / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    assert predicate()


# ---------------------------------------------------------------- retries


async def test_retries_429_honouring_retry_after(openai_server, openai_settings):
    openai_server.queue_chat(Reply.rate_limited(retry_after=0.3), Reply(text="after the wait"))
    chat = _chat(openai_settings, retry_max_wait=5.0)

    result = await chat.complete(USER)

    assert result.text == "after the wait"
    first, second = openai_server.chat_requests
    assert [first.status, second.status] == [429, 200]
    # backoff alone would be <= 0.05 s here (retry_base_wait=0.01); only Retry-After explains 0.3 s
    assert second.started_at - first.started_at >= 0.3


async def test_a_retry_whose_wait_would_outlast_llm_timeout_fails_at_once_naming_the_cause(openai_server, openai_settings):
    """A 429 asking for 30 s under a 2 s `llm_timeout`: the call idled until the timeout and failed
    as 'timed out (llm_timeout)', hiding the rate limit. It now fails at once with the server's answer;
    a wait that fits the timeout is still made."""
    from drift_lance.models.deadline import within

    openai_server.queue_chat(Reply.rate_limited(retry_after=30))
    chat = _chat(openai_settings, retry_max_wait=60.0)
    with pytest.raises(ModelRequestError) as info:
        await within(chat.complete(USER), 2.0, "LLM call")
    assert info.value.status == 429 and "Rate limit reached" in str(info.value)
    assert "not retried: waiting 30" in str(info.value) and "outlast llm_timeout" in str(info.value)
    assert len(openai_server.chat_requests) == 1

    openai_server.queue_chat(Reply.rate_limited(retry_after=0.2), Reply(text="after the wait"))
    assert (await within(chat.complete(USER), 2.0, "LLM call")).text == "after the wait"
    assert [r.status for r in openai_server.chat_requests] == [429, 429, 200]


async def test_retry_after_ms_header_is_honoured(openai_server, openai_settings):
    openai_server.queue_chat(Reply.rate_limited(retry_after=0.25, header="retry-after-ms"), Reply(text="ok"))
    result = await _chat(openai_settings, retry_max_wait=5.0).complete(USER)
    first, second = openai_server.chat_requests
    assert result.text == "ok" and second.started_at - first.started_at >= 0.25


async def test_retries_5xx_then_succeeds(openai_server, openai_settings):
    openai_server.queue_chat(Reply.server_error(500), Reply.server_error(503), Reply(text="third time lucky"))
    result = await _chat(openai_settings).complete(USER)
    assert result.text == "third time lucky"
    assert [r.status for r in openai_server.chat_requests] == [500, 503, 200]
    assert result.usage.calls == 1 and not result.usage.counted


async def test_gives_up_after_configured_attempts_with_clear_error(openai_server, openai_settings):
    openai_server.queue_chat(*[Reply.server_error(500, "model overloaded")] * 5)
    with pytest.raises(ModelRequestError) as info:
        await _chat(openai_settings, max_retries=2).complete(USER)
    message = str(info.value)
    assert "after 3 attempts" in message and "HTTP 500" in message and "model overloaded" in message
    assert "test-chat" in message and openai_server.base_url in message
    assert info.value.attempts == 3 and info.value.status == 500 and info.value.failure == "status"
    assert len(openai_server.chat_requests) == 3


async def test_client_errors_are_not_retried(openai_server, openai_settings):
    openai_server.queue_chat(Reply(status=401, body={"error": {"message": "bad key"}}))
    with pytest.raises(ModelError, match="HTTP 401: bad key"):
        await _chat(openai_settings).complete(USER)
    assert len(openai_server.chat_requests) == 1


async def test_timeout_retries_then_fails_and_disconnects(openai_server, openai_settings):
    openai_server.queue_chat(Reply.hanging(), Reply.hanging())
    chat = _chat(openai_settings, request_timeout=0.3, max_retries=1)
    with pytest.raises(ModelRequestError, match="timed out after 0.3s") as info:
        await chat.complete(USER)
    assert info.value.attempts == 2 and info.value.failure == "timeout" and info.value.status is None
    # the client gave up on both requests: the server saw both connections go away
    await _eventually(lambda: openai_server.disconnects == 2)


@pytest.mark.parametrize("server", ["refusing", "closing"])
async def test_a_refused_or_dropped_connection_is_reported_as_such_not_as_a_timeout(openai_settings, server):
    """The SDK's aiohttp transport turns both into a connect timeout; the error must say what happened
    (and an embedding request split into batches fails with that error, not an ExceptionGroup)."""
    async def close_at_once(reader, writer):
        writer.close()

    listener = await asyncio.start_server(close_at_once, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    if server == "refusing":
        listener.close()
        await listener.wait_closed()
    settings = openai_settings.model_copy(update={"base_url": f"http://127.0.0.1:{port}/v1", "max_retries": 0})
    try:
        with pytest.raises(ModelRequestError, match="connection failed: ") as info:
            await _chat(settings).complete(USER)
        assert "timed out" not in str(info.value) and info.value.failure == "connection"
        embedder = get_embedder(settings.model_copy(update={"embedding_batch_size": 1}))
        with pytest.raises(ModelRequestError, match="connection failed: "):
            await embedder.embed(["a", "b", "c"])
    finally:
        listener.close()


async def test_a_refused_connection_gets_connect_retries_not_max_retries(openai_server, openai_settings):
    """Nothing listening: the call fails after connect_retries, not after max_retries backoffs;
    a server that answers with errors still gets every retry of max_retries."""
    listener = await asyncio.start_server(lambda reader, writer: writer.close(), "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    listener.close()
    await listener.wait_closed()
    refused = openai_settings.model_copy(update={"base_url": f"http://127.0.0.1:{port}/v1", "max_retries": 10, "connect_retries": 2})
    with pytest.raises(ModelRequestError, match="after 3 attempts: connection failed") as info:
        await _chat(refused).complete(USER)
    assert info.value.attempts == 3 and info.value.failure == "connection"

    openai_server.queue_chat(*[Reply.server_error(503)] * 4, Reply(text="back"))
    answering = openai_settings.model_copy(update={"max_retries": 4, "connect_retries": 0})
    assert (await _chat(answering).complete(USER)).text == "back"
    assert len(openai_server.chat_requests) == 5


async def test_a_host_name_that_does_not_resolve_is_a_connection_failure_not_a_timeout(openai_settings, monkeypatch):
    """aiohttp reports a failed name lookup as a connect timeout: it must read as a connection failure
    and get connect_retries, not 11 attempts of "timed out after 180s" (the lookup is faked: no network)."""
    import socket

    real = socket.getaddrinfo

    def lookup(host, *args, **kwargs):
        if host == "no-such-host.test":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    settings = openai_settings.model_copy(update={"base_url": "http://no-such-host.test/v1", "max_retries": 10, "connect_retries": 2})
    with pytest.raises(ModelRequestError, match="after 3 attempts: connection failed: .*Name or service not known") as info:
        await _chat(settings).complete(USER)
    assert info.value.failure == "connection" and "timed out" not in str(info.value)


async def test_a_server_that_wants_max_completion_tokens_gets_the_cap_under_that_name(openai_server, openai_settings):
    """OpenAI's reasoning models reject max_tokens; other servers read only max_tokens. The cap goes
    out as max_tokens until a server says otherwise, then under the name it asked for (remembered)."""
    from drift_lance.models.base import ChatParams

    def like_a_reasoning_model(request):
        if "max_tokens" in request.body:
            return Reply.bad_request("Unsupported parameter: 'max_tokens' is not supported with this model. "
                                     "Use 'max_completion_tokens' instead.")
        return Reply(text=f"capped at {request.body.get('max_completion_tokens')}")

    openai_server.on_chat = like_a_reasoning_model
    chat = _chat(openai_settings.model_copy(update={"chat_model": "reasoning-model"}), max_retries=0)
    assert (await chat.complete(USER, params=ChatParams(max_tokens=50))).text == "capped at 50"
    deltas = [d async for d in chat.stream(USER, params=ChatParams(max_tokens=60))]
    assert "".join(deltas) == "capped at 60"
    sent = [r.body for r in openai_server.chat_requests]
    assert [("max_tokens" in b, b.get("max_completion_tokens")) for b in sent] == [(True, None), (False, 50), (False, 60)]
    # what was learnt is per model: another model on the same server starts with max_tokens again
    assert (await _chat(openai_settings, max_retries=0).complete(USER, params=ChatParams(max_tokens=5))).text == "capped at 5"
    assert ["max_tokens" in r.body for r in openai_server.chat_requests[3:]] == [True, False]


def _like_openai_reasoning_model(request) -> Reply | None:
    """OpenAI's o-series / gpt-5 refusals (same wording on Azure), one parameter at a time."""
    body = request.body
    if "max_tokens" in body:
        return Reply.bad_request("Unsupported parameter: 'max_tokens' is not supported with this model. "
                                 "Use 'max_completion_tokens' instead.")
    if body.get("temperature", 1) != 1:
        return Reply.bad_request(f"Unsupported value: 'temperature' does not support {body['temperature']} with "
                                 "this model. Only the default (1) value is supported.")
    if "top_p" in body:
        return Reply.bad_request("Unsupported parameter: 'top_p' is not supported with this model.")
    return None


async def test_a_reasoning_model_that_refuses_temperature_and_top_p_gets_calls_without_them(openai_server, openai_settings):
    """DRIFT sends temperature 0 and top_p 1; OpenAI's reasoning models answer 400 to both. The call
    goes again without the refused parameter (the model's default applies), remembered per model, and
    neither a structured call's format nor a stream's usage request is given up over it."""
    from drift_lance.models.base import ChatParams

    openai_server.on_chat = lambda request: _like_openai_reasoning_model(request) or Reply(json=PRIMER)
    chat = _chat(openai_settings.model_copy(update={"chat_model": "o3-mini"}), max_retries=0)
    params = ChatParams(temperature=0.0, top_p=1.0, max_tokens=50, seed=7)
    assert (await chat.complete(USER, params=params, response_model=Primer)).parsed == Primer(**PRIMER)
    first = openai_server.chat_requests[-1]
    assert first.response_format["type"] == "json_schema"
    assert {k: first.body.get(k) for k in ("temperature", "top_p", "max_completion_tokens", "seed")} == {
        "temperature": None, "top_p": None, "max_completion_tokens": 50, "seed": 7}

    sent_before = len(openai_server.chat_requests)
    deltas = [d async for d in chat.stream(USER, params=ChatParams(temperature=0.0, top_p=1.0))]
    assert "".join(deltas) == json.dumps(PRIMER)
    [streamed] = openai_server.chat_requests[sent_before:]  # what was learnt is not asked again
    assert "temperature" not in streamed.body and "top_p" not in streamed.body
    assert streamed.body["stream_options"] == {"include_usage": True}


async def test_call_parameters_go_in_one_order_whatever_the_hash_seed(openai_server, openai_settings):
    """temperature, top_p, max_tokens, n and seed came from a set: their order in the request body
    changed from process to process with PYTHONHASHSEED. Now ChatParams' field order, on the wire too."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from drift_lance.models.base import ChatParams

    openai_server.queue_chat(Reply(text="ok"))
    await _chat(openai_settings).complete(USER, params=ChatParams(seed=7, n=1, max_tokens=5, top_p=0.9, temperature=0.1))
    assert list(openai_server.chat_requests[-1].body)[:7] == ["model", "messages", "temperature", "top_p", "max_tokens", "n", "seed"]
    script = ("from drift_lance.models.base import ChatParams; from drift_lance.models.openai_backend import _params_kwargs; "
              "print(*_params_kwargs(ChatParams(0.1, 0.9, 5, 1, 7)))")
    orders = {subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONHASHSEED": seed}, check=True,
                             cwd=Path(__file__).resolve().parents[1],
                             capture_output=True, text=True).stdout.strip() for seed in ("0", "1")}
    assert orders == {"temperature top_p max_tokens n seed"}


async def test_a_refused_parameter_is_not_dropped_for_other_models_or_without_a_refusal(openai_server, openai_settings):
    from drift_lance.models.base import ChatParams

    openai_server.queue_chat(Reply.bad_request("Unsupported value: 'temperature' does not support 0.0 with this model."),
                             Reply(text="without"), Reply(text="other model"))
    assert (await _chat(openai_settings, chat_model="o1", max_retries=0).complete(USER, params=ChatParams(temperature=0.0))).text == "without"
    other = _chat(openai_settings, max_retries=0)
    assert (await other.complete(USER, params=ChatParams(temperature=0.0))).text == "other model"
    assert [r.body.get("temperature") for r in openai_server.chat_requests] == [0.0, None, 0.0]
    # a 400 about something else is the caller's error, not a reason to drop parameters
    openai_server.queue_chat(Reply.bad_request("messages: too long"))
    with pytest.raises(ModelRequestError, match="too long"):
        await other.complete(USER, params=ChatParams(temperature=0.0))
    assert openai_server.chat_requests[-1].body["temperature"] == 0.0


async def test_a_404_from_a_base_url_without_v1_says_so_and_quotes_the_server(openai_server, openai_settings):
    """OPENAI_BASE_URL=http://localhost:11434 (no /v1): Ollama answers "404 page not found" as plain
    text, vLLM {"detail": "Not Found"}; the error said only "HTTP 404: Error code: 404"."""
    root = openai_server.base_url.removesuffix("/v1")
    openai_server.queue_chat(Reply(status=404, body="404 page not found"), Reply(status=404, body={"detail": "Not Found"}))
    chat = _chat(openai_settings, base_url=root, max_retries=0)
    for said in ("404 page not found", "Not Found"):
        with pytest.raises(ModelRequestError) as info:
            await chat.complete(USER)
        assert f"HTTP 404: {said}; is /v1 missing from the base URL" in str(info.value)
        assert f"try {root}/v1" in str(info.value)
    # with /v1 in the URL a 404 is something else (an unknown model): no such hint
    openai_server.queue_chat(Reply(status=404, body={"error": {"message": 'model "llama3.1:8b" not found'}}))
    with pytest.raises(ModelRequestError, match='HTTP 404: model "llama3.1:8b" not found$'):
        await _chat(openai_settings, max_retries=0).complete(USER)


async def test_a_proxy_html_error_page_is_reported_by_its_title(openai_server, openai_settings):
    page = "<html><head><title>502 Bad Gateway</title></head><body><h1>502 Bad Gateway</h1><hr>nginx</body></html>"
    openai_server.queue_chat(Reply(status=502, body=page))
    with pytest.raises(ModelRequestError, match=r"HTTP 502: 502 Bad Gateway$"):
        await _chat(openai_settings, max_retries=0).complete(USER)


async def test_an_answer_with_no_text_says_why_instead_of_passing_for_a_blank_answer(openai_server, openai_settings):
    """Azure's content filter (finish_reason content_filter, content null), an output cap a reasoning
    model spent on reasoning (finish_reason length, content ""), and a refusal (message.refusal) made a
    blank DRIFT answer with exit status 0."""
    from drift_lance.models import EmptyAnswerError

    refusal = {"choices": [{"index": 0, "finish_reason": "stop",
                            "message": {"role": "assistant", "content": None, "refusal": "I can't help with that."}}],
               "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}}
    openai_server.queue_chat(Reply(text="", finish_reason="content_filter"), Reply(body=refusal),
                             Reply(text="", finish_reason="length"), Reply(text="", finish_reason="content_filter"),
                             Reply(text="", finish_reason="stop"))
    chat = _chat(openai_settings, max_retries=0)
    with pytest.raises(EmptyAnswerError, match="returned no text: the provider's content filter blocked the answer"):
        await chat.complete(USER)
    with pytest.raises(EmptyAnswerError, match="the model refused: I can't help with that.") as info:
        await chat.complete(USER)
    assert info.value.usage.output_tokens == 4  # what the call cost is still known
    with pytest.raises(StructuredOutputError, match="output cap ran out before any answer text"):
        await chat.complete(USER, response_model=Primer)
    stream = chat.stream(USER)
    with pytest.raises(EmptyAnswerError, match="content filter"):
        _ = [d async for d in stream]
    assert (await chat.complete(USER)).text == ""  # empty, and the server gave no reason: as it came


async def test_a_web_page_instead_of_the_api_is_reported_at_once(openai_server, openai_settings):
    """A base URL pointing at a web UI or a login portal answers 200 with HTML: that was retried as
    a garbled body (11 attempts with backoff by default) and reported as "Expecting value: line 1"."""
    page = "<!doctype html><html><head><title>Open WebUI</title></head><body></body></html>"
    openai_server.queue_chat(Reply(body=page))
    openai_server.queue_embeddings(Reply(body=page))
    with pytest.raises(ModelRequestError, match=r"failed: the endpoint answered with a web page \('Open WebUI'\), not the "
                       r"API's JSON: is http://127.0.0.1:\d+/v1 the OpenAI-compatible API's base URL") as info:
        await _chat(openai_settings, max_retries=3).complete(USER)
    assert info.value.attempts == 1 and info.value.failure == "malformed"
    with pytest.raises(ModelError, match="web page"):
        await get_embedder(openai_settings).embed(["x"])
    assert len(openai_server.requests) == 2


async def test_malformed_http_body_is_a_model_error(openai_server, openai_settings):
    openai_server.queue_chat(*[Reply(body="{not json")] * 3)
    with pytest.raises(ModelRequestError, match="malformed response body") as info:
        await _chat(openai_settings).complete(USER)
    assert info.value.attempts == 3 and info.value.failure == "malformed"


@pytest.mark.parametrize("http_client", ["aiohttp", "httpx"])
async def test_a_response_the_http_parser_refuses_is_a_model_error(openai_server, openai_settings, http_client):
    """A malformed header line (a broken proxy): aiohttp's parser error came through the SDK
    unwrapped, so a search failed as an internal error (the service's 500 with a traceback) instead
    of the model's; httpx's transport already reported it as a failed request."""
    openai_server.queue_chat(*[Reply(body="{}", headers={"Bad Header": "x"})] * 4)
    chat = _chat(openai_settings, http_client=http_client, max_retries=1)
    with pytest.raises(ModelRequestError, match="Bad Header") as info:
        await chat.complete(USER)
    assert info.value.attempts == 2 and info.value.status is None
    with pytest.raises(ModelRequestError, match="Bad Header"):
        _ = [delta async for delta in chat.stream(USER)]


async def test_a_streamed_chunk_that_is_not_json_is_a_model_error(openai_server, openai_settings):
    """It raised the JSON decoder's own error: a streamed DRIFT reduce failed as the service's 500."""
    openai_server.queue_chat(Reply(body="data: {not json\n\n"))
    with pytest.raises(ModelRequestError, match="stream failed: malformed response body") as info:
        _ = [delta async for delta in _chat(openai_settings).stream(USER)]
    assert info.value.failure == "malformed"


async def test_a_json_body_that_is_not_an_object_is_a_model_error(openai_server, openai_settings):
    openai_server.queue_chat(Reply(body="[1, 2, 3]"))
    with pytest.raises(ModelRequestError, match="malformed response body: expected a JSON object") as info:
        await _chat(openai_settings, max_retries=0).complete(USER)
    assert info.value.failure == "malformed"


async def test_http_transport_is_aiohttp_unless_a_proxy_is_configured(openai_server, openai_settings, monkeypatch):
    """aiohttp costs about half of httpx's CPU per request, but only httpx honours HTTP(S)_PROXY."""
    from openai._vendor.httpx_aiohttp import Httpx2AiohttpClient

    from drift_lance.models.base import aclose_models

    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    default = _chat(openai_settings)
    forced = _chat(openai_settings, http_client="httpx")
    openai_server.queue_chat(Reply(text="over aiohttp"), Reply(text="over httpx"))
    assert (await default.complete(USER)).text == "over aiohttp"
    assert (await forced.complete(USER)).text == "over httpx"
    assert isinstance(default._endpoint.client()._client, Httpx2AiohttpClient)
    assert not isinstance(forced._endpoint.client()._client, Httpx2AiohttpClient)

    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    proxied = _chat(openai_settings)
    assert not isinstance(proxied._endpoint.client()._client, Httpx2AiohttpClient)

    await aclose_models(default, forced, proxied)
    assert not default._endpoint._clients and not forced._endpoint._clients  # sessions closed, not leaked


# ---------------------------------------------------------------- streaming


async def test_streaming_yields_deltas_and_server_usage(openai_server, openai_settings):
    text = "DRIFT combines global and local search, step by step."
    openai_server.queue_chat(Reply(text=text))
    stream = _chat(openai_settings).stream(USER)
    deltas = [d async for d in stream]
    assert len(deltas) > 3 and "".join(deltas) == text
    request = openai_server.chat_requests[0]
    assert request.stream and request.body["stream_options"] == {"include_usage": True}
    assert stream.usage.output_tokens == len(text.split()) and not stream.usage.counted


async def test_streaming_without_stream_options_support_counts_tokens(openai_server, openai_settings):
    openai_server.reject_stream_options = True
    openai_server.queue_chat(Reply(text="counted locally"), Reply(text="again"))
    chat = _chat(openai_settings)
    stream = chat.stream(USER)
    assert "".join([d async for d in stream]) == "counted locally"
    assert stream.usage.counted and stream.usage.output_tokens == get_tokenizer().count("counted locally")
    # remembered: the next stream does not send stream_options at all
    second = chat.stream(USER)
    assert "".join([d async for d in second]) == "again"
    assert "stream_options" not in openai_server.chat_requests[-1].body


async def test_closing_a_stream_early_disconnects(openai_server, openai_settings):
    openai_server.queue_chat(Reply(text="word " * 200, chunk_delay=0.01))
    chat = _chat(openai_settings, max_concurrency=1)
    stream = chat.stream(USER)
    iterator = aiter(stream)
    assert await anext(iterator)
    await stream.aclose()
    await _eventually(lambda: openai_server.disconnects == 1)
    assert chat.limiter.in_use == 0  # the slot came back
    openai_server.queue_chat(Reply(text="next"))
    assert (await chat.complete(USER)).text == "next"


# ---------------------------------------------------------------- structured output


async def test_json_schema_strict_when_server_accepts_it(openai_server, openai_settings):
    openai_server.queue_chat(Reply(json=PRIMER))
    result = await _chat(openai_settings).complete(USER, response_model=Primer)
    assert result.parsed == Primer(**PRIMER)
    fmt = openai_server.chat_requests[0].response_format
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    schema = fmt["json_schema"]["schema"]
    assert schema["additionalProperties"] is False
    assert set(schema["required"]) == {"intermediate_answer", "score", "follow_up_queries"}


async def test_falls_back_to_json_object_with_schema_and_remembers(openai_server, openai_settings):
    openai_server.reject_response_formats = {"json_schema"}  # like llama.cpp's server
    openai_server.queue_chat(Reply(json=PRIMER), Reply(json=PRIMER))
    chat = _chat(openai_settings)
    assert (await chat.complete(USER, response_model=Primer)).parsed == Primer(**PRIMER)
    rejected, accepted = openai_server.chat_requests
    assert rejected.status == 400 and rejected.response_format["type"] == "json_schema"
    assert accepted.response_format["type"] == "json_object"
    assert accepted.response_format["schema"]["properties"].keys() == Primer.model_fields.keys()
    assert "JSON" in accepted.messages[0]["content"]  # JSON mode needs the instruction

    # a second model object for the same endpoint skips the rejected mode
    await _chat(openai_settings).complete(USER, response_model=Primer)
    assert len(openai_server.chat_requests) == 3
    assert openai_server.chat_requests[-1].response_format["type"] == "json_object"


async def test_a_500_refusing_json_schema_falls_back_at_once_instead_of_retrying(openai_server, openai_settings):
    """llama.cpp's server before json_schema support (and ik_llama.cpp today) refuse it with a 500:
    retrying it with backoff took minutes per call and then failed the call; it is a refusal."""
    refusal = 'response_format type must be one of "text" or "json_object", but got: json_schema'

    def like_an_older_llama_cpp_server(request):
        if (request.response_format or {}).get("type") == "json_schema":
            return Reply.server_error(500, refusal)
        return Reply(json=PRIMER)

    openai_server.on_chat = like_an_older_llama_cpp_server
    chat = _chat(openai_settings, max_retries=5)
    assert (await chat.complete(USER, response_model=Primer)).parsed == Primer(**PRIMER)
    assert [r.response_format["type"] for r in openai_server.chat_requests] == ["json_schema", "json_object"]
    await chat.complete(USER, response_model=Primer)  # remembered: json_schema is not asked again
    assert [r.response_format["type"] for r in openai_server.chat_requests[2:]] == ["json_object"]
    # an ordinary 500 is still retried
    openai_server.queue_chat(Reply.server_error(500), Reply(json=PRIMER))
    await chat.complete(USER, response_model=Primer)
    assert [r.status for r in openai_server.chat_requests[3:]] == [500, 200]


async def test_a_stray_400_does_not_give_up_json_schema_for_good(openai_server, openai_settings):
    """A 400 that says nothing about the output format (a context-length error, a proxy's hiccup)
    moves one call down the chain but is not remembered; a server that refuses json_schema the same
    unexplained way twice in a row is remembered."""
    openai_server.queue_chat(Reply.bad_request("This model's maximum context length is 8192 tokens"), Reply(json=PRIMER),
                             Reply(json=PRIMER))
    chat = _chat(openai_settings)
    await chat.complete(USER, response_model=Primer)
    await chat.complete(USER, response_model=Primer)
    formats = [r.response_format["type"] for r in openai_server.chat_requests]
    assert formats == ["json_schema", "json_object", "json_schema"]  # the next call tried json_schema again

    refused = Reply.bad_request("Bad Request")
    openai_server.queue_chat(refused, Reply(json=PRIMER), refused, Reply(json=PRIMER), Reply(json=PRIMER))
    for _ in range(3):
        await chat.complete(USER, response_model=Primer)
    formats = [r.response_format["type"] for r in openai_server.chat_requests[3:]]
    assert formats == ["json_schema", "json_object", "json_schema", "json_object", "json_object"]


async def test_falls_back_to_prompt_only_with_repair(openai_server, openai_settings):
    openai_server.reject_response_formats = {"json_schema", "json_object"}
    sloppy = (
        "Sure! Here is the JSON:\n```json\n{'intermediate_answer': 'A hybrid search.', 'score': 80,"
        ' "follow_up_queries": ["What is a community?",],}\n```'
    )
    openai_server.queue_chat(Reply(text=sloppy))
    chat = _chat(openai_settings, chat_model="other-model")
    system_then_user = [Message("system", "You are helpful."), *USER]
    result = await chat.complete(system_then_user, response_model=Primer)
    assert result.parsed == Primer(**PRIMER)
    last = openai_server.chat_requests[-1]
    assert last.response_format is None
    assert last.messages[0]["role"] == "system" and "You are helpful." in last.messages[0]["content"]
    assert "follow_up_queries" in last.messages[0]["content"]  # the schema is in the prompt
    assert [m["role"] for m in last.messages] == ["system", "user"]


async def test_truncated_json_is_repaired(openai_server, openai_settings):
    truncated = '{"intermediate_answer": "A hybrid search.", "score": 80, "follow_up_queries": ["What is a comm'
    openai_server.queue_chat(Reply(text=truncated, finish_reason="length"))
    result = await _chat(openai_settings).complete(USER, response_model=Primer)
    assert result.parsed.score == 80 and result.parsed.follow_up_queries == ["What is a comm"]


async def test_unrecoverable_output_is_reported_with_the_text(openai_server, openai_settings):
    openai_server.queue_chat(Reply(text="I cannot answer that."), Reply(json={**PRIMER, "score": "high"}))
    chat = _chat(openai_settings)
    with pytest.raises(StructuredOutputError, match="no JSON object for Primer") as info:
        await chat.complete(USER, response_model=Primer)
    assert info.value.text == "I cannot answer that." and info.value.usage.calls == 1
    with pytest.raises(StructuredOutputError, match="score"):
        await chat.complete(USER, response_model=Primer)


async def test_a_long_structured_answer_is_parsed_off_the_event_loop(openai_server, openai_settings):
    """Repairing a long answer's JSON is Python work (0.2-0.4 s a MB): a 5 MB unterminated answer held
    the event loop, and every other search of the service, for 2.1 s. A long answer is parsed (and
    its tokens counted) on a worker thread; a short one stays on the loop, with no thread hop."""
    import functools
    from concurrent.futures import ThreadPoolExecutor

    class Recording(ThreadPoolExecutor):
        def __init__(self):
            super().__init__(max_workers=2)
            self.ran: list[str] = []

        def submit(self, fn, /, *args, **kwargs):
            ours = {"_count", "parse_structured"}  # (the SDK runs its platform lookup on a thread too)
            if isinstance(fn, functools.partial) and getattr(fn.args[0] if fn.args else None, "__name__", "") in ours:
                self.ran.append(fn.args[0].__name__)  # asyncio.to_thread: partial(context.run, func, ...)
            return super().submit(fn, *args, **kwargs)

    executor = Recording()
    asyncio.get_running_loop().set_default_executor(executor)
    long_answer = json.dumps({**PRIMER, "intermediate_answer": "long " * 100_000})[:-1]  # cut: repair runs
    openai_server.queue_chat(Reply(text=long_answer, usage=False), Reply(json=PRIMER, usage=False))
    chat = _chat(openai_settings)
    result = await chat.complete(USER, response_model=Primer)
    assert result.parsed.intermediate_answer == "long " * 100_000 and result.usage.counted
    assert executor.ran == ["_count", "parse_structured"]
    assert (await chat.complete(USER, response_model=Primer)).parsed == Primer(**PRIMER)
    assert executor.ran == ["_count", "parse_structured"]  # nothing more: a short answer stays on the loop


async def test_explicit_prompt_mode_sends_no_response_format(openai_server, openai_settings):
    openai_server.queue_chat(Reply(json=PRIMER))
    await _chat(openai_settings, structured_output="prompt").complete(USER, response_model=Primer)
    assert openai_server.chat_requests[0].response_format is None


# ---------------------------------------------------------------- concurrency


async def test_concurrency_limit_never_exceeded_under_50_calls(openai_server, openai_settings):
    openai_server.on_chat = lambda request: Reply(text="ok", delay=0.1)
    chat = _chat(openai_settings, max_concurrency=5)
    results = await asyncio.gather(*(chat.complete(USER) for _ in range(50)))
    assert [r.text for r in results] == ["ok"] * 50
    assert openai_server.max_concurrent <= 5
    assert openai_server.max_concurrent >= 2  # the calls really did overlap
    assert chat.limiter.max_in_use <= 5 and chat.limiter.in_use == 0


async def test_limit_is_shared_by_model_objects_and_holds_with_retries(openai_server, openai_settings):
    replies = [Reply.rate_limited(0.01) if i % 7 == 0 else Reply(text="ok", delay=0.02) for i in range(60)]
    openai_server.queue_chat(*replies)
    a = _chat(openai_settings, max_concurrency=4)
    b = _chat(openai_settings, max_concurrency=4)
    assert a.limiter is b.limiter
    await asyncio.gather(*(m.complete(USER) for m in [a, b] * 25))
    assert openai_server.max_concurrent <= 4


async def test_cancelled_callers_free_their_slots(openai_server, openai_settings):
    openai_server.on_chat = lambda request: Reply(text="slow", delay=5)
    chat = _chat(openai_settings, max_concurrency=2)
    tasks = [asyncio.create_task(chat.complete(USER)) for _ in range(6)]
    await _eventually(lambda: openai_server.in_flight == 2)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert chat.limiter.in_use == 0
    await _eventually(lambda: openai_server.in_flight == 0)
    openai_server.on_chat = None
    assert (await chat.complete(USER)).text == "ok"


async def test_a_freed_slot_goes_to_the_call_of_the_earliest_search(openai_server, openai_settings):
    """Under load, the calls of the search that started first are served first (then arrival order);
    a call of no search ranks by when it asked."""
    import time

    from drift_lance.models.limits import calls_ranked_from

    # the first call holds the only slot while the others queue up behind it
    openai_server.on_chat = lambda request: Reply(text="ok", delay=1.0 if request.messages[-1]["content"] == "holder" else 0.01)
    chat = _chat(openai_settings, max_concurrency=1)
    now = time.monotonic()

    async def call(name: str, search_started: float | None) -> None:
        if search_started is None:
            await chat.complete([Message("user", name)])
            return
        with calls_ranked_from(search_started):
            await chat.complete([Message("user", name)])

    holder = asyncio.create_task(call("holder", None))
    await _eventually(lambda: openai_server.in_flight == 1)
    waiting = []
    for name, started in [("later-0", now - 50), ("later-1", now - 50), ("no search", None), ("earlier-0", now - 100), ("earlier-1", now - 100)]:
        waiting.append(asyncio.create_task(call(name, started)))
        await _eventually(lambda: chat.limiter.waiting == len(waiting))
    await asyncio.gather(holder, *waiting)
    order = [r.messages[-1]["content"] for r in openai_server.chat_requests]
    assert order == ["holder", "earlier-0", "earlier-1", "later-0", "later-1", "no search"]


def test_limiter_works_across_event_loops(openai_server, openai_settings):
    openai_server.on_chat = lambda request: Reply(text="ok", delay=0.01)
    chat = _chat(openai_settings, max_concurrency=3)

    async def burst():
        return await asyncio.gather(*(chat.complete(USER) for _ in range(10)))

    for _ in range(3):  # a fresh event loop each time, same model object and limiter
        assert len(asyncio.run(burst())) == 10
    assert openai_server.max_concurrent <= 3


# ---------------------------------------------------------------- embeddings and Azure


async def test_embeddings_batched_in_order_and_normalised(openai_server, openai_settings):
    embedder = get_embedder(openai_settings.model_copy(update={"embedding_batch_size": 4}))
    texts = [f"text number {i}" for i in range(10)] + [""]
    matrix = await embedder.embed(texts)
    assert matrix.shape == (11, openai_server.embedding_dim) and matrix.dtype == np.float32
    assert embedder.dimension == openai_server.embedding_dim
    expected = np.array([openai_server.vector(t if t else " ") for t in texts], dtype=np.float32)
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(matrix, expected, rtol=1e-6)
    requests = openai_server.embedding_requests
    assert [len(r.body["input"]) for r in requests] == [4, 4, 3]
    assert all(r.body["encoding_format"] == "base64" and r.model == "test-embed" for r in requests)


async def test_embeddings_from_servers_that_only_send_floats(openai_server, openai_settings):
    openai_server.embeddings_float_only = True  # ignores encoding_format=base64
    matrix = await get_embedder(openai_settings).embed(["alpha beta", "gamma"])
    expected = np.array([openai_server.vector("alpha beta"), openai_server.vector("gamma")], dtype=np.float32)
    np.testing.assert_allclose(matrix, expected / np.linalg.norm(expected, axis=1, keepdims=True), rtol=1e-6)


async def test_server_rejecting_base64_embeddings_gets_floats_from_then_on(openai_server, openai_settings):
    openai_server.queue_embeddings(Reply(status=400, body={"error": {"message": "unsupported encoding_format: base64"}}))
    embedder = get_embedder(openai_settings)
    assert (await embedder.embed(["a"])).shape == (1, openai_server.embedding_dim)
    assert (await embedder.embed(["b"])).shape == (1, openai_server.embedding_dim)
    assert [r.body["encoding_format"] for r in openai_server.embedding_requests] == ["base64", "float", "float"]


async def test_embedding_errors_are_retried(openai_server, openai_settings):
    openai_server.queue_embeddings(Reply.rate_limited(0.01))
    matrix = await get_embedder(openai_settings).embed(["a", "b"])
    assert matrix.shape == (2, openai_server.embedding_dim)
    assert [r.status for r in openai_server.embedding_requests] == [429, 200]


@pytest.mark.parametrize(("data", "error"), [
    ('[{"index":0,"embedding":[1,NaN,0,0]},{"index":1,"embedding":[1,0,0,0]}]', r"NaN or infinite values \(input 0"),
    ('[{"index":0,"embedding":[1,0,0,0]},{"index":1,"embedding":[1,-Infinity,0,0]}]', r"NaN or infinite values \(input 1"),
    ('[{"index":0,"embedding":[1e39,0,0,0]},{"index":1,"embedding":[1,0,0,0]}]', "NaN or infinite"),  # past float32
    ('[{"index":0,"embedding":[1,0,0,0]},{"index":0,"embedding":[0,1,0,0]}]', r"for inputs \[0, 0\], expected 0 to 1"),
    ('[{"index":3,"embedding":[1,0,0,0]},{"index":4,"embedding":[0,1,0,0]}]', r"for inputs \[3, 4\]"),
    ('[{"index":0,"embedding":[[1,0],[0,0]]},{"index":1,"embedding":[[1,0],[0,0]]}]', "not a list of numbers"),
    ('[{"index":0,"embedding":[]},{"index":1,"embedding":[]}]', "empty"),
])
async def test_an_embeddings_answer_that_is_not_one_finite_vector_per_input_fails_naming_the_model(
        openai_server, openai_settings, data, error):
    """NaN or infinite values, a repeated index (the second input got the first one's vector, silently),
    nested or empty vectors came back as vectors; they fail the call, naming the model."""
    openai_server.queue_embeddings(Reply(body='{"data":' + data + "}"))
    with pytest.raises(ModelError, match=f"embedding model 'test-embed' returned .*{error}"):
        await get_embedder(openai_settings).embed(["a", "b"])


async def test_batches_of_different_dimensions_fail_naming_the_model(openai_server, openai_settings):
    """numpy's ValueError ("all the input array dimensions ... must match") named no model and was no
    ModelError, which callers catch."""
    openai_server.queue_embeddings(Reply(body={"data": [{"index": 0, "embedding": [1.0, 0.0]}]}),
                                   Reply(body={"data": [{"index": 0, "embedding": [1.0, 0.0, 0.0]}]}))
    embedder = get_embedder(openai_settings.model_copy(update={"embedding_batch_size": 1, "max_concurrency": 1}))
    with pytest.raises(ModelError, match=r"embedding model 'test-embed' at .* returned vectors of \[2, 3\] dimensions"):
        await embedder.embed(["a", "b"])


async def test_azure_backend_uses_deployment_route_and_api_key_header(openai_server, monkeypatch):
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    settings = ModelSettings(
        chat_backend="azure",
        embedding_backend="azure",
        azure_endpoint=openai_server.base_url.removesuffix("/v1"),
        api_key="azure-key",
        api_version="2024-10-21",
        deployment="my-gpt",
        embedding_deployment="my-embed",
        max_retries=0,
    )
    openai_server.queue_chat(Reply(text="from azure"))
    assert (await get_chat_model(settings).complete(USER)).text == "from azure"
    await get_embedder(settings).embed(["x"])
    chat_req, embed_req = openai_server.requests
    assert chat_req.route == "/openai/deployments/my-gpt/chat/completions"
    assert embed_req.route == "/openai/deployments/my-embed/embeddings"
    assert "api-version=2024-10-21" in chat_req.query and chat_req.headers["api-key"] == "azure-key"


async def test_azure_from_the_environment_sends_azures_key_though_openai_api_key_is_set(openai_server, monkeypatch):
    """With AZURE_OPENAI_ENDPOINT, AZURE_OPENAI_API_KEY and an OPENAI_API_KEY left in the
    environment, the OpenAI key went to the Azure resource (401, and a secret sent to the wrong
    provider); the openai SDK's AzureOpenAI reads AZURE_OPENAI_API_KEY."""
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.setenv("AZURE_OPENAI_ENDPOINT", openai_server.base_url.removesuffix("/v1"))
    monkeypatch.setenv("AZURE_OPENAI_API_KEY", "azure-key")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-key")
    monkeypatch.setenv("OPENAI_API_VERSION", "2024-10-21")
    openai_server.queue_chat(Reply(text="from azure"))
    assert (await get_chat_model(ModelSettings(max_retries=0)).complete(USER)).text == "from azure"
    assert openai_server.requests[0].headers["api-key"] == "azure-key"


def test_fake_server_works_from_sync_code():
    import openai

    with FakeOpenAIServer() as server:
        server.queue_chat("plain text reply")
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        client.close()
    assert reply.choices[0].message.content == "plain text reply"
    assert server.requests[0].messages == [{"role": "user", "content": "hi"}]


async def test_a_body_nested_deeper_than_the_decoder_goes_is_a_malformed_response(openai_server, openai_settings):
    """A server answering "[[[[...]]]]" made the JSON decoder raise RecursionError, which escaped
    as an internal error (a 500 from the service for a local search) instead of a model failure."""
    nested = "[" * 100_000 + "]" * 100_000
    openai_server.queue_chat(Reply(body=nested))
    with pytest.raises(ModelRequestError, match="malformed response body: JSON nested too deeply") as info:
        await _chat(openai_settings, max_retries=2).complete(USER)
    assert info.value.attempts == 1 and info.value.failure == "malformed"
    openai_server.queue_embeddings(Reply(body=nested))
    with pytest.raises(ModelRequestError, match="nested too deeply"):
        await get_embedder(openai_settings.model_copy(update={"max_retries": 0})).embed(["x"])
    stream_chunk = "data: " + nested + "\n\n"
    openai_server.queue_chat(Reply(body=stream_chunk, headers={"content-type": "text/event-stream"}))
    with pytest.raises(ModelRequestError, match="stream failed: malformed response body: a chunk's JSON is nested too "
                       "deeply") as info:
        _ = [d async for d in _chat(openai_settings).stream(USER)]
    assert info.value.failure == "malformed"


async def test_an_error_body_cannot_write_lines_or_escapes_into_the_log(openai_server, openai_settings, caplog):
    """The server's error message is quoted in the log and the error: a newline in it wrote a
    forged log line (the service's format, a request id of its choosing), an ANSI escape recoloured
    or cleared the operator's terminal."""
    import logging

    forged = "overloaded\n2026-12-07 10:00:00,000 ERROR drift_lance.service [admin] forged\x1b[2J\x1b[31m"
    openai_server.queue_chat(*[Reply.server_error(500, forged)] * 2)
    with caplog.at_level(logging.WARNING), pytest.raises(ModelRequestError) as info:
        await _chat(openai_settings, max_retries=1).complete(USER)
    logged = [r.getMessage() for r in caplog.records if "overloaded" in r.getMessage()]
    assert logged, "the retry is logged with the server's words"
    for text in [str(info.value), *logged]:
        assert "overloaded 2026-12-07 10:00:00,000 ERROR" in text
        assert "\n" not in text and "\x1b" not in text


# ---------------------------------------------------------------- response size bound

_CAP = 64 * 1024  # max_response_bytes in these tests


def _endless(first: bytes, piece: bytes):
    """A body that never ends (the server writes until the client hangs up)."""
    yield first
    while True:
        yield piece


def _sse(content: str) -> bytes:
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}
    return f"data: {json.dumps(chunk)}\n\n".encode()


@pytest.mark.parametrize("http_client", ["aiohttp", "httpx"])
async def test_a_response_past_max_response_bytes_fails_its_call_at_once(openai_server, openai_settings, http_client):
    """A server generating without end (or answering gigabytes) held the call until request_timeout,
    retried it, and read the whole body into memory: a 200 MB answer took the process from 215 to
    848 MB RSS and held the event loop 0.7 s. Now the call fails, unretried, once the body passes
    max_response_bytes, and the connection is dropped."""
    settings = openai_settings.model_copy(update={"max_response_bytes": _CAP, "http_client": http_client})
    chat, embedder = _chat(settings), get_embedder(settings)
    opening = b'{"choices":[{"index":0,"message":{"role":"assistant","content":"'
    openai_server.queue_chat(Reply(body_chunks=_endless(opening, b"all work and no play " * 100)))
    with pytest.raises(ModelRequestError, match=r"response too large: more than 65,536 bytes \(max_response_bytes\); a "
                       "model that does not stop generating") as info:
        await chat.complete(USER)
    assert info.value.failure == "too_large" and info.value.attempts == 1
    await _eventually(lambda: openai_server.disconnects == 1)

    openai_server.queue_chat(Reply(text="x" * (_CAP + 1)))  # a declared length past the bound is not read at all
    with pytest.raises(ModelRequestError, match=r"more than 65,536 bytes \(65,[0-9]{3} declared\)"):
        await chat.complete(USER)
    openai_server.queue_chat(Reply(status=500, body_chunks=_endless(b"<html>", b"error " * 1000)))  # an error page too
    with pytest.raises(ModelRequestError, match="response too large") as info:
        await chat.complete(USER)
    assert info.value.attempts == 1
    openai_server.queue_embeddings(Reply(body_chunks=_endless(b'{"data":[{"index":0,"embedding":[', b"0.5, " * 1000)))
    with pytest.raises(ModelRequestError, match="embedding model 'test-embed' .* response too large.* raise "
                       "max_response_bytes or lower embedding_batch_size"):
        await embedder.embed(["x"])

    answer = "y" * (_CAP - 1000)  # within the bound: answered as before
    openai_server.queue_chat(Reply(text=answer))
    assert (await chat.complete(USER)).text == answer
    assert (await embedder.embed(["x"])).shape == (1, openai_server.embedding_dim)


async def test_a_compressed_body_is_bounded_as_it_unpacks(openai_server, openai_settings):
    """A small gzip body can unpack to gigabytes: the bound counts what it unpacks to."""
    import gzip

    body = b'{"choices":[{"index":0,"message":{"role":"assistant","content":"' + b"0" * (4 * _CAP) + b'"}}]}'
    packed = gzip.compress(body)
    assert len(packed) < _CAP
    openai_server.queue_chat(Reply(body=packed, headers={"content-encoding": "gzip"}))
    with pytest.raises(ModelRequestError, match="more than 65,536 bytes unpacked") as info:
        await _chat(openai_settings, max_response_bytes=_CAP).complete(USER)
    assert info.value.failure == "too_large"


async def test_an_endless_stream_fails_at_the_bound_instead_of_running_forever(openai_server, openai_settings):
    """An event stream that never ends streamed tokens for as long as the caller waited (the CLI:
    forever), and its text filled memory. Its text is bounded by max_response_bytes, its bytes on the
    wire (a JSON chunk per token) by 8 times that."""
    chat = _chat(openai_settings, max_response_bytes=_CAP)
    sse = {"content-type": "text/event-stream"}
    openai_server.queue_chat(Reply(body_chunks=_endless(b"", _sse("word ") * 50), headers=sse))
    with pytest.raises(ModelRequestError, match=r"stream failed: response too large: more than 524,288 bytes of event "
                       r"stream \(8 x the answer's bound\)") as info:
        _ = [d async for d in chat.stream(USER)]
    assert info.value.failure == "too_large"
    openai_server.queue_chat(Reply(body_chunks=_endless(b"", _sse("long paragraph " * 500)), headers=sse))
    received = []
    with pytest.raises(ModelRequestError, match=r"more than 65,536 characters of answer"):
        async for delta in chat.stream(USER):
            received.append(delta)
    assert len("".join(received)) <= _CAP
    await _eventually(lambda: openai_server.disconnects == 2)
    assert chat.limiter.in_use == 0


async def test_a_stream_dripping_a_byte_at_a_time_ends_at_stream_timeout(openai_server, openai_settings):
    """request_timeout bounds the wait for each byte: a server sending one byte every so often, never
    finishing, held a stream (and the CLI's query) forever. stream_timeout bounds the whole stream."""

    def drip():
        yield _sse("first ")
        while True:
            yield from (bytes([b]) for b in _sse("slow "))

    openai_server.queue_chat(Reply(body_chunks=drip(), chunk_delay=0.05, headers={"content-type": "text/event-stream"}))
    chat = _chat(openai_settings, stream_timeout=1.0)
    received = []
    async with asyncio.timeout(60):  # without the bound: here, not a hung test
        with pytest.raises(ModelRequestError, match=r"did not end within 1s \(stream_timeout\)") as info:
            async for delta in chat.stream(USER):
                received.append(delta)
    assert info.value.failure == "timeout" and received  # it was answering, just never finishing
    await _eventually(lambda: openai_server.disconnects == 1)
