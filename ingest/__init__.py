"""Ingest a GraphRAG output folder (any released layout) into LanceDB, once and atomically.

    import ingest
    report = await ingest.run_ingest("path/to/graphrag/output", "path/to/db")
    report = ingest.ingest("path/to/graphrag/output", "s3://bucket/db", storage_options={...})

All input is read, validated and normalised (and missing vectors computed) in memory before the
first write, so bad input writes nothing; the write itself switches generations atomically (see
`ingest.writer`).
"""

from __future__ import annotations

from ingest import _lance_log  # noqa: F401 - first: sets Lance's log level before Lance is imported

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from drift_lance import schema
from drift_lance.config import checked_config
from drift_lance.config.ingest import IngestConfig
from drift_lance.errors import ConfigError, IngestError
from drift_lance.models.base import Embedder, check_model_argument
from drift_lance.models.compat import native_dimension, normalise_model_id
from drift_lance.store import Manifest
from ingest.embeddings import TableVectors, align, compute, find_reusable
from ingest.layouts import SourceIndex, detect_layout
from ingest.lock import IngestLock, local_folder
from ingest.normalize import NormalizedIndex, embedding_texts, normalize
from ingest.writer import IndexWriter, PreparedTable

log = logging.getLogger(__name__)

__all__ = ["IngestConfig", "IngestReport", "ingest", "prepare", "run_ingest"]

# Table write order: vector tables and the big ones first, so the cheap ones finish the run.
_WRITE_ORDER = (
    schema.ENTITIES,
    schema.RELATIONSHIPS,
    schema.COMMUNITIES,
    schema.COMMUNITY_REPORTS,
    schema.TEXT_UNITS,
    schema.COVARIATES,
    schema.DOCUMENTS,
)


class IngestReport(BaseModel):
    """What an ingest did: the manifest it committed plus timings."""

    db_uri: str
    manifest: Manifest
    rows: dict[str, int]
    seconds: dict[str, float] = Field(default_factory=dict)  # read, embed, write, index, cleanup, total
    computed_vectors: int = 0  # texts embedded by this run
    warnings: list[str] = Field(default_factory=list)  # e.g. optional columns filled with defaults (also logged)

    @property
    def rows_per_second(self) -> float:
        total = self.seconds.get("total", 0.0)
        return sum(self.rows.values()) / total if total else 0.0


def _reused_vectors(norm: NormalizedIndex, table: str, embedding_model: str | None) -> TableVectors | None:
    """GraphRAG's own vectors for `table`, in row order, or None when the index has none."""
    frame = norm.tables[table]
    ids = frame["id"].to_list()
    raw = norm.raw[table].to_arrow()
    raw_columns = {name: raw.column(name) for name in raw.column_names}
    found = find_reusable(norm.root, table, raw_columns, ids, norm.files[table])
    if found is None:
        return None
    return TableVectors(align(found, ids, table), embedding_model or "unknown", found.source, found.origin)


async def _computed_vectors(norm: NormalizedIndex, table: str, embedder: Embedder, config: IngestConfig,
                            progress: bool) -> tuple[TableVectors, int]:
    texts = embedding_texts(table, norm.tables[table])
    matrix = await compute(texts, embedder, batch_size=config.embed_batch_size, desc=f"embed {table}", progress=progress)
    return TableVectors(matrix, embedder.model_id, "computed", embedder.model_id), len(texts)


@dataclass(slots=True)
class _Prepared:
    source: SourceIndex
    tables: list[PreparedTable]
    computed: int  # texts embedded
    warnings: list[str]


async def prepare(
    src: str | Path,
    *,
    config: IngestConfig,
    embedder: Embedder | None = None,
    reembed: bool = False,
    embedding_model: str | None = None,
    progress: bool = True,
) -> tuple[SourceIndex, list[PreparedTable], int]:
    """Read, validate and normalise `src` and attach vectors; nothing is written."""
    done = await _prepare(src, config=config, embedder=embedder, reembed=reembed, embedding_model=embedding_model, progress=progress)
    return done.source, done.tables, done.computed


async def _prepare(
    src: str | Path,
    *,
    config: IngestConfig,
    embedder: Embedder | None,
    reembed: bool,
    embedding_model: str | None,
    progress: bool,
) -> _Prepared:
    """`prepare`, plus the warnings about the input that the report carries."""
    source = detect_layout(src)
    norm = normalize(source)
    vectors: dict[str, TableVectors] = {}
    if not reembed:
        for name in schema.VECTOR_TABLES:
            if name in norm.tables and (found := _reused_vectors(norm, name, embedding_model)) is not None:
                vectors[name] = found
    _check_reused_dimensions(list(vectors.values()))
    if vectors and embedding_model:
        _check_recorded_model(next(iter(vectors.values())), embedding_model)
    missing = [name for name in _WRITE_ORDER if name in schema.VECTOR_TABLES and name in norm.tables and name not in vectors]
    computed = 0
    warnings = list(norm.warnings)
    if missing:
        if embedder is None:  # the configured default, built only when some vectors must be computed
            from drift_lance.models import get_embedder

            embedder = get_embedder()
        if embedding_model and not vectors and normalise_model_id(embedding_model) != normalise_model_id(embedder.model_id):
            warnings.append(f"{source.root}: --embedding-model {embedding_model!r} names the model of vectors the index "
                            f"has, and it has none: every vector is computed with {embedder.model_id!r} (choose the "
                            "model that computes them with DRIFT_LANCE_EMBEDDING_MODEL / models.embedding_model)")
            log.warning("%s", warnings[-1])
        reused = next(iter(vectors.values()), None)
        if reused is not None:  # checked before embedding anything (a remote model may take hours)
            _check_one_space(reused, embedder.model_id, embedder.dimension, missing[0], embedding_model)
        for name in missing:
            vectors[name], n = await _computed_vectors(norm, name, embedder, config, progress)
            computed += n
            if reused is not None:  # a model of unknown dimension is known now
                _check_one_space(reused, embedder.model_id, vectors[name].matrix.shape[1], name, embedding_model)
    prepared = [PreparedTable(name, norm.tables[name], vectors.get(name)) for name in _WRITE_ORDER if name in norm.tables]
    return _Prepared(source, prepared, computed, warnings)


def _check_one_space(reused: TableVectors, model_id: str, dimension: int, table: str, embedding_model: str | None) -> None:
    """Vectors computed for `table` must be comparable with the index's reused ones: one database,
    one embedding space (a query embeds once and searches every table with that vector)."""
    advice = ("embed the missing tables with the model that made the index's vectors (--embedder / "
              "models.embedding_model), or use --reembed to recompute every table with this one")
    if dimension and dimension != reused.matrix.shape[1]:
        raise IngestError(
            f"{reused.origin}: the index's own vectors are {reused.matrix.shape[1]}-d, but table {table!r} has none and "
            f"the configured embedder {model_id!r} makes {dimension}-d vectors; {advice}"
        )
    if embedding_model and normalise_model_id(embedding_model) != normalise_model_id(model_id):
        raise IngestError(
            f"{reused.origin}: the index's own vectors are from {embedding_model!r} (--embedding-model), but table "
            f"{table!r} has none and the configured embedder is {model_id!r}; {advice}"
        )


def _check_recorded_model(reused: TableVectors, embedding_model: str) -> None:
    """--embedding-model names the model that made the index's vectors: an OpenAI model whose full
    dimension is below theirs cannot have (text-embedding-3-* can be shortened, not lengthened)."""
    native = native_dimension(embedding_model)
    if native is not None and reused.matrix.shape[1] > native:
        raise IngestError(
            f"{reused.origin}: vectors have dimension {reused.matrix.shape[1]}, but --embedding-model "
            f"{embedding_model!r} makes at most {native}-d vectors; name the model that embedded this index"
        )


def _check_reused_dimensions(reused: list[TableVectors]) -> None:
    """A GraphRAG index embeds everything with one model, so its reused vectors share one dimension."""
    dims = {v.matrix.shape[1] for v in reused}
    if len(dims) > 1:
        # name the odd one out: the dimension held by the fewest tables
        odd = min(reused, key=lambda v: sum(w.matrix.shape[1] == v.matrix.shape[1] for w in reused))
        other = next(v for v in reused if v.matrix.shape[1] != odd.matrix.shape[1])
        raise IngestError(
            f"{odd.origin}: vectors have dimension {odd.matrix.shape[1]}, but {other.origin} has dimension "
            f"{other.matrix.shape[1]}; one GraphRAG index uses one embedding model (use --reembed to recompute)"
        )


async def run_ingest(
    src: str | Path,
    db_uri: str | os.PathLike[str],
    *,
    config: IngestConfig | Mapping[str, Any] | None = None,
    embedder: Embedder | None = None,
    reembed: bool = False,
    embedding_model: str | None = None,
    storage_options: dict[str, str] | None = None,
    progress: bool = True,
) -> IngestReport:
    """Ingest the GraphRAG output folder `src` into the LanceDB database `db_uri` (any LanceDB URI).

    Vectors are reused from the index when present (model id: `embedding_model` or "unknown"),
    otherwise computed with `embedder` (default: `drift_lance.models.get_embedder()`); `reembed`
    recomputes all of them. Raises IngestError (bad input, a local database in or around `src`, or
    another ingest is writing to this local database; nothing written) or StoreError."""
    config = _checked_config(checked_config(config, IngestConfig, "config") or IngestConfig())
    check_model_argument(embedder, "embedder", "embed", "embedding_model")
    db_uri = str(db_uri)
    if not db_uri.strip():  # LanceDB would take it for the current directory
        raise ConfigError("db_uri: empty; name the LanceDB database (a folder, s3://bucket/path, ...)")
    started = time.perf_counter()
    _check_apart(src, db_uri)  # before the lock: taking it writes a lock file into an existing folder
    lock = IngestLock(db_uri)
    lock.take(create=False)  # before the slow preparation, so a second ingest stops at once
    if lock.folder is None:
        # Object storage: a missing bucket, refused credentials or a silent endpoint are reported
        # before any vector is computed (remote embedding calls cost money), not after.
        await IndexWriter(db_uri, config, storage_options, progress).open()
    try:
        done = await _prepare(
            src, config=config, embedder=embedder, reembed=reembed, embedding_model=embedding_model, progress=progress
        )
        prepared_s = time.perf_counter() - started
        lock.take(create=True)  # a new database: its folder is created only now that the input is valid
        writer = IndexWriter(db_uri, config, storage_options, progress)
        await writer.open()
        options = {
            "reembed": reembed,
            "ann_min_rows": config.ann_min_rows,
            "vector_index": config.vector_index.model_dump(),
            "target_recall": config.target_recall,
        }
        manifest = await writer.write(done.tables, source_path=str(done.source.root.resolve()), layout=done.source.layout,
                                      options=options)
    except BaseException:
        lock.release(failed=True)
        raise
    lock.release()
    t = writer.timings
    return IngestReport(
        db_uri=db_uri,
        manifest=manifest,
        rows={name: info.rows for name, info in manifest.tables.items()},
        seconds={
            "prepare": prepared_s,
            "write": t.write_s,
            "index": t.index_s,
            "calibrate": t.calibrate_s,
            "cleanup": t.cleanup_s,
            "total": time.perf_counter() - started,
            **{f"index.{k}": v for k, v in t.index_s_by_table.items()},
        },
        computed_vectors=done.computed,
        warnings=done.warnings + writer.warnings,
    )


def _check_apart(src: str | Path, db_uri: str) -> None:
    """A local database must be a folder of its own, apart from the GraphRAG output folder it is made
    from: LanceDB tables written among graphrag's files (or into its own `lancedb/` vector store, which
    ingest reads vectors from) mix two programs' data in one folder, and a database folder holding
    the source puts the source at the mercy of whatever replaces or deletes the database."""
    folder = local_folder(db_uri)
    if folder is None:  # object storage: no local folder to collide with
        return
    root = detect_layout(src).root.resolve()  # the folder the tables are read from (maybe SRC/output)
    db = folder.expanduser().resolve()
    if db == root:
        relation = "is"
    elif db.is_relative_to(root):
        relation = "is inside"
    elif root.is_relative_to(db):
        relation = "holds"
    else:
        return
    raise IngestError(f"database {db_uri} {relation} the GraphRAG output folder {root} being ingested (SRC {src}); "
                      "the database must be a folder apart from it: choose another one (nothing was written)")


def _checked_config(config: IngestConfig) -> IngestConfig:
    """`config` validated again: one made with model_copy(update=...) was never checked."""
    try:
        return IngestConfig.model_validate(config.model_dump())
    except ValidationError as exc:
        from drift_lance.config.settings import describe_validation_error

        raise ConfigError(describe_validation_error(exc, prefix="ingest")) from None


def ingest(src: str | Path, db_uri: str | os.PathLike[str], **kwargs: Any) -> IngestReport:
    """Synchronous `run_ingest` (for scripts and the CLI; not for use inside a running event loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_ingest(src, db_uri, **kwargs))
    raise IngestError("ingest.ingest() called inside a running event loop; use `await ingest.run_ingest(...)`")
