"""The data files a local Lance table's version lists, read from its manifest without pylance.

The store checks at open that every data file of each pinned version is present at its recorded
size. Asking pylance for the fragments imports it and starts its runtime: +35 MB resident for the
life of the process (+19 MB the import, +15 MB the first dataset; measured at 10^4 x 1536, where it
was all of DRIFT's peak-RSS rise from 508 to 545 MB). The manifest is small and its layout is
Lance's published table format (protos/table.proto): a protobuf `Manifest` at the position the
16-byte footer gives (u64 position, u16 major, u16 minor, "LANC"), length-prefixed (u32).

Only the fields the check needs are read: Manifest.fragments (2), DataFragment.files (2) and
deletion_file (3), DataFile.path (1), file_size_bytes (6) and base_id (7). Anything else this
reader does not handle (another footer, a version file it cannot find, a deletion file, a file
under another base path, a malformed message) gives None: the caller then asks pylance, which
also words every failure, so this reader can only ever confirm a healthy table."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["listed_data_files"]

_MAGIC = b"LANC"
_FOOTER = 16
_U64_MAX = 2**64 - 1


class _Unreadable(Exception):
    """A manifest this reader does not handle."""


def listed_data_files(root: Path, version: int) -> list[tuple[Path, int]] | None:
    """(path, recorded size; 0 = unknown) of every data file of `version` of the Lance table at
    `root`, or None when its manifest is not one this reader handles."""
    for name in (f"{_U64_MAX - version:020d}.manifest", f"{version}.manifest"):  # V2 naming, then V1
        path = root / "_versions" / name
        try:
            data = path.read_bytes()
        except OSError:
            continue
        try:
            return [(root / "data" / file, size) for file, size in _data_files(data)]
        except (_Unreadable, struct.error, UnicodeDecodeError, IndexError):
            return None
    return None


def _data_files(data: bytes) -> list[tuple[str, int]]:
    if len(data) < _FOOTER or data[-4:] != _MAGIC:
        raise _Unreadable("footer")
    (position,) = struct.unpack_from("<Q", data, len(data) - _FOOTER)
    (length,) = struct.unpack_from("<I", data, position)
    start = position + 4
    if start + length > len(data) - _FOOTER:
        raise _Unreadable("manifest position")
    files = []
    for field, value in _fields(data, start, start + length):
        if field == 2:  # Manifest.fragments
            files.extend(_fragment_files(data, *value))
    return files


def _fragment_files(data: bytes, start: int, end: int) -> list[tuple[str, int]]:
    files = []
    for field, value in _fields(data, start, end):
        if field == 3:  # DataFragment.deletion_file: its path rule is left to pylance
            raise _Unreadable("deletion file")
        if field == 2:  # DataFragment.files
            path, size = None, 0
            for file_field, file_value in _fields(data, *value):
                if file_field == 1:
                    path = data[file_value[0]:file_value[1]].decode()
                elif file_field == 6:
                    size = file_value
                elif file_field == 7:  # DataFile.base_id: a file under another base path
                    raise _Unreadable("base path")
            if not path:
                raise _Unreadable("data file without a path")
            files.append((path, size))
    return files


def _fields(data: bytes, start: int, end: int) -> Iterator[tuple[int, Any]]:
    """(field number, value) of the protobuf message in data[start:end]: an int for varints and
    fixed-width fields, (start, end) of the payload for length-delimited ones."""
    position = start
    while position < end:
        key, position = _varint(data, position)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, position = _varint(data, position)
        elif wire == 2:
            size, position = _varint(data, position)
            value = (position, position + size)
            position += size
        elif wire == 1:
            (value,) = struct.unpack_from("<Q", data, position)
            position += 8
        elif wire == 5:
            (value,) = struct.unpack_from("<I", data, position)
            position += 4
        else:
            raise _Unreadable(f"wire type {wire}")
        if position > end:
            raise _Unreadable("field past the message end")
        yield field, value


def _varint(data: bytes, position: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, position
        shift += 7
        if shift > 63:
            raise _Unreadable("varint")
