"""The HTTP search service (FastAPI on uvicorn).

    from drift_lance.config import Settings
    from drift_lance.service import create_app, serve
    app = create_app(Settings.load("drift-lance.toml", db="./index"))
"""

from drift_lance.service.app import SearchRequest, create_app
from drift_lance.service.backend import Readiness, SearchBackend, SearchEvent
from drift_lance.service.server import build_server, serve

__all__ = ["Readiness", "SearchBackend", "SearchEvent", "SearchRequest", "build_server", "create_app", "serve"]
