"""`SearchResult`: what every search method (local, DRIFT) returns; JSON-serialisable.

Per-stage counts use graphrag's stage names: `build_context` (for DRIFT: the HyDE expansion),
`primer`, `action` (the follow-up local searches) and `reduce`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import date, datetime
from typing import Any

import numpy as np
import polars as pl
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["STAGES", "SearchResult", "to_jsonable"]

STAGES = ("build_context", "primer", "action", "reduce")


class SearchResult(BaseModel):
    """The answer of one search and what it cost; plain JSON types throughout (`model_dump()`,
    `model_dump_json()`).

    - `response`: the answer text (DRIFT with `reduce=False`: the action graph).
    - `context_data`: the records the model read. Local search: {section: [record, ...]}; DRIFT:
      {action query: {section: [record, ...]}}, the root (primer) query's entry holding the
      community reports the primer read. `context_text`: the context tables as sent (DRIFT: per
      action query).
    - `completion_time`: seconds. `llm_calls`, `prompt_tokens`, `output_tokens`: totals;
      `llm_calls_categories`, `prompt_tokens_categories`, `output_tokens_categories`: the same per
      stage (DRIFT: `build_context` = the HyDE call, `primer`, `action` = the follow-ups, `reduce`;
      local search: `build_context`, `response`).
    - `failures`, `failures_categories` (DRIFT): steps the answer had to do without, per stage.
    - `state` (DRIFT): the action graph, questions, answers and scores, without contexts.

    The repr leaves out `context_data`, `context_text` and `state` (tens of kilobytes).
    """

    # Serialised with every field (CLI --json, the service): its JSON schema says so, so a client
    # generated from the OpenAPI document types none of them as optional.
    model_config = ConfigDict(json_schema_serialization_defaults_required=True)

    response: str | dict[str, Any] | list[Any]
    # Local search: {section: [records]}. DRIFT: {action query: {section: [records]}}; the root
    # (primer) action's entry holds the community reports the primer read.
    context_data: dict[str, Any] = Field(default_factory=dict, repr=False)
    context_text: str | list[Any] | dict[str, Any] = Field("", repr=False)
    completion_time: float = 0.0  # seconds
    llm_calls: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    llm_calls_categories: dict[str, int] = Field(default_factory=dict)
    prompt_tokens_categories: dict[str, int] = Field(default_factory=dict)
    output_tokens_categories: dict[str, int] = Field(default_factory=dict)
    # DRIFT: steps the answer had to do without, per stage: a HyDE expansion that fell back to the
    # query (build_context), failed primer folds, failed or cut-off follow-ups. 0: nothing was lost.
    failures: int = 0
    failures_categories: dict[str, int] = Field(default_factory=dict)
    # DRIFT only: the action graph (QueryState.serialize(include_context=False)).
    state: dict[str, Any] | None = Field(None, repr=False)


def to_jsonable(value: Any) -> Any:
    """Recursively turn numpy / polars / datetime values into plain JSON types. Non-finite floats
    become strings ("-inf", "inf", "nan") so the output stays valid JSON."""
    if isinstance(value, (float, np.floating)):
        number = float(value)
        return number if math.isfinite(number) else _nonfinite_text(number)
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.ndarray):
        return [to_jsonable(item) for item in value.tolist()]
    jsonable = getattr(value, "__jsonable__", None)  # e.g. a context's SectionRecords: rows, no frames
    if callable(jsonable):
        return jsonable()
    if isinstance(value, Mapping):
        return {str(key): to_jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [to_jsonable(item) for item in value]
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, pl.DataFrame):
        records = value.to_dicts()
        # Context records are all strings (graphrag's record layout): nothing left to convert.
        return records if all(dtype == pl.String for dtype in value.dtypes) else to_jsonable(records)
    return str(value)


def _nonfinite_text(number: float) -> str:
    if math.isnan(number):
        return "nan"
    return "inf" if number > 0 else "-inf"
