"""Measure how many IVF partitions an ANN index must probe to reach a recall target (run by ingest).

How many partitions a recall needs depends on the data, the dimension and the index: on the same
synthetic corpus, IVF_RQ probed at 30% gave recall@10 0.996 at 10^6 x 1536 but 0.955 at 10^6 x 384.
So instead of a fixed share, ingest measures it on the index it just built:

- queries: random rows perturbed to cosine ~0.8 to the row (a question's embedding sits near, not
  on, the entity it asks about; the row itself is then not a guaranteed hit);
- truth: exact top-10 by cosine (a dot product: ingest stores rows unit-normalised, see
  `ingest.embeddings.TableVectors`) over the whole matrix, which ingest holds in memory anyway; a result
  scoring at least the 10th exact score counts as a hit, so ties between equal vectors do not count
  as misses;
- a probe count reaches the target when the sample's mean recall@10 minus 1.645 standard errors
  (a one-sided 95% lower confidence bound) does: recall varies a lot from query to query (a
  per-query standard deviation of 0.09-0.15 at 10^6 x 1536), so 300-query samples of one index
  measured 0.916-0.948 at the same probe count, and a calibration that stopped at the first count
  whose sample mean reached 0.97 chose 69 probes where 1,800 other queries measured 0.957. A count
  is first measured on 300 of the (by default 1,000) queries and on the rest only when a 99%
  interval around the first look's mean contains the target, so counts far from it cost less;
- recall grows with the probe count, so a binary search over a ladder of probe counts finds the
  first rung that reaches the target in a handful of rounds of concurrent LanceDB queries, and a
  bisection between it and the rung below (which missed) narrows it to within 5%: near 0.97 recall
  is flat in the probes (10^6 x 1536: 0.969 at 125, 0.972 at 140, 0.973 at 150), so a rung's step
  would otherwise be paid for in latency on every query.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from drift_lance._lance_store import ann_query
from drift_lance.config.ingest import SearchTuning
from drift_lance.store import AnnCalibration, TableInfo

log = logging.getLogger(__name__)

K = 10
QUERY_NOISE = 0.75  # noise of this norm on a unit row: cosine ~0.8 between query and row
SEED = 0
# Shares of the partitions tried (as probe counts, deduplicated); the last rung probes everything.
PROBE_FRACTIONS = (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.7, 1.0)
CONCURRENCY = 8  # LanceDB queries in flight (it runs them on its own threads)
TRUTH_CHUNK_ROWS = 65_536  # rows scored at once for the exact top-10 (bounds the score matrix)
TIE_TOLERANCE = 1e-5
REFINE_TOLERANCE = 0.05  # bisection between rungs stops once the gap is this share of the probes
CONFIDENCE_Z = 1.645  # standard errors below the mean: a one-sided 95% lower confidence bound
# Each probe count is first measured on this many of the sample queries; only a count whose 99%
# interval there (EARLY_Z standard errors either side) contains the target is measured on them all.
# Counts far from the target (most of the ladder) then cost 300 queries, not 1000.
FIRST_LOOK = 300
EARLY_Z = 2.326


@dataclass(frozen=True)
class RecallEstimate:
    """Recall@10 over `queries` sample queries at one probe count."""

    mean: float
    margin: float  # z standard errors of the mean
    queries: int

    @classmethod
    def of(cls, per_query: np.ndarray, z: float = CONFIDENCE_Z) -> RecallEstimate:
        spread = float(np.std(per_query, ddof=1)) if len(per_query) > 1 else 0.0
        return cls(mean=float(np.mean(per_query)), margin=z * spread / math.sqrt(len(per_query)), queries=len(per_query))

    @property
    def lower_bound(self) -> float:
        return self.mean - self.margin

    def reaches(self, target: float) -> bool:
        return self.lower_bound >= target

    def clearly_misses(self, target: float) -> bool:
        return self.mean + self.margin < target


def probe_ladder(num_partitions: int, floor: int = 1) -> list[int]:
    """Probe counts to try, ascending, none below `floor` (the store's `min_nprobes` safety net:
    a small, easy table must not end up probing 2 partitions for queries unlike the sample)."""
    lowest = min(num_partitions, max(1, floor))
    return sorted({min(num_partitions, max(lowest, math.ceil(f * num_partitions))) for f in PROBE_FRACTIONS})


def sample_queries(matrix: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` random rows of the unit-row `matrix`, each moved to cosine ~0.8 by random noise."""
    picks = rng.choice(matrix.shape[0], size=min(n, matrix.shape[0]), replace=False)
    return queries_near(matrix[np.sort(picks)], rng)


def queries_near(rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Unit queries, one per unit row of `rows`, each the row plus random noise of norm QUERY_NOISE."""
    base = rows.astype(np.float32)
    noise = rng.standard_normal(base.shape).astype(np.float32)
    noise *= QUERY_NOISE / np.linalg.norm(noise, axis=1, keepdims=True)
    queries = base + noise
    return queries / np.linalg.norm(queries, axis=1, keepdims=True)


def kth_exact_scores(matrix: np.ndarray, queries: np.ndarray, k: int = K) -> np.ndarray:
    """Per query, the k-th best cosine over all (unit) rows: the lowest score that still makes the top k."""
    best = np.full((len(queries), 0), -np.inf, dtype=np.float32)
    for start in range(0, matrix.shape[0], TRUTH_CHUNK_ROWS):
        scores = queries @ matrix[start : start + TRUTH_CHUNK_ROWS].T
        merged = np.concatenate([best, scores.astype(np.float32)], axis=1)
        keep = min(k, merged.shape[1])
        best = np.partition(merged, merged.shape[1] - keep, axis=1)[:, merged.shape[1] - keep :]
    return best.min(axis=1)


class _RecallProbe:
    """Recall@10 of the index at a given probe count, for fixed queries (exact truth scored for the
    first look up front, for the rest when a probe count first needs them)."""

    def __init__(self, handle: Any, info: TableInfo, matrix: np.ndarray, ids: pl.Series, queries: np.ndarray, tuning: SearchTuning) -> None:
        self.handle, self.info, self.tuning = handle, info, tuning
        self.matrix, self.queries = matrix, queries
        self.k = min(K, matrix.shape[0])  # a table of fewer than 10 rows has only that many to find
        self.first_look = min(FIRST_LOOK, len(queries))
        self.kth = np.full(len(queries), np.nan, dtype=np.float32)
        self._score_truth(0, self.first_look)
        self.rows_by_id = pl.DataFrame({"id": ids}).with_row_index("row")

    def _score_truth(self, start: int, stop: int) -> None:
        self.kth[start:stop] = kth_exact_scores(self.matrix, self.queries[start:stop])

    async def recall(self, nprobes: int, target: float) -> RecallEstimate:
        """Measured on the first look's queries, and on all of them unless that settles `target`."""
        hits = await self._hits_at(nprobes, 0, self.first_look)
        if self.first_look == len(self.queries):
            return RecallEstimate.of(hits)
        early = RecallEstimate.of(hits, z=EARLY_Z)
        if early.reaches(target) or early.clearly_misses(target):
            return early
        if np.isnan(self.kth[-1]):
            await asyncio.to_thread(self._score_truth, self.first_look, len(self.queries))
        rest = await self._hits_at(nprobes, self.first_look, len(self.queries))
        return RecallEstimate.of(np.concatenate([hits, rest]))

    async def _hits_at(self, nprobes: int, start: int, stop: int) -> np.ndarray:
        """Per query in `start:stop`, its share of the exact top 10 found at `nprobes`."""
        limit = asyncio.Semaphore(CONCURRENCY)

        async def ids_found(query: np.ndarray) -> list[Any]:
            async with limit:
                q = ann_query(self.handle, query, K, self.tuning, self.info, nprobes=nprobes).select(["id", "_distance"])
                return (await q.to_arrow()).column("id").to_pylist()

        found = await asyncio.gather(*(ids_found(q) for q in self.queries[start:stop]))
        return self._hits(found, start) / self.k

    def _hits(self, found: Sequence[Sequence[Any]], start: int) -> np.ndarray:
        """Per query (the queries from `start` on), how many of its results score at least its k-th
        exact score (at most k)."""
        query_of = np.repeat(np.arange(len(found)), [len(ids) for ids in found])
        flat = pl.Series("id", [i for ids in found for i in ids], dtype=self.rows_by_id["id"].dtype)
        results = pl.DataFrame({"id": flat, "query": query_of})
        # One join for all queries (a join per query re-hashes the whole id column each time).
        located = results.join(self.rows_by_id, on="id", how="inner")
        rows, queries = located["row"].to_numpy(), located["query"].to_numpy()
        scores = np.einsum("ij,ij->i", self.matrix[rows], self.queries[start + queries])
        hits = np.bincount(queries[scores >= self.kth[start + queries] - TIE_TOLERANCE], minlength=len(found))
        return np.minimum(hits, self.k)


async def _bisect(
    probe: _RecallProbe, measured: dict[int, RecallEstimate], target: float, *, missed: int, reached: int
) -> int:
    """The fewest probes between `missed` (short of the target) and `reached` (reaching it) that
    reach the target, to within REFINE_TOLERANCE of the count (exactly, for small counts)."""
    while reached - missed > max(1, round(REFINE_TOLERANCE * reached)):
        mid = (missed + reached) // 2
        measured[mid] = await probe.recall(mid, target)
        if measured[mid].reaches(target):
            reached = mid
        else:
            missed = mid
    return reached


async def calibrate_probes(
    handle: Any,
    info: TableInfo,
    matrix: np.ndarray,
    ids: pl.Series,
    *,
    target: float,
    queries: int,
    tuning: SearchTuning | None = None,
    seed: int = SEED,
) -> AnnCalibration | None:
    """The fewest probes (to within REFINE_TOLERANCE) whose recall@10 reaches `target` on `handle`'s
    index (unit rows of `matrix` in the order of `ids`) with 95% confidence over `queries` sample
    queries; all partitions, with a warning, when none does. None for an index without partitions
    recorded."""
    num_partitions = info.vector_index_params.get("num_partitions")
    if not info.vector_index or not num_partitions:
        return None
    tuning = tuning or SearchTuning()
    started = time.perf_counter()
    sample = sample_queries(matrix, queries, np.random.default_rng(seed))
    probe = await asyncio.to_thread(_RecallProbe, handle, info, matrix, ids, sample, tuning)
    ladder = probe_ladder(int(num_partitions), tuning.min_nprobes)
    measured: dict[int, RecallEstimate] = {}
    lo, hi = 0, len(ladder) - 1
    while lo < hi:  # invariant: the answer is in ladder[lo..hi] (the top rung if none reaches target)
        mid = (lo + hi) // 2
        measured[ladder[mid]] = await probe.recall(ladder[mid], target)
        if measured[ladder[mid]].reaches(target):
            hi = mid
        else:
            lo = mid + 1
    chosen = ladder[lo]
    if chosen not in measured:
        measured[chosen] = await probe.recall(chosen, target)
    if lo > 0 and measured[chosen].reaches(target):  # the rung below was measured and missed
        chosen = await _bisect(probe, measured, target, missed=ladder[lo - 1], reached=chosen)
    estimate = measured[chosen]
    if not estimate.reaches(target):
        log.warning(
            "table %r: recall@10 %.3f (lower bound %.3f) with all %d partitions probed is below the target %.3f",
            info.name, estimate.mean, estimate.lower_bound, chosen, target,
        )
    log.info("table %r: probes -> recall@10 (lower bound) %s", info.name,
             {p: (round(r.mean, 4), round(r.lower_bound, 4)) for p, r in sorted(measured.items())})
    return AnnCalibration(
        nprobes=chosen,
        refine_factor=tuning.refine(info.vector_index),
        recall_at_10=round(estimate.mean, 4),
        recall_lower_bound=round(estimate.lower_bound, 4),
        target_recall=target,
        queries=estimate.queries,
        seconds=round(time.perf_counter() - started, 3),
    )
