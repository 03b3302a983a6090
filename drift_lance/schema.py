"""The contract between `ingest` (writer) and the engine (reader): LanceDB table and column names.

Every table keeps graphrag's own column names where graphrag has one, so users who know graphrag's
parquet files recognise ours. Vector columns are `fixed_size_list<float32>[dim]`, L2-normalised, and
always named `vector` (LanceDB's default), with the embedding model recorded in the manifest.
"""

from __future__ import annotations

import pyarrow as pa

VECTOR = "vector"
MANIFEST_TABLE = "drift_lance_manifest"

ENTITIES = "entities"
RELATIONSHIPS = "relationships"
COMMUNITIES = "communities"
COMMUNITY_REPORTS = "community_reports"
TEXT_UNITS = "text_units"
COVARIATES = "covariates"
DOCUMENTS = "documents"

ALL_TABLES = (ENTITIES, RELATIONSHIPS, COMMUNITIES, COMMUNITY_REPORTS, TEXT_UNITS, COVARIATES, DOCUMENTS)
REQUIRED_TABLES = (ENTITIES, RELATIONSHIPS, COMMUNITIES, COMMUNITY_REPORTS, TEXT_UNITS)

# Tables that carry a vector column, and which text it embeds (graphrag's embedding names).
VECTOR_TABLES = {
    ENTITIES: "entity_description",  # title + ":" + description, as graphrag embeds it
    COMMUNITY_REPORTS: "community_full_content",
    TEXT_UNITS: "text_unit_text",
}

_str = pa.string()
_i64 = pa.int64()
_f64 = pa.float64()
_strs = pa.list_(pa.string())
_i64s = pa.list_(pa.int64())


def vector_type(dim: int) -> pa.DataType:
    return pa.list_(pa.float32(), dim)


# Columns per table (without the vector column, which is appended with the table's dimension).
# human_readable_id is graphrag's short id; it is what the local-search context shows as `id`
# for entities, relationships and claims (reports show `community`, sources `human_readable_id`).
COLUMNS: dict[str, list[tuple[str, pa.DataType]]] = {
    ENTITIES: [
        ("id", _str),
        ("human_readable_id", _i64),
        ("title", _str),
        ("type", _str),
        ("description", _str),
        ("text_unit_ids", _strs),
        ("frequency", _i64),
        ("degree", _i64),
        # Community membership: community numbers and their levels, aligned element-wise, all
        # levels (the engine restricts to <= community_level at query time).
        ("community_ids", _i64s),
        ("community_levels", _i64s),
    ],
    RELATIONSHIPS: [
        ("id", _str),
        ("human_readable_id", _i64),
        ("source", _str),  # entity title
        ("target", _str),  # entity title
        ("description", _str),
        ("weight", _f64),
        ("combined_degree", _i64),
        ("text_unit_ids", _strs),
    ],
    COMMUNITIES: [
        ("id", _str),
        ("human_readable_id", _i64),
        ("community", _i64),
        ("level", _i64),
        ("parent", _i64),  # -1 for roots
        ("children", _i64s),
        ("title", _str),
        ("entity_ids", _strs),
        ("relationship_ids", _strs),
        ("text_unit_ids", _strs),
        ("size", _i64),
        ("period", _str),
    ],
    COMMUNITY_REPORTS: [
        ("id", _str),
        ("human_readable_id", _i64),
        ("community", _i64),
        ("level", _i64),
        ("parent", _i64),
        ("children", _i64s),
        ("title", _str),
        ("summary", _str),
        ("full_content", _str),
        ("rank", _f64),
        ("rating_explanation", _str),
        ("findings", _str),  # JSON list of {summary, explanation}
        ("size", _i64),
        ("period", _str),
    ],
    TEXT_UNITS: [
        ("id", _str),
        ("human_readable_id", _i64),
        ("text", _str),
        ("n_tokens", _i64),
        ("document_ids", _strs),
        ("entity_ids", _strs),
        ("relationship_ids", _strs),
        ("covariate_ids", _strs),
    ],
    COVARIATES: [
        ("id", _str),
        ("human_readable_id", _i64),
        ("covariate_type", _str),
        ("type", _str),
        ("description", _str),
        ("subject_id", _str),  # entity title
        ("object_id", _str),
        ("status", _str),
        ("start_date", _str),
        ("end_date", _str),
        ("source_text", _str),
        ("text_unit_id", _str),
    ],
    DOCUMENTS: [
        ("id", _str),
        ("human_readable_id", _i64),
        ("title", _str),
        ("text", _str),
        ("text_unit_ids", _strs),
    ],
}

# Scalar (BTREE) indexes the engine relies on for exact id lookups.
SCALAR_INDEXES: dict[str, tuple[str, ...]] = {
    ENTITIES: ("id", "human_readable_id", "title"),
    RELATIONSHIPS: ("id", "human_readable_id", "source", "target"),
    COMMUNITIES: ("id", "community"),
    COMMUNITY_REPORTS: ("id", "human_readable_id", "community"),
    TEXT_UNITS: ("id", "human_readable_id"),
    COVARIATES: ("id", "human_readable_id", "subject_id"),
    DOCUMENTS: ("id",),
}


def table_schema(table: str, dim: int | None = None) -> pa.Schema:
    fields = [pa.field(name, typ) for name, typ in COLUMNS[table]]
    if table in VECTOR_TABLES:
        if dim is None:
            raise ValueError(f"table {table!r} needs a vector dimension")
        fields.append(pa.field(VECTOR, vector_type(dim)))
    return pa.schema(fields)
