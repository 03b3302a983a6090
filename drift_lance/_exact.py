"""Exact top-k cosine search over a table's vectors held in memory.

A float32 scan of 10^4 x 1536 vectors reads 61 MB per query and is bound by memory bandwidth
(~0.9-1.5 ms). Matrices from 750k values are therefore screened first with int8 codes (a quarter of
the bytes; SimSIMD's integer dot product on one thread, ~0.35 ms), and only rows that could still be
in the top k are scored in float32. The result is exact, not approximate: every row's screening
error is bounded,

    |q.v - q'.v'| <= |q| |v - v'| + |q - q'| |v'|,

where v' and q' are the dequantized codes; |v - v'| and |v'| are kept per row, |q - q'| is computed
per query. A row's screened score plus its bound is its ceiling. Score the k rows of highest
ceiling in float32; the smallest of those scores is a floor the true k-th score cannot be under. A
row whose ceiling stays under the floor cannot be in the top k; every other row is scored in
float32 and the top k of those are returned, ties in table order. Candidates are scored row by row
(`_row_scores`), so equal rows get equal scores wherever they sit; a batch of queries picks its
candidates with one float32 product instead of screening and scores them the same way, so a query
gets the same answer alone or in a batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from drift_lance._blas import similarity_scores

__all__ = ["ExactMatrix", "top_k_stable"]

# Below this many values (rows x dim, 3 MB of float32) the matrix is scanned as is: screening pays
# for its fixed per-query steps from about there. Measured per query against the float32 product on
# one BLAS thread (`_blas.py` says why one): 1,000 x 384 37 / 39 us, 2,000 x 384 47 / 61 us,
# 10^4 x 384 ~120 / 191 us, 1,000 x 1,536 75 / 94 us (AMD EPYC, 32 MB L3).
SCREEN_MIN_VALUES = 750_000
# Larger batches are scored with one float32 product (20 x 10^4 x 1536: 9 ms, screened 11.6 ms).
SCREEN_MAX_QUERIES = 1
# A unit query's float32 norm is within ~1e-7 of 1; the residual norms are stored times this, so
# |q| |v - v'| needs no per-query pass over the rows (a query over it still gets the exact bound).
QUERY_NORM_ROOM = 1.0 + 1e-6


@dataclass(frozen=True, slots=True)
class ExactMatrix:
    """A table's unit vectors in row-id order, with what exact search needs of them: the float32
    matrix transposed (one column per row) when it is scanned as is, or row-major with int8 codes
    when it is screened."""

    row_ids: np.ndarray  # uint64 LanceDB row ids, ascending; row i of the matrix has row_ids[i]
    columns: np.ndarray | None = None  # (dim, rows) float32: unscreened
    vectors: np.ndarray | None = None  # (rows, dim) float32: screened
    codes: np.ndarray | None = None  # (rows, dim) int8, vectors ~ codes * scales[:, None]
    scales: np.ndarray | None = None  # (rows,) float64
    residual_norms: np.ndarray | None = None  # (rows,) |v - v'| x QUERY_NORM_ROOM, rounded up
    code_norms: np.ndarray | None = None  # (rows,) |v'|, rounded up
    max_code_norm: float = 0.0  # the largest of code_norms

    @classmethod
    def build(cls, matrix: np.ndarray, row_ids: np.ndarray, *, screen: bool = True) -> ExactMatrix:
        """`matrix`: (rows, dim) float32 unit vectors in the order of `row_ids`; `screen=False`
        keeps no int8 codes whatever the size."""
        if not (screen and _screens(*matrix.shape)):
            # `query @ columns` is 10% (1536-d) to 30% (384-d) faster than `rows @ query` (OpenBLAS)
            return cls(row_ids=row_ids, columns=np.ascontiguousarray(matrix.T))
        vectors = np.ascontiguousarray(matrix, dtype=np.float32)
        codes = np.empty(vectors.shape, dtype=np.int8)
        scales, residual, norms = (np.empty(len(vectors)) for _ in range(3))
        for start in range(0, len(vectors), 1024):  # temporaries a block at a time, not matrix-sized
            block = slice(start, start + 1024)
            codes[block], scales[block] = _quantize(vectors[block])
            decoded = codes[block].astype(np.float64) * scales[block, None]
            norms[block] = np.linalg.norm(decoded, axis=1)
            residual[block] = np.linalg.norm(vectors[block] - decoded, axis=1)
        up = 1.0 + 1e-9  # the norms are float64 sums: round them up, never down
        return cls(row_ids=row_ids, vectors=vectors, codes=codes, scales=scales,
                   residual_norms=residual * (up * QUERY_NORM_ROOM), code_norms=norms * up,
                   max_code_norm=float(np.max(norms, initial=0.0)) * up)

    @staticmethod
    def estimated_bytes(rows: int, dim: int, *, screened: bool = True) -> int:
        """What `build` holds for `rows` x `dim` vectors: float32 values and a uint64 row id each,
        plus int8 codes and three float64s per row when screened (and the size is screened)."""
        plain = rows * (dim * 4 + 8)
        return plain + rows * (dim + 24) if screened and _screens(rows, dim) else plain

    @property
    def rows(self) -> int:
        return len(self.row_ids)

    @property
    def nbytes(self) -> int:
        parts = (self.row_ids, self.columns, self.vectors, self.codes, self.scales, self.residual_norms, self.code_norms)
        return sum(part.nbytes for part in parts if part is not None)

    def top_k(self, queries: np.ndarray, k: int, excluded: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Positions (queries, k') of each query's k best rows, best first, and their float32
        cosine similarities; k' = min(k, rows not excluded). `queries` are unit vectors."""
        matching = self.rows - (int(excluded.sum()) if excluded is not None else 0)
        k = min(k, matching)
        if k <= 0:
            return np.empty((len(queries), 0), dtype=np.int64), np.empty((len(queries), 0), dtype=np.float32)
        if self.codes is None:
            scores = _without(similarity_scores(queries, self.columns), excluded)
            tops = np.stack([top_k_stable(row, k) for row in scores])
            return tops, np.take_along_axis(scores, tops, axis=1)
        # Rows that can make the top k, then their scores row by row: `_row_scores` rounds a row
        # the same wherever it sits among the candidates, so equal rows tie (BLAS's gemv does not).
        if len(queries) <= SCREEN_MAX_QUERIES:
            candidates = [self._screen(query, k, excluded) for query in queries]
        else:  # one blocked float32 product for a batch beats screening each query
            candidates = self._candidates_by_product(queries, k, excluded)
        positions = np.empty((len(queries), k), dtype=np.int64)
        similarities = np.empty((len(queries), k), dtype=np.float32)
        for i, (query, rows) in enumerate(zip(queries, candidates, strict=True)):
            exact = _row_scores(self.vectors[rows], query)
            top = top_k_stable(exact, k)
            positions[i] = rows[top]
            similarities[i] = exact[top]
        return positions, similarities

    def _screen(self, query: np.ndarray, k: int, excluded: np.ndarray | None) -> np.ndarray:
        """Ascending positions of every row whose int8-screened score plus its error bound (its
        ceiling) reaches the smallest float32 score among the k rows of highest ceiling. `query`:
        one unit vector. Each step is one pass over the rows; the int8 products (~9 ns a row at
        384-d) are most of the time."""
        assert self.vectors is not None and self.scales is not None
        assert self.residual_norms is not None and self.code_norms is not None
        query_codes, query_scale, query_error = _quantize_one(query)
        ceiling = self._int8_products(query_codes.reshape(1, -1))[0]
        ceiling *= self.scales
        ceiling *= query_scale
        query_norm = float(np.linalg.norm(query.astype(np.float64)))
        if query_norm <= QUERY_NORM_ROOM:  # residual_norms carry that much room already
            ceiling += self.residual_norms
        else:
            ceiling += query_norm * self.residual_norms
        _without(ceiling[None, :], excluded)
        # The per-row term |q - q'| |v'| is bounded by the largest |v'|, and that constant and the
        # rounding slack move to the floor's side of the comparison: one pass less over the rows.
        margin = query_error * self.max_code_norm + _rounding_slack(len(query))
        # Any k matching rows' float32 scores floor the k-th best; rows of high ceiling give a
        # high floor, and one partition of the ceilings is all it costs.
        cut = len(ceiling) - k
        best = np.argpartition(ceiling, cut)[cut:] if cut > 0 else np.arange(len(ceiling))
        floor = float(np.min(_row_scores(self.vectors[best], query)))
        return np.flatnonzero(ceiling >= floor - margin)

    def _candidates_by_product(self, queries: np.ndarray, k: int, excluded: np.ndarray | None) -> list[np.ndarray]:
        """Per query, ascending positions of every row whose float32 product score is within
        rounding of the k-th best (the product and `_row_scores` may round a row differently)."""
        assert self.vectors is not None
        scores = _without(similarity_scores(queries, self.vectors.T), excluded)
        slack = _rounding_slack(queries.shape[1])
        cut = scores.shape[1] - k
        return [np.flatnonzero(row >= np.partition(row, cut)[cut] - slack) for row in scores]

    def _int8_products(self, query_codes: np.ndarray) -> np.ndarray:
        """(queries, rows) float64 integer dot products of the query codes with every row's codes.
        On the calling thread: handing half to a worker measured slower for one query (0.73 vs 0.66
        ms at 10^4 x 1536), its wake-up costing more than it saves."""
        assert self.codes is not None
        return np.asarray(_int8_dots()(query_codes, self.codes))


def top_k_stable(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k best scores, best first; equal scores keep table order."""
    if scores.shape[0] <= 64:  # a screen's few candidates, a small table: one stable sort is cheaper
        return np.argsort(-scores, kind="stable")[:k]
    if k < scores.shape[0]:
        # argpartition picks an arbitrary subset among ties at the cut: take everything >= the
        # k-th score, then sort stably so the lowest offsets win.
        kth = np.partition(scores, scores.shape[0] - k)[scores.shape[0] - k]
        candidates = np.flatnonzero(scores >= kth)
    else:
        candidates = np.arange(scores.shape[0])
    order = np.lexsort((candidates, -scores[candidates]))
    return candidates[order][:k]


def _without(scores: np.ndarray, excluded: np.ndarray | None) -> np.ndarray:
    """`scores` (queries, rows) with the excluded rows at -inf, in place: never among the top
    min(k, n) of the n matching rows."""
    if excluded is not None:
        scores[:, excluded] = -np.inf
    return scores


def _row_scores(rows: np.ndarray, query: np.ndarray) -> np.ndarray:
    """`rows @ query` in float32, each row summed the same way wherever it sits (numpy's own
    einsum loop; BLAS gemv rounds a row differently by its position, so equal rows did not tie)."""
    return np.einsum("ij,j->i", rows, query.astype(rows.dtype, copy=False))


def _rounding_slack(dim: int) -> float:
    """A float32 cosine of unit vectors is within dim * 2^-24 of the true value however it is
    summed. A row cut by one computation (the product, or the screened ceiling) against scores of
    another (`_row_scores`) needs up to four times that to keep every row that can make the top k."""
    return 4.0 * dim * 2.0**-24


def _screens(rows: int, dim: int) -> bool:
    return rows * dim >= SCREEN_MIN_VALUES and _int8_dots() is not None


def _quantize(vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 codes per row: row ~ codes * scale, scale = max |value| / 127."""
    peaks = np.max(np.abs(vectors), axis=1).astype(np.float64)
    scales = np.where(peaks > 0, peaks / 127.0, 1.0)
    codes = np.rint(vectors / scales[:, None].astype(np.float32)).clip(-127, 127).astype(np.int8)
    return codes, scales


def _quantize_one(vector: np.ndarray) -> tuple[np.ndarray, float, float]:
    """`_quantize` for one vector, in fewer steps (it is per query): its codes, scale, and the
    float64 norm of what the codes miss, |v - codes * scale|."""
    peak = float(np.max(np.abs(vector)))
    if peak == 0.0:
        return np.zeros(vector.shape, dtype=np.int8), 1.0, 0.0
    scale = peak / 127.0
    codes = np.rint(vector * np.float32(127.0 / peak)).astype(np.int8)  # |values| <= 127.0000x
    return codes, scale, float(np.linalg.norm(vector - codes * scale))


@functools.cache
def _int8_dots() -> Any:
    """SimSIMD's int8 inner products (exact integers, as float64), or None without SimSIMD."""
    try:
        import simsimd
    except ImportError:  # pragma: no cover - a core dependency; the float32 scan still answers
        return None

    def dots(queries: np.ndarray, codes: np.ndarray) -> Any:
        return simsimd.cdist(queries, codes, metric="dot", threads=1)

    return dots
