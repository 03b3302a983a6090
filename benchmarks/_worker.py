"""Fresh-process runner for one benchmark case: `python -m benchmarks._worker '<json spec>'`.

The spec is {"target": "module:function", "kwargs": {...}}; the function returns a JSON-able dict,
printed on a marked stdout line together with this process's peak RSS and wall time.
"""

from __future__ import annotations

import importlib
import json
import sys
import time

from benchmarks._harness import emit_result, library_versions, peak_rss_mb


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    module_name, func_name = spec["target"].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    started = time.perf_counter()
    result = func(**spec["kwargs"])
    result = dict(result)
    result.setdefault("peak_rss_mb", peak_rss_mb())
    # this interpreter's libraries: graphrag's cases run in graphrag's own virtualenv
    result.setdefault("versions", library_versions())
    result["wall_s"] = time.perf_counter() - started
    emit_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
