"""Local context ranking and budget rules on a small hand-made graphrag index in a real LanceDB.

Graph (titles; combined_degree in brackets), selected by name so the order is fixed:

    in-network:  A-B [5], B-A [5]
    out-network: A-X [4], B-X [4], A-Y [9], Z-B [4], W-A [9]

Communities: level 0: 0 {A, B, X}, 1 {C, Y}; level 1: 2 {A}, 3 {B}, 4 {D}.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import pytest_asyncio

from drift_lance._lance_store import open_store
from drift_lance.local import LocalContextBuilder, build_local_context
from drift_lance.testing import HashEmbedder

DIM = 16
TITLES = ["A", "B", "C", "D", "X", "Y", "Z", "W"]
RELATIONSHIPS = [  # (source, target, combined_degree, text units)
    ("A", "B", 5, ["t0"]),
    ("A", "X", 4, ["t1"]),
    ("B", "X", 4, ["t2"]),
    ("A", "Y", 9, ["t1"]),
    ("Z", "B", 4, ["t2"]),
    ("W", "A", 9, ["t0"]),
    ("B", "A", 5, ["t2"]),
]
COMMUNITIES = [  # (community, level, parent, members, report rank)
    (0, 0, -1, ["A", "B", "X"], 5.0),
    (1, 0, -1, ["C", "Y"], 9.0),
    (2, 1, 0, ["A"], 8.0),
    (3, 1, 0, ["B"], 8.0),
    (4, 1, 1, ["D"], 1.0),
]
ENTITY_UNITS = {"A": ["t0", "t1"], "B": ["t2", "t0"], "C": ["t2"], "D": ["t2"]}
UNIT_RELATIONSHIPS = {"t0": [0, 5], "t1": [1, 3], "t2": [2, 4, 6]}  # relationship positions
CLAIMS = [("B", "claim about B"), ("A", "first claim about A"), ("A", "second claim about A")]


def _write(columns: dict, path: Path) -> None:
    """Write a parquet file; scalar values are repeated over the rows."""
    rows = max(len(v) for v in columns.values() if isinstance(v, (list, range)))
    data = {k: list(v) if isinstance(v, (list, range)) else [v] * rows for k, v in columns.items()}
    pl.DataFrame(data).write_parquet(path)


def _write_index(folder: Path) -> None:
    eid = {t: f"e-{t}" for t in TITLES}
    rid = [f"r-{i}" for i in range(len(RELATIONSHIPS))]
    degree = {t: sum(t in (s, o) for s, o, _, _ in RELATIONSHIPS) for t in TITLES}
    _write({
        "id": [eid[t] for t in TITLES],
        "human_readable_id": range(len(TITLES)),
        "title": TITLES,
        "type": "thing",
        "description": [f"{t} is entity {t}" for t in TITLES],
        "text_unit_ids": [ENTITY_UNITS.get(t, ["t0"]) for t in TITLES],
        "frequency": 1,
        "degree": [degree[t] for t in TITLES],
    }, folder / "entities.parquet")
    _write({
        "id": rid,
        "human_readable_id": range(len(RELATIONSHIPS)),
        "source": [r[0] for r in RELATIONSHIPS],
        "target": [r[1] for r in RELATIONSHIPS],
        "description": [f"{s} relates to {o}" for s, o, _, _ in RELATIONSHIPS],
        "weight": 1.0,
        "combined_degree": [r[2] for r in RELATIONSHIPS],
        "text_unit_ids": [r[3] for r in RELATIONSHIPS],
    }, folder / "relationships.parquet")
    common = {
        "id": [f"c-{c[0]}" for c in COMMUNITIES],
        "human_readable_id": [c[0] for c in COMMUNITIES],
        "community": [c[0] for c in COMMUNITIES],
        "level": [c[1] for c in COMMUNITIES],
        "parent": [c[2] for c in COMMUNITIES],
        "children": [[k[0] for k in COMMUNITIES if k[2] == c[0]] for c in COMMUNITIES],
        "title": [f"Community {c[0]}" for c in COMMUNITIES],
        "period": "2024-01-01",
        "size": [len(c[3]) for c in COMMUNITIES],
    }
    _write({
        **common,
        "entity_ids": [[eid[t] for t in c[3]] for c in COMMUNITIES],
        "relationship_ids": [[] for _ in COMMUNITIES],
        "text_unit_ids": [["t0"] for _ in COMMUNITIES],
    }, folder / "communities.parquet")
    _write({
        **common,
        "id": [f"report-{c[0]}" for c in COMMUNITIES],
        "title": [f"Report {c[0]}" for c in COMMUNITIES],
        "summary": [f"summary {c[0]}" for c in COMMUNITIES],
        "full_content": [f"# Report {c[0]}\n\nabout {', '.join(c[3])}" for c in COMMUNITIES],
        "rank": [c[4] for c in COMMUNITIES],
        "rating_explanation": "because",
        "findings": [[{"summary": "s", "explanation": "e"}] for _ in COMMUNITIES],
        "full_content_json": "{}",
    }, folder / "community_reports.parquet")
    units = ["t0", "t1", "t2"]
    _write({
        "id": units,
        "human_readable_id": range(len(units)),
        "text": [f"text of {u}" for u in units],
        "n_tokens": 4,
        "document_id": "doc-0",
        "entity_ids": [[eid[t] for t, us in ENTITY_UNITS.items() if u in us] for u in units],
        "relationship_ids": [[rid[i] for i in UNIT_RELATIONSHIPS[u]] for u in units],
        "covariate_ids": [[] for _ in units],
    }, folder / "text_units.parquet")
    _write({
        "id": [f"cv-{i}" for i in range(len(CLAIMS))],
        "human_readable_id": range(len(CLAIMS)),
        "covariate_type": "claim",
        "type": "FACT",
        "description": [c[1] for c in CLAIMS],
        "subject_id": [c[0] for c in CLAIMS],
        "object_id": "NONE",
        "status": "TRUE",
        "start_date": "NONE",
        "end_date": "NONE",
        "source_text": "quote",
        "text_unit_id": "t0",
    }, folder / "covariates.parquet")
    _write({
        "id": ["doc-0"], "human_readable_id": [0], "title": ["doc"], "text": ["all"], "text_unit_ids": [units],
        "creation_date": ["2024-01-01"],
    }, folder / "documents.parquet")


@pytest.fixture(scope="module")
def rules_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    import ingest

    folder = tmp_path_factory.mktemp("rules-index")
    _write_index(folder)
    uri = str(tmp_path_factory.mktemp("rules-db") / "db")
    asyncio.run(ingest.run_ingest(folder, uri, embedder=HashEmbedder(DIM), progress=False))
    return uri


@pytest_asyncio.fixture
async def store(rules_db: str):
    opened = await open_store(rules_db)
    try:
        yield opened
    finally:
        await opened.close()


async def build(store, names, **params):
    """Context for the entities `names`, in that order (no ANN matches: top_k_entities=0)."""
    return await build_local_context(
        store, "q", query_vector=np.ones(DIM, dtype=np.float32), include_entity_names=names, top_k_entities=0, **params
    )


async def test_relationships_in_network_by_rank_then_out_network_by_links_rank_and_side(store):
    ctx = await build(store, ["A", "B"], top_k_relationships=2)
    # in-network r0, r6 tie on rank: table order. Out-network: X links to A and B (links 2) first;
    # then links 1 by rank; A-Y (source side) before W-A (target side) on equal rank; Z-B (rank 4)
    # is cut by the cap 2 relationships x 2 entities.
    assert ctx.record_ids("relationships") == ["0", "6", "1", "2", "3", "5"]
    rel = ctx.records["relationships"]
    assert rel.columns == ["id", "source", "target", "description", "weight", "links"]
    assert dict(zip(rel["id"], rel["links"])) == {"0": "1", "6": "1", "1": "2", "2": "2", "3": "1", "5": "1"}


async def test_relationship_cap_counts_selected_entities(store):
    ctx = await build(store, ["A", "B"], top_k_relationships=1)
    assert ctx.record_ids("relationships") == ["0", "6", "1", "2"]


def section(text: str, name: str) -> str:
    """One rendered section ("-----name-----\n...\n") out of a context text."""
    start = text.index(f"-----{name}-----\n")
    end = text.find("\n\n-----", start)
    return text[start : end + 1 if end >= 0 else len(text)]


async def test_entities_are_added_one_at_a_time_until_the_local_budget_is_hit(store):
    local_only = dict(text_unit_prop=0.0, community_prop=0.0)
    full = await build(store, ["A", "B"], max_context_tokens=10_000, **local_only)
    assert full.record_ids("relationships") == ["0", "6", "1", "2", "3", "5", "4"]
    one = await build(store, ["A"], max_context_tokens=10_000, **local_only)
    count = one.tokenizer.count
    # A budget that holds both entity rows plus A's relationships and claims, but not B's.
    budget = count(section(full.context_text, "Entities")) + count(section(one.context_text, "Relationships")) + count(
        section(one.context_text, "claims")
    )
    tight = await build(store, ["A", "B"], max_context_tokens=budget, **local_only)
    assert tight.record_ids("entities") == ["0", "1"]
    assert tight.record_ids("relationships") == one.record_ids("relationships") == ["3", "5", "0", "6", "1"]
    assert tight.record_ids("claims") == one.record_ids("claims") == ["1", "2"]
    over = await build(store, ["A", "B"], max_context_tokens=budget - 1, **local_only)
    assert over.record_ids("entities") == ["0", "1"] and over.record_ids("relationships") == []


async def test_reports_rank_by_matches_then_rank_then_first_seen(store):
    ctx = await build(store, ["A", "B"], community_level=1, max_context_tokens=20_000)
    assert ctx.record_ids("reports") == ["0", "2", "3"]
    assert ctx.context_text.startswith('-----Reports-----\nid|title|content\n0|Report 0|"# Report 0\n\nabout A, B, X"\n')


async def test_community_level_restricts_reports_and_entities(store):
    ctx = await build(store, ["A", "B", "D"], community_level=0, max_context_tokens=20_000)
    assert ctx.record_ids("reports") == ["0"]
    assert ctx.record_ids("entities") == ["0", "1"]  # D is only in a level-1 community
    deeper = await build(store, ["D"], community_level=1, max_context_tokens=20_000)
    assert deeper.record_ids("entities") == ["3"] and deeper.record_ids("reports") == ["4"]


async def test_min_community_rank_drops_reports(store):
    ctx = await build(store, ["A", "B"], community_level=1, min_community_rank=6, max_context_tokens=20_000)
    assert ctx.record_ids("reports") == ["2", "3"]


async def test_sources_by_entity_order_then_supported_relationships(store):
    ctx = await build(store, ["A", "B"], max_context_tokens=20_000)
    # A cites t0 (supports 2 of A's relationships) and t1 (2): tie keeps citation order; B adds t2.
    assert ctx.record_ids("sources") == ["0", "1", "2"]
    ctx = await build(store, ["C", "A"], max_context_tokens=20_000)
    assert ctx.record_ids("sources") == ["2", "0", "1"]


async def test_claims_follow_entity_order_and_table_order(store):
    ctx = await build(store, ["A", "B"], max_context_tokens=20_000)
    assert ctx.record_ids("claims") == ["1", "2", "0"]
    assert "-----claims-----\nid|entity|object_id|status|start_date|end_date|description\n1|A|NONE|TRUE|NONE|NONE|first claim about A\n" in ctx.context_text
    without = await build(store, ["A", "B"], max_context_tokens=20_000, include_claims=False)
    assert "-----claims-----" not in without.context_text and without.record_ids("claims") == []


async def test_empty_sections(store):
    # C has no claims: header only (graphrag prints it); X-only has no in-network relationships.
    ctx = await build(store, ["C"], max_context_tokens=20_000)
    assert ctx.record_ids("claims") == []
    assert "-----claims-----\nid|entity|object_id|status|start_date|end_date|description\n" in ctx.context_text
    assert "-----Relationships-----" not in ctx.context_text and ctx.record_ids("relationships") == []
    nothing = await build(store, [], max_context_tokens=20_000)
    assert nothing.context_text == "" and all(len(f) == 0 for f in nothing.records.values())


async def test_zero_budgets_fixed_by_default_reproducible_on_request(store):
    params = dict(max_context_tokens=1000, text_unit_prop=0.5, community_prop=0.5)
    fixed = await build(store, ["A"], community_level=1, **{**params, "community_prop": 0.001, "text_unit_prop": 0.999})
    assert not fixed.context_text.startswith("[]") and "-----Entities-----" not in fixed.context_text
    reference = await build(
        store, ["A"], community_level=1, reproduce_reference_defects=True, **{**params, "community_prop": 0.001, "text_unit_prop": 0.999}
    )
    assert reference.context_text.startswith("[]\n\n-----Entities-----\nid|entity|description|number of relationships\n\n\n")
    assert fixed.record_ids("sources") == reference.record_ids("sources") == ["0", "1"]


async def test_budget_is_int_of_total_times_share(store):
    builder = LocalContextBuilder(store)
    base = await builder.build("q", query_vector=np.ones(DIM), include_entity_names=["A", "B"], top_k_entities=0, max_context_tokens=20_000)
    sources = base.context_text[base.context_text.index("-----Sources-----"):]
    needed = builder.tokenizer_for(builder.config).count(sources)
    # text budget int(T * 0.5) exactly equal to the section's tokens keeps every unit; one less drops the last.
    fits = await builder.build("q", query_vector=np.ones(DIM), include_entity_names=["A", "B"], top_k_entities=0,
                               max_context_tokens=needed * 2, text_unit_prop=0.5, community_prop=0.0)
    assert fits.record_ids("sources") == ["0", "1", "2"]
    short = await builder.build("q", query_vector=np.ones(DIM), include_entity_names=["A", "B"], top_k_entities=0,
                                max_context_tokens=needed * 2 - 2, text_unit_prop=0.5, community_prop=0.0)
    assert short.record_ids("sources") == ["0", "1"]


async def test_exclude_names_and_ann_oversampling(store):
    ctx = await build_local_context(store, "q", query_vector=np.ones(DIM), top_k_entities=2)
    assert len(ctx.record_ids("entities")) == 4  # graphrag keeps all 2 x top_k matches
    excluded = await build_local_context(store, "q", query_vector=np.ones(DIM), top_k_entities=2, exclude_entity_names=["A", "B"])
    titles = excluded.records["entities"]["entity"].to_list()
    assert "A" not in titles and "B" not in titles


async def test_bad_settings_name_the_field(store):
    from drift_lance.errors import ConfigError

    with pytest.raises(ConfigError, match="community_prop"):
        await build(store, ["A"], community_prop=0.8, text_unit_prop=0.5)
    with pytest.raises(ConfigError, match="top_k_typo"):
        await build(store, ["A"], top_k_typo=3)


def test_reports_rank_by_selected_members_then_rank_then_first_seen():
    from drift_lance.local.ranking import rank_reports

    reports = pl.DataFrame({
        "community": [10, 11, 12, 13, 14],
        "rank": [2.0, 9.0, 9.0, None, 1.0],
        "title": ["ten", "eleven", "twelve", "thirteen", "fourteen"],
    })
    # entity memberships in selection order: 12 is seen first, 11 second; 10 has two members
    selected = [[12, 10], [11, 10], [13], [14]]
    ranked = rank_reports(selected, reports, min_rank=1.5)
    # 10 (two selected members) first; 12 and 11 tie on members and rank: 12 was seen first;
    # 13 has no rank and 14 is under min_rank, so both are left out
    assert [r["title"] for r in ranked] == ["ten", "twelve", "eleven"]
    assert rank_reports(selected, reports, min_rank=0)[-1]["title"] == "fourteen"


def test_sources_count_a_relationship_id_as_often_as_the_unit_lists_it():
    from drift_lance.local.ranking import rank_text_units

    units = pl.DataFrame({"id": ["t0", "t1"], "relationship_ids": [["r0", "r0"], ["r1"]]})
    relationships = pl.DataFrame({"id": ["r0", "r1"], "source": ["A", "A"], "target": ["X", "Y"],
                                  "text_unit_ids": [["t0"], ["t1"]]})
    # graphrag 3.3.0's count_relationships sums over the unit's list, duplicates included: t0
    # supports A twice and outranks t1 (once), although A cites t1 first. A set would tie them.
    assert rank_text_units([["t1", "t0"]], ["A"], units, relationships) == ["t0", "t1"]


def test_report_csv_is_what_the_csv_module_writes():
    """to_csv quotes in str methods; every field and delimiter here must come out as the csv
    module (pandas' to_csv) writes it: quotes doubled, delimiter or newline quoted, "\\r" as the
    running Python writes it, a lone empty field quoted."""
    import csv
    import io
    import itertools

    from drift_lance.local.render import to_csv

    fields = ["", "plain", 'say "hi"', "a|b", "a,b", "line\nbreak", "cr\rhere", "tab\there", " pad ", '"', "é|\n"]
    for delimiter in ("|", ",", "\t", " "):
        for width in (1, 2, 3):
            rows = [list(combo) for combo in itertools.islice(itertools.product(fields, repeat=width), 200)]
            buffer = io.StringIO()
            csv.writer(buffer, delimiter=delimiter, quotechar='"', quoting=csv.QUOTE_MINIMAL, lineterminator="\n").writerows(
                [["id", "title", "content"][:width], *rows]
            )
            assert to_csv(["id", "title", "content"][:width], rows, delimiter) == buffer.getvalue(), (delimiter, width)
