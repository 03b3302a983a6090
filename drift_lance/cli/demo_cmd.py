"""`drift-lance demo`: bundled sample index -> LanceDB -> one DRIFT query, all offline.

Uses the embedded models (SmolLM2 via llama.cpp for chat, multilingual-e5-small for embeddings)
whatever OpenAI variables are set, so the demo behaves the same on every machine. The DRIFT config
is deliberately small (3 reports, 1 primer fold, 1 follow-up epoch) to finish in a few minutes on
two CPU cores; the index is built once per workdir and reused.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


# Small enough for a 135M-parameter model on 2 cores; every other field keeps graphrag's default.
DEMO_DRIFT: dict[str, Any] = {
    "drift_k_followups": 3,
    "primer_folds": 1,
    "n_depth": 1,
    "primer_llm_max_tokens": 3_000,
    "hyde_max_tokens": 200,  # SmolLM2 otherwise writes 512 tokens of HyDE before the primer starts
    "llm_timeout": None,
    "local_search_max_data_tokens": 2_500,
    "data_max_tokens": 2_000,
    "local_search_llm_max_gen_tokens": 256,
    "reduce_max_tokens": 300,
    "concurrency": 2,
    "seed": 42,
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="build the bundled sample index, ingest it and run a DRIFT query, offline",
        description="Builds the bundled sample GraphRAG index (a small original corpus about a lighthouse "
        "restoration), ingests it into LanceDB with the embedded embedder, and answers one question with "
        "DRIFT search on the embedded chat model. No network needed.",
    )
    parser.add_argument(
        "--workdir", metavar="DIR",
        help="where the sample index and the LanceDB database go (default: ~/.cache/drift-lance/demo, "
        "or ./drift-lance-demo when the cache dir is not writable)",
    )
    parser.add_argument("--query", help="the question (default: the sample's showcase question)")
    parser.add_argument("--reingest", action="store_true", help="rebuild and re-ingest the sample index")
    parser.set_defaults(func=run)


@dataclass
class DemoTimings:
    seconds: dict[str, float] = field(default_factory=dict)

    def record(self, step: str, started: float) -> None:
        self.seconds[step] = time.perf_counter() - started


def run(args: argparse.Namespace) -> int:
    from drift_lance.sample import SAMPLE_QUERY

    from drift_lance.cli import UsageError

    query = SAMPLE_QUERY if args.query is None else args.query
    if not query.strip():
        raise UsageError("--query must not be empty")
    workdir = given_workdir(Path(args.workdir).expanduser()) if args.workdir else default_workdir()
    timings = DemoTimings()
    result = asyncio.run(run_demo(workdir, query, reingest=args.reingest, timings=timings))
    print_report(query, result, timings)
    return 0


def default_workdir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "drift-lance" / "demo"
    try:
        return writable_folder(cache)
    except OSError:
        return Path.cwd() / "drift-lance-demo"


def given_workdir(path: Path) -> Path:
    """--workdir, created if need be; a UsageError naming it when it cannot hold the demo's files,
    before minutes go into loading models."""
    from drift_lance.cli import UsageError

    if path.exists() and not path.is_dir():
        raise UsageError(f"--workdir {path}: is a file, not a folder")
    try:
        return writable_folder(path)
    except OSError as exc:
        raise UsageError(f"--workdir {path}: cannot use it as the demo's folder: {exc.strerror or exc}") from None


def writable_folder(path: Path) -> Path:
    """`path`, created if missing, once a file could be written in it (OSError otherwise)."""
    path.mkdir(parents=True, exist_ok=True)
    probe = path / ".write-test"
    probe.touch()
    probe.unlink()
    return path


def demo_model_settings() -> Any:
    """The embedded offline models, regardless of OPENAI_* / DRIFT_LANCE_* model variables."""
    from drift_lance.config.models import ModelSettings

    return ModelSettings.model_validate({"chat_backend": "local", "embedding_backend": "local"})


async def run_demo(workdir: Path, query: str, *, reingest: bool, timings: DemoTimings) -> Any:
    from drift_lance.config.drift import DRIFTSearchConfig
    from drift_lance.drift.search import open_drift_search
    from drift_lance.models import get_chat_model, get_embedder

    models = demo_model_settings()
    started = time.perf_counter()
    embedder = await asyncio.to_thread(get_embedder, models)
    timings.record("load embedder", started)

    db = workdir / "lancedb"
    await _ensure_index(workdir, db, embedder, reingest=reingest, timings=timings)

    started = time.perf_counter()
    chat = await asyncio.to_thread(get_chat_model, models)
    timings.record("load chat model", started)

    _status(f"DRIFT search: {query}")
    started = time.perf_counter()
    search = await open_drift_search(
        str(db), config=DRIFTSearchConfig(**DEMO_DRIFT), chat_model=chat, embedder=embedder, callbacks=[_Progress()]
    )
    try:
        result = await search.search(query)
    finally:
        await search.close()
    timings.record("DRIFT query", started)
    return result


async def _ensure_index(workdir: Path, db: Path, embedder: Any, *, reingest: bool, timings: DemoTimings) -> None:
    from drift_lance._ingest_package import import_ingest
    from drift_lance._lance_store import open_store
    from drift_lance.errors import StoreError
    from drift_lance.sample import build_sample_index

    marker = workdir / SAMPLE_DIGEST_FILE
    digest = _sample_digest(embedder.model_id)
    if not reingest and db.exists() and marker.is_file() and marker.read_text().strip() == digest:
        try:
            await (await open_store(str(db))).close()
            _status(f"using the sample index already ingested in {db}")
            return
        except StoreError:
            pass  # half-built or foreign folder: rebuild below
    started = time.perf_counter()
    source = build_sample_index(workdir / "graphrag")
    timings.record("build sample index", started)
    _status(f"ingesting the sample index into {db} (embedding with {embedder.model_id})")
    started = time.perf_counter()
    marker.unlink(missing_ok=True)
    await import_ingest().run_ingest(source, str(db), embedder=embedder, reembed=True, progress=sys.stderr.isatty())
    marker.write_text(digest + "\n")
    timings.record("ingest", started)


SAMPLE_DIGEST_FILE = "sample-ingested.sha256"


def _sample_digest(embedder_id: str) -> str:
    """What an ingested sample was made from: the sample's source files, the embedder and the
    drift-lance version. A demo reuses its ingest only while all three are unchanged."""
    import hashlib

    import drift_lance
    from drift_lance.sample import SOURCE_DIR

    digest = hashlib.sha256(f"{drift_lance.__version__}\n{embedder_id}\n".encode())
    for path in sorted(p for p in Path(SOURCE_DIR).rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(SOURCE_DIR)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def print_report(query: str, result: Any, timings: DemoTimings) -> None:
    from drift_lance.cli.query_cmd import print_stats

    answer = result.response if isinstance(result.response, str) else str(result.response)
    out = sys.stdout
    out.write(f"\nQuestion: {query}\n\nAnswer:\n{answer.strip()}\n")
    print_stats(result, out)
    out.write("\nsteps:\n")
    for step, seconds in timings.seconds.items():
        out.write(f"  {step:<20}{seconds:8.1f} s\n")
    out.flush()


def _status(text: str) -> None:
    print(f"drift-lance demo: {text}", file=sys.stderr, flush=True)


class _Progress:
    """One stderr line per DRIFT stage, so a multi-minute CPU run visibly progresses."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def _line(self, text: str) -> None:
        _status(f"[{time.perf_counter() - self.started:6.1f}s] {text}")

    def on_primer_done(self, root: Any, reports: list) -> None:
        self._line(f"primer read {len(reports)} community reports, proposed {len(root.follow_ups)} follow-ups")

    def on_action_completed(self, action: Any, epoch: int) -> None:
        self._line(f"follow-up done: {action.query[:70]}")

    def on_reduce_start(self, state: Any) -> None:
        self._line("writing the final answer")
