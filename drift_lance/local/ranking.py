"""Which records each section offers, in which order: graphrag 3.x's ranking rules on fetched rows.

All functions are pure (Polars frames or column lists / numpy in, ordered rows out) so they can be
tested on hand-made tables. Input order ties are broken by `human_readable_id`, which is the row
order of graphrag's parquet files (graphrag keeps its in-memory lists in that order). One exception
lives in the builder: an empty query's top-degree entities break ties by `id`, as graphrag's entity
reader groups them by id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from drift_lance._positions import ColumnLists

__all__ = [
    "RelationshipSteps",
    "membership_order",
    "rank_reports",
    "rank_text_units",
]

NOT_SELECTED = np.iinfo(np.int64).max


def membership_order(community_ids: Sequence[int]) -> list[int]:
    """The iteration order graphrag gives an entity's communities. graphrag aggregates membership
    into a Python set of community numbers (inserted in community-table order) and iterates it,
    and that order breaks ties between equally ranked reports. Equal numbers hash equally whether
    int or float, so a set built here in the same insertion order iterates identically."""
    return list(set(community_ids))


def rank_reports(
    selected_memberships: Sequence[Sequence[int]],
    reports: pl.DataFrame | ColumnLists,
    *,
    min_rank: float,
    max_level: int | None = None,
) -> list[dict[str, Any]]:
    """The reports of the selected entities' communities, as row dicts: ordered by how many selected
    entities belong to the community, then report rank (both descending; ties keep the order in which
    the communities were first seen), keeping reports with a rank >= `min_rank` and (given
    `max_level`) a level <= `max_level`.

    Plain Python on purpose: a few dozen reports per build, where a Polars join, sort and filter
    cost ~0.5 ms."""
    matches: dict[int, int] = {}
    for memberships in selected_memberships:
        for community in membership_order(memberships):
            matches[community] = matches.get(community, 0) + 1
    first_seen = {community: position for position, community in enumerate(matches)}
    columns = ColumnLists.of(reports)
    if not len(columns):  # an empty frame may have no columns at all
        return []
    names = list(columns.lists)
    levels = columns["level"] if max_level is not None else [None] * len(columns)
    kept = [
        dict(zip(names, values))
        for values, community, rank, level in zip(
            zip(*columns.lists.values()), columns["community"], columns["rank"], levels
        )
        if community in matches
        and rank is not None
        and rank >= min_rank
        and (max_level is None or (level is not None and level <= max_level))
    ]
    kept.sort(key=lambda r: (-matches[r["community"]], -r["rank"], first_seen[r["community"]]))
    return kept


@dataclass(slots=True)
class RelationshipStep:
    """The relationship records offered after adding entity number `step` (0-based)."""

    order: np.ndarray  # row positions into the candidate frame, in section order
    links: np.ndarray  # per candidate row: graphrag's `links` attribute as it stands (0 = unset)


class RelationshipSteps:
    """graphrag's relationship ranking, replayed as entities are added one at a time.

    For the first i+1 selected entities: in-network relationships (both ends selected) by rank,
    then out-of-network ones (one end selected) by `links` (how many selected entities the outside
    end is linked to), then rank, capped at top_k_relationships x (i+1). graphrag stores `links` on
    the shared relationship objects, so a relationship keeps the value from the last step in which it
    was out-of-network (it shows in the `links` column); `links` here carries that state.
    `links_memory` seeds it with values left by earlier builds (graphrag keeps them for the life of
    the context builder)."""

    def __init__(
        self,
        candidates: pl.DataFrame | ColumnLists,
        selected_titles: Sequence[str],
        *,
        ranking: str,
        top_k: int,
        links_memory: Mapping[str, int] | None = None,
    ):
        first_step: dict[str, int] = {}
        for step, title in enumerate(selected_titles):
            first_step.setdefault(title, step)
        candidates = ColumnLists.of(candidates)
        self._ids = candidates["id"]
        self.top_k = top_k
        self.n_selected = 0
        sources = candidates["source"]
        targets = candidates["target"]
        self._source_step = np.array([first_step.get(s, NOT_SELECTED) for s in sources], dtype=np.int64)
        self._target_step = np.array([first_step.get(t, NOT_SELECTED) for t in targets], dtype=np.int64)
        column = "combined_degree" if ranking == "rank" else "weight"
        # As Polars' cast to Float64 and fill_null(0.0) give it.
        self._rank = np.array([0.0 if value is None else float(value) for value in candidates[column]], dtype=np.float64)
        self._input_order = np.arange(len(candidates))
        self._source_codes, self._target_codes = _name_codes(sources, targets)
        self.links = np.zeros(len(candidates), dtype=np.int64)
        if links_memory:
            self.links[:] = [links_memory.get(rel_id, 0) for rel_id in self._ids]

    def links_state(self) -> dict[str, int]:
        """{relationship id: links} for every candidate that carries the attribute."""
        return {self._ids[i]: int(self.links[i]) for i in np.flatnonzero(self.links)}

    def step(self, index: int, n_selected: int) -> RelationshipStep:
        """Ranking once selected entities [0..index] are in (`n_selected` counts duplicates)."""
        src_in = self._source_step <= index
        tgt_in = self._target_step <= index
        in_network = np.flatnonzero(src_in & tgt_in)
        in_network = in_network[np.lexsort((self._input_order[in_network], -self._rank[in_network]))]
        out_network = np.flatnonzero(src_in ^ tgt_in)
        if len(out_network) > 1:
            self._update_links(out_network, src_in)
            # graphrag lists source-side matches before target-side ones, then sorts stably.
            group = (~src_in[out_network]).astype(np.int64)
            out_network = out_network[
                np.lexsort(
                    (
                        self._input_order[out_network],
                        group,
                        -self._rank[out_network],
                        -self.links[out_network],
                    )
                )
            ][: self.top_k * n_selected]
        return RelationshipStep(np.concatenate([in_network, out_network]), self.links.copy())

    def _update_links(self, out_network: np.ndarray, src_in: np.ndarray) -> None:
        outside_is_target = src_in[out_network]
        outside = np.where(outside_is_target, self._target_codes[out_network], self._source_codes[out_network])
        inside = np.where(outside_is_target, self._source_codes[out_network], self._target_codes[out_network])
        pairs = np.unique(np.stack([outside, inside], axis=1), axis=0)
        linked = np.bincount(pairs[:, 0], minlength=int(outside.max()) + 1)
        self.links[out_network] = linked[outside]


def _name_codes(sources: list[str], targets: list[str]) -> tuple[np.ndarray, np.ndarray]:
    codes: dict[str, int] = {}
    src = np.array([codes.setdefault(s, len(codes)) for s in sources], dtype=np.int64)
    tgt = np.array([codes.setdefault(t, len(codes)) for t in targets], dtype=np.int64)
    return src, tgt


def rank_text_units(
    entity_units: Sequence[Sequence[str]],
    entity_titles: Sequence[str],
    units: pl.DataFrame | ColumnLists,
    relationships: pl.DataFrame | ColumnLists,
) -> list[str]:
    """Text-unit ids in graphrag's source order: by the position of the first selected entity that
    cites the unit, then by how many of that entity's relationships the unit supports (descending),
    then citation order. `units` (id, relationship_ids) holds the units that exist; `relationships`
    (id, source, target, text_unit_ids) every relationship touching a selected entity.

    Plain Python on purpose: a few hundred ids per build, where Polars' per-call overhead dominates."""
    units = ColumnLists.of(units, ["id", "relationship_ids"])
    relationships = ColumnLists.of(relationships, ["id", "source", "target", "text_unit_ids"])
    unit_relationships = {unit_id: rel_ids or [] for unit_id, rel_ids in zip(units["id"], units["relationship_ids"])}
    touching: dict[str, list[tuple[str, list[str]]]] = {}
    columns = (relationships[name] for name in ("id", "source", "target", "text_unit_ids"))
    for rel_id, source, target, cited in zip(*columns):
        for title in {source, target}:
            touching.setdefault(title, []).append((rel_id, cited or []))
    ranked: list[tuple[int, int, int, str]] = []
    seen: set[str] = set()
    for position, (title, unit_ids) in enumerate(zip(entity_titles, entity_units)):
        entity_rels = touching.get(title, [])
        entity_rel_ids = {rel_id for rel_id, _ in entity_rels}
        for unit_id in unit_ids or ():
            if unit_id in seen or unit_id not in unit_relationships:
                continue
            seen.add(unit_id)
            ranked.append((position, -_supported(unit_id, unit_relationships[unit_id], entity_rels, entity_rel_ids), len(ranked), unit_id))
    return [unit_id for *_, unit_id in sorted(ranked)]


def _supported(unit_id: str, unit_rel_ids: list[str], entity_rels: list[tuple[str, list[str]]], entity_rel_ids: set[str]) -> int:
    """graphrag's count_relationships: the unit's relationship ids that belong to the entity, an id
    listed twice counted twice (graphrag sums over the unit's list, not a set); for a unit without
    relationship ids, the entity's relationships that cite the unit."""
    if unit_rel_ids:
        return sum(1 for rel_id in unit_rel_ids if rel_id in entity_rel_ids)
    return sum(1 for _, cited in entity_rels if unit_id in cited)
