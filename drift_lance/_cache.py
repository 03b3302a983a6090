"""A byte-bounded LRU cache for the store's in-memory copies (exact-search matrices, small tables).

Values are immutable (numpy matrices, Arrow tables), so entries are shared freely between concurrent
searches; the lock only guards the bookkeeping (the service may run stores from several threads).
An entry larger than the whole bound is not kept: the caller falls back to reading LanceDB.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

__all__ = ["BoundedCache", "CacheStats"]


@dataclass(frozen=True, slots=True)
class CacheStats:
    bytes: int
    max_bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int
    rejected: int  # values larger than max_bytes, never cached


class BoundedCache:
    """Least-recently-used entries are evicted once the summed sizes exceed `max_bytes`."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = self._rejected = 0

    @property
    def bytes(self) -> int:
        return self._bytes

    def get(self, key: Hashable) -> Any | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return entry[0]

    def put(self, key: Hashable, value: Any, nbytes: int) -> bool:
        """Keep `value` (evicting older entries as needed); False when it alone exceeds the bound."""
        with self._lock:
            if nbytes > self.max_bytes:
                self._rejected += 1
                return False
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (value, nbytes)
            self._bytes += nbytes
            while self._bytes > self.max_bytes:
                _, (_, size) = self._entries.popitem(last=False)
                self._bytes -= size
                self._evictions += 1
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._bytes, self.max_bytes, len(self._entries), self._hits, self._misses,
                              self._evictions, self._rejected)
