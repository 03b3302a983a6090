"""Rendering of context sections exactly as graphrag 3.x lays them out, with its budget rules.

Every table section is `-----Name-----\\n` + a delimiter-joined header line + one line per record.
A record is added while header tokens + the tokens of each record line (counted line by line, the
way graphrag counts) stay within the budget; the first record that does not fit ends the section.
Reports are the exception: budgeted the same way but written out as CSV (pandas' `to_csv`), so
multi-line report text is quoted.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import polars as pl

from drift_lance.models.tokens import Tokenizer

__all__ = [
    "RenderedSection",
    "SectionRecords",
    "TokenCountCache",
    "TokenCounter",
    "render_csv_section",
    "render_table_section",
]


class TokenCountCache:
    """Token counts of rendered lines, kept across the builds of one context builder: DRIFT's
    follow-ups of one query render mostly the same entity, relationship, report and source lines.
    Emptied whenever the text it has counted passes `max_chars`, so memory stays bounded."""

    def __init__(self, max_chars: int = 16_000_000):
        self.max_chars = max_chars
        self.counts: dict[str, int] = {}
        self._chars = 0

    def add(self, text: str, tokens: int) -> None:
        self._chars += len(text)
        if self._chars > self.max_chars:
            self.counts.clear()
            self._chars = len(text)
        self.counts[text] = tokens


class TokenCounter:
    """Token counts with a cache: the relationship and claim sections are re-rendered once per
    added entity, mostly from the same lines (and other builds rendered many of them already)."""

    def __init__(self, tokenizer: Tokenizer, cache: TokenCountCache | None = None):
        self.tokenizer = tokenizer
        self._cache = cache if cache is not None else TokenCountCache()

    def count(self, text: str) -> int:
        cached = self._cache.counts.get(text)
        if cached is None:
            cached = self.tokenizer.count(text)
            self._cache.add(text, cached)
        return cached

    def count_joined(self, pieces: Sequence[str], counted: int | None = None) -> int:
        """Tokens of "".join(pieces), as if encoded whole. The sum of the pieces' counts is exact
        when every boundary falls after a newline and before a character that starts a new
        pre-token on its own (tiktoken's o200k/cl100k split patterns never merge "\\n" with a
        following letter, digit or punctuation other than "/"): BPE merges never cross pre-tokens.
        `counted`: that sum, when the caller has it already."""
        if all(_clean_boundary(a, b) for a, b in zip(pieces, pieces[1:])):
            return sum(self.count(piece) for piece in pieces) if counted is None else counted
        return self.tokenizer.count("".join(pieces))


def _clean_boundary(before: str, after: str) -> bool:
    return not before or not after or (before.endswith("\n") and not after[0].isspace() and after[0] != "/")


@dataclass(slots=True)
class RenderedSection:
    text: str  # "" when the section is absent from the context
    header: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)  # the records that made it into the text
    tokens: int = 0  # tokens of `text` encoded whole

    def records(self) -> pl.DataFrame:
        schema = {name: pl.String for name in _unique_names(self.header)}
        return pl.DataFrame(self.rows, schema=schema, orient="row")

    def record_dicts(self) -> list[dict[str, str]]:
        """`records().to_dicts()`, without building the frame."""
        names = _unique_names(self.header)
        return [dict(zip(names, row)) for row in self.rows]


class SectionRecords(Mapping[str, pl.DataFrame]):
    """A context's records per section. Each frame is built on first access: DRIFT keeps some sixty
    contexts per query and mostly serializes them, which `__jsonable__` does from the rendered rows
    (five frames per build cost ~0.6 ms, before the follow-up's call could leave)."""

    def __init__(self, sections: Mapping[str, RenderedSection]):
        self._sections = dict(sections)
        self._frames: dict[str, pl.DataFrame] = {}

    def __getitem__(self, name: str) -> pl.DataFrame:
        frame = self._frames.get(name)
        if frame is None:
            frame = self._frames[name] = self._sections[name].records()
        return frame

    def __iter__(self) -> Iterator[str]:
        return iter(self._sections)

    def __len__(self) -> int:
        return len(self._sections)

    def __jsonable__(self) -> dict[str, list[dict[str, str]]]:
        return {name: section.record_dicts() for name, section in self._sections.items()}

    def __repr__(self) -> str:  # rows per section, without building a frame
        return f"SectionRecords({', '.join(f'{name}={len(section.rows)}' for name, section in self._sections.items())})"


def _unique_names(header: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    names = []
    for name in header:
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return names


def section_head(name: str, header: Sequence[str], delimiter: str) -> str:
    return f"-----{name}-----\n" + delimiter.join(header) + "\n"


def render_table_section(
    name: str,
    header: list[str],
    rows: Iterable[list[str]],
    *,
    budget: int,
    counter: TokenCounter,
    delimiter: str,
) -> RenderedSection:
    """Header, then rows until the next one would exceed `budget` (graphrag's entity, relationship,
    covariate and text-unit sections). The header is always written, even with no rows."""
    head = section_head(name, header, delimiter)
    used = counter.count(head)
    pieces = [head]
    kept: list[list[str]] = []
    for row in rows:
        line = delimiter.join(row) + "\n"
        line_tokens = counter.count(line)
        if used + line_tokens > budget:
            break
        pieces.append(line)
        kept.append(row)
        used += line_tokens
    return RenderedSection("".join(pieces), header, kept, counter.count_joined(pieces, used))


def render_csv_section(
    name: str,
    header: list[str],
    rows: Iterable[list[str]],
    *,
    budget: int,
    counter: TokenCounter,
    delimiter: str,
    reorder: Callable[[list[list[str]]], list[list[str]]] | None = None,
) -> RenderedSection:
    """graphrag's single-batch community-report section: rows budgeted as delimiter-joined lines,
    then written as CSV. No row fitting gives an empty section (text ""). `reorder` puts the rows
    that fit in the order they are written (graphrag sorts the batch it cut by its rank column)."""
    used = counter.count(section_head(name, header, delimiter))
    kept: list[list[str]] = []
    for row in rows:
        line_tokens = counter.count(delimiter.join(row) + "\n")
        if used + line_tokens > budget:
            break
        kept.append(row)
        used += line_tokens
    if not kept:
        return RenderedSection("", header, [])
    if reorder is not None:
        kept = reorder(kept)
    text = f"-----{name}-----\n" + to_csv(header, kept, delimiter)
    return RenderedSection(text, header, kept)  # tokens unused: nothing budgets against this text


def to_csv(header: Sequence[str], rows: Iterable[Sequence[str]], delimiter: str) -> str:
    """What pandas' DataFrame.to_csv(index=False, sep=delimiter) writes for string columns:
    minimal quoting, doubled quotes, "\\n" line ends."""
    lines = [header, *rows]
    if len(delimiter) == 1 and delimiter not in '"\r\n' and all(len(line) > 1 for line in lines):
        # The csv module's rule, in str methods: ~5x faster on report-sized fields (the writer
        # copies them character by character). A "\r" is left to the module: Python 3.11 writes it
        # bare, later versions quote it. A lone empty field is quoted too, hence two fields or more.
        text = "".join(delimiter.join([_csv_field(field, delimiter) for field in line]) + "\n" for line in lines)
        if "\r" not in text:
            return text
    return _csv_module(lines, delimiter)


def _csv_field(field: str, delimiter: str) -> str:
    if '"' in field:
        return '"' + field.replace('"', '""') + '"'
    return '"' + field + '"' if delimiter in field or "\n" in field else field


def _csv_module(lines: Iterable[Sequence[str]], delimiter: str) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, delimiter=delimiter, quotechar='"', quoting=csv.QUOTE_MINIMAL, lineterminator="\n")
    writer.writerows(lines)
    return buffer.getvalue()
