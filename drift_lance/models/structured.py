"""Structured (JSON) output: schemas for the request, tolerant extraction and repair of the answer.

Small and local models often wrap JSON in prose or code fences, leave trailing commas, use single
quotes or stop mid-object when they hit max_tokens. `parse_structured` recovers what it can and
validates the result with the caller's pydantic model; when nothing valid can be recovered it raises
StructuredOutputError carrying the raw text, so callers can log or skip that answer.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from drift_lance.models.base import StructuredOutputError, Usage, well_formed

StructuredMode = Literal["json_schema", "json_object", "prompt"]
# Fallback order when the server rejects a mode: strict schema, JSON mode (with the schema where
# accepted, as llama.cpp's server does), then plain prompting plus repair.
MODE_CHAIN: tuple[StructuredMode, ...] = ("json_schema", "json_object", "prompt")

_FENCE = re.compile(r"```[a-zA-Z0-9_-]*\s*\n?(.*?)(?:```|\Z)", re.DOTALL)
_LITERALS = {"True": "true", "False": "false", "None": "null"}
# DeepSeek-R1, Qwen3 and other reasoning models served by vLLM / Ollama / llama.cpp think aloud first:
# only leading blocks (or a leading one cut off unclosed) are reasoning; "<think>" later on, as in a
# string value of the JSON, is the answer's own text.
_THINK = re.compile(r"\A(?:\s*<think>.*?(?:</think>|\Z))+", re.DOTALL)


# ---------------------------------------------------------------- request side


def response_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema, a fresh dict per call (callers may change it)."""
    return json.loads(_schema_json(model))


@functools.cache
def _schema_json(model: type[BaseModel]) -> str:
    # pydantic rebuilds the schema on every model_json_schema() call (~1 ms); DRIFT asks once per call.
    return json.dumps(model.model_json_schema())


def strict_json_schema(model: type[BaseModel]) -> tuple[dict[str, Any], bool]:
    """The model's JSON schema adapted to OpenAI's strict mode (every object closed, every property
    required, no defaults). Returns (schema, strict); strict is False when the schema uses open maps
    (dict[str, X]) that strict mode cannot express, in which case the plain schema is returned."""
    schema = response_schema(model)
    ok = _make_strict(schema)
    return (schema, True) if ok else (response_schema(model), False)


def _make_strict(node: Any) -> bool:
    if isinstance(node, list):
        return all(_make_strict(item) for item in node)
    if not isinstance(node, dict):
        return True
    node.pop("default", None)
    if node.get("type") == "object" or "properties" in node:
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) or (extra is True and not node.get("properties")):
            return False  # an open map: strict mode would forbid its keys
        node["additionalProperties"] = False
        node["required"] = list(node.get("properties", {}))
    return all(_make_strict(value) for key, value in node.items() if key != "required")


@functools.cache  # once per response model: a str, and the schema does not change
def schema_instruction(model: type[BaseModel]) -> str:
    """System-message text asking for JSON that matches the schema (needed in json_object and
    prompt modes; OpenAI's JSON mode also requires the word JSON in the messages)."""
    schema = json.dumps(response_schema(model), ensure_ascii=False, separators=(",", ":"))
    return (
        "Respond with a single JSON object and nothing else (no code fences, no commentary). "
        f"It must validate against this JSON schema:\n{schema}"
    )


def response_format_for(mode: StructuredMode, model: type[BaseModel]) -> dict[str, Any] | None:
    if mode == "json_schema":
        schema, strict = strict_json_schema(model)
        return {
            "type": "json_schema",
            "json_schema": {"name": _schema_name(model), "schema": schema, "strict": strict},
        }
    if mode == "json_object":
        return {"type": "json_object", "schema": response_schema(model)}
    return None


def _schema_name(model: type[BaseModel]) -> str:
    return re.sub(r"[^a-zA-Z0-9_-]", "_", model.__name__)[:64] or "response"


# ---------------------------------------------------------------- response side


def parse_structured(text: str, model: type[BaseModel], *, usage: Usage | None = None) -> BaseModel:
    """Extract, repair and validate JSON for `model` from a model's answer text."""
    try:
        data = extract_json(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python recurses
        raise StructuredOutputError(
            f"no JSON object for {model.__name__} in the model output: {exc}; output starts {text[:200]!r}",
            text=text,
            usage=usage,
        ) from None
    try:
        return model.model_validate(_well_formed_strings(data))
    except RecursionError:
        raise StructuredOutputError(f"model output for {model.__name__} is JSON nested too deeply to read", text=text,
                                    usage=usage) from None
    except ValidationError as exc:
        raise StructuredOutputError(
            f"model output is JSON but does not match {model.__name__}: {_first_errors(exc)}",
            text=text,
            usage=usage,
        ) from None


def _well_formed_strings(data: Any) -> Any:
    if isinstance(data, str):
        return well_formed(data)
    if isinstance(data, dict):
        return {well_formed(str(key)): _well_formed_strings(value) for key, value in data.items()}
    if isinstance(data, list):
        return [_well_formed_strings(item) for item in data]
    return data


def _first_errors(exc: ValidationError, limit: int = 3) -> str:
    parts = []
    for err in exc.errors()[:limit]:
        where = ".".join(str(p) for p in err["loc"]) or "<root>"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def extract_json(text: str) -> Any:
    """The first JSON object (or array) in `text`, repairing common defects. Raises ValueError.
    A reasoning model's leading `<think>...</think>` block is skipped: JSON-like text in it is not the
    answer. "<think>" anywhere else (inside a string of the JSON, say) is left as it is."""
    try:  # most answers are plain JSON (which cannot start with a think block): read them first
        return json.loads(text, strict=False)  # as the stripped text would read: JSON's own blanks
    except (ValueError, RecursionError):
        pass
    text = _THINK.sub("", text, count=1)
    for candidate in _candidates(text):
        try:
            return json.loads(candidate, strict=False)
        except (ValueError, RecursionError):  # the latter: nested deeper than the parser goes
            pass
    start = _first_opening(text)
    if start < 0:
        raise ValueError("no '{' or '[' found")
    for repaired in repair_json(text[start:]):
        try:
            return json.loads(repaired, strict=False)
        except (ValueError, RecursionError):
            continue
    raise ValueError("JSON could not be repaired")


def _candidates(text: str) -> list[str]:
    stripped = text.strip()
    out = [stripped]
    out += [m.group(1).strip() for m in _FENCE.finditer(text)]
    start = _first_opening(stripped)
    if start > 0:
        out.append(stripped[start:])
    return out


def _first_opening(text: str) -> int:
    positions = [p for p in (text.find("{"), text.find("[")) if p >= 0]
    return min(positions) if positions else -1


# Open brackets, innermost first, as a linked list: ("[", ("{", None)) for "{[".
_Openers = tuple[str, "_Openers"] | None


def repair_json(src: str) -> list[str]:
    """Candidate repairs of JSON-like text starting at its first bracket, best first: single quotes
    to double quotes, Python literals, trailing commas, raw newlines in strings, text after the
    outermost value, and (for truncated output) unclosed strings and brackets. Further candidates
    drop the incomplete last members of a truncated object."""
    out: list[str] = []
    # A cut keeps the stack as it was without copying it: a copy per comma made deeply nested output
    # quadratic (240 KB of unclosed lists in a model's answer held the service's event loop for 23 s).
    stack: _Openers = None
    cuts: list[tuple[int, _Openers]] = []  # (len(out) at a top-level-ish comma, stack then)
    quote: str | None = None
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if quote is not None:
            i = _string_char(src, i, quote, out)
            if out and out[-1] == "\0end":
                out.pop()
                out.append('"')
                quote = None
            continue
        if c in "\"'":
            quote = c
            out.append('"')
        elif c in "{[":
            stack = (c, stack)
            out.append(c)
        elif c in "}]":
            _drop_trailing_comma(out)
            if stack is not None:
                stack = stack[1]
            out.append(c)
            if stack is None:
                break
        elif c == ",":
            cuts.append((len(out), stack))
            out.append(c)
        elif c == "/" and src.startswith("//", i):
            end = src.find("\n", i)
            i = n if end < 0 else end
            continue
        elif c.isalpha():
            j = i
            while j < n and (src[j].isalnum() or src[j] == "_"):
                j += 1
            word = src[i:j]
            out.append(_LITERALS.get(word, word))
            i = j
            continue
        else:
            out.append(c)
        i += 1
    if quote is not None:
        out.append('"')
    candidates = [_close("".join(out), stack)]
    for pos, snapshot in reversed(cuts[-3:]):
        candidates.append(_close("".join(out[:pos]), snapshot))
    return candidates


def _string_char(src: str, i: int, quote: str, out: list[str]) -> int:
    """Copy one character (or escape) of a string literal into `out` as JSON; returns next index.
    Appends the marker "\\0end" when the closing quote is reached."""
    c = src[i]
    if c == "\\":
        nxt = src[i + 1] if i + 1 < len(src) else ""
        if nxt == "'":
            out.append("'")
        else:
            out.append(c + nxt)
        return i + 2
    if c == quote:
        out.append("\0end")
        return i + 1
    if c == '"':  # a double quote inside a single-quoted string
        out.append('\\"')
    elif c == "\n":
        out.append("\\n")
    elif c == "\r":
        out.append("\\r")
    elif c == "\t":
        out.append("\\t")
    else:
        out.append(c)
    return i + 1


def _drop_trailing_comma(out: list[str]) -> None:
    k = len(out) - 1
    while k >= 0 and out[k].isspace():
        k -= 1
    if k >= 0 and out[k] == ",":
        del out[k]


def _close(text: str, stack: _Openers) -> str:
    body = text.rstrip()
    while body.endswith(","):
        body = body[:-1].rstrip()
    if body.endswith(":"):
        body += " null"
    closers = []
    while stack is not None:  # innermost first
        opener, stack = stack
        closers.append("}" if opener == "{" else "]")
    return body + "".join(closers)
