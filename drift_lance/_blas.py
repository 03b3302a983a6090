"""Matrix products of the exact search path.

OpenBLAS (numpy's BLAS) hands a product to a helper thread and that thread then spins for ~0.1 s
waiting for more work. On this project's 2-core machine the helper burned ~460 ms of CPU per DRIFT
query (the engine's own thread used ~310 ms), CPU a service's other queries and a local LLM server
need. So every product here runs with BLAS held to one thread, and a large batch is split by rows
of the table between the calling thread and one worker of our own, which blocks instead of spinning
when done: a 20 x 10^4 x 1536 product takes ~7 ms instead of ~11 ms, with no spin after it.
Single queries too: the helper halves a 10^4 x 384 product (~90 against ~170 us), but a query every
20 ms then kept it spinning, 4.2 s of CPU in 6 s, and two busy processes beside it lost a third of
their throughput. Tables where that product costs most are screened with int8 codes instead
(`_exact.py`), on one thread.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from drift_lance._cores import usable_cores

__all__ = ["similarity_scores"]

# Below this many multiply-adds a batch is scored on the calling thread: handing half of it to the
# worker costs ~0.1 ms, which only pays off from a few milliseconds of work.
SPLIT_MIN_MULTIPLY_ADDS = 50_000_000


def similarity_scores(queries: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """`queries @ columns`: one row of scores per query (rows of `queries`)."""
    work = queries.shape[0] * columns.shape[0] * columns.shape[1]
    # The thread count is process-wide: a lock keeps callers on other threads from restoring it
    # under each other (they would compete for the same cores anyway).
    with _LIMIT_LOCK, _controller().limit(limits=1, user_api="blas"):
        worker = _worker()
        if work < SPLIT_MIN_MULTIPLY_ADDS or worker is None:
            return queries @ columns
        half = columns.shape[1] // 2
        other = worker.submit(np.matmul, queries, columns[:, half:])
        first = queries @ columns[:, :half]
        return np.concatenate([first, other.result()], axis=1)


_LIMIT_LOCK = threading.Lock()


@functools.cache
def _controller() -> Any:
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()  # finds the loaded BLAS libraries once (~3 ms)


@functools.cache
def _worker() -> ThreadPoolExecutor | None:
    """One helper thread for the second half of large batches; none on a single-core machine."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="drift-lance-blas") if usable_cores() > 1 else None
