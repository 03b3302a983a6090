"""`import lancedb`, without paying for the REST namespace client at start-up.

`lancedb` imports `lance_namespace`, which imports `lance_namespace_urllib3_client.models`; the
package `__init__` of that client also imports its nine API modules, whose 366 pydantic
`validate_call` wrappers cost 0.5-2 s of every process start (measured here: `import lancedb`
1.87 s -> 1.01 s). We only use local and object-store connections, never the REST namespace, so the
client's `__init__` runs on first attribute access instead of at import. Submodules such as
`.models` load normally. If the client package is missing or already imported, this does nothing.

lancedb also decorates about a hundred methods with `overrides.override`, which disassembles the
calling frame's bytecode at class creation to check each one (0.3 s); during lancedb's import the
decorator only marks the method, as `override` itself does after the check.

Lance sizes its CPU pool as the cores minus two kept for IO (at least one thread). Our IO is the OS
page cache or object-store requests that wait on the network, so on small machines that kept a core
idle while a DRIFT epoch's ANN queries queued on one thread; the pool gets every usable core unless
`LANCE_CPU_THREADS` is set (read once, when Lance first runs CPU work).

Index statistics (which a reload reads to check that every index file of a new generation is there)
leave out an IVF index's centroids, as Lance will by default, unless `LANCE_INCLUDE_VECTOR_CENTROIDS`
is set: with them Lance warns on every call. Both variables are set here, at import, before any Lance
thread runs: setting the environment later, from Python, races with Rust threads reading it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

from drift_lance._cores import usable_cores

_CLIENT = "lance_namespace_urllib3_client"


def _defer_package_init(name: str) -> None:
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return
    module = importlib.util.module_from_spec(spec)
    lock = threading.Lock()
    loaded = False

    def __getattr__(attr: str) -> object:  # PEP 562: only called for names not yet defined
        nonlocal loaded
        with lock:
            if not loaded:
                loaded = True
                del module.__getattr__  # the real __init__ defines everything it exports
                spec.loader.exec_module(module)  # type: ignore[union-attr]
        try:
            return module.__dict__[attr]
        except KeyError:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}") from None

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules[name] = module


@contextlib.contextmanager
def _unchecked_overrides() -> Iterator[None]:
    try:
        import overrides
    except ImportError:
        yield
        return

    def mark(method: Any = None, **_: Any) -> Any:
        if method is None:
            return mark
        method.__override__ = True
        return method

    checked = overrides.override
    overrides.override = mark
    try:
        yield
    finally:
        overrides.override = checked


# 10^6 x 1536 entities on 2 cores: an epoch's 20 ANN queries 191-207 -> 127-133 ms, 8 concurrent
# queries 106-108 -> 131-137 QPS, a single query unchanged (it runs on one thread either way).
os.environ.setdefault("LANCE_CPU_THREADS", str(usable_cores()))
os.environ.setdefault("LANCE_INCLUDE_VECTOR_CENTROIDS", "false")
_defer_package_init(_CLIENT)
with _unchecked_overrides():
    import lancedb

__all__ = ["lancedb"]
