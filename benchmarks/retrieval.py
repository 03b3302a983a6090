"""Retrieval: top-10 latency, throughput and recall@10 of LanceDB ANN, LanceDB flat scan, numpy brute
force over in-memory vectors (graphrag's way for reports) and the engine's own `store.search`.

Each index build and each query method runs in a fresh subprocess (see `_harness.run_case`), so the
reported peak RSS is that method's alone: numpy's includes the whole matrix, LanceDB's only what it
reads and caches.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import DEFAULT_RESULTS_DIR
from benchmarks._harness import Record, latency_summary, load_records, log, recall_at_k, run_case, write_records
from benchmarks.vectors import TABLE

K = 10
RECALL_TARGET = 0.95
CONCURRENCY = 8
WARMUP_QUERIES = 5
FLAT_SAMPLE_AT_SCALE = 5  # queries for lancedb_flat at 10^6 rows and more
# Queries this far apart measure the process's CPU per query as a service sees it: a BLAS helper
# thread that spins after a product (OpenBLAS's does, ~0.1 s) shows there, not in the latency.
PACED_QUERIES = 25
PACED_GAP_S = 0.02
PAIRED_QUERIES = 50  # ANN vs numpy alternating: numpy takes ~0.2-0.3 s per query at 10^6 x 1536
# Index-backed methods read a few partitions a query, so one query warms little: LanceDB's ANN
# headline gets the engine's warm pass (benchmarks.engine: 1000 recall queries - 100 timed), queries
# other than the timed ones. numpy and the flat scan read every row each query and are in their
# steady state after WARMUP_QUERIES.
ANN_WARM_PASS = 900
METHODS = ("lancedb_ann", "lancedb_flat", "numpy_exact", "engine")


@dataclass(frozen=True)
class IndexSpec:
    """One ANN index build: LanceDB index type plus build parameters (cosine metric throughout)."""

    index_type: str
    build: dict[str, Any] = field(default_factory=dict)

    def label(self) -> str:
        return self.index_type + "".join(f" {k}={v}" for k, v in sorted(self.build.items()))


# ---------------------------------------------------------------- parameter choices

def ivf_partitions(rows: int) -> int:
    """sqrt(rows) partitions (LanceDB's default rule), at least 1."""
    return max(1, int(round(rows**0.5)))


def hnsw_partitions(rows: int) -> int:
    """HNSW graphs per IVF partition stay large (~250k vectors) so each graph is worth building."""
    return max(1, rows // 250_000)


def rq_dimension_ok(dim: int) -> bool:
    """LanceDB's RaBitQ codes (IVF_RQ) need a multiple of 8 dimensions: ingest builds IVF_FLAT instead."""
    return dim % 8 == 0


def sweep_specs(rows: int, dim: int) -> list[tuple[IndexSpec, list[dict[str, Any]]]]:
    """Index builds and their query-parameter grids for the index-type sweep (IVF_RQ only where
    LanceDB can build it)."""
    from ingest.writer import pq_sub_vectors  # here: the writer pulls in lancedb, the numpy cases' processes need not

    p = ivf_partitions(rows)
    # fixed counts, plus a quarter and half of the partitions: at 10^6 rows (1000 partitions) the
    # anisotropic benchmark vectors need 80-160 probes for recall@10 >= 0.95 (80 gave 0.94)
    probes = sorted({n for n in (5, 10, 20, 40, 80, 120) if n <= p} | {min(p, 160)} | {n for n in (p // 4, p // 2) if n > 160})
    hp = hnsw_partitions(rows)
    specs = [
        (IndexSpec("IVF_PQ", {"num_partitions": p, "num_sub_vectors": pq_sub_vectors(dim)}),
         [{"nprobes": n, "refine_factor": r} for n in probes for r in (None, 5, 10, 20, 40)]),
        (IndexSpec("IVF_HNSW_SQ", {"num_partitions": hp, "m": 20, "ef_construction": 150}),
         # LanceDB requires ef >= k * refine_factor.
         [{"nprobes": hp, "ef": ef, "refine_factor": r} for ef in (20, 40, 80, 160, 320) for r in (None, 2)
          if ef >= K * (r or 1)]),
        (IndexSpec("IVF_FLAT", {"num_partitions": p}), [{"nprobes": n} for n in probes]),
        (IndexSpec("IVF_RQ", {"num_partitions": p}),
         [{"nprobes": n, "refine_factor": r} for n in probes for r in (None, 5, 10, 20)]),
    ]
    return [(spec, grid) for spec, grid in specs if spec.index_type != "IVF_RQ" or rq_dimension_ok(dim)]


# ---------------------------------------------------------------- subprocess case bodies

def drop_vector_index_case(db: str) -> dict[str, Any]:
    """Remove an ANN index an earlier run built on the benchmark table (exact methods need none)."""
    import lancedb

    table = lancedb.connect(db).open_table(TABLE)
    dropped = [i.name for i in table.list_indices() if "vector" in i.columns]
    for name in dropped:
        table.drop_index(name)
    return {"dropped": dropped}


def build_index_case(db: str, index_type: str, build: dict[str, Any]) -> dict[str, Any]:
    """Build (replace) the table's vector index; report wall time."""
    import lancedb
    from lancedb import index as lidx

    config_cls = {"IVF_PQ": lidx.IvfPq, "IVF_HNSW_SQ": lidx.HnswSq, "IVF_FLAT": lidx.IvfFlat,
                  "IVF_RQ": lidx.IvfRq, "IVF_HNSW_PQ": lidx.HnswPq, "IVF_SQ": lidx.IvfSq}[index_type]
    table = lancedb.connect(db).open_table(TABLE)
    started = time.perf_counter()
    table.create_index("vector", config=config_cls(distance_type="cosine", **build), replace=True)
    build_s = time.perf_counter() - started
    # What LanceDB built, defaults included: lancedb 0.41 moved IVF_RQ's code width from 1 to 5 bits.
    (index,) = [i for i in table.list_indices() if "vector" in i.columns]
    return {"index_build_s": build_s, "index_details": getattr(index, "index_details", None),
            "index_bytes": getattr(index, "size_bytes", None)}


def drop_index_case(db: str) -> dict[str, Any]:
    import lancedb

    table = lancedb.connect(db).open_table(TABLE)
    for index in table.list_indices():
        table.drop_index(index.name)
    return {}


def lancedb_query_case(db: str, dataset_dir: str, grid: list[dict[str, Any]], flat: bool = False,
                       concurrent: bool = True, queries: int | None = None, warm_pass: bool = False) -> dict[str, Any]:
    """Query the table through LanceDB's async API, once per query-parameter set in `grid`; with
    `warm_pass`, the first set is warmed by the dataset's queries other than the timed ones."""
    import lancedb

    qv, truth = _load_queries(dataset_dir, queries)
    warm = _other_queries(dataset_dir, len(qv)) if warm_pass else None

    async def run() -> list[dict[str, Any]]:
        table = await (await lancedb.connect_async(db)).open_table(TABLE)
        return [await _measure_async(_lancedb_searcher(table, p, flat), qv, truth, p, concurrent,
                                     warm=warm if i == 0 else None) for i, p in enumerate(grid)]

    return {"cases": asyncio.run(run())}


def _lancedb_searcher(table: Any, params: dict[str, Any], flat: bool = False) -> Callable[[np.ndarray], Any]:
    """An async top-K query on the benchmark table with LanceDB query parameters `params`."""
    async def search(q: np.ndarray) -> list[int]:
        query = table.vector_search(q).distance_type("cosine").limit(K).select(["id"])
        if flat:
            query = query.bypass_vector_index()
        if params.get("nprobes") is not None:
            query = query.nprobes(int(params["nprobes"]))
        if params.get("refine_factor") is not None:
            query = query.refine_factor(int(params["refine_factor"]))
        if params.get("ef") is not None:
            query = query.ef(int(params["ef"]))
        return (await query.to_arrow())["id"].to_pylist()

    return search


def paired_ann_numpy_case(db: str, dataset_dir: str, params: dict[str, Any], queries: int = PAIRED_QUERIES) -> dict[str, Any]:
    """LanceDB ANN at `params` against numpy brute force, alternating query by query in one process:
    this VM's speed drifts by +-30% within minutes, which separate runs of the two methods would put
    into their ratio (the 10^6 target is a ratio)."""
    import lancedb

    qv, _ = _load_queries(dataset_dir, queries)
    warm = _other_queries(dataset_dir, len(qv))
    matrix = _load_matrix(lancedb.connect(db).open_table(TABLE))

    async def run() -> dict[str, Any]:
        search = _lancedb_searcher(await (await lancedb.connect_async(db)).open_table(TABLE), params)
        for q in warm if len(warm) else qv[:_warmup(qv)]:  # as the engine's alternating run warms up
            await search(q)
        numpy_p50, ann_p50, timed = await alternating_p50_ms(lambda q: numpy_top_k(matrix, q), search, qv)
        return {"paired_ann_p50_ms": ann_p50, "paired_numpy_p50_ms": numpy_p50,
                "paired_speedup": numpy_p50 / ann_p50, "paired_queries": timed}

    return asyncio.run(run())


async def alternating_p50_ms(first: Callable[[np.ndarray], Any], second: Callable[[np.ndarray], Awaitable[Any]],
                             qv: np.ndarray, rounds: int = 1) -> tuple[float, float, int]:
    """p50 ms of `first` (sync) and `second` (async), run one after the other on each query, `rounds`
    times over `qv`, and how many queries each timed: in one process and interleaved, host noise hits
    both alike."""
    firsts, seconds = [], []
    for _ in range(rounds):
        for q in qv:
            t0 = time.perf_counter()
            first(q)
            t1 = time.perf_counter()
            await second(q)
            t2 = time.perf_counter()
            firsts.append(t1 - t0)
            seconds.append(t2 - t1)
    return float(np.median(firsts)) * 1000, float(np.median(seconds)) * 1000, len(firsts)


def numpy_query_case(db: str, dataset_dir: str, concurrent: bool = True, queries: int | None = None) -> dict[str, Any]:
    """Exact brute force over all vectors held in one float32 matrix, as graphrag does for reports."""
    import lancedb

    qv, truth = _load_queries(dataset_dir, queries)
    table = lancedb.connect(db).open_table(TABLE)
    started = time.perf_counter()
    matrix = _load_matrix(table)
    load_s = time.perf_counter() - started

    def search(q: np.ndarray) -> list[int]:
        return numpy_top_k(matrix, q)

    case = _measure_threads(search, qv, truth, {}, concurrent)
    case["load_s"] = load_s
    case["paced_cpu_ms"] = asyncio.run(paced_cpu_ms(search, qv))
    return {"cases": [case]}


def numpy_top_k(matrix: np.ndarray, q: np.ndarray, k: int = K) -> list[int]:
    """Brute-force top-k row indices, best first: one matrix-vector product, argpartition, sort."""
    scores = matrix @ q
    top = np.argpartition(-scores, k)[:k]
    return top[np.argsort(-scores[top])].tolist()


def engine_query_case(store_uri: str, dataset_dir: str, table: str, concurrent: bool = True,
                      queries: int | None = None) -> dict[str, Any]:
    """The engine's own path: `open_store(uri).search(table, vec, k)` (ANN when indexed, else exact)."""
    from drift_lance._lance_store import open_store

    qv, truth = _load_queries(dataset_dir, queries)

    async def run() -> dict[str, Any]:
        started = time.perf_counter()
        store = await _maybe_await(open_store(store_uri))
        open_s = time.perf_counter() - started
        id_column = "human_readable_id"

        async def search(q: np.ndarray) -> list[int]:
            frame = await store.search(table, q, K, columns=[id_column])
            return frame[id_column].to_list()

        try:
            case = await _measure_async(search, qv, truth, {}, concurrent)
        finally:
            await store.close()
        case["open_s"] = open_s
        info = store.manifest.tables.get(table)
        case["index_type"] = info.vector_index if info else None
        return case

    return {"cases": [asyncio.run(run())]}


async def _maybe_await(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) else value


async def paced_cpu_ms(search: Callable[[np.ndarray], Any], qv: np.ndarray) -> float:
    """The whole process's CPU ms per query (every thread) for queries PACED_GAP_S apart."""
    queries = qv[:PACED_QUERIES]
    started = time.process_time()
    for q in queries:
        await _maybe_await(search(q))
        await asyncio.sleep(PACED_GAP_S)
    return 1000 * (time.process_time() - started) / len(queries)


def _load_queries(dataset_dir: str, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    qv = np.load(Path(dataset_dir) / "queries.npy")
    truth = np.load(Path(dataset_dir) / "truth.npy")[:, :K]
    if limit:
        qv, truth = qv[:limit], truth[:limit]
    return qv, truth


def _load_matrix(table: Any) -> np.ndarray:
    """All vectors into one preallocated matrix, batch by batch (no 2x peak from concatenation)."""
    rows = table.count_rows()
    dim = table.schema.field("vector").type.list_size
    matrix = np.empty((rows, dim), dtype=np.float32)
    reader = table.to_lance().scanner(columns=["id", "vector"], batch_size=65_536).to_reader()
    for batch in reader:
        ids = batch.column("id").to_numpy()
        matrix[ids] = batch.column("vector").values.to_numpy().reshape(-1, dim)
    return matrix


def _other_queries(dataset_dir: str, timed: int, limit: int = ANN_WARM_PASS) -> np.ndarray:
    """Up to `limit` of the dataset's queries after the first `timed` (an untimed warm pass)."""
    return np.load(Path(dataset_dir) / "queries.npy", mmap_mode="r")[timed: timed + limit]


def _warmup(qv: np.ndarray) -> int:
    """Warm-up queries before timing: WARMUP_QUERIES, fewer for a small sample (a 5-query flat scan)."""
    return min(WARMUP_QUERIES, max(1, len(qv) // 4))


async def _measure_async(search: Callable[[np.ndarray], Any], qv: np.ndarray, truth: np.ndarray,
                         params: dict[str, Any], concurrent: bool, warm: np.ndarray | None = None) -> dict[str, Any]:
    """Latency, recall and QPS of `search` over `qv`, after warming it with `warm` (other queries)
    or, without them, with the first WARMUP_QUERIES of `qv`."""
    warm_up = warm if warm is not None and len(warm) else qv[:_warmup(qv)]
    for q in warm_up:
        await search(q)
    latencies, found = [], []
    started = time.perf_counter()
    for q in qv:
        t0 = time.perf_counter()
        found.append(await search(q))
        latencies.append(time.perf_counter() - t0)
    serial_s = time.perf_counter() - started
    case = _case_summary(params, latencies, found, truth, serial_s)
    case["warmup"] = _warmup_note(warm_up is warm, len(warm_up))
    if concurrent:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def gated(q: np.ndarray) -> Any:
            async with gate:
                return await search(q)

        started = time.perf_counter()
        await asyncio.gather(*(gated(q) for q in qv))
        case["qps_concurrent"] = len(qv) / (time.perf_counter() - started)
    return case


def _measure_threads(search: Callable[[np.ndarray], list[int]], qv: np.ndarray, truth: np.ndarray,
                     params: dict[str, Any], concurrent: bool) -> dict[str, Any]:
    from concurrent.futures import ThreadPoolExecutor

    for q in qv[:_warmup(qv)]:
        search(q)
    latencies, found = [], []
    started = time.perf_counter()
    for q in qv:
        t0 = time.perf_counter()
        found.append(search(q))
        latencies.append(time.perf_counter() - t0)
    serial_s = time.perf_counter() - started
    case = _case_summary(params, latencies, found, truth, serial_s)
    case["warmup"] = _warmup_note(False, _warmup(qv))
    if concurrent:
        started = time.perf_counter()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(search, qv))
        case["qps_concurrent"] = len(qv) / (time.perf_counter() - started)
    return case


def _warmup_note(other: bool, count: int) -> str:
    """What ran untimed before a case's timed queries, as the engine's records say it."""
    if other:
        return f"{count} other queries"
    return "the first timed query" if count == 1 else f"the first {count} timed queries"


def _case_summary(params: dict[str, Any], latencies: Sequence[float], found: list[list[int]],
                  truth: np.ndarray, serial_s: float) -> dict[str, Any]:
    return {"params": params, **latency_summary(latencies), "qps": len(latencies) / serial_s,
            "recall_at_10": recall_at_k(found, truth, K), "queries": len(latencies)}


# ---------------------------------------------------------------- orchestration (parent process)

def _records_from(result: dict[str, Any], *, rows: int, dim: int, method: str, concurrent: bool,
                  index_type: str | None = None, build: dict[str, Any] | None = None,
                  build_s: float | None = None, benchmark: str = "retrieval") -> list[Record]:
    records = []
    for case in result["cases"]:
        extra = {k: case[k] for k in ("load_s", "open_s", "paced_cpu_ms", "warmup") if k in case}
        records.append(Record(
            benchmark=benchmark, rows=rows, dim=dim, method=method,
            p50_ms=case["p50_ms"], p95_ms=case["p95_ms"], p99_ms=case["p99_ms"], qps=case["qps"],
            qps_concurrent=case.get("qps_concurrent"), concurrency=CONCURRENCY if concurrent else None,
            recall_at_10=case["recall_at_10"], peak_rss_mb=result["peak_rss_mb"], queries=case["queries"],
            index_type=case.get("index_type", index_type), index_build_s=build_s,
            params={**(build or {}), **{k: v for k, v in case["params"].items() if v is not None}},
            extra=extra, versions=result.get("versions", {}),
        ))
    return records


def build_and_query(meta: dict[str, Any], spec: IndexSpec, grid: list[dict[str, Any]], *,
                    concurrent: bool, benchmark: str, method: str = "lancedb_ann",
                    queries: int | None = None) -> list[Record]:
    log(f"  build {spec.label()} on {meta['rows']:,}x{meta['dim']}")
    built = run_case("benchmarks.retrieval:build_index_case", db=meta["db"], index_type=spec.index_type,
                     build=spec.build)
    log(f"    built in {built['index_build_s']:.1f}s (peak RSS {built['peak_rss_mb']:.0f} MB); querying {len(grid)} settings")
    result = run_case("benchmarks.retrieval:lancedb_query_case", db=meta["db"], dataset_dir=meta["dir"],
                      grid=grid, concurrent=concurrent, queries=queries)
    records = _records_from(result, rows=meta["rows"], dim=meta["dim"], method=method, concurrent=concurrent,
                            index_type=spec.index_type, build=spec.build, build_s=built["index_build_s"],
                            benchmark=benchmark)
    for r in records:
        r.extra |= _built_extra(built)
    return records


def _built_extra(built: dict[str, Any]) -> dict[str, Any]:
    """What a record keeps of its index build: its peak RSS, size and LanceDB's own description."""
    return {"index_build_peak_rss_mb": built["peak_rss_mb"], "index_bytes": built.get("index_bytes"),
            "index_details": built.get("index_details")}


def run_sweep(rows: int, dim: int, queries: int, out: Path, work: Path,
              index_types: Sequence[str] | None = None) -> list[Record]:
    """Index-type sweep: every index type over its query grid -> recall-latency curves."""
    meta = prepare(rows, dim, queries, work)
    records: list[Record] = []
    if "IVF_RQ" in (index_types or ["IVF_RQ"]) and not rq_dimension_ok(dim):
        log(f"  IVF_RQ skipped: LanceDB's RaBitQ codes need a multiple of 8 dimensions, not {dim}")
    for spec, grid in sweep_specs(rows, dim):
        if index_types and spec.index_type not in index_types:
            continue
        new = build_and_query(meta, spec, grid, concurrent=False, benchmark="sweep", queries=queries)
        write_records(out, "sweep", new)
        records += new
    return records


def prepare(rows: int, dim: int, queries: int, work: Path) -> dict[str, Any]:
    log(f"prepare {rows:,}x{dim} ({queries} queries)")
    return run_case("benchmarks.vectors:prepare_dataset", root=str(work), rows=rows, dim=dim, queries=queries)


def run_retrieval(rows: int, dim: int, queries: int, out: Path, work: Path, *,
                  methods: Sequence[str] = METHODS,
                  graphrag: str | None = None) -> list[Record]:
    """The headline comparison at one (rows, dim), plus the recall-latency curve of the chosen index;
    graphrag's own vector-store query first (before any ANN index exists on the table, as graphrag's
    tables have none for rows added after creation) when a graphrag interpreter is available."""
    from benchmarks import graphrag_side
    from benchmarks.recommend import chosen_index

    # LanceDB's ANN headline is warmed by queries other than the timed ones (ANN_WARM_PASS)
    meta = prepare(rows, dim, queries + (ANN_WARM_PASS if "lancedb_ann" in methods else 0), work)
    records: list[Record] = []

    def add(new: list[Record]) -> None:
        write_records(out, "retrieval", new)
        records.extend(new)

    python = graphrag_side.graphrag_python(graphrag)
    if python is None:
        graphrag_side.not_available_note()
    else:
        sample = min(queries, 50 if rows <= 10_000 else 10)  # it scans every vector per query
        log(f"  graphrag LanceDBVectorStore.similarity_search_by_vector ({sample} queries)")
        run_case("benchmarks.retrieval:drop_vector_index_case", db=meta["db"])
        add(_records_from(run_case("benchmarks.graphrag_side:graphrag_vector_search_case", python=python,
                                   db=meta["db"], dataset_dir=meta["dir"], table=TABLE, dim=dim, queries=sample),
                          rows=rows, dim=dim, method="graphrag_vector_store", concurrent=False))

    if "numpy_exact" in methods:
        log("  numpy brute force")
        add(_records_from(run_case("benchmarks.retrieval:numpy_query_case", db=meta["db"], dataset_dir=meta["dir"],
                                   queries=queries),
                          rows=rows, dim=dim, method="numpy_exact", concurrent=True))
    if "lancedb_ann" in methods:
        # This run's own sweep when it has one (--out), else the committed one (the README's)
        sweeps = out if load_records(out, "sweep") else DEFAULT_RESULTS_DIR
        spec = chosen_index(rows, dim, sweeps)
        log(f"  build {spec.label()} (index type from the sweep in {sweeps})")
        built = run_case("benchmarks.retrieval:build_index_case", db=meta["db"], index_type=spec.index_type,
                         build=spec.build)
        # Recall-latency curve first; the headline row uses its fastest setting with recall@10 >= 0.95.
        curve = _records_from(
            run_case("benchmarks.retrieval:lancedb_query_case", db=meta["db"], dataset_dir=meta["dir"],
                     grid=curve_grid(spec, rows), concurrent=False, queries=queries),
            rows=rows, dim=dim, method="lancedb_ann", concurrent=False, index_type=spec.index_type,
            build=spec.build, build_s=built["index_build_s"], benchmark="curve")
        write_records(out, "curves", curve)
        best = fastest_meeting(curve, RECALL_TARGET)
        query_params = {k: v for k, v in best.params.items() if k not in spec.build}
        log(f"  lancedb ANN at {query_params} (recall {best.recall_at_10:.3f} in the curve)")
        headline = _records_from(
            run_case("benchmarks.retrieval:lancedb_query_case", db=meta["db"], dataset_dir=meta["dir"],
                     grid=[query_params], queries=queries, warm_pass=True),
            rows=rows, dim=dim, method="lancedb_ann", concurrent=True, index_type=spec.index_type,
            build=spec.build, build_s=built["index_build_s"])
        for r in headline:
            r.extra |= _built_extra(built)
        if "numpy_exact" in methods:
            sample = min(queries, PAIRED_QUERIES)
            log(f"  lancedb ANN vs numpy brute force, alternating on the same {sample} queries")
            paired = run_case("benchmarks.retrieval:paired_ann_numpy_case", db=meta["db"], dataset_dir=meta["dir"],
                              params=query_params, queries=sample)
            for r in headline:
                r.extra |= {k: v for k, v in paired.items() if k.startswith("paired_")}  # not its peak RSS
        add(headline)
    if "lancedb_flat" in methods:
        # A flat scan reads every vector per query (~20 s at 10^6 x 1536): a sample there.
        sample = queries if rows < 1_000_000 else min(queries, FLAT_SAMPLE_AT_SCALE)
        log(f"  lancedb flat scan ({sample} queries)")
        add(_records_from(run_case("benchmarks.retrieval:lancedb_query_case", db=meta["db"], dataset_dir=meta["dir"],
                                   grid=[{}], flat=True, queries=sample),
                          rows=rows, dim=dim, method="lancedb_flat", concurrent=True))
    if "engine" in methods:
        from benchmarks import engine

        records += engine.run_engine_retrieval(rows, dim, out, work, recall_bar=RECALL_TARGET)
    return records


def curve_grid(spec: IndexSpec, rows: int) -> list[dict[str, Any]]:
    for sweep_spec, grid in sweep_specs(rows, 384):
        if sweep_spec.index_type == spec.index_type:
            return grid
    return [{}]


def fastest_meeting(records: Sequence[Record], recall: float) -> Record:
    """Lowest-p50 record with recall@10 >= `recall`; the most accurate one when none meets it."""
    meeting = [r for r in records if (r.recall_at_10 or 0) >= recall]
    if meeting:
        return min(meeting, key=lambda r: r.p50_ms)
    return max(records, key=lambda r: (r.recall_at_10, -r.p50_ms))
