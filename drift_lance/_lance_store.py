"""`LanceStore`: the `IndexStore` contract on LanceDB's async API.

Every table is opened at the version the newest manifest pins, so an ingest that is still running
(or was killed) is invisible. Vector search uses the table's ANN index when ingest built one;
otherwise an exact path: the (small) table's vectors are loaded once into a float32 matrix and
scored in memory (`drift_lance._exact`: a matrix product, or for a large one an int8 screening pass
first, with the same results), which is far faster than LanceDB's flat scan.

On object storage every LanceDB read is a request, so hot data is kept in memory, each cache bounded
in bytes (`StoreConfig`): the exact-search matrices, the rows of small tables (key lookups then need no
request), and LanceDB's own index/metadata caches (a `lancedb.Session`, handed on to the store of
the next generation when the service reloads).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import shlex
import os
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from drift_lance._lancedb import lancedb
import numpy as np
import polars as pl
import pyarrow as pa

from drift_lance import schema
from drift_lance._cache import BoundedCache
from drift_lance._arguments import one_vector, real_array
from drift_lance._opening import opening
from drift_lance._exact import ExactMatrix
from drift_lance._lance_manifest import listed_data_files
from drift_lance._positions import positions_by_value, positions_of, rows_at
from drift_lance.config import checked_config
from drift_lance.config.ingest import SearchTuning, StoreConfig
from drift_lance.errors import ConfigError, DriftLanceError, IndexUnreadableError, StoreError
from drift_lance.object_store import (
    check_not_a_file,
    connect_uri,
    describe_open_failure,
    is_local_uri,
    merge_storage_options,
    resolve_storage_options,
)
from drift_lance.store import Manifest, TableInfo

__all__ = ["LanceStore", "ann_query", "list_table_names", "open_store", "read_manifests", "sql_literal"]

log = logging.getLogger(__name__)

SIMILARITY = "_similarity"


def sql_literal(value: Any) -> str:
    """A value as a LanceDB SQL literal; strings are single-quoted with quotes doubled."""
    if value is None:
        return "NULL"
    if isinstance(value, bool | np.bool_):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int | np.integer):
        return str(int(value))
    if isinstance(value, float | np.floating):
        if not np.isfinite(value):
            raise StoreError(f"cannot filter on non-finite value {value!r}")
        return repr(float(value))
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    raise StoreError(f"unsupported filter value type {type(value).__name__}: {value!r}")


def _quote_ident(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


async def read_manifests(db: Any, uri: str) -> list[Manifest]:
    """All complete manifests of the database at `uri`, oldest generation first ([] when none)."""
    if schema.MANIFEST_TABLE not in await list_table_names(db):
        return []
    table = await db.open_table(schema.MANIFEST_TABLE)
    rows = (await table.query().select(["generation", "manifest"]).to_arrow()).to_pylist()
    manifests = []
    for row in sorted(rows, key=lambda r: r["generation"]):
        try:
            manifests.append(Manifest.model_validate(json.loads(row["manifest"])))
        except (ValueError, TypeError) as exc:
            raise StoreError(
                f"{uri}: manifest generation {row['generation']} in table {schema.MANIFEST_TABLE!r} is unreadable: {exc}"
            ) from exc
    return manifests


async def list_table_names(db: Any) -> set[str]:
    """Every table name of a LanceDB async connection (list_tables is paged)."""
    names: list[str] = []
    token: str | None = None
    while True:
        resp = await db.list_tables(page_token=token)
        names.extend(resp.tables)
        token = resp.page_token
        if not token:
            return set(names)


def cache_overflow_warning(table: str, index_bytes: int | None, cache_bytes: int | None) -> str | None:
    """Why queries of `table` will be slow, when its vector index (`index_bytes`) is larger than the
    index cache: every query then re-reads the partitions it probes (an index built with lancedb
    0.41's 5-bit default at 10^6 x 1536, 985 MB against 512 MiB: 20-35 ms a query instead of ~9)."""
    if not index_bytes or cache_bytes is None or index_bytes <= cache_bytes:
        return None
    return (f"table {table!r}: its vector index ({index_bytes / 2**20:,.0f} MiB) is larger than "
            f"store.index_cache_bytes ({cache_bytes / 2**20:,.0f} MiB), so queries re-read partitions: raise "
            "index_cache_bytes, or re-ingest (ingest builds 1-bit IVF_RQ codes, vector_index.num_bits)")


class LanceStore:
    """Read access to one ingested index, pinned to one manifest generation."""

    def __init__(self, uri: str, db: Any, manifest: Manifest, config: StoreConfig, session: Any = None) -> None:
        self.uri = uri
        self.manifest = manifest
        self.config = config
        self.session = session  # the lancedb.Session holding LanceDB's index and metadata caches
        self._db = db
        self._tables: dict[str, Any] = {}
        self._schemas: dict[str, pa.Schema] = {}  # of the pinned versions in self._tables
        # Single-flight loads (a table's handle, matrix, cached rows), one lock per name per event loop:
        # an asyncio.Lock binds to the loop that first waits on it, and a store may serve several
        # loops in its life (asyncio.run per call, a thread per loop).
        self._locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = weakref.WeakKeyDictionary()
        self._closed = False
        self.vector_cache = BoundedCache(config.vector_cache_bytes)  # (table, version) -> ExactMatrix
        self.table_cache = BoundedCache(config.table_cache_bytes)  # (table, version) -> pl.DataFrame
        self._not_cached: set[str] = set()  # tables too large for the table cache
        self._local = is_local_uri(uri)

    def __repr__(self) -> str:
        return f"LanceStore(uri={self.uri!r}, generation={self.manifest.generation})"

    # ------------------------------------------------------------------ tables

    def has_table(self, table: str) -> bool:
        return table in self.manifest.tables

    def dimension(self, table: str) -> int:
        """Vector dimension of `table` (StoreError when it has no vector column)."""
        info = self.manifest.vectors.get(table)
        if info is None:
            if table not in self.manifest.tables:  # a misspelt name is not "a table without vectors"
                raise self._unknown_table(table)
            raise StoreError(f"{self.uri}: table {table!r} has no vector column (tables with vectors: "
                             f"{', '.join(sorted(self.manifest.vectors))})")
        return info.dimension

    def _unknown_table(self, table: str) -> StoreError:
        return StoreError(
            f"{self.uri}: table {table!r} is not in manifest generation {self.manifest.generation} "
            f"(tables: {', '.join(sorted(self.manifest.tables))})"
        )

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(asyncio.get_running_loop(), {}).setdefault(name, asyncio.Lock())

    async def _table(self, table: str) -> Any:
        if self._closed:
            raise StoreError(f"{self.uri}: this store is closed")
        if table not in self.manifest.tables:
            raise self._unknown_table(table)
        handle = self._tables.get(table)
        if handle is not None:
            return handle
        async with self._lock("open"):
            if table not in self._tables:
                version = self.manifest.tables[table].version
                try:
                    self._tables[table] = await self._db.open_table(table, version=version)
                except Exception as exc:  # noqa: BLE001 - any LanceDB failure is a store error here
                    raise StoreError(f"{self.uri}: cannot open table {table!r} at version {version}: {exc}") from exc
            return self._tables[table]

    async def open_tables(self) -> None:
        """Open every table of the manifest at its pinned version (the searches reuse the handles).
        A database missing one (a partial copy, a deleted table folder) then fails here, as a
        StoreError naming the table, instead of in every DRIFT follow-up after the primer's calls
        were paid for (which answered from the primer alone, reported as merely degraded). So does a
        manifest without a table every ingest writes."""
        missing = [table for table in schema.REQUIRED_TABLES if table not in self.manifest.tables]
        if missing:
            raise StoreError(f"{self.uri}: manifest generation {self.manifest.generation} lists no table "
                             f"{', '.join(map(repr, missing))}, which every ingest writes; run the ingest again")
        for table in self.manifest.tables:
            await self._table(table)
        if self._local:
            for table in self.manifest.tables:
                await self.check_files_present(table)

    async def check_files_present(self, table: str) -> None:
        """StoreError naming the table and the file when a data or deletion file of the table's pinned
        version is missing from the local database folder, or its size is not the one that version
        recorded (a partial copy or sync, a deleted or truncated file): such a file failed only in the
        searches that read it, and a DRIFT query answered from the primer alone, exit 0. One stat per
        file and no read: ~1 ms per table (ingest writes one data file per table up to 2^20 rows, so
        10^6 rows is one file). Not on object storage, where each file would be a request: a read
        that fails there is checked by `raise_if_unreadable`. The files are listed from the version's
        manifest (`listed_data_files`); pylance (imported once: ~25 ms and +35 MB resident) is asked
        only when that reader cannot confirm every file, and words the failure."""
        handle = await self._table(table)
        version = self.manifest.tables[table].version
        if await self._files_confirmed(table, handle, version):
            return
        try:
            dataset = await handle.to_lance()
            fragments = [fragment.metadata for fragment in dataset.get_fragments()]
        except Exception as exc:  # noqa: BLE001 - Lance reports a missing object as OSError, ValueError, ...
            raise IndexUnreadableError(f"{self.uri}: table {table!r} at version {version} cannot be read: {exc}") from exc
        root = Path(dataset.uri)
        for fragment in fragments:
            files = [(root / "data" / f.path, f.file_size_bytes) for f in fragment.files if f.base_id is None]
            if fragment.deletion_file is not None and fragment.deletion_file.base_id is None:
                files.append((root / fragment.deletion_file.path(fragment.id), None))
            for path, expected in files:
                problem = _file_problem(path, expected)
                if problem is None:
                    continue
                raise IndexUnreadableError(f"{self.uri}: table {table!r} at version {version} cannot be read: file {path} {problem}; the database "
                                 "folder is incomplete (a partial copy or sync, or a deleted file): copy it whole, or ingest again")

    async def _files_confirmed(self, table: str, handle: Any, version: int) -> bool:
        """Every data file the version's manifest lists is present at its recorded size (False also
        when the manifest is not one `listed_data_files` reads, or lists no file for rows)."""
        try:
            root = await handle.uri()
        except Exception:  # noqa: BLE001 - pylance decides
            return False
        if not isinstance(root, str) or "://" in root:
            return False
        listed = listed_data_files(Path(root), version)
        if listed is None or (not listed and self.manifest.tables[table].rows):
            return False
        try:
            return all(_file_problem(path, expected) is None for path, expected in listed)
        except OSError:  # a file that cannot be stat-ed: pylance decides and words it
            return False

    # ------------------------------------------------------------------ search

    async def search(
        self,
        table: str,
        vector: np.ndarray,
        k: int,
        *,
        columns: Sequence[str] | None = None,
        where: str | None = None,
    ) -> pl.DataFrame:
        query = one_vector(vector, "vector", several="search_many")  # several rows were searched as one long vector
        return (await self.search_many(table, query.reshape(1, -1), k, columns=columns, where=where))[0]

    async def search_many(
        self,
        table: str,
        vectors: np.ndarray,
        k: int,
        *,
        columns: Sequence[str] | None = None,
        where: str | None = None,
    ) -> list[pl.DataFrame]:
        """`search` for each row of `vectors`. Exactly searched tables score every query in one
        matrix product (20 queries cost about 5 single ones); ANN tables get one multi-vector
        LanceDB query (20 at 10^6 x 1536: ~28% less CPU and 10-18% less wall time than 20 queries
        run concurrently, with the same results)."""
        matrix = real_array(vectors, "vectors")
        k = _checked_k(k)
        if isinstance(columns, str):  # else searched as its letters' columns
            raise ConfigError(f"columns: expected a list of column names, got the string {columns!r}")
        if matrix.ndim != 2:
            raise StoreError(f"{self.uri}: query vectors for table {table!r} must be a 2-d array, got {matrix.ndim}-d")
        queries = [self._query_vector(table, row) for row in matrix]
        await self._check_columns(table, columns)
        # LanceDB sizes its result buffers by k: an unbounded k from a setting aborts the process.
        k = min(k, self.manifest.tables[table].rows)
        if k <= 0 or not queries:
            empty = await self._empty(table, columns, with_similarity=True)
            return [empty for _ in queries]
        if self.manifest.tables[table].vector_index and not self._exact_in_memory(table):
            return await self._search_lance(table, np.stack(queries), k, columns, where)
        return await self._search_exact(table, np.stack(queries), k, columns, where)

    def _exact_in_memory(self, table: str) -> bool:
        """On object storage an ANN query reads index partitions and re-ranking rows from the store
        on every call (30k x 384: ~10 GETs, 190 ms on loopback S3, against 4.6 ms on local disk), so a
        table whose matrix fits half the vector cache is downloaded once and searched exactly in memory
        instead. On local disk the OS page cache makes the index cheap, and it is used as built."""
        if self._local or not self.config.exact_in_memory_on_object_storage:
            return False
        return self._matrix_bytes(table) <= self._matrix_budget(table)

    def _matrix_bytes(self, table: str, *, screened: bool = False) -> int:
        """Memory of the table's exact-search matrix (see ExactMatrix.estimated_bytes)."""
        return ExactMatrix.estimated_bytes(self.manifest.tables[table].rows, self.dimension(table), screened=screened)

    def _matrix_budget(self, table: str) -> int:
        """The most the table's exact-search matrix may hold: the vector cache, or half of it for an
        indexed table searched in memory on object storage."""
        max_bytes = self.vector_cache.max_bytes
        return max_bytes // 2 if self.manifest.tables[table].vector_index else max_bytes

    def _query_vector(self, table: str, vector: np.ndarray) -> np.ndarray:
        dim = self.dimension(table)
        query = np.asarray(vector, dtype=np.float32).reshape(-1)
        if query.shape[0] != dim:
            raise StoreError(
                f"{self.uri}: query vector has dimension {query.shape[0]} but table {table!r} "
                f"column {schema.VECTOR!r} has dimension {dim} (model {self.manifest.vectors[table].model!r})"
            )
        # One dot product both normalises and validates: a NaN or inf anywhere makes it non-finite.
        with np.errstate(over="ignore", invalid="ignore"):  # reported below, naming the table
            squared = float(np.dot(query, query))
        if math.isfinite(squared):
            return query / np.float32(math.sqrt(squared)) if squared > 0 else query
        if not np.all(np.isfinite(query)):
            raise StoreError(f"{self.uri}: query vector for table {table!r} contains NaN or inf")
        wide = query.astype(np.float64)  # finite, but its squared norm overflowed float32
        return (wide / np.linalg.norm(wide)).astype(np.float32)

    async def _search_lance(self, table: str, queries: np.ndarray, k: int, columns: Sequence[str] | None,
                            where: str | None = None) -> list[pl.DataFrame]:
        """LanceDB's vector query (ANN, or its flat scan without an index) for every row of `queries`,
        as one multi-vector query: LanceDB plans it once and runs the per-vector searches on its own
        threads (a flat scan is shared by all of them)."""
        handle = await self._table(table)
        q = ann_query(handle, queries[0] if len(queries) == 1 else queries, k, self.config.search,
                      self.manifest.tables[table]).with_row_id()
        if where:
            q = q.where(where)  # prefiltered (LanceDB's default): the top k among matching rows
        if columns is not None:
            q = q.select([*columns, "_distance"])  # named, or lance warns it will stop adding it
        rows = await q.to_arrow()
        # Best first per query; ties by row id keep equal-similarity results in a stable,
        # reproducible order. Sorted with numpy and converted once: Polars' sort and partition cost
        # ~1 ms per call here, on CPU caches the ANN scan has just flushed.
        distance = rows.column("_distance").to_numpy()
        if _QUERY_INDEX in rows.column_names:  # a multi-vector result names each row's query
            query_of = rows.column(_QUERY_INDEX).to_numpy()
        else:
            query_of = np.zeros(len(distance), dtype=np.int32)
        order = np.lexsort((rows.column("_rowid").to_numpy(), distance, query_of))
        similarity = 1.0 - distance[order].astype(np.float64)
        rows = rows.drop_columns([c for c in (_QUERY_INDEX, "_distance", "_rowid") if c in rows.column_names])
        scores = pa.array(similarity)
        # No column asked for (columns=[]): the scores alone (a table of no columns takes no rows).
        frame = pl.from_arrow(rows.take(order).append_column(SIMILARITY, scores) if rows.num_columns else pa.table({SIMILARITY: scores}))
        assert isinstance(frame, pl.DataFrame)
        bounds = np.searchsorted(query_of[order], np.arange(len(queries) + 1))
        return [frame.slice(int(start), int(end - start)) for start, end in zip(bounds[:-1], bounds[1:])]

    async def _search_exact(self, table: str, queries: np.ndarray, k: int, columns: Sequence[str] | None,
                            where: str | None = None) -> list[pl.DataFrame]:
        exact = await self._exact_index(table)
        if exact is None:  # matrix over the vector cache bound: let LanceDB scan, keep nothing
            return await self._search_lance(table, queries, k, columns, where)
        excluded = None if not where else ~(await self._matching_rows(table, where, exact.row_ids))
        tops, scores = exact.top_k(queries, k, excluded)  # one screening or product for the whole batch
        if tops.shape[1] == 0:
            empty = await self._empty(table, columns, with_similarity=True)
            return [empty for _ in queries]
        # One row read for the whole batch, then a zero-copy slice per query.
        rows = await self._rows_by_id(table, exact.row_ids, tops.ravel(), columns)
        similarity = pl.Series(SIMILARITY, scores.ravel().astype(np.float64))
        frame = rows.hstack([similarity]) if rows.width else similarity.to_frame()  # columns=[]: the scores alone
        if len(tops) == 1:
            return [frame]
        width = tops.shape[1]
        return [frame.slice(i * width, width) for i in range(len(tops))]

    async def _matching_rows(self, table: str, where: str, row_ids: np.ndarray) -> np.ndarray:
        """Which of `row_ids` (the exact matrix's, ascending) match the filter `where` (cached per
        table version: DRIFT's primer asks the same one every query)."""
        key = (table, self.manifest.tables[table].version, "where", where)
        mask = self.vector_cache.get(key)
        if mask is None:
            handle = await self._table(table)
            try:
                hits = await handle.query().where(where).select([]).with_row_id().to_arrow()
            except Exception as exc:  # noqa: BLE001 - LanceDB raises ValueError/RuntimeError for bad SQL
                raise StoreError(f"{self.uri}: filter {where!r} on table {table!r} failed: {exc}") from exc
            mask = np.isin(row_ids, hits.column("_rowid").to_numpy())
            self.vector_cache.put(key, mask, mask.nbytes)
        return mask

    async def _rows_by_id(self, table: str, all_ids: np.ndarray, picked: np.ndarray, columns: Sequence[str] | None) -> pl.DataFrame:
        """Rows with row ids `all_ids[picked]` (`all_ids`: every row id of the table, ascending), in
        that order, without `_rowid`."""
        rows = await self._cached_take(table, all_ids, picked, columns)
        if rows is not None:
            return rows
        wanted = all_ids[picked]
        handle = await self._table(table)
        take = handle.take_row_ids([int(r) for r in wanted]).with_row_id()
        if columns is not None:
            take = take.select(list(columns))
        rows = await take.to_arrow()
        # take does not promise an order: put rows back in score order via their row ids.
        position = {int(r): i for i, r in enumerate(rows.column("_rowid").to_pylist())}
        frame = pl.from_arrow(rows.take(pa.array([position[int(r)] for r in wanted], type=pa.int64())).drop_columns(["_rowid"]))
        assert isinstance(frame, pl.DataFrame)
        return frame

    async def _exact_index(self, table: str) -> ExactMatrix | None:
        """The table's vectors as a matrix (cached), or None when it would not fit the cache bound."""
        key = (table, self.manifest.tables[table].version)
        cached = self.vector_cache.get(key)
        if cached is not None:
            return cached
        if self._matrix_bytes(table) > self._matrix_budget(table):
            return None
        lock = self._lock(f"exact:{table}")
        async with lock:
            cached = self.vector_cache.get(key)
            if cached is None:
                handle = await self._table(table)
                arrow = await handle.query().select([schema.VECTOR]).with_row_id().to_arrow()
                # screening codes only where they fit too: the plain matrix is worth more than no matrix
                screen = self._matrix_bytes(table, screened=True) <= self._matrix_budget(table)
                cached = _exact_index_from_arrow(arrow, self.uri, table, screen=screen)
                self.vector_cache.put(key, cached, cached.nbytes)
            return cached

    async def _cached_rows(self, table: str) -> pl.DataFrame | None:
        """Every row of a small table without its vector column, plus `_rowid` (cached); None when
        the table is larger than a quarter of the table cache (so several small tables fit at once).
        Kept as a Polars frame: picking rows is then a gather per column (a few us), where an Arrow
        take plus the conversion of its result cost ~0.17 ms per exact search at 10^4 rows."""
        if table in self._not_cached or self.table_cache.max_bytes == 0:
            return None
        key = (table, self.manifest.tables[table].version)
        cached = self.table_cache.get(key)
        if cached is not None:
            return cached
        async with self._lock(f"rows:{table}"):
            cached = self.table_cache.get(key)
            if cached is not None:
                return cached
            handle = await self._table(table)
            limit = self.table_cache.max_bytes // 4
            stats = await handle.stats()
            vectors = self.manifest.tables[table].rows * 4 * (self.dimension(table) if table in self.manifest.vectors else 0)
            if stats["total_bytes"] - vectors > limit:
                self._not_cached.add(table)
                return None
            names = [n for n in (await handle.schema()).names if n != schema.VECTOR]
            # One chunk per column, in row-id (= table) order: a pick gathers from one contiguous
            # array, not from one chunk per LanceDB read batch, and row ids are found by binary search.
            arrow = (await handle.query().select(names).with_row_id().to_arrow()).sort_by("_rowid").combine_chunks()
            rows = pl.from_arrow(arrow)
            assert isinstance(rows, pl.DataFrame)
            size = rows.estimated_size()
            if size > limit or not self.table_cache.put(key, rows, size):
                self._not_cached.add(table)
                return None
            return rows

    async def _cached_take(self, table: str, all_ids: np.ndarray, picked: np.ndarray, columns: Sequence[str] | None) -> pl.DataFrame | None:
        """Rows `all_ids[picked]` from the table cache, in that order, or None to read LanceDB."""
        if columns is None or schema.VECTOR in columns:
            return None
        rows = await self._cached_rows(table)
        if rows is None or not set(columns) <= set(rows.columns):
            return None
        # The cached rows are the same table version sorted by row id, so when they hold every row
        # the positions are the indices into `all_ids` themselves.
        if rows.height == len(all_ids):
            positions = picked
        else:
            positions = np.searchsorted(rows.get_column("_rowid").to_numpy(), all_ids[picked])
        return rows_at(rows, positions, list(columns))

    # ------------------------------------------------------------------ exact reads

    async def fetch(
        self,
        table: str,
        key: str,
        values: Sequence[Any],
        *,
        columns: Sequence[str] | None = None,
    ) -> pl.DataFrame:
        handle = await self._table(table)
        await self._check_columns(table, [key, *(columns or ())])
        unique = list(dict.fromkeys(v for v in values if v is not None))
        if not unique:
            return await self._empty(table, columns)
        cached = await self._fetch_cached(table, key, unique, columns)
        if cached is not None:
            return cached
        size = self.config.fetch_chunk_size
        parts = []
        for start in range(0, len(unique), size):
            chunk = unique[start : start + size]
            where = f"{_quote_ident(key)} IN ({', '.join(sql_literal(v) for v in chunk)})"
            q = handle.query().where(where)
            if columns is not None:
                q = q.select(list(columns))
            parts.append(await q.to_arrow())
        frame = pl.from_arrow(pa.concat_tables(parts))
        assert isinstance(frame, pl.DataFrame)
        return frame

    async def _fetch_cached(self, table: str, key: str, values: list[Any], columns: Sequence[str] | None) -> pl.DataFrame | None:
        """`fetch` answered from the table cache (same rows, in table order), or None to ask LanceDB."""
        if columns is None or schema.VECTOR in columns:
            return None
        rows = await self._cached_rows(table)
        if rows is None or not {key, *columns} <= set(rows.columns):
            return None  # unknown names: LanceDB reports them
        key_type = (await self._schema(table)).field(key).type
        try:
            wanted = pa.array(values, type=key_type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
            return None  # e.g. strings for an integer column: LanceDB's SQL decides
        positions = self._key_positions(table, key, rows, key_type)
        if positions is None:
            matches = rows.get_column(key).is_in(pl.Series(values=wanted.to_pylist(), dtype=rows.schema[key]))
            found = np.flatnonzero(matches.to_numpy()).tolist()
        else:
            found = positions_of(positions, wanted.to_pylist())
        return rows_at(rows, found, list(columns))

    def _key_positions(self, table: str, key: str, rows: pl.DataFrame, key_type: pa.DataType) -> dict[Any, list[int]] | None:
        """{value: row positions} of a cached table's key column, built on first lookup and kept in
        the table cache: a lookup then costs the values asked for, not a pass over the column
        (~0.8 ms per is_in filter at 10^4 entities, five per local context). None for key types
        that are not plain integers or strings, or when the cache has no room."""
        if not (pa.types.is_integer(key_type) or pa.types.is_string(key_type) or pa.types.is_large_string(key_type)):
            return None
        cache_key = (table, self.manifest.tables[table].version, "positions", key)
        positions = self.table_cache.get(cache_key)
        if positions is None:
            positions = positions_by_value(rows.get_column(key).to_list())
            if not self.table_cache.put(cache_key, positions, _POSITIONS_BYTES_PER_ROW * rows.height):
                return None
        return positions

    async def scan(
        self,
        table: str,
        *,
        where: str | None = None,
        columns: Sequence[str] | None = None,
        limit: int | None = None,
    ) -> pl.DataFrame:
        handle = await self._table(table)
        await self._check_columns(table, columns)
        q = handle.query()
        if where:
            q = q.where(where)
        if columns is not None:
            q = q.select(list(columns))
        if limit is not None:
            q = q.limit(limit)
        try:
            arrow = await q.to_arrow()
        except Exception as exc:  # noqa: BLE001 - LanceDB raises plain errors for bad SQL
            raise StoreError(f"{self.uri}: scan of table {table!r} failed (where={where!r}): {exc}") from exc
        frame = pl.from_arrow(arrow)
        assert isinstance(frame, pl.DataFrame)
        return frame

    async def count(self, table: str) -> int:
        await self._table(table)  # validates the name
        return self.manifest.tables[table].rows

    async def check_readable(self, table: str) -> None:
        """Open every object of the table's pinned version: one row of each fragment (its data files
        and deletion file) and the statistics of each index (its files). A version with a missing
        object (a partial copy or replication of the database, a deleted file) then fails here, as a
        StoreError naming the table, rather than in the searches that reach it. ~20 ms per table at
        10^6 rows on local disk; on S3 a small read per object (a 10^4 x 384 index: 77 requests,
        1.7 MB)."""
        handle = await self._table(table)
        version = self.manifest.tables[table].version
        try:
            dataset = await handle.to_lance()
            await asyncio.to_thread(_open_every_object, dataset)
        except Exception as exc:  # noqa: BLE001 - Lance reports a missing object as OSError, ValueError, ...
            raise IndexUnreadableError(f"{self.uri}: table {table!r} at version {version} cannot be read: {exc}") from exc

    async def raise_if_unreadable(self, exc: BaseException) -> None:
        """The IndexUnreadableError naming the table, raised from `exc`, when `exc` (an error that is
        not ours) came from a file of the pinned version that is missing: a partial copy of the
        database failed as "RuntimeError: lance error: Not found: <file>, <a Rust source line>" (exit
        1). Checks only after a failure, so a search pays nothing for it; returns when every table
        reads whole."""
        unreadable = await self._first_unreadable_table(exc)
        if unreadable is not None:
            raise unreadable from exc

    async def unreadable_error(self, exc: BaseException) -> IndexUnreadableError | None:
        """For a read that failed with `exc` in a search that degrades around it (a DRIFT follow-up):
        the error naming the table when a file of the pinned version is missing or truncated. None
        when every table reads whole, and on object storage when the check failed for another reason
        than a missing object (a timeout: maybe transient)."""
        unreadable = await self._first_unreadable_table(exc)
        if unreadable is None or self._local or "not found" in str(unreadable).lower():
            return unreadable
        return None

    async def _first_unreadable_table(self, exc: BaseException) -> IndexUnreadableError | None:
        """Checked only after `exc` (an error that is not ours), so a search pays nothing for it:
        each table's files present at their recorded sizes (a local database), then readable."""
        if isinstance(exc, DriftLanceError):
            return None
        for table in self.manifest.tables:
            try:
                if self._local:
                    await self.check_files_present(table)
                await self.check_readable(table)
            except IndexUnreadableError as unreadable:
                return unreadable
        return None

    async def generations(self) -> list[int]:
        """Generations of every complete manifest in the database (this store pins one of them)."""
        return [m.generation for m in await self.manifests()]

    async def manifests(self) -> list[Manifest]:
        """Every complete manifest in the database, oldest generation first."""
        return await read_manifests(self._db, self.uri)

    async def indexes(self, table: str) -> dict[str, str]:
        """Index type per indexed column of the pinned table version, e.g. {"id": "BTree", "vector": "IvfHnswSq"}."""
        handle = await self._table(table)
        return {", ".join(i.columns): str(i.index_type) for i in await handle.list_indices()}

    async def vector_index_bytes(self, table: str) -> int | None:
        """On-disk size of the pinned table version's vector index (None: no index, or a LanceDB
        that does not report sizes)."""
        handle = await self._table(table)
        sizes = [getattr(i, "size_bytes", None) for i in await handle.list_indices() if "vector" in i.columns]
        return sizes[0] if sizes else None

    async def index_cache_warning(self, table: str) -> str | None:
        """Why queries of `table` will be slow, when its vector index is larger than the index cache
        (see `cache_overflow_warning`)."""
        index_bytes = await self.vector_index_bytes(table) if self.manifest.tables[table].vector_index else None
        return cache_overflow_warning(table, index_bytes, self.config.index_cache_bytes)

    async def close(self) -> None:
        """Close the tables and drop the caches; using the store afterwards raises StoreError."""
        self._closed = True
        for handle in self._tables.values():
            handle.close()
        self._tables.clear()
        self.vector_cache.clear()
        self.table_cache.clear()

    async def __aenter__(self) -> LanceStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ helpers

    async def _schema(self, table: str) -> pa.Schema:
        # A table version's schema never changes, and asking LanceDB is a cross-thread round trip.
        cached = self._schemas.get(table)
        if cached is None:
            cached = self._schemas[table] = await (await self._table(table)).schema()
        return cached

    async def _check_columns(self, table: str, columns: Sequence[str] | None) -> None:
        """StoreError naming the table and the columns it lacks (LanceDB and the row caches would
        each fail in their own words, or not at all for a lookup of no keys)."""
        if columns is None:
            return
        names = (await self._schema(table)).names
        missing = [c for c in columns if c not in names]
        if missing:
            raise StoreError(f"{self.uri}: table {table!r} has no column {', '.join(map(repr, missing))} (columns: {', '.join(names)})")

    async def _empty(self, table: str, columns: Sequence[str] | None, *, with_similarity: bool = False) -> pl.DataFrame:
        arrow_schema = await self._schema(table)
        if columns is not None:
            arrow_schema = pa.schema([arrow_schema.field(c) for c in columns])
        frame = pl.from_arrow(arrow_schema.empty_table())
        assert isinstance(frame, pl.DataFrame)
        if with_similarity:
            frame = frame.with_columns(pl.Series(SIMILARITY, [], dtype=pl.Float64))
        return frame


def ann_query(handle: Any, query: np.ndarray, k: int, tuning: SearchTuning, info: TableInfo, *, nprobes: int | None = None) -> Any:
    """LanceDB's top-k vector query on a table described by `info`, with the index parameters the
    store uses (`nprobes` overrides the probe count: ingest's calibration tries several). Without an
    ANN index (a table over the vector cache bound) it is LanceDB's flat scan."""
    q = handle.vector_search(query).column(schema.VECTOR).distance_type("cosine")
    if info.vector_index:
        q = q.nprobes(nprobes or tuning.probing_for(info)[0])
        refine = tuning.refine(info.vector_index)
        if refine:
            q = q.refine_factor(refine)
        if tuning.ef:
            q = q.ef(tuning.ef)
    return q.limit(k)


_QUERY_INDEX = "query_index"  # LanceDB's column naming the query vector of each multi-vector result row
_POSITIONS_BYTES_PER_ROW = 200  # a key-positions dict entry: key object, list, int, hash slot


def _exact_index_from_arrow(arrow: pa.Table, uri: str, table: str, *, screen: bool = True) -> ExactMatrix:
    """The vector column as a float32 matrix in row-id (= table) order, with the row ids."""
    column = arrow.column(schema.VECTOR).combine_chunks()
    if not pa.types.is_fixed_size_list(column.type):
        raise StoreError(f"{uri}: table {table!r} column {schema.VECTOR!r} is {column.type}, not a fixed-size list")
    dim = column.type.list_size
    flat = column.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    if not np.isfinite(flat).all():  # ingest refuses them; a NaN would poison every top k
        bad = int(np.flatnonzero(~np.isfinite(flat))[0] // dim)
        raise StoreError(f"{uri}: table {table!r} column {schema.VECTOR!r} has NaN or infinite values "
                         f"(first at row id {int(arrow.column('_rowid')[bad].as_py())})")
    matrix = flat.reshape(len(column), dim)
    row_ids = arrow.column("_rowid").to_numpy()
    order = np.argsort(row_ids, kind="stable")
    if not np.array_equal(order, np.arange(len(order))):  # scans usually come back in row-id order
        matrix, row_ids = matrix[order], row_ids[order]
    return ExactMatrix.build(matrix, row_ids, screen=screen)


def _open_every_object(dataset: Any) -> None:
    """Read a little of every file of a Lance dataset version (blocking; see `check_readable`)."""
    names = dataset.schema.names
    for fragment in dataset.get_fragments():
        if fragment.count_rows():  # applies the fragment's deletion file, if it has one
            fragment.take([0], columns=names)  # a row from each of its data files
    describe = getattr(dataset, "describe_indices", None)  # pylance 1.x+; older ones list dicts
    for name in ([i.name for i in describe()] if describe else [i["name"] for i in dataset.list_indices()]):
        dataset.stats.index_stats(name)


def _ingest_hint(uri: str) -> str:
    """How to make a database at `uri`. A folder of parquet files (or graphrag 3.x's CSV tables) is a
    GraphRAG output given as --db: it is ingest's SRC, and the database goes next to it, not into it."""
    folder = Path(uri).expanduser()
    if "://" in uri or not (any(folder.glob("*.parquet")) or (folder / "entities.csv").exists()):
        return f"run `drift-lance ingest SRC --db {shlex.quote(uri)}`"
    database = folder.resolve().with_name(f"{folder.resolve().name}.lancedb")
    return (f"it holds GraphRAG output (parquet or CSV tables), not a drift-lance database: run "
            f"`drift-lance ingest {shlex.quote(uri)} --db {shlex.quote(str(database))}`, then use --db {shlex.quote(str(database))}")


def _checked_k(k: Any) -> int:
    """A negative k returned no rows as if nothing matched; a float or text failed deep in the sort."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ConfigError(f"k: expected a whole number >= 0, got {k!r}")
    return int(k)


def _file_problem(path: Path, expected: int | None) -> str | None:
    """What is wrong with a table file expected at `expected` bytes (None or 0: any size), or None."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "is missing"
    if not expected or size == expected:
        return None
    return f"is {size:,} bytes, not the {expected:,} that version wrote (truncated?)"


def _checked_uri(uri: Any) -> str:
    """`uri` as a string; ConfigError for None (an unset `os.environ.get("DB")`) or a blank one, which
    were opened as the folder "None" or the working directory and reported as a database not found there."""
    if not isinstance(uri, (str, os.PathLike)):
        raise ConfigError(f"database uri: expected a path or URI string, got {type(uri).__name__}")
    uri = os.fspath(uri)
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError(f"database uri: {'empty' if isinstance(uri, str) else 'not a text path'}")
    return uri


@opening
async def open_store(
    uri: str | os.PathLike[str],
    *,
    storage_options: dict[str, str] | None = None,
    config: StoreConfig | Mapping[str, Any] | None = None,
    generation: int | None = None,
    session: Any = None,
) -> LanceStore:
    """Open the ingested index at `uri` (any LanceDB URI), pinned to its newest complete manifest
    (or to `generation`). Raises StoreError naming the URI when there is no complete ingest.

    Storage options: `config.storage_options` updated by `storage_options`, plus allow_http for an
    http:// S3 endpoint (see `drift_lance.object_store`). `session`: a `lancedb.Session` to share
    LanceDB's caches with another store (default: a new one sized by `config`).

        store = await open_store(uri)           # close it with `await store.close()`
        async with open_store(uri) as store:    # or let the block close it
            ...

    Nothing is opened until it is awaited or entered."""
    uri = _checked_uri(uri)
    config = checked_config(config, StoreConfig, "config") or StoreConfig()
    if storage_options is not None and not isinstance(storage_options, Mapping):  # else an AttributeError on .items()
        raise ConfigError(f"storage_options: expected a dict of option names to values, got {type(storage_options).__name__}")
    if generation is not None and (isinstance(generation, bool) or not isinstance(generation, int)):
        # generation="2" said "no manifest generation 2 (have [1, 2])"; True opened generation 1
        raise ConfigError(f"generation: expected a whole number, got {type(generation).__name__} {generation!r}")
    check_not_a_file(uri)
    if "://" not in uri and not Path(uri).expanduser().exists():  # local default: say so plainly
        raise StoreError(f"{uri}: no database at this path; run `drift-lance ingest SRC --db {shlex.quote(uri)}` first")
    options = resolve_storage_options(uri, merge_storage_options(config.storage_options, storage_options))
    if session is None:
        session = lancedb.Session(
            index_cache_size_bytes=config.index_cache_bytes, metadata_cache_size_bytes=config.metadata_cache_bytes
        )
    try:
        db = await lancedb.connect_async(connect_uri(uri), storage_options=options, session=session)
        manifests = await read_manifests(db, uri)
    except StoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - connection errors differ per backend
        raise describe_open_failure(uri, exc) from exc
    if not manifests:
        raise StoreError(f"{uri}: no complete ingest found (no {schema.MANIFEST_TABLE!r} table); {_ingest_hint(uri)}")
    if generation is None:
        manifest = manifests[-1]
    else:
        matches = [m for m in manifests if m.generation == generation]
        if not matches:
            raise StoreError(f"{uri}: no manifest generation {generation} (have {[m.generation for m in manifests]})")
        manifest = matches[0]
    return LanceStore(uri, db, manifest, config, session)
