"""`python -m benchmarks COMMAND ...` -- see `python -m benchmarks --help`.

Every command appends/replaces its records in DIR/<name>.json (default benchmarks/results/) and then
re-renders DIR/results.md and the PNG plots from everything in DIR.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks import DEFAULT_RESULTS_DIR
from benchmarks._harness import CaseFailed, log, work_dir

# `all --quick`: tiny sizes that exercise every benchmark's code path in well under a minute or two.
QUICK = {"rows": 2_000, "dim": 64, "queries": 20, "entities": 300, "drift_queries": 1}


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _methods(text: str) -> list[str]:
    from benchmarks.retrieval import METHODS

    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise argparse.ArgumentTypeError(f"unknown method(s) {', '.join(unknown) or '(none given)'}; "
                                         f"choose from {', '.join(METHODS)}")
    return methods


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=None,
                        help="where generated datasets go (default benchmarks/work/, git-ignored)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR, help="results directory")
        return p

    p = add("retrieval", "top-10 latency/QPS/recall: LanceDB ANN vs LanceDB flat vs numpy vs engine")
    p.add_argument("--rows", type=_positive, required=True)
    p.add_argument("--dim", type=_positive, required=True)
    p.add_argument("--queries", type=_positive, default=200)
    p.add_argument("--methods", type=_methods, default=None,
                   help="comma-separated subset of lancedb_ann,lancedb_flat,numpy_exact,engine (default: all)")
    _graphrag_option(p)

    p = add("sweep", "ANN index-type sweep (recall-latency curves) and the index recommendation")
    p.add_argument("--rows", type=_positive, required=True)
    p.add_argument("--dim", type=_positive, required=True)
    p.add_argument("--queries", type=_positive, default=200)
    p.add_argument("--index-types", default="IVF_FLAT,IVF_PQ,IVF_RQ,IVF_HNSW_SQ")

    p = add("context", "local-search context building latency and peak RSS")
    p.add_argument("--rows", type=_positive, required=True, help="entities in the synthetic index")
    p.add_argument("--queries", type=_positive, default=30)
    p.add_argument("--dim", type=_positive, default=1536)
    _graphrag_option(p)

    p = add("drift", "end-to-end DRIFT against a fake OpenAI server with a fixed latency")
    p.add_argument("--latency-ms", type=float, default=200.0)
    p.add_argument("--queries", type=_positive, default=3)
    p.add_argument("--rows", type=_positive, default=10_000, help="entities in the synthetic index")
    p.add_argument("--dim", type=_positive, default=1536)

    p = add("first-answer", "whole-process wall time and peak RSS of `drift-lance query` with an instant LLM")
    p.add_argument("--rows", type=_positive, required=True, help="entities in the synthetic index")
    p.add_argument("--dim", type=_positive, default=1536)
    p.add_argument("--runs", type=_positive, default=5)

    p = add("startup", "engine start-up time and RSS on an ingested index")
    p.add_argument("--rows", type=_positive, required=True)
    p.add_argument("--dim", type=_positive, default=1536)

    p = add("ingest", "ingest throughput (rows/s) and index build time")
    p.add_argument("--rows", type=_positive, required=True, help="entities in the synthetic index")
    p.add_argument("--dim", type=_positive, default=1536)

    p = add("s3", "query latency on local disk vs S3-compatible storage on loopback (moto + counting proxy)")
    p.add_argument("--rows", type=_positive, default=10_000, help="entities in the synthetic index")
    p.add_argument("--dim", type=_positive, default=384)
    p.add_argument("--queries", type=_positive, default=30)
    p.add_argument("--latency-ms", default="0", help="comma-separated delays added per S3 request, e.g. 0,20")
    p.add_argument("--dulce", type=Path, default=None, help="measure this GraphRAG folder (the dulce index) instead")

    add("report", "re-render results.md and the plots from the JSON records")

    p = add("all", "every benchmark; --quick for the small smoke configuration")
    p.add_argument("--quick", action="store_true")
    return parser


def _graphrag_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--graphrag-python", default=None, metavar="PATH",
                   help="interpreter of a virtualenv with graphrag==3.3.0, to run graphrag's own code side by side "
                        "(default: $DRIFT_LANCE_GRAPHRAG_PYTHON, or this interpreter if it imports graphrag)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    work = args.work or work_dir()
    work.mkdir(parents=True, exist_ok=True)
    out: Path = args.out
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


def _dispatch(args: argparse.Namespace, out: Path, work: Path) -> None:
    from benchmarks import retrieval

    if args.command == "retrieval":
        retrieval.run_retrieval(args.rows, args.dim, args.queries, out, work,
                                methods=args.methods or retrieval.METHODS,
                                graphrag=args.graphrag_python)
    elif args.command == "sweep":
        from benchmarks.recommend import write_recommendation

        types = [t.strip() for t in args.index_types.split(",") if t.strip()]
        for index_type in types:
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
                                  latencies_ms=[float(x) for x in args.latency_ms.split(",") if x.strip()])
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
    for rows in (10_000, 100_000, 1_000_000):
        for dim in (384, 1536):
            retrieval.run_retrieval(rows, dim, 100, out, work)
    for rows in (100_000, 1_000_000):
        engine.run_ingest_benchmark(rows, 1536, out, work)
    for rows in (10_000, 100_000, 1_000_000):
        context.run_context(rows, 1536, 50, out, work)
    drift_overhead.run_drift(200.0, 5, 10_000, 1536, out, work)
    engine.run_startup(1_000_000, 1536, out, work)
    drift_overhead.run_first_answer(1_000_000, 1536, 5, out, work)


if __name__ == "__main__":
    sys.exit(main())
