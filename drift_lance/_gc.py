"""Keeping a process's start-up objects out of the cyclic garbage collector's full passes.

After the imports and opening an index, a process holds ~170k objects the collector tracks (the
modules' functions, dicts, pydantic field infos, ...) that live as long as the process does. Python
walks every one of them in each full (generation 2) collection, which it runs once enough new
long-lived objects have piled up: during DRIFT queries at 10^4 entities, every ~4 queries, 120-160
ms each with the event loop stopped, on this project's 2-core VM. `gc.freeze()` moves them into the
permanent generation that collections skip (a full pass then took ~11 ms). Reference counting still
frees them as before; only reference cycles among them are no longer collected. No collection runs
first (~80 ms at start-up): the few cycles of import-time garbage it would free stay in memory.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_long_lived_objects"]


def freeze_long_lived_objects() -> int:
    """Exempt every object tracked now from later collections; returns how many are exempt.
    Call it once a long-running process has imported and opened what it serves (the CLI's `query`
    and the HTTP service do; an application embedding drift-lance does it after its own start-up)."""
    gc.freeze()
    return gc.get_freeze_count()
