"""Matrix products of the exact search path.

OpenBLAS (numpy's BLAS) hands a product to a helper thread and that thread then spins for ~0.1 s
waiting for more work. On this project's 2-core machine the helper burned ~460 ms of CPU per DRIFT
query (the engine's own thread used ~310 ms), CPU a service's other queries and a local LLM server
need. A batch of queries runs on the calling thread alone: a 20 x 10^4 x 1536 product takes the
same ~11 ms either way. A single query keeps the helper: its memory-bound matrix-vector product is
~30% faster with it (2.2 vs 3.1 ms at 10^4 x 1536).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np

__all__ = ["similarity_scores"]


def similarity_scores(queries: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """`queries @ columns`: one row of scores per query (rows of `queries`)."""
    if len(queries) == 1:
        return queries @ columns
    # The thread count is process-wide: a lock keeps callers on other threads from restoring it
    # under each other (they would compete for the same cores anyway).
    with _LIMIT_LOCK, _controller().limit(limits=1, user_api="blas"):
        return queries @ columns


_LIMIT_LOCK = threading.Lock()


@functools.cache
def _controller() -> Any:
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()  # finds the loaded BLAS libraries once (~3 ms)
