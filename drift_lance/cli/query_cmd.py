"""`drift-lance query "..." --db URI`: run a DRIFT (or local) search and print the answer, then the
LLM calls / tokens per stage and the timing; `--json` prints the whole SearchResult instead."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from drift_lance.drift.callbacks import DriftCallbacks
from drift_lance.drift.result import STAGES, SearchResult
from drift_lance.errors import checked_question


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "query",
        help="ask a question (DRIFT search by default)",
        description="Run a DRIFT (or local) search on an ingested index and print the answer, then "
        "the LLM calls and tokens per stage (build_context, primer, action, reduce).",
    )
    parser.add_argument("query", help='the question; "-" reads it from standard input')
    parser.add_argument("--db", metavar="URI", help="LanceDB URI of the ingested index (default: `db` from settings)")
    parser.add_argument("--method", choices=("drift", "local"), default="drift", help="search method (default drift)")
    parser.add_argument(
        "--storage-option", dest="storage_options", action="append", default=[], metavar="KEY=VALUE",
        help="LanceDB storage option for an object-store --db, e.g. aws_endpoint=http://127.0.0.1:9000 "
        "(repeatable; adds to `store.storage_options` from settings)",
    )
    parser.add_argument("--stream", action="store_true", help="print the answer as it is generated")
    parser.add_argument("--json", action="store_true", help="print the whole SearchResult as JSON")
    parser.add_argument(
        "--config", metavar="FILE",
        help="settings file (TOML/YAML); a graphrag settings.yaml is accepted (its drift_search and local_search blocks are used)",
    )
    parser.add_argument(
        "--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
        help="override a search setting by field name, e.g. --set drift_k_followups=3 --set n_depth=2 "
        "--set community_level=1 (repeatable)",
    )
    parser.add_argument(
        "--graph-out", metavar="FILE",
        help="write the DRIFT action graph; format by extension: .json, .graphml or .html (self-contained)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from drift_lance.cli import UsageError, json_text, question_argument
    from drift_lance.drift.export import EXPORT_FORMATS

    if args.graph_out:
        if args.method != "drift":
            raise UsageError("--graph-out needs --method drift (local search has no action graph)")
        suffix = Path(args.graph_out).suffix.lower()
        if suffix not in (*EXPORT_FORMATS, ".htm"):
            raise UsageError(f"--graph-out {args.graph_out}: unknown extension {suffix!r}; use {', '.join(EXPORT_FORMATS)}")
    if args.stream and args.json:
        raise UsageError("--stream and --json cannot be combined")
    args.query = checked_question(question_argument(args.query))
    if args.graph_out:  # before any LLM call is spent
        check_writable_file("--graph-out", Path(args.graph_out))
    settings, search_config = load_query_settings(args)
    db = args.db or settings.db
    if not db:
        raise UsageError("no database: pass --db URI (or set `db` in the config file / DRIFT_LANCE_DB)")
    result = asyncio.run(_search(args, settings, search_config, db))
    if args.json:
        print(json_text(result.model_dump(mode="json"), allow_nan=False))
    else:
        print_stats(result, sys.stdout)
    if args.graph_out and result.state is not None:
        from drift_lance.drift.export import export_graph

        path = export_graph(result.state, args.graph_out)
        print(f"action graph written to {path}", file=sys.stderr)
    return 0


BUNDLED_CHAT_NOTICE = ("answering with the embedded offline chat model (SmolLM2-135M): it shows the pipeline, its "
                       "answers are not real; set OPENAI_BASE_URL / OPENAI_API_KEY or [models] for a real model")


def uses_bundled_chat_model(models: Any) -> bool:
    """Whether the chat model is the bundled demo model (local backend, no GGUF of the user's own)."""
    resolved = models.resolve()
    return resolved.chat_backend == "local" and resolved.llama_model_path is None


def check_writable_file(option: str, path: Path) -> None:
    """UsageError naming `option` when `path` cannot be written as a file (checked before a query
    spends any LLM call, not after)."""
    from drift_lance.cli import UsageError

    parent = path.resolve().parent
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: no such directory {str(parent)!r}")
    if path.is_dir():
        raise UsageError(f"{option} {path}: is a directory")
    if not os.access(path if path.exists() else parent, os.W_OK):
        raise UsageError(f"{option} {path}: not writable")


def load_query_settings(args: argparse.Namespace) -> tuple[Any, Any]:
    """Settings (models, db, local) plus the method's search config with --set applied."""
    from drift_lance.config.drift import load_drift_config
    from drift_lance.config.settings import Settings, parse_assignments

    settings = Settings.load(args.config, graphrag=True, db=args.db)
    if args.method == "local":
        updated = settings.with_updates(parse_assignments(args.assignments, section="local"))
        return updated, updated.local
    # Settings.load already applied the file and the environment to settings.drift.
    return settings, load_drift_config(None, args.assignments, env={}, base=settings.drift)


async def _search(args: argparse.Namespace, settings: Any, config: Any, db: str) -> SearchResult:
    from drift_lance._gc import freeze_long_lived_objects
    from drift_lance._lance_store import open_store
    from drift_lance.cli.ingest_cmd import parse_storage_options
    from drift_lance.models import get_chat_model, get_embedder
    from drift_lance.models.base import aclose_models

    store = await open_store(db, config=settings.store, storage_options=parse_storage_options(args.storage_options))
    chat = embedder = None
    try:
        await store.open_tables()  # a table missing from the database: before any model call
        # Loading model weights (embedded defaults) must not block the event loop.
        chat = await asyncio.to_thread(get_chat_model, settings.models)
        embedder = await asyncio.to_thread(get_embedder, settings.models)
        freeze_long_lived_objects()  # no 0.1 s full collection of start-up objects mid-query
        if args.method == "local":
            from drift_lance.local import LocalContextBuilder, LocalSearch, check_embedder_compatible
            from drift_lance.models.tokens import get_tokenizer

            check_embedder_compatible(store, embedder)  # a setup error, as DRIFT's is: before the model notice
            builder = LocalContextBuilder(store, tokenizer=get_tokenizer(config.encoding), config=config)
            search: Any = LocalSearch(chat, builder, embedder=embedder, config=config)
            callbacks: list[DriftCallbacks] = []
        else:
            search = _drift_search(store, chat, embedder, settings, config)
            callbacks = [_Progress(sys.stderr)] if sys.stderr.isatty() and not args.json else []
        if uses_bundled_chat_model(settings.models):  # once the search is built: not before its setup errors
            print(f"drift-lance {args.command}: {BUNDLED_CHAT_NOTICE}", file=sys.stderr)
        for progress in callbacks:
            progress.on_query_start(config)
        return await _run_search(search, args, callbacks)
    except Exception as exc:
        await store.raise_if_unreadable(exc)
        raise
    finally:
        try:
            await aclose_models(chat, embedder)
        finally:
            await store.close()


def _drift_search(store: Any, chat: Any, embedder: Any, settings: Any, config: Any) -> Any:
    from drift_lance.drift.search import DRIFTSearch, local_config_for_drift
    from drift_lance.local.context import LocalContextBuilder
    from drift_lance.models.tokens import get_tokenizer

    local = local_config_for_drift(config, settings.local)
    tokenizer = get_tokenizer(local.encoding)
    return DRIFTSearch(
        store=store,
        chat_model=chat,
        embedder=embedder,
        context_builder=LocalContextBuilder(store, tokenizer=tokenizer, config=local),
        tokenizer=tokenizer,
        config=config,
    )


async def _run_search(search: Any, args: argparse.Namespace, callbacks: list[DriftCallbacks]) -> SearchResult:
    """Print the answer (streamed or whole) and return the SearchResult."""
    kwargs = {"callbacks": callbacks} if callbacks else {}
    if not args.stream:
        result = await search.search(args.query, **kwargs)
        if not args.json:
            print(_answer_text(result.response))
        return result
    written = False
    try:
        async with search.stream_search(args.query, **kwargs) as stream:
            async for delta in stream:
                sys.stdout.write(delta)
                sys.stdout.flush()
                written = True
    except BaseException:
        if written:  # the reduce failed or Ctrl-C cut it: the error must not run on from the half answer
            with contextlib.suppress(OSError, ValueError):  # a closed pipe has its own exit
                sys.stdout.write("\n")
                sys.stdout.flush()
        raise
    sys.stdout.write("\n")
    assert stream.result is not None
    return stream.result


def _answer_text(response: Any) -> str:
    return response if isinstance(response, str) else json.dumps(response, ensure_ascii=False, indent=2)


def print_stats(result: SearchResult, out: TextIO) -> None:
    """Per-stage LLM calls and tokens, then the wall time."""
    # The stages the result has: DRIFT's four, or local search's build_context and response.
    stages = list(result.llm_calls_categories) or list(STAGES)
    rows = [(stage, result.llm_calls_categories.get(stage, 0), result.prompt_tokens_categories.get(stage, 0),
             result.output_tokens_categories.get(stage, 0)) for stage in stages]
    rows.append(("total", result.llm_calls, result.prompt_tokens, result.output_tokens))
    out.write("\n")
    out.write(f"{'stage':<14}{'llm_calls':>10}{'prompt_tokens':>15}{'output_tokens':>15}\n")
    for stage, calls, prompt, output in rows:
        out.write(f"{stage:<14}{calls:>10}{prompt:>15}{output:>15}\n")
    if result.failures:
        lost = ", ".join(f"{stage} {count}" for stage, count in result.failures_categories.items() if count)
        out.write(f"degraded: answered without {result.failures} failed step(s) ({lost}; the log says why)\n")
    out.write(f"completion time: {result.completion_time:.2f} s\n")


class _Progress(DriftCallbacks):
    """One line per DRIFT step on stderr (only when stderr is a terminal)."""

    def __init__(self, out: TextIO):
        self.out = out
        self.started = time.perf_counter()
        self.done = 0

    def _line(self, text: str) -> None:
        self.out.write(f"[{time.perf_counter() - self.started:6.1f}s] {text}\n")
        self.out.flush()

    def on_query_start(self, config) -> None:  # the primer's calls take a while on a local model
        self._line(f"HyDE expansion, then {config.primer_folds} primer call(s) over the top {config.drift_k_followups} reports")

    def on_primer_done(self, root, reports) -> None:
        self._line(f"primer: {len(reports)} reports, {len(root.follow_ups)} follow-up questions")

    def on_epoch_start(self, epoch, actions) -> None:
        self.done = 0
        self._line(f"epoch {epoch}: {len(actions)} follow-up searches")

    def on_action_completed(self, action, epoch) -> None:
        self.done += 1
        status = "failed" if action.failed else f"score {action.score:g}"
        self._line(f"  [{self.done}] {action.query[:70]} ({status})")

    def on_reduce_start(self, state) -> None:
        self._line("reduce: writing the answer")
