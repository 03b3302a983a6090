"""Request ids: every response carries `X-Request-ID` (the client's, when it sent a usable one, else
a new one), and every log record written while the request is served carries it as `request_id`,
so an operator can match a client's error to the server log lines behind it. The search task a
request starts inherits the id (asyncio copies the context into the tasks it creates)."""

from __future__ import annotations

import contextvars
import logging
import re
import uuid
from typing import Any

from drift_lance.service.errors import internal_error

__all__ = ["HEADER", "RequestIds", "current_request_id", "declare_request_ids", "install_log_request_ids", "new_request_id"]

HEADER = "x-request-id"
_NO_REQUEST = "-"
# What a client may choose: short, printable, no spaces (it is echoed in a header and in logs).
_USABLE = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
_current: contextvars.ContextVar[str] = contextvars.ContextVar("drift_lance_request_id", default=_NO_REQUEST)
_installed = False
log = logging.getLogger("drift_lance.service")


def current_request_id() -> str:
    """The id of the request being served on this task, or "-" outside a request."""
    return _current.get()


def new_request_id() -> str:
    """An id for a request whose client sent no usable one."""
    return uuid.uuid4().hex


def install_log_request_ids() -> None:
    """Give every log record a `request_id` attribute (for a format with `%(request_id)s`).
    Idempotent; wraps whatever record factory is installed."""
    global _installed
    if _installed:
        return
    make_record = logging.getLogRecordFactory()

    def record_with_request_id(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        record.request_id = _current.get()
        return record

    logging.setLogRecordFactory(record_with_request_id)
    _installed = True


class RequestIds:
    """ASGI middleware: picks the request's id, serves the request with it set, and adds it to the
    response headers."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == HEADER.encode()), "")
        request_id = sent if _USABLE.fullmatch(sent) else new_request_id()
        token = _current.set(request_id)
        started = False

        async def send_with_id(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", ()), (HEADER.encode(), request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if started:
                raise
            # A bug's 500 is answered here, with the id set: Starlette's own error middleware runs
            # outside this one, so its answer had no X-Request-ID and its log line no request id.
            log.exception("unhandled error in request")
            await internal_error(exc).response()(scope, receive, send_with_id)
        finally:
            _current.reset(token)


def declare_request_ids(openapi: dict[str, Any]) -> None:
    """Name the header in `openapi`: an optional request parameter of every operation and a header
    of each of its responses, so a generated client can send its own id and read the one answered."""
    parameter = {
        "name": "X-Request-ID", "in": "header", "required": False, "schema": {"type": "string"},
        "description": "Your id for this request (up to 128 of A-Za-z0-9._:/+=-), echoed in the response and the "
                       "server log; any other value is replaced by a new id.",
    }
    header = {"description": "The request's id: the one sent, or a new one", "schema": {"type": "string"}}
    for operations in openapi.get("paths", {}).values():
        for operation in operations.values():
            operation.setdefault("parameters", []).append(parameter)
            for response in operation.get("responses", {}).values():
                response.setdefault("headers", {})["X-Request-ID"] = header
