"""Server-Sent Events for one search: progress events, then a final `done` (or `error`) event.

A plain ASGI response (not StreamingResponse) so that every exit path — normal end, error, timeout,
client disconnect, server shutdown — runs the same `finally`: cancel the search, release its slot.
A search that ends releases its slot before its final event is sent: a client that reads a stream
to its end and then starts the next search must find the slot free.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import Receive, Scope, Send

from drift_lance.drift.result import SearchResult
from drift_lance.service.backend import EventSink, SearchEvent
from drift_lance.service.errors import ApiError, cancelled_by_shutdown
from drift_lance.service.events import done_event

log = logging.getLogger("drift_lance.service")

SearchRunner = Callable[[EventSink], Awaitable[SearchResult]]
ErrorMapper = Callable[[BaseException], ApiError]
# Called once when the search ends, with "ok" and its result, or with the error code the client
# was sent (or would have been: "client_closed" when it left) and None.
EndObserver = Callable[[str, SearchResult | None], None]


def format_event(event: str, data: Any, event_id: int) -> bytes:
    """One SSE frame. JSON data is a single line, so one `data:` field suffices."""
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"id: {event_id}\nevent: {event}\ndata: {payload}\n\n".encode()


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has gone away (request body already consumed)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SearchEventStream:
    """ASGI app streaming one search as `text/event-stream`."""

    media_type = "text/event-stream"

    def __init__(
        self,
        run: SearchRunner,
        *,
        timeout: float,
        keepalive: float,
        map_error: ErrorMapper,
        on_finish: Callable[[], None],
        track: Callable[[asyncio.Task], None],
        stall_grace: float = 10.0,
        on_end: EndObserver | None = None,
    ):
        self._run = run
        self._timeout = timeout
        self._stall_grace = stall_grace
        self._keepalive = keepalive
        self._map_error = map_error
        self._on_finish = on_finish
        self._track = track
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._on_finish()

        ended = False

        def end(outcome: str, result: SearchResult | None = None) -> None:
            nonlocal ended
            if not ended and self._on_end is not None:
                self._on_end(outcome, result)
            ended = True

        queue: asyncio.Queue[SearchEvent] = asyncio.Queue()
        search = asyncio.create_task(self._run(queue.put_nowait))
        self._track(search)
        gone = asyncio.create_task(wait_for_disconnect(receive))
        try:
            # A client that stops reading blocks our writes once the socket buffers are full: past
            # the search's own deadline (plus time to send its error) the stream is dropped, so it
            # cannot hold a search slot for ever.
            async with asyncio.timeout(self._timeout + self._stall_grace):
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [
                            (b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no"),  # nginx: do not buffer the stream
                        ],
                    }
                )
                await self._pump(queue, search, gone, send, release, end)
        except OSError:
            end("client_closed")  # the client went away mid-write; the finally cancels the search
        except TimeoutError:
            log.warning("a stream's client stopped reading; dropping the stream and cancelling its search")
            end("timeout")
        finally:
            gone.cancel()
            if not search.done():
                search.cancel()
            await asyncio.gather(search, gone, return_exceptions=True)
            release()
            end("cancelled")  # the stream itself was cancelled (shutdown)

    async def _pump(
        self, queue: asyncio.Queue[SearchEvent], search: asyncio.Task, gone: asyncio.Task, send: Send,
        release: Callable[[], None], end: Callable[..., None],
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        event_id = 0

        async def emit(name: str, data: Any) -> None:
            nonlocal event_id
            event_id += 1
            await send({"type": "http.response.body", "body": format_event(name, data, event_id), "more_body": True})

        while True:
            getter = asyncio.ensure_future(queue.get())
            wait_for = min(self._keepalive, max(0.0, deadline - loop.time()))
            done, _ = await asyncio.wait({getter, search, gone}, timeout=wait_for, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:  # before the queue: events a departed client had not taken go nowhere
                getter.cancel()
                log.info("client disconnected; cancelling its search")
                end("client_closed")
                return
            if getter in done:
                event = getter.result()
                await emit(event.event, event.data)
                continue
            getter.cancel()
            if search in done:
                break
            if loop.time() >= deadline:
                log.warning("search timed out after %gs; cancelling it and its model calls", self._timeout)
                # Ended and its slot free before the client can see the stream end, as a finished search's.
                search.cancel()
                await asyncio.gather(search, return_exceptions=True)
                release()
                err = ApiError(504, "timeout", f"search exceeded {self._timeout:g}s")
                end(err.code)
                await emit("error", err.payload())
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            await send({"type": "http.response.body", "body": b": keepalive\n\n", "more_body": True})

        # The search finished: its slot is free, and its end counted, before the client can see the
        # stream end. Then flush the events it queued, and the final event.
        release()
        if search.cancelled():  # e.g. the server is shutting down past its grace period
            final = ("error", cancelled_by_shutdown("search").payload())
            end("cancelled")
        elif (exc := search.exception()) is None:
            final = ("done", done_event(search.result()))
            end("ok", search.result())
        else:
            err = self._map_error(exc)
            final = ("error", err.payload())
            end(err.code)
        while not queue.empty() and not gone.done():
            event = queue.get_nowait()
            await emit(event.event, event.data)
        await emit(*final)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
