"""Quick sweep behind ingest's default ANN index (README, section "Ingest").

    python -m benchmarks.index_choice --rows 10000 100000 --dims 384 1536 [--queries 100]

For each size: entity vectors from `ingest.synthetic` (clustered, unit norm), one LanceDB table per
candidate index (IVF_HNSW_SQ, IVF_PQ + refine_factor, IVF_FLAT, built exactly as `ingest.writer`
builds them), top-10 queries that are noisy copies of random entities, recall@10 against exact
cosine (numpy), latency percentiles and build time. Appends JSON lines to OUT/index_choice.jsonl
(`--out`, default benchmarks/results/, the README's figures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import time
from pathlib import Path

import lance
import lancedb
import numpy as np
import pyarrow as pa

from benchmarks import DEFAULT_RESULTS_DIR
from benchmarks._harness import latency_summary, library_versions, machine_info
from benchmarks.retrieval import WARMUP_QUERIES
from ingest.writer import pq_sub_vectors
from drift_lance.config.ingest import VectorIndexConfig
from ingest.synthetic import generate_index
from ingest.writer import _vector_index

RESULTS_NAME = "index_choice.jsonl"


def candidates(rows: int, dim: int) -> list[tuple[VectorIndexConfig, list[dict]]]:
    """(build config, query settings to try) per index type."""
    ivf = max(1, round(np.sqrt(rows)))
    return [
        (
            VectorIndexConfig(type="IVF_HNSW_SQ", num_partitions=max(1, rows // 100_000)),
            [{"nprobes": 1, "ef": None}, {"nprobes": 1, "ef": 64}, {"nprobes": 1, "ef": 128}],
        ),
        (
            VectorIndexConfig(type="IVF_PQ", num_partitions=ivf, num_sub_vectors=pq_sub_vectors(dim)),
            [{"nprobes": 20, "refine_factor": 10}, {"nprobes": 40, "refine_factor": 10}, {"nprobes": 40, "refine_factor": 20}],
        ),
        (
            VectorIndexConfig(type="IVF_FLAT", num_partitions=ivf),
            [{"nprobes": 20}, {"nprobes": 40}, {"nprobes": 80}],
        ),
    ]


async def sweep(rows: int, dim: int, n_queries: int, work: Path, types: list[str] | None = None) -> list[dict]:
    src = generate_index(work / f"src-{rows}-{dim}", n_entities=rows, dim=dim, seed=0)
    data = lance.dataset(str(src / "lancedb" / "entity_description.lance")).to_table()
    matrix = np.stack(data["vector"].to_numpy(zero_copy_only=False)).astype(np.float32)
    rng = np.random.default_rng(42)
    picks = rng.choice(rows, size=n_queries, replace=False)
    queries = matrix[picks] + (0.5 / np.sqrt(dim)) * rng.standard_normal((n_queries, dim)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    truth = [set(np.argsort(-(matrix @ q), kind="stable")[:10].tolist()) for q in queries]
    db = await lancedb.connect_async(str(work / f"db-{rows}-{dim}"))
    table_data = pa.table({"row": np.arange(rows), "vector": data["vector"]})
    out = []
    for config, settings in candidates(rows, dim):
        if types and config.type not in types:
            continue
        table = await db.create_table(config.type.lower(), data=table_data, mode="overwrite")
        start = time.perf_counter()
        await table.create_index("vector", config=_vector_index(config, rows, dim), replace=True)
        build_s = time.perf_counter() - start
        for setting in settings:
            async def search(q: np.ndarray, setting: dict = setting) -> list[int]:
                query = (table.vector_search(q).distance_type("cosine").nprobes(setting["nprobes"]).limit(10)
                         .select(["row", "_distance"]))  # named, or lance warns on every query
                if setting.get("refine_factor"):
                    query = query.refine_factor(setting["refine_factor"])
                if setting.get("ef"):
                    query = query.ef(setting["ef"])
                return (await query.to_arrow())["row"].to_pylist()

            for q in queries[:WARMUP_QUERIES]:  # as the retrieval benchmark warms up: index loads untimed
                await search(q)
            latencies, hits = [], 0
            started = time.perf_counter()
            for q, expected in zip(queries, truth, strict=True):
                t0 = time.perf_counter()
                found = await search(q)
                latencies.append(time.perf_counter() - t0)
                hits += len(expected & set(found))
            serial_s = time.perf_counter() - started
            record = {
                "rows": rows,
                "dim": dim,
                "method": "lancedb_ann",
                "index": config.type,
                "build": config.model_dump(exclude_none=True, exclude={"distance_type"}),
                "query": setting,
                "queries": n_queries,
                "recall_at_10": round(hits / (10 * n_queries), 4),
                **{k: round(v, 2) for k, v in latency_summary(latencies).items()},
                "qps": round(n_queries / serial_s, 1),
                # one process builds every candidate: its peak RSS would be the largest so far, not this index's
                "peak_rss_mb": None,
                "build_s": round(build_s, 1),
                "machine": machine_info(),
                "versions": library_versions(),
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            print(json.dumps(record), flush=True)
            out.append(record)
    shutil.rmtree(work / f"db-{rows}-{dim}", ignore_errors=True)
    shutil.rmtree(src, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.index_choice", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--dims", type=int, nargs="+", default=[384, 1536])
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--types", nargs="+", default=None, help="subset of IVF_HNSW_SQ IVF_PQ IVF_FLAT")
    parser.add_argument("--work", type=Path, default=Path(__file__).resolve().parent / "work" / "index_choice")
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR,
                        help=f"results directory: appends to OUT/{RESULTS_NAME} (default: the committed figures)")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for rows in args.rows:
        for dim in args.dims:
            records = asyncio.run(sweep(rows, dim, args.queries, args.work, args.types))
            with (args.out / RESULTS_NAME).open("a") as f:
                for record in records:
                    f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
