"""Vectors for the three embedded tables: reuse GraphRAG's own, or compute them.

Reuse order per table (first hit wins): graphrag's LanceDB folder (``lancedb/`` next to the parquet,
3.x names like ``entity_description`` and 1.x/2.x names like ``default-entity-description``, vectors
possibly ``list<double>``), an ``embeddings.<name>.parquet`` snapshot, then an embedding column in the
table's own parquet (``description_embedding`` in pre-1.0 entities). Reused vectors must cover every
row: mixing them with vectors of another model would make similarities meaningless.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from drift_lance import schema
from drift_lance.errors import IngestError
from drift_lance.models.base import Embedder

# graphrag's vector-store table names, newest first.
LANCEDB_TABLES = {
    schema.ENTITIES: ("entity_description", "default-entity-description"),
    schema.COMMUNITY_REPORTS: ("community_full_content", "default-community-full_content"),
    schema.TEXT_UNITS: ("text_unit_text", "default-text_unit-text"),
}
PARQUET_COLUMNS = {
    schema.ENTITIES: ("description_embedding",),
    schema.COMMUNITY_REPORTS: ("full_content_embedding",),
    schema.TEXT_UNITS: ("text_embedding",),
}
_VECTOR_COLUMNS = ("vector", "embedding")


@dataclass(slots=True)
class TableVectors:
    """Unit-normalised float32 vectors aligned with a table's rows, and where they came from."""

    matrix: np.ndarray
    model: str
    source: str  # "graphrag-lancedb" | "embeddings-parquet" | "parquet-column" | "computed"
    origin: str  # file / table the vectors were read from, or the embedder


@dataclass(slots=True)
class FoundVectors:
    ids: list[str]
    matrix: np.ndarray  # (len(ids), dim) float32, validated and normalised
    source: str
    origin: str


def vectors_to_matrix(column: pa.ChunkedArray | pa.Array, where: str) -> np.ndarray:
    """A list / fixed-size-list vector column as a (rows, dim) float32 matrix; IngestError on nulls
    or mixed dimensions (naming `where`)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(array) == 0:
        return np.zeros((0, 0), dtype=np.float32)
    if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type) or pa.types.is_fixed_size_list(array.type)):
        raise IngestError(f"{where} has type {array.type}, expected a list of floats")
    if not (pa.types.is_floating(array.type.value_type) or pa.types.is_integer(array.type.value_type)):
        raise IngestError(f"{where} has type {array.type}, expected a list of floats")
    if array.null_count:
        raise IngestError(f"{where}: {array.null_count} rows have no vector (null)")
    if pa.types.is_fixed_size_list(array.type):
        dim = array.type.list_size
    else:
        lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False)
        dims = np.unique(lengths)
        if len(dims) != 1:
            raise IngestError(f"{where}: vectors have mixed dimensions {dims.tolist()[:5]}")
        dim = int(dims[0])
    if dim == 0:
        raise IngestError(f"{where}: vectors are empty (dimension 0)")
    flat = pc.list_flatten(array).to_numpy(zero_copy_only=False)
    if len(flat) != len(array) * dim:  # sliced or nested-null storage; take the slow exact path
        flat = np.asarray(array.to_pylist(), dtype=np.float64).reshape(-1)
    return normalise_rows(flat.astype(np.float32, copy=False).reshape(len(array), dim), where)


def normalise_rows(matrix: np.ndarray, where: str) -> np.ndarray:
    """Validate (finite, non-zero) and L2-normalise each row, so cosine = dot product."""
    bad = ~np.isfinite(matrix).all(axis=1)
    if bad.any():
        raise IngestError(f"{where}: {int(bad.sum())} vectors contain NaN or inf (first at row {int(np.argmax(bad))})")
    norms = np.linalg.norm(matrix, axis=1)
    zero = norms == 0
    if zero.any():
        raise IngestError(f"{where}: {int(zero.sum())} vectors are all zeros (first at row {int(np.argmax(zero))})")
    return np.ascontiguousarray((matrix / norms[:, None]).astype(np.float32, copy=False))


def _from_arrow(table: pa.Table, where: str, source: str) -> FoundVectors:
    if "id" not in table.column_names:
        raise IngestError(f"{where}: required column 'id' is missing")
    vector_col = next((c for c in _VECTOR_COLUMNS if c in table.column_names), None)
    if vector_col is None:
        raise IngestError(f"{where}: no vector column ('vector' or 'embedding')")
    ids = table.column("id").cast(pa.string()).to_pylist()
    matrix = vectors_to_matrix(table.column(vector_col), f"{where}: column {vector_col!r}")
    return FoundVectors(ids, matrix, source, where)


def _read_lance(path: Path) -> pa.Table:
    import lance  # pylance; a dependency of lancedb

    dataset = lance.dataset(str(path))
    columns = [c for c in ("id", *_VECTOR_COLUMNS) if c in dataset.schema.names]
    return dataset.to_table(columns=columns)


def find_reusable(root: Path, table: str, raw_columns: dict[str, pa.ChunkedArray], ids: list[str], parquet: Path) -> FoundVectors | None:
    """graphrag's vectors for `table`, if the index has them (see module docstring for the order)."""
    for name in LANCEDB_TABLES[table]:
        path = root / "lancedb" / f"{name}.lance"
        if path.is_dir():
            try:
                arrow = _read_lance(path)
            except Exception as exc:  # noqa: BLE001 - lance raises OSError/ValueError/RuntimeError
                raise IngestError(f"{path}: cannot read graphrag LanceDB table: {exc}") from exc
            return _from_arrow(arrow, str(path), "graphrag-lancedb")
    for name in LANCEDB_TABLES[table][:1]:
        path = root / f"embeddings.{name}.parquet"
        if path.exists():
            return _from_arrow(pq.read_table(path), str(path), "embeddings-parquet")
    for column in PARQUET_COLUMNS[table]:
        if column in raw_columns:
            where = f"{parquet}: column {column!r}"
            return FoundVectors(ids, vectors_to_matrix(raw_columns[column], where), "parquet-column", str(parquet))
    return None


def align(found: FoundVectors, ids: Sequence[str], table: str) -> np.ndarray:
    """`found`'s vectors in the order of `ids`; IngestError if any row has no vector."""
    if found.ids is ids:
        return found.matrix
    position: dict[str, int] = {}
    for i, key in enumerate(found.ids):
        if key in position:
            raise IngestError(f"{found.origin}: duplicate vector id {key!r}")
        position[key] = i
    rows = np.fromiter((position.get(k, -1) for k in ids), dtype=np.int64, count=len(ids))
    missing = np.flatnonzero(rows < 0)
    if len(missing):
        raise IngestError(
            f"{found.origin}: no vector for {len(missing)} of {len(ids)} {table} rows (e.g. id {ids[int(missing[0])]!r}); "
            "rerun with --reembed to compute all vectors with the configured embedder"
        )
    return found.matrix[rows]


async def compute(texts: Sequence[str], embedder: Embedder, *, batch_size: int, desc: str, progress: bool) -> np.ndarray:
    """Embed `texts` in batches (one call at a time: embedders are CPU- or rate-bound) with a progress bar."""
    from tqdm.auto import tqdm

    out = np.zeros((len(texts), embedder.dimension), dtype=np.float32)
    with tqdm(total=len(texts), desc=desc, unit="text", disable=not progress, leave=False) as bar:
        for start in range(0, len(texts), batch_size):
            batch = list(texts[start : start + batch_size])
            vectors = np.asarray(await embedder.embed(batch, kind="document"), dtype=np.float32)
            if vectors.shape != (len(batch), embedder.dimension):
                raise IngestError(
                    f"embedder {embedder.model_id!r} returned shape {vectors.shape} for {len(batch)} texts, "
                    f"expected ({len(batch)}, {embedder.dimension})"
                )
            out[start : start + len(batch)] = vectors
            bar.update(len(batch))
    return normalise_rows(out, f"embedder {embedder.model_id!r} ({desc})")


class LazyEmbedder:
    """An Embedder built on first use, so a reused-vectors ingest never loads a model."""

    def __init__(self, factory: Callable[[], Embedder]) -> None:
        self._factory = factory
        self._embedder: Embedder | None = None

    def _get(self) -> Embedder:
        if self._embedder is None:
            self._embedder = self._factory()
        return self._embedder

    @property
    def model_id(self) -> str:
        return self._get().model_id

    @property
    def dimension(self) -> int:
        return self._get().dimension

    async def embed(self, texts: Sequence[str], *, kind: str = "document") -> np.ndarray:
        return await self._get().embed(texts, kind=kind)  # type: ignore[arg-type]
