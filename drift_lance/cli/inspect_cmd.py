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
    """The database at `uri` as a JSON-able dict: manifest, generations, per-table details."""
    from drift_lance._lance_store import cache_overflow_warning, open_store
    from drift_lance.cli.ingest_cmd import probing_line

    store = await open_store(uri, storage_options=storage_options, config=config)
    try:
        tables = {}
        for name, info in store.manifest.tables.items():
            vec = store.manifest.vectors.get(name)
            tables[name] = {
                "rows": info.rows,
                "version": info.version,
                "vector_index": info.vector_index,
                "indexes": await store.indexes(name),
                "vector_index_bytes": await store.vector_index_bytes(name) if info.vector_index else None,
                "dimension": vec.dimension if vec else None,
                "embedding_model": vec.model if vec else None,
            }
        generations = await store.generations()
        probing = {
            name: probing_line(info, store.config.search) + _clamp_note(info, store.config.search)
            + _warning_note(cache_overflow_warning(name, tables[name]["vector_index_bytes"], store.config.index_cache_bytes))
            for name, info in store.manifest.tables.items() if info.vector_index
        }
        return {
            "uri": uri, "generations": generations, "manifest": store.manifest.model_dump(mode="json"),
            "tables": tables, "probing": probing,
        }
    finally:
        await store.close()


def _clamp_note(info: Any, tuning: Any) -> str:
    """Why the probe count is below store.search.nprobes: the store probes at most every partition."""
    partitions = info.vector_index_params.get("num_partitions")
    if tuning.nprobes is None or not partitions or tuning.nprobes <= partitions:
        return ""
    return f"; store.search.nprobes {tuning.nprobes} is more than the index's {partitions} partitions, so all are probed"


def _warning_note(warning: str | None) -> str:
    return f"; WARNING: {warning}" if warning else ""


def run(args: argparse.Namespace) -> int:
    from drift_lance.cli import UsageError, json_text
    from drift_lance.cli.ingest_cmd import parse_storage_options
    from drift_lance.config.settings import Settings

    # db and store.storage_options from the settings ($DRIFT_LANCE_CONFIG, environment), then the flags
    settings = Settings.load(args.config, graphrag=True, db=args.db)  # a $DRIFT_LANCE_CONFIG set for query and serve
    if not settings.db:
        raise UsageError("no database: pass --db URI (or set `db` in the config file / DRIFT_LANCE_DB)")
    info = asyncio.run(describe(settings.db, parse_storage_options(args.storage_options), settings.store))
    if args.json:
        print(json_text(info))
        return 0
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
        print(f"{name:<18} {t['rows']:>9} {t['version']:>7}  {vectors:<40} {indexes}", file=out)
    for line in info["probing"].values():
        print(line, file=out)
    return 0
