"""The data of each Server-Sent Event of `POST /v1/search/stream`, as typed models: the stream
builds every payload from them, and the OpenAPI document lists their schemas (under
`x-sse-events` of the stream's `text/event-stream` response), so clients can type each event."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from drift_lance.drift.result import SearchResult
from drift_lance.service.backend import SearchEvent
from drift_lance.service.errors import ErrorResponse

__all__ = ["STREAM_EVENTS", "ActionEvent", "DoneEvent", "PrimerEvent", "TokenEvent", "add_stream_events", "done_event",
           "search_event"]


class _Event(BaseModel):
    # every field is sent, defaults too: the schemas say so (a generated client types none as optional)
    model_config = ConfigDict(extra="forbid", json_schema_serialization_defaults_required=True)


class PrimerEvent(_Event):
    """`primer`: DRIFT's primer is done (drift only)."""

    query: str = Field(description="the question the primer answered")
    score: float | None = Field(description="the primer's score; null when it had none")
    follow_ups: list[str] = Field(description="follow-up queries it proposed")
    reports: int = Field(description="community reports it read")


class ActionEvent(_Event):
    """`action`: one follow-up (a local search) completed (drift only)."""

    epoch: int = Field(description="follow-up round, from 1")
    query: str
    score: float | None = Field(description="the answer's score; null when it failed or had none")
    failed: bool
    follow_ups: list[str]


class TokenEvent(_Event):
    """`token`: the next piece of the answer."""

    text: str


class DoneEvent(_Event):
    """`done`: the last event of a finished search: LLM calls and tokens, equal to the blocking
    result's."""

    llm_calls: int
    prompt_tokens: int
    output_tokens: int
    llm_calls_categories: dict[str, int]
    prompt_tokens_categories: dict[str, int]
    output_tokens_categories: dict[str, int]
    failures: int = Field(0, description="DRIFT steps the answer had to do without (0: nothing was lost)")
    failures_categories: dict[str, int] = Field(default_factory=dict, description="those steps per stage")
    completion_time: float = Field(description="seconds")


# event name -> the model of its data; `error` (the last event of a failed search) is the JSON error body
STREAM_EVENTS: dict[str, type[BaseModel]] = {
    "primer": PrimerEvent, "action": ActionEvent, "token": TokenEvent, "done": DoneEvent, "error": ErrorResponse,
}


_EVENT_NAMES = {model: name for name, model in STREAM_EVENTS.items()}


def search_event(data: PrimerEvent | ActionEvent | TokenEvent) -> SearchEvent:
    """A progress event named by its model, so a name and its data cannot disagree."""
    return SearchEvent(_EVENT_NAMES[type(data)], data.model_dump())  # type: ignore[arg-type]


def done_event(result: SearchResult) -> dict[str, Any]:
    return DoneEvent.model_validate(result.model_dump(include=set(DoneEvent.model_fields))).model_dump()


def add_stream_events(openapi: dict[str, Any], path: str) -> None:
    """Put every event model into `openapi`'s components and name them, by event, in the stream
    response of `path`."""
    components = openapi.setdefault("components", {}).setdefault("schemas", {})
    for model in STREAM_EVENTS.values():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
        for name, definition in schema.pop("$defs", {}).items():
            components.setdefault(name, definition)
        components.setdefault(model.__name__, schema)
    media = openapi["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]
    media["x-sse-events"] = {event: {"$ref": f"#/components/schemas/{model.__name__}"} for event, model in STREAM_EVENTS.items()}
