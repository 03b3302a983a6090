"""Run the app on uvicorn with the service's shutdown policy."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from drift_lance.config.settings import Settings
from drift_lance.service.backend import SearchBackend
from drift_lance.service.errors import ApiError
from drift_lance.service.request_id import HEADER, new_request_id

log = logging.getLogger("drift_lance.service")


def build_server(settings: Settings, *, app: FastAPI | None = None, backend: SearchBackend | None = None) -> uvicorn.Server:
    """A uvicorn Server for `settings.service`. On SIGINT/SIGTERM it stops accepting connections,
    lets in-flight searches finish for `shutdown_grace_seconds`, then cancels the rest (their LLM
    calls with them)."""
    from drift_lance.service.app import create_app

    cfg = settings.service
    config = uvicorn.Config(
        app or create_app(settings, backend=backend),
        host=cfg.host,
        port=cfg.port,
        timeout_graceful_shutdown=cfg.shutdown_grace_seconds,
        log_level="info",
        use_colors=_log_colours(),
        access_log=False,
        # Clients' requests must be bounded too: headers and idle keep-alive connections.
        timeout_keep_alive=5,
        h11_max_incomplete_event_size=64 * 1024,
        http=_service_protocol(cfg.request_read_timeout_seconds),
    )
    return ServiceServer(config)


def _log_colours() -> bool:
    """Colour uvicorn's log lines only on a terminal, and not under NO_COLOR (no-color.org). uvicorn's
    own choice looks at stdout while it writes to stderr: `serve 2>server.log` from a terminal filled
    the log with escape codes."""
    return sys.stderr.isatty() and not os.environ.get("NO_COLOR")


def _service_protocol(seconds: float) -> type:
    """uvicorn's h11 protocol, closing a connection whose request headers have not all arrived
    `seconds` after it opened or after its previous response, and answering a request it cannot
    parse in the service's JSON error shape. uvicorn times out idle keep-alive connections only, and
    any byte received cancels that, so a client sending a header byte every few seconds held its
    connection forever (hundreds of them starved the server of sockets)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class ServiceProtocol(H11Protocol):
        _header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_deadline()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the headers are in: the body has its own deadline
                self._disarm_header_deadline()

        def _arm_header_deadline(self) -> None:
            self._disarm_header_deadline()
            self._header_deadline = self.loop.call_later(seconds, self._close_if_still_waiting)

        def _disarm_header_deadline(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _close_if_still_waiting(self) -> None:
            self._header_deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.info("closing a connection whose request headers did not arrive within %gs", seconds)
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a malformed request line or header (h11 refused it), which it
            sends as plain text: the same 400, in the JSON error shape every other error has, with
            an X-Request-ID as every other response (no request was parsed, so always a new one)."""
            refusal = ApiError(400, "invalid_http", "malformed HTTP request: its request line or a header cannot be parsed")
            headers, body = refusal.closing_response()
            headers.append((HEADER.encode(), new_request_id().encode()))
            if (state := getattr(getattr(self.config.app, "state", None), "service", None)) is not None:
                # Counted as the app counts an answer to a path it does not serve: no route was parsed.
                state.metrics.requests.labels("other", "400").inc()
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return ServiceProtocol


class ServiceServer(uvicorn.Server):
    """uvicorn's server, cancelling the app's in-flight searches itself shortly before the grace
    period ends: each request then still answers (503 `cancelled` in the JSON error shape, or the
    stream's final `error` event). Left to uvicorn, the request tasks themselves are cancelled at
    the deadline: a plain-text 500, or a stream cut off without its final event. A second Ctrl-C
    (uvicorn's force exit) cancels them at once, the same way; a third forces the exit. Either way,
    a connection whose client is not reading what it was sent is then closed (see `_end_requests`)."""

    _loop: asyncio.AbstractEventLoop | None = None
    _cancelled_early = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = _service_state(self)
        if (self.should_exit and sig == signal.SIGINT and not self._cancelled_early and state is not None
                and self._loop is not None and not self._loop.is_closed()):
            # The user wants out now: the searches answer 503 `cancelled` and shutdown completes,
            # instead of uvicorn dropping them mid-response with tracebacks.
            self._cancelled_early = True
            log.warning("second interrupt: cancelling the searches still running (again to force the exit)")
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(_end_requests(self, state, _ANSWER_MARGIN_S / 2)))
            return
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = _service_state(self)
        grace = self.config.timeout_graceful_shutdown
        canceller = None
        if state is not None and grace is not None:
            canceller = asyncio.create_task(_cancel_searches_after(self, state, _cancel_at(grace)))
        try:
            await super().shutdown(sockets)
        finally:
            if canceller is not None:
                canceller.cancel()
                await asyncio.gather(canceller, return_exceptions=True)


def _service_state(server: uvicorn.Server) -> Any:
    """The app's service state (its search slots), or None for another app."""
    return getattr(getattr(server.config.app, "state", None), "service", None)


# Time left, once the searches are cancelled, for their requests to send the error and close.
_ANSWER_MARGIN_S = 1.0


def _cancel_at(grace: float) -> float:
    return grace - _ANSWER_MARGIN_S if grace >= 2 * _ANSWER_MARGIN_S else grace / 2


async def _cancel_searches_after(server: uvicorn.Server, state: Any, delay: float) -> None:
    await asyncio.sleep(delay)
    if state.slots.tasks:
        log.warning("shutdown: cancelling %d search(es) or reload(s) still running after the grace period", len(state.slots.tasks))
    grace = server.config.timeout_graceful_shutdown or 0.0
    await _end_requests(server, state, (grace - delay) / 2)


async def _end_requests(server: uvicorn.Server, state: Any, unread_after: float) -> None:
    """Cancel the running searches (each still answers), then, `unread_after` seconds later, close
    the connections that still have bytes their client has not taken. A stream whose client stopped
    reading (a vanished host, a stuck proxy) blocks its writes on the full socket: left open, it held
    the shutdown to uvicorn's deadline, which then cancelled it with a traceback."""
    await state.slots.cancel_all()
    await asyncio.sleep(unread_after)
    _close_unread_connections(server)


def _close_unread_connections(server: uvicorn.Server) -> None:
    unread = [c for c in list(server.server_state.connections)
              if getattr(c, "transport", None) is not None and c.transport.get_write_buffer_size() > 0]
    if unread:
        log.warning("shutdown: closing %d connection(s) whose client is not reading its response", len(unread))
    for connection in unread:
        connection.transport.abort()  # uvicorn then sees a disconnect: the request ends without an error


def listen_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to `port` on every address `host` resolves to, as uvicorn would bind them.
    Binding before the server starts lets the caller report an unusable address in its own words:
    uvicorn logs the OSError and exits 3 only after its start-up has begun. Raises OSError."""
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                                  flags=socket.AI_PASSIVE):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio: "::" must not also take the IPv4 port
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def serve(settings: Settings, *, backend: SearchBackend | None = None, sockets: list[socket.socket] | None = None) -> None:
    """Blocking: serve until interrupted, on `sockets` (from `listen_sockets`) when given, else on
    `settings.service`'s host and port."""
    build_server(settings, backend=backend).run(sockets=sockets)
