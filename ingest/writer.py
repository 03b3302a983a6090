"""Write validated tables to LanceDB and switch to them atomically.

Every table is written with mode="overwrite", which makes a new LanceDB table version; readers pin
the versions named by the newest manifest, so they keep seeing the previous data. Only after every
table and index is written does one row get appended to the manifest table: that append is the
switch. Nothing here renames folders, so the same protocol works on object storage.

On an exception the touched tables are restored to the versions the previous manifest pins (best
effort); after a kill -9 nothing needs restoring, because no manifest points at the new versions.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from drift_lance._lancedb import lancedb
import numpy as np
import polars as pl
import pyarrow as pa

import drift_lance
from drift_lance import schema
from drift_lance._lance_store import list_table_names, read_manifests
from drift_lance.config.ingest import IngestConfig, VectorIndexConfig
from drift_lance.errors import IngestError, StoreError
from drift_lance.object_store import check_not_a_file, connect_uri, describe_open_failure, resolve_storage_options
from drift_lance.store import Manifest, TableInfo, VectorColumnInfo
from ingest.calibrate import calibrate_probes
from ingest.embeddings import TableVectors

log = logging.getLogger(__name__)

PQ_MIN_ROWS = 256  # one row per code of an 8-bit PQ codebook

# Test hook for the interrupted-ingest test: seconds to sleep after each table is written.
PAUSE_ENV = "DRIFT_LANCE_INGEST_PAUSE_AFTER_TABLE"


@dataclass(slots=True)
class PreparedTable:
    name: str
    frame: pl.DataFrame  # exactly schema.COLUMNS[name]
    vectors: TableVectors | None = None


@dataclass(slots=True)
class WriteTimings:
    write_s: float = 0.0
    index_s: float = 0.0
    cleanup_s: float = 0.0
    calibrate_s: float = 0.0
    index_s_by_table: dict[str, float] = field(default_factory=dict)


def to_arrow(table: PreparedTable) -> pa.Table:
    """The table in its exact LanceDB schema (vector column appended as fixed_size_list<float32>)."""
    arrow = table.frame.to_arrow()
    columns = [arrow.column(name).cast(typ) for name, typ in schema.COLUMNS[table.name]]
    if table.name in schema.VECTOR_TABLES:
        assert table.vectors is not None, f"table {table.name} needs vectors"
        matrix = np.ascontiguousarray(table.vectors.matrix, dtype=np.float32)
        columns.append(pa.FixedSizeListArray.from_arrays(pa.array(matrix.reshape(-1)), matrix.shape[1]))
        return pa.Table.from_arrays(columns, schema=schema.table_schema(table.name, matrix.shape[1]))
    return pa.Table.from_arrays(columns, schema=schema.table_schema(table.name))


def index_params(config: VectorIndexConfig, rows: int, dim: int) -> dict[str, Any]:
    """The concrete build parameters for a table of `rows` x `dim` (recorded in the manifest)."""
    if config.type == "IVF_HNSW_SQ":
        partitions = config.num_partitions or max(1, rows // 100_000)
        return {"num_partitions": partitions, "m": config.m, "ef_construction": config.ef_construction}
    # IVF_RQ: half of sqrt(rows). Each probed partition costs ~55 us of fixed work besides its rows, so
    # at 10^6 x 1536 500 partitions reach recall@10 0.955 at 60 probes in 7.4-8.5 ms, where 1000 need
    # 96 probes and 11.0-11.9 ms (raw LanceDB, alternated; 700 and 350 partitions did worse than 500).
    root = math.sqrt(rows) / 2 if config.type == "IVF_RQ" else math.sqrt(rows)
    # LanceDB trains at most one partition per row; the manifest records what it builds
    partitions = min(config.num_partitions or max(1, round(root)), max(rows, 1))
    if config.type == "IVF_PQ":
        return {"num_partitions": partitions, "num_sub_vectors": config.num_sub_vectors or pq_sub_vectors(dim)}
    if config.type == "IVF_RQ":
        return {"num_partitions": partitions, "num_bits": config.num_bits}
    return {"num_partitions": partitions}


def pq_sub_vectors(dim: int) -> int:
    """16 dimensions per PQ sub-vector, LanceDB's SIMD-friendly default, where that divides the
    dimension; LanceDB needs a divisor, so elsewhere the largest one below dim / 16 (300-d: 15)."""
    return next(n for n in range(max(1, dim // 16), 0, -1) if dim % n == 0)


def _vector_index(config: VectorIndexConfig, rows: int, dim: int) -> Any:
    from lancedb.index import HnswSq, IvfFlat, IvfPq, IvfRq

    params = index_params(config, rows, dim)
    if config.type == "IVF_HNSW_SQ":
        return HnswSq(distance_type=config.distance_type, **params)
    if config.type == "IVF_PQ":
        return IvfPq(distance_type=config.distance_type, **params)
    if config.type == "IVF_RQ":
        return IvfRq(distance_type=config.distance_type, **params)
    return IvfFlat(distance_type=config.distance_type, **params)


class IndexWriter:
    """One ingest's write phase into the database at `uri`."""

    def __init__(self, uri: str, config: IngestConfig, storage_options: dict[str, str] | None, progress: bool) -> None:
        self.uri = uri
        self.config = config
        self.storage_options = storage_options
        self.progress = progress
        self.timings = WriteTimings()
        self.warnings: list[str] = []  # what the report carries besides the input's warnings
        self._db: Any = None
        self._manifests: list[Manifest] = []  # every complete generation's, oldest first, when opened
        self._touched: list[str] = []

    @property
    def _previous(self) -> Manifest | None:
        """The newest generation when this ingest started (None for an empty database)."""
        return self._manifests[-1] if self._manifests else None

    async def open(self) -> Manifest | None:
        check_not_a_file(self.uri)
        try:
            # Fill what LanceDB does not infer from the environment (allow_http for an http:// endpoint).
            self.storage_options = resolve_storage_options(self.uri, self.storage_options)
            self._db = await lancedb.connect_async(connect_uri(self.uri), storage_options=self.storage_options)
            manifests = await read_manifests(self._db, self.uri)
        except StoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - connection errors differ per backend
            raise describe_open_failure(self.uri, exc) from exc
        self._manifests = manifests
        if self._previous is None:
            await self._check_no_foreign_tables()
        return self._previous

    async def _check_no_foreign_tables(self) -> None:
        """A first ingest overwrites its tables and deletes their older versions: refuse a database
        whose tables of our names were not written by drift-lance (their columns differ). Ours left
        by an interrupted first ingest are simply overwritten."""
        for name in sorted(set(schema.ALL_TABLES) & await list_table_names(self._db)):
            columns = (await (await self._db.open_table(name)).schema()).names
            ours = [column for column, _ in schema.COLUMNS[name]]
            if [c for c in columns if c != schema.VECTOR] != ours:
                raise StoreError(
                    f"{self.uri}: table {name!r} exists and was not written by drift-lance (columns "
                    f"{', '.join(columns[:6])}{', ...' if len(columns) > 6 else ''}); ingest into an empty folder or prefix"
                )

    async def write(
        self,
        tables: list[PreparedTable],
        *,
        source_path: str,
        layout: str,
        options: dict[str, Any],
    ) -> Manifest:
        """Write all tables, build indexes, append the manifest; roll back on any failure."""
        try:
            infos: dict[str, TableInfo] = {}
            for table in tables:
                infos[table.name] = await self._write_table(table)
                self._pause_hook(table.name)
            manifest = Manifest(
                generation=(self._previous.generation + 1) if self._previous else 1,
                source_path=source_path,
                layout=layout,
                tables=infos,
                vectors={
                    t.name: VectorColumnInfo(
                        table=t.name, dimension=int(t.vectors.matrix.shape[1]), model=t.vectors.model, source=t.vectors.source
                    )
                    for t in tables
                    if t.vectors is not None
                },
                ingested_at=datetime.now(UTC).isoformat(timespec="microseconds"),  # tells two ingests apart (a database re-made within a second)
                drift_lance_version=drift_lance.__version__,
                options=options,
            )
            await self._check_no_newer_generation()
            await self._append_manifest(manifest)
        except BaseException as exc:
            await self._rollback()
            if isinstance(exc, Exception) and _is_commit_conflict(exc):
                table = self._touched[-1] if self._touched else "?"
                raise IngestError(
                    f"{self.uri}: another ingest wrote table {table!r} at the same time (LanceDB commit conflict); "
                    "nothing was committed, run it again"
                ) from exc
            raise
        if self.config.cleanup_old_versions:
            start = time.perf_counter()
            try:
                await self._cleanup(manifest)
            except (asyncio.CancelledError, KeyboardInterrupt):
                # Committed already: Ctrl-C here stops the cleanup, not the ingest. What is left of
                # older versions is deleted by the next ingest's cleanup.
                self.warnings.append(f"{self.uri}: generation {manifest.generation} is committed; the cleanup of "
                                     "older versions was interrupted (the next ingest finishes it)")
                log.warning("%s", self.warnings[-1])
            self.timings.cleanup_s = time.perf_counter() - start
        return manifest

    def _pause_hook(self, name: str) -> None:
        pause = os.environ.get(PAUSE_ENV)
        if pause:
            print(f"drift-lance ingest: wrote table {name}", file=sys.stderr, flush=True)
            time.sleep(float(pause))

    async def _write_table(self, table: PreparedTable) -> TableInfo:
        arrow = to_arrow(table)
        start = time.perf_counter()
        self._touched.append(table.name)
        handle = await self._db.create_table(table.name, data=_batches(arrow, self.config.write_batch_rows), mode="overwrite")
        self.timings.write_s += time.perf_counter() - start
        start = time.perf_counter()
        scalar = await self._scalar_indexes(handle, table.name)
        vector_index, params = await self._vector_index(handle, table, arrow.num_rows)
        elapsed = time.perf_counter() - start
        self.timings.index_s += elapsed
        self.timings.index_s_by_table[table.name] = elapsed
        info = TableInfo(
            name=table.name,
            version=await handle.version(),
            rows=arrow.num_rows,
            vector_index=vector_index,
            vector_index_params=params,
            scalar_indexes=scalar,
        )
        if vector_index and table.vectors is not None and self.config.target_recall is not None:
            start = time.perf_counter()
            info.calibration = await calibrate_probes(
                handle, info, table.vectors.matrix, table.frame["id"],
                target=self.config.target_recall, queries=self.config.calibration_queries,
            )
            self.timings.calibrate_s += time.perf_counter() - start
        return info

    async def _scalar_indexes(self, handle: Any, name: str) -> list[str]:
        if not self.config.scalar_indexes:
            return []
        from lancedb.index import BTree

        built = []
        for column in schema.SCALAR_INDEXES.get(name, ()):
            await handle.create_index(column, config=BTree(), replace=True)
            built.append(column)
        return built

    async def _vector_index(self, handle: Any, table: PreparedTable, rows: int) -> tuple[str | None, dict[str, Any]]:
        if table.vectors is None or rows < self.config.ann_min_rows:
            return None, {}
        dim = int(table.vectors.matrix.shape[1])
        config = self.config.vector_index
        if config.type == "IVF_RQ" and dim % 8:
            # LanceDB's RaBitQ codes need a multiple of 8 dimensions; IVF_FLAT takes any.
            log.warning("table %r: %d-d vectors cannot be IVF_RQ-indexed (needs a multiple of 8); building IVF_FLAT",
                        table.name, dim)
            config = config.model_copy(update={"type": "IVF_FLAT"})
        if config.type == "IVF_PQ" and config.num_sub_vectors and dim % config.num_sub_vectors:
            raise IngestError(f"table {table.name!r}: vector_index.num_sub_vectors={config.num_sub_vectors} does not divide "
                              f"its {dim}-d vectors (IVF_PQ needs a divisor; leave it unset for {pq_sub_vectors(dim)})")
        if config.type == "IVF_PQ" and rows < PQ_MIN_ROWS:
            # PQ trains 256 centroids per sub-vector: LanceDB then leaves every row unindexed.
            log.warning("table %r: %d rows are too few to train IVF_PQ (needs %d); building IVF_FLAT", table.name, rows, PQ_MIN_ROWS)
            config = config.model_copy(update={"type": "IVF_FLAT"})
        await handle.create_index(schema.VECTOR, config=_vector_index(config, rows, dim), replace=True)
        return config.type, index_params(config, rows, dim)

    async def _check_no_newer_generation(self) -> None:
        """Another ingest into the same database may have committed while this one wrote (two
        writers would otherwise both commit the same generation number, and replicas that already
        switched to the first would never see the second). The later one gives way: rolled back,
        nothing committed. Object stores have no lock to take, so this is checked at commit."""
        latest = await read_manifests(self._db, self.uri)
        expected = self._previous.generation if self._previous else None
        found = latest[-1].generation if latest else None
        if found != expected:
            raise IngestError(
                f"{self.uri}: another ingest committed generation {found} while this one ran (it started from "
                f"{'generation ' + str(expected) if expected else 'an empty database'}); nothing was committed, run it again"
            )

    async def _append_manifest(self, manifest: Manifest) -> None:
        row = pa.table(
            {
                "generation": pa.array([manifest.generation], pa.int64()),
                "ingested_at": pa.array([manifest.ingested_at], pa.string()),
                "manifest": pa.array([manifest.model_dump_json()], pa.string()),
            }
        )
        if schema.MANIFEST_TABLE in await list_table_names(self._db):
            await (await self._db.open_table(schema.MANIFEST_TABLE)).add(row)
        else:
            await self._db.create_table(schema.MANIFEST_TABLE, data=row)

    async def _rollback(self) -> None:
        """Put each touched table back to the version the newest committed generation that has it
        pins; drop only a table no committed generation pins. The manifests are read again: another
        ingest may have committed meanwhile (object stores have no lock), and an older kept
        generation may still need a table the previous one lacks."""
        try:
            committed = await read_manifests(self._db, self.uri)
        except Exception as exc:  # noqa: BLE001 - fall back to what was committed when this ingest began
            log.warning("%s: could not re-read the manifests for the rollback: %s", self.uri, exc)
            committed = self._manifests
        for name in self._touched:
            pins = [m.tables[name].version for m in committed if name in m.tables]  # oldest first
            try:
                if pins:
                    handle = await self._db.open_table(name)
                    await handle.restore(pins[-1])
                else:
                    await self._db.drop_table(name, ignore_missing=True)
            except Exception as exc:  # noqa: BLE001 - best effort: the manifest still pins the old versions
                log.warning("%s: could not roll back table %r: %s", self.uri, name, exc)

    async def _cleanup(self, manifest: Manifest) -> None:
        """Delete table versions older than the ones the kept generations pin: the previous one, and
        every one replaced less than `keep_replaced_seconds` ago, so searches and replicas still on
        them keep working. The manifests of the generations that go are deleted first: an
        interrupted cleanup then leaves unlisted data behind (the next cleanup deletes it), never a
        listed generation with part of its data gone."""
        kept = kept_generations([*self._manifests, manifest], datetime.now(UTC), self.config.keep_replaced_seconds)
        if kept[0].generation < manifest.generation:
            try:
                manifests = await self._db.open_table(schema.MANIFEST_TABLE)
                await manifests.delete(f"generation < {kept[0].generation}")
            except Exception as exc:  # noqa: BLE001 - cleanup failing must not fail a finished ingest
                log.warning("%s: could not drop the manifests of replaced generations (their data stays): %s", self.uri, exc)
                return
        for name, info in manifest.tables.items():
            keep_from = min((m.tables[name].version for m in kept if name in m.tables), default=info.version)
            try:
                handle = await self._db.open_table(name)
                old = [v["version"] for v in await handle.list_versions() if v["version"] < keep_from]
                if not old:
                    continue
                dataset = await handle.to_lance()  # carries the connection's storage options
                await asyncio.to_thread(
                    dataset.cleanup_old_versions,
                    older_than=timedelta(0),
                    versions=old,
                    error_if_tagged_old_versions=False,
                )
            except Exception as exc:  # noqa: BLE001 - as above
                log.warning("%s: could not clean up old versions of table %r: %s", self.uri, name, exc)
        await self._drop_unpinned_tables(kept)

    async def _drop_unpinned_tables(self, kept: list[Manifest]) -> None:
        """Drop tables only generations that are no longer kept had (covariates, when a later index
        has no claims). A table written since its last pinned version is left alone: an ingest
        running now on object storage (no lock) may be writing it."""
        kept_names = {name for m in kept for name in m.tables}
        for name in sorted({name for m in self._manifests for name in m.tables} - kept_names):
            last_pinned = max(m.tables[name].version for m in self._manifests if name in m.tables)
            try:
                if await (await self._db.open_table(name)).version() <= last_pinned:
                    await self._db.drop_table(name)
            except Exception as exc:  # noqa: BLE001 - as above
                log.warning("%s: could not drop table %r, which no kept generation uses: %s", self.uri, name, exc)


def kept_generations(manifests: list[Manifest], now: datetime, keep_replaced_seconds: float) -> list[Manifest]:
    """The generations whose data an ingest's cleanup keeps, oldest first: the newest two, and every
    older one whose successor was ingested less than `keep_replaced_seconds` before `now`."""
    oldest = max(len(manifests) - 2, 0)
    while oldest > 0 and _age_seconds(manifests[oldest].ingested_at, now) < keep_replaced_seconds:
        oldest -= 1  # manifests[oldest] replaced manifests[oldest - 1] recently: keep that one too
    return manifests[oldest:]


def _age_seconds(ingested_at: str, now: datetime) -> float:
    try:
        when = datetime.fromisoformat(ingested_at)
    except ValueError:
        return math.inf  # unreadable: not evidence of a recent replacement
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return (now - when).total_seconds()


def _is_commit_conflict(exc: Exception) -> bool:
    """Lance's error when a concurrent writer committed a version of the same table first."""
    text = str(exc)
    return type(exc).__name__ == "CommitConflictError" or "commit conflict" in text.lower() or "concurrent transaction" in text


def _batches(arrow: pa.Table, rows: int) -> pa.RecordBatchReader:
    """Stream the table to LanceDB in bounded record batches."""
    return pa.RecordBatchReader.from_batches(arrow.schema, arrow.to_batches(max_chunksize=rows))
