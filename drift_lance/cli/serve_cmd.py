"""`drift-lance serve`: run the HTTP search service on an ingested index."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from drift_lance.errors import StoreError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the HTTP search service (FastAPI on uvicorn)",
        description="Serve POST /v1/search, POST /v1/search/stream (SSE), GET /v1/index, POST /v1/admin/reload, "
        "GET /openapi.json, /healthz and /readyz for an ingested index. Set DRIFT_LANCE_API_KEY to require a "
        "bearer token (every route but the probes).",
    )
    parser.add_argument("--db", metavar="URI", help="LanceDB URI of the ingested index (default: `db` from settings)")
    parser.add_argument("--host", help="interface to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="TCP port (default 8000)")
    parser.add_argument(
        "--config", metavar="FILE",
        help="settings file (TOML or YAML); a graphrag settings.yaml is accepted (its drift_search and "
        "local_search blocks are used)",
    )
    parser.add_argument(
        "--storage-option", dest="storage_options", action="append", default=[], metavar="KEY=VALUE",
        help="LanceDB storage option for an object-store --db, e.g. aws_endpoint=http://127.0.0.1:9000 "
        "(repeatable; adds to `store.storage_options` from settings)",
    )
    parser.add_argument(
        "--reload-interval", type=float, metavar="SECONDS",
        help="check for a newer ingested generation this often (default 30, 0 = only on POST /v1/admin/reload)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from drift_lance.cli import UsageError
    from drift_lance.cli.ingest_cmd import parse_storage_options
    from drift_lance.cli.query_cmd import BUNDLED_CHAT_NOTICE, uses_bundled_chat_model
    from drift_lance.config.settings import Settings
    from drift_lance.object_store import merge_storage_options
    from drift_lance.service.request_id import install_log_request_ids
    from drift_lance.service.server import serve

    settings = Settings.load(args.config, graphrag=True, db=args.db)
    if settings.db is None:
        raise UsageError("no database: pass --db URI (or set `db` in the config file / DRIFT_LANCE_DB)")
    flags = {"service.host": args.host, "service.port": args.port, "store.reload_interval_seconds": args.reload_interval}
    cli_options = parse_storage_options(args.storage_options)
    if cli_options:
        flags["store.storage_options"] = merge_storage_options(settings.store.storage_options, cli_options)
    settings = settings.with_updates({k: v for k, v in flags.items() if v is not None})
    # Fail fast, with exit 2, on a database that is missing or was never ingested, instead of
    # starting a server whose /readyz never turns ready.
    asyncio.run(check_database(settings.db, settings.store))
    cfg = settings.service
    sockets = listen(cfg.host, cfg.port)
    port = sockets[0].getsockname()[1]  # the one the OS picked for --port 0
    auth = "on" if cfg.api_key else "off"
    print(f"drift-lance: serving {settings.db} on http://{host_and_port(cfg.host, port)} (API key {auth})", file=sys.stderr)
    if uses_bundled_chat_model(settings.models):
        print(f"drift-lance: {BUNDLED_CHAT_NOTICE}", file=sys.stderr)
    # A long-running server's log lines carry the time and the request they belong to (the id its
    # response's X-Request-ID header gives the client).
    install_log_request_ids()
    logging.basicConfig(force=True, level=logging.getLogger().level,
                        format="%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")
    # The service's own events (generation switches, cancelled searches) at uvicorn's level, info.
    service_log = logging.getLogger("drift_lance.service")
    if service_log.getEffectiveLevel() > logging.INFO:
        service_log.setLevel(logging.INFO)
    serve(settings, sockets=sockets)
    return 0


def listen(host: str, port: int) -> list[socket.socket]:
    """The bound listening sockets, or a UsageError naming the address and the OS's reason (a port
    in use, a host that does not resolve or is not this machine's), before anything is announced."""
    from drift_lance.cli import UsageError
    from drift_lance.service.server import listen_sockets

    try:
        return listen_sockets(host, port)
    except OSError as exc:
        raise UsageError(f"cannot listen on {host_and_port(host, port)}: {exc.strerror or exc}") from None


def host_and_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def check_database(uri: str, config: Any = None) -> None:
    """Raise StoreError naming `uri` when it is not an ingested drift-lance index."""
    from drift_lance._lance_store import open_store

    if is_local_path(uri) and not Path(uri).expanduser().exists():
        raise StoreError(f"{uri}: database not found")
    store = await open_store(uri, config=config)
    await store.close()


def is_local_path(uri: str) -> bool:
    scheme = urlparse(uri).scheme
    return scheme in ("", "file") or len(scheme) == 1  # one letter: a Windows drive
