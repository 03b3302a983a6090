"""The local-search context builder: graphrag 3.x's LocalSearchMixedContext on rows fetched from
LanceDB by key, so memory stays flat as the corpus grows.

One build = one ANN query on the entity vectors (oversampled x2 like graphrag), then one concurrent
round of exact key lookups (reports by community, relationships by source/target title, claims by
subject, text units by id), then the sections in graphrag's order and layout:

    [Conversation History] Reports | Entities, Relationships, claims | Sources

Budgets follow graphrag: `int(T * community_prop)` for reports, `int(T * (1 - community_prop -
text_unit_prop))` for the entity/relationship/claim block, `int(T * text_unit_prop)` for sources.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Protocol

import numpy as np
import polars as pl
import pyarrow as pa
from pydantic import ValidationError

from drift_lance import schema
from drift_lance._arguments import check_open_store, one_vector
from drift_lance._positions import ColumnLists, positions_by_value, positions_of, rows_at
from drift_lance.config import checked_config
from drift_lance.config.local import LocalSearchConfig
from drift_lance.errors import ConfigError, EmbeddingMismatchError, StoreError, did_you_mean
from drift_lance.local.history import ConversationHistory
from drift_lance.local.ranking import RelationshipSteps, rank_reports, rank_text_units
from drift_lance.local.render import (
    RenderedSection,
    SectionRecords,
    TokenCountCache,
    TokenCounter,
    render_csv_section,
    render_table_section,
)
from drift_lance.models.base import Embedder
from drift_lance.models.compat import check_embedding_compatibility
from drift_lance.models.tokens import Tokenizer, get_tokenizer
from drift_lance.store import IndexStore

__all__ = [
    "SECTIONS",
    "CandidateRows",
    "LocalContext",
    "LocalContextBuilder",
    "build_local_context",
    "check_embedder_compatible",
]

log = logging.getLogger(__name__)

SECTIONS = ("reports", "entities", "relationships", "claims", "sources")
OVERSAMPLE = 2  # graphrag asks the vector store for 2 x top_k entities and keeps every match
CLAIM_ATTRIBUTES = ("object_id", "status", "start_date", "end_date", "description")

_ENTITY_COLUMNS = [
    "id",
    "human_readable_id",
    "title",
    "description",
    "degree",
    "text_unit_ids",
    "community_ids",
    "community_levels",
]
_RELATIONSHIP_COLUMNS = [
    "id",
    "human_readable_id",
    "source",
    "target",
    "description",
    "weight",
    "combined_degree",
    "text_unit_ids",
]
_CLAIM_COLUMNS = ["human_readable_id", "subject_id", *CLAIM_ATTRIBUTES]
# Fetched for every candidate unit (ranking); the text itself only for the units that may fit.
_UNIT_RANKING_COLUMNS = ["id", "human_readable_id", "n_tokens", "relationship_ids"]
_UNIT_FETCH_SLACK = 2  # extra units fetched beyond the n_tokens estimate, to avoid a second trip
_RELATIONSHIP_ROW_COLUMNS = ("human_readable_id", "source", "target", "description", "weight")  # what a row prints
# What a build reads of its selected entities (_ENTITY_COLUMNS plus the membership selection adds).
_SELECTED_COLUMNS = ["id", "human_readable_id", "title", "description", "degree", "text_unit_ids", "membership"]
_LOOKUP_KEY_COLUMNS = ["title", "membership", "text_unit_ids"]  # what the row lookups are keyed by


@dataclass
class LocalContext:
    """What the LLM gets (`context_text`) and the records behind it, per section, with graphrag's
    record columns (all strings; `id` is the id shown in the text)."""

    context_text: str
    records: Mapping[str, pl.DataFrame]  # a SectionRecords from `build`: frames built on first access
    selected_entity_ids: list[str]
    tokenizer: Tokenizer | None = field(default=None, repr=False)
    llm_calls: int = 0  # context building calls no model
    prompt_tokens: int = 0
    output_tokens: int = 0
    _tokens: int | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        # The text is tens of kilobytes (a notebook cell would print it all): show its shape.
        return (f"LocalContext(context_text=<{len(self.context_text):,} chars>, records={self.records!r}, "
                f"selected_entity_ids=<{len(self.selected_entity_ids)} ids>)")

    @property
    def token_count(self) -> int:
        """Tokens of `context_text` (counted on first use)."""
        if self._tokens is None:
            self._tokens = (self.tokenizer or get_tokenizer()).count(self.context_text)
        return self._tokens

    def record_ids(self, section: str) -> list[str]:
        frame = self.records.get(section)
        return [] if frame is None or "id" not in frame.columns else frame["id"].to_list()

    def to_json(self) -> dict[str, Any]:
        """{"context_text": ..., "records": {section: [record, ...]}} for every section."""
        return {
            "context_text": self.context_text,
            "records": {name: self.records[name].to_dicts() for name in SECTIONS},
        }


def check_embedder_compatible(store: IndexStore, embedder: Embedder, table: str = schema.ENTITIES) -> None:
    """Raise EmbeddingMismatchError unless `embedder` makes vectors comparable with `table`'s."""
    info = store.manifest.vectors.get(table)
    if info is None:
        raise StoreError(f"{store.uri}: table {table!r} has no vectors in the manifest")
    check_embedding_compatibility(info, embedder, uri=store.uri)


class RowSource(Protocol):
    async def fetch(self, table: str, key: str, values: Sequence[Any], *, columns: Sequence[str] | None = None) -> pl.DataFrame: ...


class CandidateRows:
    """Rows fetched once for several builds (`LocalContextBuilder.prefetch`): a build's lookup picks
    its rows out of them. A lookup asking for keys or columns the prefetch did not cover (a build
    with other settings) goes to the store."""

    def __init__(
        self,
        store: IndexStore,
        frames: Mapping[tuple[str, str], pl.DataFrame],
        keys: Mapping[tuple[str, str], Sequence[Any]] | None = None,
    ):
        self.store = store
        self.frames = dict(frames)
        self.keys = {lookup: set(values) for lookup, values in (keys or {}).items()}  # what was looked up
        self._columns = {lookup: frozenset(frame.columns) for lookup, frame in self.frames.items()}  # asked ~5x a build
        self._positions: dict[tuple[str, str], dict[Any, list[int]]] = {}
        self._narrowed: dict[tuple[str, str, tuple[str, ...]], pl.DataFrame] = {}  # column subsets asked for
        self._lists: dict[tuple[str, str], ColumnLists] = {}  # each frame's columns as lists, for `pick`
        # Per column list: relationships by source and by target merged, as lists.
        self._merged: dict[tuple[str, ...], _MergedRelationships] = {}

    def _covers(self, table: str, key: str, values: Sequence[Any], columns: Sequence[str] | None) -> bool:
        held = self._columns.get((table, key))
        return (
            held is not None
            and columns is not None
            and held.issuperset(columns)
            and self.keys.get((table, key), set()).issuperset(values)
        )

    async def fetch(self, table: str, key: str, values: Sequence[Any], *, columns: Sequence[str] | None = None) -> pl.DataFrame:
        if not self._covers(table, key, values, columns):
            return await self.store.fetch(table, key, values, columns=columns)
        picked = self._picked(table, key, values)
        narrowed = self._narrowed.get((table, key, tuple(columns)))
        if narrowed is None:
            narrowed = self._narrowed[(table, key, tuple(columns))] = self.frames[(table, key)].select(list(columns))
        return rows_at(narrowed, picked)

    def pick(self, table: str, key: str, values: Sequence[Any], columns: Sequence[str]) -> ColumnLists | None:
        """The rows `fetch` would return, as column lists (what a build reads); None when the
        prefetch did not cover them."""
        if not self._covers(table, key, values, columns):
            return None
        lists = self._lists.get((table, key))
        if lists is None:  # once per lookup kind
            lists = self._lists[(table, key)] = ColumnLists.of(self.frames[(table, key)])
        return lists.pick(self._picked(table, key, values), columns)

    def _picked(self, table: str, key: str, values: Sequence[Any]) -> list[int]:
        positions = self._positions.get((table, key))
        if positions is None:  # once per lookup kind: later builds pick rows by position
            positions = self._positions[(table, key)] = positions_by_value(self.frames[(table, key)][key].to_list())
        return positions_of(positions, values)

    def relationship_lists(self, titles: Sequence[str], columns: Sequence[str]) -> ColumnLists | None:
        """Relationships whose source or target is in `titles`, each once, by human_readable_id: what
        a build gets from its by-source and by-target lookups concatenated, first row per id kept and
        sorted, picked out of the rows merged once for the prefetch. None when the prefetch did not
        cover these titles or columns."""
        picked = self._touching(titles, columns)
        return None if picked is None else self._merged[tuple(columns)].rows.pick(picked)

    def _touching(self, titles: Sequence[str], columns: Sequence[str]) -> list[int] | None:
        """Positions of the merged rows touching `titles`, in merged (human_readable_id) order."""
        rel = schema.RELATIONSHIPS
        if not (self._covers(rel, "source", titles, columns) and self._covers(rel, "target", titles, columns)):
            return None
        merged = self._merged.get(tuple(columns))
        if merged is None:
            # Merged once per prefetch, in Python: Polars' concat, unique and sort cost ~1 ms here.
            # Both frames are lookups of one table, so their columns have the same types.
            parts = [ColumnLists.of(self.frames[(rel, end)], columns) for end in ("source", "target")]
            both = ColumnLists({name: parts[0][name] + parts[1][name] for name in columns}, len(parts[0]) + len(parts[1]))
            order = _first_per_id(both["id"], both["human_readable_id"])
            merged = self._merged[tuple(columns)] = _MergedRelationships(both, order)
        # Ascending positions keep the merged order.
        return sorted(set(positions_of(merged.by_source, titles)).union(positions_of(merged.by_target, titles)))


class _MergedRelationships:
    """A prefetch's by-source and by-target relationship rows, merged (`order` picks them out of the
    two concatenated), with positions by end."""

    def __init__(self, concatenated: ColumnLists, order: list[int]):
        self.rows = concatenated.pick(order)
        self.by_source = positions_by_value(self.rows["source"])
        self.by_target = positions_by_value(self.rows["target"])


def _first_per_id(ids: list[Any], human_readable_ids: list[Any]) -> list[int]:
    """Positions of each id's first row, by human_readable_id (nulls first, ties in row order): what
    Polars' unique("id", keep="first", maintain_order=True) then sort("human_readable_id",
    maintain_order=True) keep."""
    first: dict[Any, int] = {}
    for position, value in enumerate(ids):
        first.setdefault(value, position)
    keys = human_readable_ids
    return sorted(first.values(), key=lambda p: (keys[p] is not None, 0 if keys[p] is None else keys[p]))


class LocalContextBuilder:
    """Builds graphrag-identical local-search contexts from an `IndexStore`.

    `build` takes per-call overrides of any `LocalSearchConfig` field (DRIFT passes its own
    budgets this way)."""

    def __init__(
        self, store: IndexStore, *, tokenizer: Tokenizer | None = None, config: LocalSearchConfig | Mapping[str, Any] | None = None
    ):
        if isinstance(store, (str, os.PathLike)):  # would fail at the first build, as an AttributeError
            raise ConfigError(f"store: expected an open store (`await open_store({str(store)!r})`), got the path itself")
        check_open_store(store)
        self.store = store
        self.config = checked_config(config, LocalSearchConfig, "config") or LocalSearchConfig()
        self._tokenizer = tokenizer
        # Only with carry_relationship_links: the `links` values graphrag leaves on its shared
        # relationship objects, which later builds print for relationships they never re-rank.
        self._links_memory: dict[str, int] = {}
        self._token_counts: dict[str, TokenCountCache] = {}  # per encoding name, shared by builds

    def resolve_config(self, overrides: Mapping[str, Any]) -> LocalSearchConfig:
        if not overrides:
            return self.config
        values = dict(overrides)
        if "top_k_mapped_entities" in values:
            values["top_k_entities"] = values.pop("top_k_mapped_entities")
        try:
            return LocalSearchConfig.model_validate({**self.config.model_dump(), **values})
        except ValidationError as exc:
            problems = "; ".join(_describe_problem(error) for error in exc.errors())
            raise ConfigError(f"local search settings: {problems}") from None

    def tokenizer_for(self, config: LocalSearchConfig) -> Tokenizer:
        return self._tokenizer or get_tokenizer(config.encoding)

    async def select_entities(self, vectors: np.ndarray, **overrides: Any) -> list[pl.DataFrame]:
        """The entities `build` would select for each query vector, from one batched store search
        (DRIFT maps a whole epoch of follow-ups at once); pass each to `build` as
        `selected_entities` together with its `query_vector`, and all of them to `prefetch`."""
        cfg = self.resolve_config(overrides)
        matrix = np.asarray(vectors, dtype=np.float32)
        for vector in matrix:
            self._check_vector(vector)
        found = await self.store.search_many(
            schema.ENTITIES, matrix, cfg.top_k_entities * OVERSAMPLE, columns=_ENTITY_COLUMNS
        )
        matched = _with_memberships([_without_similarity(frame) for frame in found], cfg.community_level)
        return [await self._select_entities("", None, cfg, matched=frame) for frame in matched]

    async def build(
        self,
        query: str,
        *,
        query_vector: np.ndarray | Sequence[float] | None = None,
        embedder: Embedder | None = None,
        conversation_history: Any = None,
        selected_entities: pl.DataFrame | None = None,
        candidates: CandidateRows | None = None,
        **overrides: Any,
    ) -> LocalContext:
        """The context for `query`. `selected_entities` (from `select_entities`, for the same vector
        and settings, no conversation history) skips the entity search and selection; `candidates`
        (from `prefetch` over those selections) answers the row lookups without asking the store."""
        if not isinstance(query, str):  # else an AttributeError from deep in the entity mapping
            raise ConfigError(f"query: must be text (str), got {type(query).__name__}")
        cfg = self.resolve_config(overrides)
        tokenizer = self.tokenizer_for(cfg)
        counter = TokenCounter(tokenizer, self._token_counts.setdefault(tokenizer.name, TokenCountCache()))
        history = ConversationHistory.from_any(conversation_history)

        mapping_text = query
        if history:
            # graphrag maps the query plus the previous user questions to entities.
            recent = history.recent_user_questions(cfg.conversation_history_max_turns)
            mapping_text = f"{query}\n" + "\n".join(recent)
        if selected_entities is None or history:
            vector = await self._query_vector(mapping_text, query_vector, embedder)
            selected_entities = await self._select_entities(mapping_text, vector, cfg)
        # The columns the sections read, each converted once (several sections read the same ones).
        selected = ColumnLists.of(selected_entities, _SELECTED_COLUMNS)

        parts: list[str] = []
        budget = cfg.max_context_tokens
        if history:
            history_text = history.render(
                counter=counter,
                max_turns=cfg.conversation_history_max_turns,
                user_turns_only=cfg.conversation_history_user_turns_only,
                max_tokens=budget,
                delimiter=cfg.column_delimiter,
                empty_header=cfg.reproduce_reference_defects,
            )
            if history_text.strip():
                parts.append(history_text)
                budget -= counter.count(history_text)

        rows: RowSource = candidates if candidates is not None else self.store
        fetched = await self._fetch_candidates(selected, cfg, rows)
        records: dict[str, RenderedSection] = {}

        reports = self._reports_section(selected, fetched, cfg, counter, max(int(budget * cfg.community_prop), 0))
        if reports.text.strip():
            parts.append(reports.text)
        records["reports"] = reports

        local_prop = 1 - cfg.community_prop - cfg.text_unit_prop
        local_text, local_records = self._local_block(selected, fetched, cfg, counter, max(int(budget * local_prop), 0))
        if local_text.strip():
            parts.append(local_text)
        records.update(local_records)

        sources = await self._sources_section(selected, fetched, cfg, counter, max(int(budget * cfg.text_unit_prop), 0), rows)
        if sources.text.strip():
            parts.append(sources.text)
        records["sources"] = sources

        return LocalContext(
            context_text="\n\n".join(parts),
            records=SectionRecords({name: records[name] for name in SECTIONS}),
            selected_entity_ids=selected["id"],
            tokenizer=tokenizer,
        )

    # ------------------------------------------------------------------ entity mapping

    async def _query_vector(
        self, text: str, query_vector: np.ndarray | Sequence[float] | None, embedder: Embedder | None
    ) -> np.ndarray | None:
        if query_vector is not None:
            vector = checked_query_vector(query_vector)
            self._check_vector(vector)
            return vector
        if text == "":
            return None  # graphrag: an empty query selects the highest-degree entities
        if embedder is None:
            raise ConfigError("local search needs a query vector or an embedder to map the query to entities")
        check_embedder_compatible(self.store, embedder)
        matrix = await embedder.embed([text], kind="query")
        vector = np.asarray(matrix, dtype=np.float32)[0]
        self._check_vector(vector, f"embedder {embedder.model_id!r} made a vector that")  # unknown dimension: checked here
        return vector

    def _check_vector(self, vector: np.ndarray, source: str = "query vector") -> None:
        if vector.size and not np.any(vector):
            raise EmbeddingMismatchError(f"{source} is all zeros: it has no direction to rank entities by")
        info = self.store.manifest.vectors.get(schema.ENTITIES)
        if info is not None and vector.shape[0] != info.dimension:
            raise EmbeddingMismatchError(
                f"{source} has dimension {vector.shape[0]} but table 'entities' of {self.store.uri} "
                f"holds {info.dimension}-d vectors (model {info.model!r})"
            )

    async def _select_entities(
        self, text: str, vector: np.ndarray | None, cfg: LocalSearchConfig, *, matched: pl.DataFrame | None = None
    ) -> pl.DataFrame:
        """Selected entities in graphrag's order: included names first, then the ANN matches that
        are members at `community_level` and not excluded. Duplicates are kept, as graphrag does.
        `matched`: ANN matches already kept and given their membership (`select_entities`)."""
        level = cfg.community_level
        if matched is None:
            if vector is not None:
                k = cfg.top_k_entities * OVERSAMPLE
                found = await self.store.search(schema.ENTITIES, vector, k, columns=_ENTITY_COLUMNS)
                matched = _without_similarity(found)
            else:
                matched = await self._top_degree_entities(cfg.top_k_entities, level)
            matched = _with_membership(matched, level)
        if cfg.exclude_entity_names:
            matched = matched.filter(~pl.col("title").is_in(cfg.exclude_entity_names))
        included = await self._included_entities(cfg.include_entity_names, level)
        return pl.concat([included, matched], how="vertical_relaxed") if len(included) else matched

    async def _top_degree_entities(self, k: int, level: int) -> pl.DataFrame:
        # Only three narrow columns are scanned; rows are fetched for the k winners.
        ranks = await self.store.scan(schema.ENTITIES, columns=["id", "human_readable_id", "degree", "community_levels"])
        # Ties in degree in graphrag's order: read_indexer_entities groups the entities by `id`,
        # which sorts them by id, and the empty-query branch then sorts stably by degree.
        ranks = ranks.filter(_eligible(level)).sort([pl.col("degree").fill_null(0), "id"], descending=[True, False])
        winners = ranks["id"].head(k).to_list()
        rows = await self.store.fetch(schema.ENTITIES, "id", winners, columns=_ENTITY_COLUMNS)
        return _in_key_order(rows, "id", winners)

    async def _included_entities(self, names: Sequence[str], level: int) -> pl.DataFrame:
        if not names:
            return pl.DataFrame()
        rows = await self.store.fetch(schema.ENTITIES, "title", list(names), columns=_ENTITY_COLUMNS)
        rows = _with_membership(rows.sort("human_readable_id"), level)
        return pl.concat([rows.filter(pl.col("title") == name) for name in names], how="vertical_relaxed")

    # ------------------------------------------------------------------ fetching

    async def prefetch(self, selections: Sequence[pl.DataFrame], **overrides: Any) -> CandidateRows:
        """Every row the builds over `selections` (from `select_entities`) will look up, in one round
        of store lookups for all of them (DRIFT's epoch: 4 queries instead of ~100 on a LanceDB-backed
        index). Pass the result to each `build` as `candidates`."""
        cfg = self.resolve_config(overrides)
        found = [selected for selected in selections if len(selected)]
        if not found:
            return CandidateRows(self.store, {})
        # The selections' key columns as lists, end to end: concatenating the frames went through
        # Polars' lazy engine (~1 ms an epoch) for three columns.
        parts = [ColumnLists.of(selected, _LOOKUP_KEY_COLUMNS) for selected in found]
        union = ColumnLists(
            {name: list(chain.from_iterable(part[name] for part in parts)) for name in _LOOKUP_KEY_COLUMNS},
            sum(len(part) for part in parts),
        )
        lookups = self._candidate_lookups(union, cfg, unit_columns=[*_UNIT_RANKING_COLUMNS, "text"])
        frames = await asyncio.gather(*(self._lookup(self.store, *lookup) for lookup in lookups))
        return CandidateRows(
            self.store,
            {(table, key): frame for (table, key, _, _), frame in zip(lookups, frames)},
            {(table, key): values for table, key, values, _ in lookups},
        )

    def _candidate_lookups(
        self, selected: pl.DataFrame | ColumnLists, cfg: LocalSearchConfig, *, unit_columns: list[str] = _UNIT_RANKING_COLUMNS
    ) -> list[tuple[str, str, list[Any], list[str]]]:
        """(table, key, values, columns) of the lookups for the selected entities' candidate rows:
        reports by community, relationships by source and by target title, claims by subject,
        text units by id."""
        selected = ColumnLists.of(selected, _LOOKUP_KEY_COLUMNS)
        titles = list(dict.fromkeys(selected["title"]))
        communities = sorted({c for members in selected["membership"] for c in members})
        unit_ids = list(dict.fromkeys(chain.from_iterable(u or () for u in selected["text_unit_ids"])))
        claims_active = cfg.include_claims and self.store.has_table(schema.COVARIATES)
        return [
            (schema.COMMUNITY_REPORTS, "community", communities, ["community", "level", "rank", "title", _report_content(cfg)]),
            (schema.RELATIONSHIPS, "source", titles, _RELATIONSHIP_COLUMNS),
            (schema.RELATIONSHIPS, "target", titles, _RELATIONSHIP_COLUMNS),
            (schema.COVARIATES, "subject_id", titles if claims_active else [], _CLAIM_COLUMNS),
            (schema.TEXT_UNITS, "id", unit_ids, unit_columns),
        ]

    async def _lookup(self, rows: RowSource, table: str, key: str, values: list[Any], columns: list[str]) -> pl.DataFrame:
        if not values or not self.store.has_table(table):
            return pl.DataFrame()
        return await rows.fetch(table, key, values, columns=columns)

    async def _lookup_lists(self, rows: RowSource, table: str, key: str, values: list[Any], columns: list[str]) -> ColumnLists:
        """`_lookup` as column lists: picked straight from prefetched rows when they cover it."""
        picked = rows.pick(table, key, values, columns) if values and isinstance(rows, CandidateRows) else None
        return picked if picked is not None else ColumnLists.of(await self._lookup(rows, table, key, values, columns))

    async def _fetch_candidates(self, selected: ColumnLists, cfg: LocalSearchConfig, rows: RowSource) -> dict[str, ColumnLists]:
        """Every candidate row the sections rank, in one round of key lookups (concurrent when they
        go to the store), as column lists. Reports are not yet filtered by level (the ranking does it)."""
        reports_lookup, by_source_lookup, by_target_lookup, claims_lookup, units_lookup = self._candidate_lookups(selected, cfg)
        relationships = None
        if isinstance(rows, CandidateRows):
            # Picks from memory: awaited in turn, no task per lookup (~0.4 ms per build with tasks);
            # relationships out of the by-source and by-target rows merged once per prefetch.
            reports, units = [await self._lookup_lists(rows, *lookup) for lookup in (reports_lookup, units_lookup)]
            claims = await self._lookup(rows, *claims_lookup)
            _, _, titles, columns = by_source_lookup
            relationships = rows.relationship_lists(titles, columns)
            by_end = []
            if relationships is None:  # titles or columns the prefetch did not cover
                by_end = [await self._lookup(rows, *lookup) for lookup in (by_source_lookup, by_target_lookup)]
        else:
            lookups = (reports_lookup, claims_lookup, units_lookup, by_source_lookup, by_target_lookup)
            reports_rows, claims, units_rows, *by_end = await asyncio.gather(*(self._lookup(rows, *lookup) for lookup in lookups))
            reports, units = ColumnLists.of(reports_rows), ColumnLists.of(units_rows)
        if relationships is None:
            found = [frame for frame in by_end if len(frame)]
            relationships = ColumnLists.of(
                pl.concat(found, how="vertical_relaxed").unique("id", keep="first").sort("human_readable_id")
                if found
                else _empty_relationships()
            )
        return {
            "reports": reports,
            "relationships": relationships,
            "claims": ColumnLists.of(claims.sort("human_readable_id") if len(claims) else claims),
            "units": units,
        }

    # ------------------------------------------------------------------ sections

    def _reports_section(
        self, selected: ColumnLists, fetched: dict[str, ColumnLists], cfg: LocalSearchConfig, counter: TokenCounter, budget: int
    ) -> RenderedSection:
        header = ["id", "title", "summary" if cfg.use_community_summary else "content"]
        if cfg.include_community_rank:
            header.append("rank")
        if len(selected) == 0 or self._table_rows(schema.COMMUNITY_REPORTS) == 0:
            return RenderedSection("", header)
        reports = fetched["reports"]
        ranked = (
            rank_reports(
                selected["membership"], reports, min_rank=cfg.min_community_rank, max_level=cfg.community_level
            )
            if len(reports)
            else []
        )
        content = _report_content(cfg)

        def rows() -> Iterator[list[str]]:
            for report in ranked:
                row = [str(report["community"]), _text(report["title"]), _text(report[content])]
                if cfg.include_community_rank:
                    row.append(str(report["rank"]))
                yield row

        # With the rank column shown, graphrag re-sorts the reports that fit by rank alone
        # (_rank_report_context), so the community-match order no longer shows in the text.
        section = render_csv_section(
            cfg.community_context_name, header, rows(), budget=budget, counter=counter, delimiter=cfg.column_delimiter,
            reorder=_by_rank_as_graphrag if cfg.include_community_rank else None,
        )
        if not section.rows and cfg.reproduce_reference_defects:
            section.text = "[]"  # graphrag 3.x writes str([]) when no report fits
        return section

    def _local_block(
        self, selected: ColumnLists, fetched: dict[str, ColumnLists], cfg: LocalSearchConfig, counter: TokenCounter, budget: int
    ) -> tuple[str, dict[str, RenderedSection]]:
        """Entities, then relationships and claims grown one selected entity at a time until the
        block would exceed `budget` (the last state that fits is kept)."""
        delimiter = cfg.column_delimiter
        entity_header = ["id", "entity", "description"] + ([cfg.rank_description] if cfg.include_entity_rank else [])
        relationship_header = ["id", "source", "target", "description"] + (["weight"] if cfg.include_relationship_weight else [])
        claim_header = ["id", "entity", *CLAIM_ATTRIBUTES]
        empty = {
            "entities": RenderedSection("", entity_header),
            "relationships": RenderedSection("", relationship_header),
            "claims": RenderedSection("", claim_header),
        }
        if len(selected) == 0:
            return "", empty

        entities = render_table_section(
            "Entities", entity_header, _entity_rows(selected, cfg), budget=budget, counter=counter, delimiter=delimiter
        )
        bare_entities = not entities.rows and not cfg.reproduce_reference_defects
        if bare_entities and entities.tokens >= budget:
            return "", empty  # not even a relationship or claim row can fit beside the header

        titles = selected["title"]
        claims_active = cfg.include_claims and self.store.has_table(schema.COVARIATES)
        claims_by_subject = _group_claims(fetched["claims"]) if claims_active else {}
        any_claims = claims_active and self._table_rows(schema.COVARIATES) > 0
        relationships = fetched["relationships"]
        steps = RelationshipSteps(
            relationships,
            titles,
            ranking=cfg.relationship_ranking_attribute,
            top_k=cfg.top_k_relationships,
            links_memory=self._links_memory if cfg.carry_relationship_links else None,
        )

        # Row tuples once: each step re-renders a prefix of them.
        relationship_rows = list(zip(*(relationships[name] for name in _RELATIONSHIP_ROW_COLUMNS)))
        kept_parts: list[str] = []
        kept: dict[str, RenderedSection] = {}
        for index in range(len(titles)):
            step = steps.step(index, index + 1)
            rel_section = self._relationship_section(relationship_rows, step.order, step.links, relationship_header, budget, counter, delimiter)
            parts = [rel_section.text]
            total = entities.tokens + rel_section.tokens
            current = {"relationships": rel_section}
            if claims_active:
                claim_section = (
                    render_table_section(
                        "claims",
                        claim_header,
                        chain.from_iterable(claims_by_subject.get(t, ()) for t in titles[: index + 1]),
                        budget=budget,
                        counter=counter,
                        delimiter=delimiter,
                    )
                    if any_claims
                    else RenderedSection("", claim_header)
                )
                parts.append(claim_section.text)
                total += claim_section.tokens
                current["claims"] = claim_section
            if total > budget:
                break
            kept_parts, kept = parts, current
        if cfg.carry_relationship_links:
            self._links_memory.update(steps.links_state())

        records = dict(empty)
        records["entities"] = entities
        for name, section in kept.items():
            records[name] = section
        if bare_entities:
            # graphrag prints the Entities header without rows; the relationships and claims that
            # fit beside it are kept (a long entity description must not drop a short relationship).
            if not any(section.rows for section in kept.values()):
                return "", empty
            return "\n\n".join(part for part in kept_parts if part), records
        return entities.text + "\n\n" + "\n\n".join(kept_parts), records

    def _relationship_section(
        self,
        frame: list[tuple[Any, ...]],
        order: np.ndarray,
        links: np.ndarray,
        header: list[str],
        budget: int,
        counter: TokenCounter,
        delimiter: str,
    ) -> RenderedSection:
        if len(order) == 0:
            return RenderedSection("", header)
        with_weight = "weight" in header
        # graphrag adds a `links` column when the first record carries a links attribute.
        with_links = bool(links[order[0]])
        full_header = header + (["links"] if with_links else [])
        picked_links = links[order].tolist()

        def rows() -> Iterator[list[str]]:
            for position, link in zip(order.tolist(), picked_links):
                hrid, source, target, description, weight = frame[position]
                row = [_short_id(hrid), source, target, _text(description)]
                if with_weight:
                    row.append(str(weight) if weight else "")
                if with_links:
                    row.append(str(link) if link else "")
                yield row

        return render_table_section("Relationships", full_header, rows(), budget=budget, counter=counter, delimiter=delimiter)

    async def _sources_section(
        self,
        selected: ColumnLists,
        fetched: dict[str, ColumnLists],
        cfg: LocalSearchConfig,
        counter: TokenCounter,
        budget: int,
        rows_source: RowSource,
    ) -> RenderedSection:
        header = ["id", "text"]
        units = fetched["units"]
        if len(selected) == 0 or len(units) == 0:
            return RenderedSection("", header)
        ranked = rank_text_units(selected["text_unit_ids"], selected["title"], units, fetched["relationships"])
        if not ranked:
            return RenderedSection("", header)
        unit_ids = units["id"]
        short_ids = dict(zip(unit_ids, units["human_readable_id"]))
        estimates = dict(zip(unit_ids, units["n_tokens"]))  # None counts as 0
        texts: dict[str, str] = {}
        fetch_upto = _estimated_fit(ranked, estimates, budget)
        delimiter = _sources_delimiter(cfg)
        while True:
            missing = [u for u in ranked[:fetch_upto] if u not in texts]
            if missing:
                rows = await self._lookup_lists(rows_source, schema.TEXT_UNITS, "id", missing, ["id", "text"])
                texts.update(zip(rows["id"], rows["text"]))
            section = render_table_section(
                "Sources",
                header,
                ([_short_id(short_ids[u]), _text(texts.get(u))] for u in ranked[:fetch_upto]),
                budget=budget,
                counter=counter,
                delimiter=delimiter,
            )
            # Done when a unit did not fit, or every ranked unit was offered.
            if len(section.rows) < fetch_upto or fetch_upto >= len(ranked):
                return section
            fetch_upto = min(len(ranked), fetch_upto * 2)

    def _table_rows(self, table: str) -> int:
        info = self.store.manifest.tables.get(table)
        return info.rows if info is not None else 0


async def build_local_context(
    store: IndexStore,
    query: str,
    *,
    query_vector: np.ndarray | Sequence[float] | None = None,
    embedder: Embedder | None = None,
    conversation_history: Any = None,
    tokenizer: Tokenizer | None = None,
    **params: Any,
) -> LocalContext:
    """One-shot context build; `params` are `LocalSearchConfig` fields (graphrag's names)."""
    builder = LocalContextBuilder(store, tokenizer=tokenizer)
    return await builder.build(
        query, query_vector=query_vector, embedder=embedder, conversation_history=conversation_history, **params
    )


# ---------------------------------------------------------------------- helpers


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def _short_id(value: Any) -> str:
    return "" if value is None else str(value)


def _eligible(level: int) -> pl.Expr:
    """graphrag drops entities whose every community is deeper than `level` (entities without any
    community stay)."""
    levels = pl.col("community_levels").fill_null([])
    return (levels.list.len() == 0) | (levels.list.eval(pl.element() <= level).list.any())


def _with_membership(frame: pl.DataFrame, level: int) -> pl.DataFrame:
    """Keep eligible entities and add `membership`: their communities at levels <= `level`, in
    stored (community-table) order."""
    return _with_memberships([frame], level)[0]


def _with_memberships(frames: Sequence[pl.DataFrame], level: int) -> list[pl.DataFrame]:
    """`_with_membership` of each frame, with one Arrow conversion for all of them (an epoch's 20
    selections: the conversion was ~half of each selection's cost)."""
    # Plain Python over a few dozen rows: a list.eval filter costs more than the whole loop.
    kept_frames, memberships = [], []
    for frame in frames:
        keep = []
        for ids, levels in zip(frame["community_ids"].to_list(), frame["community_levels"].to_list()):
            levels = levels or ()
            eligible = not levels or any(lvl is not None and lvl <= level for lvl in levels)
            keep.append(eligible)
            if eligible:
                memberships.append([c for c, lvl in zip(ids or (), levels) if lvl is not None and lvl <= level])
        kept_frames.append(frame if all(keep) else rows_at(frame, [index for index, kept in enumerate(keep) if kept]))
    # Through Arrow and hstack: a nested pl.Series from Python lists plus with_columns cost ~0.35 ms.
    membership = pl.from_arrow(pa.array(memberships, type=pa.list_(pa.int64())))
    assert isinstance(membership, pl.Series)
    out, start = [], 0
    for frame in kept_frames:
        out.append(frame.hstack([membership.slice(start, frame.height).alias("membership")]))
        start += frame.height
    return out


def _describe_problem(error: Mapping[str, Any]) -> str:
    """One validation problem: the field, the message and the value given. A rule across fields
    (community_prop + text_unit_prop) has no field and its message already names the values;
    its input is the whole settings dict, which is not repeated. The overrides are `build` / `search`
    keyword arguments or `drift-lance context --set`, so neither is named."""
    loc = error["loc"]
    if not loc:
        return str(error["msg"]).removeprefix("Value error, ")
    field = ".".join(map(str, loc))
    if error["type"] == "extra_forbidden":  # a misspelt keyword argument
        return f"{field}: unknown setting{did_you_mean(field, LocalSearchConfig.model_fields)}"
    return f"{field}: {error['msg']}, got {error['input']!r}"


def _report_content(cfg: LocalSearchConfig) -> str:
    """The report column the reports section prints (and so the one its lookup fetches)."""
    return "summary" if cfg.use_community_summary else "full_content"


def _without_similarity(frame: pl.DataFrame) -> pl.DataFrame:
    # Column indexing, not `drop`: no trip through the lazy engine (~15 us instead of ~60 us).
    return frame[[name for name in frame.columns if name != "_similarity"]]


def _empty_relationships() -> pl.DataFrame:
    frame = pl.from_arrow(schema.table_schema(schema.RELATIONSHIPS).empty_table().select(_RELATIONSHIP_COLUMNS))
    assert isinstance(frame, pl.DataFrame)
    return frame


def _in_key_order(frame: pl.DataFrame, key: str, keys: Sequence[Any]) -> pl.DataFrame:
    position = {k: i for i, k in enumerate(keys)}
    return frame.with_columns(pl.col(key).replace_strict(position, return_dtype=pl.Int64).alias("_pos")).sort("_pos").drop("_pos")


def _entity_rows(selected: ColumnLists, cfg: LocalSearchConfig) -> Iterator[list[str]]:
    names = ["human_readable_id", "title", "description"] + (["degree"] if cfg.include_entity_rank else [])
    for hrid, title, description, *degree in zip(*(selected[name] for name in names)):
        row = [_short_id(hrid), title, _text(description)]
        if degree:
            row.append(str(degree[0]))  # graphrag prints the rank as is ("None" when missing)
        yield row


def _group_claims(claims: ColumnLists) -> dict[str, list[list[str]]]:
    """Claim rows per subject title, in table order."""
    grouped: dict[str, list[list[str]]] = {}
    if not len(claims):  # no lookup: no columns either
        return grouped
    columns = zip(*(claims[name] for name in ("human_readable_id", "subject_id", *CLAIM_ATTRIBUTES)))
    for hrid, subject, *attributes in columns:
        row = [_short_id(hrid), subject, *(str(value) if value else "" for value in attributes)]
        grouped.setdefault(subject, []).append(row)
    return grouped


def _by_rank_as_graphrag(rows: list[list[str]]) -> list[list[str]]:
    """Report rows (rank last) in the order graphrag's `sort_values("rank", ascending=False)` gives:
    pandas argsorts the reversed column with numpy's quicksort and reverses the result. That sort is
    not stable (equal ranks can swap), so it is replayed as is rather than as a stable sort."""
    reversed_ranks = np.array([float(row[-1]) for row in reversed(rows)])
    order = (len(rows) - 1 - np.argsort(reversed_ranks, kind="quicksort"))[::-1]
    return [rows[i] for i in order]


def _sources_delimiter(cfg: LocalSearchConfig) -> str:
    """graphrag 3.x never passes column_delimiter to its Sources section, which is always
    "|"-separated; only reproduce_reference_defects copies that."""
    return "|" if cfg.reproduce_reference_defects else cfg.column_delimiter


def _estimated_fit(ranked: list[str], estimates: dict[str, int | None], budget: int) -> int:
    """How many ranked units to fetch text for: those whose stored n_tokens fit, plus slack."""
    used, count = 0, 0
    for unit in ranked:
        used += estimates.get(unit) or 0
        count += 1
        if used > budget:
            break
    return min(len(ranked), max(1, count + _UNIT_FETCH_SLACK))


def checked_query_vector(value: object) -> np.ndarray:
    """`query_vector` as one flat float32 vector. numpy would turn text into a ValueError, drop a
    complex part, read booleans as 0/1 and flatten several rows into one long vector, and a NaN
    would fail in the store naming a table: each is a ConfigError naming the argument instead."""
    array = one_vector(value, "query_vector")  # an embedder's one-row matrix is fine
    with np.errstate(over="ignore"):  # a float64 beyond float32's range becomes inf, reported below
        vector = array.astype(np.float32)
    if not np.all(np.isfinite(vector)):
        raise ConfigError("query_vector: contains NaN or inf (or a value beyond float32's range)")
    return vector
