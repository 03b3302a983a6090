"""Vectors for the three embedded tables: reuse GraphRAG's own, or compute them.

Reuse order per table (first hit wins): graphrag's LanceDB folder (``lancedb/`` next to the parquet,
3.x names like ``entity_description`` and 1.x/2.x names like ``default-entity-description``, or
another ``container_name`` than ``default``; vectors possibly ``list<double>``), an ``embeddings.<name>.parquet`` snapshot (3.x ``entity_description``,
0.5-2.x ``entity.description``; ``.csv`` from a 3.x index written as CSV), then an embedding column in the table's own parquet
(``description_embedding`` in pre-1.0 entities). Reused vectors must cover every
row: mixing them with vectors of another model would make similarities meaningless.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from drift_lance import schema
from drift_lance.errors import IngestError
from drift_lance.models.base import Embedder
from ingest.csv_tables import read_embeddings_csv

log = logging.getLogger(__name__)

# graphrag's vector-store table names, newest first.
LANCEDB_TABLES = {
    schema.ENTITIES: ("entity_description", "default-entity-description"),
    schema.COMMUNITY_REPORTS: ("community_full_content", "default-community-full_content"),
    schema.TEXT_UNITS: ("text_unit_text", "default-text_unit-text"),
}
# graphrag 0.5-2.x name each table "<vector_store.container_name>-<embedding>"; "default" unless the
# user's settings.yaml chose another container.
CONTAINER_SUFFIXES = {
    schema.ENTITIES: "-entity-description",
    schema.COMMUNITY_REPORTS: "-community-full_content",
    schema.TEXT_UNITS: "-text_unit-text",
}
# graphrag's `snapshots.embeddings` files: embeddings.<name>.parquet, 3.x name first, then 0.5-2.x's
# dotted one (a vector store other than LanceDB leaves these as the only local copy of the vectors).
SNAPSHOT_NAMES = {
    schema.ENTITIES: ("entity_description", "entity.description"),
    schema.COMMUNITY_REPORTS: ("community_full_content", "community.full_content"),
    schema.TEXT_UNITS: ("text_unit_text", "text_unit.text"),
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
    source: str  # "graphrag-lancedb" | "embeddings-parquet" | "embeddings-csv" | "parquet-column" | "computed"
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
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    return _matrix_from_chunks(chunks, len(column), where)


def _matrix_from_chunks(chunks: Iterable[pa.Array], rows: int, where: str) -> np.ndarray:
    """Vector chunks copied one by one into one preallocated (rows, dim) float32 matrix, then
    validated and normalised in place: a 10^6 x 1536 column never exists twice in memory."""
    matrix: np.ndarray | None = None
    row = 0
    for chunk in chunks:
        if len(chunk) == 0:
            continue
        dim = _vector_dimension(chunk, where)
        if matrix is None:
            matrix = np.empty((rows, dim), dtype=np.float32)
        elif dim != matrix.shape[1]:
            raise IngestError(f"{where}: vectors have mixed dimensions {[matrix.shape[1], dim]}")
        row = _fill_rows(matrix, row, chunk, where)
    if matrix is None:
        return np.zeros((0, 0), dtype=np.float32)
    assert row == rows, (row, rows)
    return normalise_rows(matrix, where)


def _vector_dimension(column: pa.Array, where: str) -> int:
    """The one dimension of a chunk of vectors (checked: list of numbers, no nulls, one length)."""
    typ = column.type
    if not (pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ)):
        raise IngestError(f"{where} has type {typ}, expected a list of floats")
    if not (pa.types.is_floating(typ.value_type) or pa.types.is_integer(typ.value_type)):
        raise IngestError(f"{where} has type {typ}, expected a list of floats")
    if column.null_count:
        raise IngestError(f"{where}: {column.null_count} rows have no vector (null)")
    if pa.types.is_fixed_size_list(typ):
        dim = typ.list_size
    else:
        dims = np.unique(pc.list_value_length(column).to_numpy(zero_copy_only=False))
        if len(dims) != 1:
            raise IngestError(f"{where}: vectors have mixed dimensions {dims.tolist()[:5]}")
        dim = int(dims[0])
    if dim == 0:
        raise IngestError(f"{where}: vectors are empty (dimension 0)")
    return dim


def _fill_rows(matrix: np.ndarray, row: int, chunk: pa.Array, where: str) -> int:
    """Copy one chunk of vectors into `matrix` from `row` on (cast to float32); the next free row."""
    n, dim = len(chunk), matrix.shape[1]
    flat = pc.list_flatten(chunk).to_numpy(zero_copy_only=False)
    if len(flat) != n * dim:  # sliced or nested-null storage, or a length that differs: exact path
        try:
            flat = np.asarray(chunk.to_pylist(), dtype=np.float64).reshape(-1)
        except ValueError as exc:
            raise IngestError(f"{where}: vectors have mixed dimensions ({exc})") from exc
        if len(flat) != n * dim:
            raise IngestError(f"{where}: vectors have mixed dimensions (expected {dim})")
    matrix[row : row + n] = flat.reshape(n, dim)
    return row + n


# Below this a float32 norm may have lost squares to underflow (components under ~1e-19).
_FLOAT32_NORM_FLOOR = 1e-15


def normalise_rows(matrix: np.ndarray, where: str) -> np.ndarray:
    """Validate (finite, non-zero) and L2-normalise each row in place (cosine = dot product).
    `matrix` must be a float32 array the caller owns; it is returned."""
    block = 65_536  # rows per step: the temporaries stay small whatever the table size
    for start in range(0, matrix.shape[0], block):
        part = matrix[start : start + block]
        bad = ~np.isfinite(part).all(axis=1)
        if bad.any():
            first = start + int(np.argmax(bad))
            raise IngestError(f"{where}: vectors contain NaN or inf (first at row {first})")
        with np.errstate(over="ignore", under="ignore"):  # handled below
            norms = np.linalg.norm(part, axis=1)
        if not (odd := ~np.isfinite(norms) | (norms < _FLOAT32_NORM_FLOOR)).any():
            part /= norms[:, None]
            continue
        # float32 squares overflow above ~1e19 (a zero vector would be stored) and underflow
        # below ~1e-19 (a wrong norm, or a false "all zeros"): norm those rows in float64
        rows = np.flatnonzero(odd)
        wide = part[rows].astype(np.float64)
        wide_norms = np.linalg.norm(wide, axis=1)
        if (zero := wide_norms == 0).any():
            raise IngestError(f"{where}: vectors are all zeros (first at row {start + int(rows[np.argmax(zero)])})")
        norms[rows] = 1.0
        part /= norms[:, None]
        part[rows] = wide / wide_norms[:, None]
    return matrix


def _from_arrow(table: pa.Table, where: str, source: str) -> FoundVectors:
    vector_col = _vector_column(table.schema, where)
    ids = table.column("id").cast(pa.string()).to_pylist()
    matrix = vectors_to_matrix(table.column(vector_col), f"{where}: column {vector_col!r}")
    return FoundVectors(ids, matrix, source, where)


def _vector_column(schema: pa.Schema, where: str) -> str:
    if "id" not in schema.names:
        raise IngestError(f"{where}: required column 'id' is missing")
    vector_col = next((c for c in _VECTOR_COLUMNS if c in schema.names), None)
    if vector_col is None:
        raise IngestError(f"{where}: no vector column ('vector' or 'embedding')")
    return vector_col


def _from_lance(path: Path) -> FoundVectors:
    """graphrag's LanceDB table read batch by batch into one preallocated matrix."""
    import lance  # pylance; a dependency of lancedb

    dataset = lance.dataset(str(path))
    vector_col = _vector_column(dataset.schema, str(path))
    where = f"{path}: column {vector_col!r}"
    ids: list[str] = []

    def vector_chunks() -> Iterator[pa.Array]:
        for batch in dataset.to_batches(columns=["id", vector_col]):
            ids.extend(batch.column("id").cast(pa.string()).to_pylist())
            yield batch.column(vector_col)

    matrix = _matrix_from_chunks(vector_chunks(), dataset.count_rows(), where)
    return FoundVectors(ids, matrix, "graphrag-lancedb", str(path))


def _lancedb_table(folder: Path, table: str, ids: list[str]) -> Path | None:
    """graphrag's LanceDB table for `table`: a known name, else the one "<container>-..." table (of
    several containers sharing the folder, the one with a vector for every row)."""
    for name in LANCEDB_TABLES[table]:
        if (folder / f"{name}.lance").is_dir():
            return folder / f"{name}.lance"
    candidates = sorted(folder.glob(f"*{CONTAINER_SUFFIXES[table]}.lance")) if folder.is_dir() else []
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    covering = [path for path in candidates if _covers(path, ids)]
    if len(covering) == 1:
        return covering[0]
    names = ", ".join(path.name for path in candidates)
    raise IngestError(
        f"{folder}: {len(candidates)} graphrag vector tables for {table} ({names}) and "
        f"{'none' if not covering else 'more than one'} has a vector for every row; keep only this index's "
        "container in the folder, or use --reembed"
    )


def _covers(path: Path, ids: list[str]) -> bool:
    """Whether the LanceDB table at `path` has a row for each of `ids`."""
    import lance

    try:
        found = set(lance.dataset(str(path)).to_table(columns=["id"]).column("id").cast(pa.string()).to_pylist())
    except Exception as exc:  # noqa: BLE001 - lance raises OSError/ValueError/RuntimeError
        raise IngestError(f"{path}: cannot read graphrag LanceDB table: {exc}") from exc
    return found.issuperset(ids)


def find_reusable(root: Path, table: str, raw_columns: dict[str, pa.ChunkedArray], ids: list[str], parquet: Path) -> FoundVectors | None:
    """graphrag's vectors for `table`, if the index has them (see module docstring for the order)."""
    path = _lancedb_table(root / "lancedb", table, ids)
    if path is not None:
        try:
            return _from_lance(path)
        except IngestError:
            raise
        except Exception as exc:  # noqa: BLE001 - lance raises OSError/ValueError/RuntimeError
            raise IngestError(f"{path}: cannot read graphrag LanceDB table: {exc}") from exc
    for name in SNAPSHOT_NAMES[table]:
        path = root / f"embeddings.{name}.parquet"
        if path.exists():
            try:
                vectors = pq.read_table(path)
            except (OSError, pa.ArrowException) as exc:
                raise IngestError(f"{path}: cannot read embeddings parquet: {exc}") from exc
            return _from_arrow(vectors, str(path), "embeddings-parquet")
        path = root / f"embeddings.{name}.csv"  # graphrag 3.x with `table_provider: csv`
        if path.exists():
            ids, matrix, column = read_embeddings_csv(path)
            return FoundVectors(ids, normalise_rows(matrix, f"{path}: column {column!r}"), "embeddings-csv", str(path))
    for column in PARQUET_COLUMNS[table]:
        if column in raw_columns:
            where = f"{parquet}: column {column!r}"
            if len(raw_columns[column]) and raw_columns[column].null_count == len(raw_columns[column]):
                # graphrag 0.4 configured with a vector store sent the vectors there and left this empty
                log.warning("%s holds no vector (graphrag 0.4 stored them in its vector store); computing them", where)
                continue
            return FoundVectors(ids, vectors_to_matrix(raw_columns[column], where), "parquet-column", str(parquet))
    return None


def align(found: FoundVectors, ids: Sequence[str], table: str) -> np.ndarray:
    """`found`'s vectors in the order of `ids`; IngestError if any row has no vector."""
    if found.ids is ids:
        return found.matrix
    position: dict[str, int] = {}
    for i, key in enumerate(found.ids):
        if key in position:
            # graphrag 1.x/2.x re-runs with `overwrite: false` append every vector again: the same
            # vector twice is harmless, two different ones leave no way to choose.
            if np.array_equal(found.matrix[position[key]], found.matrix[i]):
                continue
            raise IngestError(
                f"{found.origin}: id {key!r} has two different vectors (a graphrag run appended to its "
                "vector store?); rerun with --reembed to compute all vectors with the configured embedder"
            )
        position[key] = i
    rows = np.fromiter((position.get(k, -1) for k in ids), dtype=np.int64, count=len(ids))
    missing = np.flatnonzero(rows < 0)
    if len(missing):
        raise IngestError(
            f"{found.origin}: no vector for {len(missing)} of {len(ids)} {table} rows (e.g. id {ids[int(missing[0])]!r}); "
            "rerun with --reembed to compute all vectors with the configured embedder"
        )
    if len(rows) == len(found.matrix) and bool(np.all(rows == np.arange(len(rows)))):
        return found.matrix  # already in table order (graphrag writes both in the same order): no copy
    return found.matrix[rows]


async def compute(texts: Sequence[str], embedder: Embedder, *, batch_size: int, desc: str, progress: bool) -> np.ndarray:
    """Embed `texts` in batches (one call at a time: embedders are CPU- or rate-bound) with a progress bar."""
    from tqdm.auto import tqdm

    # Sized by the first batch: an embedder may only learn its dimension from its first answer (a
    # remote model the client has no table for).
    out: np.ndarray | None = None
    with tqdm(total=len(texts), desc=desc, unit="text", disable=not progress, leave=False) as bar:
        for start in range(0, len(texts), batch_size):
            batch = list(texts[start : start + batch_size])
            vectors = np.asarray(await embedder.embed(batch, kind="document"), dtype=np.float32)
            if vectors.shape != (len(batch), embedder.dimension):
                raise IngestError(
                    f"embedder {embedder.model_id!r} returned shape {vectors.shape} for {len(batch)} texts, "
                    f"expected ({len(batch)}, {embedder.dimension})"
                )
            if out is None:
                out = np.zeros((len(texts), vectors.shape[1]), dtype=np.float32)
            out[start : start + len(batch)] = vectors
            bar.update(len(batch))
    if out is None:  # no texts
        out = np.zeros((0, embedder.dimension), dtype=np.float32)
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
