"""Ingest and store settings: ANN index choice and parameters, embedding batches, read-side tuning.

Defaults come from measurements on a 2-core machine (see README, section "Ingest"): below
`ann_min_rows` rows a table gets no ANN index and the store answers with an exact in-memory scan;
above it an IVF_RQ index (RaBitQ, 1 bit per dimension) with sqrt(rows) / 2 partitions, re-ranked with full
vectors (refine_factor 5) and probed at the fewest partitions that reached recall@10 0.97 when ingest
measured it on the built index (`target_recall`; 30% of the partitions for indexes ingested without
calibration). Fixed 30% probing gave recall 0.996 at 10^6 x 1536 but only 0.955 at 10^6 x 384: how
many partitions a recall needs depends on the data, so it is measured. At 10^6 x 384 entities 30% gave
recall@10 0.953 at 8.4 ms p50 with a 65 MB index and flat memory, where IVF_FLAT (the previous
default) reached only 0.906 at 10% of its partitions, took 17-31 ms, and its cached partitions (full
vectors) grew the process to 1.6 GB. IVF_HNSW_SQ and IVF_PQ took minutes to build at 10^5 rows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from drift_lance.store import TableInfo

VectorIndexType = Literal["IVF_RQ", "IVF_HNSW_SQ", "IVF_PQ", "IVF_FLAT"]
ProbeSource = Literal["nprobes", "calibrated", "nprobes_fraction", "min_nprobes"]


class VectorIndexConfig(BaseModel):
    """How the ANN index of a vector column is built."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: VectorIndexType = "IVF_RQ"
    # IVF partitions; None = round(sqrt(rows) / 2) for IVF_RQ, round(sqrt(rows)) for IVF_FLAT / IVF_PQ, max(1, rows // 100_000)
    # for IVF_HNSW_SQ (an HNSW graph per partition: fewer, larger partitions recall better).
    num_partitions: int | None = None
    # IVF_PQ only: sub-vectors per vector, a divisor of the dimension; None = dim / 16 (LanceDB's default),
    # or the largest divisor below it.
    num_sub_vectors: int | None = None
    # IVF_RQ only: bits per dimension of the RaBitQ codes. Set here, not left to LanceDB: lancedb
    # 0.41 moved its default from 1 to 5, which made the 10^6 x 1536 index 985 MB instead of ~200 MB,
    # past the store's 512 MiB index cache, and a query 20-35 ms instead of ~9 (re-ranking with full
    # vectors recovers what the 1-bit codes lose; see the README's Ingest section).
    num_bits: int = Field(default=1, ge=1, le=8)
    # IVF_HNSW_SQ only: graph degree and construction beam.
    m: int = 20
    ef_construction: int = 300
    # Vectors are unit-normalised, so cosine and dot rank alike; cosine keeps `_distance` in [0, 2].
    distance_type: Literal["cosine"] = "cosine"


class SearchTuning(BaseModel):
    """Read-side ANN parameters (the store uses these for tables that have an ANN index)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    def probing_for(self, info: TableInfo) -> tuple[int, ProbeSource]:
        """Partitions to probe for the ANN index of the table `info` describes, and which setting
        decided it."""
        calibrated = info.calibration.nprobes if info.calibration else None
        return self.probing(info.vector_index_params.get("num_partitions"), calibrated)

    def probing(self, num_partitions: int | None, calibrated: int | None = None) -> tuple[int, ProbeSource]:
        """Partitions to probe for an index with `num_partitions` partitions, of which ingest found
        `calibrated` enough for its recall target, and which setting decided it. An explicit
        `nprobes` or `nprobes_fraction` wins; no more partitions than the index has are probed."""
        if self.nprobes is not None:
            return min(self.nprobes, num_partitions or self.nprobes), "nprobes"
        if calibrated is not None and "nprobes_fraction" not in self.model_fields_set:
            return calibrated, "calibrated"
        if not num_partitions:
            return self.min_nprobes, "min_nprobes"
        fraction = min(num_partitions, max(self.min_nprobes, math.ceil(self.nprobes_fraction * num_partitions)))
        return fraction, "nprobes_fraction"

    nprobes: int | None = Field(
        default=None, ge=1, description="IVF partitions probed per query; None = nprobes_fraction of the partitions"
    )
    nprobes_fraction: float = Field(default=0.3, gt=0, le=1, description="share of partitions probed when nprobes is None (and, when set, instead of ingest's calibration)")
    min_nprobes: int = Field(default=20, ge=1, description="lower bound of the automatic nprobes")
    refine_factor: int | None = Field(
        default=None, ge=1, description="re-rank k*refine_factor candidates with full vectors; None = 5 for IVF_RQ, 10 for IVF_PQ"
    )
    ef: int | None = Field(default=None, ge=1, description="HNSW search beam; None = LanceDB default")

    def refine(self, index_type: str | None) -> int | None:
        """Re-ranking factor for an index of `index_type` (quantized indexes re-rank by default)."""
        if self.refine_factor is not None:
            return self.refine_factor
        return {"IVF_RQ": 5, "IVF_PQ": 10}.get(index_type or "")


class StoreConfig(BaseModel):
    """How `open_store` reads an ingested index."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    search: SearchTuning = Field(default_factory=SearchTuning)
    # `fetch()` splits long key lists into IN (...) filters of this many values.
    fetch_chunk_size: int = Field(default=1000, ge=1)

    # Object storage (s3://, gs://, az://): LanceDB storage options, e.g. {"aws_endpoint": ...}. The
    # standard AWS variables are read by LanceDB itself; see drift_lance.object_store.
    storage_options: dict[str, str] = Field(default_factory=dict)
    # The service checks the manifest table for a newer generation this often (0 = only on
    # POST /v1/admin/reload).
    reload_interval_seconds: float = Field(default=30.0, ge=0)
    # In-memory caches, bounded in bytes. vector: exact-search matrices of tables without an ANN
    # index (a table whose matrix exceeds the bound is searched by LanceDB instead); table: rows of
    # small tables (each at most a quarter of the bound), so key lookups need no object-store request.
    vector_cache_bytes: int = Field(default=512 * 2**20, ge=0)
    # On object storage, search a table with an ANN index exactly in memory when its matrix fits half
    # the vector cache: one download instead of index and row reads on every query.
    exact_in_memory_on_object_storage: bool = True
    table_cache_bytes: int = Field(default=256 * 2**20, ge=0)
    # LanceDB's own caches (opened index data; file metadata), shared by every table of a store and
    # handed on to the next generation's store on reload. None = LanceDB's defaults (6 GiB, 1 GiB).
    # 512 MiB holds the IVF_RQ index of 10^6 x 1536 vectors (~250 MB) plus scalar-index pages, and
    # keeps a long-running service's memory bounded whatever the corpus size.
    index_cache_bytes: int | None = Field(default=512 * 2**20, ge=0)
    metadata_cache_bytes: int | None = Field(default=None, ge=0)

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        # repr(settings) ends up in logs and tracebacks: storage secrets are masked there (as in
        # `drift-lance config`); `storage_options` itself, what LanceDB gets, keeps them.
        for name, value in super().__repr_args__():
            if name == "storage_options":
                value = {key: "**********" if is_secret_name(key) else option for key, option in value.items()}
            yield name, value


# Names of settings and storage options whose values are credentials: api keys, and storage options
# such as aws_secret_access_key, aws_session_token, azure_storage_account_key or azure_storage_sas_key.
# A token only as a name's last word: max_tokens and token_budget are not secrets.
_SECRET_NAME = re.compile(r"key|secret|password|credential|(^|_)token$", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


class IngestConfig(BaseModel):
    """Settings of `ingest.run_ingest` / `drift-lance ingest`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # A table gets an ANN index once it has at least this many rows; below, exact search answers.
    # 20k, not 10k: at 10^4 x 1536 the exact numpy path (3.3 ms p50) beat the ANN index (8.0 ms).
    ann_min_rows: int = Field(default=20_000, ge=1)
    vector_index: VectorIndexConfig = Field(default_factory=VectorIndexConfig)
    # After building an ANN index, measure recall@10 against exact search for `calibration_queries`
    # sample queries (random rows perturbed to cosine ~0.8, as a question sits near the entity it asks
    # about) and record in the manifest the fewest probed partitions whose recall reaches this target
    # with 95% confidence (the sample mean minus 1.645 standard errors); the store probes that many.
    # 1000 queries, not 300: recall@10 varies by 0.09-0.15 from query to query, so 300-query samples
    # of one 10^6 x 1536 index measured 0.916-0.948 at one probe count, and the bound would cost
    # ~0.015 of margin instead of ~0.005. None = no calibration (probe `SearchTuning.nprobes_fraction`).
    target_recall: float | None = Field(default=0.97, gt=0, le=1)
    calibration_queries: int = Field(default=1000, ge=10)
    # Texts per embedder call when vectors have to be computed.
    embed_batch_size: int = Field(default=64, ge=1)
    # Rows per record batch when writing a table (bounds memory for large indexes).
    write_batch_rows: int = Field(default=50_000, ge=1)
    # Build BTREE indexes from `drift_lance.schema.SCALAR_INDEXES`.
    scalar_indexes: bool = True
    # Delete table versions older than the one the previous manifest pins, after a successful ingest.
    cleanup_old_versions: bool = True
    # ... except those of generations replaced less than this long ago: a search (or a replica that
    # has not reloaded yet) still on such a generation finishes, however many ingests follow it.
    keep_replaced_seconds: float = Field(default=600.0, ge=0)
