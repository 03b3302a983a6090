"""What the HTTP layer needs from a search engine: the `SearchBackend` protocol.

The app only talks to this protocol, so it can be driven by the real engine (`EngineBackend`, the
store + models + DRIFTSearch/LocalSearch) or, in tests, by the same engine with a scripted chat model.
Progress reaches the app as `SearchEvent`s through a plain callback, which the streaming route turns
into Server-Sent Events.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import BaseModel

from drift_lance.drift.result import SearchResult
from drift_lance.store import Manifest

Method = Literal["drift", "local"]
EventName = Literal["primer", "action", "token"]


@dataclass(frozen=True, slots=True)
class SearchEvent:
    """One progress event: `primer` (primer done), `action` (one follow-up action completed),
    `token` (a reduce/answer token)."""

    event: EventName
    data: dict[str, Any] = field(default_factory=dict)


EventSink = Callable[[SearchEvent], None]


@dataclass(frozen=True, slots=True)
class Readiness:
    store: bool
    models: bool
    detail: str = ""

    @property
    def ready(self) -> bool:
        return self.store and self.models


class SearchBackend(Protocol):
    """A search engine behind the HTTP service. All methods run on the server's event loop."""

    async def start(self) -> None:
        """Open the store and load the models (called once, in the background, at startup)."""
        ...

    def readiness(self) -> Readiness: ...

    def manifest(self) -> Manifest:
        """The manifest of the open index (only called when ready)."""
        ...

    def base_config(self, method: Method) -> BaseModel:
        """The server's config for `method`; requests override fields of a copy of it."""
        ...

    async def search(
        self, query: str, method: Method, config: BaseModel, on_event: EventSink | None = None
    ) -> SearchResult:
        """Run one search. Cancelling the awaiting task must cancel its in-flight LLM calls."""
        ...

    async def close(self) -> None: ...

    # Optional: `async def reload() -> generations.ReloadResult` switches to the newest ingested
    # generation (POST /v1/admin/reload answers 501 for a backend without it);
    # `def observe_reloads(callback: Callable[[str], None])` tells the metrics each reload's outcome;
    # `def count_model_failures(counter)` counts the chat model's failed calls by kind.
