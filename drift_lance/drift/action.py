"""`DriftAction`: one question in the DRIFT graph, its answer, score and follow-ups.

Actions are equal (and hash) by their normalised query (whitespace collapsed, case folded), so the
same follow-up proposed twice becomes one node of the `QueryState` graph with two parents.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, Field

from drift_lance.drift.result import to_jsonable

__all__ = ["ActionAnswer", "DriftAction", "PrimerFoldAnswer", "normalize_query"]

NEG_INF = float("-inf")


# Field order is generation order for schema- or grammar-constrained models: the short fields come
# first, so an answer cut off by an output-token cap loses the end of its text, not its score and
# follow-ups (the structured-output layer closes the cut string).


def _question_list(value: Any) -> Any:
    """Follow-up questions as models write them: one question as a bare string, null for none, and
    stray non-text items dropped, instead of losing the whole answer over its questions."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, str)]
    return value


QuestionList = Annotated[list[str], BeforeValidator(_question_list)]


class ActionAnswer(BaseModel):
    """Structured output of one follow-up (local search) call."""

    score: float = Field(description="0-100: how well the answer helps with the overall question.")
    follow_up_queries: QuestionList = Field(default_factory=list)
    response: str = Field(description="The answer, formatted in markdown.")


class PrimerFoldAnswer(BaseModel):
    """Structured output of one primer call (one fold of community reports)."""

    score: float
    follow_up_queries: QuestionList = Field(default_factory=list)
    intermediate_answer: str


def normalize_query(query: str) -> str:
    return " ".join(query.split()).casefold()


# Follow-up questions kept per answer, at least: a bound against a model that lists without end, not
# a choice of questions (graphrag keeps every one, and the primer prompt asks for "at least" k).
_FOLLOW_UPS_KEPT = 100


def follow_ups_kept(drift_k_followups: int) -> int:
    """How many of one answer's follow-up questions join the graph: the first max(k, 100). A model
    listing 10^5 per answer made 10^6 graph nodes in two epochs (3 GB, the event loop held 25 s)."""
    return max(drift_k_followups, _FOLLOW_UPS_KEPT)


def _questions(proposed: Iterable[str], limit: int | None) -> list[str]:
    """The first `limit` non-blank questions, stripped."""
    questions = (q.strip() for q in proposed if q and q.strip())
    return list(itertools.islice(questions, limit))


def _empty_usage() -> dict[str, Any]:
    return {"llm_calls": 0, "prompt_tokens": 0, "output_tokens": 0}


class DriftAction:
    """A question with (once run) an answer, a score and follow-up questions.

    `metadata` holds `llm_calls`, `prompt_tokens`, `output_tokens`, and once run `context_data`
    ({section: [records]}) and `context_text`; a failed action has `error` and score -inf.
    """

    __slots__ = ("query", "answer", "score", "follow_ups", "metadata", "_key")

    def __init__(
        self,
        query: str,
        answer: str | None = None,
        follow_ups: list[str] | None = None,
        score: float | None = None,
        metadata: dict[str, Any] | None = None,
    ):
        if not query or not query.strip():
            raise ValueError("a DRIFT action needs a non-empty query")
        self.query = query.strip()
        self.answer = answer
        self.score = score
        self.follow_ups: list[str] = list(follow_ups or [])
        self.metadata: dict[str, Any] = {**_empty_usage(), **(metadata or {})}
        self._key = normalize_query(self.query)

    # --- state ---
    @property
    def failed(self) -> bool:
        return "error" in self.metadata

    @property
    def is_complete(self) -> bool:
        """Answered, or tried and failed (failed actions are not retried)."""
        return self.answer is not None or self.failed

    @property
    def sort_score(self) -> float:
        return NEG_INF if self.score is None or math.isnan(self.score) else self.score

    # --- updates ---
    def record_usage(self, *, llm_calls: int, prompt_tokens: int, output_tokens: int) -> None:
        self.metadata["llm_calls"] += llm_calls
        self.metadata["prompt_tokens"] += prompt_tokens
        self.metadata["output_tokens"] += output_tokens

    def apply_answer(self, answer: ActionAnswer, max_follow_ups: int | None = None) -> None:
        self.answer = answer.response
        self.score = float(answer.score)
        self.follow_ups = _questions(answer.follow_up_queries, max_follow_ups)

    def mark_failed(self, error: str) -> None:
        """A failed call or unusable answer: the search goes on without this action's answer."""
        self.score = NEG_INF
        self.follow_ups = []
        self.metadata["error"] = error

    def compute_score(self, scorer: Callable[[DriftAction], float | None]) -> None:
        score = scorer(self)
        self.score = NEG_INF if score is None else float(score)

    # --- construction ---
    @classmethod
    def from_primer_folds(cls, query: str, folds: list[PrimerFoldAnswer], metadata: Mapping[str, Any] | None = None,
                          max_follow_ups: int | None = None) -> DriftAction:
        """The root action: fold answers joined, follow-ups concatenated (the first `max_follow_ups`
        of each fold), mean score."""
        if not folds:
            raise ValueError("the primer produced no answers")
        return cls(
            query,
            answer="\n\n".join(fold.intermediate_answer for fold in folds),
            follow_ups=[q for fold in folds for q in _questions(fold.follow_up_queries, max_follow_ups)],
            score=sum(float(fold.score) for fold in folds) / len(folds),
            metadata=dict(metadata or {}),
        )

    # --- serialization ---
    def serialize(self, include_follow_ups: bool = True, include_context: bool = True) -> dict[str, Any]:
        """JSON-ready dict. A non-finite score is written as a string ("-inf"), None as null."""
        metadata = self.metadata if include_context else {
            key: value for key, value in self.metadata.items() if key not in ("context_data", "context_text")
        }
        data: dict[str, Any] = {
            "query": self.query,
            "answer": self.answer,
            "score": to_jsonable(self.score),
            "metadata": to_jsonable(metadata),
        }
        if include_follow_ups:
            data["follow_ups"] = list(self.follow_ups)
        return data

    @classmethod
    def deserialize(cls, data: Mapping[str, Any]) -> DriftAction:
        score = data.get("score")
        return cls(
            data["query"],
            answer=data.get("answer"),
            follow_ups=list(data.get("follow_ups") or []),
            score=float(score) if score is not None else None,  # float("-inf") parses "-inf"
            metadata=dict(data.get("metadata") or {}),
        )

    # --- identity ---
    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DriftAction) and self._key == other._key

    def __repr__(self) -> str:
        state = "failed" if self.failed else ("done" if self.answer is not None else "open")
        return f"DriftAction({self.query!r}, {state}, score={self.score})"
