"""Row positions by key value: picking an in-memory table's rows by key costs the keys asked for,
not a pass over the column. Used by the store's table cache and by rows prefetched for a batch of
local-context builds."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np
import polars as pl

__all__ = ["ColumnLists", "positions_by_value", "positions_of", "rows_at"]


def positions_by_value(values: Iterable[Any]) -> dict[Any, list[int]]:
    """{value: the positions where it occurs}; None is left out (it matches no lookup)."""
    positions: dict[Any, list[int]] = {}
    for position, value in enumerate(values):
        if value is not None:
            positions.setdefault(value, []).append(position)
    return positions


def positions_of(index: Mapping[Any, list[int]], wanted: Iterable[Any]) -> list[int]:
    """Positions of the rows whose value is wanted, in row order (a value asked twice counts once)."""
    return sorted(chain.from_iterable(index.get(value, ()) for value in dict.fromkeys(wanted)))


def rows_at(frame: pl.DataFrame, positions: Iterable[int] | np.ndarray, columns: Sequence[str] | None = None) -> pl.DataFrame:
    """`frame.gather(positions)` (of `columns`, default all), column by column: a DataFrame-level
    gather costs ~0.1-0.3 ms even for a few dozen rows (it goes through Polars' thread pool), a
    Series-level one a few us, and the several picks of each local-context build add up."""
    names = frame.columns if columns is None else columns
    if not names:
        return frame.select([])
    values = positions.tolist() if isinstance(positions, np.ndarray) else list(positions)
    index = pl.Series(values=values, dtype=pl.get_index_type())
    return pl.DataFrame([frame.get_column(name)[index] for name in names])


class ColumnLists:
    """Rows as one Python list per column: what a local-context build reads. Picking a few dozen
    prefetched rows this way costs a few us, where a Polars frame per pick cost ~40 us and each
    column's `to_list` a few us more."""

    __slots__ = ("height", "lists")

    def __init__(self, lists: Mapping[str, list[Any]], height: int):
        self.lists = dict(lists)
        self.height = height

    @classmethod
    def of(cls, frame: pl.DataFrame | ColumnLists, columns: Sequence[str] | None = None) -> ColumnLists:
        """`frame`'s columns (default all) as lists; a ColumnLists is returned as is."""
        if isinstance(frame, ColumnLists):
            return frame
        names = frame.columns if columns is None else columns
        return cls({name: frame.get_column(name).to_list() for name in names}, frame.height)

    def __len__(self) -> int:
        return self.height

    def __getitem__(self, name: str) -> list[Any]:
        return self.lists[name]

    def __contains__(self, name: object) -> bool:
        return name in self.lists

    def pick(self, positions: Sequence[int], columns: Sequence[str] | None = None) -> ColumnLists:
        """The rows at `positions` (of `columns`, default all), in that order."""
        names = self.lists if columns is None else columns
        return ColumnLists({name: _at(self.lists[name], positions) for name in names}, len(positions))


def _at(values: list[Any], positions: Sequence[int]) -> list[Any]:
    return [values[i] for i in positions]
