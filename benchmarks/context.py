"""Local-search context building: latency (p50/p95/p99), throughput and peak RSS on ingested
synthetic indexes. One build = map the query vector to entities (ANN or exact), fetch their
reports, relationships, claims and text units by key from LanceDB, rank and render with Polars."""

from __future__ import annotations

import asyncio
import hashlib
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

            digests: dict[int, str] = {}

            async def build(i: int) -> int:
                context = await builder.build(f"benchmark question {i}", query_vector=qv[i])
                digests[i] = hashlib.sha1(context.context_text.encode()).hexdigest()
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
                    "queries": len(qv), "first_build_ms": first_ms, "mean_context_tokens": float(np.mean(tokens)),
                    "context_sha1": [digests[i] for i in range(len(qv))]}
        finally:
            await store.close()

    return asyncio.run(run())


def run_context(rows: int, dim: int, queries: int, out: Path, work: Path, *,
                graphrag: str | None = None) -> list[Record]:
    """Our builder, then (when a graphrag interpreter is given or importable) graphrag's own on the
    same index, query vectors and parameters."""
    from benchmarks import graphrag_side

    meta = ensure_ingested(rows, dim, work, out, queries=max(queries, 100))
    available = len(np.load(Path(meta["dir"]) / "engine_queries.npy", mmap_mode="r"))
    if queries > available:  # one query per entity at most, and at most RECALL_QUERIES
        log(f"  {queries} queries asked for; the dataset has {available}: using {available}")
        queries = available
    log(f"context building on {rows:,} entities x {dim} ({queries} queries)")
    case = run_case("benchmarks.context:context_case", db=meta["db"], data_dir=meta["dir"], queries=queries)
    records = [Record(
        benchmark="context", rows=rows, dim=dim, method="drift_lance_local_context",
        p50_ms=case["p50_ms"], p95_ms=case["p95_ms"], p99_ms=case["p99_ms"], qps=case["qps"],
        qps_concurrent=case["qps_concurrent"], concurrency=CONCURRENCY, peak_rss_mb=case["peak_rss_mb"],
        queries=case["queries"], params={"config": "LocalSearchConfig defaults"},
        extra={"first_build_ms": case["first_build_ms"], "mean_context_tokens": case["mean_context_tokens"]},
    )]
    write_records(out, "context", records)
    python = graphrag_side.graphrag_python(graphrag)
    if python is None:
        graphrag_side.not_available_note()
        return records
    log(f"  graphrag {rows:,} entities: LocalSearchMixedContext.build_context")
    theirs = run_case("benchmarks.graphrag_side:graphrag_context_case", python=python,
                      env=graphrag_side.tiktoken_cache_env(), src=str(Path(meta["dir"]) / "graphrag"),
                      data_dir=meta["dir"], queries=queries, dim=dim, params=graphrag_params())
    records.append(Record(
        benchmark="context", rows=rows, dim=dim, method="graphrag_local_context",
        p50_ms=theirs["p50_ms"], p95_ms=theirs["p95_ms"], p99_ms=theirs["p99_ms"], qps=theirs["qps"],
        peak_rss_mb=theirs["peak_rss_mb"], queries=theirs["queries"], params={"config": "same values, graphrag 3.3.0"},
        versions=theirs.get("versions", {}),
        extra={"first_build_ms": theirs["first_build_ms"], "mean_context_tokens": theirs["mean_context_tokens"],
               "load_s": theirs["load_s"],
               # same query vector and parameters: how many context texts are byte-identical to ours
               "identical_contexts": sum(a == b for a, b in zip(case["context_sha1"], theirs["context_sha1"], strict=True))},
    ))
    write_records(out, "context", records[-1:])
    return records


def graphrag_params() -> dict[str, Any]:
    """Our LocalSearchConfig defaults as graphrag's build_context keyword arguments."""
    from drift_lance.config.local import LocalSearchConfig

    cfg = LocalSearchConfig()
    return {
        "max_context_tokens": cfg.max_context_tokens, "text_unit_prop": cfg.text_unit_prop,
        "community_prop": cfg.community_prop, "top_k_mapped_entities": cfg.top_k_entities,
        "top_k_relationships": cfg.top_k_relationships, "include_entity_rank": cfg.include_entity_rank,
        "include_relationship_weight": cfg.include_relationship_weight,
        "include_community_rank": cfg.include_community_rank, "min_community_rank": cfg.min_community_rank,
        "use_community_summary": cfg.use_community_summary, "column_delimiter": cfg.column_delimiter,
        "community_level": cfg.community_level,
    }
