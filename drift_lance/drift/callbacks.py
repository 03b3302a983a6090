"""Progress callbacks of a DRIFT query (CLI progress display, the HTTP SSE stream).

Subclass `DriftCallbacks` and override what you need; methods may be plain or `async`. A callback
that raises is logged and skipped: progress display must never fail a query.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

from drift_lance.drift.action import DriftAction
from drift_lance.errors import ConfigError

__all__ = ["DriftCallbacks", "as_callback_list", "emit"]

log = logging.getLogger(__name__)


class DriftCallbacks:
    """Progress of one DRIFT query. Override the events you need (plain or `async` methods; the
    query waits for an async one); pass the object, or a list of them, as `callbacks=` to
    `open_drift_search` / `DRIFTSearch` (every query) or to `search` / `stream_search` (one). A
    callback that raises is logged and skipped."""

    def on_primer_done(self, root: DriftAction, reports: list[dict[str, Any]]) -> Any:
        """The root action exists; `reports` are the top-k reports the primer read."""

    def on_epoch_start(self, epoch: int, actions: list[DriftAction]) -> Any:
        """Epoch `epoch` (1-based) is about to run `actions`."""

    def on_action_completed(self, action: DriftAction, epoch: int) -> Any:
        """A follow-up action finished (answered, or failed: `action.failed`)."""

    def on_reduce_start(self, state: dict[str, Any]) -> Any:
        """The reduce call starts; `state` is the serialized action graph without context."""

    def on_token(self, token: str) -> Any:
        """A streamed reduce delta (stream_search only)."""

    def on_reduce_end(self, response: str) -> Any:
        """The final answer."""


EVENTS = tuple(name for name in vars(DriftCallbacks) if name.startswith("on_"))


def as_callback_list(callbacks: DriftCallbacks | Sequence[DriftCallbacks] | None) -> list[DriftCallbacks]:
    """`callbacks=` as a list: one callbacks object or a sequence of them (or None) are accepted.
    ConfigError for one with none of the events' methods (a plain function, say), which would
    otherwise never be called."""
    if callbacks is None:
        return []
    listed = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    for callback in listed:
        if not any(callable(getattr(callback, event, None)) for event in EVENTS):
            named = " ".join(filter(None, (type(callback).__name__, getattr(callback, "__qualname__", None))))
            raise ConfigError(
                f"callbacks: {named} has none of the methods "
                f"{', '.join(EVENTS)}; subclass drift_lance.DriftCallbacks and override the events you need"
            )
    return listed  # type: ignore[return-value]


async def emit(callbacks: Sequence[DriftCallbacks], event: str, *args: Any) -> None:
    for callback in callbacks:
        method = getattr(callback, event, None)
        if method is None:
            continue
        try:
            outcome = method(*args)
            if inspect.isawaitable(outcome):
                await outcome
        except Exception:  # noqa: BLE001 - a broken progress display must not fail the query
            log.warning("DRIFT callback %s.%s failed", type(callback).__name__, event, exc_info=True)
