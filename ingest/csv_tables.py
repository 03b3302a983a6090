"""Read the CSV tables graphrag 3.x writes with `table_provider: {type: csv}` into typed frames.

graphrag_storage writes them with Python's csv module (pandas `to_csv` or `csv.DictWriter`: UTF-8,
minimal quoting, `""` doubled, no index). Every value is text there: a null (None / NaN) is an empty
field, a list is its `str()` - `['a', 'b']`, or `['a' 'b']` / `['a'\\n 'b']` when the list was a numpy
array - and a report's findings are a list of dicts (`[{'explanation': ..., 'summary': ...}]`).
`read_csv_table` turns the columns graphrag types (its `data_model/dfs.py`) back into ints, floats
and lists, so normalisation sees what the parquet path gives it; any other column stays text. An
empty field is null in every column (normalisation fills the same defaults as for parquet nulls).
A value that cannot be read raises IngestError naming file, column, row and line.
"""

from __future__ import annotations

import ast
import csv
import io
import json
import math
import re
import sys
import tokenize
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from drift_lance import schema
from drift_lance.errors import IngestError

# graphrag's text fields (a whole document) exceed the csv module's 128 KiB default; graphrag
# itself lifts the limit the same way when it reads these files.
try:
    csv.field_size_limit(sys.maxsize)
except OverflowError:  # pragma: no cover - 32-bit C long
    csv.field_size_limit(2**31 - 1)

_INT, _FLOAT, _STRS, _INTS, _FINDINGS, _VECTOR = "int", "float", "strs", "ints", "findings", "vector"

# Per table, the columns graphrag's readers (data_model/dfs.py, row_transformers.py) type; the rest is text.
_COLUMN_KINDS: dict[str, dict[str, str]] = {
    schema.ENTITIES: {"human_readable_id": _INT, "text_unit_ids": _STRS, "frequency": _INT, "degree": _INT},
    schema.RELATIONSHIPS: {"human_readable_id": _INT, "weight": _FLOAT, "combined_degree": _INT, "text_unit_ids": _STRS},
    schema.COMMUNITIES: {
        "human_readable_id": _INT, "community": _INT, "level": _INT, "parent": _INT, "children": _INTS,
        "entity_ids": _STRS, "relationship_ids": _STRS, "text_unit_ids": _STRS, "size": _INT,
    },
    schema.COMMUNITY_REPORTS: {
        "human_readable_id": _INT, "community": _INT, "level": _INT, "parent": _INT, "children": _INTS,
        "rank": _FLOAT, "findings": _FINDINGS, "size": _INT,
    },
    schema.TEXT_UNITS: {
        "human_readable_id": _INT, "n_tokens": _INT, "document_ids": _STRS, "entity_ids": _STRS,
        "relationship_ids": _STRS, "covariate_ids": _STRS,
    },
    schema.COVARIATES: {"human_readable_id": _INT},
    schema.DOCUMENTS: {"human_readable_id": _INT, "text_unit_ids": _STRS},
}
_DTYPES = {_INT: pl.Int64, _FLOAT: pl.Float64, _STRS: pl.List(pl.String), _INTS: pl.List(pl.Int64), _FINDINGS: pl.String}

# The common case, `str()` of a list of ids: read without the parser.
_SIMPLE_STR_LIST = re.compile(r"\['[^'\\]*'(?:, '[^'\\]*')*\]")


class _BadValue(ValueError):
    """A cell that is not a value of its column's kind (the message says what it should be)."""


def header(path: Path) -> list[str]:
    """The column names of the CSV table at `path` (IngestError naming the file if unreadable)."""
    try:
        with path.open(encoding="utf-8-sig", newline="") as f:
            return next(csv.reader(f), [])
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise IngestError(f"{path}: cannot read CSV: {exc}") from exc


def read_csv_table(path: Path, table: str) -> pl.DataFrame:
    """The CSV file of logical table `table` as a frame typed like graphrag's parquet."""
    columns, lines = _read_cells(path)
    kinds = _COLUMN_KINDS.get(table, {})
    series = []
    for name, cells in columns.items():
        kind = kinds.get(name)
        if kind is None:
            series.append(pl.Series(name, [cell or None for cell in cells], dtype=pl.String))
        else:
            values = [_parse(cell, kind, path, name, row, lines[row]) for row, cell in enumerate(cells)]
            series.append(pl.Series(name, values, dtype=_DTYPES[kind]))
    return pl.DataFrame(series)


def _read_cells(path: Path) -> tuple[dict[str, list[str]], list[int]]:
    """Column name -> cells, and the file line each row starts on (for error messages)."""
    start = 1  # the line the record being read starts on
    try:
        with path.open(encoding="utf-8-sig", newline="") as f:
            reader = csv.reader(f, strict=True)  # as pandas, graphrag's reader: a quote left open is an error
            names = next(reader, [])
            _check_header(path, names)
            columns: list[list[str]] = [[] for _ in names]
            lines: list[int] = []
            start = reader.line_num + 1
            for row in reader:
                if len(row) != len(names):
                    if not row:  # a blank line
                        start = reader.line_num + 1
                        continue
                    raise IngestError(f"{path}: row {len(lines)} (line {start}) has {len(row)} fields, the header has {len(names)}")
                for cells, cell in zip(columns, row, strict=True):
                    cells.append(cell)
                lines.append(start)
                start = reader.line_num + 1
    except UnicodeDecodeError:
        raise IngestError(f"{path}: not UTF-8 (graphrag writes its CSV tables as UTF-8): {_first_bad_byte(path)}") from None
    except csv.Error as exc:
        raise IngestError(f"{path}: cannot read CSV: {exc} (in the record starting at line {start})") from exc
    except OSError as exc:
        raise IngestError(f"{path}: cannot read CSV: {exc}") from exc
    return dict(zip(names, columns, strict=True)), lines


def _first_bad_byte(path: Path) -> str:
    """Where the file stops being UTF-8 (the decoder's own position is within a buffered chunk)."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        return f"byte {data[exc.start]:#04x} at line {line} ({exc.reason})"
    return "undecodable bytes"


def _check_header(path: Path, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise IngestError(f"{path}: column {name!r} appears twice in the header")
        seen.add(name)


def _parse(cell: str, kind: str, path: Path, column: str, row: int, line: int) -> Any:
    if cell == "":  # how graphrag writes None / NaN
        return None
    try:
        return _PARSERS[kind](cell)
    except _BadValue as exc:
        shown = cell if len(cell) <= 80 else cell[:77] + "..."
        raise IngestError(f"{path}: column {column!r}, row {row} (line {line}): cannot read {shown!r}: {exc}") from None


def _int(cell: str) -> int:
    try:
        value = int(cell)
    except ValueError:
        try:  # pandas writes an int column holding NaN as floats ("3.0")
            number = float(cell)
        except ValueError:
            raise _BadValue("expected an integer") from None
        if not (math.isfinite(number) and number.is_integer()):
            raise _BadValue("expected an integer")
        value = int(number)
    if not -(2**63) <= value < 2**63:  # the columns are int64, as in graphrag's parquet
        raise _BadValue("integer out of the 64-bit range")
    return value


def _float(cell: str) -> float:
    try:
        return float(cell)
    except ValueError:
        raise _BadValue("expected a number") from None


def _str_list(cell: str) -> list[str]:
    if cell == "[]":
        return []
    if _SIMPLE_STR_LIST.fullmatch(cell):
        return cell[2:-2].split("', '")
    items = _list_literal(cell)
    if not all(isinstance(item, str | int) and not isinstance(item, bool) for item in items):
        raise _BadValue(f"expected a list of ids{_ellipsis_hint(items)}")
    return [str(item) for item in items]


def _int_list(cell: str) -> list[int]:
    # graphrag writes community `children` as [1, 2] and, re-read by its own reader, as ['1', '2']
    items = _list_literal(cell)
    if all(isinstance(item, str | int | float) and not isinstance(item, bool) for item in items):
        try:
            return [_int(str(item)) for item in items]
        except _BadValue:
            pass
    raise _BadValue(f"expected a list of integers{_ellipsis_hint(items)}")


def _findings(cell: str) -> str:
    """A report's findings as the JSON text the parquet path stores ([{"explanation", "summary"}, ...]).
    Like a parquet list, any list is kept: `graphrag update` rewrites a CSV index's findings as the
    comma-split pieces its reader made of them (a list of strings), and search does not read them."""
    try:
        findings = json.loads(cell)
    except ValueError:
        findings = _list_literal(cell)
    if not isinstance(findings, list):
        raise _BadValue("expected a list of findings ({'summary': ..., 'explanation': ...})")
    try:
        return json.dumps(findings, ensure_ascii=False)
    except (TypeError, ValueError):  # a literal JSON has no form for (bytes, sets, ...)
        raise _BadValue("expected a list of findings ({'summary': ..., 'explanation': ...})") from None


def _list_literal(cell: str) -> list[Any]:
    """A `str()`'d Python list, or a numpy array's (elements separated by blanks or newlines)."""
    text = cell.strip()
    if not (text.startswith("[") and text.endswith("]")):
        raise _BadValue("expected a list like ['a', 'b']")
    try:
        # commas first: Python reads numpy's ['a' 'b'] as ['ab']
        value = ast.literal_eval(_with_commas(text))
    except (ValueError, SyntaxError, MemoryError, RecursionError, tokenize.TokenError):
        raise _BadValue("expected a list like ['a', 'b']") from None
    if not isinstance(value, list):
        raise _BadValue("expected a list like ['a', 'b']")
    return value


def _with_commas(text: str) -> str:
    """`text` with a comma between any two elements of the outer list that lack one (numpy's
    `['a' 'b']`, `[1 -2]`, `[{...} {...}]`); Python's `['a', 'b']` comes back unchanged in meaning."""
    out: list[str] = []
    depth = 0
    ended = False  # the previous token ended an element of the outer list
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.ENDMARKER, tokenize.INDENT, tokenize.DEDENT):
            continue
        is_op = tok.type == tokenize.OP
        opens, closes = is_op and tok.string in "([{", is_op and tok.string in ")]}"
        if depth == 1 and ended and not closes and tok.string != ",":
            out.append(",")
        if closes:
            depth -= 1
        out.append(tok.string)
        if opens:
            depth += 1
        # a sign starts a number, a comma or an opening bracket starts nothing yet
        ended = depth == 1 and not opens and tok.string not in (",", "-", "+")
    return " ".join(out)


def _ellipsis_hint(items: list[Any]) -> str:
    if any(item is Ellipsis for item in items):
        return " (numpy shortened this list with '...' when graphrag wrote it: its values are lost; re-index)"
    return ""


def read_embeddings_csv(path: Path) -> tuple[list[str], np.ndarray, str]:
    """graphrag's `embeddings.<name>.csv` snapshot (`id`, `embedding` = `str()` of a list of floats):
    its ids, a (rows, dim) float32 matrix and the vector column's name; IngestError naming file, row
    and line on a bad vector."""
    columns, lines = _read_cells(path)
    if "id" not in columns:
        raise IngestError(f"{path}: required column 'id' is missing")
    column = next((c for c in ("embedding", "vector") if c in columns), None)
    if column is None:
        raise IngestError(f"{path}: no vector column ('vector' or 'embedding')")
    cells = columns[column]
    matrix: np.ndarray | None = None
    for row, cell in enumerate(cells):
        where = f"{path}: column {column!r}, row {row} (line {lines[row]})"
        vector = _parse(cell, _VECTOR, path, column, row, lines[row])
        if vector is None or not vector:
            raise IngestError(f"{where} has no vector")
        if matrix is None:
            matrix = np.empty((len(cells), len(vector)), dtype=np.float32)
        elif len(vector) != matrix.shape[1]:
            raise IngestError(f"{where}: vectors have mixed dimensions {[matrix.shape[1], len(vector)]}")
        matrix[row] = vector
    return columns["id"], matrix if matrix is not None else np.zeros((0, 0), dtype=np.float32), column


def _vector(cell: str) -> list[float]:
    text = cell.strip()
    if not (text.startswith("[") and text.endswith("]")):
        raise _BadValue("expected a list of numbers")
    try:  # Python's [0.1, -0.2] or numpy's [ 0.1 -0.2\n  0.3]
        return [float(x) for x in text[1:-1].replace(",", " ").split()]
    except ValueError:
        raise _BadValue("expected a list of numbers") from None


_PARSERS: dict[str, Callable[[str], Any]] = {
    _INT: _int, _FLOAT: _float, _STRS: _str_list, _INTS: _int_list, _FINDINGS: _findings, _VECTOR: _vector,
}
