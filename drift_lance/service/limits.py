"""Request limits: body size, per-request config overrides within caps, and the concurrency bound."""

from __future__ import annotations

import asyncio
import json
import typing
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from drift_lance.config.service import RequestCaps
from drift_lance.config.settings import union_members
from drift_lance.service.errors import ApiError, validation_error

_NUMERIC = (int, float, bool)


def overridable_fields(model: type[BaseModel], server_only: typing.Iterable[str] = ()) -> set[str]:
    """Fields a request may override: plain numbers and booleans only, minus `server_only`. Strings
    (prompt files, model ids, paths) stay server-side, so a request can never make the server read
    a file it names."""
    allowed = set()
    for name, info in model.model_fields.items():
        kinds = [a for a in union_members(info.annotation) if a is not type(None)]
        if kinds and all(k in _NUMERIC for k in kinds):
            allowed.add(name)
    return allowed - set(server_only)


def resolve_search_config(base: BaseModel, overrides: dict[str, Any], caps: RequestCaps) -> BaseModel:
    """`base` with a request's `config` overrides applied, validated, and checked against `caps`.
    Raises ApiError 422 naming `config.<field>` for an unknown, non-overridable, invalid or capped field."""
    model = type(base)
    allowed = overridable_fields(model, caps.server_only)
    for key in overrides:
        if key not in model.model_fields:
            raise ApiError(422, "unknown_field", f"config.{key}: unknown {model.__name__} field", field=f"config.{key}")
        if key not in allowed:
            raise ApiError(
                422, "not_overridable", f"config.{key}: cannot be set per request (server-side only)", field=f"config.{key}"
            )
    for key, value in overrides.items():
        _check_json_type(key, value, model.model_fields[key].annotation)
    try:
        merged = model.model_validate({**base.model_dump(), **overrides})
    except ValidationError as exc:
        raise validation_error(exc.errors(), prefix="config") from None
    for key in overrides:
        _check_cap(key, getattr(merged, key), caps)
    return merged


def _check_json_type(key: str, value: Any, annotation: Any) -> None:
    """JSON types as the field declares them: pydantic's lax mode would take "2" or true for
    n_depth, and a client sending those has a bug worth hearing about."""
    kinds = set(union_members(annotation))
    if value is None and type(None) in kinds:
        return
    if isinstance(value, bool):
        ok = bool in kinds
    elif isinstance(value, int | float):
        ok = (int in kinds and (isinstance(value, int) or float(value).is_integer())) or float in kinds
    else:
        ok = False
    if not ok:
        wanted = " or ".join(sorted({"bool": "true/false", "int": "an integer", "float": "a number", "NoneType": "null"}[k.__name__]
                                    for k in kinds if k.__name__ in ("bool", "int", "float", "NoneType")))
        raise ApiError(422, "invalid_request", f"config.{key}: expected {wanted}, got {json.dumps(value)}", field=f"config.{key}")


def _check_cap(key: str, value: Any, caps: RequestCaps) -> None:
    if isinstance(value, bool):
        return
    if value is not None and value < 0:
        raise ApiError(422, "invalid_request", f"config.{key}: must be >= 0, got {value}", field=f"config.{key}")
    cap = caps.cap_for(key)
    # null means "no limit" (a model's own output cap): past any cap
    if cap is not None and (value is None or value > cap):
        shown = int(cap) if float(cap).is_integer() else cap
        asked = "null (no limit)" if value is None else value
        raise ApiError(
            422, "over_limit", f"config.{key}: {asked} exceeds this server's cap of {shown}", field=f"config.{key}"
        )


class SearchSlots:
    """At most `limit` searches at once; a request beyond that is refused at once (429), never queued,
    so a saturated server answers fast and clients back off. Also tracks the running search (and
    reload) tasks so shutdown can cancel stragglers."""

    def __init__(self, limit: int, retry_after_seconds: int):
        self.limit = limit
        self.retry_after_seconds = retry_after_seconds
        self.tasks: set[asyncio.Task] = set()
        self._in_use = 0

    @property
    def in_use(self) -> int:
        return self._in_use

    def acquire(self) -> None:
        if self._in_use >= self.limit:
            raise ApiError(
                429,
                "too_many_searches",
                f"{self.limit} searches already running; retry in {self.retry_after_seconds}s",
                headers={"Retry-After": str(self.retry_after_seconds)},
            )
        self._in_use += 1

    def release(self) -> None:
        self._in_use -= 1

    def track(self, task: asyncio.Task) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def cancel_all(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)


class BodySizeLimit:
    """ASGI middleware: refuse bodies over `max_bytes` with 413, and bodies still arriving after
    `read_timeout` seconds with 408, before any handler parses them. Buffers the (small, bounded)
    body and replays it, then passes later `receive` calls through so handlers still see the
    client's disconnect."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout: float = 10.0):
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, self._too_large())
            return
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.read_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_bytes:
                        await self._refuse(send, self._too_large())
                        return
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await self._refuse(send, ApiError(408, "body_timeout", f"request body not received within {self.read_timeout:g}s", field="body"))
            return
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self) -> ApiError:
        return ApiError(413, "body_too_large", f"request body exceeds {self.max_bytes} bytes", field="body")

    async def _refuse(self, send: Send, err: ApiError) -> None:
        headers, body = err.closing_response()
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
