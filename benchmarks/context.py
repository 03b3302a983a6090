"""Local-search context building: latency (p50/p95/p99), throughput and peak RSS on ingested
synthetic indexes. One build = map the query vector to entities (ANN or exact), fetch their
reports, relationships, claims and text units by key from LanceDB, rank and render with Polars."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import Record, latency_summary, log, run_case, write_records
from benchmarks.engine import ensure_ingested

CONCURRENCY = 8


def context_case(db: str, data_dir: str, queries: int) -> dict[str, Any]:
    from drift_lance._lance_store import open_store
    from drift_lance.local import LocalContextBuilder

    qv = np.load(Path(data_dir) / "engine_queries.npy")[:queries]

    async def run() -> dict[str, Any]:
        store = await open_store(db)
        try:
            builder = LocalContextBuilder(store)

            async def build(i: int) -> int:
                context = await builder.build(f"benchmark question {i}", query_vector=qv[i])
                return context.token_count

            t0 = time.perf_counter()
            await build(0)  # first build opens tables and loads indexes: reported separately
            first_ms = (time.perf_counter() - t0) * 1000
            latencies, tokens = [], []
            serial_start = time.perf_counter()
            for i in range(len(qv)):
                t0 = time.perf_counter()
                tokens.append(await build(i))
                latencies.append(time.perf_counter() - t0)
            serial_s = time.perf_counter() - serial_start
            gate = asyncio.Semaphore(CONCURRENCY)

            async def gated(i: int) -> int:
                async with gate:
                    return await build(i)

            conc_start = time.perf_counter()
            await asyncio.gather(*(gated(i) for i in range(len(qv))))
            conc_s = time.perf_counter() - conc_start
            return {**latency_summary(latencies), "qps": len(qv) / serial_s, "qps_concurrent": len(qv) / conc_s,
                    "queries": len(qv), "first_build_ms": first_ms, "mean_context_tokens": float(np.mean(tokens))}
        finally:
            await store.close()

    return asyncio.run(run())


def run_context(rows: int, dim: int, queries: int, out: Path, work: Path) -> list[Record]:
    meta = ensure_ingested(rows, dim, work, out, queries=max(queries, 100))
    log(f"context building on {rows:,} entities x {dim} ({queries} queries)")
    case = run_case("benchmarks.context:context_case", db=meta["db"], data_dir=meta["dir"], queries=queries)
    record = Record(
        benchmark="context", rows=rows, dim=dim, method="drift_lance_local_context",
        p50_ms=case["p50_ms"], p95_ms=case["p95_ms"], p99_ms=case["p99_ms"], qps=case["qps"],
        qps_concurrent=case["qps_concurrent"], concurrency=CONCURRENCY, peak_rss_mb=case["peak_rss_mb"],
        queries=case["queries"], params={"config": "LocalSearchConfig defaults"},
        extra={"first_build_ms": case["first_build_ms"], "mean_context_tokens": case["mean_context_tokens"]},
    )
    write_records(out, "context", [record])
    if importlib.util.find_spec("graphrag") is None:
        log("  graphrag not installed (optional extra): no side-by-side graphrag case")
    return [record]
