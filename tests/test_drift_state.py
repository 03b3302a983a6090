"""DriftAction / QueryState: merging, ranking, token counts, serialization and graph export."""

from __future__ import annotations

import json
import random

import networkx as nx
import pytest

from drift_lance.drift.action import ActionAnswer, DriftAction, PrimerFoldAnswer
from drift_lance.drift.export import export_graph
from drift_lance.drift.state import QueryState
from drift_lance.errors import ConfigError


def _answered(query: str, score: float, follow_ups: list[str], calls: int = 1) -> DriftAction:
    action = DriftAction(query)
    action.apply_answer(ActionAnswer(response=f"answer to {query}", score=score, follow_up_queries=follow_ups))
    action.record_usage(llm_calls=calls, prompt_tokens=100 * calls, output_tokens=10 * calls)
    return action


def _small_state() -> tuple[QueryState, DriftAction]:
    state = QueryState()
    root = DriftAction.from_primer_folds(
        "Who leads Dulce?",
        [
            PrimerFoldAnswer(intermediate_answer="fold one", score=80, follow_up_queries=["Q1", "Q2"]),
            PrimerFoldAnswer(intermediate_answer="fold two", score=40, follow_up_queries=["Q3"]),
        ],
    )
    state.add_action(root)
    state.add_all_follow_ups(root, root.follow_ups)
    return state, root


def test_root_action_combines_primer_folds():
    _, root = _small_state()
    assert root.answer == "fold one\n\nfold two"
    assert root.score == 60
    assert root.follow_ups == ["Q1", "Q2", "Q3"]
    assert root.is_complete and not root.failed


def test_duplicate_follow_ups_merge_into_one_node_with_two_parents():
    state, root = _small_state()
    q1 = _answered("Q1", 70, ["Shared question", "shared   QUESTION "])
    q2 = _answered("Q2", 20, ["Shared question", "Q1"])
    for action in (q1, q2):
        state.add_action(action)
        state.add_all_follow_ups(action, action.follow_ups)
    # root + Q1..Q3 + one merged "shared question" node
    assert len(state) == 5
    shared = DriftAction("Shared question")
    parents = {p.query for p in state.graph.predecessors(state._node(shared))}
    assert parents == {"Q1", "Q2"}
    # Q2 -> Q1 re-links an existing node instead of adding a new one
    assert state.graph.has_edge(state._node(q2), state._node(q1))
    # the same follow-up twice from one parent gives a single edge
    assert state.graph.number_of_edges(state._node(q1), state._node(shared)) == 1


def test_merged_follow_up_keeps_the_answered_node():
    state, root = _small_state()
    q1 = state._node(DriftAction("Q1"))
    q1.apply_answer(ActionAnswer(response="done", score=50, follow_up_queries=[]))
    state.add_all_follow_ups(DriftAction("Q2"), ["q1"])  # "q1" equals "Q1" after normalisation
    assert state._node(DriftAction("q1")) is q1
    assert {a.query for a in state.find_incomplete_actions()} == {"Q2", "Q3"}


def test_rank_random_is_reproducible_with_a_seed_and_scorer_orders_by_parent_score():
    state, root = _small_state()
    q1 = state._node(DriftAction("Q1"))
    q1.apply_answer(ActionAnswer(response="a", score=90, follow_up_queries=["From Q1"]))
    q3 = state._node(DriftAction("Q3"))
    q3.apply_answer(ActionAnswer(response="b", score=10, follow_up_queries=["From Q3"]))
    state.add_all_follow_ups(q1, q1.follow_ups)
    state.add_all_follow_ups(q3, q3.follow_ups)

    first = [a.query for a in state.rank_incomplete_actions(rng=random.Random(7))]
    again = [a.query for a in state.rank_incomplete_actions(rng=random.Random(7))]
    assert first == again and sorted(first) == ["From Q1", "From Q3", "Q2"]

    ranked = [a.query for a in state.rank_incomplete_actions(scorer=state.parent_score)]
    # parents: From Q1 <- Q1 (90), Q2 <- root (60), From Q3 <- Q3 (10)
    assert ranked == ["From Q1", "Q2", "From Q3"]


def test_failed_action_is_complete_scores_minus_inf_and_serializes_as_valid_json():
    state, root = _small_state()
    bad = state._node(DriftAction("Q2"))
    bad.record_usage(llm_calls=1, prompt_tokens=50, output_tokens=5)
    bad.mark_failed("StructuredOutputError: not JSON")
    assert bad.is_complete and bad.failed and bad.score == float("-inf")
    graph = state.serialize(include_context=False)
    text = json.dumps(graph, allow_nan=False)  # raises on NaN / inf
    node = next(n for n in json.loads(text)["nodes"] if n["query"] == "Q2")
    assert node["score"] == "-inf"
    assert node["metadata"]["error"].startswith("StructuredOutputError")
    restored = QueryState.deserialize(json.loads(text))
    assert restored._node(DriftAction("Q2")).score == float("-inf")


def test_action_token_ct_sums_follow_up_actions_only():
    state, root = _small_state()
    for query, calls in (("Q1", 1), ("Q2", 2)):
        node = state._node(DriftAction(query))
        node.apply_answer(ActionAnswer(response="x", score=1, follow_up_queries=[]))
        node.record_usage(llm_calls=calls, prompt_tokens=100 * calls, output_tokens=10 * calls)
    assert state.action_token_ct() == {"llm_calls": 3, "prompt_tokens": 300, "output_tokens": 30}


def test_serialize_ids_are_stable_and_context_is_optional():
    state, root = _small_state()
    root.metadata["context_data"] = {"reports": [{"id": "r1", "title": "Report one"}]}
    root.metadata["context_text"] = "# Report one"
    graph, context_data, context_text = state.serialize(include_context=True)
    assert [n["id"] for n in graph["nodes"]] == [0, 1, 2, 3]
    assert [n["query"] for n in graph["nodes"]] == ["Who leads Dulce?", "Q1", "Q2", "Q3"]
    assert [n["depth"] for n in graph["nodes"]] == [0, 1, 1, 1]
    assert {(e["source"], e["target"]) for e in graph["edges"]} == {(0, 1), (0, 2), (0, 3)}
    assert context_data == {"Who leads Dulce?": {"reports": [{"id": "r1", "title": "Report one"}]}}
    assert context_text == {"Who leads Dulce?": "# Report one"}
    bare = state.serialize(include_context=False)
    assert "context_data" not in bare["nodes"][0]["metadata"]
    # a round trip keeps ids and edges
    assert QueryState.deserialize(json.loads(json.dumps(bare))).serialize(include_context=False) == bare
    assert state.serialize(include_context=False) == bare  # serializing twice gives the same ids


def test_depths_hold_when_a_follow_up_repeats_the_question():
    """A follow-up asking the user's question again merges into the root; every depth used to be
    null then (no node was left without parents), and the exported graph drew one column."""
    state, root = _small_state()
    q1 = state._node(DriftAction("Q1"))
    q1.apply_answer(ActionAnswer(response="x", score=1, follow_up_queries=["who leads  DULCE?", "Q4"]))
    state.add_all_follow_ups(q1, q1.follow_ups)
    graph = state.serialize(include_context=False)
    assert [(n["query"], n["depth"]) for n in graph["nodes"]] == [
        ("Who leads Dulce?", 0), ("Q1", 1), ("Q2", 1), ("Q3", 1), ("Q4", 2)
    ]


def test_export_json_graphml_and_html(tmp_path):
    state, root = _small_state()
    state._node(DriftAction("Q2")).mark_failed("TimeoutError: slow")
    graph = state.serialize(include_context=False)

    json_path = export_graph(graph, tmp_path / "g.json")
    assert json.loads(json_path.read_text()) == graph

    graphml = nx.read_graphml(export_graph(graph, tmp_path / "g.graphml"))
    assert graphml.number_of_nodes() == 4 and graphml.number_of_edges() == 3
    assert graphml.nodes["0"]["query"] == "Who leads Dulce?"
    assert graphml.nodes["0"]["score"] == 60.0  # a number, for tools that sort or colour by it
    assert "score" not in graphml.nodes["1"]  # not answered yet
    assert "score" not in graphml.nodes["2"] and "TimeoutError" in graphml.nodes["2"]["error"]

    page = export_graph(graph, tmp_path / "g.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")  # no CDN, works offline
    assert "Who leads Dulce?" in page and page.count('class="node"') == 4

    with pytest.raises(ConfigError, match=r"g\.png.*\.json"):
        export_graph(graph, tmp_path / "g.png")
