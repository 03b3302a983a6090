"""Synthetic GraphRAG 3.x index generator: deterministic, graphrag-shaped, ingestible."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lance
import numpy as np
import polars as pl
import pytest

from ingest.layouts import detect_layout
from ingest.synthetic import generate_index

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_index(tmp_path_factory.mktemp("synth") / "idx", n_entities=3200, dim=48, seed=7)


def _vectors(root: Path, name: str) -> tuple[list[str], np.ndarray]:
    table = lance.dataset(str(root / "lancedb" / f"{name}.lance")).to_table()
    return table["id"].to_pylist(), np.stack(table["vector"].to_numpy(zero_copy_only=False))


def test_same_seed_same_index_other_seed_differs(synth, tmp_path):
    again = generate_index(tmp_path / "again", n_entities=3200, dim=48, seed=7)
    other = generate_index(tmp_path / "other", n_entities=3200, dim=48, seed=8)
    for name in ("entities", "relationships", "communities", "community_reports", "text_units", "covariates"):
        assert pl.read_parquet(synth / f"{name}.parquet").equals(pl.read_parquet(again / f"{name}.parquet")), name
    assert np.array_equal(_vectors(synth, "entity_description")[1], _vectors(again, "entity_description")[1])
    assert not np.array_equal(_vectors(synth, "entity_description")[1], _vectors(other, "entity_description")[1])


def test_graphrag3_layout_and_referential_integrity(synth):
    assert detect_layout(synth).layout == "graphrag-3"
    entities = pl.read_parquet(synth / "entities.parquet")
    relationships = pl.read_parquet(synth / "relationships.parquet")
    units = pl.read_parquet(synth / "text_units.parquet")
    titles = set(entities["title"])
    assert set(relationships["source"]) <= titles and set(relationships["target"]) <= titles
    unit_ids = set(units["id"])
    assert set(entities["text_unit_ids"].explode()) <= unit_ids
    assert set(units["entity_ids"].explode().drop_nulls()) <= set(entities["id"])
    claims = pl.read_parquet(synth / "covariates.parquet")
    assert set(claims["subject_id"]) <= titles and set(claims["text_unit_id"]) <= unit_ids


def test_community_hierarchy_like_graphrag(synth):
    entities = pl.read_parquet(synth / "entities.parquet")
    communities = pl.read_parquet(synth / "communities.parquet")
    reports = pl.read_parquet(synth / "community_reports.parquet")
    assert sorted(communities["level"].unique()) == [0, 1, 2]
    assert reports.height == communities.height
    assert 12 <= entities.height / reports.height <= 20  # ~1 report per 16 entities
    parent_of = dict(zip(communities["community"], communities["parent"], strict=True))
    for row in communities.iter_rows(named=True):
        if row["level"] == 0:
            assert row["parent"] == -1
        else:
            parent = communities.filter(pl.col("community") == row["parent"]).row(0, named=True)
            assert parent["level"] == row["level"] - 1
            assert set(row["entity_ids"]) <= set(parent["entity_ids"])
        assert all(parent_of[c] == row["community"] for c in row["children"])
    # every entity is in exactly one community per level
    per_level = communities.explode("entity_ids").group_by("level").agg(pl.col("entity_ids").n_unique(), pl.len())
    assert per_level["entity_ids"].to_list() == [entities.height] * 3
    assert per_level["len"].to_list() == [entities.height] * 3


def test_power_law_degrees(synth):
    degree = pl.read_parquet(synth / "entities.parquet")["degree"].to_numpy()
    relationships = pl.read_parquet(synth / "relationships.parquet")
    assert degree.sum() == 2 * relationships.height
    assert degree.max() >= 8 * np.median(degree)  # a heavy tail, unlike a uniform random graph


def test_vectors_unit_float32_and_clustered(synth):
    ids, vectors = _vectors(synth, "entity_description")
    entities = pl.read_parquet(synth / "entities.parquet")
    assert ids == entities["id"].to_list()
    assert vectors.dtype == np.float32 and vectors.shape == (3200, 48)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    # entities of the same leaf community are closer than random pairs
    communities = pl.read_parquet(synth / "communities.parquet").filter(pl.col("level") == 2)
    position = {e: i for i, e in enumerate(ids)}
    members = [position[e] for e in communities["entity_ids"][0]]
    within = (vectors[members] @ vectors[members].T).mean()
    overall = (vectors[:200] @ vectors[200:400].T).mean()
    assert within > overall + 0.3
    for name, table in (("community_full_content", "community_reports"), ("text_unit_text", "text_units")):
        vid, _ = _vectors(synth, name)
        assert vid == pl.read_parquet(synth / f"{table}.parquet")["id"].to_list()


def test_module_cli(tmp_path):
    out = tmp_path / "cli"
    result = subprocess.run(
        [sys.executable, "-m", "ingest.synthetic", str(out), "--entities", "500", "--dim", "16"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert pl.read_parquet(out / "entities.parquet").height == 500
    assert _vectors(out, "entity_description")[1].shape == (500, 16)


def test_rejects_tiny_sizes(tmp_path):
    with pytest.raises(ValueError, match="n_entities"):
        generate_index(tmp_path / "x", n_entities=3)


def _module_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    # without the log levels this process set by importing `ingest`: the child must set its own
    inherited = {k: v for k, v in os.environ.items() if k not in ("LANCE_LOG", "LANCEDB_LOG")}
    return subprocess.run([sys.executable, "-m", "ingest.synthetic", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**inherited, **env})


def test_module_cli_shows_no_lance_warnings_unless_asked(tmp_path):
    """Lance warned "No existing dataset at ..., it will be created" for each vector table written."""
    quiet = _module_cli(str(tmp_path / "a"), "--entities", "100", "--dim", "8")
    assert quiet.returncode == 0 and "No existing dataset" not in quiet.stderr, quiet.stderr
    loud = _module_cli(str(tmp_path / "b"), "--entities", "100", "--dim", "8", LANCE_LOG="warn")  # the user's level is kept
    assert loud.returncode == 0 and "No existing dataset" in loud.stderr, loud.stderr


def test_module_cli_refuses_to_replace_a_folder_it_did_not_write(tmp_path):
    """A user's notes were deleted: OUT was replaced whatever it held."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    result = _module_cli(str(out), "--entities", "100", "--dim", "8")
    assert result.returncode == 2
    assert f"{out}: folder is not empty and not a synthetic index written by this tool" in result.stderr
    assert "--overwrite" in result.stderr and "Traceback" not in result.stderr
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"
    # asked for explicitly, it is replaced
    assert _module_cli(str(out), "--entities", "100", "--dim", "8", "--overwrite").returncode == 0
    assert not (out / "notes.txt").exists() and pl.read_parquet(out / "entities.parquet").height == 100


def test_an_earlier_synthetic_index_is_replaced_unless_a_user_file_was_added(tmp_path):
    out = generate_index(tmp_path / "idx", n_entities=100, dim=8, seed=1)
    assert generate_index(out, n_entities=120, dim=8, seed=1) == out  # its own output: replaced
    assert pl.read_parquet(out / "entities.parquet").height == 120
    (out / ".drift-lance-synthetic").unlink()  # as written before the marker existed: known by its files
    assert generate_index(out, n_entities=120, dim=8, seed=1) == out
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a synthetic index written by this tool"):
        generate_index(out, n_entities=100, dim=8, seed=1)
    assert (out / "notes.txt").read_text() == "keep me" and pl.read_parquet(out / "entities.parquet").height == 120


def test_module_cli_output_path_that_is_a_file_is_a_clear_error(tmp_path):
    out = tmp_path / "taken"
    out.write_text("a file")
    result = _module_cli(str(out), "--entities", "100", "--dim", "8")
    assert result.returncode == 2, result.stderr
    assert f"{out}: is a file, not a folder" in result.stderr and "Traceback" not in result.stderr
    assert out.read_text() == "a file"
