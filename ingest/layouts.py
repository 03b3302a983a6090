"""Find a GraphRAG output folder's layout and read its parquet files.

Layouts (detected from file and column names, never from a version file graphrag does not write):
- ``graphrag-3``: ``entities.parquet`` ... with ``text_units.document_id`` (one document per unit);
- ``graphrag-2``: ``entities.parquet`` ... with ``text_units.document_ids`` lists;
- ``graphrag-1``: ``create_final_*.parquet`` with entity ``title`` (graphrag 0.5 to 1.x);
- ``graphrag-0.4``: ``create_final_*.parquet`` with entity ``name`` and embeddings in the parquet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq

from drift_lance import schema
from drift_lance.errors import IngestError

# Logical table -> file stem, per family. "nodes" only exists in the create_final_* family.
_MODERN_FILES = {
    schema.ENTITIES: "entities",
    schema.RELATIONSHIPS: "relationships",
    schema.COMMUNITIES: "communities",
    schema.COMMUNITY_REPORTS: "community_reports",
    schema.TEXT_UNITS: "text_units",
    schema.COVARIATES: "covariates",
    schema.DOCUMENTS: "documents",
}
_LEGACY_FILES = {table: f"create_final_{stem}" for table, stem in _MODERN_FILES.items()}
NODES = "nodes"
_LEGACY_FILES[NODES] = "create_final_nodes"

# Sub-folders graphrag writes its parquet into, tried after the folder itself.
_OUTPUT_SUBDIRS = ("output", "artifacts")


@dataclass(slots=True)
class SourceIndex:
    """A GraphRAG output folder: its layout and the parquet file behind each logical table."""

    root: Path
    layout: str
    files: dict[str, Path] = field(default_factory=dict)

    def file(self, table: str) -> Path:
        return self.files[table]

    def read(self, table: str) -> pl.DataFrame:
        """The parquet file of `table` as a DataFrame (IngestError naming the file if unreadable)."""
        path = self.files[table]
        try:
            return pl.read_parquet(path)
        except Exception as exc:  # noqa: BLE001 - polars/arrow raise many types for bad files
            raise IngestError(f"{path}: cannot read parquet: {exc}") from exc


def detect_layout(src: str | Path) -> SourceIndex:
    """The layout of the GraphRAG output folder `src`; IngestError when it is not one."""
    root = Path(src).expanduser()
    if not root.exists():
        raise IngestError(f"{root}: no such folder")
    if not root.is_dir():
        raise IngestError(f"{root}: not a folder (expected a GraphRAG output folder with *.parquet files)")
    for folder in (root, *(root / sub for sub in _OUTPUT_SUBDIRS)):
        if (folder / "entities.parquet").exists():
            return _modern(folder)
        if (folder / "create_final_entities.parquet").exists():
            return _legacy(folder)
    parquet = sorted(p.name for p in root.glob("*.parquet"))
    raise IngestError(
        f"{root}: no GraphRAG index found: missing entities.parquet (graphrag >= 2) or "
        f"create_final_entities.parquet (graphrag 0.4-1.x); parquet files present: {parquet or 'none'}"
        + _timestamped_runs_hint(root)
    )


def _timestamped_runs_hint(root: Path) -> str:
    """graphrag <= 0.4 wrote each run to output/<timestamp>/artifacts: name those runs, newest first,
    for the user to choose (the newest may be one that was interrupted)."""
    runs = [p.parent for pattern in ("*/artifacts", "output/*/artifacts") for p in root.glob(pattern)
            if (p / "create_final_entities.parquet").exists()]
    if not runs:
        return ""
    runs.sort(key=lambda run: run.name, reverse=True)
    shown = ", ".join(str(run / "artifacts") for run in runs[:3])
    return f"; graphrag 0.4 runs found, pass one of: {shown}{', ...' if len(runs) > 3 else ''}"


def _existing(folder: Path, stems: dict[str, str]) -> dict[str, Path]:
    return {t: folder / f"{s}.parquet" for t, s in stems.items() if (folder / f"{s}.parquet").exists()}


def _require(folder: Path, files: dict[str, Path], stems: dict[str, str]) -> None:
    for table in schema.REQUIRED_TABLES:
        if table not in files:
            raise IngestError(f"{folder / (stems[table] + '.parquet')}: required table {table!r} is missing")


def _columns(path: Path) -> list[str]:
    try:
        return pq.read_schema(path).names
    except Exception as exc:  # noqa: BLE001
        raise IngestError(f"{path}: cannot read parquet: {exc}") from exc


def _modern(folder: Path) -> SourceIndex:
    files = _existing(folder, _MODERN_FILES)
    _require(folder, files, _MODERN_FILES)
    unit_columns = _columns(files[schema.TEXT_UNITS])
    layout = "graphrag-3" if "document_id" in unit_columns else "graphrag-2"
    return SourceIndex(folder, layout, files)


def _legacy(folder: Path) -> SourceIndex:
    files = _existing(folder, _LEGACY_FILES)
    _require(folder, files, _LEGACY_FILES)
    entity_columns = _columns(files[schema.ENTITIES])
    layout = "graphrag-1" if "title" in entity_columns else "graphrag-0.4"
    return SourceIndex(folder, layout, files)
