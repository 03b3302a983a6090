"""Synthetic embedding-like vectors, streamed in chunks straight into a LanceDB table.

Uniform random vectors are a poor stand-in for text embeddings (no neighbourhood structure, every
point nearly orthogonal to every other). These are clustered and anisotropic instead: each vector is
a topic direction plus noise concentrated in a 256-dimensional subspace with a power-law spectrum,
plus a small isotropic floor, L2-normalised -- closer to how real embeddings spread. Queries are
fresh draws from the same distribution. Chunk i is generated from seed (seed, dim, i), so a table of
10^6 x 1536 (6 GB) is written and its exact ground truth computed without ever holding it in memory.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from benchmarks._harness import log

TABLE = "vectors"
CHUNK_ROWS = 25_000
N_TOPICS = 512
SUBTOPICS_PER_TOPIC = 32
SUBSPACE = 256
TOPIC_WEIGHT = 0.55
SUBTOPIC_WEIGHT = 0.8
POINT_NOISE = 0.55
FLOOR_NOISE = 0.2
QUERY_SEED_OFFSET = 1_000_003
QUERY_BLOCK = 100  # queries come in blocks of a stream each, so the first n are the same for any count


@dataclass(frozen=True)
class VectorSpace:
    """Deterministic generator for one (dim, seed)."""

    dim: int
    seed: int = 7

    def _basis(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.dim, 0])
        topics = _normalise(rng.standard_normal((N_TOPICS, self.dim), dtype=np.float32))
        sub = min(SUBSPACE, self.dim)
        q, _ = np.linalg.qr(rng.standard_normal((self.dim, sub)).astype(np.float32))
        basis = q.T.astype(np.float32)  # (sub, dim) orthonormal rows
        spectrum = (np.arange(1, sub + 1, dtype=np.float32) ** -0.5)
        spectrum /= np.linalg.norm(spectrum)
        # Subtopic offsets live in the low-rank subspace (coefficients only: 16k x 256 floats).
        subtopics = rng.standard_normal((N_TOPICS * SUBTOPICS_PER_TOPIC, sub), dtype=np.float32) * spectrum
        return topics, basis, spectrum, subtopics

    def sample(self, n: int, stream: int) -> np.ndarray:
        """`n` unit vectors from the stream `stream` (chunk index; queries use a distant stream)."""
        topics, basis, spectrum, subtopics = self._cached_basis()
        rng = np.random.default_rng([self.seed, self.dim, stream + 1])
        sub_ids = rng.integers(0, len(subtopics), size=n)
        coeff = (SUBTOPIC_WEIGHT * subtopics[sub_ids]
                 + POINT_NOISE * rng.standard_normal((n, basis.shape[0]), dtype=np.float32) * spectrum)
        floor = rng.standard_normal((n, self.dim), dtype=np.float32) * (FLOOR_NOISE / np.sqrt(self.dim))
        vectors = TOPIC_WEIGHT * topics[sub_ids // SUBTOPICS_PER_TOPIC] + coeff @ basis + floor
        return _normalise(vectors)

    def _cached_basis(self) -> tuple[np.ndarray, ...]:
        cache = _BASIS_CACHE.get((self.dim, self.seed))
        if cache is None:
            cache = _BASIS_CACHE[(self.dim, self.seed)] = self._basis()
        return cache

    def chunks(self, rows: int) -> Iterator[tuple[int, np.ndarray]]:
        """(first_row_id, vectors) chunks covering rows [0, rows)."""
        for index, start in enumerate(range(0, rows, CHUNK_ROWS)):
            yield start, self.sample(min(CHUNK_ROWS, rows - start), stream=index)

    def queries(self, n: int) -> np.ndarray:
        """The first `n` of one fixed query sequence: a run of 10 queries measures the first 10 of a
        run of 200, whatever the work directory asked for before."""
        blocks = [self.sample(QUERY_BLOCK, stream=QUERY_SEED_OFFSET + b) for b in range(-(-n // QUERY_BLOCK))]
        return np.concatenate(blocks)[:n] if blocks else np.zeros((0, self.dim), np.float32)


_BASIS_CACHE: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}


def _normalise(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32, copy=False)


def vector_batch(first_id: int, vectors: np.ndarray) -> pa.RecordBatch:
    """id + `vector` as fixed_size_list<float32>[dim], the schema's vector type."""
    dim = vectors.shape[1]
    flat = pa.array(vectors.reshape(-1), type=pa.float32())
    ids = pa.array(np.arange(first_id, first_id + len(vectors), dtype=np.int64))
    return pa.RecordBatch.from_arrays([ids, pa.FixedSizeListArray.from_arrays(flat, dim)], ["id", "vector"])


def dataset_dir(root: Path, rows: int, dim: int, seed: int) -> Path:
    return root / "retrieval" / f"{rows}x{dim}-s{seed}"


def prepare_dataset(root: str, rows: int, dim: int, queries: int, seed: int = 7) -> dict:
    """Write the LanceDB table and exact top-100 ground truth for `queries` queries, unless a
    complete copy exists. Returns paths and timings. Streams: memory stays O(chunk). Locked, so
    concurrent benchmark runs wait for one writer instead of clobbering each other."""
    out = dataset_dir(Path(root), rows, dim, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _prepare_locked(out, rows, dim, queries, seed)


def _prepare_locked(out: Path, rows: int, dim: int, queries: int, seed: int) -> dict:
    meta_path = out / "dataset.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        current = meta.get("query_block") == QUERY_BLOCK  # older datasets drew their queries in one stream
        if current and meta.get("queries", 0) >= queries:
            return meta
        if (meta.get("rows"), meta.get("dim"), meta.get("seed")) == (rows, dim, seed):
            return _more_queries(meta_path, meta, max(queries, meta.get("queries", 0)))
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    import lancedb

    space = VectorSpace(dim, seed)
    query_vectors, truth = _queries_and_truth(space, queries)

    def batches() -> Iterator[pa.RecordBatch]:
        for first_id, chunk in space.chunks(rows):
            truth.update(query_vectors @ chunk.T, first_id)
            if first_id % (CHUNK_ROWS * 8) == 0:
                log(f"  writing {rows}x{dim}: {first_id:,} rows")
            yield vector_batch(first_id, chunk)

    schema = pa.schema([pa.field("id", pa.int64()), pa.field("vector", pa.list_(pa.float32(), dim))])
    started = time.perf_counter()
    db = lancedb.connect(str(out / "db"))
    db.create_table(TABLE, data=pa.RecordBatchReader.from_batches(schema, batches()), schema=schema)
    write_s = time.perf_counter() - started
    meta = {"dir": str(out), "db": str(out / "db"), "rows": rows, "dim": dim, "seed": seed,
            "queries": queries, "write_s": write_s}
    return _save_queries(meta_path, meta, query_vectors, truth)


def _more_queries(meta_path: Path, meta: dict, queries: int) -> dict:
    """More queries for an existing dataset: the table (and any ANN index on it) stays; its vectors
    are regenerated in memory, chunk by chunk as written, to score the new queries' exact top k."""
    rows, dim, seed = meta["rows"], meta["dim"], meta["seed"]
    log(f"  {rows:,}x{dim}: {queries} queries (had {meta.get('queries', 0)}); the table stays")
    space = VectorSpace(dim, seed)
    query_vectors, truth = _queries_and_truth(space, queries)
    for first_id, chunk in space.chunks(rows):
        truth.update(query_vectors @ chunk.T, first_id)
    return _save_queries(meta_path, {**meta, "queries": queries}, query_vectors, truth)


def _queries_and_truth(space: VectorSpace, queries: int) -> tuple[np.ndarray, _TopK]:
    """The dataset's query vectors and an empty running exact top 100 for them."""
    query_vectors = space.queries(queries)
    return query_vectors, _TopK(len(query_vectors), k=100)


def _save_queries(meta_path: Path, meta: dict, query_vectors: np.ndarray, truth: _TopK) -> dict:
    """Write the queries, their exact top 100 and then `meta`. Until `meta` says how many queries
    there are, a run that stops midway leaves a dataset whose queries the next run recomputes (the
    table stays): never queries paired with another set's truth."""
    out = meta_path.parent
    if meta_path.exists():
        meta_path.write_text(json.dumps({**meta, "queries": 0}))
    for name, array in (("queries", query_vectors), ("truth", truth.ids())):
        np.save(out / f"{name}.tmp.npy", array)
        os.replace(out / f"{name}.tmp.npy", out / f"{name}.npy")
    meta = {**meta, "query_block": QUERY_BLOCK}
    meta_path.write_text(json.dumps(meta))
    return meta


class _TopK:
    """Running exact top-k (by similarity) per query over streamed score chunks."""

    def __init__(self, n_queries: int, k: int):
        self.k = k
        self.scores = np.full((n_queries, 0), -np.inf, dtype=np.float32)
        self.idx = np.zeros((n_queries, 0), dtype=np.int64)

    def update(self, chunk_scores: np.ndarray, first_id: int) -> None:
        ids = np.broadcast_to(np.arange(first_id, first_id + chunk_scores.shape[1]), chunk_scores.shape)
        scores = np.concatenate([self.scores, chunk_scores], axis=1)
        idx = np.concatenate([self.idx, ids], axis=1)
        keep = min(self.k, scores.shape[1])
        part = np.argpartition(-scores, keep - 1, axis=1)[:, :keep]
        self.scores = np.take_along_axis(scores, part, axis=1)
        self.idx = np.take_along_axis(idx, part, axis=1)

    def ids(self) -> np.ndarray:
        order = np.argsort(-self.scores, axis=1)
        return np.take_along_axis(self.idx, order, axis=1)
