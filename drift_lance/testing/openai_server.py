"""A small OpenAI-protocol HTTP server on 127.0.0.1 for tests (no network, real HTTP).

Serves POST /v1/chat/completions (JSON or SSE streaming) and POST /v1/embeddings. Each chat
request takes the next scripted `Reply` (or asks `on_chat`, or answers `default_text`):

    with FakeOpenAIServer() as server:              # also `async with`
        server.queue_chat(Reply.rate_limited(retry_after=0.2), Reply(text="hello"))
        server.queue_chat(Reply(json={"answer": 1}), Reply.server_error(500), Reply(hang=True))
        server.on_chat = lambda req: Reply(text=req.messages[-1]["content"].upper())
        server.reject_response_formats = {"json_schema"}   # answer 400 like llama.cpp's server
        client = openai.OpenAI(base_url=server.base_url, api_key="x")
        ...
        server.requests[-1].response_format, server.max_concurrent, server.disconnects

Replies: text / json (the assistant message), status + headers + body (raw HTTP, e.g. malformed
bodies), delay (seconds before answering), hang (never answer; the client must time out),
chunk_delay (between stream chunks), usage (include token usage), body_chunks (a raw body sent
piece by piece with chunked transfer encoding, chunk_delay apart: an endless generator makes a body
or event stream that never ends, one byte a second a slow drip). Streaming requests get the
text split into word deltas, then a usage chunk when stream_options.include_usage was sent.
Embeddings are deterministic per text (feature hashing) with `embedding_dim` dimensions, as float
lists or, when the request asks for encoding_format=base64, little-endian float32 in base64 like
OpenAI (`embeddings_float_only` ignores that, as some servers do).
Requests whose client disconnects before the response is complete are counted in `disconnects`
and flagged `disconnected`.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import threading
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FakeOpenAIServer", "RecordedRequest", "Reply"]

_WORDS = re.compile(r"\s*\S+\s*|\s+")
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 411: "Length Required",
            422: "Unprocessable Entity", 429: "Too Many Requests", 500: "Internal Server Error",
            502: "Bad Gateway", 503: "Service Unavailable"}


@dataclass
class Reply:
    """How to answer one request."""

    text: str | None = None  # assistant message content
    json: Any = None  # assistant message content, serialised as JSON
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: str | bytes | dict | None = None  # raw response body; replaces the normal completion
    delay: float = 0.0
    hang: bool = False
    chunk_delay: float = 0.0
    usage: bool = True
    finish_reason: str = "stop"
    body_chunks: Iterable[bytes] | None = None  # raw body, chunked; content-type from headers (default JSON)

    @classmethod
    def rate_limited(cls, retry_after: float | None = 1.0, *, header: str = "retry-after") -> Reply:
        headers = {header: f"{retry_after:g}" if header == "retry-after" else f"{retry_after * 1000:g}"}
        return cls(status=429, headers=headers if retry_after is not None else {},
                   body=_error_body("Rate limit reached", "rate_limit_exceeded"))

    @classmethod
    def server_error(cls, status: int = 500, message: str = "internal error") -> Reply:
        return cls(status=status, body=_error_body(message, "server_error"))

    @classmethod
    def bad_request(cls, message: str = "bad request") -> Reply:
        return cls(status=400, body=_error_body(message, "invalid_request_error"))

    @classmethod
    def hanging(cls) -> Reply:
        return cls(hang=True)

    def content(self, default: str) -> str:
        if self.json is not None:
            return json.dumps(self.json, ensure_ascii=False)
        return self.text if self.text is not None else default


def _error_body(message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: Any  # parsed JSON, or the raw text if it was not JSON
    started_at: float
    finished_at: float | None = None
    status: int | None = None
    disconnected: bool = False

    @property
    def route(self) -> str:
        """The path without its query string."""
        return self.path.split("?", 1)[0]

    @property
    def query(self) -> str:
        return self.path.split("?", 1)[1] if "?" in self.path else ""

    @property
    def kind(self) -> str:
        if self.route.endswith("/chat/completions"):
            return "chat"
        if self.route.endswith("/embeddings"):
            return "embeddings"
        return "other"

    def _get(self, key: str, default: Any = None) -> Any:
        return self.body.get(key, default) if isinstance(self.body, dict) else default

    @property
    def model(self) -> str | None:
        return self._get("model")

    @property
    def messages(self) -> list[dict]:
        return self._get("messages", [])

    @property
    def response_format(self) -> dict | None:
        return self._get("response_format")

    @property
    def stream(self) -> bool:
        return bool(self._get("stream", False))


class _Disconnected(Exception):
    pass


class _ClientReader(asyncio.StreamReader):
    """A StreamReader that also says when its client has gone (end of stream or connection lost),
    so a delayed or hanging reply sleeps in one piece yet notices a disconnect at once. (Polling
    every 10 ms cost the benchmarks' LLM server ~450 ms of CPU per DRIFT query at 1 s latency, on
    the cores the engine being measured runs on.)"""

    def __init__(self) -> None:
        super().__init__()
        self.gone = asyncio.Event()

    def feed_eof(self) -> None:
        super().feed_eof()
        self.gone.set()

    def set_exception(self, exc: BaseException) -> None:
        super().set_exception(exc)
        self.gone.set()


class FakeOpenAIServer:
    def __init__(self, *, embedding_dim: int = 8, default_text: str = "ok", host: str = "127.0.0.1"):
        self.host = host
        self.port = 0
        self.embedding_dim = embedding_dim
        self.default_text = default_text
        self.on_chat: Callable[[RecordedRequest], Reply | str | dict | None] | None = None
        self.reject_response_formats: set[str] = set()
        # Like servers that only speak floats: ignore encoding_format=base64 and answer float lists.
        self.embeddings_float_only = False
        self.reject_stream_options = False
        self.requests: list[RecordedRequest] = []
        self.in_flight = 0
        self.max_concurrent = 0
        self.disconnects = 0
        self._chat_replies: deque[Reply] = deque()
        self._embedding_replies: deque[Reply] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._started = threading.Event()
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ public API

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def queue_chat(self, *replies: Reply | str | dict) -> None:
        self._chat_replies.extend(_as_reply(r) for r in replies)

    def queue_embeddings(self, *replies: Reply) -> None:
        self._embedding_replies.extend(replies)

    @property
    def chat_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.kind == "chat"]

    @property
    def embedding_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.kind == "embeddings"]

    def reset_stats(self) -> None:
        self.requests.clear()
        self.max_concurrent = self.in_flight
        self.disconnects = 0

    def start(self) -> FakeOpenAIServer:
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._serve_forever, name="fake-openai-server", daemon=True)
        self._thread.start()
        self._started.wait(10)
        if self._error is not None:
            raise RuntimeError(f"FakeOpenAIServer failed to start: {self._error}") from self._error
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if not loop.is_closed():
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
            try:
                fut.result(10)
            except Exception:  # noqa: BLE001 - best effort; the loop is stopped below anyway
                pass
            loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        self._thread = None

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> FakeOpenAIServer:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    # ------------------------------------------------------------------ server thread

    def _serve_forever(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            protocol = lambda: asyncio.StreamReaderProtocol(_ClientReader(), self._on_connection)  # noqa: E731
            self._server = loop.run_until_complete(loop.create_server(protocol, self.host, 0))
            self.port = self._server.sockets[0].getsockname()[1]
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
            self._started.set()
            loop.close()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while await self._handle_one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, _Disconnected):
            pass
        except asyncio.CancelledError:
            pass  # server shutdown; returning normally keeps asyncio from logging the cancellation
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _handle_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
        if not head:
            return False
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0") or 0)
        raw = await reader.readexactly(length) if length else b""
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        request = RecordedRequest(method, path, headers, body, time.monotonic())
        self.requests.append(request)
        self.in_flight += 1
        self.max_concurrent = max(self.max_concurrent, self.in_flight)
        try:
            await self._respond(request, reader, writer)
        except (_Disconnected, ConnectionError):
            request.disconnected = True
            self.disconnects += 1
            raise
        except asyncio.CancelledError:
            request.disconnected = True
            raise
        finally:
            self.in_flight -= 1
            request.finished_at = time.monotonic()
        return headers.get("connection", "").lower() != "close"

    async def _respond(self, request: RecordedRequest, reader: asyncio.StreamReader, writer) -> None:
        if request.method != "POST" or request.kind == "other":
            return await self._send_json(request, writer, 404, _error_body(f"no route {request.path}", "not_found"))
        rejection = self._rejection(request) if request.kind == "chat" else None
        if rejection:  # checked first, so a rejected request does not use up a scripted reply
            return await self._send_json(request, writer, 400, _error_body(rejection, "invalid_request_error"))
        reply = self._next_reply(request)
        if reply.hang:
            await self._wait(reader, writer, None)
        if reply.delay:
            await self._wait(reader, writer, reply.delay)
        if reply.body_chunks is not None:
            return await self._send_chunks(request, reader, writer, reply)
        if reply.body is not None or reply.status != 200:
            body = reply.body if reply.body is not None else _error_body("error", "server_error")
            return await self._send_raw(request, writer, reply.status, body, reply.headers)
        if request.kind == "embeddings":
            return await self._send_json(request, writer, 200, self._embeddings(request))
        text = reply.content(self.default_text)
        if request.stream:
            return await self._send_stream(request, reader, writer, reply, text)
        return await self._send_json(request, writer, 200, self._completion(request, reply, text), reply.headers)

    def _next_reply(self, request: RecordedRequest) -> Reply:
        if request.kind == "embeddings":
            return self._embedding_replies.popleft() if self._embedding_replies else Reply()
        if self._chat_replies:
            return self._chat_replies.popleft()
        if self.on_chat is not None:
            answer = self.on_chat(request)
            if answer is not None:
                return _as_reply(answer)
        return Reply()

    def _rejection(self, request: RecordedRequest) -> str | None:
        fmt = request.response_format
        if isinstance(fmt, dict) and fmt.get("type") in self.reject_response_formats:
            return f"response_format type {fmt.get('type')!r} is not supported"
        if self.reject_stream_options and isinstance(request.body, dict) and "stream_options" in request.body:
            return "unrecognized request argument: stream_options"
        return None

    async def _wait(self, reader: _ClientReader, writer, seconds: float | None) -> None:
        """Sleep (forever when seconds is None) unless the client disconnects first."""
        if reader.gone.is_set() or writer.is_closing():
            raise _Disconnected()
        try:
            await asyncio.wait_for(reader.gone.wait(), seconds)
        except TimeoutError:
            return
        raise _Disconnected()

    # ------------------------------------------------------------------ bodies

    def _usage(self, request: RecordedRequest, text: str) -> dict:
        prompt = sum(len(str(m.get("content", "")).split()) for m in request.messages)
        completion = len(text.split())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _completion(self, request: RecordedRequest, reply: Reply, text: str) -> dict:
        body = {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.model or "fake",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": reply.finish_reason,
                }
            ],
        }
        if reply.usage:
            body["usage"] = self._usage(request, text)
        return body

    def _embeddings(self, request: RecordedRequest) -> dict:
        inputs = request.body.get("input", []) if isinstance(request.body, dict) else []
        if isinstance(inputs, str):
            inputs = [inputs]
        as_base64 = request.body.get("encoding_format") == "base64" and not self.embeddings_float_only
        data = [{"object": "embedding", "index": i,
                 "embedding": _base64_floats(self.vector(str(t))) if as_base64 else self.vector(str(t))}
                for i, t in enumerate(inputs)]
        tokens = sum(len(str(t).split()) for t in inputs)
        return {"object": "list", "data": data, "model": request.model or "fake",
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def vector(self, text: str) -> list[float]:
        """The (un-normalised) embedding this server returns for `text`."""
        out = [0.0] * self.embedding_dim
        for word in re.findall(r"\w+", text.lower()) or [""]:
            h = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
            out[h % self.embedding_dim] += 2.0 if (h >> 63) & 1 else -2.0
        if not any(out):
            out[0] = 2.0
        return out

    async def _send_stream(self, request, reader, writer, reply: Reply, text: str) -> None:
        base = {"id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": request.model or "fake"}
        opts = request.body.get("stream_options") or {}
        events: list[dict] = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                    "finish_reason": None}]}]
        for piece in _WORDS.findall(text):
            events.append({**base, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
        events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": reply.finish_reason}]})
        if reply.usage and opts.get("include_usage"):
            events.append({**base, "choices": [], "usage": self._usage(request, text)})
        head = ["HTTP/1.1 200 OK", "Content-Type: text/event-stream", "Cache-Control: no-cache",
                "Transfer-Encoding: chunked", *(f"{k}: {v}" for k, v in reply.headers.items())]
        request.status = 200
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        for event in events:
            if reply.chunk_delay:
                await self._wait(reader, writer, reply.chunk_delay)
            await self._write_chunk(writer, f"data: {json.dumps(event)}\n\n".encode())
        await self._write_chunk(writer, b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def _send_chunks(self, request, reader, writer, reply: Reply) -> None:
        headers = {"content-type": "application/json", **{k.lower(): v for k, v in reply.headers.items()}}
        head = [f"HTTP/1.1 {reply.status} {_REASONS.get(reply.status, 'Status')}", "Transfer-Encoding: chunked",
                *(f"{k}: {v}" for k, v in headers.items())]
        request.status = reply.status
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        for piece in reply.body_chunks or ():
            if reply.chunk_delay:
                await self._wait(reader, writer, reply.chunk_delay)
            if piece:
                await self._write_chunk(writer, piece)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def _write_chunk(self, writer, data: bytes) -> None:
        if writer.is_closing():
            raise _Disconnected()
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        await writer.drain()

    async def _send_json(self, request, writer, status: int, body: Any, headers: dict | None = None) -> None:
        await self._send_raw(request, writer, status, body, headers or {})

    async def _send_raw(self, request, writer, status: int, body: Any, headers: dict[str, str]) -> None:
        if isinstance(body, dict | list):
            data, ctype = json.dumps(body).encode(), "application/json"
        elif isinstance(body, str):
            data, ctype = body.encode(), "application/json"
        else:
            data, ctype = bytes(body), "application/json"
        head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}", f"Content-Type: {ctype}",
                f"Content-Length: {len(data)}", *(f"{k}: {v}" for k, v in headers.items())]
        request.status = status  # before writing: the client may look as soon as the bytes arrive
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        await writer.drain()


def _as_reply(answer: Reply | str | dict | list) -> Reply:
    if isinstance(answer, Reply):
        return answer
    if isinstance(answer, str):
        return Reply(text=answer)
    return Reply(json=answer)


def _base64_floats(values: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
