"""The FastAPI app: search (blocking and SSE), index manifest, health, readiness, metrics.

Auth: when `service.api_key` (or DRIFT_LANCE_API_KEY) is set, every route except /healthz and
/readyz — including /openapi.json, /metrics and unknown paths — needs `Authorization: Bearer <key>`, checked
before anything of the request is read. Probes stay open because
load balancers and orchestrators call them without credentials; they reveal nothing about the index.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Request, Security
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from prometheus_client import Gauge
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from drift_lance import __version__
from drift_lance.config.drift import DRIFTSearchConfig
from drift_lance.config.local import LocalSearchConfig
from drift_lance.config.service import RequestCaps
from drift_lance.config.settings import Settings
from drift_lance.drift.result import SearchResult
from drift_lance.errors import USER_ERRORS, ConfigError, IndexUnreadableError, StoreError, first_cause
from drift_lance.models.base import EmptyAnswerError, ModelError, ModelRequestError, StructuredOutputError
from drift_lance.models.deadline import LLMTimeoutError
from drift_lance.service.backend import Method, SearchBackend
from drift_lance.service.errors import ApiError, cancelled_by_shutdown, error_responses, install_error_handlers
from drift_lance.service.events import add_stream_events
from drift_lance.service.limits import BodySizeLimit, SearchSlots, overridable_fields, resolve_search_config
from drift_lance.service.metrics import CountRequests, SearchUsage, ServiceMetrics, tallied
from drift_lance.service.request_id import RequestIds, declare_request_ids, install_log_request_ids
from drift_lance.service.sse import SearchEventStream, wait_for_disconnect
from drift_lance.store import Manifest

log = logging.getLogger("drift_lance.service")

OPEN_PATHS = ("/healthz", "/readyz")
ROUTES = (*OPEN_PATHS, "/v1/search", "/v1/search/stream", "/v1/index", "/v1/admin/reload", "/metrics", "/openapi.json")


def _override_properties(model: type[BaseModel], server_only: list[str] | None = None) -> dict[str, Any]:
    """JSON schema of every field of `model` a request may override."""
    schema = model.model_json_schema()["properties"]
    fields = overridable_fields(model, RequestCaps().server_only if server_only is None else server_only)
    return {name: schema[name] for name in sorted(fields)}


def _config_by_method(drift: dict[str, Any] | None = None, local: dict[str, Any] | None = None) -> dict[str, Any]:
    """`config`'s fields per method, for the OpenAPI document: DRIFTSearchConfig's for drift (the
    default method), LocalSearchConfig's for local. The `config` property itself lists the union,
    for clients that do not read `if`/`then`."""

    def config_of(properties: dict[str, Any]) -> dict[str, Any]:
        return {"properties": {"config": {"properties": properties, "additionalProperties": False}}}

    is_local = {"properties": {"method": {"const": "local"}}, "required": ["method"]}
    return {"allOf": [{"if": is_local,
                       "then": config_of(_override_properties(LocalSearchConfig) if local is None else local),
                       "else": config_of(_override_properties(DRIFTSearchConfig) if drift is None else drift)}]}


def _union_properties(*per_method: dict[str, Any]) -> dict[str, Any]:
    """Every method's `config` fields. A field two methods type differently takes either schema:
    the `config` property applies whatever the method, so one method's alone refused values the
    other takes (drift's `community_level` may be null, local's may not)."""
    union: dict[str, Any] = {}
    for properties in per_method:
        for name, schema in properties.items():
            if name in union and union[name] != schema:
                union[name] = {"anyOf": [union[name], schema]}
            else:
                union[name] = schema
    return union


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_config_by_method())

    query: str = Field(..., min_length=1, description="The question. Length is capped by the server.")
    method: Literal["drift", "local"] = Field("drift", description="Search method.")
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="Per-request overrides of numeric/boolean fields of the method's config "
        "(DRIFTSearchConfig fields for drift, LocalSearchConfig fields for local), within the server's "
        "caps; other fields are rejected with 422.",
        json_schema_extra={"properties": _union_properties(_override_properties(DRIFTSearchConfig),
                                                           _override_properties(LocalSearchConfig)),
                           "additionalProperties": False},
    )
    include_context: StrictBool = Field(
        True,
        description="false: leave out `context_data` and `context_text` (for DRIFT, every follow-up's tables: "
        "megabytes on a large index); the answer, usage and action graph stay. Streams never carry them.",
    )


# Responses carry every field: their schemas say so (a generated client types none as optional).
_SENT_IN_FULL = ConfigDict(json_schema_serialization_defaults_required=True)


class Health(BaseModel):
    model_config = _SENT_IN_FULL

    status: Literal["ok"] = "ok"
    version: str = __version__


class ReloadStatus(BaseModel):
    """Result of `POST /v1/admin/reload`."""

    switched: bool
    previous_generation: int
    generation: int = Field(description="manifest generation now served to new searches")
    newest_generation: int = Field(description="newest complete generation in the database")


class ReadyStatus(BaseModel):
    model_config = _SENT_IN_FULL

    status: Literal["ready", "starting", "failed"]
    store: bool
    models: bool
    detail: str = ""


class _ServiceState:
    """Per-app runtime state: the backend, its startup task and the search slots."""

    def __init__(self, settings: Settings, backend: SearchBackend):
        self.settings = settings
        self.backend = backend
        cfg = settings.service
        self.slots = SearchSlots(cfg.max_concurrent_searches, cfg.retry_after_seconds)
        # A request may ask for a shorter DRIFT time budget than the search timeout, not a longer one.
        self.request_caps = cfg.caps.model_copy(update={"fields": {"time_budget": cfg.search_timeout_seconds, **cfg.caps.fields}})
        self.startup: asyncio.Task | None = None
        self.startup_error: str = ""
        self.metrics = ServiceMetrics(generation=self._served_generation, in_flight=lambda: self.slots.in_use,
                                      slots=cfg.max_concurrent_searches)
        # Optional backend hooks, like `reload`.
        if (observe_reloads := getattr(backend, "observe_reloads", None)) is not None:
            observe_reloads(lambda outcome: self.metrics.reloads.labels(outcome).inc())
        if (count_model_failures := getattr(backend, "count_model_failures", None)) is not None:
            count_model_failures(self.metrics.model_failures)

    def _served_generation(self) -> int | None:
        return self.backend.manifest().generation if self.backend.readiness().store else None

    def start_search(self, method: Method) -> float:
        """Take a search slot (429 when none is free), counted; the search's start time."""
        try:
            self.slots.acquire()
        except ApiError:
            self.metrics.rejected.labels(method).inc()
            raise
        self.metrics.started.labels(method).inc()
        return time.perf_counter()

    def ready_status(self) -> ReadyStatus:
        r = self.backend.readiness()
        if self.startup_error:  # what did come up is still reported
            return ReadyStatus(status="failed", store=r.store, models=r.models, detail=self.startup_error)
        return ReadyStatus(status="ready" if r.ready else "starting", store=r.store, models=r.models, detail=r.detail)

    def authorized(self, header: str | None) -> bool:
        """Whether an Authorization header carries the API key (in constant time; always true when
        no key is configured)."""
        key = self.settings.service.api_key
        if key is None:
            return True
        scheme, _, token = (header or "").partition(" ")
        given = token.strip(" \t") if scheme.lower() == "bearer" else ""
        # The header as its bytes (ASGI servers decode it as latin-1), against the key's UTF-8: a
        # non-ASCII key, sent as UTF-8 by curl or httpx, was refused however it was sent.
        return hmac.compare_digest(given.encode("latin-1", "replace"), key.get_secret_value().encode())

    def require_ready(self) -> None:
        status = self.ready_status()
        if status.status != "ready":
            detail = f": {status.detail}" if status.detail else ""
            raise ApiError(
                503, "not_ready", f"service is {status.status}{detail}",
                headers={"Retry-After": str(self.settings.service.retry_after_seconds)},
            )


def create_app(settings: Settings, *, backend: SearchBackend | None = None) -> FastAPI:
    """The HTTP app for `settings`. Without `backend`, the real engine on `settings.db` is used."""
    if backend is None:
        from drift_lance.service.engine import EngineBackend

        backend = EngineBackend(settings)
    state = _ServiceState(settings, backend)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.startup = asyncio.create_task(_start_backend(state))
        try:
            yield
        finally:
            # uvicorn has already waited up to its graceful-shutdown timeout for open requests.
            state.startup.cancel()
            await state.slots.cancel_all()
            await asyncio.gather(state.startup, return_exceptions=True)
            await backend.close()

    app = FastAPI(
        title="drift-lance",
        version=__version__,
        description="GraphRAG DRIFT and local search over a LanceDB index.",
        lifespan=lifespan,
        openapi_url=None,  # served below, behind the API key when one is set
        docs_url=None,
        redoc_url=None,
    )
    app.state.service = state
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.service.max_body_bytes,
                       read_timeout=settings.service.request_read_timeout_seconds)
    app.add_middleware(_RequireApiKey, state=state)  # before any body is read
    install_log_request_ids()
    app.add_middleware(RequestIds)  # every response, a 401 too, carries its id
    app.add_middleware(CountRequests, metrics=state.metrics, routes=ROUTES)  # outermost: a bug's 500 counted too

    declare_auth = [Security(_bearer)]  # the OpenAPI security scheme; _RequireApiKey enforces it
    app.include_router(_probe_routes(state))
    app.include_router(_api_routes(state), dependencies=declare_auth)
    app.include_router(_admin_routes(state), dependencies=declare_auth)
    if settings.service.metrics:
        app.include_router(_metrics_routes(state), dependencies=declare_auth)

    generate_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:  # FastAPI caches the document it generates: add to it once
            document = generate_openapi()
            add_stream_events(document, "/v1/search/stream")
            declare_request_ids(document)
            _describe_served_requests(document["components"]["schemas"]["SearchRequest"], state)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_schema() -> JSONResponse:
        return JSONResponse(app.openapi())

    return app


def _describe_served_requests(request: dict[str, Any], state: _ServiceState) -> None:
    """Make the SearchRequest schema the one this server applies, so a client generated or
    validating from the document sends what the server takes: a query that is not blank, at most
    its `max_query_chars` long; per `config` field its cap as maximum (null, "no limit", is past a cap, so not
    offered), the server's refusal of negative numbers, the value it uses when the field is left
    out as default, and its `server_only` fields left out."""
    request["properties"]["query"].update(maxLength=state.settings.service.max_query_chars, pattern=r"\S")  # not blank
    served = {method: _served_properties(state, method) for method in ("drift", "local")}
    request["properties"]["config"]["properties"] = _union_properties(served["drift"], served["local"])
    request.update(_config_by_method(served["drift"], served["local"]))


def _served_properties(state: _ServiceState, method: Method) -> dict[str, Any]:
    caps = state.request_caps
    base = _served_defaults(state, method)
    model = DRIFTSearchConfig if method == "drift" else LocalSearchConfig
    return {name: _served_field(schema, caps.cap_for(name), base[name])
            for name, schema in _override_properties(model, caps.server_only).items()}


def _served_defaults(state: _ServiceState, method: Method) -> dict[str, Any]:
    """What a search of `method` uses for each field a request leaves out."""
    base = state.backend.base_config(method).model_dump(mode="json")
    if method == "drift":
        base["time_budget"] = _drift_time_budget(base["time_budget"], state.settings.service.search_timeout_seconds)
    return base


def _served_field(schema: dict[str, Any], cap: float | None, default: Any) -> dict[str, Any]:
    served = {key: value for key, value in schema.items() if key != "anyOf"}
    if "anyOf" in schema:
        kinds = [kind for kind in schema["anyOf"] if cap is None or kind.get("type") != "null"]
        kinds = [_within_cap(kind, cap) for kind in kinds]
        served.update(kinds[0] if len(kinds) == 1 else {"anyOf": kinds})
    else:
        served = _within_cap(served, cap)
    if default is None and cap is not None:
        # The server's own "no limit", which a request cannot ask for past a cap: no valid default.
        served.pop("default", None)
        served["description"] = f"{served.get('description', '')} Left out: no limit.".strip()
    else:
        served["default"] = default
    return served


def _within_cap(kind: dict[str, Any], cap: float | None) -> dict[str, Any]:
    """A numeric schema bounded as `resolve_search_config` bounds it: at least 0, at most `cap`."""
    if kind.get("type") not in ("integer", "number"):
        return kind
    kind = dict(kind)
    if "minimum" not in kind and "exclusiveMinimum" not in kind:
        kind["minimum"] = 0
    if cap is not None:
        cap = int(cap) if float(cap).is_integer() else cap
        kind["maximum"] = min(kind.get("maximum", cap), cap)
    return kind


def _drift_time_budget(requested: float | None, search_timeout: float) -> float:
    """A DRIFT search's time budget: the one asked for within the search timeout, which is also the
    budget of a search that asks for none."""
    return min(requested or search_timeout, search_timeout)


async def _start_backend(state: _ServiceState) -> None:
    """Start the backend. A start that failed reading the index (a file of a bucket still being
    copied, an object store that did not answer) is tried again at every reload check, so the
    replica turns ready once the index can be read instead of staying failed until restarted; the
    server's own configuration (prompt files, models, a query embedder that does not fit) is not."""
    settings = state.settings
    retry_seconds = settings.store.reload_interval_seconds or settings.service.retry_after_seconds
    while True:
        try:
            await state.backend.start()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported by /readyz, the server keeps running
            state.startup_error = " ".join(f"{type(exc).__name__}: {exc}".split())
            if not _is_index_read_failure(exc):
                log.error("search backend failed to start: %s", state.startup_error)
                return
            log.error("search backend failed to start: %s; trying again in %gs", state.startup_error, retry_seconds)
            await asyncio.sleep(retry_seconds)
        else:
            if state.startup_error:
                log.info("search backend started")
            state.startup_error = ""
            return


def _is_index_read_failure(exc: BaseException) -> bool:
    exc = first_cause(exc)
    return isinstance(exc, StoreError) or _is_store_io_failure(exc)


_bearer = HTTPBearer(auto_error=False, description="API key, when the server has one configured")


class _RequireApiKey:
    """ASGI middleware: every route but the probes needs the API key, checked before anything reads
    the request (as a route dependency it ran after FastAPI had parsed the body, so a client without
    the key got 422 invalid_json for a bad body instead of 401)."""

    def __init__(self, app: Any, state: _ServiceState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)
            if not self.state.authorized(header):
                refusal = ApiError(401, "unauthorized", "missing or wrong API key (Authorization: Bearer <key>)",
                                   headers={"WWW-Authenticate": "Bearer"})
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _probe_routes(state: _ServiceState) -> APIRouter:
    router = APIRouter(tags=["health"])

    @router.get("/healthz", response_model=Health, summary="Liveness: the process answers", operation_id="healthz")
    async def healthz() -> Health:
        return Health()

    @router.get(
        "/readyz",
        operation_id="readyz",
        response_model=ReadyStatus,
        summary="Readiness: store opened and models loaded",
        responses={503: {"model": ReadyStatus, "description": "Still starting, or startup failed"}},
    )
    async def readyz(request: Request) -> JSONResponse:
        status = state.ready_status()
        if not state.authorized(request.headers.get("authorization")):
            status.detail = ""  # why setup failed (paths, endpoints) is for the operator: log or authenticated
        return JSONResponse(status.model_dump(), status_code=200 if status.status == "ready" else 503)

    # HEAD probes (some load balancers send them); kept out of the schema, which has the GETs.
    router.add_api_route("/healthz", healthz, methods=["HEAD"], include_in_schema=False)
    router.add_api_route("/readyz", readyz, methods=["HEAD"], include_in_schema=False)
    return router


async def _json_body(request: Request) -> None:
    """A search body is JSON. `curl -d` sends application/x-www-form-urlencoded, which the body model
    would report as "Input should be a valid dictionary"; say what is wrong instead."""
    kind = request.headers.get("content-type", "")
    media = kind.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):  # a missing type too
        raise ApiError(
            415, "unsupported_media_type",
            f"send the request body as JSON with Content-Type: application/json (got {kind!r}; "
            "curl: -H 'Content-Type: application/json' or --json)",
        )


def _api_routes(state: _ServiceState) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["search"])
    cfg = state.settings.service

    @router.get("/index", summary="Manifest of the served index", response_model=Manifest, operation_id="get_index",
                responses=error_responses(401, 503))
    async def index() -> JSONResponse:
        state.require_ready()
        return JSONResponse(state.backend.manifest().model_dump(mode="json"))

    @router.post(
        "/search",
        operation_id="search",
        response_model=SearchResult,
        summary="Run a search and return the full result",
        responses=error_responses(400, 401, 408, 413, 415, 422, 429, 500, 502, 503, 504, codes={503: (
            "`not_ready`: store or models not ready yet; `cancelled`: the server shut down; `generation_gone`: the "
            "generation searched was deleted, the replica has switched (retry); `store_unavailable`: the object "
            "store or disk failed a read (retry after Retry-After)")}),
        dependencies=[Depends(_json_body)],
    )
    async def search(body: SearchRequest, request: Request) -> Response:
        method, config = _validated(state, body)
        started = state.start_search(method)
        outcome, result = "cancelled", None  # what a cancelled request (shutdown) ends as
        usage = SearchUsage()
        try:
            task = asyncio.create_task(tallied(lambda: state.backend.search(body.query, method, config), usage))
            state.slots.track(task)
            result = await _await_unless_disconnected(task, request, cfg.search_timeout_seconds)
            outcome = "ok"
        except ApiError as exc:
            outcome = exc.code
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a JSON error
            mapped = _map_search_error(exc)
            outcome = mapped.code
            raise mapped from exc
        finally:
            state.slots.release()
            state.metrics.search_ended(method, started, outcome, result, usage)
        if not body.include_context:
            result = result.model_copy(update={"context_data": {}, "context_text": ""})
        return JSONResponse(_public_result(result.model_dump(mode="json")))

    @router.post(
        "/search/stream",
        operation_id="search_stream",
        summary="Run a search, streaming progress as Server-Sent Events",
        description="Events, in order: `primer` (DRIFT primer done), `action` (one per completed "
        "follow-up action), `token` (answer tokens), then `done` (per-stage LLM calls and tokens, "
        "equal to the blocking result's) or `error` ({\"error\": {code, message}}). Each event's data "
        "is one JSON line; its schema, by event name, is under `x-sse-events` of this response.",
        responses={
            200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}, "description": "SSE stream"},
            **error_responses(401, 408, 413, 415, 422, 429, 503),
        },
        response_class=Response,
        dependencies=[Depends(_json_body)],
    )
    async def search_stream(body: SearchRequest) -> Response:
        method, config = _validated(state, body)
        started = state.start_search(method)
        usage = SearchUsage()
        stream = SearchEventStream(
            lambda sink: tallied(lambda: state.backend.search(body.query, method, config, sink), usage),
            timeout=cfg.search_timeout_seconds,
            keepalive=cfg.sse_keepalive_seconds,
            map_error=_map_search_error,
            on_finish=state.slots.release,
            track=state.slots.track,
            on_end=lambda outcome, result: state.metrics.search_ended(method, started, outcome, result, usage),
        )
        return _AsgiResponse(stream, open_streams=state.metrics.streams_open)

    return router


def _admin_routes(state: _ServiceState) -> APIRouter:
    router = APIRouter(prefix="/v1/admin", tags=["admin"])

    @router.post(
        "/reload",
        operation_id="reload_index",
        response_model=ReloadStatus,
        summary="Switch to the newest ingested generation now",
        description="Reads the index's manifest table; when a newer complete generation exists, opens it "
        "and serves new searches from it. Searches already running finish on the generation they started "
        "with. The service also checks on its own every `store.reload_interval_seconds`.",
        responses=error_responses(401, 503, codes={503: (
            "`not_ready`: store or models not ready yet; `reload_failed`: the newest generation cannot be served, "
            "the previous one still is; `cancelled`: the server shut down")}),
    )
    async def reload() -> ReloadStatus:
        state.require_ready()
        reload_backend = getattr(state.backend, "reload", None)
        if reload_backend is None:
            raise ApiError(501, "not_supported", "this search backend cannot reload its index")
        # A task shutdown can cancel past its grace period, as it does searches: the request then
        # still answers in the JSON error shape (uvicorn's own cancellation gives a plain-text 500).
        task = asyncio.create_task(reload_backend())
        state.slots.track(task)
        try:
            await asyncio.wait({task})
        finally:
            if not task.done():  # this request itself was cancelled
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise cancelled_by_shutdown("reload", "the previous generation was still served")
        exc = task.exception()
        if exc is not None:  # the old generation keeps serving
            message = " ".join(str(exc).split()) or type(exc).__name__
            log.warning("reload failed: %s", message)
            raise ApiError(503, "reload_failed", f"still serving the previous generation: {message}") from exc
        result = task.result()
        return ReloadStatus(
            switched=result.switched,
            previous_generation=result.previous_generation,
            generation=result.generation,
            newest_generation=result.newest_generation,
        )

    return router


def _metrics_routes(state: _ServiceState) -> APIRouter:
    router = APIRouter(tags=["metrics"])

    @router.get(
        "/metrics",
        operation_id="metrics",
        summary="Prometheus metrics",
        description="Searches, their outcomes, durations, LLM calls and tokens per stage, the served index "
        "generation, reloads, open streams and the process's own metrics, in Prometheus' text format (or "
        "OpenMetrics when the Accept header asks for it). Needs the API key when one is set.",
        response_class=Response,  # the 200 is text, its errors JSON
        responses={200: {"content": {kind: {"schema": {"type": "string"}}
                                     for kind in ("text/plain", "application/openmetrics-text")},
                         "description": "The metrics"},
                   **error_responses(401)},
    )
    async def metrics(request: Request) -> Response:
        body, content_type = state.metrics.exposition(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    return router


class _AsgiResponse(Response):
    """Lets a route return a raw ASGI app (the SSE stream) as its response; `open_streams` counts
    the ones being sent."""

    def __init__(self, app: SearchEventStream, open_streams: Gauge):
        super().__init__(media_type=app.media_type)
        self._app = app
        self._open_streams = open_streams

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        with self._open_streams.track_inprogress():
            await self._app(scope, receive, send)


def _validated(state: _ServiceState, body: SearchRequest) -> tuple[Method, Any]:
    cfg = state.settings.service
    if not body.query.strip():
        raise ApiError(422, "invalid_request", "query: must not be blank", field="query")
    try:
        body.query.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from a \ud800-style JSON escape
        raise ApiError(422, "invalid_request", "query: not valid Unicode text", field="query") from None
    if len(body.query) > cfg.max_query_chars:
        raise ApiError(
            422, "over_limit",
            f"query: {len(body.query)} characters exceeds this server's cap of {cfg.max_query_chars}",
            field="query",
        )
    state.require_ready()
    config = resolve_search_config(state.backend.base_config(body.method), body.config, state.request_caps)
    if body.method == "drift":
        config = config.model_copy(update={"time_budget": _drift_time_budget(config.time_budget, cfg.search_timeout_seconds)})
    return body.method, config


async def _await_unless_disconnected(task: asyncio.Task, request: Request, timeout: float) -> Any:
    """The task's result; cancels it if the client disconnects or the timeout passes."""
    gone = asyncio.create_task(wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            if task.cancelled():  # by the server's shutdown, past its grace period
                raise cancelled_by_shutdown("search")
            return task.result()
        if gone in done:
            log.info("client disconnected; cancelling its search")
            raise ApiError(499, "client_closed", "client closed the connection")
        log.warning("search timed out after %gs; cancelling it and its model calls", timeout)
        raise ApiError(504, "timeout", f"search exceeded {timeout:g}s")
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)


def _map_search_error(exc: BaseException) -> ApiError:
    exc = first_cause(exc)
    if isinstance(exc, ApiError):
        return exc
    message = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, ConfigError):
        return ApiError(422, "invalid_config", message)
    if isinstance(exc, USER_ERRORS) and not isinstance(exc, IndexUnreadableError):
        return ApiError(400, "bad_index", message)
    if isinstance(exc, ModelError):
        # The full text can name the model's endpoint, quote its error body or its raw output: the
        # operator's log only.
        log.warning("search failed: %s", message)
        return ApiError(502, "model_error", f"the model request failed ({_model_failure(exc)}); details are in the server log")
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return ApiError(504, "timeout", message)
    if isinstance(exc, IndexUnreadableError) or _is_store_io_failure(exc):
        # the bucket or disk (a file gone or cut since the start: not the request, not a bug): worth
        # a retry once it is restored, and said so
        log.warning("search failed reading the index: %s", message)
        return ApiError(503, "store_unavailable", "the index could not be read (object store or disk); details are in "
                        "the server log", headers={"Retry-After": "5"})
    log.error("search failed", exc_info=exc)
    return ApiError(500, "internal", f"search failed: {type(exc).__name__}")


_FAILURE_WORDS = {"timeout": "timed out", "connection": "connection failed", "malformed": "malformed response",
                  "too_large": "response too large"}


def _is_store_io_failure(exc: BaseException) -> bool:
    """LanceDB reports a read that the object store or the disk failed (a timeout, a dropped
    connection, a missing object) as a RuntimeError or OSError whose text names its IO error."""
    text = str(exc)
    return isinstance(exc, (RuntimeError, OSError)) and ("LanceError(IO)" in text or "object_store" in text)


def _model_failure(exc: BaseException) -> str:
    """The kind of a model failure (its own or its first cause's), for a client."""
    while exc is not None:
        if isinstance(exc, ModelRequestError):
            return _request_failure(exc)
        if isinstance(exc, StructuredOutputError):
            return "answer was not the requested JSON"
        if isinstance(exc, EmptyAnswerError):
            return "empty answer"
        if isinstance(exc, LLMTimeoutError):
            return "timed out (llm_timeout)"
        exc = exc.__cause__  # type: ignore[assignment]
    return "model error"


def _request_failure(exc: ModelRequestError) -> str:
    """What went wrong with a model request, without the endpoint or the upstream body."""
    if exc.status is not None:
        return f"HTTP {exc.status}"
    return _FAILURE_WORDS.get(exc.failure, "no response")


def _public_result(result: dict[str, Any]) -> dict[str, Any]:
    """A search result for a client: a failed action's error keeps its type, not its text (which can
    name the model's endpoint, quote its error body or a server file path; the log has it)."""
    state = result.get("state")
    for node in state.get("nodes", ()) if isinstance(state, dict) else ():
        metadata = node.get("metadata") or {}
        if isinstance(metadata.get("error"), str):
            metadata["error"] = metadata["error"].split(":", 1)[0]
    return result
