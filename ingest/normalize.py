"""Turn any GraphRAG layout's tables (parquet, or CSV typed by `ingest.csv_tables`) into the columns of `drift_lance.schema`.

Everything here happens in memory and raises IngestError (naming file and column) before anything
is written. Column fallbacks cover older graphrag releases: entity `name` for `title`, `source_id`
strings for `text_unit_ids`, `document_id(s)`, `rank_explanation`, and membership / degree from
`create_final_nodes` when the communities table has no `entity_ids`. Optional columns a table lacks
(descriptions, weights, titles, ...) get a default on every row, and a warning names them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from drift_lance import schema
from drift_lance.errors import IngestError
from ingest.layouts import NODES, SourceIndex

log = logging.getLogger(__name__)

_STR, _I64, _F64 = pl.String, pl.Int64, pl.Float64
_STRS, _I64S = pl.List(pl.String), pl.List(pl.Int64)
_POLARS_TYPES = {"string": _STR, "int64": _I64, "double": _F64, "list<item: string>": _STRS, "list<item: int64>": _I64S}


def polars_type(arrow_type: Any) -> pl.DataType:
    return _POLARS_TYPES[str(arrow_type).replace("element", "item")]


@dataclass(slots=True)
class NormalizedIndex:
    """All tables in the schema's columns (without vectors) plus the raw frames they came from."""

    layout: str
    root: Path
    tables: dict[str, pl.DataFrame]
    raw: dict[str, pl.DataFrame]
    files: dict[str, Path]
    warnings: list[str] = field(default_factory=list)  # optional columns filled with defaults, per table


class _Table:
    """One raw parquet table with its file path, for error messages and typed column access."""

    def __init__(self, name: str, path: Path, frame: pl.DataFrame) -> None:
        self.name, self.path, self.frame = name, path, frame
        self.filled: dict[str, str] = {}  # optional column missing here -> the default every row got

    def optional(self, *candidates: str, target: pl.DataType, default: Any = None) -> pl.Series:
        """The first of `candidates` present, as `target`; else `default` on every row, and the
        column is noted as filled (the ingest warns: a variant may lack it, a broken export too)."""
        column = self.pick(*candidates)
        if column is not None:
            return self.typed(column, target)
        self.note_filled(candidates[0], default)
        return pl.Series([default] * self.frame.height, dtype=target)

    def note_filled(self, column: str, default: Any) -> None:
        self.filled[column] = "null" if default is None else repr(default)

    def filled_warning(self) -> str | None:
        """One line naming the table and its optional columns that were filled with defaults."""
        if not self.filled:
            return None
        columns = ", ".join(repr(column) for column in self.filled)
        plural = "s" if len(self.filled) > 1 else ""
        return (f"{self.path}: table {self.name!r} has no optional column{plural} {columns} "
                f"(filled with {', '.join(self.filled.values())} on every row)")

    def has(self, column: str) -> bool:
        return column in self.frame.columns

    def pick(self, *candidates: str) -> str | None:
        return next((c for c in candidates if self.has(c)), None)

    def need(self, *candidates: str) -> str:
        found = self.pick(*candidates)
        if found is None:
            names = " or ".join(repr(c) for c in candidates)
            raise IngestError(f"{self.path}: required column {names} is missing (columns: {', '.join(self.frame.columns)})")
        return found

    def typed(self, column: str, target: pl.DataType, *, not_null: bool = False) -> pl.Series:
        """Column `column` converted to `target`; IngestError naming file and column on a wrong type."""
        series = _convert(self.frame[column], target, f"{self.path}: column {column!r}")
        if not_null and series.null_count():
            first = int(series.is_null().arg_max() or 0)
            raise IngestError(f"{self.path}: column {column!r} has {series.null_count()} empty values (first at row {first})")
        return series


def _convert(series: pl.Series, target: pl.DataType, where: str) -> pl.Series:
    dtype = series.dtype
    if dtype == pl.Null:
        return pl.Series(series.name, [None] * len(series), dtype=target)
    if isinstance(dtype, pl.Array):
        series, dtype = series.arr.to_list(), pl.List(dtype.inner)
    ok: bool
    if target == _STR:
        ok = dtype in (pl.String, pl.Categorical, pl.Enum) or isinstance(dtype, pl.Categorical | pl.Enum)
    elif target == _I64:
        ok = dtype.is_integer() or dtype.is_float() or dtype == pl.String
    elif target == _F64:
        ok = dtype.is_numeric() or dtype == pl.String
    elif isinstance(target, pl.List):
        inner = target.inner
        ok = isinstance(dtype, pl.List) and (
            dtype.inner == pl.Null
            or (inner == pl.String and dtype.inner == pl.String)
            or (inner == pl.Int64 and (dtype.inner.is_integer() or dtype.inner == pl.String))
        )
    else:  # pragma: no cover - every schema type is handled above
        ok = False
    if not ok:
        raise IngestError(f"{where} has type {dtype}, expected {target}")
    try:
        converted = series.cast(target, strict=True)
    except (pl.exceptions.InvalidOperationError, pl.exceptions.ComputeError) as exc:
        raise IngestError(f"{where}: values cannot be read as {target}: {exc}".split("\n")[0]) from exc
    if target == _I64 and dtype.is_float():
        # a float column is only acceptable when it holds whole numbers (pandas writes ints with NaN as floats)
        if (series.drop_nulls() != converted.drop_nulls().cast(dtype)).any():
            raise IngestError(f"{where} has type {dtype} with fractional values, expected {target}")
    return converted


def _row_numbers(n: int) -> pl.Series:
    return pl.Series(values=range(n), dtype=_I64)


def _split_ids(series: pl.Series) -> pl.Series:
    """graphrag 0.x `source_id`: comma-separated ids in one string."""
    return series.cast(_STR).str.split(",").list.eval(pl.element().str.strip_chars()).list.eval(
        pl.element().filter(pl.element() != "")
    )


def _unit_ids(t: _Table) -> pl.Series:
    """`text_unit_ids`, or graphrag 0.x's comma-separated `source_id` strings."""
    if not t.has("text_unit_ids") and t.has("source_id") and t.frame["source_id"].dtype == pl.String:
        return _fill_lists(_split_ids(t.frame["source_id"]))  # a null source_id: no units, as a null list elsewhere
    return _fill_lists(t.optional("text_unit_ids", "source_id", target=_STRS, default=[]))


def _empty_lists(n: int, dtype: pl.DataType) -> pl.Series:
    return pl.Series(values=[[] for _ in range(n)], dtype=dtype)


def _fill_lists(series: pl.Series) -> pl.Series:
    return series.fill_null(pl.Series(values=[[]], dtype=series.dtype))


def _citation_ids(table: _Table, default: pl.Series) -> pl.Series:
    """`human_readable_id`, the id answers cite ("[Data: Entities (4, 5)]"): set on every row and
    unique when the table has it (graphrag numbers the rows), else `default`."""
    if not table.has("human_readable_id"):
        return default
    ids = table.typed("human_readable_id", _I64, not_null=True)
    _check_unique(table, "human_readable_id", ids)
    return ids


def _check_unique(table: _Table, column: str, values: pl.Series) -> None:
    dupes = values.filter(values.is_duplicated()).unique(maintain_order=True)
    if len(dupes):
        shown = ", ".join(repr(v) for v in dupes.head(3).to_list())
        raise IngestError(f"{table.path}: column {column!r} has {len(dupes)} duplicated values, e.g. {shown}")


def _frame(table: str, columns: dict[str, pl.Series]) -> pl.DataFrame:
    """A frame with exactly the schema's columns of `table`, in order and with the schema's types."""
    out = {}
    for name, arrow_type in schema.COLUMNS[table]:
        out[name] = columns[name].cast(polars_type(arrow_type)).rename(name)
    return pl.DataFrame(out)


# --------------------------------------------------------------------------- per-table conversions


def _entities(t: _Table, memberships: pl.DataFrame, degrees: dict[str, int]) -> pl.DataFrame:
    n = t.frame.height
    ids = t.typed(t.need("id"), _STR, not_null=True)
    title_col = t.need("title", "name")
    titles = t.typed(title_col, _STR, not_null=True)
    _check_unique(t, "id", ids)
    _check_unique(t, title_col, titles)
    units = _unit_ids(t)
    frequency = t.typed("frequency", _I64) if t.has("frequency") else units.list.len().cast(_I64)
    if t.has("degree"):
        degree = t.typed("degree", _I64).fill_null(0)
    else:
        degree = pl.Series([degrees.get(x, 0) for x in titles.to_list()], dtype=_I64)
    member = pl.DataFrame({"id": ids}).join(memberships, on="id", how="left", maintain_order="left")
    return _frame(
        schema.ENTITIES,
        {
            "id": ids,
            "human_readable_id": _citation_ids(t, _row_numbers(n)),
            "title": titles,
            "type": t.optional("type", target=_STR),
            "description": t.optional("description", target=_STR, default="").fill_null(""),
            "text_unit_ids": units,
            "frequency": frequency,
            "degree": degree,
            "community_ids": _fill_lists(member["community_ids"]),
            "community_levels": _fill_lists(member["community_levels"]),
        },
    )


def _relationships(t: _Table, degrees: dict[str, int]) -> pl.DataFrame:
    n = t.frame.height
    ids = t.typed(t.need("id"), _STR, not_null=True)
    _check_unique(t, "id", ids)
    source = t.typed(t.need("source"), _STR, not_null=True)
    target = t.typed(t.need("target"), _STR, not_null=True)
    if degree_col := t.pick("combined_degree", "rank"):  # graphrag 0.x stored the combined degree as `rank`
        combined = t.typed(degree_col, _I64)
    else:
        combined = pl.Series(
            [degrees.get(s, 0) + degrees.get(o, 0) for s, o in zip(source.to_list(), target.to_list(), strict=True)],
            dtype=_I64,
        )
    units = _unit_ids(t)
    return _frame(
        schema.RELATIONSHIPS,
        {
            "id": ids,
            "human_readable_id": _citation_ids(t, _row_numbers(n)),
            "source": source,
            "target": target,
            "description": t.optional("description", target=_STR, default="").fill_null(""),
            "weight": t.optional("weight", target=_F64, default=1.0).fill_null(1.0),
            "combined_degree": combined,
            "text_unit_ids": units,
        },
    )


def _infer_parents(communities: list[int], levels: list[int], members: list[list[str]]) -> list[int]:
    """Parent of each community: the community one level up sharing the most entities (-1 at level 0)."""
    owner: dict[tuple[int, str], int] = {}
    for community, level, entity_ids in zip(communities, levels, members, strict=True):
        for entity in entity_ids:
            owner[(level, entity)] = community
    parents = []
    for level, entity_ids in zip(levels, members, strict=True):
        votes: dict[int, int] = {}
        for entity in entity_ids:
            up = owner.get((level - 1, entity))
            if up is not None:
                votes[up] = votes.get(up, 0) + 1
        parents.append(min(votes, key=lambda c: (-votes[c], c)) if votes else -1)
    return parents


def _children_of(communities: list[int], parents: list[int]) -> list[list[int]]:
    kids: dict[int, list[int]] = {}
    for community, parent in zip(communities, parents, strict=True):
        if parent >= 0:
            kids.setdefault(parent, []).append(community)
    return [sorted(kids.get(c, [])) for c in communities]


def _community_numbers(t: _Table, column: str) -> pl.Series:
    """`community`, or the `id` older graphrag kept the number in: an `id` that is no number
    (graphrag >= 1 writes uuids there) means the `community` column is missing, so say that."""
    try:
        return t.typed(column, _I64, not_null=True)
    except IngestError as exc:
        if column == "community":
            raise
        raise IngestError(f"{t.path}: required column 'community' is missing, and column 'id' holds no community "
                          f"numbers in its place ({str(exc).removeprefix(f'{t.path}: ')})") from exc


def _communities(t: _Table, node_members: pl.DataFrame | None) -> pl.DataFrame:
    community_col = t.need("community", "id")
    community = _community_numbers(t, community_col)
    _check_unique(t, community_col, community)
    level = t.typed(t.need("level"), _I64, not_null=True)
    ids = t.typed("id", _STR, not_null=True) if t.has("id") else community.cast(_STR)
    _check_unique(t, "id", ids)  # as every table's ids (a distinct `community` does not make them so)
    if t.has("entity_ids"):
        entity_ids = _fill_lists(t.typed("entity_ids", _STRS))
    elif node_members is not None:
        joined = pl.DataFrame({"community": community}).join(node_members, on="community", how="left", maintain_order="left")
        entity_ids = _fill_lists(joined["entity_ids"])
    else:
        raise IngestError(f"{t.path}: column 'entity_ids' is missing and there is no create_final_nodes.parquet to derive it")
    if t.has("parent"):
        parent = t.typed("parent", _I64).fill_null(-1)
    else:
        parent = pl.Series(_infer_parents(community.to_list(), level.to_list(), entity_ids.to_list()), dtype=_I64)
    if t.has("children"):
        children = _fill_lists(t.typed("children", _I64S))
    else:
        children = pl.Series(_children_of(community.to_list(), parent.to_list()), dtype=_I64S)
    titles = pl.select(pl.coalesce(_optional_str(t, "title"), pl.lit("Community ") + community.cast(_STR))).to_series()
    if "title" in t.filled:
        t.note_filled("title", "Community <community>")
    return _frame(
        schema.COMMUNITIES,
        {
            "id": ids,
            "human_readable_id": _citation_ids(t, community),
            "community": community,
            "level": level,
            "parent": parent,
            "children": children,
            "title": titles,
            "entity_ids": entity_ids,
            "relationship_ids": _fill_lists(t.optional("relationship_ids", target=_STRS, default=[])),
            "text_unit_ids": _fill_lists(t.optional("text_unit_ids", target=_STRS, default=[])),
            "size": t.typed("size", _I64) if t.has("size") else entity_ids.list.len().cast(_I64),
            "period": t.optional("period", target=_STR),
        },
    )


def _findings_json(t: _Table) -> pl.Series:
    n = t.frame.height
    if not t.has("findings"):
        t.note_filled("findings", [])
        return pl.Series(["[]"] * n, dtype=_STR)
    series = t.frame["findings"]
    if series.dtype == pl.String:
        return series.fill_null("[]")
    if not isinstance(series.dtype, pl.List | pl.Array) and series.dtype != pl.Null:
        raise IngestError(f"{t.path}: column 'findings' has type {series.dtype}, expected a list of {{summary, explanation}}")
    return pl.Series([json.dumps(v or [], ensure_ascii=False) for v in series.to_list()], dtype=_STR)


def _community_reports(t: _Table, communities: pl.DataFrame) -> pl.DataFrame:
    community = t.typed(t.need("community"), _I64, not_null=True)
    _check_unique(t, "community", community)
    full_content = t.typed(t.need("full_content"), _STR, not_null=True)
    by_community = pl.DataFrame({"community": community}).join(
        communities.select("community", "level", "parent", "children", "size", "period"),
        on="community",
        how="left",
        maintain_order="left",
    )
    ids = t.typed("id", _STR, not_null=True) if t.has("id") else community.cast(_STR)
    _check_unique(t, "id", ids)

    def own_or_community(column: str, dtype: pl.DataType) -> pl.Series:
        return t.typed(column, dtype) if t.has(column) else by_community[column]

    # the level decides which reports a search at a community level sees: never guessed
    level = t.typed("level", _I64, not_null=True) if t.has("level") else by_community["level"]
    if level.null_count():
        unknown = ", ".join(str(c) for c in community.filter(level.is_null()).head(3).to_list())
        raise IngestError(f"{t.path}: column 'level' is missing and some reports' communities are not in the "
                          f"communities table (e.g. community {unknown})")
    return _frame(
        schema.COMMUNITY_REPORTS,
        {
            "id": ids,
            "human_readable_id": _citation_ids(t, community),
            "community": community,
            "level": level,
            "parent": own_or_community("parent", _I64).fill_null(-1),
            "children": _fill_lists(own_or_community("children", _I64S)),
            "title": t.optional("title", target=_STR),
            "summary": t.optional("summary", target=_STR),
            "full_content": full_content,
            "rank": t.optional("rank", target=_F64),
            "rating_explanation": t.optional("rating_explanation", "rank_explanation", target=_STR),
            "findings": _findings_json(t),
            "size": own_or_community("size", _I64),
            "period": own_or_community("period", _STR),
        },
    )


def _inverse(owner_ids: pl.Series, unit_lists: pl.Series, unit_ids: pl.Series) -> pl.Series:
    """For each text unit, the ids of the rows (entities, relationships, ...) that list it."""
    pairs = pl.DataFrame({"owner": owner_ids, "unit": unit_lists}).explode("unit").drop_nulls("unit")
    grouped = pairs.group_by("unit", maintain_order=True).agg(pl.col("owner"))
    joined = pl.DataFrame({"unit": unit_ids}).join(grouped, on="unit", how="left", maintain_order="left")
    return _fill_lists(joined["owner"].cast(_STRS))


def _text_units(t: _Table, entities: pl.DataFrame, relationships: pl.DataFrame, covariates: pl.DataFrame | None) -> pl.DataFrame:
    n = t.frame.height
    ids = t.typed(t.need("id"), _STR, not_null=True)
    _check_unique(t, "id", ids)
    if t.has("document_ids"):
        documents = _fill_lists(t.typed("document_ids", _STRS))
    elif t.has("document_id"):
        documents = t.typed("document_id", _STR).to_frame("d").select(
            pl.when(pl.col("d").is_null()).then(pl.lit([], dtype=_STRS)).otherwise(pl.concat_list("d"))
        ).to_series()
    else:
        t.note_filled("document_ids", [])
        documents = _empty_lists(n, _STRS)

    def ids_or_inverse(column: str, derived: Callable[[], pl.Series]) -> pl.Series:
        return _fill_lists(t.typed(column, _STRS)) if t.has(column) else derived()

    return _frame(
        schema.TEXT_UNITS,
        {
            "id": ids,
            "human_readable_id": _citation_ids(t, _row_numbers(n)),
            "text": t.typed(t.need("text", "chunk"), _STR, not_null=True),
            "n_tokens": t.optional("n_tokens", target=_I64),
            "document_ids": documents,
            "entity_ids": ids_or_inverse("entity_ids", lambda: _inverse(entities["id"], entities["text_unit_ids"], ids)),
            "relationship_ids": ids_or_inverse(
                "relationship_ids", lambda: _inverse(relationships["id"], relationships["text_unit_ids"], ids)
            ),
            "covariate_ids": ids_or_inverse(
                "covariate_ids",
                lambda: _inverse(covariates["id"], covariates["text_unit_id"].cast(_STR).to_frame().select(pl.concat_list("text_unit_id")).to_series(), ids)
                if covariates is not None
                else _empty_lists(n, _STRS),
            ),
        },
    )


def _optional_str(t: _Table, *candidates: str) -> pl.Series:
    return t.optional(*candidates, target=_STR)


def _covariates(t: _Table) -> pl.DataFrame:
    n = t.frame.height
    ids = t.typed(t.need("id"), _STR, not_null=True)
    _check_unique(t, "id", ids)
    return _frame(
        schema.COVARIATES,
        {
            "id": ids,
            "human_readable_id": _citation_ids(t, _row_numbers(n)),
            "covariate_type": _optional_str(t, "covariate_type"),
            "type": _optional_str(t, "type"),
            "description": _optional_str(t, "description"),
            "subject_id": _optional_str(t, "subject_id"),
            "object_id": _optional_str(t, "object_id"),
            "status": _optional_str(t, "status"),
            "start_date": _optional_str(t, "start_date"),
            "end_date": _optional_str(t, "end_date"),
            "source_text": _optional_str(t, "source_text"),
            "text_unit_id": _optional_str(t, "text_unit_id"),
        },
    )


def _documents(t: _Table) -> pl.DataFrame:
    n = t.frame.height
    ids = t.typed(t.need("id"), _STR, not_null=True)
    _check_unique(t, "id", ids)
    return _frame(
        schema.DOCUMENTS,
        {
            "id": ids,
            "human_readable_id": t.typed("human_readable_id", _I64) if t.has("human_readable_id") else _row_numbers(n),
            "title": _optional_str(t, "title"),
            "text": _optional_str(t, "text", "raw_content"),
            "text_unit_ids": _fill_lists(t.optional("text_unit_ids", target=_STRS, default=[])),
        },
    )


# --------------------------------------------------------------------------- derived facts


def _degrees_from_relationships(rel: _Table) -> dict[str, int]:
    # typed, not cast: a list or struct column must fail naming file and column, not in polars
    ends = pl.concat([rel.typed(rel.need("source"), _STR), rel.typed(rel.need("target"), _STR)])
    counts = ends.value_counts()
    return dict(zip(counts[ends.name].to_list(), counts["count"].to_list(), strict=True))


def _nodes_facts(nodes: _Table, entities: _Table) -> tuple[dict[str, int], pl.DataFrame, pl.DataFrame]:
    """From create_final_nodes: degree per title, (entity id, community, level) rows, and entity ids per community."""
    title_col = nodes.need("title", "name")
    title_to_id = dict(
        zip(
            entities.typed(entities.need("title", "name"), _STR).to_list(),
            entities.typed(entities.need("id"), _STR).to_list(),
            strict=True,
        )
    )
    frame = pl.DataFrame(
        {
            "title": nodes.typed(title_col, _STR, not_null=True),
            "community": nodes.typed(nodes.need("community"), _I64),
            "level": nodes.typed(nodes.need("level"), _I64),
            "degree": nodes.typed("degree", _I64) if nodes.has("degree") else pl.Series([None] * nodes.frame.height, dtype=_I64),
        }
    ).with_columns(pl.col("title").replace_strict(title_to_id, default=None).alias("id"))
    degrees = {
        r["title"]: int(r["degree"]) for r in frame.group_by("title").agg(pl.col("degree").max()).drop_nulls().iter_rows(named=True)
    }
    rows = frame.drop_nulls(["id", "community"]).filter(pl.col("community") >= 0)
    per_community = rows.group_by("community", maintain_order=True).agg(pl.col("id").unique(maintain_order=True).alias("entity_ids"))
    return degrees, rows.select("id", "community", "level"), per_community


def _memberships(communities: pl.DataFrame) -> pl.DataFrame:
    """Per entity id: community numbers and levels, sorted by (level, community)."""
    pairs = (
        communities.select("community", "level", pl.col("entity_ids").alias("id"))
        .explode("id")
        .drop_nulls("id")
        .unique()
        .sort(["id", "level", "community"])
    )
    return pairs.group_by("id", maintain_order=True).agg(
        pl.col("community").alias("community_ids"), pl.col("level").alias("community_levels")
    )


def normalize(source: SourceIndex) -> NormalizedIndex:
    """Read and convert every table of `source`; IngestError (naming file and column) on bad input."""
    raw = {name: source.read(name) for name in source.files}
    tabs = {name: _Table(name, source.files[name], frame) for name, frame in raw.items()}
    for name in schema.REQUIRED_TABLES:
        if tabs[name].frame.height == 0:
            raise IngestError(f"{tabs[name].path}: table {name!r} is empty")

    node_members = None
    degrees: dict[str, int] = {}
    needs_nodes = not tabs[schema.COMMUNITIES].has("entity_ids") or not tabs[schema.ENTITIES].has("degree")
    if NODES in tabs and needs_nodes:
        degrees, _, node_members = _nodes_facts(tabs[NODES], tabs[schema.ENTITIES])
    if not degrees:
        degrees = _degrees_from_relationships(tabs[schema.RELATIONSHIPS])

    communities = _communities(tabs[schema.COMMUNITIES], node_members)
    entities = _entities(tabs[schema.ENTITIES], _memberships(communities), degrees)
    entity_degree = dict(zip(entities["title"].to_list(), entities["degree"].to_list(), strict=True))
    relationships = _relationships(tabs[schema.RELATIONSHIPS], entity_degree)
    tables = {
        schema.ENTITIES: entities,
        schema.RELATIONSHIPS: relationships,
        schema.COMMUNITIES: communities,
        schema.COMMUNITY_REPORTS: _community_reports(tabs[schema.COMMUNITY_REPORTS], communities),
    }
    covariates = None
    if schema.COVARIATES in tabs and tabs[schema.COVARIATES].frame.height:
        covariates = tables[schema.COVARIATES] = _covariates(tabs[schema.COVARIATES])
    tables[schema.TEXT_UNITS] = _text_units(tabs[schema.TEXT_UNITS], entities, relationships, covariates)
    if schema.DOCUMENTS in tabs and tabs[schema.DOCUMENTS].frame.height:
        tables[schema.DOCUMENTS] = _documents(tabs[schema.DOCUMENTS])
    warnings = [w for name in tables if (w := tabs[name].filled_warning())]
    warnings += dangling_references(tables, {name: tab.path for name, tab in tabs.items()})
    for warning in warnings:
        log.warning("%s", warning)
    return NormalizedIndex(source.layout, source.root, tables, raw, dict(source.files), warnings)


# (table, column, referenced table, referenced column)
_REFERENCES = (
    (schema.RELATIONSHIPS, "source", schema.ENTITIES, "title"),
    (schema.RELATIONSHIPS, "target", schema.ENTITIES, "title"),
    (schema.ENTITIES, "text_unit_ids", schema.TEXT_UNITS, "id"),
    (schema.COMMUNITIES, "entity_ids", schema.ENTITIES, "id"),
    (schema.TEXT_UNITS, "document_ids", schema.DOCUMENTS, "id"),
    (schema.COMMUNITY_REPORTS, "community", schema.COMMUNITIES, "community"),  # no entity leads local search there
)


def dangling_references(tables: dict[str, pl.DataFrame], paths: dict[str, Path]) -> list[str]:
    """Warnings for ids and titles that point at no row of the table they refer to (an index that
    was edited or partly regenerated, or graphrag's own extraction: the dulce sample names two
    relationship sources that are no entity). The ingest goes on."""
    warnings = []
    for table, column, target, key in _REFERENCES:
        if table not in tables or target not in tables:
            continue
        values = tables[table].get_column(column)
        if values.dtype == pl.List(pl.String):
            values = values.explode()
        distinct = values.drop_nulls().unique(maintain_order=True)
        missing = distinct.filter(~distinct.is_in(tables[target].get_column(key).implode()))
        if missing.len():
            examples = ", ".join(repr(v) for v in missing.head(3).to_list())
            warnings.append(f"{paths[table]}: table {table!r}: {missing.len()} distinct value(s) of column {column!r} match no {key!r} of table "
                            f"{target!r} (e.g. {examples}); searches do without what they point at")
    return warnings


def embedding_texts(table: str, frame: pl.DataFrame) -> list[str]:
    """The text graphrag embeds for each row of `table`."""
    if table == schema.ENTITIES:
        return (frame["title"].fill_null("") + ":" + frame["description"].fill_null("")).to_list()
    if table == schema.COMMUNITY_REPORTS:
        return frame["full_content"].fill_null("").to_list()
    if table == schema.TEXT_UNITS:
        return frame["text"].fill_null("").to_list()
    raise ValueError(f"table {table!r} has no vector column")


__all__: Sequence[str] = ["NormalizedIndex", "embedding_texts", "normalize", "polars_type"]
