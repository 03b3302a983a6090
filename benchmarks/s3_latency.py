"""Query latency on local disk versus S3-compatible object storage on loopback.

The same GraphRAG index is ingested into a local folder and into moto's S3 server (127.0.0.1), behind
the counting proxy of `drift_lance.testing.s3`, optionally with a fixed delay per request to imitate
a remote store's round trip. For each storage, in a fresh process: open the store, then per query a
top-10 vector search on `entities` and a full local-search context build (defaults), reporting
p50/p95 and the object-store requests (by kind) and bytes per query. The first query of each kind
is reported apart (cold caches: table metadata, index files, the exact-path vector matrix).

    python -m benchmarks s3 --rows 10000 --dim 384 --queries 30 [--latency-ms 0,20] [--dulce]

Writes benchmarks/results/s3_latency.json and s3_latency.md.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import Record, latency_summary, load_records, log, run_case, write_records

NAME = "s3_latency"
BUCKET = "drift-lance-bench"


# ---------------------------------------------------------------- subprocess case body

def query_case(db: str, queries_file: str, queries: int, storage_options: dict[str, str] | None,
               proxy: str | None, table_cache_bytes: int | None = None) -> dict[str, Any]:
    """Vector search and context build latencies (+ request counts when `proxy` is given)."""
    from drift_lance._lance_store import open_store
    from drift_lance.config.ingest import StoreConfig
    from drift_lance.local import build_local_context
    from drift_lance.testing.s3 import RequestCounts

    qv = np.load(queries_file)[:queries].astype(np.float32)

    def counts() -> RequestCounts:
        if proxy is None:
            return RequestCounts()
        import httpx

        data = httpx.get(f"{proxy}/_proxy/counts", timeout=10).json()
        return RequestCounts(data["by_kind"], data["bytes_out"])

    async def run() -> dict[str, Any]:
        before = counts()
        t0 = time.perf_counter()
        config = StoreConfig() if table_cache_bytes is None else StoreConfig(table_cache_bytes=table_cache_bytes)
        store = await open_store(db, storage_options=storage_options, config=config)
        open_ms = (time.perf_counter() - t0) * 1000
        open_requests = (counts() - before).as_dict()
        try:
            phases: dict[str, Any] = {}

            async def vector(i: int) -> None:
                await store.search("entities", qv[i], 10, columns=["id"])

            async def context(i: int) -> None:
                await build_local_context(store, f"benchmark question {i}", query_vector=qv[i])

            for name, op in (("vector_search", vector), ("context", context)):
                before = counts()
                t0 = time.perf_counter()
                await op(0)
                first_ms = (time.perf_counter() - t0) * 1000
                first_requests = (counts() - before).as_dict()
                latencies, per_query = [], []
                for i in range(1, len(qv)):
                    before = counts()
                    t0 = time.perf_counter()
                    await op(i)
                    latencies.append(time.perf_counter() - t0)
                    per_query.append((counts() - before).as_dict())
                phases[name] = {
                    **latency_summary(latencies),
                    "qps": len(latencies) / sum(latencies),
                    "queries": len(latencies),
                    "first_ms": first_ms,
                    "first_requests": first_requests,
                    "requests_per_query": {k: statistics.fmean(q[k] for q in per_query) for k in per_query[0]}
                    if proxy else None,
                }
            return {"open_ms": open_ms, "open_requests": open_requests, "phases": phases}
        finally:
            await store.close()

    return asyncio.run(run())


def ingest_case(src: str, db: str, storage_options: dict[str, str] | None) -> dict[str, Any]:
    import ingest

    t0 = time.perf_counter()
    report = ingest.ingest(src, db, storage_options=storage_options, progress=False)
    return {"seconds": time.perf_counter() - t0, "rows": report.rows,
            "vector_indexes": {k: v.vector_index for k, v in report.manifest.tables.items()}}


# ---------------------------------------------------------------- driver

def _dataset(rows: int, dim: int, work: Path, out: Path, dulce: Path | None) -> dict[str, Any]:
    """Source folder, local db and query vectors of the dataset to measure."""
    if dulce is not None:
        import json

        golden = dulce.parent.parent / "golden" / "local_context_dulce_v3.json"
        base = work / "s3_latency" / "dulce"
        base.mkdir(parents=True, exist_ok=True)
        queries = base / "queries.npy"
        cases = json.loads(golden.read_text())["cases"]
        np.save(queries, np.asarray([c["query_vector"] for c in cases], dtype=np.float32))
        db = base / "db"
        if not db.exists():
            run_case("benchmarks.s3_latency:ingest_case", src=str(dulce), db=str(db), storage_options=None)
        return {"name": "dulce", "rows": None, "dim": 3072, "src": str(dulce), "db": str(db), "queries": str(queries)}
    from benchmarks.engine import ensure_ingested

    # The generated source and queries are shared with the other benchmarks; the local database is
    # ingested here with today's defaults, like the S3 copy, so both have the same indexes.
    meta = ensure_ingested(rows, dim, work, out)
    name = f"synthetic-{rows}x{dim}"
    src = str(Path(meta["dir"]) / "graphrag")
    db = work / "s3_latency" / name / "db"
    if not db.exists():
        run_case("benchmarks.s3_latency:ingest_case", src=src, db=str(db), storage_options=None)
    return {"name": name, "rows": rows, "dim": dim, "src": src, "db": str(db),
            "queries": str(Path(meta["dir"]) / "engine_queries.npy")}


def run_s3_latency(rows: int, dim: int, queries: int, out: Path, work: Path, *,
                   latencies_ms: list[float], dulce: Path | None = None) -> list[Record]:
    from drift_lance.testing.s3 import LocalS3

    data = _dataset(rows, dim, work, out, dulce)
    records: list[Record] = []
    log(f"s3 latency: {data['name']} on local disk")
    local = run_case("benchmarks.s3_latency:query_case", db=data["db"], queries_file=data["queries"],
                     queries=queries, storage_options=None, proxy=None)
    records += _records(data, "local", local, None, queries)
    for latency in latencies_ms:
        with LocalS3(latency_ms=latency) as s3:
            s3.create_bucket(BUCKET)
            uri = f"s3://{BUCKET}/{data['name']}"
            log(f"s3 latency: ingest {data['name']} into {uri} (proxy delay {latency:g} ms)")
            ingested = run_case("benchmarks.s3_latency:ingest_case", src=data["src"], db=uri,
                                storage_options=s3.storage_options())
            log(f"s3 latency: {data['name']} on loopback S3 (+{latency:g} ms per request)")
            result = run_case("benchmarks.s3_latency:query_case", db=uri, queries_file=data["queries"],
                              queries=queries, storage_options=s3.storage_options(), proxy=s3.endpoint)
            records += _records(data, f"s3+{latency:g}ms", result, ingested, queries)
            # Tables too large for the table cache: every row lookup is an object-store read.
            result = run_case("benchmarks.s3_latency:query_case", db=uri, queries_file=data["queries"],
                              queries=queries, storage_options=s3.storage_options(), proxy=s3.endpoint,
                              table_cache_bytes=0)
            records += _records(data, f"s3+{latency:g}ms, no table cache", result, ingested, queries)
    write_records(out, NAME, records)
    render(out)
    return records


def _records(data: dict[str, Any], storage: str, result: dict[str, Any], ingested: dict[str, Any] | None,
             queries: int) -> list[Record]:
    records = []
    for phase, stats in result["phases"].items():
        records.append(Record(
            benchmark=NAME, rows=data["rows"], dim=data["dim"], method=f"{data['name']}:{phase}:{storage}",
            p50_ms=stats["p50_ms"], p95_ms=stats["p95_ms"], p99_ms=stats["p99_ms"], qps=stats["qps"],
            queries=stats["queries"], peak_rss_mb=result.get("peak_rss_mb"),
            params={"dataset": data["name"], "phase": phase, "storage": storage, "queries": queries},
            extra={"first_ms": stats["first_ms"], "first_requests": stats["first_requests"],
                   "requests_per_query": stats["requests_per_query"], "open_ms": result["open_ms"],
                   "open_requests": result["open_requests"],
                   "ingest_s": ingested["seconds"] if ingested else None},
        ))
    return records


def render(out: Path) -> Path:
    """s3_latency.md: one row per dataset x phase x storage."""
    rows = sorted(load_records(out, NAME), key=lambda r: (r["params"]["dataset"], r["params"]["phase"], r["params"]["storage"]))
    lines = [
        "# Query latency: local disk vs S3-compatible storage on loopback",
        "",
        "moto S3 server on 127.0.0.1 behind a counting proxy (`s3+N ms` = N ms added per request). "
        "Warm queries after the first; requests and KiB are per query (object store only).",
        "",
        "| dataset | phase | storage | p50 ms | p95 ms | first query ms | GET | LIST | HEAD | KiB read | first query requests |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p, e = r["params"], r["extra"]
        per = e.get("requests_per_query") or {}
        first = e.get("first_requests") or {}
        lines.append(
            f"| {p['dataset']} | {p['phase']} | {p['storage']} | {r['p50_ms']:.1f} | {r['p95_ms']:.1f} | "
            f"{e['first_ms']:.0f} | {_n(per.get('get'))} | {_n(per.get('list'))} | {_n(per.get('head'))} | "
            f"{_n(per['bytes_out'] / 1024 if per else None)} | {first.get('total', '-') if per else '-'} |"
        )
    path = out / f"{NAME}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _n(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
