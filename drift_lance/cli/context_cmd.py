"""`drift-lance context "QUERY" --db URI`: build the local-search context without calling a chat model.

Prints the context text the LLM would get (or, with --json, `{"context_text": ..., "records":
{section: [records]}}`, ids as graphrag shows them). `--query-vector FILE` (.npy or a JSON list)
skips the embedder; otherwise the query is embedded with the configured embedder, which must match
the model that embedded the index.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from drift_lance.errors import checked_question, did_you_mean

# Settings that only matter for the answer, not for the context.
_ANSWER_ONLY_KEYS = {"prompt", "completion_model_id", "embedding_model_id", "response_type", "llm_timeout"}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "context",
        help="show the local-search context for a query (no chat model call)",
        description="Build graphrag's local-search context for QUERY from an ingested index and print it.",
    )
    parser.add_argument("query", help='the question; "-" reads it from standard input')
    parser.add_argument("--db", metavar="URI", help="LanceDB URI of the ingested index (default: `db` from settings)")
    parser.add_argument("--query-vector", metavar="FILE", help="query embedding as .npy or a JSON list; skips the embedder")
    parser.add_argument(
        "--storage-option", dest="storage_options", action="append", default=[], metavar="KEY=VALUE",
        help="LanceDB storage option for an object-store --db, e.g. aws_endpoint=http://127.0.0.1:9000 "
        "(repeatable; adds to `store.storage_options` from settings)",
    )
    parser.add_argument(
        "--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
        help="local search setting, e.g. --set max_context_tokens=8000 --set community_level=1 "
        "(keys: max_context_tokens, text_unit_prop, community_prop, top_k_entities, top_k_relationships, "
        "community_level, include_claims, and the other `local` settings); repeatable",
    )
    parser.add_argument(
        "--config", metavar="FILE",
        help="settings file (TOML/YAML) with `local` and `models` sections; a graphrag settings.yaml is accepted "
        "(its local_search block is used)",
    )
    parser.add_argument("--json", action="store_true", help='print {"context_text": ..., "records": {...}} as JSON')
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from drift_lance.cli import UsageError, json_text, question_argument
    from drift_lance.config.settings import Settings

    settings = Settings.load(args.config, graphrag=True)
    db = args.db or settings.db
    if not db:
        raise UsageError("no database: pass --db URI (or set `db` in the config file / DRIFT_LANCE_DB)")
    overrides = parse_overrides(args.assignments)
    vector = read_query_vector(Path(args.query_vector)) if args.query_vector else None
    args.query = question_argument(args.query)
    if args.query.strip():  # empty: graphrag's context of the --set include_entity_names only
        args.query = checked_question(args.query)
    from drift_lance.cli.ingest_cmd import parse_storage_options

    storage_options = parse_storage_options(args.storage_options)
    context = asyncio.run(_build(db, args.query, vector, settings, overrides, storage_options))
    if args.json:
        print(json_text(context.to_json()))
    else:
        print(context.context_text)
        summary = ", ".join(f"{name}: {len(frame)}" for name, frame in context.records.items())
        print(f"records: {summary}; {context.token_count} tokens", file=sys.stderr)
    return 0


def parse_overrides(assignments: list[str]) -> dict[str, Any]:
    """`["max_context_tokens=8000", "include_claims=false"]` -> typed values (as `parse_value`
    reads them), keys checked against the local search settings."""
    from drift_lance.cli import UsageError
    from drift_lance.config.local import LocalSearchConfig
    from drift_lance.config.settings import parse_value

    allowed = (set(LocalSearchConfig.model_fields) | {"top_k_mapped_entities"}) - _ANSWER_ONLY_KEYS
    overrides: dict[str, Any] = {}
    for item in assignments:
        key, sep, raw = item.partition("=")
        key = key.strip().removeprefix("local.")
        if not sep or not key:
            raise UsageError(f"--set {item!r}: expected KEY=VALUE")
        if key not in allowed:
            hint = did_you_mean(key, sorted(allowed))
            raise UsageError(f"--set {key}: unknown local search setting{hint} (known: {', '.join(sorted(allowed))})")
        field = LocalSearchConfig.model_fields.get("top_k_entities" if key == "top_k_mapped_entities" else key)
        overrides[key] = parse_value(raw, field.annotation if field else None)
    return overrides


def read_query_vector(path: Path) -> np.ndarray:
    """A 1-d float32 vector from a .npy file or a JSON list of numbers."""
    from drift_lance.cli import UsageError

    try:
        if path.suffix.lower() == ".npy":
            value = np.load(path, allow_pickle=False)
        else:
            value = json.loads(path.read_text(encoding="utf-8"))
        vector = np.asarray(value, dtype=np.float32)
    except FileNotFoundError:
        raise UsageError(f"--query-vector {path}: no such file") from None
    except (ValueError, TypeError, OSError) as exc:
        raise UsageError(f"--query-vector {path}: not a .npy array or JSON list of numbers ({exc})") from None
    if vector.ndim == 2 and vector.shape[0] == 1:
        vector = vector[0]
    if vector.ndim != 1 or vector.size == 0:
        raise UsageError(f"--query-vector {path}: expected one vector, got an array of shape {vector.shape}")
    if not np.all(np.isfinite(vector)):
        raise UsageError(f"--query-vector {path}: contains NaN or inf")
    if not np.any(vector):
        raise UsageError(f"--query-vector {path}: is all zeros (it has no direction to rank by)")
    return vector


async def _build(
    db: str,
    query: str,
    vector: np.ndarray | None,
    settings: Any,
    overrides: dict[str, Any],
    storage_options: dict[str, str] | None = None,
):
    from drift_lance._lance_store import open_store
    from drift_lance.local.context import LocalContextBuilder

    store = await open_store(db, config=settings.store, storage_options=storage_options)
    try:
        builder = LocalContextBuilder(store, config=settings.local)
        builder.resolve_config(overrides)  # bad settings fail before any model is loaded
        embedder = None
        if vector is None and query:
            from drift_lance.models import get_embedder

            embedder = get_embedder(settings.models)
        from drift_lance.models.base import aclose_models

        try:
            return await builder.build(query, query_vector=vector, embedder=embedder, **overrides)
        except Exception as exc:
            await store.raise_if_unreadable(exc)
            raise
        finally:
            await aclose_models(embedder)
    finally:
        await store.close()
