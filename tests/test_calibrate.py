"""ANN probe calibration at ingest: the fewest probes reaching the recall target, recorded in the
manifest and used by the store unless the user sets the probing explicitly."""

from __future__ import annotations

import logging
import math

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

import ingest
from drift_lance import schema
from drift_lance._lance_store import ann_query, open_store
from drift_lance._lancedb import lancedb
from drift_lance.cli import main as cli_main
from drift_lance.config.ingest import IngestConfig, SearchTuning, StoreConfig
from drift_lance.store import TableInfo
from ingest.calibrate import RecallEstimate, calibrate_probes, sample_queries

ROWS, DIM, PARTITIONS = 4000, 16, 64


@pytest.fixture(scope="module")
def random_table(tmp_path_factory):
    """Unclustered unit vectors with an IVF_FLAT index: recall grows gradually with the probes."""
    rng = np.random.default_rng(7)
    matrix = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)
    ids = pl.Series("id", [f"e{i}" for i in range(ROWS)])
    data = pa.table({"id": ids.to_arrow(), schema.VECTOR: pa.FixedSizeListArray.from_arrays(pa.array(matrix.ravel()), DIM)})
    uri = str(tmp_path_factory.mktemp("calibrate") / "db")

    async def build() -> int:
        from lancedb.index import IvfFlat

        db = await lancedb.connect_async(uri)
        table = await db.create_table("t", data=data)
        await table.create_index(schema.VECTOR, config=IvfFlat(num_partitions=PARTITIONS, distance_type="cosine"))
        return await table.version()

    import asyncio

    version = asyncio.run(build())
    info = TableInfo(name="t", version=version, rows=ROWS, vector_index="IVF_FLAT", vector_index_params={"num_partitions": PARTITIONS})
    return uri, info, matrix, ids


async def lower_bound_at(
    uri: str, info: TableInfo, matrix: np.ndarray, queries: np.ndarray, nprobes: int, z: float = 1.645
) -> float:
    """The one-sided lower confidence bound (95% by default) of LanceDB's own recall@10 at `nprobes`,
    against numpy's exact top 10: mean - z standard errors over the queries."""
    table = await (await lancedb.connect_async(uri)).open_table(info.name)
    exact = np.argsort(-(queries @ matrix.T), axis=1)[:, :10]
    per_query = []
    for query, truth in zip(queries, exact):
        q = table.vector_search(query).column(schema.VECTOR).distance_type("cosine").nprobes(nprobes).limit(10)
        found = (await q.select(["id", "_distance"]).to_arrow()).column("id").to_pylist()
        per_query.append(len(set(found) & {f"e{i}" for i in truth}) / 10)
    return float(np.mean(per_query) - z * np.std(per_query, ddof=1) / math.sqrt(len(per_query)))


def test_a_noisy_sample_whose_mean_reaches_the_target_does_not():
    """90 queries at recall 1.0 and 10 at 0.5 average 0.95, but that sample cannot tell 0.95 from
    0.93: the calibration asks for the target with 95% confidence, not for a lucky mean."""
    noisy = RecallEstimate.of(np.array([1.0] * 90 + [0.5] * 10))
    assert noisy.mean == pytest.approx(0.95) and noisy.lower_bound < 0.94 and not noisy.reaches(0.95)
    assert noisy.reaches(0.9)
    perfect = RecallEstimate.of(np.ones(50))
    assert perfect.lower_bound == 1.0 and perfect.reaches(1.0)


async def test_calibration_picks_the_fewest_probes_that_reach_the_target(random_table):
    uri, info, matrix, ids = random_table
    table = await (await lancedb.connect_async(uri)).open_table("t")
    tuning = SearchTuning(min_nprobes=1)
    # 0.95 falls between two rungs of the ladder (16 and 20 of 64 partitions) on this index
    found = await calibrate_probes(table, info, matrix, ids, target=0.95, queries=100, tuning=tuning)
    assert found is not None and found.queries == 100 and found.target_recall == 0.95
    assert found.recall_at_10 > found.recall_lower_bound >= 0.95
    # Checked independently, on the same queries: the chosen count reaches the target with 95%
    # confidence, one probe fewer does not (at this size the bisection is exact), and a lower
    # target needs fewer probes.
    queries = sample_queries(matrix, 100, np.random.default_rng(0))
    assert await lower_bound_at(uri, info, matrix, queries, found.nprobes) == pytest.approx(found.recall_lower_bound, abs=1e-4)
    assert await lower_bound_at(uri, info, matrix, queries, found.nprobes - 1) < 0.95
    lower = await calibrate_probes(table, info, matrix, ids, target=0.5, queries=100, tuning=tuning)
    assert lower is not None and lower.nprobes < found.nprobes


async def test_a_table_of_fewer_than_10_rows_is_fully_recalled(tmp_path):
    """recall@10 of a 6-row table is the share of its 6 rows found, not of 10."""
    rng = np.random.default_rng(3)
    matrix = rng.standard_normal((6, DIM)).astype(np.float32)
    matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)
    ids = pl.Series("id", [f"e{i}" for i in range(6)])
    data = pa.table({"id": ids.to_arrow(), schema.VECTOR: pa.FixedSizeListArray.from_arrays(pa.array(matrix.ravel()), DIM)})
    from lancedb.index import IvfFlat

    table = await (await lancedb.connect_async(str(tmp_path / "db"))).create_table("t", data=data)
    await table.create_index(schema.VECTOR, config=IvfFlat(num_partitions=2, distance_type="cosine"))
    info = TableInfo(name="t", version=await table.version(), rows=6, vector_index="IVF_FLAT", vector_index_params={"num_partitions": 2})
    found = await calibrate_probes(table, info, matrix, ids, target=0.97, queries=20, tuning=SearchTuning(min_nprobes=1))
    assert found is not None and found.recall_at_10 == 1.0 and found.nprobes <= 2


async def test_probes_never_go_below_the_min_nprobes_floor(random_table):
    uri, info, matrix, ids = random_table
    table = await (await lancedb.connect_async(uri)).open_table("t")
    found = await calibrate_probes(table, info, matrix, ids, target=0.05, queries=20, tuning=SearchTuning(min_nprobes=20))
    assert found is not None and found.nprobes == 20


async def test_probe_counts_far_from_the_target_are_settled_by_the_first_300_queries(random_table):
    uri, info, matrix, ids = random_table
    table = await (await lancedb.connect_async(uri)).open_table("t")
    # The min_nprobes floor (20 of 64) recalls far more than 0.3: 300 of the 1000 queries settle it.
    easy = await calibrate_probes(table, info, matrix, ids, target=0.3, queries=1000, tuning=SearchTuning(min_nprobes=20))
    assert easy is not None and easy.nprobes == 20 and easy.queries == 300 and easy.recall_lower_bound >= 0.3
    # Near the target a count is settled by the first 300 queries only if their 99% bound clears it,
    # else by all 1000 at 95%; either way the recorded bound is the one computed independently, and
    # one probe fewer does not reach the target over all 1000.
    close = await calibrate_probes(table, info, matrix, ids, target=0.95, queries=1000, tuning=SearchTuning(min_nprobes=1))
    assert close is not None and close.queries in (300, 1000)
    queries = sample_queries(matrix, 1000, np.random.default_rng(0))
    z = 2.326 if close.queries == 300 else 1.645
    bound = await lower_bound_at(uri, info, matrix, queries[: close.queries], close.nprobes, z=z)
    assert bound == pytest.approx(close.recall_lower_bound, abs=1e-4) and bound >= 0.95
    assert await lower_bound_at(uri, info, matrix, queries, close.nprobes - 1) < 0.95


async def test_unreachable_target_probes_everything_and_warns(random_table, caplog):
    uri, info, matrix, ids = random_table
    table = await (await lancedb.connect_async(uri)).open_table("t")
    # IVF_FLAT probing every partition is exact; told the index has 4 of its 64 partitions, the
    # ladder tops out at 4 probes, far from recall 1.0 on unclustered vectors.
    few = info.model_copy(update={"vector_index_params": {"num_partitions": 4}})
    with caplog.at_level(logging.WARNING, logger="ingest.calibrate"):
        found = await calibrate_probes(table, few, matrix, ids, target=1.0, queries=50, tuning=SearchTuning(min_nprobes=1))
    assert found is not None and found.nprobes == 4 and found.recall_lower_bound < found.recall_at_10 < 0.9
    assert "below the target" in caplog.text and "'t'" in caplog.text


async def test_ingest_records_calibration_and_the_store_probes_that_many(tmp_path):
    from ingest.synthetic import generate_index

    src = generate_index(tmp_path / "src", n_entities=3000, dim=32, seed=5)
    report = await ingest.run_ingest(src, str(tmp_path / "db"), config=IngestConfig(ann_min_rows=2000), progress=False)
    info = report.manifest.tables["entities"]
    partitions = info.vector_index_params["num_partitions"]
    assert info.calibration is not None and info.calibration.target_recall == 0.97
    assert SearchTuning().min_nprobes <= info.calibration.nprobes <= partitions
    assert report.manifest.options["target_recall"] == 0.97 and report.seconds["calibrate"] > 0
    assert report.manifest.tables["community_reports"].calibration is None  # no ANN index

    async def probes_in_plan(config: StoreConfig) -> int:
        store = await open_store(str(tmp_path / "db"), config=config)
        try:
            handle = await store._table("entities")
            plan = await ann_query(handle, np.ones(32, np.float32), 10, store.config.search, store.manifest.tables["entities"]).explain_plan(True)
        finally:
            await store.close()
        return int(plan.split("minimum_nprobes=")[1].split(",")[0])

    assert await probes_in_plan(StoreConfig()) == info.calibration.nprobes
    # An explicit setting wins over the calibration.
    assert await probes_in_plan(StoreConfig(search=SearchTuning(nprobes_fraction=0.9))) == math.ceil(0.9 * partitions)
    assert await probes_in_plan(StoreConfig(search=SearchTuning(nprobes=7))) == 7


def test_cli_target_recall_off_and_bad_values_and_inspect_shows_the_probing(tmp_path, capsys, monkeypatch):
    from ingest.synthetic import generate_index

    src = generate_index(tmp_path / "src", n_entities=4800, dim=16, seed=2)
    db = str(tmp_path / "db")
    assert cli_main(["ingest", str(src), "--db", db, "--ann-min-rows", "1000", "--target-recall", "0.5", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "entities: IVF_RQ probes 20 of 35 partitions (calibrated at ingest: recall@10 " in out
    # 20 of 35 partitions reach far above 0.5: the first 300 of the 1000 sample queries settle it.
    assert "at 95% confidence), target 0.5, 300 sample queries" in out
    # The live probing, and which setting decides it, is what `inspect` shows.
    assert cli_main(["inspect", "--db", db]) == 0
    assert "entities: IVF_RQ probes 20 of 35 partitions (calibrated at ingest" in capsys.readouterr().out
    monkeypatch.setenv("DRIFT_LANCE_STORE__SEARCH__NPROBES", "7")
    assert cli_main(["inspect", "--db", db]) == 0
    assert "entities: IVF_RQ probes 7 of 35 partitions (store.search.nprobes, not the ingest calibration)" in capsys.readouterr().out
    monkeypatch.delenv("DRIFT_LANCE_STORE__SEARCH__NPROBES")
    assert cli_main(["ingest", str(src), "--db", db, "--ann-min-rows", "1000", "--target-recall", "off", "--no-progress"]) == 0
    assert "probes 20 of 35 partitions (the floor store.search.min_nprobes = 20, as the default 30% of the partitions is only 11: not calibrated at ingest)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["ingest", str(src), "--db", db, "--target-recall", "1.5"])
    assert exit_info.value.code == 2
    assert "--target-recall" in capsys.readouterr().err


def test_ingest_prints_the_probing_its_settings_put_in_force_as_inspect_does(tmp_path, capsys, monkeypatch):
    """With `[store.search] nprobes` (or its variable) set, ingest said "probes 20 (calibrated at
    ingest)" while every query, and `inspect` with the same settings, probed 7."""
    from ingest.synthetic import generate_index

    src = generate_index(tmp_path / "src", n_entities=4800, dim=16, seed=2)
    db = str(tmp_path / "db")
    monkeypatch.setenv("DRIFT_LANCE_STORE__SEARCH__NPROBES", "7")
    assert cli_main(["ingest", str(src), "--db", db, "--ann-min-rows", "1000", "--target-recall", "0.5", "--no-progress"]) == 0
    line = "entities: IVF_RQ probes 7 of 35 partitions (store.search.nprobes, not the ingest calibration)"
    assert line in capsys.readouterr().out
    assert cli_main(["inspect", "--db", db]) == 0
    assert line in capsys.readouterr().out


def test_indexes_calibrated_before_the_confidence_bound_still_open_and_print():
    """A manifest written before the bound existed has no `recall_lower_bound`: it loads, and
    `inspect` prints its probing without one."""
    from drift_lance.cli.ingest_cmd import probing_line
    from drift_lance.store import AnnCalibration

    old = AnnCalibration.model_validate(
        {"nprobes": 100, "refine_factor": 5, "recall_at_10": 0.972, "target_recall": 0.97, "queries": 300, "seconds": 27.1}
    )
    info = TableInfo(name="entities", version=1, rows=250_000, vector_index="IVF_RQ",
                     vector_index_params={"num_partitions": 500}, calibration=old)
    assert old.recall_lower_bound is None
    assert probing_line(info) == (
        "entities: IVF_RQ probes 100 of 500 partitions "
        "(calibrated at ingest: recall@10 0.972, target 0.97, 300 sample queries, 27.1s)"
    )


def test_inspect_says_when_calibration_never_reached_its_target():
    """No probe count reached the target, so calibration settled on every partition: the probing
    line must say the target was missed (only the ingest's log said so before)."""
    from drift_lance.cli.ingest_cmd import probing_line
    from drift_lance.store import AnnCalibration

    def line(mean: float, bound: float) -> str:
        calibration = AnnCalibration(nprobes=35, refine_factor=5, recall_at_10=mean, recall_lower_bound=bound,
                                     target_recall=0.99, queries=300, seconds=3.0)
        info = TableInfo(name="entities", version=1, rows=25_000, vector_index="IVF_RQ",
                         vector_index_params={"num_partitions": 35}, calibration=calibration)
        return probing_line(info)

    assert line(0.896, 0.88).endswith("3.0s; TARGET NOT REACHED with every partition probed)")
    assert "NOT REACHED" not in line(0.995, 0.991)
