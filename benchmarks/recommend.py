"""Turn the index-type sweep into the ANN recommendation the ingest step uses.

Rule: among all (index type, build params, query params) points with recall@10 >= 0.95, the lowest
p50 latency wins; per dimension, and overall (the type that wins at most dimensions).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from benchmarks import DEFAULT_RESULTS_DIR
from benchmarks._harness import load_records
from benchmarks.retrieval import (
    RECALL_TARGET,
    IndexSpec,
    hnsw_partitions,
    ivf_partitions,
    rq_dimension_ok,
)
from ingest.writer import pq_sub_vectors

STATUS_FILE = Path("/tmp/drift-status/ann-recommendation.md")


def best_per_type(records: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, dict[str, Any]]]:
    """{(rows, dim): {index_type: fastest record meeting the recall target (or most accurate)}}"""
    groups: dict[tuple[int, int], dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        groups[(r["rows"], r["dim"])][r["index_type"]].append(r)
    best: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for key, by_type in sorted(groups.items()):
        best[key] = {}
        for index_type, recs in by_type.items():
            meeting = [r for r in recs if r["recall_at_10"] >= RECALL_TARGET]
            best[key][index_type] = (min(meeting, key=lambda r: r["p50_ms"]) if meeting
                                     else max(recs, key=lambda r: r["recall_at_10"]))
    return best


def winner(best: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    meeting = [r for r in best.values() if r["recall_at_10"] >= RECALL_TARGET]
    return min(meeting, key=lambda r: r["p50_ms"]) if meeting else None


def chosen_index(rows: int, dim: int, results_dir: Path = DEFAULT_RESULTS_DIR) -> IndexSpec:
    """Index type the sweep picked for the nearest measured dimension, with build parameters scaled to
    `rows` (partitions grow with sqrt(rows)). Falls back to IVF_PQ before any sweep exists, and from
    IVF_RQ to IVF_FLAT where LanceDB cannot build it, as ingest does."""
    best = best_per_type(load_records(results_dir, "sweep"))
    candidates = [(abs(d - dim), w) for (_, d), by_type in best.items() if (w := winner(by_type))]
    index_type = min(candidates, key=lambda c: c[0])[1]["index_type"] if candidates else "IVF_PQ"
    if index_type == "IVF_RQ" and not rq_dimension_ok(dim):
        index_type = "IVF_FLAT"
    return scaled_spec(index_type, rows, dim, (min(candidates, key=lambda c: c[0])[1] if candidates else {}))


def scaled_spec(index_type: str, rows: int, dim: int, measured: dict[str, Any]) -> IndexSpec:
    params = measured.get("params", {}) if measured else {}
    if index_type == "IVF_HNSW_SQ":
        return IndexSpec(index_type, {"num_partitions": hnsw_partitions(rows), "m": params.get("m", 20),
                                      "ef_construction": params.get("ef_construction", 150)})
    if index_type == "IVF_PQ":
        return IndexSpec(index_type, {"num_partitions": ivf_partitions(rows), "num_sub_vectors": pq_sub_vectors(dim)})
    return IndexSpec(index_type, {"num_partitions": ivf_partitions(rows)})


def render(records: list[dict[str, Any]]) -> str:
    best = best_per_type(records)
    lines = [
        "# ANN index recommendation (from `python -m benchmarks sweep`)",
        "",
        f"Rule: lowest p50 top-10 latency among settings with recall@10 >= {RECALL_TARGET} against exact",
        "cosine search. Cosine metric. Synthetic clustered vectors (benchmarks/vectors.py), queries",
        "from the same distribution. Machine: see records in benchmarks/results/sweep.json.",
        _versions_line(records),
        "",
        "Index types measured: " + ", ".join(sorted({r["index_type"] for r in records})) + " (of IVF_FLAT, IVF_PQ, IVF_RQ, IVF_HNSW_SQ).",
        "",
        "| rows | dim | index type | build params | query params | recall@10 | p50 ms | p95 ms | build s | meets |",
        "|---:|---:|---|---|---|---:|---:|---:|---:|---|",
    ]
    winners = Counter()
    for (rows, dim), by_type in best.items():
        w = winner(by_type)
        if w:
            winners[w["index_type"]] += 1
        for index_type, r in sorted(by_type.items(), key=lambda kv: kv[1]["p50_ms"]):
            build_keys = {"num_partitions", "num_sub_vectors", "m", "ef_construction"}
            build = {k: v for k, v in r["params"].items() if k in build_keys}
            query = {k: v for k, v in r["params"].items() if k not in build_keys}
            mark = "**chosen**" if r is w else ("yes" if r["recall_at_10"] >= RECALL_TARGET else "no")
            lines.append(f"| {rows:,} | {dim} | {index_type} | {_kv(build)} | {_kv(query)} | "
                         f"{r['recall_at_10']:.3f} | {r['p50_ms']:.2f} | {r['p95_ms']:.2f} | "
                         f"{r['index_build_s']:.1f} | {mark} |")
    lines += ["", "## Recommendation", ""]
    for (rows, dim), by_type in best.items():
        w = winner(by_type)
        lines.append(f"- {rows:,} x {dim}-d: " + (f"`{w['index_type']}` {_kv(w['params'])}" if w
                                                  else "no setting reached the recall target"))
    lines += ["", "Scaling rule used by the retrieval benchmark (benchmarks/retrieval.py):",
              "IVF_PQ / IVF_FLAT / IVF_RQ: num_partitions = round(sqrt(rows)); IVF_PQ num_sub_vectors = dim/16;",
              "IVF_HNSW_SQ: num_partitions = max(1, rows // 250000), m = 20, ef_construction = 150.", ""]
    return "\n".join(lines)


def _versions_line(records: list[dict[str, Any]]) -> str:
    """Which LanceDB built the indexes: its defaults move (IVF_RQ's num_bits went from 1 to 5 in
    lancedb 0.41), and the sweep builds with them, as `lancedb_ann` does."""
    seen = sorted({f"lancedb {v.get('lancedb', '?')}, pylance {v.get('pylance', '?')}"
                   for r in records if (v := r.get("versions"))})
    return (f"Built with LanceDB's defaults for each index type ({'; '.join(seen) or 'versions not recorded'}); "
            "IVF_RQ's default is 1-bit codes before lancedb 0.41 and 5-bit from it.")


def _kv(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(d.items())) or "-"


def write_recommendation(results_dir: Path, status_file: Path | None = STATUS_FILE) -> str:
    text = render(load_records(results_dir, "sweep"))
    (results_dir / "ann-recommendation.md").write_text(text)
    if status_file is not None:
        status_file.parent.mkdir(parents=True, exist_ok=True)
        status_file.write_text(text)
    return text


if __name__ == "__main__":
    print(write_recommendation(DEFAULT_RESULTS_DIR))
    print(json.dumps({"ok": True}))
