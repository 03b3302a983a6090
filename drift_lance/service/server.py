"""Run the app on uvicorn with the service's shutdown policy."""

from __future__ import annotations

import uvicorn
from fastapi import FastAPI

from drift_lance.config.settings import Settings
from drift_lance.service.backend import SearchBackend


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
    return uvicorn.Server(config)


def serve(settings: Settings, *, backend: SearchBackend | None = None) -> None:
    """Blocking: serve until interrupted."""
    build_server(settings, backend=backend).run()
