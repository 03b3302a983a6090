"""A local S3-compatible object store for tests and benchmarks, with request counting.

`LocalS3` starts `moto`'s S3 server on 127.0.0.1 (moto[server], a dev dependency) in a subprocess and
puts a small counting reverse proxy in front of it (a second subprocess, so neither steals the
measuring process's CPU or GIL). Clients talk to the proxy; `counts()` says how many object-store
requests they made, by kind:

    with LocalS3() as s3:                      # buckets: s3.create_bucket("drift-test")
        uri = "s3://drift-test/index"
        opts = s3.storage_options()            # endpoint (the proxy), keys, region, allow_http
        ...                                    # or os.environ.update(s3.environment())
        s3.reset_counts(); run_query(); print(s3.counts())   # RequestCounts(get=.., list=.., ...)

Kinds: LIST (GET of a bucket listing), GET (object reads, ranged or whole), HEAD, PUT, POST
(multipart upload control), DELETE. The proxy can add a fixed delay per request (`latency_ms`) to
imitate a remote store's round trip.

Run the proxy alone: `python -m drift_lance.testing.s3 proxy --upstream http://127.0.0.1:9000`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import httpx

__all__ = ["LocalS3", "RequestCounts", "classify_request", "free_port"]

# Path prefix of the proxy's own endpoints. S3 bucket names cannot contain "_", so it never
# shadows a bucket.
CONTROL_PREFIX = "/_proxy"
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"
# Hop-by-hop headers are the proxy's own business, not forwarded (RFC 9110 section 7.6.1).
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}
KINDS = ("list", "get", "head", "put", "post", "delete")


@dataclass(frozen=True)
class RequestCounts:
    """Object-store requests seen by the proxy, by kind, plus response body bytes."""

    by_kind: dict[str, int] = field(default_factory=dict)
    bytes_out: int = 0  # response body bytes sent to the client (what a read downloaded)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def __getattr__(self, name: str) -> int:
        if name in KINDS:
            return self.by_kind.get(name, 0)
        raise AttributeError(name)

    def __sub__(self, other: RequestCounts) -> RequestCounts:
        kinds = set(self.by_kind) | set(other.by_kind)
        return RequestCounts({k: self.by_kind.get(k, 0) - other.by_kind.get(k, 0) for k in kinds},
                             self.bytes_out - other.bytes_out)

    def as_dict(self) -> dict[str, int]:
        return {**{k: self.by_kind.get(k, 0) for k in KINDS}, "total": self.total, "bytes_out": self.bytes_out}


def classify_request(method: str, path: str, query_string: str) -> str:
    """The request kind of an S3 path-style request: list, get, head, put, post, delete."""
    method = method.upper()
    if method == "GET":
        is_bucket_root = path.strip("/").count("/") == 0
        params = parse_qs(query_string, keep_blank_values=True)
        if "list-type" in params or "uploads" in params or is_bucket_root:
            return "list"
        return "get"
    return method.lower()


class _CountingProxy:
    """ASGI app forwarding every request to `upstream` and counting it by kind."""

    def __init__(self, upstream: str, latency_ms: float = 0.0):
        self.upstream = upstream.rstrip("/")
        self.latency_s = latency_ms / 1000.0
        self.counts: Counter[str] = Counter()
        self.bytes_out = 0
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        path: str = scope["path"]
        if path.startswith(CONTROL_PREFIX):
            await self._control(scope, send)
            return
        query = scope.get("query_string", b"").decode("latin-1")
        body = await _read_body(receive)
        self.counts[classify_request(scope["method"], path, query)] += 1
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        raw_path = scope.get("raw_path") or path.encode()
        url = self.upstream + raw_path.decode("latin-1") + (f"?{query}" if query else "")
        headers = [(k, v) for k, v in scope["headers"] if k.decode("latin-1").lower() not in _HOP_BY_HOP]
        assert self._client is not None
        request = self._client.build_request(scope["method"], url, headers=headers, content=body)
        response = await self._client.send(request, stream=True)
        try:
            out_headers = [
                (k.encode("latin-1"), v.encode("latin-1"))
                for k, v in response.headers.multi_items()
                if k.lower() not in _HOP_BY_HOP
            ]
            await send({"type": "http.response.start", "status": response.status_code, "headers": out_headers})
            async for chunk in response.aiter_raw():
                self.bytes_out += len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                # No pool limit: the client's own concurrency is what we want to observe.
                self._client = httpx.AsyncClient(timeout=60.0, limits=httpx.Limits(max_connections=None))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._client is not None:
                    await self._client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _control(self, scope: dict[str, Any], send: Any) -> None:
        if scope["path"] == f"{CONTROL_PREFIX}/reset" and scope["method"] == "POST":
            self.counts.clear()
            self.bytes_out = 0
        payload = json.dumps({"by_kind": dict(self.counts), "bytes_out": self.bytes_out}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})


async def _read_body(receive: Any) -> bytes:
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_http(url: str, process: subprocess.Popen, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode} before it answered on {url}")
        try:
            httpx.get(url, timeout=2.0)
            return
        except httpx.TransportError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not answer on {url} within {timeout:g}s")


class LocalS3:
    """moto's S3 server plus the counting proxy, both on 127.0.0.1 in subprocesses."""

    def __init__(self, *, latency_ms: float = 0.0, nice: int = 0):
        self.latency_ms = latency_ms
        self.nice = nice
        self.upstream = ""
        self.endpoint = ""
        self._processes: list[subprocess.Popen] = []

    def start(self) -> LocalS3:
        try:
            import moto.server  # noqa: F401 - only checking that moto[server] is installed
        except ImportError as exc:
            raise RuntimeError("LocalS3 needs moto[server] (pip install 'moto[server]')") from exc
        moto_port = free_port()
        self.upstream = f"http://127.0.0.1:{moto_port}"
        moto = self._spawn([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(moto_port)])
        _wait_http(self.upstream, moto, "moto S3 server")
        proxy_port = free_port()
        self.endpoint = f"http://127.0.0.1:{proxy_port}"
        proxy = self._spawn([
            sys.executable, "-m", "drift_lance.testing.s3", "proxy", "--upstream", self.upstream,
            "--port", str(proxy_port), "--latency-ms", str(self.latency_ms),
        ])
        _wait_http(f"{self.endpoint}{CONTROL_PREFIX}/counts", proxy, "counting S3 proxy")
        return self

    def _spawn(self, argv: list[str]) -> subprocess.Popen:
        process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            preexec_fn=(lambda: os.nice(self.nice)) if self.nice else None,
        )
        self._processes.append(process)
        return process

    def stop(self) -> None:
        for process in reversed(self._processes):
            process.terminate()
        for process in self._processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        self._processes.clear()

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ clients

    def storage_options(self) -> dict[str, str]:
        """LanceDB storage options that reach this store through the proxy."""
        return {
            "aws_endpoint": self.endpoint,
            "aws_access_key_id": ACCESS_KEY,
            "aws_secret_access_key": SECRET_KEY,
            "aws_region": REGION,
            "allow_http": "true",
        }

    def environment(self) -> dict[str, str]:
        """The standard AWS variables for this store (allow_http is left for drift-lance to infer)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
        }

    def create_bucket(self, name: str) -> None:
        import boto3

        client = boto3.client(
            "s3", endpoint_url=self.upstream, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY, region_name=REGION,
        )
        client.create_bucket(Bucket=name)

    def list_keys(self, bucket: str, prefix: str = "") -> list[str]:
        import boto3

        client = boto3.client(
            "s3", endpoint_url=self.upstream, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY, region_name=REGION,
        )
        keys: list[str] = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys.extend(obj["Key"] for obj in page.get("Contents", []))
        return keys

    # ------------------------------------------------------------------ counting

    def counts(self) -> RequestCounts:
        data = httpx.get(f"{self.endpoint}{CONTROL_PREFIX}/counts", timeout=10.0).json()
        return RequestCounts(data["by_kind"], data["bytes_out"])

    def reset_counts(self) -> None:
        httpx.post(f"{self.endpoint}{CONTROL_PREFIX}/reset", timeout=10.0)


def _serve_proxy(upstream: str, port: int, latency_ms: float) -> None:
    import uvicorn

    app = _CountingProxy(upstream, latency_ms)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                            lifespan="on", timeout_keep_alive=30)
    server = uvicorn.Server(config)
    # Stop when the parent dies, so a crashed test run leaves no proxy behind.
    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        server.should_exit = True

    threading.Thread(target=watch_parent, daemon=True).start()
    server.run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m drift_lance.testing.s3")
    sub = parser.add_subparsers(dest="command", required=True)
    proxy = sub.add_parser("proxy", help="counting reverse proxy in front of an S3-compatible endpoint")
    proxy.add_argument("--upstream", required=True, help="e.g. http://127.0.0.1:9000")
    proxy.add_argument("--port", type=int, required=True)
    proxy.add_argument("--latency-ms", type=float, default=0.0, help="delay added to every request")
    args = parser.parse_args(argv)
    _serve_proxy(args.upstream, args.port, args.latency_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
