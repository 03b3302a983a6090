"""Find a GraphRAG output folder's layout and read its tables (parquet, or graphrag 3.x's CSV).

Layouts (detected from file and column names, never from a version file graphrag does not write):
- ``graphrag-3``: ``entities.parquet`` ... with ``text_units.document_id`` (one document per unit);
- ``graphrag-3-csv``: the same tables as ``entities.csv`` ... (graphrag 3.x ``table_provider: csv``);
- ``graphrag-2``: ``entities.parquet`` ... with ``text_units.document_ids`` lists;
- ``graphrag-1``: ``create_final_*.parquet`` with entity ``title`` (graphrag 0.5 to 1.x);
- ``graphrag-0.4``: ``create_final_*.parquet`` with entity ``name`` and embeddings in the parquet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from drift_lance import schema
from drift_lance.errors import IngestError
from ingest import csv_tables

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
    """A GraphRAG output folder: its layout and the parquet (or CSV) file behind each logical table."""

    root: Path
    layout: str
    files: dict[str, Path] = field(default_factory=dict)

    def file(self, table: str) -> Path:
        return self.files[table]

    def read(self, table: str) -> pl.DataFrame:
        """The file of `table` as a DataFrame (IngestError naming the file if unreadable)."""
        path = self.files[table]
        if path.suffix == ".csv":
            return csv_tables.read_csv_table(path, table)
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
        if (folder / "entities.parquet").exists() or (folder / "entities.csv").exists():
            return _modern(folder, _one_format(folder))
        if (folder / "create_final_entities.parquet").exists():
            return _legacy(folder)
    tables = sorted(p.name for pattern in ("*.parquet", "*.csv") for p in root.glob(pattern))
    raise IngestError(
        f"{root}: no GraphRAG index found: missing entities.parquet or entities.csv (graphrag >= 2) or "
        f"create_final_entities.parquet (graphrag 0.4-1.x); parquet and csv files present: {tables or 'none'}"
        + _timestamped_runs_hint(root)
    )


def _one_format(folder: Path) -> str:
    """"parquet" or "csv": the format of the folder's tables. graphrag writes one format per run (its
    `table_provider`), so tables in both are partly another run's, and which is current is unknown."""
    found = {fmt: [f"{stem}.{fmt}" for stem in _MODERN_FILES.values() if (folder / f"{stem}.{fmt}").exists()]
             for fmt in ("parquet", "csv")}
    if found["parquet"] and found["csv"]:
        raise IngestError(
            f"{folder}: holds GraphRAG tables both as parquet ({', '.join(found['parquet'])}) and as CSV "
            f"({', '.join(found['csv'])}); graphrag writes one format per run, so one set is left over from "
            "another run: move it out of the folder"
        )
    return "csv" if found["csv"] else "parquet"


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


def _existing(folder: Path, stems: dict[str, str], fmt: str = "parquet") -> dict[str, Path]:
    return {t: folder / f"{s}.{fmt}" for t, s in stems.items() if (folder / f"{s}.{fmt}").exists()}


def _require(folder: Path, files: dict[str, Path], stems: dict[str, str], fmt: str = "parquet") -> None:
    for table in schema.REQUIRED_TABLES:
        if table not in files:
            raise IngestError(f"{folder / (stems[table] + '.' + fmt)}: required table {table!r} is missing")


def _columns(path: Path) -> list[str]:
    if path.suffix == ".csv":
        return csv_tables.header(path)
    try:
        # polars, as SourceIndex.read: it also reads a folder of parquet parts (Spark writes tables so)
        return list(pl.read_parquet_schema(path))
    except Exception as exc:  # noqa: BLE001
        raise IngestError(f"{path}: cannot read parquet: {exc}") from exc


def _modern(folder: Path, fmt: str) -> SourceIndex:
    files = _existing(folder, _MODERN_FILES, fmt)
    _require(folder, files, _MODERN_FILES, fmt)
    unit_columns = _columns(files[schema.TEXT_UNITS])
    layout = "graphrag-3" if "document_id" in unit_columns else "graphrag-2"
    return SourceIndex(folder, layout if fmt == "parquet" else f"{layout}-csv", files)


def _legacy(folder: Path) -> SourceIndex:
    files = _existing(folder, _LEGACY_FILES)
    _require(folder, files, _LEGACY_FILES)
    entity_columns = _columns(files[schema.ENTITIES])
    layout = "graphrag-1" if "title" in entity_columns else "graphrag-0.4"
    return SourceIndex(folder, layout, files)
