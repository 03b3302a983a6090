"""Ingest a GraphRAG output folder (any released layout) into LanceDB, once and atomically.

    import ingest
    report = await ingest.run_ingest("path/to/graphrag/output", "path/to/db")
    report = ingest.ingest("path/to/graphrag/output", "s3://bucket/db", storage_options={...})

All input is read, validated and normalised (and missing vectors computed) in memory before the
first write, so bad input writes nothing; the write itself switches generations atomically (see
`ingest.writer`).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from drift_lance import schema
from drift_lance.config.ingest import IngestConfig
from drift_lance.errors import IngestError
from drift_lance.models.base import Embedder
from drift_lance.store import Manifest
from ingest.embeddings import TableVectors, align, compute, find_reusable
from ingest.layouts import SourceIndex, detect_layout
from ingest.normalize import NormalizedIndex, embedding_texts, normalize
from ingest.writer import IndexWriter, PreparedTable

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

    @property
    def rows_per_second(self) -> float:
        total = self.seconds.get("total", 0.0)
        return sum(self.rows.values()) / total if total else 0.0


async def _vectors_for(
    norm: NormalizedIndex,
    table: str,
    *,
    embedder_factory: Any,
    reembed: bool,
    embedding_model: str | None,
    config: IngestConfig,
    progress: bool,
) -> tuple[TableVectors, int]:
    frame = norm.tables[table]
    ids = frame["id"].to_list()
    if not reembed:
        raw = norm.raw[table].to_arrow()
        raw_columns = {name: raw.column(name) for name in raw.column_names}
        found = find_reusable(norm.root, table, raw_columns, ids, norm.files[table])
        if found is not None:
            matrix = align(found, ids, table)
            return TableVectors(matrix, embedding_model or "unknown", found.source, found.origin), 0
    embedder: Embedder = embedder_factory()
    texts = embedding_texts(table, frame)
    matrix = await compute(texts, embedder, batch_size=config.embed_batch_size, desc=f"embed {table}", progress=progress)
    return TableVectors(matrix, embedder.model_id, "computed", embedder.model_id), len(texts)


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
    source = detect_layout(src)
    norm = normalize(source)
    cached: list[Embedder] = []

    def embedder_factory() -> Embedder:
        if embedder is not None:
            return embedder
        if not cached:  # the configured default, built only when some vectors must be computed
            from drift_lance.models import get_embedder

            cached.append(get_embedder())
        return cached[0]

    prepared, computed = [], 0
    for name in _WRITE_ORDER:
        if name not in norm.tables:
            continue
        vectors = None
        if name in schema.VECTOR_TABLES:
            vectors, n = await _vectors_for(
                norm,
                name,
                embedder_factory=embedder_factory,
                reembed=reembed,
                embedding_model=embedding_model,
                config=config,
                progress=progress,
            )
            computed += n
        prepared.append(PreparedTable(name, norm.tables[name], vectors))
    _check_reused_dimensions(prepared)
    return source, prepared, computed


def _check_reused_dimensions(tables: list[PreparedTable]) -> None:
    """A GraphRAG index embeds everything with one model, so its reused vectors share one dimension."""
    reused = [t.vectors for t in tables if t.vectors is not None and t.vectors.source != "computed"]
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
    db_uri: str,
    *,
    config: IngestConfig | None = None,
    embedder: Embedder | None = None,
    reembed: bool = False,
    embedding_model: str | None = None,
    storage_options: dict[str, str] | None = None,
    progress: bool = True,
) -> IngestReport:
    """Ingest the GraphRAG output folder `src` into the LanceDB database `db_uri` (any LanceDB URI).

    Vectors are reused from the index when present (model id: `embedding_model` or "unknown"),
    otherwise computed with `embedder` (default: `drift_lance.models.get_embedder()`); `reembed`
    recomputes all of them. Raises IngestError (bad input; nothing written) or StoreError."""
    config = config or IngestConfig()
    db_uri = str(db_uri)
    started = time.perf_counter()
    source, tables, computed = await prepare(
        src, config=config, embedder=embedder, reembed=reembed, embedding_model=embedding_model, progress=progress
    )
    prepared_s = time.perf_counter() - started
    writer = IndexWriter(db_uri, config, storage_options, progress)
    await writer.open()
    options = {
        "reembed": reembed,
        "ann_min_rows": config.ann_min_rows,
        "vector_index": config.vector_index.model_dump(),
        "target_recall": config.target_recall,
    }
    manifest = await writer.write(tables, source_path=str(source.root.resolve()), layout=source.layout, options=options)
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
        computed_vectors=computed,
    )


def ingest(src: str | Path, db_uri: str, **kwargs: Any) -> IngestReport:
    """Synchronous `run_ingest` (for scripts and the CLI; not for use inside a running event loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_ingest(src, db_uri, **kwargs))
    raise IngestError("ingest.ingest() called inside a running event loop; use `await ingest.run_ingest(...)`")
