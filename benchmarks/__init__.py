"""drift-lance benchmarks: `python -m benchmarks {retrieval,sweep,context,drift,ingest,report,all}`.

Every case runs in a fresh subprocess (`benchmarks._worker`) so peak RSS and warm caches of one case
never leak into the next. Results are lists of JSON records under `benchmarks/results/` (or --out),
rendered to `results.md` and PNG plots by `benchmarks.report`.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
DEFAULT_RESULTS_DIR = PACKAGE_DIR / "results"
# Generated datasets and databases (git-ignored); override with DRIFT_LANCE_BENCH_WORK.
DEFAULT_WORK_DIR = PACKAGE_DIR / "work"
