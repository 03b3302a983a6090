"""`python -m benchmarks COMMAND ...` -- see `python -m benchmarks --help`.

Every command appends/replaces its records in DIR/<name>.json (default benchmarks/results/) and then
re-renders DIR/results.md and the PNG plots from everything in DIR.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from pathlib import Path

from benchmarks import DEFAULT_RESULTS_DIR
from benchmarks._harness import CaseFailed, log, work_dir
from benchmarks.graphrag_side import ENV_PYTHON

# `all --quick`: tiny sizes that exercise every benchmark's code path in well under a minute or two.
QUICK = {"rows": 2_000, "dim": 64, "queries": 20, "entities": 300, "drift_queries": 1}


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _rows(text: str) -> int:
    """A row count every benchmark can use: the synthetic index's minimum, and more than the top 10
    each query ranks (numpy's top-10 partition needs 11 rows)."""
    from ingest.synthetic import MIN_ENTITIES

    value = _positive(text)
    if value < MIN_ENTITIES:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_ENTITIES}, got {text}")
    return value


def _latency_ms(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of milliseconds, got {text}")
    return value


def _latencies_ms(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated milliseconds, e.g. 0,20; got {text!r}") from None
    if not values or any(not 0 <= v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated milliseconds >= 0, e.g. 0,20; got {text!r}")
    return values


def _index_types(text: str) -> list[str]:
    from drift_lance.config.ingest import VectorIndexType

    return _choices(text, typing.get_args(VectorIndexType), "index type")


def _methods(text: str) -> list[str]:
    from benchmarks.retrieval import METHODS

    return _choices(text, METHODS, "method")


def _choices(text: str, known: typing.Sequence[str], what: str) -> list[str]:
    """A comma-separated list of `known` names, or an argparse error naming the unknown ones."""
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in known]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown {what}(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(known)}")
    return chosen


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="drift-lance benchmarks: each command measures, writes its records to OUT/<name>.json, "
        "then re-renders OUT/results.md and the plots.",
    )
    work_help = "where generated datasets go (default $DRIFT_LANCE_BENCH_WORK, else benchmarks/work/, git-ignored)"
    parser.add_argument("--work", type=Path, default=None, help=work_help)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        p.add_argument("--out", type=Path, default=argparse.SUPPRESS,
                       help=f"results directory (default {DEFAULT_RESULTS_DIR.relative_to(DEFAULT_RESULTS_DIR.parents[1])}/, "
                            "the committed figures; `all --quick`: WORK/quick-results/)")
        p.add_argument("--work", type=Path, default=argparse.SUPPRESS, help=work_help)  # before or after COMMAND
        return p

    p = add("retrieval", "top-10 latency/QPS/recall: LanceDB ANN vs LanceDB flat vs numpy vs engine")
    p.add_argument("--rows", type=_rows, required=True, help="vectors in the synthetic table")
    p.add_argument("--dim", type=_positive, required=True, help="their dimension")
    p.add_argument("--queries", type=_positive, default=200, help="timed top-10 queries per method (the README's figures: 100); the engine's own cases always time "
                        "100, measure recall over 1000 and alternate with numpy over 3 rounds of 100 (1 round at 10^6)")
    p.add_argument("--methods", type=_methods, default=None,
                   help="comma-separated subset of lancedb_ann,lancedb_flat,numpy_exact,engine; None: all of them")
    _graphrag_option(p)

    p = add("sweep", "ANN index-type sweep (recall-latency curves) and the index recommendation")
    p.add_argument("--rows", type=_rows, required=True)
    p.add_argument("--dim", type=_positive, required=True)
    p.add_argument("--queries", type=_positive, default=200)
    p.add_argument("--index-types", type=_index_types, default="IVF_FLAT,IVF_PQ,IVF_RQ,IVF_HNSW_SQ")

    p = add("context", "local-search context building latency and peak RSS")
    p.add_argument("--rows", type=_rows, required=True, help="entities in the synthetic index")
    p.add_argument("--queries", type=_positive, default=30, help="contexts built (the README's figures: 50 at 10^4, else 30)")
    p.add_argument("--dim", type=_positive, default=1536, help="vector dimension")
    _graphrag_option(p)

    p = add("drift", "end-to-end DRIFT against a fake OpenAI server with a fixed latency")
    p.add_argument("--latency-ms", type=_latency_ms, default=200.0, help="simulated latency of every LLM call")
    p.add_argument("--queries", type=_positive, default=3, help="timed DRIFT queries (the README's figures: 10 / 10 / 8 at 10^4 / 10^5 / 10^6)")
    p.add_argument("--rows", type=_rows, default=10_000, help="entities in the synthetic index")
    p.add_argument("--dim", type=_positive, default=1536)

    p = add("first-answer", "whole-process wall time and peak RSS of `drift-lance query` with an instant LLM")
    p.add_argument("--rows", type=_rows, required=True, help="entities in the synthetic index")
    p.add_argument("--dim", type=_positive, default=1536)
    p.add_argument("--runs", type=_positive, default=5, help="whole-process runs (the README's figures: 10)")

    p = add("startup", "engine start-up time and RSS on an ingested index")
    p.add_argument("--rows", type=_rows, required=True)
    p.add_argument("--dim", type=_positive, default=1536)

    p = add("ingest", "ingest throughput (rows/s) and index build time")
    p.add_argument("--rows", type=_rows, required=True, help="entities in the synthetic index")
    p.add_argument("--dim", type=_positive, default=1536)

    p = add("s3", "query latency on local disk vs S3-compatible storage on loopback (moto + counting proxy)")
    p.add_argument("--rows", type=_rows, default=10_000, help="entities in the synthetic index")
    p.add_argument("--dim", type=_positive, default=384)
    p.add_argument("--queries", type=_positive, default=30)
    p.add_argument("--latency-ms", type=_latencies_ms, default="0", help="comma-separated delays added per S3 request, e.g. 0,20")
    p.add_argument("--dulce", type=Path, default=None, help="measure this GraphRAG folder (the dulce index) instead")

    add("report", "re-render results.md and the plots from the JSON records")

    p = add("all", "every benchmark; --quick for the small smoke configuration")
    p.add_argument("--quick", action="store_true")
    return parser


def _graphrag_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--graphrag-python", default=None, metavar="PATH",
                   help="interpreter of a virtualenv with graphrag==3.3.0, to run graphrag's own code side by side "
                        "(default: $DRIFT_LANCE_GRAPHRAG_PYTHON, or this interpreter if it imports graphrag; off: never)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    explicit = getattr(args, "graphrag_python", None)  # `all` reads the environment variable only
    if args.command in ("retrieval", "context", "all") and explicit != "off":
        if explicit is not None or os.environ.get(ENV_PYTHON):
            _check_graphrag_python(parser, explicit)
    work = args.work or work_dir()
    work.mkdir(parents=True, exist_ok=True)
    out: Path = getattr(args, "out", None) or default_out(args, work)
    try:
        _dispatch(args, out, work)
    except CaseFailed as exc:
        print(f"benchmarks {args.command}: failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    from benchmarks import report

    report.render_all(out)
    log(f"results in {out}")
    return 0


def default_out(args: argparse.Namespace, work: Path) -> Path:
    """Where results go without --out: the committed results directory, except for the smoke run,
    whose 2,000-row records would otherwise replace the figures the README quotes."""
    if args.command == "all" and args.quick:
        return work / "quick-results"
    return DEFAULT_RESULTS_DIR


def _check_graphrag_python(parser: argparse.ArgumentParser, explicit: str | None) -> None:
    """Before any data is generated: the interpreter exists and imports graphrag."""
    import subprocess

    from benchmarks.graphrag_side import graphrag_python

    try:
        python = graphrag_python(explicit)
    except FileNotFoundError as exc:
        parser.error(str(exc))
    assert python is not None
    # An interpreter must say graphrag's version: `/bin/true` exits 0 too.
    probe = subprocess.run([python, "-c", "import graphrag.query, importlib.metadata as m; print(m.version('graphrag'))"],
                           capture_output=True, text=True)
    if probe.returncode != 0 or not probe.stdout.strip():
        last = (probe.stderr.strip().splitlines() or ["it printed no graphrag version"])[-1]
        parser.error(f"--graphrag-python / {ENV_PYTHON}: {python} cannot import graphrag ({last})")


def _dispatch(args: argparse.Namespace, out: Path, work: Path) -> None:
    from benchmarks import retrieval

    if args.command == "retrieval":
        retrieval.run_retrieval(args.rows, args.dim, args.queries, out, work,
                                methods=args.methods or retrieval.METHODS,
                                graphrag=args.graphrag_python)
    elif args.command == "sweep":
        from benchmarks.recommend import write_recommendation

        for index_type in args.index_types:  # argparse converts the string default too
            retrieval.run_sweep(args.rows, args.dim, args.queries, out, work, index_types=[index_type])
            # Refresh after each index type so the ingest step can use a partial answer early.
            write_recommendation(out, status_file=None if out != DEFAULT_RESULTS_DIR else _status_file())
    elif args.command == "context":
        from benchmarks import context

        context.run_context(args.rows, args.dim, args.queries, out, work, graphrag=args.graphrag_python)
    elif args.command == "drift":
        from benchmarks import drift_overhead

        drift_overhead.run_drift(args.latency_ms, args.queries, args.rows, args.dim, out, work)
    elif args.command == "first-answer":
        from benchmarks import drift_overhead

        drift_overhead.run_first_answer(args.rows, args.dim, args.runs, out, work)
    elif args.command == "startup":
        from benchmarks import engine

        engine.run_startup(args.rows, args.dim, out, work)
    elif args.command == "ingest":
        from benchmarks import engine

        engine.run_ingest_benchmark(args.rows, args.dim, out, work)
    elif args.command == "s3":
        from benchmarks import s3_latency

        s3_latency.run_s3_latency(args.rows, args.dim, args.queries, out, work, dulce=args.dulce,
                                  latencies_ms=args.latency_ms)
    elif args.command == "all":
        run_all(args.quick, out, work)


def _status_file() -> Path:
    from benchmarks.recommend import STATUS_FILE

    return STATUS_FILE


def run_all(quick: bool, out: Path, work: Path) -> None:
    """Every benchmark once. --quick: the smoke sizes; otherwise the README's full configuration."""
    from benchmarks import context, drift_overhead, engine, retrieval

    if quick:
        q = QUICK
        retrieval.run_sweep(q["rows"], q["dim"], q["queries"], out, work)
        retrieval.run_retrieval(q["rows"], q["dim"], q["queries"], out, work)
        engine.run_ingest_benchmark(q["entities"], q["dim"], out, work)
        engine.run_startup(q["entities"], q["dim"], out, work)
        context.run_context(q["entities"], q["dim"], 5, out, work)
        drift_overhead.run_drift(20.0, q["drift_queries"], q["entities"], q["dim"], out, work)
        drift_overhead.run_first_answer(q["entities"], q["dim"], 1, out, work)
        return
    # The README's sitting (about 35 minutes on the 2-core VM, ~40 GB of generated data).
    for rows in (10_000, 100_000, 1_000_000):
        for dim in (384, 1536):
            retrieval.run_retrieval(rows, dim, 100, out, work)
    for rows in (100_000, 1_000_000):
        engine.run_ingest_benchmark(rows, 1536, out, work)
    for rows, queries in ((10_000, 50), (100_000, 30), (1_000_000, 30)):
        # graphrag's own builder takes ~2 s per context at 10^5 and loads every table into pandas: not at 10^6
        context.run_context(rows, 1536, queries, out, work, graphrag=None if rows < 1_000_000 else "off")
    for rows, queries in ((10_000, 10), (100_000, 10), (1_000_000, 8)):
        drift_overhead.run_drift(200.0, queries, rows, 1536, out, work)
    drift_overhead.run_drift(1000.0, 6, 10_000, 1536, out, work)
    engine.run_startup(1_000_000, 1536, out, work)
    for dim in (1536, 384):
        drift_overhead.run_first_answer(1_000_000, dim, 10, out, work)

if __name__ == "__main__":
    sys.exit(main())
