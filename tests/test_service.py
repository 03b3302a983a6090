"""HTTP service: the real app on uvicorn (127.0.0.1), a real HTTP client, the real engine on a real
LanceDB index; only the chat model is scripted."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

import httpx
import pytest
from fixtures.service import REDUCE_ANSWER, GatedChatModel, drift_responder, make_backend, scripted_drift_model

from drift_lance.config.settings import Settings
from drift_lance.drift.action import ActionAnswer
from drift_lance.service import create_app
from drift_lance.store import Manifest

COUNT_FIELDS = (
    "llm_calls",
    "prompt_tokens",
    "output_tokens",
    "llm_calls_categories",
    "prompt_tokens_categories",
    "output_tokens_categories",
)


def read_sse(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event, data) pairs of an SSE response, in arrival order (keep-alive comments skipped)."""
    events, name, data = [], None, []
    for line in response.iter_lines():
        if line.startswith(":"):
            continue
        if not line:
            if name is not None:
                events.append((name, json.loads("\n".join(data))))
            name, data = None, []
        elif line.startswith("event:"):
            name = line.partition(":")[2].strip()
        elif line.startswith("data:"):
            data.append(line.partition(":")[2].strip())
    return events


def scrape(client: httpx.Client) -> dict[tuple[str, frozenset], float]:
    """/metrics parsed: {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4"), r.text
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(r.text) for sample in family.samples}


def moved(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture
def server(service_settings, live_server):
    return live_server(create_app(service_settings, backend=make_backend(service_settings)))


def start(live_server, settings: Settings, chat_model=None, **kwargs):
    return live_server(create_app(settings, backend=make_backend(settings, chat_model)), **kwargs)


# ---------------------------------------------------------------------------------------- search


def test_blocking_drift_search_returns_the_search_result(server):
    with server.client() as client:
        r = client.post("/v1/search", json={"query": "What is the Paranormal Military Squad doing?"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["response"] == REDUCE_ANSWER
    calls = body["llm_calls_categories"]
    assert calls["primer"] == 1 and calls["reduce"] == 1 and calls["action"] >= 1
    assert body["llm_calls"] == sum(calls.values())
    assert body["state"]["nodes"], "the DRIFT action graph is part of the result"


def test_a_drift_request_sets_the_community_level_of_the_primers_reports(server):
    def primer_report_levels(config: dict) -> set[int]:
        with server.client() as client:
            r = client.post("/v1/search", json={"query": "Who restored the lighthouse?", "config": config})
        assert r.status_code == 200, r.text
        return {report["level"] for report in r.json()["context_data"]["Who restored the lighthouse?"]["reports"]}

    assert max(primer_report_levels({})) > 0
    assert primer_report_levels({"community_level": 0}) == {0}


def test_local_search_method(server):
    with server.client() as client:
        r = client.post("/v1/search", json={"query": "Who leads the squad?", "method": "local"})
    assert r.status_code == 200, r.text
    assert r.json()["response"]
    assert r.json()["llm_calls"] == 1


def test_stream_events_in_order_with_counts_equal_to_blocking_result(server):
    request = {"query": "What is the Paranormal Military Squad doing?", "config": {"n_depth": 1}}
    with server.client() as client:
        blocking = client.post("/v1/search", json=request).json()
        with client.stream("POST", "/v1/search/stream", json=request) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = read_sse(r)
    names = [name for name, _ in events]
    assert names[0] == "primer"
    assert names[-1] == "done"
    first_token = names.index("token")
    assert set(names[1:first_token]) == {"action"}, names
    assert set(names[first_token:-1]) == {"token"}, names
    assert names.count("action") == blocking["llm_calls_categories"]["action"]
    assert "".join(data["text"] for name, data in events if name == "token") == blocking["response"]
    done = events[-1][1]
    assert {k: done[k] for k in COUNT_FIELDS} == {k: blocking[k] for k in COUNT_FIELDS}
    primer = events[0][1]
    assert primer["follow_ups"] and primer["reports"] >= 1


def test_every_stream_event_matches_the_schema_openapi_names_for_it(service_settings, live_server):
    """`x-sse-events` of the stream's response maps each event name to its data's schema: a client
    typing the events from the document must accept every event the server sends."""
    import jsonschema

    from drift_lance.models.base import ModelError
    from drift_lance.testing import ScriptedChatModel

    srv = start(live_server, service_settings)
    with srv.client() as client:
        document = client.get("/openapi.json").json()
        with client.stream("POST", "/v1/search/stream", json={"query": "Who is in the squad?", "config": {"n_depth": 1}}) as r:
            events = read_sse(r)
    failing = start(live_server, service_settings, ScriptedChatModel(lambda *a: ModelError("upstream is down")))
    with failing.client() as client, client.stream("POST", "/v1/search/stream", json={"query": "q", "method": "local"}) as r:
        events += read_sse(r)
    stream = document["paths"]["/v1/search/stream"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    named = stream["x-sse-events"]
    assert set(named) == {"primer", "action", "token", "done", "error"} == {name for name, _ in events}
    for name, data in events:
        jsonschema.validate(data, {**named[name], "components": document["components"]})
        assert_sent_fields_required(document, named[name], data)
    with pytest.raises(jsonschema.ValidationError):  # the schemas are closed: a renamed field would show
        jsonschema.validate({**events[0][1], "follow_up": []}, {**named[events[0][0]], "components": document["components"]})


def assert_as_documented(document: dict, path: str, method: str, response: httpx.Response) -> None:
    """`response` is one the OpenAPI document declares for its route and status, and matches that
    schema; every field it carries is a required one there (a generated client types nothing the
    server always sends as optional)."""
    import jsonschema

    declared = document["paths"][path][method]["responses"].get(str(response.status_code))
    assert declared is not None, f"{method.upper()} {path} answered {response.status_code}, which the document does not declare"
    media = response.headers["content-type"].split(";")[0]
    schema = declared["content"][media]["schema"]
    jsonschema.validate(response.json(), {**schema, "components": document["components"]})
    assert_sent_fields_required(document, schema, response.json())
    headers = {name.lower() for name in declared.get("headers", {})}
    assert {"x-request-id", "retry-after"} & set(response.headers) <= headers, (path, response.status_code, headers)
    if "error" in response.json():  # the status's description names the code a client can branch on
        assert f"`{response.json()['error']['code']}`" in declared["description"], (path, response.text)


def assert_sent_fields_required(document: dict, schema: dict, data: Any) -> None:
    if "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    if not isinstance(data, dict) or "properties" not in schema:
        return
    assert set(data) <= set(schema.get("required", ())), (schema.get("title"), set(data) - set(schema.get("required", ())))
    for name, value in data.items():
        field = schema["properties"][name]
        for kind in field.get("anyOf", [field]):
            assert_sent_fields_required(document, kind, value)
            if isinstance(value, dict) and isinstance(kind.get("additionalProperties"), dict):
                for item in value.values():
                    assert_sent_fields_required(document, kind["additionalProperties"], item)


def test_every_response_is_one_the_document_declares_with_every_field_it_sends_required(service_settings, live_server,
                                                                                       monkeypatch):
    monkeypatch.setenv("DRIFT_LANCE_API_KEY", "s3cret")
    srv = start(live_server, Settings.load(db=service_settings.db).with_updates(
        {"drift.n_depth": 1, "drift.drift_k_followups": 2, "drift.primer_folds": 1}))
    key = {"Authorization": "Bearer s3cret"}
    with srv.client() as client:
        document = client.get("/openapi.json", headers=key).json()
        answers = [
            ("/healthz", "get", client.get("/healthz")),
            ("/readyz", "get", client.get("/readyz")),
            ("/v1/index", "get", client.get("/v1/index", headers=key)),
            ("/v1/index", "get", client.get("/v1/index")),
            ("/metrics", "get", client.get("/metrics")),
            ("/v1/admin/reload", "post", client.post("/v1/admin/reload", headers=key)),
            ("/v1/search", "post", client.post("/v1/search", headers=key, json={"query": "Who restored the lighthouse?"})),
            ("/v1/search", "post", client.post("/v1/search", headers=key, json={"query": "q", "method": "local"})),
            ("/v1/search", "post", client.post("/v1/search", headers=key, json={"query": "q", "config": {"n_depth": 9}})),
            ("/v1/search", "post", client.post("/v1/search", headers=key, data={"query": "q"})),
            ("/v1/search", "post", client.post("/v1/search", headers={**key, "Content-Type": "application/json"},
                                               content=b"[" * 70_000)),
            ("/v1/search/stream", "post", client.post("/v1/search/stream", headers=key, json={"query": "q", "x": 1})),
        ]
    assert {r.status_code for _, _, r in answers} == {200, 401, 413, 415, 422}
    for path, method, response in answers:
        assert_as_documented(document, path, method, response)


def test_index_health_and_readiness(server):
    with server.client() as client:
        assert client.get("/healthz").json()["status"] == "ok"
        assert client.head("/healthz").status_code == 200 and client.head("/readyz").status_code == 200  # HEAD probes
        ready = client.get("/readyz")
        manifest = client.get("/v1/index").json()
        schema = client.get("/openapi.json").json()
    assert ready.status_code == 200 and ready.json() == {"status": "ready", "store": True, "models": True, "detail": ""}
    assert manifest["tables"]["entities"]["rows"] > 0
    assert manifest["vectors"]["entities"]["dimension"] == 64
    assert {"/v1/search", "/v1/search/stream", "/v1/index", "/healthz", "/readyz"} <= set(schema["paths"])
    # a generated client gets a typed manifest and the Retry-After header of 429 / 503
    index_ok = schema["paths"]["/v1/index"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert index_ok == {"$ref": "#/components/schemas/Manifest"} and Manifest.model_validate(manifest).generation == 1
    assert "Retry-After" in schema["paths"]["/v1/search"]["post"]["responses"]["429"]["headers"]
    # generated clients name their methods after the operation ids: stable names, not the handlers'
    operations = {(path, method): op["operationId"] for path, ops in schema["paths"].items() for method, op in ops.items()}
    assert operations == {("/healthz", "get"): "healthz", ("/readyz", "get"): "readyz", ("/v1/index", "get"): "get_index",
                          ("/v1/search", "post"): "search", ("/v1/search/stream", "post"): "search_stream",
                          ("/v1/admin/reload", "post"): "reload_index", ("/metrics", "get"): "metrics"}


def test_openapi_gives_config_the_fields_of_the_request_method(server):
    """A generated client learns which `config` fields each method takes: DRIFT's for drift (the
    default), local search's for local; the server refuses the same bodies the document does."""
    import jsonschema

    with server.client() as client:
        document = client.get("/openapi.json").json()
        schema = {**document["components"]["schemas"]["SearchRequest"], "components": document["components"]}
        validator = jsonschema.Draft202012Validator(schema)
        for body, valid in [({"query": "q", "config": {"n_depth": 1}}, True),
                            ({"query": "q", "method": "local", "config": {"top_k_entities": 5}}, True),
                            ({"query": "q", "method": "local", "config": {"n_depth": 1}}, False),
                            ({"query": "q", "config": {"top_k_entities": 5}}, False),
                            # a field both methods have, typed differently: drift's may be null, local's not
                            ({"query": "q", "config": {"community_level": None}}, True),
                            ({"query": "q", "method": "local", "config": {"community_level": None}}, False)]:
            assert validator.is_valid(body) is valid, body
            answer = client.post("/v1/search", json=body)
            assert (answer.status_code == 200) is valid, (body, answer.text)


def test_openapi_gives_config_this_servers_caps_and_defaults(service_settings, live_server):
    """The request schema is the one this server applies: a client validating from the document
    sends nothing the server refuses for a cap, a negative number, a null "no limit" or a
    server-only field, and shows as defaults the values the server uses for fields left out."""
    import jsonschema

    settings = service_settings.with_updates({"service.caps.n_depth": 2, "service.caps.token_budget": 8000,
                                              "service.caps.server_only": ["concurrency", "context_concurrency",
                                                                           "llm_timeout", "seed"],
                                              "service.max_query_chars": 50, "service.search_timeout_seconds": 60,
                                              "local.top_k_entities": 7})
    srv = start(live_server, settings)
    with srv.client() as client:
        document = client.get("/openapi.json").json()
        schema = {**document["components"]["schemas"]["SearchRequest"], "components": document["components"]}
        validator = jsonschema.Draft202012Validator(schema)
        for body, valid in [({"query": "q", "config": {"n_depth": 2}}, True),
                            ({"query": "q", "config": {"n_depth": 3}}, False),
                            ({"query": "q", "config": {"data_max_tokens": 8001}}, False),
                            ({"query": "q", "config": {"hyde_max_tokens": None}}, False),  # no limit: past the cap
                            ({"query": "q", "config": {"time_budget": 61}}, False),  # the search timeout caps it
                            ({"query": "q", "config": {"seed": 3}}, False),  # server-only here
                            ({"query": "q", "method": "local", "config": {"min_community_rank": -1}}, False),
                            ({"query": "q" * 51}, False),
                            ({"query": " \n\t"}, False)]:
            assert validator.is_valid(body) is valid, body
            answer = client.post("/v1/search", json=body)
            assert (answer.status_code == 200) is valid, (body, answer.text)
    by_method = schema["allOf"][0]
    drift, local = (by_method[branch]["properties"]["config"]["properties"] for branch in ("else", "then"))
    assert drift["n_depth"]["default"] == 1 and drift["time_budget"]["default"] == 60  # service_settings', the timeout
    assert local["top_k_entities"]["default"] == 7


def test_ready_service_exempts_its_start_up_objects_from_garbage_collection(service_settings, live_server, unfrozen_gc):
    """Full collections would otherwise walk every import-time object and stop the event loop for
    ~0.1 s every few searches."""
    import gc

    server = live_server(create_app(service_settings, backend=make_backend(service_settings)))
    with server.client() as client:
        assert client.get("/readyz").status_code == 200
    assert gc.get_freeze_count() > 10_000


def test_readyz_reports_a_backend_that_failed_to_start(tmp_path, live_server, monkeypatch):
    monkeypatch.delenv("DRIFT_LANCE_API_KEY", raising=False)
    settings = Settings.load(db=str(tmp_path / "never-ingested"))
    srv = start(live_server, settings, wait_ready=False)
    with srv.client() as client:
        for _ in range(500):
            ready = client.get("/readyz")
            if ready.json()["status"] != "starting":
                break
        search = client.post("/v1/search", json={"query": "q"})
        document = client.get("/openapi.json").json()
    assert_as_documented(document, "/readyz", "get", ready)
    assert_as_documented(document, "/v1/search", "post", search)
    assert ready.status_code == 503
    assert ready.json()["status"] == "failed" and "never-ingested" in ready.json()["detail"]
    assert ready.json()["store"] is False
    assert search.status_code == 503 and search.json()["error"]["code"] == "not_ready"
    assert "Retry-After" in search.headers


def test_readyz_tells_why_only_to_an_authenticated_caller(tmp_path, live_server, monkeypatch):
    """Probes stay open, but a failed setup's reason (paths, endpoints) is the operator's."""
    monkeypatch.setenv("DRIFT_LANCE_API_KEY", "probe-secret")
    settings = Settings.load(db=str(tmp_path / "never-ingested"))
    srv = start(live_server, settings, wait_ready=False)
    with srv.client() as client:
        anonymous = _wait_settled(client)
        wrong = client.get("/readyz", headers={"Authorization": "Bearer nope"})
        operator = client.get("/readyz", headers={"Authorization": "Bearer probe-secret"})
    assert anonymous.status_code == wrong.status_code == operator.status_code == 503
    assert anonymous.json() == wrong.json() and anonymous.json()["status"] == "failed" and anonymous.json()["detail"] == ""
    assert "never-ingested" in operator.json()["detail"]


def test_model_request_failures_do_not_show_the_endpoint_or_its_error_body(service_settings, live_server, caplog):
    """A model's HTTP failure names its endpoint and quotes the upstream body (an API key hint, a
    proxy's address): the client gets the status, the log the whole text, for the search's error
    and for each failed follow-up in a DRIFT state."""
    from drift_lance.models.base import ModelRequestError
    from drift_lance.testing import ScriptedChatModel

    leak = "chat model 'm' at http://10.1.2.3:8080/v1 failed: HTTP 401: Incorrect API key provided: sk-live-SECRET"

    def answer(messages, params, response_model):
        if response_model is ActionAnswer:
            raise ModelRequestError(leak, status=401)
        return drift_responder(messages, params, response_model)

    srv = start(live_server, service_settings, ScriptedChatModel(lambda *a: ModelRequestError(leak, status=401)))
    with srv.client() as client, caplog.at_level(logging.WARNING):
        failed = client.post("/v1/search", json={"query": "q", "method": "local"})
        with client.stream("POST", "/v1/search/stream", json={"query": "q", "method": "local"}) as r:
            events = read_sse(r)
    assert failed.status_code == 502 and _error(failed)["code"] == "model_error"
    assert _error(failed)["message"] == "the model request failed (HTTP 401); details are in the server log"
    assert events[-1][0] == "error" and events[-1][1]["error"]["message"] == _error(failed)["message"]
    assert "sk-live-SECRET" in caplog.text
    srv = start(live_server, service_settings, ScriptedChatModel(answer))
    with srv.client() as client:
        degraded = client.post("/v1/search", json={"query": "q", "method": "drift"})
    assert degraded.status_code == 200 and "10.1.2.3" not in degraded.text and "SECRET" not in degraded.text
    errors = [n["metadata"]["error"] for n in degraded.json()["state"]["nodes"] if "error" in n["metadata"]]
    assert errors and set(errors) == {"ModelRequestError"}


@pytest.mark.parametrize(("method", "what"), [("drift", "DRIFT reduce"), ("local", "local search answer")])
def test_an_empty_answer_is_a_model_error(service_settings, live_server, caplog, method, what):
    """An empty answer (DRIFT's reduce, local search's answer) was a 200 with response "" (and an SSE
    stream that ended as if answered). The calls it cost count under stage "failed"."""
    from drift_lance.testing import ScriptedChatModel

    def answer(messages, params, response_model):
        reply = drift_responder(messages, params, response_model)
        return "" if reply == REDUCE_ANSWER else reply

    srv = start(live_server, service_settings, ScriptedChatModel(answer))
    with srv.client() as client, caplog.at_level(logging.WARNING):
        before = scrape(client)
        failed = client.post("/v1/search", json={"query": "q", "method": method})
        with client.stream("POST", "/v1/search/stream", json={"query": "q", "method": method}) as r:
            events = read_sse(r)
        after = scrape(client)
    assert failed.status_code == 502 and _error(failed)["code"] == "model_error"
    assert _error(failed)["message"] == "the model request failed (empty answer); details are in the server log"
    assert events[-1][0] == "error" and events[-1][1]["error"]["message"] == _error(failed)["message"]
    assert f"{what}: chat model 'scripted' returned an empty answer" in caplog.text
    assert moved(before, after, "drift_lance_searches_finished_total", method=method, outcome="model_error") == 2
    assert moved(before, after, "drift_lance_llm_calls_total", method=method, stage="failed") >= 2
    # the model's call succeeded, the search found the answer empty: still a model failure, once a search
    assert moved(before, after, "drift_lance_model_failures_total", kind="empty_answer") == 2


@pytest.mark.parametrize("method", ["drift", "local"])
def test_an_empty_answer_the_model_raises_is_one_model_failure(service_settings, live_server, method):
    """The model's own EmptyAnswerError (a content filter) for the final answer counts once, not
    again as the search's empty answer."""
    from drift_lance.models.base import EmptyAnswerError
    from drift_lance.testing import ScriptedChatModel

    def answer(messages, params, response_model):
        reply = drift_responder(messages, params, response_model)
        return EmptyAnswerError("returned no text: content_filter") if reply == REDUCE_ANSWER else reply

    srv = start(live_server, service_settings, ScriptedChatModel(answer))
    with srv.client() as client:
        before = scrape(client)
        failed = client.post("/v1/search", json={"query": "q", "method": method})
        with client.stream("POST", "/v1/search/stream", json={"query": "q", "method": method}) as r:
            events = read_sse(r)
        after = scrape(client)
    assert failed.status_code == 502 and events[-1][0] == "error"
    assert moved(before, after, "drift_lance_model_failures_total", kind="empty_answer") == 2


@pytest.mark.parametrize(("failure", "said"), [("timeout", "timed out"), ("connection", "connection failed"),
                                                ("malformed", "malformed response"), ("too_large", "response too large"),
                                                ("other", "no response")])
def test_a_model_failure_without_a_status_is_told_by_its_kind_not_its_text(service_settings, live_server, failure, said):
    """The client learns what kind of failure it was from the error's `failure`, whatever its
    message says (here a message that would read as another kind)."""
    from drift_lance.models.base import ModelRequestError
    from drift_lance.testing import ScriptedChatModel

    misleading = "chat model 'm' at http://10.1.2.3:8080/v1 failed: connection failed, request timed out"
    srv = start(live_server, service_settings, ScriptedChatModel(lambda *a: ModelRequestError(misleading, failure=failure)))
    with srv.client() as client:
        failed = client.post("/v1/search", json={"query": "q", "method": "local"})
    assert failed.status_code == 502
    assert _error(failed)["message"] == f"the model request failed ({said}); details are in the server log"


def test_an_endless_model_answer_fails_its_search_and_the_service_goes_on(service_settings, live_server, openai_server,
                                                                         openai_settings):
    """A model server that never stops answering grew the service by every byte it sent, until the
    search timeout. The search now fails at max_response_bytes (502, "response too large"), and the
    next search is answered."""
    from drift_lance.models import get_chat_model
    from drift_lance.testing import Reply

    def endless():
        yield b'{"choices":[{"index":0,"message":{"role":"assistant","content":"'
        while True:
            yield b"and so on " * 1000

    openai_server.queue_chat(Reply(body_chunks=endless()), Reply(text="Alex Mercer leads the team."))
    chat = get_chat_model(openai_settings.model_copy(update={"max_response_bytes": 64 * 1024}))
    srv = start(live_server, service_settings, chat)
    with srv.client() as client:
        failed = client.post("/v1/search", json={"query": "Who leads?", "method": "local"})
        answered = client.post("/v1/search", json={"query": "Who leads?", "method": "local"})
    assert failed.status_code == 502 and _error(failed)["code"] == "model_error"
    assert _error(failed)["message"] == "the model request failed (response too large); details are in the server log"
    assert answered.status_code == 200 and answered.json()["response"] == "Alex Mercer leads the team."


def test_a_request_the_http_parser_refuses_gets_the_json_error_shape(service_settings, live_server):
    """A header line without a colon never reaches the app (the HTTP parser refuses it); the 400
    still comes in the one error shape clients parse, with an X-Request-ID like every other answer
    (it had none), counted in /metrics (it was not), and the connection is closed."""
    import json
    import socket

    app = create_app(service_settings, backend=make_backend(service_settings))
    server = live_server(app, settings=service_settings)  # uvicorn configured as `drift-lance serve` does
    host, port = server.base_url.split("//")[1].split(":")
    with server.client() as client:
        before = scrape(client)
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nnot a header\r\n\r\n")
        received = b""
        while chunk := conn.recv(4096):  # the server closes the connection after answering
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower()
    assert json.loads(body)["error"]["code"] == "invalid_http"
    ids = [line.split(b":", 1)[1].strip() for line in head.split(b"\r\n") if line.lower().startswith(b"x-request-id:")]
    assert len(ids) == 1 and ids[0]
    with server.client() as client:  # counted, as every answer is, under the route of an unknown path
        assert moved(before, scrape(client), "drift_lance_http_requests_total", route="other", status="400") == 1


def test_slow_senders_lose_their_connection(service_settings, live_server):
    """Headers trickled a byte at a time, or a body that stops halfway, must not hold a connection
    (or, hundreds of them, every socket the server has): headers get `request_read_timeout_seconds`
    from the connection, a body as long from its headers (then 408)."""
    import socket

    settings = service_settings.with_updates({"service.request_read_timeout_seconds": 0.5})
    srv = live_server(create_app(settings, backend=make_backend(settings)), settings=settings)
    port = int(srv.base_url.rsplit(":", 1)[1])

    def connect() -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(b"POST /v1/search HTTP/1.1\r\nHost: x\r\n")
        return sock

    trickle, stalled = connect(), connect()
    stalled.sendall(b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"query\":")
    started = time.monotonic()
    try:
        closed = False
        while time.monotonic() - started < 4 and not closed:
            time.sleep(0.1)
            try:
                trickle.sendall(b"X")  # one more header byte: uvicorn's keep-alive timer restarts on each
                closed = trickle.recv(1, socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed = True
        assert closed and time.monotonic() - started < 2
        answer = b""
        while chunk := stalled.recv(4096):  # the 408 closes the connection: read to the end
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b'"code":"body_timeout"' in answer.replace(b" ", b"")
    finally:
        trickle.close()
        stalled.close()
    with srv.client() as client:  # a normal client is served as before
        assert client.post("/v1/search", json={"query": "q", "method": "local"}).status_code == 200


async def test_a_stream_whose_client_stopped_reading_releases_its_slot():
    """Once the socket buffers are full every write waits on the client: the stream is dropped at
    the search timeout plus a grace, its search cancelled and its slot released."""
    from drift_lance.service.backend import SearchEvent
    from drift_lance.service.errors import ApiError
    from drift_lance.service.sse import SearchEventStream

    finished, searching = asyncio.Event(), asyncio.Event()

    async def run(sink):
        for i in range(100):
            sink(SearchEvent("token", {"text": "x" * 1000, "i": i}))
        searching.set()
        await asyncio.sleep(3600)

    async def send(message):
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()  # the client's window is shut: never drains

    async def receive():
        await asyncio.Event().wait()  # nor does it disconnect

    tasks: list[asyncio.Task] = []
    stream = SearchEventStream(run, timeout=0.3, keepalive=0.1, map_error=lambda e: ApiError(500, "internal", "x"),
                               on_finish=finished.set, track=tasks.append, stall_grace=0.2)
    await asyncio.wait_for(stream({"type": "http"}, receive, send), timeout=5)
    assert finished.is_set() and searching.is_set() and tasks[0].cancelled()


def _wait_settled(client) -> httpx.Response:
    for _ in range(500):
        ready = client.get("/readyz")
        if ready.json()["status"] != "starting":
            return ready
        time.sleep(0.02)
    return ready


@pytest.mark.parametrize("problem", ["missing prompt file", "embedder of another dimension"])
def test_a_setup_that_would_fail_every_search_fails_the_start(service_settings, live_server, tmp_path, problem):
    """Not "ready" and then 4xx on every search for the server's own configuration."""
    from drift_lance.service.engine import EngineBackend
    from drift_lance.testing import HashEmbedder

    if problem == "missing prompt file":
        settings, embedder, named = service_settings.with_updates({"drift.prompt": str(tmp_path / "missing.txt")}), None, "missing.txt"
    else:
        settings, embedder, named = service_settings, HashEmbedder(384), "384-d"
    backend = EngineBackend(settings, chat_model=scripted_drift_model(), embedder=embedder or HashEmbedder(64))
    srv = live_server(create_app(settings, backend=backend), wait_ready=False)
    with srv.client() as client:
        ready = _wait_settled(client)
        search = client.post("/v1/search", json={"query": "q"})
    assert ready.status_code == 503 and ready.json()["status"] == "failed" and named in ready.json()["detail"]
    # what did come up is reported: the store opens with a bad prompt file, not for the wrong embedder
    assert ready.json()["store"] is (problem == "missing prompt file")
    assert search.status_code == 503 and search.json()["error"]["code"] == "not_ready"


def serve_own_sample_index(tmp_path, service_settings, live_server, updates=None):
    """The sample corpus ingested into a database of the test's own (64-d hash vectors), served with
    no periodic reload so the test decides when generations switch. Returns (server, source, db)."""
    import ingest
    from drift_lance.sample.builder import build_sample_index
    from drift_lance.service.engine import EngineBackend
    from drift_lance.testing import HashEmbedder

    source = build_sample_index(tmp_path / "graphrag")
    db = tmp_path / "db"
    ingest.ingest(source, str(db), embedder=HashEmbedder(64), progress=False)
    settings = service_settings.with_updates({"db": str(db), "store.reload_interval_seconds": 0, **(updates or {})})
    backend = EngineBackend(settings, chat_model=scripted_drift_model(), embedder=HashEmbedder(64))
    return live_server(create_app(settings, backend=backend)), source, db


def test_a_vector_index_larger_than_the_index_cache_is_a_warning_at_start(tmp_path, service_settings, live_server, caplog):
    """Every search would re-read index partitions (a 5-bit IVF_RQ at 10^6 x 1536: 985 MB against
    the 512 MiB default): slow, not failed, so the operator hears it once, at start."""
    import ingest
    from drift_lance.config.ingest import IngestConfig
    from drift_lance.sample.builder import build_sample_index
    from drift_lance.service.engine import EngineBackend
    from drift_lance.testing import HashEmbedder

    db = tmp_path / "db"
    ingest.ingest(build_sample_index(tmp_path / "graphrag"), str(db), embedder=HashEmbedder(64),
                  config=IngestConfig(ann_min_rows=1), progress=False)  # an ANN index on every vector table
    for cache_bytes, warned in ((1024, True), (512 * 2**20, False)):
        caplog.clear()
        settings = service_settings.with_updates({"db": str(db), "store.index_cache_bytes": cache_bytes})
        backend = EngineBackend(settings, chat_model=scripted_drift_model(), embedder=HashEmbedder(64))
        with caplog.at_level(logging.WARNING, logger="drift_lance.service"):
            with live_server(create_app(settings, backend=backend)).client() as client:
                assert client.get("/readyz").status_code == 200  # served all the same
        message = "table 'entities': its vector index"
        assert (message in caplog.text) is warned, caplog.text
        if warned:
            assert "is larger than store.index_cache_bytes (0 MiB), so queries re-read partitions" in caplog.text


def test_a_new_generation_the_query_embedder_does_not_fit_is_not_switched_to(tmp_path, service_settings, live_server):
    """Re-ingested with another embedding model: the reload keeps serving the generation it has and
    says why, instead of switching and failing every search."""
    import ingest
    from drift_lance.testing import HashEmbedder

    srv, source, db = serve_own_sample_index(tmp_path, service_settings, live_server)
    ingest.ingest(source, str(db), embedder=HashEmbedder(32), reembed=True, progress=False)
    with srv.client() as client:
        reload = client.post("/v1/admin/reload")
        assert reload.status_code == 503 and _error(reload)["code"] == "reload_failed"
        assert "holds 32-d vectors" in _error(reload)["message"] and "produces 64-d vectors" in _error(reload)["message"]
        assert_as_documented(client.get("/openapi.json").json(), "/v1/admin/reload", "post", reload)
        assert client.get("/v1/index").json()["generation"] == 1
        assert client.get("/readyz").status_code == 200
        assert client.post("/v1/search", json={"query": "Who leads the squad?", "method": "local"}).status_code == 200


def serve_then_ingest_a_partial_copy(tmp_path, service_settings, live_server):
    """The sample served at generation 1, then generation 2 ingested with its new entity data file
    moved to tmp_path / "elsewhere" (a partial copy). Returns (server, db, the moved file's path)."""
    import ingest
    from drift_lance.testing import HashEmbedder

    srv, source, db = serve_own_sample_index(tmp_path, service_settings, live_server)
    data = db / "entities.lance" / "data"
    before = set(data.iterdir())
    ingest.ingest(source, str(db), embedder=HashEmbedder(64), progress=False)
    (written, *_) = sorted(set(data.iterdir()) - before)
    written.rename(tmp_path / "elsewhere")
    return srv, db, written


def test_a_new_generation_with_a_missing_file_is_not_switched_to(tmp_path, service_settings, live_server):
    """A new generation whose entity data file is missing (a partial copy or replication of the
    database) is refused with the table named, the previous generation keeps serving, and once the
    file is there the next reload switches. The metrics show both (what an operator alerts on)."""
    srv, db, written = serve_then_ingest_a_partial_copy(tmp_path, service_settings, live_server)
    with srv.client() as client:
        reload = client.post("/v1/admin/reload")
        assert reload.status_code == 503 and _error(reload)["code"] == "reload_failed"
        assert "table 'entities'" in _error(reload)["message"]
        assert client.get("/v1/index").json()["generation"] == 1
        assert client.post("/v1/search", json={"query": "Who leads the squad?", "method": "local"}).status_code == 200
        failed = scrape(client)
        (tmp_path / "elsewhere").rename(written)
        assert client.post("/v1/admin/reload").json()["switched"] is True
        assert client.get("/v1/index").json()["generation"] == 2
        switched = scrape(client)
    reloads = "drift_lance_index_reloads_total"
    assert failed[(reloads, frozenset({("outcome", "failed")}))] == 1 and failed[("drift_lance_index_generation", frozenset())] == 1
    assert moved(failed, switched, reloads, outcome="switched") == 1 and moved(failed, switched, reloads, outcome="failed") == 0
    assert switched[("drift_lance_index_generation", frozenset())] == 2


def test_a_replica_started_on_a_newest_generation_with_a_missing_file_serves_the_one_before(tmp_path, service_settings,
                                                                                            live_server):
    """Started while the newest generation is a partial copy: it serves the previous generation
    (not "ready" with every search failing), and a reload switches once the file is there."""
    from drift_lance.service.engine import EngineBackend
    from drift_lance.testing import HashEmbedder

    _, db, written = serve_then_ingest_a_partial_copy(tmp_path, service_settings, live_server)
    settings = service_settings.with_updates({"db": str(db), "store.reload_interval_seconds": 0})
    backend = EngineBackend(settings, chat_model=scripted_drift_model(), embedder=HashEmbedder(64))
    replica = live_server(create_app(settings, backend=backend))
    with replica.client() as client:
        assert client.get("/readyz").status_code == 200
        assert client.get("/v1/index").json()["generation"] == 1
        assert client.post("/v1/search", json={"query": "Who leads the squad?", "method": "local"}).status_code == 200
        (tmp_path / "elsewhere").rename(written)
        assert client.post("/v1/admin/reload").json()["switched"] is True



def test_a_replica_whose_start_could_not_read_the_index_turns_ready_once_it_can(tmp_path, service_settings, live_server):
    """Started while its only generation lacks a file (a bucket still being copied, a store that did
    not answer): /readyz says failed and why, and once the file is there the start is tried again at
    the next reload check. It stayed failed until restarted, while /healthz said it was alive."""
    import ingest
    from drift_lance.service.engine import EngineBackend
    from drift_lance.sample.builder import build_sample_index
    from drift_lance.testing import HashEmbedder

    db = tmp_path / "db"
    ingest.ingest(build_sample_index(tmp_path / "graphrag"), str(db), embedder=HashEmbedder(64), progress=False)
    (data_file, *_) = sorted((db / "entities.lance" / "data").iterdir())
    data_file.rename(tmp_path / "elsewhere")
    settings = service_settings.with_updates({"db": str(db), "store.reload_interval_seconds": 0.2})
    backend = EngineBackend(settings, chat_model=scripted_drift_model(), embedder=HashEmbedder(64))
    srv = live_server(create_app(settings, backend=backend), wait_ready=False)
    with srv.client() as client:
        failed = _wait_settled(client)
        assert failed.status_code == 503 and failed.json()["status"] == "failed"
        assert "table 'entities'" in failed.json()["detail"]
        (tmp_path / "elsewhere").rename(data_file)
        srv.wait_ready(timeout=30)
        assert client.post("/v1/search", json={"query": "Who leads the squad?", "method": "local"}).status_code == 200


def test_a_search_on_a_generation_deleted_by_cleanup_switches_and_answers_503(tmp_path, service_settings, live_server):
    """A replica that did not reload while two ingests replaced its generation and the cleanup
    deleted it: the failing search switches the replica to the newest generation and answers 503
    generation_gone with Retry-After, not an opaque 500 on every search until someone reloads."""
    import ingest
    from drift_lance.config.ingest import IngestConfig
    from drift_lance.testing import HashEmbedder

    srv, source, db = serve_own_sample_index(
        tmp_path, service_settings, live_server, {"store.table_cache_bytes": 0, "store.vector_cache_bytes": 0}
    )
    for _ in range(2):  # generation 1, replaced by 2 and not kept: deleted by the third ingest's cleanup
        ingest.ingest(source, str(db), embedder=HashEmbedder(64), config=IngestConfig(keep_replaced_seconds=0), progress=False)
    query = {"query": "Who leads the squad?", "method": "local"}
    with srv.client() as client:
        gone = client.post("/v1/search", json=query)
        assert gone.status_code == 503 and _error(gone)["code"] == "generation_gone"
        assert gone.headers["Retry-After"] == "0"
        assert_as_documented(client.get("/openapi.json").json(), "/v1/search", "post", gone)
        assert "generation 1 was deleted by a later ingest" in _error(gone)["message"]
        assert client.get("/v1/index").json()["generation"] == 3
        assert client.post("/v1/search", json=query).status_code == 200



@pytest.mark.parametrize("ingests", [1, 2], ids=["same generation number", "lower generation number"])
def test_a_database_deleted_and_ingested_anew_is_switched_to(tmp_path, service_settings, live_server, ingests):
    """The database deleted and ingested again from scratch while served: its generations start
    again at 1. The replica switches to it, instead of keeping the generation it had (the newest
    was not newer), which answered searches from its caches or 503 `generation_gone` ("retry")
    for ever."""
    import shutil

    import ingest
    from drift_lance.testing import HashEmbedder

    srv, source, db = serve_own_sample_index(
        tmp_path, service_settings, live_server, {"store.table_cache_bytes": 0, "store.vector_cache_bytes": 0}
    )
    query = {"query": "Who leads the squad?", "method": "local"}
    with srv.client() as client:
        for _ in range(ingests - 1):  # the replica serves generation `ingests`
            ingest.ingest(source, str(db), embedder=HashEmbedder(64), progress=False)
        assert client.post("/v1/admin/reload").json()["generation"] == ingests
        served_at = client.get("/v1/index").json()["ingested_at"]
        shutil.rmtree(db)  # and made anew at once: within the same second, which whole-second times missed
        ingest.ingest(source, str(db), embedder=HashEmbedder(64), progress=False)
        search = client.post("/v1/search", json=query)
        reload = client.post("/v1/admin/reload")
        assert reload.status_code == 200, reload.text
        index = client.get("/v1/index").json()
        assert index["generation"] == 1 and index["ingested_at"] != served_at
        assert client.post("/v1/search", json=query).status_code == 200
    # the search that found its generation gone said so (or was answered): never a retry on the old one
    assert search.status_code == 200 or "now serving generation 1" in _error(search)["message"]


@pytest.mark.parametrize("method", ["drift", "local"])
def test_a_search_without_context_leaves_out_the_context_tables(service_settings, live_server, method):
    srv = start(live_server, service_settings, scripted_drift_model())
    query = {"query": "Who leads the squad?", "method": method, "config": {"drift_k_followups": 2, "n_depth": 1} if method == "drift" else {}}
    with srv.client() as client:
        full = client.post("/v1/search", json=query).json()
        lean_response = client.post("/v1/search", json={**query, "include_context": False})
    lean = lean_response.json()
    assert lean_response.status_code == 200 and full["context_data"] and full["context_text"]
    assert lean["context_data"] == {} and lean["context_text"] == ""
    assert lean["response"] == full["response"] and lean["llm_calls_categories"] == full["llm_calls_categories"]
    assert len(lean_response.content) < len(json.dumps(full)) / 2
    if method == "drift":
        assert lean["state"]["nodes"] and lean["state"] == full["state"]


# ------------------------------------------------------------------------------------------ auth


def test_auth_required_when_api_key_set_from_environment(service_db, live_server, monkeypatch):
    monkeypatch.setenv("DRIFT_LANCE_API_KEY", "s3cret")
    settings = Settings.load(db=str(service_db))
    srv = start(live_server, settings)
    query = {"query": "Who leads the squad?", "method": "local"}
    with srv.client() as client:
        missing = client.post("/v1/search", json=query)
        wrong = client.post("/v1/search", json=query, headers={"Authorization": "Bearer nope"})
        right = client.post("/v1/search", json=query, headers={"Authorization": "Bearer s3cret"})
        index = client.get("/v1/index")
        schema = client.get("/openapi.json")
        stream = client.post("/v1/search/stream", json=query)
        health, ready = client.get("/healthz"), client.get("/readyz")
        # nothing of the request is read before the key is checked: no 422 or 413 tells the body's fate
        bad_json = client.post("/v1/search", content=b"{bad", headers={"content-type": "application/json"})
        huge = client.post("/v1/search", content=b"x" * 200_000, headers={"content-type": "application/json"})
        unknown = client.get("/v1/nothing-here")
        schema_with_key = client.get("/openapi.json", headers={"Authorization": "Bearer s3cret"})
        metrics, metrics_with_key = client.get("/metrics"), client.get("/metrics", headers={"Authorization": "Bearer s3cret"})
    assert metrics.status_code == 401 and metrics_with_key.status_code == 200
    # refused requests are counted: missing, wrong, bad_json, huge
    assert 'drift_lance_http_requests_total{route="/v1/search",status="401"} 4.0' in metrics_with_key.text
    assert bad_json.status_code == huge.status_code == unknown.status_code == 401
    assert schema_with_key.status_code == 200 and "HTTPBearer" in schema_with_key.json()["components"]["securitySchemes"]
    assert missing.status_code == 401 and missing.headers["WWW-Authenticate"] == "Bearer"
    assert missing.json()["error"]["code"] == "unauthorized"
    assert wrong.status_code == 401
    assert right.status_code == 200
    assert index.status_code == 401 and schema.status_code == 401 and stream.status_code == 401
    assert health.status_code == 200 and ready.status_code == 200  # probes stay open


@pytest.mark.parametrize(("configured", "sent"), [("s3cret\n", "s3cret"), (" s3cret\r\n", "s3cret"), ("clé-ünï", "clé-ünï")])
def test_the_configured_api_key_is_accepted_as_a_client_sends_it(service_db, live_server, monkeypatch, configured, sent):
    """A key read from a file ends in a newline no client can send, and a non-ASCII key travels as
    its UTF-8 bytes: with either, every request was refused 401."""
    monkeypatch.setenv("DRIFT_LANCE_API_KEY", configured)
    srv = start(live_server, Settings.load(db=str(service_db)))
    with srv.client() as client:
        right = client.get("/v1/index", headers={"Authorization": f"Bearer {sent}".encode()})
        wrong = client.get("/v1/index", headers={"Authorization": "Bearer s3cre"})
    assert right.status_code == 200, right.text
    assert wrong.status_code == 401

def test_no_auth_when_no_api_key(server):
    with server.client() as client:
        r = client.post("/v1/search", json={"query": "Who leads the squad?", "method": "local"})
    assert r.status_code == 200


# ---------------------------------------------------------------------------------------- limits


def _error(r: httpx.Response) -> dict:
    return r.json()["error"]


def test_body_size_limit(service_settings, live_server):
    settings = service_settings.with_updates({"service.max_body_bytes": 1024})
    srv = start(live_server, settings)
    big = {"query": "x" * 2000}
    with srv.client() as client:
        declared = client.post("/v1/search", json=big)

        def chunks():  # no Content-Length: the limit must hold for chunked bodies too
            yield json.dumps(big).encode()

        chunked = client.post("/v1/search", content=chunks(), headers={"content-type": "application/json"})
    for r in (declared, chunked):
        assert r.status_code == 413
        assert _error(r)["code"] == "body_too_large" and "1024" in _error(r)["message"]


def test_a_body_not_sent_as_json_is_415_saying_so(server):
    body = json.dumps({"query": "Who leads the squad?", "method": "local"})
    with server.client() as client:
        form = client.post("/v1/search", content=body, headers={"content-type": "application/x-www-form-urlencoded"})
        with client.stream("POST", "/v1/search/stream", content=body, headers={"content-type": "text/plain"}) as streamed:
            streamed.read()
        with_charset = client.post("/v1/search", content=body, headers={"content-type": "application/json; charset=utf-8"})
        untyped = client.post("/v1/search", content=body, headers={"content-type": ""})
    for r in (form, streamed, untyped):
        assert r.status_code == 415 and _error(r)["code"] == "unsupported_media_type"
        assert "Content-Type: application/json" in _error(r)["message"]
    assert with_charset.status_code == 200


@pytest.mark.parametrize(
    ("config", "field", "cap"),
    [
        ({"n_depth": 4}, "config.n_depth", "3"),
        ({"drift_k_followups": 21}, "config.drift_k_followups", "20"),
        ({"local_search_max_data_tokens": 16_001}, "config.local_search_max_data_tokens", "16000"),
        ({"reduce_max_tokens": 100_000}, "config.reduce_max_tokens", "16000"),
        ({"primer_folds": 11}, "config.primer_folds", "10"),
        # null is "no limit" for an output cap: it must not lift the server's
        ({"reduce_max_tokens": None}, "config.reduce_max_tokens", "16000"),
        ({"local_search_llm_max_gen_tokens": None}, "config.local_search_llm_max_gen_tokens", "16000"),
    ],
)
def test_config_over_cap_is_422_naming_field_and_cap(server, config, field, cap):
    with server.client() as client:
        r = client.post("/v1/search", json={"query": "q", "config": config})
    assert r.status_code == 422
    err = _error(r)
    assert err["code"] == "over_limit" and err["field"] == field
    assert f"cap of {cap}" in err["message"]


def test_caps_come_from_server_config(service_settings, live_server):
    settings = service_settings.with_updates({"service.caps.n_depth": 1})
    srv = start(live_server, settings)
    with srv.client() as client:
        over = client.post("/v1/search", json={"query": "q", "config": {"n_depth": 2}})
        at = client.post("/v1/search", json={"query": "q", "config": {"n_depth": 1}})
    assert over.status_code == 422 and "cap of 1" in _error(over)["message"]
    assert at.status_code == 200


@pytest.mark.parametrize(
    ("body", "code", "field"),
    [
        ({"query": "q", "config": {"n_depht": 1}}, "unknown_field", "config.n_depht"),
        ({"query": "q", "config": {"prompt": "/etc/passwd"}}, "not_overridable", "config.prompt"),
        ({"query": "q", "config": {"context_concurrency": 100000000}}, "not_overridable", "config.context_concurrency"),
        ({"query": "q", "config": {"n_depth": "deep"}}, "invalid_request", "config.n_depth"),
        ({"query": "q", "config": {"n_depth": "2"}}, "invalid_request", "config.n_depth"),
        ({"query": "q", "config": {"n_depth": True}}, "invalid_request", "config.n_depth"),
        ({"query": "q", "config": {"n_depth": 1.5}}, "invalid_request", "config.n_depth"),
        ({"query": "q", "config": {"n_depth": -1}}, "invalid_request", "config.n_depth"),
        ({"query": "q", "config": {"community_level": -1}}, "invalid_request", "config.community_level"),
        ({"query": "q", "config": {"community_level": 0.5}}, "invalid_request", "config.community_level"),
        ({"query": "q", "config": {"community_level": 2**63}}, "invalid_request", "config.community_level"),
        ({"query": "q", "config": {"seed": 2**63}}, "invalid_request", "config.seed"),
        ({"query": "q", "include_context": "no"}, "invalid_request", "include_context"),
        ({"query": "q", "method": "global"}, "invalid_request", "method"),
        ({"query": "q", "extra": 1}, "unknown_field", "extra"),
        ({"query": "   "}, "invalid_request", "query"),
        ({}, "invalid_request", "query"),
        ([{"query": "q"}], "invalid_request", "body"),  # not an object: the body itself is named
        ("q", "invalid_request", "body"),
        (7, "invalid_request", "body"),
    ],
)
def test_bad_requests_are_422_naming_the_field(server, body, code, field):
    with server.client() as client:
        r = client.post("/v1/search", json=body)
    assert r.status_code == 422, r.text
    assert _error(r)["code"] == code and _error(r)["field"] == field


def test_query_length_limit(service_settings, live_server):
    settings = service_settings.with_updates({"service.max_query_chars": 50})
    srv = start(live_server, settings)
    with srv.client() as client:
        r = client.post("/v1/search/stream", json={"query": "y" * 51})
    assert r.status_code == 422
    assert _error(r)["field"] == "query" and "cap of 50" in _error(r)["message"]


def test_invalid_json_and_unknown_route(server):
    with server.client() as client:
        bad = client.post("/v1/search", content=b"{not json", headers={"content-type": "application/json"})
        missing = client.get("/v1/nothing")
    assert bad.status_code == 422 and _error(bad)["code"] == "invalid_json"
    # not UTF-8, empty, nested deeper than the parser goes
    for body in ('{"query": "Who is é?"}'.encode("latin-1"), b"", b'{"query": "q", "config": ' + b"[" * 5000 + b"]" * 5000 + b"}"):
        with server.client() as client:
            r = client.post("/v1/search", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422 and _error(r)["code"] == "invalid_json", (body[:20], r.text)
    assert missing.status_code == 404 and _error(missing)["code"] == "not_found"


# ------------------------------------------------------------- concurrency, cancellation, timeouts


def _post_in_thread(srv, path: str, body: dict, results: list) -> threading.Thread:
    def run():
        with srv.client(timeout=60) as client:
            results.append(client.post(path, json=body))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_saturated_server_answers_429_with_retry_after(service_settings, live_server):
    settings = service_settings.with_updates({"service.max_concurrent_searches": 1, "service.retry_after_seconds": 7})
    model = GatedChatModel()
    srv = start(live_server, settings, model)
    results: list[httpx.Response] = []
    first = _post_in_thread(srv, "/v1/search", {"query": "first"}, results)
    assert model.started.wait(30), "the first search never reached the model"
    with srv.client() as client:
        busy = client.post("/v1/search", json={"query": "second"})
        busy_stream = client.post("/v1/search/stream", json={"query": "second"})
        document = client.get("/openapi.json").json()
    model.release()
    first.join(60)
    with srv.client() as client:
        after = client.post("/v1/search", json={"query": "third"})
    for r, path in ((busy, "/v1/search"), (busy_stream, "/v1/search/stream")):
        assert r.status_code == 429
        assert r.headers["Retry-After"] == "7" and _error(r)["code"] == "too_many_searches"
        assert_as_documented(document, path, "post", r)
    assert results[0].status_code == 200
    assert after.status_code == 200, "the slot is released after a search"


@pytest.mark.parametrize("ends", ["done", "error", "timeout"])
async def test_a_streamed_search_frees_its_slot_before_the_client_sees_the_stream_end(ends):
    """A client that reads a stream to its end and then starts its next search must find the slot
    free: it was released after the last byte went out, and the next request could arrive first
    (4 callers running one stream at a time got 429s; after a stream's 504 `timeout` event, 5 of 6
    next searches did on a server with one slot, whose timed-out search was cancelled only then)."""
    from drift_lance.drift.result import SearchResult
    from drift_lance.service.errors import ApiError
    from drift_lance.service.sse import SearchEventStream

    released, cancelled = [], []

    async def run(sink):
        if ends == "error":
            raise RuntimeError("the model failed")
        if ends == "timeout":
            try:
                await asyncio.Event().wait()  # a model call that never answers
            except asyncio.CancelledError:
                cancelled.append(True)
                raise
        return SearchResult(response="answer")

    stream = SearchEventStream(
        run, timeout=0.2 if ends == "timeout" else 5, keepalive=1, map_error=lambda exc: ApiError(500, "internal", str(exc)),
        on_finish=lambda: released.append(True), track=lambda task: None,
    )
    seen_at_end, events = [], []

    async def send(message):
        events.append(message.get("body", b""))
        if message["type"] == "http.response.body" and not message.get("more_body"):
            seen_at_end.append(list(released))
            assert cancelled == ([True] if ends == "timeout" else []), "the timed-out search was still running"

    async def receive():
        await asyncio.Event().wait()  # the client stays connected

    await stream({"type": "http"}, receive, send)
    assert seen_at_end == [[True]], "the slot was still held when the stream's end was sent"
    assert released == [True]  # and released once
    assert (b'"code":"timeout"' in b"".join(events)) == (ends == "timeout")



async def test_a_stream_whose_client_left_stops_without_sending_its_backlog():
    """Events a slow client had not taken yet are not written once it has gone, and its search is
    cancelled at once: the stream wrote every queued event to the dead connection first (100k
    answer tokens: seconds of the server's CPU, with the search and its model calls still running,
    and past the shutdown deadline when that was what closed the connection)."""
    from drift_lance.service.errors import ApiError
    from drift_lance.service.events import TokenEvent, search_event
    from drift_lance.service.sse import SearchEventStream

    backlog = asyncio.Event()
    cancelled = []

    async def run(sink):
        for i in range(1000):
            sink(search_event(TokenEvent(text=f"t{i} ")))
        backlog.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    stream = SearchEventStream(
        run, timeout=30, keepalive=30, map_error=lambda exc: ApiError(500, "internal", str(exc)),
        on_finish=lambda: None, track=lambda task: None,
    )
    sent = []

    async def send(message):
        sent.append(message)
        if len(sent) == 1:
            await backlog.wait()  # the client reads nothing while the backlog builds up

    async def receive():
        await backlog.wait()
        return {"type": "http.disconnect"}

    await stream({"type": "http"}, receive, send)
    assert cancelled == [True]
    assert len(sent) < 10, f"{len(sent)} messages written after the client had gone"


def test_client_disconnect_cancels_blocking_search_and_its_llm_calls(service_settings, live_server):
    model = GatedChatModel()
    srv = start(live_server, service_settings, model)
    with srv.client(timeout=httpx.Timeout(30, read=0.5)) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/search", json={"query": "never answered"})
    assert model.wait_cancelled(), "the in-flight model call was not cancelled"
    with srv.client() as client:  # and its slot was released
        assert client.get("/readyz").status_code == 200
        model.release()
        assert client.post("/v1/search", json={"query": "again"}).status_code == 200
        ended = scrape(client)
    assert ended[("drift_lance_searches_finished_total", frozenset({("method", "drift"), ("outcome", "client_closed")}))] == 1


def test_client_disconnect_cancels_streamed_search(service_settings, live_server):
    model = GatedChatModel()
    srv = start(live_server, service_settings, model)
    with srv.client() as client:
        with client.stream("POST", "/v1/search/stream", json={"query": "walk away"}) as r:
            assert r.status_code == 200
            assert model.started.wait(30)
        # leaving the block closes the connection mid-stream
    assert model.wait_cancelled(), "the streamed search's model call was not cancelled"
    with srv.client() as client:
        ended = scrape(client)
    assert ended[("drift_lance_searches_finished_total", frozenset({("method", "drift"), ("outcome", "client_closed")}))] == 1


def test_search_timeout_is_504_and_cancels_the_calls(service_settings, live_server, caplog):
    """A search past its timeout is cancelled and answers 504, and the server log says so under the
    request's id (a hung model left no line at all: the operator could not tell a 504 from a client's
    own timeout)."""
    settings = service_settings.with_updates({"service.search_timeout_seconds": 0.5})
    model = GatedChatModel()
    srv = start(live_server, settings, model)
    with srv.client() as client, caplog.at_level(logging.WARNING, logger="drift_lance.service"):
        blocking = client.post("/v1/search", json={"query": "slow"}, headers={"X-Request-ID": "slow-1"})
        with client.stream("POST", "/v1/search/stream", json={"query": "slow"}, headers={"X-Request-ID": "slow-2"}) as r:
            events = read_sse(r)
        assert_as_documented(client.get("/openapi.json").json(), "/v1/search", "post", blocking)
        ended = scrape(client)
    assert ended[("drift_lance_searches_finished_total", frozenset({("method", "drift"), ("outcome", "timeout")}))] == 2
    assert blocking.status_code == 504 and _error(blocking)["code"] == "timeout"
    assert events[-1][0] == "error" and events[-1][1]["error"]["code"] == "timeout"
    assert model.wait_cancelled()
    timed_out = [r.request_id for r in caplog.records if r.getMessage().startswith("search timed out after 0.5s")]
    assert timed_out == ["slow-1", "slow-2"]


def test_a_stuck_follow_up_does_not_cost_the_answer(service_settings, live_server):
    """One follow-up never answers: the DRIFT time budget (the search timeout unless a request asks
    for less) cuts it off and the search answers 200 from the rest, blocking and streamed."""
    from drift_lance.testing import ScriptedChatModel

    async def answer(messages, params, response_model):
        if response_model is ActionAnswer and messages[-1].content.startswith("Who is involved"):
            await asyncio.Event().wait()  # never answers
        return drift_responder(messages, params, response_model)

    settings = service_settings.with_updates({"service.search_timeout_seconds": 3})
    srv = start(live_server, settings, ScriptedChatModel(answer))
    with srv.client() as client:
        blocking = client.post("/v1/search", json={"query": "stuck", "config": {"time_budget": 1}})
        too_long = client.post("/v1/search", json={"query": "stuck", "config": {"time_budget": 10}})
        with client.stream("POST", "/v1/search/stream", json={"query": "stuck"}) as r:
            events = read_sse(r)
    assert blocking.status_code == 200, blocking.text
    assert blocking.json()["response"] == REDUCE_ANSWER
    errors = [n["metadata"].get("error") for n in blocking.json()["state"]["nodes"]]
    assert errors.count("TimeoutError") == 1
    assert too_long.status_code == 422 and _error(too_long)["field"] == "config.time_budget"
    assert blocking.json()["failures"] == 1 and blocking.json()["failures_categories"]["action"] == 1
    done = [data for name, data in events if name == "done"]
    assert len(done) == 1 and done[0]["failures_categories"]["action"] == 1
    assert "".join(data["text"] for name, data in events if name == "token") == REDUCE_ANSWER


def test_every_response_and_its_log_lines_carry_the_request_id(service_settings, live_server, caplog):
    """A client's usable X-Request-ID is echoed, else one is made; the search's log lines (its
    task included) carry the same id, so an error can be found in the log."""
    from drift_lance.models.base import ModelError
    from drift_lance.testing import ScriptedChatModel

    settings = service_settings.with_updates({"service.api_key": "k"})
    srv = start(live_server, settings, ScriptedChatModel(lambda *a: ModelError("upstream is down")))
    auth = {"Authorization": "Bearer k"}
    with srv.client() as client, caplog.at_level(logging.WARNING):
        chosen = client.post("/v1/search", json={"query": "q"}, headers={**auth, "X-Request-ID": "req-42"})
        made = client.post("/v1/search", json={"query": "q", "method": "local"}, headers=auth)
        odd = client.get("/v1/index", headers={**auth, "X-Request-ID": "has spaces in it"})
        refused = client.get("/v1/index")
    assert chosen.status_code == 502 and chosen.headers["x-request-id"] == "req-42"
    assert len(made.headers["x-request-id"]) == 32 and made.headers["x-request-id"] != odd.headers["x-request-id"]
    assert odd.headers["x-request-id"] != "has spaces in it" and refused.status_code == 401 and refused.headers["x-request-id"]
    failures = [r for r in caplog.records if r.getMessage().startswith("search failed")]
    assert [r.request_id for r in failures] == ["req-42", made.headers["x-request-id"]]
    in_search_task = [r for r in caplog.records if r.getMessage().startswith("HyDE expansion failed")]
    assert [r.request_id for r in in_search_task] == ["req-42"]


def test_a_bugs_500_carries_the_request_id_and_its_log_line_too(service_settings, live_server, caplog, monkeypatch):
    """An exception no handler maps (a bug) answers 500 `internal` in the JSON shape, with the
    request's id, and the traceback in the log carries that id: the client's id leads to the cause."""
    from drift_lance.service.engine import EngineBackend

    def manifest_breaks(self):
        raise RuntimeError("a bug")

    srv = start(live_server, service_settings)
    monkeypatch.setattr(EngineBackend, "manifest", manifest_breaks)
    with srv.client() as client, caplog.at_level(logging.ERROR, logger="drift_lance.service"):
        r = client.get("/v1/index", headers={"X-Request-ID": "bug-1"})
    assert r.status_code == 500 and _error(r)["code"] == "internal" and r.headers["x-request-id"] == "bug-1"
    logged = [record for record in caplog.records if record.exc_info and "a bug" in str(record.exc_info[1])]
    assert [record.request_id for record in logged] == ["bug-1"]


def test_an_index_read_the_store_failed_is_503_not_a_bug(service_settings, live_server, monkeypatch):
    """The object store timing out mid-search (LanceDB's IO error) is a retryable 503, not a 500."""
    from drift_lance.service.engine import EngineBackend

    async def store_times_out(self, *args, **kwargs):
        raise RuntimeError("lance error: LanceError(IO): Generic S3 error: operation timed out, /home/runner/.cargo/x.rs:1")

    monkeypatch.setattr(EngineBackend, "search", store_times_out)
    srv = start(live_server, service_settings)
    with srv.client() as client:
        r = client.post("/v1/search", json={"query": "q", "method": "local"})
        assert_as_documented(client.get("/openapi.json").json(), "/v1/search", "post", r)
    assert r.status_code == 503 and _error(r)["code"] == "store_unavailable" and r.headers["Retry-After"] == "5"
    assert "cargo" not in r.text


def test_a_data_file_deleted_after_start_is_503_store_unavailable(dulce_db_uri, service_settings, live_server, tmp_path):
    """A data file of the index deleted while the service runs (a sync or a hand cleanup): DRIFT's
    first failed follow-up finds it and the search fails naming the table. That is the storage's
    fault, not the request's: a retryable 503 `store_unavailable`, not 400 `bad_index`."""
    import shutil

    from drift_lance.service.engine import EngineBackend
    from drift_lance.testing import HashEmbedder

    copy = tmp_path / "db"
    shutil.copytree(dulce_db_uri, copy)
    settings = service_settings.with_updates({"db": str(copy)})
    srv = live_server(create_app(settings, backend=EngineBackend(settings, chat_model=scripted_drift_model(),
                                                                 embedder=HashEmbedder(3072))))
    with srv.client() as client:
        assert client.get("/readyz").status_code == 200
        (data_file,) = (copy / "text_units.lance" / "data").iterdir()
        data_file.unlink()
        r = client.post("/v1/search", json={"query": "Who leads the Dulce base?"})
    assert r.status_code == 503 and _error(r)["code"] == "store_unavailable" and r.headers["Retry-After"] == "5", r.text


def test_model_failure_is_reported_not_500(service_settings, live_server, caplog):
    from drift_lance.models.base import ModelError
    from drift_lance.models.deadline import LLMTimeoutError
    from drift_lance.testing import ScriptedChatModel

    for failure, kind in ((ModelError("upstream at http://10.0.0.9 is down"), "model error"),
                          (LLMTimeoutError("answer timed out after 30 s (llm_timeout)"), "timed out (llm_timeout)")):
        srv = start(live_server, service_settings, ScriptedChatModel(lambda *a, failure=failure: failure))
        with srv.client() as client, caplog.at_level(logging.WARNING):
            r = client.post("/v1/search", json={"query": "q", "method": "local"})
            assert_as_documented(client.get("/openapi.json").json(), "/v1/search", "post", r)
        assert r.status_code == 502 and _error(r)["message"] == f"the model request failed ({kind}); details are in the server log"
    assert "upstream at http://10.0.0.9 is down" in caplog.text


@pytest.mark.parametrize(
    ("primer_failure", "kind"),
    [("http", "HTTP 401"), ("unreadable", "answer was not the requested JSON")],
)
def test_a_failed_primer_shows_its_kind_not_the_endpoint_or_the_models_output(service_settings, live_server, caplog,
                                                                              primer_failure, kind):
    """Every primer call failing fails the DRIFT search: the client learns what kind of failure
    (from the first call's), not the endpoint, the upstream body or what the model wrote."""
    from drift_lance.drift.action import PrimerFoldAnswer
    from drift_lance.models.base import ModelRequestError
    from drift_lance.testing import ScriptedChatModel

    leak = "chat model 'm' at http://10.1.2.3:8080/v1 failed: HTTP 401: Incorrect API key provided: sk-live-SECRET"

    def answer(messages, params, response_model):
        if response_model is PrimerFoldAnswer:
            return ModelRequestError(leak, status=401) if primer_failure == "http" else "SECRET-PROMPT-ECHO, not JSON"
        return drift_responder(messages, params, response_model)

    srv = start(live_server, service_settings, ScriptedChatModel(answer))
    with srv.client() as client, caplog.at_level(logging.WARNING):
        failed = client.post("/v1/search", json={"query": "q"})
        with client.stream("POST", "/v1/search/stream", json={"query": "q"}) as r:
            events = read_sse(r)
    assert failed.status_code == 502 and _error(failed)["code"] == "model_error"
    assert _error(failed)["message"] == f"the model request failed ({kind}); details are in the server log"
    assert events[-1][0] == "error" and events[-1][1]["error"]["message"] == _error(failed)["message"]
    assert "SECRET" in caplog.text and "primer calls failed" in caplog.text


def test_embedding_endpoint_down_is_a_502_naming_the_cause(service_settings, live_server):
    """The query embedder's request fails (nothing listens on its port): 502 model_error with the
    cause, not a 500 "ExceptionGroup" from its concurrent batches."""
    import socket

    from drift_lance.config.models import ModelSettings
    from drift_lance.models import get_embedder
    from drift_lance.service.engine import EngineBackend
    from fixtures.service import SERVICE_EMBED_DIM

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: connections are refused
    embedder = get_embedder(ModelSettings(embedding_backend="openai", embedding_model="hash-embedder", api_key="x", max_retries=0,
                                          base_url=f"http://127.0.0.1:{port}/v1", embedding_dimension=SERVICE_EMBED_DIM))
    backend = EngineBackend(service_settings, chat_model=scripted_drift_model(), embedder=embedder)
    srv = live_server(create_app(service_settings, backend=backend))
    with srv.client() as client:
        for method in ("drift", "local"):
            r = client.post("/v1/search", json={"query": "q", "method": method})
            assert r.status_code == 502 and _error(r)["code"] == "model_error", r.text
            assert "connection failed" in _error(r)["message"]


# ------------------------------------------------------------------------------- graceful shutdown


def test_shutdown_lets_in_flight_search_finish_within_grace(service_settings, live_server):
    model = GatedChatModel()
    srv = start(live_server, service_settings, model, grace=30)
    results: list[httpx.Response] = []
    thread = _post_in_thread(srv, "/v1/search", {"query": "finish me"}, results)
    assert model.started.wait(30)
    srv.server.should_exit = True  # what SIGTERM does
    model.release()
    thread.join(60)
    srv.thread.join(60)
    assert results and results[0].status_code == 200
    assert results[0].json()["response"] == REDUCE_ANSWER
    assert model.cancelled == 0


def test_a_second_ctrl_c_cancels_in_flight_searches_with_json_answers(service_settings, live_server):
    """Users press Ctrl-C twice. uvicorn's force exit on the second dropped in-flight requests with
    a plain-text 500 and tracebacks; the searches are cancelled instead and answer 503 `cancelled`."""
    import signal

    model = GatedChatModel()
    srv = start(live_server, service_settings, model, grace=30)
    results: list[httpx.Response] = []
    thread = _post_in_thread(srv, "/v1/search", {"query": "never finishes"}, results)
    assert model.started.wait(30)
    srv.server.handle_exit(signal.SIGINT, None)  # the first: stop accepting, let searches finish
    srv.server.handle_exit(signal.SIGINT, None)  # the second: stop waiting for them
    thread.join(60)
    srv.thread.join(60)
    assert results and results[0].status_code == 503 and _error(results[0])["code"] == "cancelled"
    assert model.wait_cancelled() and not srv.server.force_exit


def test_shutdown_cancels_a_hung_reload_after_grace_with_a_json_answer(service_settings, live_server):
    """A reload stuck on the store (an object store that stopped answering) is cancelled with the
    searches past the grace period; its request gets the JSON error, not uvicorn's plain-text 500."""
    backend = make_backend(service_settings)
    started = threading.Event()

    async def hung_reload():
        started.set()
        await asyncio.Event().wait()

    backend.reload = hung_reload
    srv = live_server(create_app(service_settings, backend=backend), grace=1.0)
    results: list[httpx.Response] = []
    thread = _post_in_thread(srv, "/v1/admin/reload", {}, results)
    assert started.wait(30)
    srv.server.should_exit = True
    srv.thread.join(60)
    thread.join(60)
    assert not srv.thread.is_alive(), "server did not stop after its grace period"
    assert results and results[0].status_code == 503 and _error(results[0])["code"] == "cancelled"


def test_shutdown_cancels_searches_still_running_after_grace(service_settings, live_server):
    """Past the grace period the searches are cancelled, and each request still gets its answer:
    the JSON error, or the stream's final `error` event."""
    model = GatedChatModel()
    srv = start(live_server, service_settings, model, grace=1.0)
    with srv.client() as client:
        document = client.get("/openapi.json").json()
    results: dict[str, Any] = {}

    def run_blocking():
        with srv.client(timeout=60) as client:
            results["blocking"] = client.post("/v1/search", json={"query": "too slow"})

    def run_stream():
        with srv.client(timeout=60) as client, client.stream("POST", "/v1/search/stream", json={"query": "too slow"}) as r:
            results["stream"] = read_sse(r)

    threads = [threading.Thread(target=run_blocking), threading.Thread(target=run_stream)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while model.calls_started < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    srv.server.should_exit = True
    srv.thread.join(60)
    for thread in threads:
        thread.join(60)
    assert not srv.thread.is_alive(), "server did not stop after its grace period"
    assert model.cancelled >= 2
    blocking = results["blocking"]
    assert_as_documented(document, "/v1/search", "post", blocking)
    assert blocking.status_code == 503 and _error(blocking) == {
        "code": "cancelled", "message": "search cancelled: server shutting down", "field": None}
    assert results["stream"][-1] == ("error", {"error": {"code": "cancelled", "message": "search cancelled: server shutting down", "field": None}})



class _FloodThenHangModel:
    """Answers like the DRIFT scripted model, but its streamed answer sends `chunks` deltas of
    1 MB and then never ends: more than the socket buffers hold of a client that does not read."""

    def __init__(self, chunks: int = 12):
        self.inner = scripted_drift_model()
        self.model_id = self.inner.model_id
        self.chunks = chunks
        self.flooded = threading.Event()

    async def complete(self, messages, *, params=None, response_model=None):
        return await self.inner.complete(messages, params=params, response_model=response_model)

    def stream(self, messages, *, params=None):
        from drift_lance.models.base import GeneratorStream

        model = self

        class Flood(GeneratorStream):
            async def _run(self):
                for i in range(model.chunks):
                    yield f"{i}" + "x" * 1_000_000
                model.flooded.set()
                await asyncio.Event().wait()

        return Flood()


@pytest.mark.parametrize("signals", [1, 2], ids=["SIGTERM", "Ctrl-C twice"])
def test_shutdown_drops_a_stream_whose_client_stopped_reading_without_a_traceback(service_settings, live_server, signals):
    """A stream whose client stopped reading (a vanished host, a stuck proxy) blocks its writes on
    the full socket. Shutdown cancels its search, then gives up on the connection: left to uvicorn,
    the request task was cancelled at the grace deadline with an "Exception in ASGI application"
    traceback and "timeout graceful shutdown exceeded"."""
    import socket

    import signal

    model = _FloodThenHangModel()
    # Ctrl-C twice: the grace period is not waited for, so it cannot be what ends the stream
    srv = start(live_server, service_settings, model, grace=2.0 if signals == 1 else 600.0)
    uvicorn_log = logging.getLogger("uvicorn.error")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    uvicorn_log.addHandler(handler)
    port = int(srv.base_url.rsplit(":", 1)[1])
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        client.connect(("127.0.0.1", port))
        body = json.dumps({"query": "who is involved?", "method": "local"}).encode()
        client.sendall(b"POST /v1/search/stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # and never reads
        assert model.flooded.wait(30), "the model did not stream its answer"
        for _ in range(signals):
            srv.server.handle_exit(signal.SIGINT if signals == 2 else signal.SIGTERM, None)
        srv.thread.join(60)
    finally:
        uvicorn_log.removeHandler(handler)
        client.close()
    assert not srv.thread.is_alive()
    assert [r.getMessage() for r in records if r.levelno >= logging.ERROR] == []


# ---------------------------------------------------------------------------------------- fuzzing


def test_schema_fuzzing_finds_no_server_errors(service_settings, live_server):
    """Valid and invalid requests generated from the OpenAPI schema (deterministic, bounded):
    every answer is below 500, and every error uses the documented JSON shape."""
    import hypothesis
    import schemathesis
    from hypothesis import HealthCheck, Phase
    from schemathesis import GenerationMode

    app = create_app(service_settings, backend=make_backend(service_settings, scripted_drift_model()))
    srv = live_server(app, settings=service_settings)  # uvicorn as `drift-lance serve` configures it
    schema = schemathesis.openapi.from_dict(app.openapi())
    failures: list[str] = []
    statuses: set[int] = set()
    for result in schema.get_all_operations():
        operation = result.ok()
        has_body = operation.method.upper() == "POST"
        # Routes without parameters or body have no invalid variant to generate.
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_body else (GenerationMode.POSITIVE,):

            @hypothesis.settings(
                max_examples=30 if has_body else 5,
                derandomize=True,
                database=None,
                deadline=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
            def check(case):
                response = case.call(base_url=srv.base_url, timeout=30)
                statuses.add(response.status_code)
                label = f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text[:200]}"
                if response.status_code >= 500:
                    failures.append(label)
                elif response.status_code >= 400 and set(response.json()) != {"error"}:
                    failures.append(f"undocumented error shape: {label}")

            check()
    assert not failures, "\n".join(failures[:5])
    assert {200, 422} <= statuses, "the generated requests should include valid and rejected ones"


# --------------------------------------------------------------------------------------- metrics


def test_metrics_count_searches_outcomes_rejections_and_llm_usage_by_stage(service_settings, live_server):
    """An operator's dashboard and alerts: searches started, ended by outcome, refused with 429,
    degraded, their LLM calls and tokens per stage as the results report them, failed model calls
    by kind, the served generation, reloads, open streams and in-flight searches; every label from
    a fixed set, none carrying what a client sent."""
    from drift_lance.models.base import ModelRequestError

    failing = {"actions": False}

    def answer(messages, params, response_model):
        if any("FAIL-ME" in m.content for m in messages):
            return ModelRequestError("chat model at http://10.1.2.3/v1 failed: timed out", failure="timeout")
        if failing["actions"] and response_model is ActionAnswer:
            return ModelRequestError("chat model failed: HTTP 500", status=500)
        return drift_responder(messages, params, response_model)

    from drift_lance.testing import ScriptedChatModel

    model = GatedChatModel(ScriptedChatModel(answer, model_id="scripted"))
    srv = start(live_server, service_settings.with_updates({"service.max_concurrent_searches": 1}), model)
    queries = ["Who restored the lighthouse?", "Who leads the squad?", "FAIL-ME please", "What happened at the pier?"]
    results = []
    with srv.client() as client:
        before = scrape(client)
        with client.stream("POST", "/v1/search/stream", json={"query": queries[0]}) as stream:
            assert model.started.wait(30), "the streamed search never reached the model"
            during = scrape(client)
            busy = [client.post("/v1/search", json={"query": queries[1]}),
                    client.post("/v1/search/stream", json={"query": queries[1], "method": "local"})]
            model.release()
            results.append(read_sse(stream)[-1][1])
        results.append(client.post("/v1/search", json={"query": queries[1], "method": "local"}).json())
        failed = client.post("/v1/search", json={"query": queries[2], "method": "local"})
        with client.stream("POST", "/v1/search/stream", json={"query": queries[2], "method": "local"}) as stream:
            failed_stream = read_sse(stream)[-1]
        failing["actions"] = True
        degraded = client.post("/v1/search", json={"query": queries[3]}).json()
        results.append(degraded)
        unknown = client.get(f"/v1/{queries[0]}")  # a path the service does not serve counts as `other`
        reload = client.post("/v1/admin/reload")
        client.get("/healthz")  # a request is counted once it is answered: this one need not be yet
        after = scrape(client)
    assert [r.status_code for r in busy] == [429, 429] and failed.status_code == 502 and reload.status_code == 200
    assert failed_stream[0] == "error" and failed_stream[1]["error"]["code"] == "model_error"
    assert unknown.status_code == 404
    answers = {(route, status): moved(before, after, "drift_lance_http_requests_total", route=route, status=status)
               for (name, labelset) in after if name == "drift_lance_http_requests_total"
               for route, status in [(dict(labelset)["route"], dict(labelset)["status"])]}
    assert {answer: count for answer, count in answers.items() if count and answer[0] != "/healthz"} == {
        ("/metrics", "200"): 2, ("/v1/admin/reload", "200"): 1, ("/v1/search/stream", "200"): 2, ("/v1/search/stream", "429"): 1,
        ("/v1/search", "200"): 2, ("/v1/search", "429"): 1, ("/v1/search", "502"): 1, ("other", "404"): 1}
    assert during[("drift_lance_searches_in_flight", frozenset())] == 1
    assert during[("drift_lance_sse_streams_open", frozenset())] == 1
    assert after[("drift_lance_searches_in_flight", frozenset())] == 0
    assert after[("drift_lance_search_slots", frozenset())] == 1
    assert after[("drift_lance_index_generation", frozenset())] == 1
    assert moved(before, after, "drift_lance_index_reloads_total", outcome="unchanged") == 1

    assert moved(before, after, "drift_lance_searches_started_total", method="drift") == 2
    assert moved(before, after, "drift_lance_searches_started_total", method="local") == 3
    assert moved(before, after, "drift_lance_searches_rejected_total", method="drift") == 1
    assert moved(before, after, "drift_lance_searches_rejected_total", method="local") == 1
    assert moved(before, after, "drift_lance_searches_finished_total", method="drift", outcome="ok") == 2
    assert moved(before, after, "drift_lance_searches_finished_total", method="local", outcome="ok") == 1
    assert moved(before, after, "drift_lance_searches_finished_total", method="local", outcome="model_error") == 2
    assert moved(before, after, "drift_lance_model_failures_total", kind="timeout") == 2  # blocking and streamed
    assert moved(before, after, "drift_lance_search_duration_seconds_count", method="drift") == 2
    assert moved(before, after, "drift_lance_search_duration_seconds_count", method="local") == 3
    assert moved(before, after, "drift_lance_search_duration_seconds_bucket", method="drift", le="+Inf") == 2

    assert degraded["failures"] > 0 and degraded["failures_categories"]["action"] > 0
    assert moved(before, after, "drift_lance_searches_degraded_total", method="drift") == 1
    assert moved(before, after, "drift_lance_searches_degraded_total", method="local") == 0
    assert moved(before, after, "drift_lance_search_step_failures_total", method="drift", stage="action") == \
        degraded["failures_categories"]["action"]
    # each failed follow-up's model call, counted by its kind, though the search was answered
    assert moved(before, after, "drift_lance_model_failures_total", kind="status") == degraded["failures_categories"]["action"]
    for name, field in (("llm_calls", "llm_calls_categories"), ("llm_prompt_tokens", "prompt_tokens_categories"),
                        ("llm_output_tokens", "output_tokens_categories")):
        for method, answered in (("drift", [results[0], results[2]]), ("local", [results[1]])):
            expected: dict[str, int] = {}
            for result in answered:
                for stage, count in result[field].items():
                    expected[stage] = expected.get(stage, 0) + count
            assert sum(expected.values()) > 0, (name, method, expected)
            assert {stage: moved(before, after, f"drift_lance_{name}_total", method=method, stage=stage)
                    for stage in expected} == expected

    labels = {(name, key) for (name, labelset) in after for key, _ in labelset if name.startswith("drift_lance_")}
    assert {key for _, key in labels} <= {"method", "outcome", "stage", "kind", "le", "version", "route", "status"}, labels
    values = {value for (_, labelset) in after for _, value in labelset}
    assert not {value for value in values for word in ("lighthouse", "squad", "FAIL-ME", "pier") if word in value}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "python_info"} <= {name for name, _ in after}


def test_metrics_can_be_turned_off(service_settings, live_server):
    srv = start(live_server, service_settings.with_updates({"service.metrics": False}))
    with srv.client() as client:
        assert client.get("/metrics").status_code == 404
        assert "/metrics" not in client.get("/openapi.json").json()["paths"]


def test_metrics_count_the_model_calls_and_tokens_of_searches_that_failed(service_settings, live_server):
    """A DRIFT search whose reduce fails has paid for its HyDE, primer and follow-up calls; it has no
    result to take per-stage counts from, so those calls and tokens are counted under stage
    `failed` (blocking and streamed alike), as the model reported them."""
    from drift_lance.models.base import ModelRequestError
    from drift_lance.testing import ScriptedChatModel

    def answer(messages, params, response_model):
        text = drift_responder(messages, params, response_model)
        return ModelRequestError("chat model failed: HTTP 500", status=500) if text == REDUCE_ANSWER else text

    model = ScriptedChatModel(answer, model_id="scripted")
    srv = start(live_server, service_settings, model)
    with srv.client() as client:
        for path in ("/v1/search", "/v1/search/stream"):
            before, calls_before, usage_before = scrape(client), len(model.calls), model.usage
            failed = client.post(path, json={"query": "Who restored the lighthouse?"})
            after = scrape(client)
            code = failed.json()["error"]["code"] if path == "/v1/search" else read_sse(failed)[-1][1]["error"]["code"]
            assert code == "model_error"
            counted = {name: moved(before, after, f"drift_lance_{name}_total", method="drift", stage="failed")
                       for name in ("llm_calls", "llm_prompt_tokens", "llm_output_tokens")}
            assert counted == {"llm_calls": len(model.calls) - calls_before,  # the failed reduce is a call too
                               "llm_prompt_tokens": model.usage.prompt_tokens - usage_before.prompt_tokens,
                               "llm_output_tokens": model.usage.output_tokens - usage_before.output_tokens}
            assert counted["llm_prompt_tokens"] > 0 and counted["llm_calls"] > 2


@pytest.mark.parametrize(("method", "cause", "code"), [("local", "llm_timeout", "model_error"),
                                                       ("local", "model_timeout", "model_error"),
                                                       ("drift", "search_timeout", "timeout")])
def test_metrics_count_a_call_cut_short_by_a_failed_search(service_settings, live_server, method, cause, code):
    """A search that failed with its last call still running (cut by llm_timeout, or by the search
    timeout's 504), or whose model raised a TimeoutError of its own, counted that call nowhere:
    stage `failed` had one call fewer than the model got (a lone local answer: none at all). It is a
    call without tokens, as a follow-up cut off by the time budget is in an answered search."""
    from drift_lance.testing import ScriptedChatModel

    async def answer(messages, params, response_model):
        reply = drift_responder(messages, params, response_model)
        if reply == REDUCE_ANSWER:  # the DRIFT reduce, local search's answer
            if cause == "model_timeout":
                raise TimeoutError("read timed out")
            await asyncio.sleep(30)
        return reply

    model = ScriptedChatModel(answer, model_id="scripted")
    timeouts = {"llm_timeout": 0.2 if cause == "llm_timeout" else None}
    srv = start(live_server, service_settings.with_updates({
        **{f"{section}.{name}": value for section in ("drift", "local") for name, value in timeouts.items()},
        "service.search_timeout_seconds": 1 if cause == "search_timeout" else 60}), model)
    with srv.client() as client:
        for path in ("/v1/search", "/v1/search/stream"):
            before, calls_before, usage_before = scrape(client), len(model.calls), model.usage
            failed = client.post(path, json={"query": "Who restored the lighthouse?", "method": method})
            after = scrape(client)
            assert (failed.json() if path == "/v1/search" else read_sse(failed)[-1][1])["error"]["code"] == code
            counted = {name: moved(before, after, f"drift_lance_{name}_total", method=method, stage="failed")
                       for name in ("llm_calls", "llm_prompt_tokens", "llm_output_tokens")}
            assert counted == {"llm_calls": len(model.calls) - calls_before,  # the call cut short too
                               "llm_prompt_tokens": model.usage.prompt_tokens - usage_before.prompt_tokens,
                               "llm_output_tokens": model.usage.output_tokens - usage_before.output_tokens}
            assert counted["llm_calls"] >= 1
