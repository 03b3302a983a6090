"""`drift-lance inspect --db URI [--json]`: what an ingested database holds."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="show an ingested database: manifest, tables, rows, indexes, embedding models",
        description="Show the newest complete manifest of an ingested database, with per-table rows, "
        "pinned versions, indexes and embedding models.",
    )
    parser.add_argument("--db", metavar="URI", help="LanceDB URI of the ingested index (default: `db` from settings)")
    parser.add_argument("--config", metavar="FILE", help="settings file (TOML/YAML; default $DRIFT_LANCE_CONFIG): db, store")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--storage-option", dest="storage_options", action="append", default=[], metavar="KEY=VALUE",
        help="LanceDB storage option for object storage (repeatable)",
    )
    parser.set_defaults(func=run)


async def describe(uri: str, storage_options: dict[str, str] | None = None, config: Any = None) -> dict[str, Any]:
    """The database at `uri` as a JSON-able dict: manifest, generations, per-table details. A table
    whose files cannot be read (one missing or truncated, a table folder gone) keeps its manifest
    entry, with the error naming the table and file in its `problem` and in `problems`."""
    from drift_lance._lance_store import cache_overflow_warning, open_store

    store = await open_store(uri, storage_options=storage_options, config=config)
    try:
        tables = {name: await _describe_table(store, name) for name in store.manifest.tables}
        generations = await store.generations()
        probing = {
            name: _probing_line(info, store.config.search)
            + _warning_note(cache_overflow_warning(name, tables[name]["vector_index_bytes"], store.config.index_cache_bytes))
            for name, info in store.manifest.tables.items() if info.vector_index and not tables[name]["problem"]
        }
        return {
            "uri": uri, "generations": generations, "manifest": store.manifest.model_dump(mode="json"),
            "tables": tables, "probing": probing,
            "problems": [t["problem"] for t in tables.values() if t["problem"]],
        }
    finally:
        await store.close()


async def _describe_table(store: Any, name: str) -> dict[str, Any]:
    """One table's row of the report. On a local database its files are checked first, as `query`
    checks them at open (present at their recorded sizes), then read a little each (index files too):
    the report said a database with a deleted or truncated data file was whole, exit 0."""
    from drift_lance._lance_store import is_local_uri
    from drift_lance.errors import StoreError

    info = store.manifest.tables[name]
    vec = store.manifest.vectors.get(name)
    entry: dict[str, Any] = {
        "rows": info.rows, "version": info.version, "vector_index": info.vector_index, "indexes": {},
        "vector_index_bytes": None, "dimension": vec.dimension if vec else None,
        "embedding_model": vec.model if vec else None, "problem": None,
    }
    try:
        if is_local_uri(store.uri):
            await store.check_files_present(name)
            await store.check_readable(name)
        entry["indexes"] = await store.indexes(name)
        entry["vector_index_bytes"] = await store.vector_index_bytes(name) if info.vector_index else None
    except StoreError as exc:
        entry["problem"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - LanceDB's own error for a missing object: name the table when it is one
        unreadable = await store.unreadable_error(exc)
        if unreadable is None:
            raise
        entry["problem"] = str(unreadable)
    return entry


def _probing_line(info: Any, tuning: Any) -> str:
    from drift_lance.cli.ingest_cmd import probing_line

    return probing_line(info, tuning) + _clamp_note(info, tuning)


def _clamp_note(info: Any, tuning: Any) -> str:
    """Why the probe count is below store.search.nprobes: the store probes at most every partition."""
    partitions = info.vector_index_params.get("num_partitions")
    if tuning.nprobes is None or not partitions or tuning.nprobes <= partitions:
        return ""
    return f"; store.search.nprobes {tuning.nprobes} is more than the index's {partitions} partitions, so all are probed"


def _warning_note(warning: str | None) -> str:
    return f"; WARNING: {warning}" if warning else ""


def run(args: argparse.Namespace) -> int:
    from drift_lance.cli import EXIT_USAGE, UsageError, json_text
    from drift_lance.cli.ingest_cmd import parse_storage_options
    from drift_lance.config.settings import Settings

    # db and store.storage_options from the settings ($DRIFT_LANCE_CONFIG, environment), then the flags
    settings = Settings.load(args.config, graphrag=True, db=args.db)  # a $DRIFT_LANCE_CONFIG set for query and serve
    if not settings.db:
        raise UsageError("no database: pass --db URI (or set `db` in the config file / DRIFT_LANCE_DB)")
    info = asyncio.run(describe(settings.db, parse_storage_options(args.storage_options), settings.store))
    if args.json:
        print(json_text(info))
    else:
        print_report(info)
    for problem in info["problems"]:  # the rest of the report stands; the database does not serve queries
        print(f"drift-lance inspect: error: {problem}", file=sys.stderr)
    return EXIT_USAGE if info["problems"] else 0


def print_report(info: dict[str, Any]) -> None:
    m = info["manifest"]
    out = sys.stdout
    print(f"database   {info['uri']}", file=out)
    print(f"generation {m['generation']} (kept: {', '.join(map(str, info['generations']))})", file=out)
    print(f"source     {m['source_path']} ({m['layout']})", file=out)
    print(f"ingested   {m['ingested_at']} by drift-lance {m['drift_lance_version']}", file=out)
    header = f"{'table':<18} {'rows':>9} {'version':>7}  {'vectors':<40} indexes"
    print(header, file=out)
    print("-" * len(header), file=out)
    for name, t in info["tables"].items():
        vectors = f"{t['dimension']}-d {t['embedding_model']}" if t["dimension"] else "-"
        indexes = ", ".join(f"{col}:{kind}" for col, kind in t["indexes"].items()) or "-"
        if t["problem"]:
            indexes = "UNREADABLE (the error below names the file)"
        print(f"{name:<18} {t['rows']:>9} {t['version']:>7}  {vectors:<40} {indexes}", file=out)
    for line in info["probing"].values():
        print(line, file=out)
