"""Read access to an ingested index: the contract the engine codes against.

`ingest` writes LanceDB tables (see `drift_lance.schema`) plus a manifest; the engine opens them
through an `IndexStore`. The store pins every table to the version named by the newest complete
manifest, so a half-finished ingest is never visible to queries.

Implementations: `drift_lance._lance_store.LanceStore` (any LanceDB URI: local path, s3://, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from drift_lance.errors import DriftLanceError, StoreError

__all__ = [
    "AnnCalibration", "IndexStore", "Manifest", "StoreError", "TableInfo", "VectorColumnInfo", "raise_if_generation_gone", "raise_if_store_failed",
    "same_manifest",
]

# The manifest is served as JSON with every field (GET /v1/index): its JSON schema says so, so a client
# generated from the OpenAPI document types no field as optional. Reading a manifest keeps the defaults.
_SERVED_IN_FULL = ConfigDict(json_schema_serialization_defaults_required=True)


class VectorColumnInfo(BaseModel):
    model_config = _SERVED_IN_FULL

    table: str
    dimension: int
    model: str = "unknown"  # embedding model id; "unknown" for reused vectors of unnamed origin
    source: str = ""  # where the vectors came from: "graphrag-lancedb", "parquet", "computed", ...


class AnnCalibration(BaseModel):
    """ANN query parameters measured by ingest on the built index: the fewest probed partitions whose
    recall@10 against exact search reached `target_recall` on sample queries, with 95% confidence
    (see `ingest.calibrate`)."""

    model_config = _SERVED_IN_FULL

    nprobes: int
    refine_factor: int | None
    recall_at_10: float  # the sample's mean at `nprobes`
    # One-sided lower confidence bound of that mean (95%; 99% when the first 300 queries settled it);
    # None in manifests written before 2026-12-06, whose calibrations compared the mean itself.
    recall_lower_bound: float | None = None
    target_recall: float
    queries: int  # sample queries measured at `nprobes`
    seconds: float


class TableInfo(BaseModel):
    model_config = _SERVED_IN_FULL

    name: str
    version: int  # LanceDB table version pinned by this manifest
    rows: int
    vector_index: str | None = None  # e.g. "IVF_RQ" when an ANN index exists, else None
    vector_index_params: dict[str, Any] = Field(default_factory=dict)  # build params, e.g. num_partitions
    scalar_indexes: list[str] = Field(default_factory=list)
    calibration: AnnCalibration | None = None  # None: no ANN index, calibration off, or an older ingest


class Manifest(BaseModel):
    """One completed ingest (a generation): its source, layout, the table versions it pins, and its
    vectors' dimension and model per table. `store.manifest` is the one a store is pinned to."""

    model_config = _SERVED_IN_FULL

    generation: int  # increases by one per completed ingest
    source_path: str
    layout: str  # e.g. "graphrag-3", "graphrag-1", "graphrag-0.4"
    tables: dict[str, TableInfo]
    vectors: dict[str, VectorColumnInfo]  # keyed by table name
    ingested_at: str  # ISO-8601 UTC
    drift_lance_version: str
    options: dict[str, Any] = Field(default_factory=dict)


class IndexStore(Protocol):
    """Read access to one ingested index, pinned to one manifest generation: what the engine needs
    from a store. `open_store(uri)` returns the LanceDB implementation; close it when done."""

    uri: str
    manifest: Manifest

    def has_table(self, table: str) -> bool: ...

    async def search(
        self,
        table: str,
        vector: np.ndarray,
        k: int,
        *,
        columns: Sequence[str] | None = None,
        where: str | None = None,
    ) -> pl.DataFrame:
        """Top-k rows by cosine similarity to `vector` (best first), with the requested columns plus
        `_similarity` (float, 1 = identical). Uses the ANN index when the table has one, otherwise an
        exact search. `where` (a LanceDB SQL filter, e.g. "level <= 2") restricts the candidates
        before ranking. Raises StoreError on a dimension mismatch, naming both dimensions."""
        ...

    async def search_many(
        self,
        table: str,
        vectors: np.ndarray,
        k: int,
        *,
        columns: Sequence[str] | None = None,
        where: str | None = None,
    ) -> list[pl.DataFrame]:
        """`search` for each row of the 2-d `vectors`, in order; batched where the store can (one
        matrix product for an exactly searched table)."""
        ...

    async def fetch(
        self,
        table: str,
        key: str,
        values: Sequence[Any],
        *,
        columns: Sequence[str] | None = None,
    ) -> pl.DataFrame:
        """All rows whose `key` column is in `values` (exact; uses the scalar index). Row order is
        unspecified; callers sort."""
        ...

    async def scan(
        self,
        table: str,
        *,
        where: str | None = None,
        columns: Sequence[str] | None = None,
        limit: int | None = None,
    ) -> pl.DataFrame:
        """Rows matching a LanceDB SQL filter (or all rows). For small tables and tests."""
        ...

    async def count(self, table: str) -> int: ...

    async def check_readable(self, table: str) -> None:
        """Read a little of every object (data, deletion and index files) of the table's pinned
        version; StoreError naming the table if one is missing or unreadable."""
        ...

    async def close(self) -> None: ...


def same_manifest(a: Any, b: Any) -> bool:
    """The same ingest: generation, time (microseconds; whole seconds before) and pinned table versions."""
    return (a.generation, a.ingested_at, {t: i.version for t, i in a.tables.items()}) == (
        b.generation, b.ingested_at, {t: i.version for t, i in b.tables.items()})


async def raise_if_generation_gone(store: IndexStore, exc: Exception) -> None:
    """StoreError saying so when `exc` came from reading a generation that is no longer listed: a
    later ingest's cleanup deleted it (a store kept open longer than `ingest.keep_replaced_seconds`
    across ingests), or the database was deleted and ingested anew. LanceDB's own error only names
    a missing file or version. Returns when the generation is still there (or cannot be checked)."""
    if isinstance(exc, DriftLanceError) and not isinstance(exc, StoreError):  # a model or setting: not the data
        return
    try:
        manifests = await store.manifests()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - the manifest table unreadable too: the search's own error stands
        return
    if any(same_manifest(m, store.manifest) for m in manifests):
        return
    newest = f" (the newest is generation {manifests[-1].generation})" if manifests else ""
    raise StoreError(
        f"{store.uri}: generation {store.manifest.generation}, which this store was opened on, was deleted by a later "
        f"ingest{newest}; open the index again (open_drift_search / open_store) to search the current one"
    ) from exc


async def raise_if_store_failed(store: IndexStore, exc: Exception) -> None:
    """For a search that failed with `exc`: the StoreError saying its generation was deleted by a
    later ingest, else the IndexUnreadableError naming the table whose file is missing or truncated
    (LanceDB's own "lance error: Not found: <file>, <a Rust source line>" names none), both raised
    from `exc`, as the CLI reports them. Returns when the store is not at fault. Checks only after a
    failure, so a search pays nothing for it."""
    await raise_if_generation_gone(store, exc)
    check = getattr(store, "raise_if_unreadable", None)  # LanceStore's; another IndexStore may not check
    if check is not None:
        await check(exc)
