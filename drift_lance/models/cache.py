"""Optional on-disk response cache: a ChatModel wrapper so repeated queries and benchmark reruns do
not pay twice.

Keyed by sha256 over (endpoint, model id, messages, generation params, requested JSON schema): two
servers that call their models by one name never share answers. Stored in one
SQLite file (`responses.sqlite` in cache_dir; WAL mode with a busy timeout, safe for several
processes sharing the dir). Only answers that succeeded (and, for structured calls, validated)
are stored. A hit costs nothing: its usage
is zero, and `ChatResult.raw["cache"] == "hit"`. Bounded (`cache_max_bytes`): past the bound, the
least recently used answers are evicted. Off unless `cache_dir` is configured.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel

from drift_lance.config.models import CACHE_MAX_BYTES
from drift_lance.errors import ConfigError
from drift_lance.models.base import (
    ChatModel,
    ChatParams,
    ChatResult,
    GeneratorStream,
    Message,
    StructuredOutputError,
    Usage,
    aclose_models,
)
from drift_lance.models.structured import parse_structured, response_schema

log = logging.getLogger(__name__)

_KEY_VERSION = 2  # 2: the endpoint is part of the key
_DB_NAME = "responses.sqlite"
_TABLE = "chat_responses"
_COLUMNS = ["key", "endpoint", "model", "text", "prompt_tokens", "output_tokens", "size", "created", "last_used"]
# Past the bound, eviction frees down to this share of it: it runs once per ~10% of the bound
# stored, not on every insert.
_EVICT_TO = 0.9
# A hit rewrites its entry's last use at most this often (seconds): most hits stay read-only, and
# eviction needs no finer order than that.
_TOUCH_INTERVAL = 600.0
# What an entry costs in the file beyond its strings (row header, numbers, its two index entries).
_ENTRY_OVERHEAD = 120
_BUSY_TIMEOUT = 30.0  # seconds an operation waits for another process's write before giving up


def cache_key(endpoint: str, model_id: str, messages: Sequence[Message], params: ChatParams | None,
              response_model: type[BaseModel] | None) -> bytes:
    payload = {
        "v": _KEY_VERSION,
        "endpoint": endpoint,
        "model": model_id,
        "messages": [m.as_dict() for m in messages],
        "params": dataclasses.asdict(params or ChatParams()),
        "schema": response_schema(response_model) if response_model else None,
    }
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).digest()


def model_endpoint(model: ChatModel) -> str:
    """Where `model`'s answers come from: its `endpoint` (the OpenAI-compatible base URL or Azure
    resource, the llama.cpp model file), else its class, so that models of one id served from
    different places never share cached answers."""
    endpoint = getattr(model, "endpoint", None)
    return str(endpoint) if endpoint else f"{type(model).__module__}.{type(model).__qualname__}"


class ResponseStore:
    """A key -> answer store in one SQLite file, shared by every process using the cache dir.

    One connection per store, opened on first use and kept until `close()`, used under a lock from
    worker threads: a connection per operation cost a WAL checkpoint and its fsyncs on every close
    (~20 ms a miss). WAL lets lookups run beside another process's write; writes take the write lock
    up front (BEGIN IMMEDIATE) and wait up to `_BUSY_TIMEOUT` for another process's. With
    synchronous=NORMAL a power cut can lose the last answers stored, never the file. A cache that
    fails at run time (disk full, a lock held past the timeout) costs a model call, not the query."""

    def __init__(self, directory: Path, *, max_bytes: int | None = CACHE_MAX_BYTES):
        directory = Path(directory).expanduser()
        self.path = directory / _DB_NAME
        self.max_bytes = max_bytes or None  # None: unbounded
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._pid = 0
        self._failing: set[str] = set()  # operations that failed last time: warned once per run
        try:
            _make_private(directory, self.path)
            with self._write() as db:
                _create_or_migrate(db)
        except (OSError, sqlite3.Error) as exc:
            self.close()
            # At start-up, as a setting to fix (CLI exit 2, the service's /readyz): not a traceback
            # after the index was opened.
            raise ConfigError(f"cache_dir: cannot use {self.path} for the response cache: {_reason(exc)}") from exc

    def _connection(self) -> sqlite3.Connection:
        """The store's connection (call with `_lock` held); a forked child opens its own."""
        if self._db is None or self._pid != os.getpid():
            db = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT, isolation_level=None, check_same_thread=False)
            try:
                db.execute("PRAGMA journal_mode=WAL")  # kept in the file: a no-op after the first open
                db.execute("PRAGMA synchronous=NORMAL")
                db.execute("PRAGMA journal_size_limit=8388608")  # the log shrinks back after an eviction
            except BaseException:
                db.close()
                raise
            self._db, self._pid = db, os.getpid()
        return self._db

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self._connection()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """A write transaction holding the file's write lock from its start: a transaction that read
        first and then wrote could fail at once with "database is locked" instead of waiting."""
        with self._lock:
            db = self._connection()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:  # a failed COMMIT (disk full) must not keep the write lock
                    db.execute("ROLLBACK")
                raise

    def close(self) -> None:
        with self._lock:
            db, self._db = self._db, None
            if db is not None and self._pid == os.getpid():  # a forked child leaves its parent's alone
                db.close()

    def get(self, key: bytes) -> tuple[str, Usage] | None:
        """The stored answer and its original usage, or None (also when the cache cannot be read)."""
        try:
            with self._read() as db:
                rows = db.execute(
                    f"SELECT text, prompt_tokens, output_tokens, last_used FROM {_TABLE} WHERE key = ?", (key,)
                ).fetchall()  # all: a statement left open would keep its read transaction
        except sqlite3.Error as exc:
            self._failed("lookup", exc)
            return None
        self._failing.discard("lookup")
        if not rows:
            return None
        text, prompt_tokens, output_tokens, last_used = rows[0]
        now = time.time()
        if now - last_used > _TOUCH_INTERVAL:
            self._touch(key, now)
        return text, Usage(prompt_tokens, output_tokens, 1)

    def _touch(self, key: bytes, now: float) -> None:
        """Record a use, so eviction takes the entries used longest ago."""
        try:
            with self._write() as db:
                db.execute(f"UPDATE {_TABLE} SET last_used = ? WHERE key = ?", (now, key))
        except sqlite3.Error as exc:
            self._failed("store", exc)

    def put(self, key: bytes, endpoint: str, model: str, text: str, usage: Usage) -> None:
        size = len(key) + len(endpoint) + len(model) + len(text.encode("utf-8", "surrogatepass")) + _ENTRY_OVERHEAD
        now = time.time()
        try:
            with self._write() as db:
                db.execute(
                    f"INSERT OR REPLACE INTO {_TABLE} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (key, endpoint, model, text, usage.prompt_tokens, usage.output_tokens, size, now, now),
                )
                if self.max_bytes is not None and _used_bytes(db) > self.max_bytes:
                    self._evict(db)
        except sqlite3.Error as exc:
            self._failed("store", exc)
            return
        self._failing.discard("store")

    def _evict(self, db: sqlite3.Connection) -> None:
        """Delete the least recently used entries until the file's live pages fit `_EVICT_TO` of the
        bound (sizes are estimates, so it checks the pages again after each batch)."""
        assert self.max_bytes is not None
        target = int(self.max_bytes * _EVICT_TO)
        while (excess := _used_bytes(db) - target) > 0:
            # The last use up to which the oldest entries add up to the excess (all of them if they
            # do not); read from the (last_used, size) index alone.
            cutoff = db.execute(
                f"SELECT coalesce((SELECT last_used FROM (SELECT last_used, sum(size) OVER (ORDER BY last_used) AS freed "
                f"FROM {_TABLE}) WHERE freed >= ? LIMIT 1), (SELECT max(last_used) FROM {_TABLE}))",
                (excess,),
            ).fetchall()[0][0]
            if cutoff is None or db.execute(f"DELETE FROM {_TABLE} WHERE last_used <= ?", (cutoff,)).rowcount == 0:
                return  # nothing left to evict
            log.debug("response cache %s: evicted entries last used up to %s", self.path, cutoff)

    def size_bytes(self) -> int:
        """Bytes the entries take in the file (its live pages)."""
        with self._read() as db:
            return _used_bytes(db)

    def _failed(self, what: str, exc: sqlite3.Error) -> None:
        if what not in self._failing:  # once per run of failures, not once per call
            log.warning("response cache %s: %s failed (%s); answers come from the model meanwhile", self.path, what, exc)
        self._failing.add(what)

    def __len__(self) -> int:
        with self._read() as db:
            return int(db.execute(f"SELECT COUNT(*) FROM {_TABLE}").fetchone()[0])


def _used_bytes(db: sqlite3.Connection) -> int:
    """The file's pages in use (pages freed by deletes are reused, not counted)."""
    return db.execute(
        "SELECT page_size * (page_count - freelist_count) FROM pragma_page_size, pragma_page_count, pragma_freelist_count"
    ).fetchall()[0][0]


def _create_or_migrate(db: sqlite3.Connection) -> None:
    """The answers table, in this version's layout. A table of another layout is dropped, not read:
    the first version's `responses` was keyed without the endpoint, so its answers cannot be told
    apart by server (and a cache holds nothing that cannot be asked again)."""
    db.execute("DROP TABLE IF EXISTS responses")
    layout = [row[1] for row in db.execute(f"PRAGMA table_info({_TABLE})")]
    if layout and layout != _COLUMNS:
        db.execute(f"DROP TABLE {_TABLE}")
    db.execute(
        f"CREATE TABLE IF NOT EXISTS {_TABLE} (key BLOB PRIMARY KEY, endpoint TEXT NOT NULL, model TEXT NOT NULL, "
        "text TEXT NOT NULL, prompt_tokens INTEGER, output_tokens INTEGER, size INTEGER NOT NULL, "
        "created REAL NOT NULL, last_used REAL NOT NULL)"
    )
    db.execute(f"CREATE INDEX IF NOT EXISTS {_TABLE}_last_used ON {_TABLE} (last_used, size)")


def _make_private(directory: Path, path: Path) -> None:
    """The cache holds every answer (and what the prompts asked): a directory it creates is 0700 and
    its files 0600 whatever the umask. SQLite gives its -wal / -shm files the database file's mode.
    A file an older version left readable by others is tightened, when it is ours."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    if os.name != "posix":
        return
    for file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            info = file.stat()
        except FileNotFoundError:
            continue
        if info.st_mode & 0o077 and info.st_uid == os.getuid():
            file.chmod(0o600)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f" ({exc.filename})" if exc.filename else "")
    return str(exc) or type(exc).__name__


class CachedChatModel:
    """Wraps a ChatModel with the on-disk cache. Misses go to the inner model."""

    def __init__(self, inner: ChatModel, cache_dir: Path, *, endpoint: str | None = None,
                 max_bytes: int | None = CACHE_MAX_BYTES):
        self.inner = inner
        self.model_id = inner.model_id
        self.endpoint = endpoint or model_endpoint(inner)
        # The inner model's fixed context window (the embedded llama.cpp model's 8192), if it has
        # one: DRIFT and local search fit their budgets to it (`fit_to_window`) through this wrapper.
        self.n_ctx = getattr(inner, "n_ctx", None)
        self.store = ResponseStore(cache_dir, max_bytes=max_bytes)
        self.hits = 0
        self.misses = 0

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        params: ChatParams | None = None,
        response_model: type[BaseModel] | None = None,
    ) -> ChatResult:
        key = self.key(messages, params, response_model)
        cached = await asyncio.to_thread(self.store.get, key)
        if cached is not None:
            text, original = cached
            try:
                parsed = parse_structured(text, response_model) if response_model else None
            except StructuredOutputError:
                # Stored by a version that validated differently: asked again (and replaced), not
                # failed on every repeat until the cache is deleted.
                log.info("response cache %s: a stored %s no longer validates; asking the model", self.store.path,
                         response_model.__name__ if response_model else "answer")
            else:
                self.hits += 1
                return ChatResult(text=text, usage=Usage(cached=True), parsed=parsed, model=self.model_id,
                                  raw={"cache": "hit", "original_usage": dataclasses.asdict(original)})
        self.misses += 1
        result = await self.inner.complete(messages, params=params, response_model=response_model)
        await asyncio.to_thread(self.store.put, key, self.endpoint, self.model_id, result.text, result.usage)
        return result

    def key(self, messages: Sequence[Message], params: ChatParams | None,
            response_model: type[BaseModel] | None) -> bytes:
        return cache_key(self.endpoint, self.model_id, messages, params, response_model)

    async def aclose(self) -> None:
        self.store.close()  # reopened if the model is used again
        await aclose_models(self.inner)

    def stream(self, messages: Sequence[Message], *, params: ChatParams | None = None) -> CachedStream:
        return CachedStream(self, list(messages), params)


class CachedStream(GeneratorStream):
    """Replays a cached answer as one delta, or streams from the inner model and stores the
    complete answer once the stream is exhausted (an abandoned stream is not stored)."""

    def __init__(self, owner: CachedChatModel, messages: list[Message], params: ChatParams | None):
        super().__init__()
        self._owner = owner
        self._messages = messages
        self._params = params

    async def _run(self) -> AsyncIterator[str]:
        owner = self._owner
        key = owner.key(self._messages, self._params, None)
        cached = await asyncio.to_thread(owner.store.get, key)
        if cached is not None:
            owner.hits += 1
            self.usage = Usage(cached=True)
            yield cached[0]
            return
        owner.misses += 1
        inner = owner.inner.stream(self._messages, params=self._params)
        parts: list[str] = []
        try:
            async for delta in inner:
                parts.append(delta)
                yield delta
        finally:
            await inner.aclose()
        self.usage = inner.usage
        await asyncio.to_thread(owner.store.put, key, owner.endpoint, owner.model_id, "".join(parts), inner.usage)
