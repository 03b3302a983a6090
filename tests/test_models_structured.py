"""JSON extraction and repair for small models' structured answers, and strict-schema requests."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from drift_lance.models import StructuredOutputError
from drift_lance.models.structured import extract_json, parse_structured, strict_json_schema


class Finding(BaseModel):
    summary: str
    explanation: str = ""


class Report(BaseModel):
    title: str
    rating: float
    findings: list[Finding]


class Loose(BaseModel):
    scores: dict[str, int]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"a": 1}', {"a": 1}),
        ('Here you go:\n```json\n{"a": 1}\n```\nHope it helps', {"a": 1}),
        ("```\n{\"a\": [1, 2]}\n```", {"a": [1, 2]}),
        ('The answer is {"a": {"b": "}"}} as requested.', {"a": {"b": "}"}}),
        ('{"a": 1, "b": [1, 2,],}', {"a": 1, "b": [1, 2]}),
        ("{'a': 'it\\'s', 'b': \"say \\\"hi\\\"\"}", {"a": "it's", "b": 'say "hi"'}),
        ('{"ok": True, "none": None, "no": False}', {"ok": True, "none": None, "no": False}),
        ('{"text": "line one\nline two"}', {"text": "line one\nline two"}),
        ('{"a": 1, "b": {"c": [1, 2', {"a": 1, "b": {"c": [1, 2]}}),
        ('{"a": "unterminated', {"a": "unterminated"}),
        ('{"a": 1, "b":', {"a": 1, "b": None}),
        ('{"a": 1, "b": "x", "c', {"a": 1, "b": "x"}),
        ('{"a": 1} // trailing comment', {"a": 1}),
        ('[{"a": 1}, {"a": 2}]', [{"a": 1}, {"a": 2}]),
        # a reasoning model's thoughts first (JSON-like text in them is not the answer), or cut off
        ('<think>maybe {"a": 0}?</think>\n{"a": 1}', {"a": 1}),
        ('<think>still thinking {"a": 0', None),
        ('\n<think>a</think>\n<think>b {"a": 0}</think>\n{"a": 1}', {"a": 1}),
        # "<think>" after the reasoning is the answer's own text, never cut
        ('{"a": "the tag <think> in HTML"}', {"a": "the tag <think> in HTML"}),
        ('<think>hm</think>{"a": "<think>x</think> kept"}', {"a": "<think>x</think> kept"}),
        ('Sure:\n```json\n{"a": "the tag <think> in HTML"}\n```', {"a": "the tag <think> in HTML"}),
        ('{"a": "cut at <think> and', {"a": "cut at <think> and"}),
    ],
)
def test_extract_json_repairs(text, expected):
    if expected is None:
        with pytest.raises(ValueError):
            extract_json(text)
        return
    assert extract_json(text) == expected


def test_think_inside_the_json_answer_is_kept():
    from drift_lance.drift.action import ActionAnswer

    text = '{"response": "the tag <think> in HTML ...", "score": 50, "follow_up_queries": []}'
    assert parse_structured(text, ActionAnswer).response == "the tag <think> in HTML ..."
    fenced = f"<think>score it</think>\n```json\n{text}\n```"
    assert parse_structured(fenced, ActionAnswer).response == "the tag <think> in HTML ..."


@pytest.mark.parametrize("questions", ['"Why?"', "null", '["Why?", 3, null]'])
def test_follow_up_questions_in_odd_shapes_keep_the_answer(questions):
    from drift_lance.drift.action import ActionAnswer

    answer = parse_structured(f'{{"score": 40, "follow_up_queries": {questions}, "response": "kept"}}', ActionAnswer)
    assert answer.response == "kept" and answer.follow_up_queries == ([] if questions == "null" else ["Why?"])


def test_half_an_escaped_character_becomes_a_replacement_character():
    from drift_lance.drift.action import ActionAnswer

    answer = parse_structured('{"score": 40, "follow_up_queries": ["Who \\ud83d?"], "response": "cut \\ud83d', ActionAnswer)
    assert answer.response == "cut \ufffd" and answer.follow_up_queries == ["Who \ufffd?"]
    answer.response.encode("utf-8")  # what the next request needs


def test_extract_json_without_json_raises():
    with pytest.raises(ValueError):
        extract_json("no structure at all")


def test_parse_structured_validates_nested_models():
    text = "```json\n{'title': 'T', 'rating': 7.5, 'findings': [{'summary': 's'},]}\n```"
    report = parse_structured(text, Report)
    assert report == Report(title="T", rating=7.5, findings=[Finding(summary="s")])


def test_parse_structured_reports_field_errors_and_keeps_text():
    with pytest.raises(StructuredOutputError, match="rating") as info:
        parse_structured('{"title": "T", "rating": "high", "findings": []}', Report)
    assert info.value.text.startswith('{"title"')


def test_strict_schema_closes_every_object_and_requires_all_fields():
    schema, strict = strict_json_schema(Report)
    assert strict
    assert schema["additionalProperties"] is False and set(schema["required"]) == {"title", "rating", "findings"}
    finding = schema["$defs"]["Finding"]
    assert finding["additionalProperties"] is False and finding["required"] == ["summary", "explanation"]
    assert "default" not in finding["properties"]["explanation"]


def test_open_maps_fall_back_to_non_strict_schema():
    schema, strict = strict_json_schema(Loose)
    assert not strict and schema == Loose.model_json_schema()


def test_output_nested_deeper_than_the_parser_goes_is_a_structured_output_error():
    """A looping model's "[[[[..." must be an unusable answer (skipped like any other), not a
    RecursionError that fails the whole search as an internal error."""
    for text in ("[" * 5000, "[" * 5000 + "]" * 5000, '{"summary": ' + "[" * 5000 + "]" * 5000 + "}"):
        with pytest.raises(StructuredOutputError):
            parse_structured(text, Finding)


def test_repairing_deeply_nested_output_takes_memory_in_proportion_to_its_length():
    """Unclosed lists with commas, 48 KB of them: each comma used to copy every open bracket
    (256 MB for this answer, 23 s of a blocked service event loop for 240 KB)."""
    import tracemalloc

    text = "{\"a\": [1, 'b', " * 4000
    tracemalloc.start()
    try:
        with pytest.raises(StructuredOutputError):
            parse_structured(text, Finding)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20, f"{peak / 2**20:.0f} MiB to repair {len(text)} characters"
