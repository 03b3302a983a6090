"""LanceStore: manifest pinning, exact and ANN vector search, exact fetch, scan, errors."""

from __future__ import annotations

import time
from pathlib import Path

import lancedb
import numpy as np
import polars as pl
import pytest

import ingest
from drift_lance import _exact
from drift_lance._exact import ExactMatrix
from drift_lance._exact import top_k_stable as _top_k_stable
from drift_lance._lance_store import open_store, sql_literal
from drift_lance.config.ingest import IngestConfig, StoreConfig
from drift_lance.errors import StoreError
from drift_lance.testing import HashEmbedder
from ingest.synthetic import generate_index


async def test_open_store_without_database_names_uri(tmp_path):
    with pytest.raises(StoreError, match=str(tmp_path / "nothing")):
        await open_store(str(tmp_path / "nothing"))


async def test_the_suggested_ingest_command_can_be_pasted_into_a_shell(tmp_path):
    missing = tmp_path / "my index"
    with pytest.raises(StoreError) as info:
        await open_store(str(missing))
    assert f"run `drift-lance ingest SRC --db '{missing}'` first" in str(info.value)


async def test_open_store_without_complete_ingest(tmp_path):
    db = await lancedb.connect_async(str(tmp_path / "db"))
    await db.create_table("entities", data=[{"id": "a"}])  # tables but no manifest: a killed first ingest
    with pytest.raises(StoreError, match="no complete ingest"):
        await open_store(str(tmp_path / "db"))


@pytest.mark.parametrize("table", ["entities.parquet", "entities.csv"])  # graphrag 3.x may write CSV tables
async def test_a_graphrag_output_folder_given_as_the_database_is_named_as_ingests_source(table, tmp_path, dulce_dir):
    output = tmp_path / "graphrag" / "output"
    output.mkdir(parents=True)
    (output / table).write_bytes((dulce_dir / "entities.parquet").read_bytes())  # only the name is looked at
    with pytest.raises(StoreError) as info:
        await open_store(str(output))
    database = (tmp_path / "graphrag" / "output.lancedb").resolve()
    assert f"run `drift-lance ingest {output} --db {database}`, then use --db {database}" in str(info.value)
    assert list(output.iterdir()) == [output / table]  # nothing written into the source


@pytest.fixture(params=["float32 scan", "int8 screening"])
def exact_path(request, monkeypatch):
    """Runs a test on both exact-search paths: dulce's tables are far under the screening size."""
    if request.param == "int8 screening":
        monkeypatch.setattr(_exact, "SCREEN_MIN_VALUES", 0)
    return request.param


async def test_exact_search_matches_brute_force(dulce_store, exact_path):
    everything = await dulce_store.scan("entities", columns=["id", "vector"])
    matrix = np.stack(everything["vector"].to_numpy())
    rng = np.random.default_rng(0)
    for _ in range(5):
        query = rng.standard_normal(3072).astype(np.float32)
        expected = matrix @ (query / np.linalg.norm(query))
        found = await dulce_store.search("entities", query, 7, columns=["id"])
        assert found.columns == ["id", "_similarity"]
        best = np.argsort(-expected, kind="stable")[:7]
        assert found["id"].to_list() == everything["id"].gather(best).to_list()
        np.testing.assert_allclose(found["_similarity"].to_numpy(), expected[best], atol=1e-5)


async def test_a_filtered_exact_search_ranks_only_the_matching_rows(dulce_store, exact_path):
    everything = await dulce_store.scan("community_reports", columns=["id", "level", "vector"])
    matrix = np.stack(everything["vector"].to_numpy())
    matching = everything["level"].to_numpy() == 0
    query = np.random.default_rng(4).standard_normal(3072).astype(np.float32)
    scores = np.where(matching, matrix @ (query / np.linalg.norm(query)), -np.inf)
    best = np.argsort(-scores, kind="stable")[: int(matching.sum())]
    for k in (3, 50):  # fewer than match, and more than match
        found = await dulce_store.search("community_reports", query, k, columns=["id", "level"], where="level <= 0")
        assert found["id"].to_list() == everything["id"].gather(best[:k]).to_list()
        assert set(found["level"]) == {0}
    assert (await dulce_store.search("community_reports", query, 5, where="level > 99")).height == 0
    with pytest.raises(StoreError, match="filter 'level <=' on table 'community_reports'"):
        await dulce_store.search("community_reports", query, 5, where="level <=")


async def test_search_returns_all_columns_best_first(dulce_store):
    report = (await dulce_store.scan("community_reports", limit=1)).row(0, named=True)
    found = await dulce_store.search("community_reports", np.asarray(report["vector"]), 50)
    assert found.height == 10  # k larger than the table: every row once
    assert found["id"][0] == report["id"]
    assert found["_similarity"][0] == pytest.approx(1.0, abs=1e-5)
    assert found["_similarity"].is_sorted(descending=True)
    assert {"full_content", "rank", "vector"} <= set(found.columns)


@pytest.mark.parametrize("generation", ["1", True, 1.0])
async def test_a_generation_that_is_not_an_int_is_refused_naming_the_argument(dulce_db_uri, generation):
    # generation="1" said "no manifest generation 1 (have [1])"; True opened generation 1.
    from drift_lance.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        await open_store(dulce_db_uri, generation=generation)
    assert str(caught.value) == f"generation: expected a whole number, got {type(generation).__name__} {generation!r}"
    newest = await open_store(dulce_db_uri)
    await newest.close()
    store = await open_store(dulce_db_uri, generation=newest.manifest.generation)
    assert store.manifest.generation == newest.manifest.generation
    await store.close()


@pytest.mark.parametrize("options", ["aws_region=eu-west-1", [("aws_region", "eu-west-1")]])
async def test_storage_options_that_are_not_a_dict_are_refused_naming_the_argument(dulce_db_uri, options):
    # Was "AttributeError: 'str' object has no attribute 'items'" from deep in the option merging.
    from drift_lance.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        await open_store(dulce_db_uri, storage_options=options)
    assert str(caught.value) == f"storage_options: expected a dict of option names to values, got {type(options).__name__}"


@pytest.mark.parametrize(
    ("vector", "k", "kwargs", "message"),
    [
        (None, -1, {}, "k: expected a whole number >= 0, got -1"),  # was an empty frame, as if nothing matched
        (None, 2.5, {}, "k: expected a whole number >= 0, got 2.5"),  # was a TypeError from the sort
        (None, "5", {}, "k: expected a whole number >= 0, got '5'"),
        ("abc", 5, {}, "vector: must hold real numbers, got dtype <U3"),  # was numpy's bare ValueError
        ("complex", 5, {}, "vector: must hold real numbers, got dtype complex64"),  # was searched without its imaginary part
        ("two rows", 5, {}, "vector: must be one vector, got an array of shape (2, 1536) (search_many takes several)"),
        (None, 5, {"columns": "title"}, "columns: expected a list of column names, got the string 'title'"),
    ],
)
async def test_search_arguments_of_the_wrong_kind_are_refused_naming_them(dulce_db_uri, vector, k, kwargs, message):
    # "two rows" was flattened and searched as one 3072-d vector; columns="title" asked for columns t, i, t, l, e.
    from drift_lance.errors import ConfigError

    good = HashEmbedder(3072).embed_sync(["Dulce"])[0]
    store = await open_store(dulce_db_uri)
    try:
        query = {"complex": good.astype(np.complex64), "two rows": good.reshape(2, -1), None: good}.get(vector, vector)
        with pytest.raises(ConfigError) as caught:
            await store.search("entities", query, k, **kwargs)
        assert str(caught.value) == message
        assert len(await store.search("entities", good.astype(np.float64).tolist(), 3, columns=["title"])) == 3
    finally:
        await store.close()


@pytest.mark.parametrize("table_cache_bytes", [256 * 2**20, 0], ids=["table cache", "lancedb rows"])
async def test_search_for_no_columns_gives_the_scores_alone(dulce_db_uri, ann_db, table_cache_bytes):
    """columns=[] asks for the similarities only; it used to fail building the frame (exact search
    and ANN alike)."""
    query = np.random.default_rng(3).standard_normal(3072).astype(np.float32)
    store = await open_store(dulce_db_uri, config=StoreConfig(table_cache_bytes=table_cache_bytes))
    try:
        expected = (await store.search("entities", query, 5, columns=["id"]))["_similarity"].to_list()
        found = await store.search("entities", query, 5, columns=[])
        assert found.columns == ["_similarity"] and found["_similarity"].to_list() == expected
    finally:
        await store.close()
    ann = await open_store(ann_db[0])
    try:
        query = np.ones(64, np.float32)
        expected = (await ann.search("entities", query, 5, columns=["id"]))["_similarity"].to_list()
        assert (await ann.search("entities", query, 5, columns=[]))["_similarity"].to_list() == expected
    finally:
        await ann.close()


async def test_search_many_matches_one_search_per_query(dulce_store, exact_path):
    """DRIFT maps a whole epoch of follow-ups with one batched search: each result must be what
    a single search for that vector returns (same rows, order and similarities)."""
    queries = np.random.default_rng(3).standard_normal((6, 3072)).astype(np.float32)
    batched = await dulce_store.search_many("entities", queries, 8, columns=["id", "title"])
    assert len(batched) == 6
    for query, found in zip(queries, batched):
        single = await dulce_store.search("entities", query, 8, columns=["id", "title"])
        assert found.columns == ["id", "title", "_similarity"]
        assert found["id"].to_list() == single["id"].to_list()
        np.testing.assert_allclose(found["_similarity"].to_numpy(), single["_similarity"].to_numpy(), atol=1e-5)
    assert await dulce_store.search_many("entities", queries[:0], 8) == []
    assert [f.height for f in await dulce_store.search_many("entities", queries[:2], 0, columns=["id"])] == [0, 0]
    with pytest.raises(StoreError, match="2-d"):
        await dulce_store.search_many("entities", queries[0], 8)
    with pytest.raises(StoreError, match=r"dimension 384.*'entities'.*dimension 3072"):
        await dulce_store.search_many("entities", np.ones((2, 384), dtype=np.float32), 3)


def _blas_threads() -> list[int]:
    """The BLAS libraries' thread settings, which user code in the process shares."""
    from threadpoolctl import threadpool_info

    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


async def test_batched_search_leaves_the_blas_thread_setting_as_it_was(dulce_store):
    """A batch of queries is scored on one BLAS thread; the process's BLAS thread count (which
    user code shares) is the same afterwards, and so are the scores."""
    queries = np.random.default_rng(5).standard_normal((4, 3072)).astype(np.float32)
    before = _blas_threads()
    batched = await dulce_store.search_many("entities", queries, 5, columns=["id"])
    assert _blas_threads() == before
    singles = [await dulce_store.search("entities", query, 5, columns=["id"]) for query in queries]
    assert [f["id"].to_list() for f in batched] == [f["id"].to_list() for f in singles]


@pytest.mark.parametrize("screen", [True, False])
def test_single_queries_leave_no_blas_thread_spinning(screen):
    """OpenBLAS's helper thread, when a product is shared with it, spins ~0.1 s afterwards waiting
    for more work: a service answering a query every few dozen ms kept a second core busy. Single
    queries are scored without it, screened or not (a matrix over the screening size without its
    codes), so the process is idle once a query has returned; the scores are a plain product's."""
    rng = np.random.default_rng(12)
    rows = rng.standard_normal((6000, 1024)).astype(np.float32)  # OpenBLAS shares a product this size
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    matrix = ExactMatrix.build(rows, np.arange(len(rows), dtype=np.uint64), screen=screen)
    assert (matrix.codes is not None) is screen
    queries = rng.standard_normal((20, 1024)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    before = _blas_threads()
    found = [matrix.top_k(query[None, :], 5)[0][0].tolist() for query in queries]
    assert _blas_threads() == before
    cpu = time.process_time()
    time.sleep(0.2)
    assert time.process_time() - cpu < 0.05  # a spinning helper burns ~0.1 s of it
    assert found == [_top_k_stable(rows @ query, 5).tolist() for query in queries]


def test_large_batches_are_scored_in_two_halves_with_the_same_result():
    """A batch above the split size is scored half on a worker thread: the scores are those of one
    product, in place, and an odd row count loses no column."""
    from drift_lance._blas import SPLIT_MIN_MULTIPLY_ADDS, similarity_scores

    rng = np.random.default_rng(11)
    dim, rows = 256, SPLIT_MIN_MULTIPLY_ADDS // (256 * 8) + 1  # 8 queries: just over the split size
    columns = np.ascontiguousarray(rng.standard_normal((dim, rows)).astype(np.float32))
    queries = rng.standard_normal((8, dim)).astype(np.float32)
    scores = similarity_scores(queries, columns)
    assert scores.shape == (8, rows) and rows % 2 == 1
    np.testing.assert_allclose(scores, queries @ columns, rtol=1e-5, atol=1e-3)


async def test_exact_search_reads_the_same_rows_without_the_table_cache(dulce_db_uri):
    """With the table cache off, rows come from LanceDB's take (unordered) and are put back in score
    order; a batch whose queries share entities gets each row once per query."""
    queries = np.random.default_rng(4).standard_normal((3, 3072)).astype(np.float32)
    queries[2] = queries[0]  # the same query twice in one batch: the same rows, twice
    results = []
    for config in (StoreConfig(), StoreConfig(table_cache_bytes=0)):
        store = await open_store(dulce_db_uri, config=config)
        try:
            results.append(await store.search_many("entities", queries, 6, columns=["id", "title"]))
        finally:
            await store.close()
    cached, uncached = results
    for a, b in zip(cached, uncached):
        assert a["id"].to_list() == b["id"].to_list() and a["title"].to_list() == b["title"].to_list()
        np.testing.assert_allclose(a["_similarity"].to_numpy(), b["_similarity"].to_numpy())
    assert uncached[2]["id"].to_list() == uncached[0]["id"].to_list()


async def test_search_dimension_mismatch_names_both(dulce_store):
    with pytest.raises(StoreError, match=r"dimension 384.*dimension 3072"):
        await dulce_store.search("entities", np.ones(384, dtype=np.float32), 3)
    with pytest.raises(StoreError, match="no vector column"):
        await dulce_store.search("relationships", np.ones(3072), 3)


async def test_query_vector_must_be_finite_and_scale_does_not_matter(dulce_store):
    query = np.random.default_rng(5).standard_normal(3072).astype(np.float32)
    for bad in (np.nan, np.inf, -np.inf):
        broken = query.copy()
        broken[17] = bad
        with pytest.raises(StoreError, match="'entities' contains NaN or inf"):
            await dulce_store.search("entities", broken, 3)
    expected = await dulce_store.search("entities", query, 5, columns=["id"])
    # 1e20 * query is finite, but its squared norm overflows float32: still a valid direction.
    for scale in (1e-3, 1e20):
        found = await dulce_store.search("entities", query * np.float32(scale), 5, columns=["id"])
        assert found["id"].to_list() == expected["id"].to_list()
        np.testing.assert_allclose(found["_similarity"].to_numpy(), expected["_similarity"].to_numpy(), atol=1e-5)


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
@pytest.mark.parametrize("table", ["entities", "relationships", "community_reports", "text_units", "covariates"])
async def test_open_tables_refuses_a_missing_or_truncated_data_file_naming_table_and_file(dulce_db_uri, tmp_path, table, damage):
    """A database folder whose data file of one table was deleted or cut short (a partial copy or
    sync) opened fine: the manifest and table metadata read, and a DRIFT query answered from the
    primer alone (every follow-up's local context failed), exit 0. `open_tables` now stats each
    data file of the pinned versions against the size the version recorded."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(dulce_db_uri, copy)
    (data_file,) = (copy / f"{table}.lance" / "data").iterdir()  # each dulce table is one data file
    if damage == "deleted":
        data_file.unlink()
        problem = "is missing"
    else:
        size = data_file.stat().st_size
        with open(data_file, "r+b") as handle:
            handle.truncate(size // 2)
        problem = rf"is {size // 2:,} bytes, not the {size:,} that version wrote \(truncated\?\)"
    store = await open_store(str(copy))
    try:
        with pytest.raises(StoreError, match=rf"^{copy}: table '{table}' at version \d+ cannot be read: file {data_file} {problem}; the database folder is incomplete"):
            await store.open_tables()
    finally:
        await store.close()


async def test_manifest_reader_lists_the_data_files_pylance_lists(dulce_store):
    """`open_tables` confirms a healthy local database from each version's manifest, read without
    pylance (whose import and runtime cost +35 MB resident): the files and recorded sizes it reads
    must be the ones pylance reports, for every table (a Lance upgrade changing the manifest shows
    here; the reader only ever confirms, so a damaged file is still worded by pylance)."""
    from drift_lance._lance_manifest import listed_data_files

    for table, info in dulce_store.manifest.tables.items():
        handle = await dulce_store._table(table)
        dataset = await handle.to_lance()
        expected = [(Path(dataset.uri) / "data" / f.path, f.file_size_bytes)
                    for fragment in dataset.get_fragments() for f in fragment.metadata.files]
        assert listed_data_files(Path(await handle.uri()), info.version) == expected, table
        assert await dulce_store._files_confirmed(table, handle, info.version), table


def test_open_tables_of_a_healthy_database_leaves_pylance_unimported(dulce_db_uri):
    import os
    import subprocess
    import sys

    code = ("import asyncio, sys\nfrom drift_lance._lance_store import open_store\n"
            "async def main():\n    store = await open_store(sys.argv[1])\n    await store.open_tables()\n    await store.close()\n"
            "asyncio.run(main())\nprint('lance' in sys.modules)")
    import drift_lance

    env = {**os.environ, "PYTHONPATH": str(Path(drift_lance.__file__).parents[1])}  # this checkout's drift_lance
    proc = subprocess.run([sys.executable, "-c", code, str(dulce_db_uri)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


async def test_unknown_table_is_a_store_error(dulce_store):
    assert not dulce_store.has_table("claims")
    with pytest.raises(StoreError, match="'claims'"):
        await dulce_store.scan("claims")
    # A search named a misspelt table "a table without vectors", with no list of what there is.
    unknown = r"table 'entity' is not in manifest generation 1 \(tables: communities, community_reports, covariates, documents, entities,"
    for search in (dulce_store.search, dulce_store.search_many):
        with pytest.raises(StoreError, match=unknown):
            await search("entity", np.ones((1, 3072), np.float32), 3)
    with pytest.raises(StoreError, match=r"table 'documents' has no vector column \(tables with vectors: community_reports, entities, text_units\)$"):
        await dulce_store.search("documents", np.ones(3072, np.float32), 3)


async def test_unknown_columns_are_a_store_error_naming_table_and_column(dulce_store, ann_db):
    """Every read names the table and the missing column, whichever path answers it (the row
    cache, LanceDB's exact or ANN search, a lookup of no keys)."""
    vector = np.ones(3072, np.float32)
    reads = [
        dulce_store.search("entities", vector, 3, columns=["title", "nope"]),
        dulce_store.search_many("entities", np.stack([vector, vector]), 3, columns=["nope"]),
        dulce_store.fetch("entities", "title", ["ALEX MERCER"], columns=["nope"]),
        dulce_store.fetch("entities", "title", [], columns=["nope"]),
        dulce_store.fetch("entities", "nope", ["x"], columns=["title"]),
        dulce_store.scan("entities", columns=["nope"]),
    ]
    for read in reads:
        with pytest.raises(StoreError, match=r"table 'entities' has no column 'nope' \(columns: .*title"):
            await read
    ann = await open_store(ann_db[0])
    try:
        with pytest.raises(StoreError, match=r"table 'entities' has no column 'nope'"):
            await ann.search("entities", np.ones(64, np.float32), 3, columns=["nope"])
    finally:
        await ann.close()


def _rows_scoring(query: np.ndarray, scores: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Unit rows whose cosine with the unit `query` is exactly `scores` (up to float32 rounding)."""
    noise = rng.standard_normal((len(scores), query.shape[0]))
    noise -= np.outer(noise @ query, query)  # orthogonal to the query
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    rows = scores[:, None] * query[None, :] + np.sqrt(1 - scores**2)[:, None] * noise
    return rows.astype(np.float32)


def test_int8_screening_returns_the_exact_top_k_among_near_ties():
    """Rows whose similarities differ by 1e-5, far under the int8 codes' error (~1e-2): the codes
    alone would rank them in the wrong order, the screened search must still return the float32
    order, with equal rows in table order, under a filter, and for k over the matching rows."""
    rng = np.random.default_rng(21)
    dim = 512
    query = rng.standard_normal(dim)
    query /= np.linalg.norm(query)
    near = _rows_scoring(query, 0.9 - 1e-5 * np.arange(400), rng)  # row i: the i-th best
    far = _rows_scoring(query, rng.uniform(-0.5, 0.8, 20_000), rng)
    rows = np.concatenate([near, near[:5], far])  # rows 400-404 repeat the 5 best
    order = rng.permutation(len(rows))
    rows, rank = rows[order], np.argsort(order)  # rank[i]: where row i went
    row_ids = np.arange(len(rows), dtype=np.uint64)
    screened = ExactMatrix.build(rows, row_ids)
    assert screened.codes is not None and screened.columns is None
    queries = np.stack([query, rows[rank[700]], rng.standard_normal(dim)]).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    excluded = np.zeros(len(rows), dtype=bool)
    excluded[rank[[1, 3, 401]]] = True
    for mask in (None, excluded):
        for k in (1, 10, 100):
            for q in queries:
                expected = rows @ q
                if mask is not None:
                    expected[mask] = -np.inf
                tops, similarities = screened.top_k(q[None, :], k, mask)
                assert tops[0].tolist() == _top_k_stable(expected, k).tolist()
                np.testing.assert_allclose(similarities[0], expected[tops[0]], atol=1e-6)
    # the 5 best repeated: each pair of equal rows in table order
    tops, _ = screened.top_k(queries[:1], 10)
    pairs = [sorted([rank[i], rank[400 + i]]) for i in range(5)]
    assert tops[0].tolist() == [p for pair in pairs for p in pair]
    few = np.ones(len(rows), dtype=bool)
    few[rank[[5, 0, 9]]] = False
    assert screened.top_k(queries[:1], 10, few)[0][0].tolist() == rank[[0, 5, 9]].tolist()
    assert screened.top_k(queries[:1], 10, np.ones(len(rows), dtype=bool))[0].shape == (1, 0)


def test_equal_rows_tie_in_table_order_alone_and_in_a_batch():
    """Five equal rows near the query: BLAS's gemv rounded the fifth differently from the others
    when it sat in the kernel's tail, which put row 4 before row 3."""
    def unit(x):
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)

    dim, n = 1024, 8192
    assert n * dim >= _exact.SCREEN_MIN_VALUES
    rows = unit(np.random.default_rng(1).standard_normal((n, dim)))
    rng = np.random.default_rng(11)
    query = unit(rng.standard_normal(dim))
    rows[:5] = unit(query + 0.3 * unit(rng.standard_normal(dim)))
    matrix = ExactMatrix.build(rows, np.arange(n, dtype=np.uint64))
    assert matrix.codes is not None
    for k in (4, 5):
        alone, alone_scores = matrix.top_k(query[None, :], k)
        batch, batch_scores = matrix.top_k(np.stack([query, query]), k)
        assert alone[0].tolist() == batch[0].tolist() == batch[1].tolist() == list(range(k))
        assert len(set(alone_scores[0].tolist())) == 1 and alone_scores[0].tolist() == batch_scores[0].tolist()


def test_int8_screening_is_used_for_large_single_queries_only():
    """A matrix over the screening size is screened for a single query; a batch is scored with
    one float32 product over the same row-major matrix, with the same results."""
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((_exact.SCREEN_MIN_VALUES // 1024 + 1, 1024)).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    matrix = ExactMatrix.build(rows, np.arange(len(rows), dtype=np.uint64))
    assert matrix.codes is not None and matrix.nbytes == ExactMatrix.estimated_bytes(*rows.shape)
    few = _exact.SCREEN_MIN_VALUES // 1024 - 1
    small = ExactMatrix.build(rows[:few], np.arange(few, dtype=np.uint64))
    assert small.codes is None and small.nbytes == ExactMatrix.estimated_bytes(few, 1024)
    queries = rng.standard_normal((3, 1024)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    batch, batch_scores = matrix.top_k(queries, 10)
    for q, tops, scores in zip(queries, batch, batch_scores):
        single, single_scores = matrix.top_k(q[None, :], 10)
        assert single[0].tolist() == tops.tolist() == _top_k_stable(rows @ q, 10).tolist()
        np.testing.assert_allclose(single_scores[0], scores, atol=1e-6)


@pytest.mark.parametrize(("cache_bytes", "screened"), [(500_000, False), (700_000, True)])
async def test_screening_codes_are_kept_only_where_they_fit_the_vector_cache(dulce_db_uri, monkeypatch, cache_bytes, screened):
    """dulce's 39 x 3072 entity matrix is 480 KB, 600 KB with int8 codes: a cache that holds the
    matrix but not the codes still gets exact search from memory, without screening."""
    monkeypatch.setattr(_exact, "SCREEN_MIN_VALUES", 0)
    store = await open_store(dulce_db_uri, config=StoreConfig(vector_cache_bytes=cache_bytes))
    try:
        query = np.random.default_rng(8).standard_normal(3072).astype(np.float32)
        found = await store.search("entities", query, 5, columns=["id"])
        exact = await store._exact_index("entities")
        assert exact is not None and (exact.codes is not None) is screened
        assert exact.nbytes == ExactMatrix.estimated_bytes(39, 3072, screened=screened)
        everything = await store.scan("entities", columns=["id", "vector"])
        expected = np.stack(everything["vector"].to_numpy()) @ (query / np.linalg.norm(query))
        assert found["id"].to_list() == everything["id"].gather(_top_k_stable(expected, 5)).to_list()
    finally:
        await store.close()


def test_a_nan_vector_is_a_store_error_naming_the_table_and_row():
    """Ingest refuses non-finite vectors; a table written otherwise must not poison every top k
    (a NaN floor left the screened search with no rows at all)."""
    import pyarrow as pa

    from drift_lance._lance_store import _exact_index_from_arrow

    vectors = np.eye(4, dtype=np.float32)
    vectors[2, 1] = np.nan
    arrow = pa.table({"vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), 4),
                      "_rowid": pa.array([10, 11, 12, 13], type=pa.uint64())})
    with pytest.raises(StoreError, match=r"db: table 'entities' column 'vector' has NaN or infinite values \(first at row id 12\)"):
        _exact_index_from_arrow(arrow, "db", "entities")


def test_ties_keep_table_order():
    scores = np.array([0.5, 0.9, 0.9, 0.1, 0.9, 0.5], dtype=np.float32)
    assert _top_k_stable(scores, 2).tolist() == [1, 2]
    assert _top_k_stable(scores, 4).tolist() == [1, 2, 4, 0]
    assert _top_k_stable(scores, 10).tolist() == [1, 2, 4, 0, 5, 3]


async def test_exact_search_ties_are_stable_end_to_end(dulce_dir, tmp_path, exact_path):
    """Identical texts get identical vectors; equal similarities come back in table order."""
    uri = str(tmp_path / "db")
    await ingest.run_ingest(dulce_dir, uri, embedder=_ConstantEmbedder(), reembed=True, progress=False)
    store = await open_store(uri)
    table_order = (await store.scan("entities", columns=["id"]))["id"].to_list()
    first = await store.search("entities", np.ones(8), 39, columns=["id"])
    second = await store.search("entities", np.ones(8), 5, columns=["id"])
    assert first["id"].to_list() == table_order
    assert second["id"].to_list() == table_order[:5]


class _ConstantEmbedder:
    model_id, dimension = "constant", 8

    async def embed(self, texts, *, kind="document"):
        return np.ones((len(texts), 8), dtype=np.float32) / np.sqrt(8)


async def test_fetch_exact_lookups(dulce_store, dulce_dir):
    entities = pl.read_parquet(dulce_dir / "entities.parquet")
    wanted = entities["title"].head(25).to_list()
    store = await open_store(dulce_store.uri, config=StoreConfig(fetch_chunk_size=4))  # 7 IN-chunks
    found = await store.fetch("entities", "title", [*wanted, "NOT THERE", "O'NEIL'S; DROP TABLE"], columns=["title", "degree"])
    assert sorted(found["title"]) == sorted(wanted)
    assert found.columns == ["title", "degree"]
    by_number = await store.fetch("entities", "human_readable_id", [0, 1, 2, 2])
    assert sorted(by_number["human_readable_id"]) == [0, 1, 2]
    empty = await store.fetch("entities", "id", [], columns=["id", "title"])
    assert empty.height == 0 and empty.columns == ["id", "title"]
    with pytest.raises(StoreError, match="no column 'nope'"):
        await store.fetch("entities", "nope", ["x"])
    await store.close()


async def test_fetch_from_the_table_cache_equals_lancedb(dulce_db_uri):
    """A lookup answered from the table cache (rows kept in memory) is the frame LanceDB's own
    query returns: same columns and types, same rows in table order, for string, integer and float
    keys (the last without a key index), lists and nulls included."""
    lookups = [
        ("relationships", "source", None, ["id", "source", "weight", "text_unit_ids", "description"]),
        ("entities", "human_readable_id", [5, 1, 30, 1, 999], ["title", "human_readable_id", "community_ids"]),
        ("community_reports", "rank", None, ["community", "rank", "title"]),
    ]
    frames = []
    for config in (StoreConfig(), StoreConfig(table_cache_bytes=0)):
        store = await open_store(dulce_db_uri, config=config)
        try:
            found = []
            for table, key, values, columns in lookups:
                if values is None:  # a few values that exist, in scrambled order
                    present = (await store.scan(table, columns=[key]))[key].unique(maintain_order=True).to_list()
                    values = present[3:0:-1] + present[-1:]
                found.append(await store.fetch(table, key, values, columns=columns))
            frames.append(found)
        finally:
            await store.close()
    for cached, uncached in zip(*frames):
        assert cached.height > 0 and cached.schema == uncached.schema
        assert cached.equals(uncached)


def test_sql_literal_quotes_safely():
    assert sql_literal("O'Neil") == "'O''Neil'"
    assert sql_literal(3) == "3"
    assert sql_literal(np.int64(4)) == "4"
    with pytest.raises(StoreError):
        sql_literal(float("nan"))


async def test_scan_and_count(dulce_store):
    level0 = await dulce_store.scan("communities", where="level = 0", columns=["community", "level"])
    assert level0.height > 0 and set(level0["level"]) == {0}
    assert await dulce_store.count("relationships") == 107
    assert (await dulce_store.scan("relationships", limit=3)).height == 3
    with pytest.raises(StoreError, match="where="):
        await dulce_store.scan("communities", where="no_such_column = 1")


async def test_reader_stays_pinned_while_a_new_generation_lands(dulce_dir, carol_dir, tmp_path):
    uri = str(tmp_path / "db")
    await ingest.run_ingest(dulce_dir, uri, progress=False)
    old = await open_store(uri)
    old_vector = (await old.scan("entities", columns=["vector"], limit=1))["vector"][0].to_numpy()
    await ingest.run_ingest(carol_dir, uri, embedder=HashEmbedder(16), progress=False)
    # the old reader keeps its generation: same rows, same 3072-d search
    assert old.manifest.generation == 1
    assert (await old.scan("entities", columns=["id"])).height == 39
    assert (await old.search("entities", old_vector, 3, columns=["id"])).height == 3
    new = await open_store(uri)
    assert new.manifest.generation == 2
    assert (await new.scan("entities", columns=["id"])).height == 260
    assert new.manifest.vectors["entities"].dimension == 16


@pytest.fixture(scope="module", params=["IVF_RQ", "IVF_FLAT", "IVF_PQ", "IVF_HNSW_SQ"])
def ann_db(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A synthetic index with an ANN index of each supported type on entities (threshold 1500 rows)."""
    import asyncio

    root = tmp_path_factory.mktemp("ann")
    src = generate_index(root / "src", n_entities=3000, dim=64, seed=5)
    config = IngestConfig(ann_min_rows=1500, vector_index={"type": request.param})
    asyncio.run(ingest.run_ingest(src, str(root / "db"), config=config, progress=False))
    return str(root / "db"), src


def test_automatic_nprobes():
    tuning = StoreConfig().search
    assert tuning.probing(1000) == (300, "nprobes_fraction")  # 30% of the partitions ...
    assert tuning.probing(55) == (20, "nprobes_fraction")  # ... but at least 20
    assert tuning.probing(8) == (8, "nprobes_fraction")  # ... and never more than there are
    assert StoreConfig(search={"nprobes": 7}).search.probing(1000) == (7, "nprobes")
    assert tuning.refine("IVF_RQ") == 5 and tuning.refine("IVF_PQ") == 10 and tuning.refine("IVF_FLAT") is None
    assert StoreConfig(search={"refine_factor": 2}).search.refine("IVF_RQ") == 2


def test_an_nprobes_above_the_partition_count_probes_every_partition():
    """LanceDB is asked for the partitions the index has (and inspect reports that count)."""
    from drift_lance._lance_store import ann_query
    from drift_lance.store import TableInfo

    class Query:
        """Records the builder calls ann_query makes on a LanceDB vector query."""

        calls: dict[str, tuple] = {}

        def __getattr__(self, name):
            def call(*args):
                self.calls[name] = args
                return self

            return call

    class Table:
        def vector_search(self, vector):
            return Query()

    info = TableInfo(name="entities", rows=5000, version=1, vector_index="IVF_RQ", vector_index_params={"num_partitions": 35})
    tuning = StoreConfig(search={"nprobes": 999}).search
    assert tuning.probing_for(info) == (35, "nprobes")
    ann_query(Table(), np.ones(4, np.float32), 10, tuning, info)
    assert Query.calls["nprobes"] == (35,)


async def test_ann_search_recall_against_exact(ann_db):
    uri, _ = ann_db
    store = await open_store(uri)
    assert store.manifest.tables["entities"].vector_index in {"IVF_RQ", "IVF_FLAT", "IVF_PQ", "IVF_HNSW_SQ"}
    assert store.manifest.tables["entities"].vector_index_params["num_partitions"] >= 1
    everything = await store.scan("entities", columns=["id", "vector"])
    matrix = np.stack(everything["vector"].to_numpy())
    rng = np.random.default_rng(1)
    hits = 0
    for row in rng.choice(len(matrix), size=20, replace=False):
        query = matrix[row] + 0.1 * rng.standard_normal(64).astype(np.float32)
        truth = set(everything["id"].gather(np.argsort(-(matrix @ query))[:10]))
        found = await store.search("entities", query, 10, columns=["id", "title"])
        assert found.columns == ["id", "title", "_similarity"]
        assert found["_similarity"].is_sorted(descending=True)
        hits += len(truth & set(found["id"]))
    assert hits / 200 >= 0.9
    # the batched form answers ANN tables too, one query at a time
    queries = matrix[:3] + 0.1 * rng.standard_normal((3, 64)).astype(np.float32)
    batched = await store.search_many("entities", queries, 10, columns=["id"])
    for query, found in zip(queries, batched):
        assert found["id"].to_list() == (await store.search("entities", query, 10, columns=["id"]))["id"].to_list()
    # a filter picks the top k among the matching rows (prefiltered), not k rows then filtered
    odd = await store.search("entities", queries[0], 10, columns=["human_readable_id"], where="human_readable_id % 2 = 1")
    assert odd.height == 10 and all(i % 2 == 1 for i in odd["human_readable_id"])
    await store.close()


async def test_a_k_beyond_the_table_returns_every_row_without_exhausting_memory(ann_db, dulce_store):
    # LanceDB allocates result buffers by k: before the clamp, k = 2**31 aborted the process.
    uri, _ = ann_db
    store = await open_store(uri)
    query = np.ones(64, np.float32)
    found = await store.search("entities", query, 2**31, columns=["id"])
    assert 0 < found.height <= 3000 and found["id"].n_unique() == found.height
    await store.close()
    everything = await dulce_store.search("entities", np.ones(3072, np.float32), 10**30, columns=["id"])
    assert everything.height == dulce_store.manifest.tables["entities"].rows


async def test_ann_table_fetch_is_exact(ann_db):
    """Id lookups never go through the ANN index: every requested row comes back."""
    uri, src = ann_db
    ids = pl.read_parquet(src / "entities.parquet")["id"].gather(list(range(0, 3000, 7))).to_list()
    store = await open_store(uri)
    found = await store.fetch("entities", "id", ids, columns=["id"])
    assert sorted(found["id"]) == sorted(ids)
    await store.close()


def test_lancedb_rest_client_loads_on_first_use_only():
    # Start-up: the store imports lancedb without the REST namespace client's API modules (see
    # drift_lance/_lancedb.py); the client must still work for anyone who touches it.
    import subprocess
    import sys

    code = (
        "import sys, drift_lance._lance_store\n"
        "assert 'lance_namespace_urllib3_client.api' not in sys.modules\n"
        "import lance_namespace_urllib3_client as client\n"
        "assert client.ApiClient.__name__ == 'ApiClient' and 'lance_namespace_urllib3_client.api' in sys.modules\n"
        "import lancedb; assert lancedb.connect is not None\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("explicit", [None, "1"])
def test_lance_compute_pool_gets_every_core_unless_set(explicit):
    # Lance keeps two cores for IO by default (one compute thread on a 2-core machine, where a DRIFT
    # epoch's ANN queries then queue); the store gives it every usable core, and a user's own
    # LANCE_CPU_THREADS wins.
    import os
    import subprocess
    import sys

    from drift_lance._cores import usable_cores

    env = {k: v for k, v in os.environ.items() if k != "LANCE_CPU_THREADS"}
    if explicit is not None:
        env["LANCE_CPU_THREADS"] = explicit
    code = "import os, drift_lance._lance_store; print(os.environ['LANCE_CPU_THREADS'])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=env, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (explicit or str(usable_cores()))


def test_one_store_serves_several_event_loops(dulce_db_uri):
    """asyncio.run per call (or a loop per thread): the store's single-flight loads must not stay
    bound to the first loop that waited on them."""
    import asyncio

    store = asyncio.run(open_store(dulce_db_uri))
    query = np.random.default_rng(2).standard_normal(3072).astype(np.float32)

    async def cold_burst() -> list[list[str]]:
        store.vector_cache.clear()
        store.table_cache.clear()  # cold: the four searches wait on one another's loads
        found = await asyncio.gather(*(store.search("entities", query, 3, columns=["id"]) for _ in range(4)))
        return [f["id"].to_list() for f in found]

    bursts = [asyncio.run(cold_burst()) for _ in range(3)]
    assert all(burst == bursts[0] for burst in bursts) and len({tuple(ids) for ids in bursts[0]}) == 1
    asyncio.run(store.close())
    with pytest.raises(StoreError, match="this store is closed"):
        asyncio.run(store.search("entities", query, 3))


async def test_open_store_may_be_awaited_or_used_in_async_with(dulce_db_uri):
    """`async with open_store(uri) as store:` failed ("'coroutine' object does not support the
    asynchronous context manager protocol"): it now opens the store and closes it on leaving."""
    async with open_store(dulce_db_uri) as store:
        assert (await store.count("entities")) == store.manifest.tables["entities"].rows
    with pytest.raises(StoreError, match="this store is closed"):
        await store.count("entities")
    opening = open_store(dulce_db_uri)
    opened = await opening  # the awaited form is unchanged, and left open
    assert not opened._closed
    with pytest.raises(RuntimeError, match="cannot reuse already awaited coroutine"):  # as a coroutine says
        await opening
    await opened.close()


@pytest.mark.parametrize(("uri", "message"), [(None, "got NoneType"), ("", "empty"), ("  ", "empty"), (b"db", "got bytes")])
async def test_a_missing_or_blank_database_uri_is_a_config_error(uri, message, tmp_path, monkeypatch):
    """open_store(None) (an unset `os.environ.get("DB")`) looked for a folder named "None", and "" opened
    the working directory: both were reported as a database missing there, naming no argument."""
    from drift_lance.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"^database uri: .*{message}"):
        await open_store(uri)
