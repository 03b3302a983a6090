"""Run the app on uvicorn with the service's shutdown policy."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI

from drift_lance.config.settings import Settings
from drift_lance.service.backend import SearchBackend

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
        access_log=False,
        # Clients' requests must be bounded too: headers and idle keep-alive connections.
        timeout_keep_alive=5,
        h11_max_incomplete_event_size=64 * 1024,
    )
    return ServiceServer(config)


class ServiceServer(uvicorn.Server):
    """uvicorn's server, cancelling the app's in-flight searches itself shortly before the grace
    period ends: each request then still answers (503 `cancelled` in the JSON error shape, or the
    stream's final `error` event). Left to uvicorn, the request tasks themselves are cancelled at
    the deadline: a plain-text 500, or a stream cut off without its final event."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = getattr(getattr(self.config.app, "state", None), "service", None)
        grace = self.config.timeout_graceful_shutdown
        canceller = None
        if state is not None and grace is not None:
            canceller = asyncio.create_task(_cancel_searches_after(state, _cancel_at(grace)))
        try:
            await super().shutdown(sockets)
        finally:
            if canceller is not None:
                canceller.cancel()
                await asyncio.gather(canceller, return_exceptions=True)


# Time left, once the searches are cancelled, for their requests to send the error and close.
_ANSWER_MARGIN_S = 1.0


def _cancel_at(grace: float) -> float:
    return grace - _ANSWER_MARGIN_S if grace >= 2 * _ANSWER_MARGIN_S else grace / 2


async def _cancel_searches_after(state: Any, delay: float) -> None:
    await asyncio.sleep(delay)
    if state.slots.tasks:
        log.warning("shutdown: cancelling %d search(es) still running after the grace period", len(state.slots.tasks))
    await state.slots.cancel_all()


def serve(settings: Settings, *, backend: SearchBackend | None = None) -> None:
    """Blocking: serve until interrupted."""
    build_server(settings, backend=backend).run()
