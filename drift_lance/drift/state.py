"""`QueryState`: the DRIFT action graph (a `networkx.MultiDiGraph` of `DriftAction` nodes).

Edges go from an action to each follow-up it proposed. Serialization numbers nodes in insertion
order (the root is 0), so the same run always gives the same ids and a round trip keeps them.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

import networkx as nx

from drift_lance.drift.action import NEG_INF, DriftAction
from drift_lance.drift.result import to_jsonable

__all__ = ["QueryState", "Scorer"]

log = logging.getLogger(__name__)

Scorer = Callable[[DriftAction], float | None]


class QueryState:
    """The action graph of one DRIFT query: the root (the question, answered by the primer) and
    every follow-up question, with edges from each action to those it proposed. A SearchResult
    carries it serialized (`result.state`); `QueryState.deserialize(result.state)` rebuilds it."""

    def __init__(self) -> None:
        self.graph = nx.MultiDiGraph()
        # networkx hands back attributes, not the stored key object; we need the stored object so
        # that a merged duplicate updates the node already in the graph.
        self._index: dict[DriftAction, DriftAction] = {}

    def __len__(self) -> int:
        return self.graph.number_of_nodes()

    @property
    def root(self) -> DriftAction | None:
        return next(iter(self.graph.nodes), None)

    def add_action(self, action: DriftAction, metadata: dict[str, Any] | None = None) -> DriftAction:
        """Add `action` (or merge it into the equal node already there) and return the node."""
        node = self._index.setdefault(action, action)
        self.graph.add_node(node, **(metadata or {}))
        return node

    def relate_actions(self, parent: DriftAction, child: DriftAction, weight: float = 1.0) -> None:
        self.graph.add_edge(self.add_action(parent), self.add_action(child), weight=weight)

    def add_all_follow_ups(self, action: DriftAction, follow_ups: list[DriftAction] | list[str], weight: float = 1.0) -> None:
        """Add each follow-up as a node (duplicates merge into the existing node) with an edge from
        `action`. Blank follow-ups and a follow-up repeating the action's own query are skipped."""
        if not follow_ups:
            log.debug("no follow-up queries for action %r", action.query)
        for follow_up in follow_ups:
            if isinstance(follow_up, str):
                if not follow_up.strip():
                    continue
                follow_up = DriftAction(follow_up)
            if follow_up == action:
                continue
            node = self.add_action(follow_up)
            if not self.graph.has_edge(self.add_action(action), node):
                self.relate_actions(action, node, weight)

    def find_incomplete_actions(self) -> list[DriftAction]:
        """Open actions, in insertion order."""
        return [node for node in self.graph.nodes if not node.is_complete]

    def rank_incomplete_actions(self, scorer: Scorer | None = None, rng: random.Random | None = None) -> list[DriftAction]:
        """Open actions best first by `scorer` (None scores last; ties keep insertion order), or
        shuffled with `rng` (the reference's random order) when there is no scorer."""
        open_actions = self.find_incomplete_actions()
        if scorer is not None:
            def key(action: DriftAction) -> float:
                score = scorer(action)
                return NEG_INF if score is None else float(score)
            return sorted(open_actions, key=key, reverse=True)
        (rng or random.Random()).shuffle(open_actions)
        return open_actions

    def parent_score(self, action: DriftAction) -> float:
        """Scorer: the best score among the action's answered parents (-inf if none)."""
        node = self._node(action)
        if node is None:
            return NEG_INF
        return max((parent.sort_score for parent in self.graph.predecessors(node)), default=NEG_INF)

    def action_token_ct(self) -> dict[str, int]:
        """LLM calls and tokens spent by the follow-up actions (the root's primer calls are
        counted separately, under the `primer` stage)."""
        totals = {"llm_calls": 0, "prompt_tokens": 0, "output_tokens": 0}
        for action in self.graph.nodes:
            for key in totals:
                totals[key] += int(action.metadata.get(key, 0))
        return totals

    def serialize(self, include_context: bool = True) -> dict[str, Any] | tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """`{"nodes": [...], "edges": [...]}`; with `include_context`, a tuple of that, the
        context data per action query, and the context text per action query. Valid JSON:
        scores of failed actions are the string "-inf"."""
        ids = {node: index for index, node in enumerate(self.graph.nodes)}
        depths = self._depths(ids)
        nodes = [
            {
                **node.serialize(include_follow_ups=False, include_context=include_context),
                "id": ids[node],
                "depth": depths.get(ids[node]),
                **to_jsonable(dict(self.graph.nodes[node])),
            }
            for node in self.graph.nodes
        ]
        edges = [
            {"source": ids[u], "target": ids[v], "weight": to_jsonable(data.get("weight", 1.0))}
            for u, v, data in self.graph.edges(data=True)
        ]
        graph = {"nodes": nodes, "edges": edges}
        if not include_context:
            return graph
        return (graph, *self.contexts())

    def contexts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(context data, context text) per action query, for the actions that built a context."""
        context_data = {
            node.query: to_jsonable(node.metadata["context_data"])
            for node in self.graph.nodes
            if node.metadata.get("context_data")
        }
        context_text = {
            node.query: node.metadata["context_text"]
            for node in self.graph.nodes
            if node.metadata.get("context_text")
        }
        return context_data, context_text

    @classmethod
    def deserialize(cls, data: dict[str, Any]) -> QueryState:
        state = cls()
        by_id: dict[Any, DriftAction] = {}
        for node_data in data.get("nodes", []):
            fields = {k: v for k, v in node_data.items() if k not in ("id", "depth")}
            by_id[node_data["id"]] = state.add_action(DriftAction.deserialize(fields))
        for edge in data.get("edges", []):
            parent, child = by_id.get(edge["source"]), by_id.get(edge["target"])
            if parent is not None and child is not None:
                state.relate_actions(parent, child, float(edge.get("weight", 1.0)))
        return state

    # --- helpers ---
    def _node(self, action: DriftAction) -> DriftAction | None:
        """The stored node equal to `action` (possibly another object with the same query)."""
        return self._index.get(action)

    def _depths(self, ids: dict[DriftAction, int]) -> dict[int, int]:
        """Hops from the nearest root: the first node (the primer's) and any node without parents.
        The first node counts even with parents: a follow-up repeating the user's question merges
        into it, and then no node would be without parents."""
        roots = [node for index, node in enumerate(self.graph.nodes) if index == 0 or self.graph.in_degree(node) == 0]
        depths: dict[int, int] = {}
        frontier = roots
        level = 0
        while frontier:
            next_frontier = []
            for node in frontier:
                if ids[node] in depths:
                    continue
                depths[ids[node]] = level
                next_frontier.extend(self.graph.successors(node))
            frontier = next_frontier
            level += 1
        return depths

