"""Deterministic synthetic GraphRAG 3.x index, from 10^3 to 10^6 entities, for tests and benchmarks.

    from ingest.synthetic import generate_index
    path = generate_index("/tmp/synth", n_entities=100_000, dim=1536, seed=0)

    python -m ingest.synthetic OUT --entities 100000 --dim 384

Shape of the data (modelled on graphrag's output):
- a 3-level community hierarchy (level 0 roots -> 1 -> 2 leaves; every entity is in one community per
  level); about one community report per 16 entities, like graphrag;
- clustered embeddings: random root centroids, each child its parent plus noise, entities their
  leaf centroid plus noise (noise scaled by 1/sqrt(dim), so the cluster structure is the same in
  every dimension; unit-norm float32) -- ANN recall measured here resembles real data more than
  uniform noise does;
- power-law (Pareto) entity degrees, edges mostly inside a leaf community;
- text units (one per 4 entities), documents, covariates (claims), written as graphrag 3.x parquet;
- vectors in a graphrag-3 style `lancedb/` folder (`entity_description`, `community_full_content`,
  `text_unit_text`), streamed in chunks so 10^6 x 1536 never sits in memory at once.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa

__all__ = ["generate_index"]

_WORDS = (
    "signal archive vault protocol reactor harbor council drone cipher meadow orbit lantern canyon "
    "ledger beacon fortress river engine garden mirror tower relay glacier market frontier compass "
    "forge summit atlas delta echo falcon granite horizon island jungle kernel lattice matrix nebula"
).split()
_TYPES = ("PERSON", "ORGANIZATION", "GEO", "EVENT", "TECHNOLOGY")
# What an output folder holds: the marker names it as this tool's, so a later run may replace it.
MARKER = ".drift-lance-synthetic"
_MARKER_TEXT = "A synthetic graphrag index written by `python -m ingest.synthetic`; the next run into this folder replaces it.\n"
_TABLES = ("entities", "relationships", "communities", "community_reports", "text_units", "documents", "covariates")
_OUTPUT_FILES = frozenset({*(f"{name}.parquet" for name in _TABLES), "lancedb"})
_VECTOR_TABLES = frozenset({"entity_description.lance", "community_full_content.lance", "text_unit_text.lance"})
_LEAF_SIZE = 21  # mean entities per leaf; with fan-out 4 this gives ~1 community per 16 entities
_FANOUT = 4
_CHUNK = 50_000  # rows per vector chunk written to lancedb
MIN_ENTITIES = 16  # generate_index refuses smaller indexes


def _phrase(rng: np.random.Generator, n: int, topic: int) -> str:
    """A few words, biased to a topic's vocabulary so text embedders also see clusters."""
    words = [_WORDS[(topic * 7 + int(rng.integers(0, 6))) % len(_WORDS)] if rng.random() < 0.6 else _WORDS[int(rng.integers(0, len(_WORDS)))] for _ in range(n)]
    return " ".join(words)


def _hierarchy(rng: np.random.Generator, n_entities: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Leaf community per entity, and parent per community; communities numbered level by level."""
    n_leaves = max(1, round(n_entities / _LEAF_SIZE))
    n_mid = max(1, round(n_leaves / _FANOUT))
    n_root = max(1, round(n_mid / _FANOUT))
    # uneven but non-empty sizes: random cut points over a sorted assignment
    leaf_of_entity = np.sort(rng.integers(0, n_leaves, size=n_entities))
    leaf_of_entity[:n_leaves] = np.arange(min(n_leaves, n_entities))  # every leaf non-empty
    leaf_of_entity = np.sort(leaf_of_entity)
    mid_of_leaf = np.sort(np.concatenate([np.arange(n_mid), rng.integers(0, n_mid, size=max(0, n_leaves - n_mid))]))[:n_leaves]
    root_of_mid = np.sort(np.concatenate([np.arange(n_root), rng.integers(0, n_root, size=max(0, n_mid - n_root))]))[:n_mid]
    # community numbers: roots 0..R-1, mids R..R+M-1, leaves after
    level = np.concatenate([np.zeros(n_root, int), np.ones(n_mid, int), np.full(n_leaves, 2)])
    parent = np.concatenate([np.full(n_root, -1), root_of_mid, n_root + mid_of_leaf])
    leaf_number = n_root + n_mid + leaf_of_entity
    return leaf_number, level, parent, np.array([n_root, n_mid, n_leaves])


def _centroids(rng: np.random.Generator, level: np.ndarray, parent: np.ndarray, dim: int) -> np.ndarray:
    """Community centroids: roots random, each child its parent plus noise (parents come first)."""
    centroids = np.zeros((len(level), dim), dtype=np.float32)
    for c in range(len(level)):
        noise = rng.standard_normal(dim).astype(np.float32)
        # noise of norm ~0.9 next to the unit parent: a child keeps cos ~0.75 with its parent
        vector = noise if parent[c] < 0 else centroids[parent[c]] + 0.9 * noise / np.sqrt(dim)
        centroids[c] = vector / np.linalg.norm(vector)
    return centroids


def _perturb(centres: np.ndarray, scale: float, rng: np.random.Generator) -> np.ndarray:
    """Unit vectors near `centres`: Gaussian noise of expected norm `scale` (in any dimension)."""
    dim = centres.shape[1]
    return _unit(centres + (scale / np.sqrt(dim)) * rng.standard_normal(centres.shape, dtype=np.float32))


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _write_vectors(path: Path, ids: list[str], chunks: Iterator[np.ndarray], dim: int) -> None:
    """A graphrag-3 style lancedb table (id, vector) written chunk by chunk."""
    import lance

    schema = pa.schema([pa.field("id", pa.string()), pa.field("vector", pa.list_(pa.float32(), dim))])

    def batches() -> Iterator[pa.RecordBatch]:
        start = 0
        for matrix in chunks:
            end = start + matrix.shape[0]
            vectors = pa.FixedSizeListArray.from_arrays(pa.array(matrix.reshape(-1)), dim)
            yield pa.RecordBatch.from_arrays([pa.array(ids[start:end], pa.string()), vectors], schema=schema)
            start = end

    lance.write_dataset(pa.RecordBatchReader.from_batches(schema, batches()), str(path), schema=schema, mode="overwrite")


def _clear_output(out: Path, overwrite: bool) -> None:
    """Remove a previous synthetic index at `out`; refuse to delete anything else unless `overwrite`."""
    if not out.exists():
        return
    if not out.is_dir():
        raise NotADirectoryError(f"{out}: is a file, not a folder; choose another output folder")
    if not any(out.iterdir()):
        return
    if not (overwrite or _is_synthetic_index(out)):
        raise FileExistsError(
            f"{out}: folder is not empty and not a synthetic index written by this tool; choose another "
            "folder or pass --overwrite (overwrite=True) to replace it"
        )
    shutil.rmtree(out)


def _is_synthetic_index(folder: Path) -> bool:
    """Written by `generate_index` and holding nothing else: its marker, or (folders written before
    the marker existed) exactly its files. A user's file added to it keeps it from being deleted."""
    entries = {p.name for p in folder.iterdir()}
    vectors = folder / "lancedb"
    if not entries - {MARKER} <= _OUTPUT_FILES:
        return False
    if vectors.exists() and not (vectors.is_dir() and {p.name for p in vectors.iterdir()} <= _VECTOR_TABLES):
        return False
    return MARKER in entries or entries == _OUTPUT_FILES


def generate_index(
    out_dir: str | Path,
    *,
    n_entities: int,
    dim: int = 1536,
    seed: int = 0,
    relationships_per_entity: float = 2.0,
    entities_per_text_unit: int = 4,
    noise: float = 0.8,
    overwrite: bool = False,
) -> Path:
    """Write a synthetic graphrag 3.x index with `n_entities` entities to `out_dir`; return its path.
    Same arguments, same bytes of content (deterministic for a seed). An existing `out_dir` is replaced
    only when it is empty or a synthetic index written here before, or with `overwrite`; otherwise
    FileExistsError (NotADirectoryError when it is a file)."""
    if n_entities < MIN_ENTITIES:
        raise ValueError(f"n_entities must be >= {MIN_ENTITIES}, got {n_entities}")
    out = Path(out_dir)
    _clear_output(out, overwrite)
    (out / "lancedb").mkdir(parents=True)
    (out / MARKER).write_text(_MARKER_TEXT)  # first, so an interrupted run's folder is still recognised
    rng = np.random.default_rng(seed)

    # ---- communities and entities
    leaf, level, parent, _ = _hierarchy(rng, n_entities)
    n_comm = len(level)
    ancestors = np.stack([leaf, parent[leaf], parent[parent[leaf]]], axis=1)  # level 2, 1, 0
    ids = [f"e{seed:02x}-{i:08d}" for i in range(n_entities)]
    titles = [f"ENTITY {i}" for i in range(n_entities)]
    n_units = max(1, n_entities // entities_per_text_unit)
    unit_ids = [f"t{seed:02x}-{i:08d}" for i in range(n_units)]
    # each entity is mentioned in 1-3 text units near its index (neighbours share units)
    mentions = [sorted({min(n_units - 1, i // entities_per_text_unit + int(k)) for k in range(int(rng.integers(1, 4)))}) for i in range(n_entities)]

    # ---- relationships with power-law degrees, mostly inside a leaf community
    weight = rng.pareto(1.6, size=n_entities) + 1.0
    p = weight / weight.sum()
    n_edges = int(n_entities * relationships_per_entity)
    src = rng.choice(n_entities, size=n_edges, p=p)
    local = rng.random(n_edges) < 0.8
    leaf_start = np.searchsorted(leaf, leaf)  # entities are sorted by leaf: block starts/ends
    leaf_end = np.searchsorted(leaf, leaf, side="right")
    tgt_local = leaf_start[src] + (rng.random(n_edges) * (leaf_end[src] - leaf_start[src])).astype(int)
    tgt = np.where(local, tgt_local, rng.choice(n_entities, size=n_edges, p=p))
    pairs = np.unique(np.stack([np.minimum(src, tgt), np.maximum(src, tgt)], axis=1), axis=0)
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    degree = np.bincount(pairs.ravel(), minlength=n_entities)

    types = [_TYPES[int(t)] for t in rng.integers(0, len(_TYPES), size=n_entities)]
    pl.DataFrame(
        {
            "id": ids,
            "human_readable_id": np.arange(n_entities),
            "title": titles,
            "type": types,
            "description": [f"{titles[i]} is a {types[i].lower()} linked to {_phrase(rng, 8, int(leaf[i]))}." for i in range(n_entities)],
            "text_unit_ids": [[unit_ids[u] for u in m] for m in mentions],
            "frequency": [len(m) for m in mentions],
            "degree": degree,
        },
        schema_overrides={"text_unit_ids": pl.List(pl.String)},
    ).write_parquet(out / "entities.parquet")

    rel_ids = [f"r{seed:02x}-{i:08d}" for i in range(len(pairs))]
    pl.DataFrame(
        {
            "id": rel_ids,
            "human_readable_id": np.arange(len(pairs)),
            "source": [titles[a] for a in pairs[:, 0]],
            "target": [titles[b] for b in pairs[:, 1]],
            "description": [f"{titles[a]} works with {titles[b]}" for a, b in pairs],
            "weight": rng.uniform(1.0, 10.0, size=len(pairs)).round(1),
            "combined_degree": degree[pairs[:, 0]] + degree[pairs[:, 1]],
            "text_unit_ids": [[unit_ids[mentions[a][0]]] for a in pairs[:, 0]],
        },
        schema_overrides={"text_unit_ids": pl.List(pl.String)},
    ).write_parquet(out / "relationships.parquet")

    # ---- communities and reports
    members: list[list[int]] = [[] for _ in range(n_comm)]
    for column in range(3):
        for entity, community in enumerate(ancestors[:, column]):
            members[community].append(entity)
    children: list[list[int]] = [[] for _ in range(n_comm)]
    for c in range(n_comm):
        if parent[c] >= 0:
            children[parent[c]].append(c)
    comm_ids = [f"c{seed:02x}-{c:06d}" for c in range(n_comm)]
    entity_set_rel: dict[int, list[str]] = {}
    rel_leaf = leaf[pairs[:, 0]]
    for r, c in enumerate(rel_leaf):
        entity_set_rel.setdefault(int(c), []).append(rel_ids[r])
    comm_rels = [entity_set_rel.get(c, []) if level[c] == 2 else [] for c in range(n_comm)]
    comm_units = [sorted({unit_ids[mentions[e][0]] for e in members[c][:64]}) for c in range(n_comm)]
    pl.DataFrame(
        {
            "id": comm_ids,
            "human_readable_id": np.arange(n_comm),
            "community": np.arange(n_comm),
            "level": level,
            "parent": parent,
            "children": children,
            "title": [f"Community {c}" for c in range(n_comm)],
            "entity_ids": [[ids[e] for e in m] for m in members],
            "relationship_ids": comm_rels,
            "text_unit_ids": comm_units,
            "period": ["2025-01-01"] * n_comm,
            "size": [len(m) for m in members],
        },
        schema_overrides={"children": pl.List(pl.Int64), "entity_ids": pl.List(pl.String), "relationship_ids": pl.List(pl.String), "text_unit_ids": pl.List(pl.String)},
    ).write_parquet(out / "communities.parquet")

    report_titles, summaries, contents, findings = [], [], [], []
    for c in range(n_comm):
        lead = ", ".join(titles[e] for e in members[c][:3])
        title = f"{_phrase(rng, 2, c).title()} network around {lead}"
        summary = f"Community {c} (level {level[c]}) groups {len(members[c])} entities led by {lead}: {_phrase(rng, 12, c)}."
        found = [{"summary": f"{titles[e]} role", "explanation": f"{titles[e]} connects to {_phrase(rng, 6, c)}."} for e in members[c][:3]]
        report_titles.append(title)
        summaries.append(summary)
        findings.append(found)
        contents.append(f"# {title}\n\n{summary}\n\n" + "\n\n".join(f"## {f['summary']}\n\n{f['explanation']}" for f in found))
    pl.DataFrame(
        {
            "id": [f"rep{seed:02x}-{c:06d}" for c in range(n_comm)],
            "human_readable_id": np.arange(n_comm),
            "community": np.arange(n_comm),
            "level": level,
            "parent": parent,
            "children": children,
            "title": report_titles,
            "summary": summaries,
            "full_content": contents,
            "rank": rng.uniform(1.0, 10.0, size=n_comm).round(1),
            "rating_explanation": ["synthetic impact rating"] * n_comm,
            "findings": findings,
            "full_content_json": [json.dumps({"title": t}) for t in report_titles],
            "period": ["2025-01-01"] * n_comm,
            "size": [len(m) for m in members],
        },
        schema_overrides={"children": pl.List(pl.Int64)},
    ).write_parquet(out / "community_reports.parquet")

    # ---- text units, documents, covariates
    unit_members: list[list[int]] = [[] for _ in range(n_units)]
    for e, m in enumerate(mentions):
        for u in m:
            unit_members[u].append(e)
    unit_entities = [[ids[e] for e in members_] for members_ in unit_members]
    n_docs = max(1, n_units // 50)
    doc_ids = [f"d{seed:02x}-{i:06d}" for i in range(n_docs)]
    unit_doc = [doc_ids[min(n_docs - 1, u * n_docs // n_units)] for u in range(n_units)]
    n_claims = max(1, n_entities // 10)
    claim_subject = rng.integers(0, n_entities, size=n_claims)
    claim_unit = [mentions[s][0] for s in claim_subject]
    unit_claims: list[list[str]] = [[] for _ in range(n_units)]
    claim_ids = [f"cv{seed:02x}-{i:07d}" for i in range(n_claims)]
    for i, u in enumerate(claim_unit):
        unit_claims[u].append(claim_ids[i])
    unit_rels: list[list[str]] = [[] for _ in range(n_units)]
    for r, a in enumerate(pairs[:, 0]):
        unit_rels[mentions[a][0]].append(rel_ids[r])
    texts = [f"{' '.join(titles[e] for e in ents[:4])} {_phrase(rng, 30, u)}." for u, ents in enumerate(unit_members)]
    pl.DataFrame(
        {
            "id": unit_ids,
            "human_readable_id": np.arange(n_units),
            "text": texts,
            "n_tokens": [len(t.split()) * 4 // 3 for t in texts],
            "document_id": unit_doc,
            "entity_ids": unit_entities,
            "relationship_ids": unit_rels,
            "covariate_ids": unit_claims,
        },
        schema_overrides={"entity_ids": pl.List(pl.String), "relationship_ids": pl.List(pl.String), "covariate_ids": pl.List(pl.String)},
    ).write_parquet(out / "text_units.parquet")
    doc_units: dict[str, list[str]] = {}
    for u, d in enumerate(unit_doc):
        doc_units.setdefault(d, []).append(unit_ids[u])
    pl.DataFrame(
        {
            "id": doc_ids,
            "human_readable_id": np.arange(n_docs),
            "title": [f"document_{i}.txt" for i in range(n_docs)],
            "text": [f"Synthetic document {i}." for i in range(n_docs)],
            "text_unit_ids": [doc_units.get(d, []) for d in doc_ids],
            "creation_date": ["2025-01-01"] * n_docs,
        },
        schema_overrides={"text_unit_ids": pl.List(pl.String)},
    ).write_parquet(out / "documents.parquet")
    pl.DataFrame(
        {
            "id": claim_ids,
            "human_readable_id": np.arange(n_claims),
            "covariate_type": ["claim"] * n_claims,
            "type": ["INVOLVEMENT"] * n_claims,
            "description": [f"{titles[s]} was involved in {_phrase(rng, 5, int(leaf[s]))}" for s in claim_subject],
            "subject_id": [titles[s] for s in claim_subject],
            "object_id": [titles[int(o)] for o in rng.integers(0, n_entities, size=n_claims)],
            "status": ["TRUE"] * n_claims,
            "start_date": ["2025-01-01T00:00:00"] * n_claims,
            "end_date": ["2025-01-02T00:00:00"] * n_claims,
            "source_text": [texts[u][:80] for u in claim_unit],
            "text_unit_id": [unit_ids[u] for u in claim_unit],
        }
    ).write_parquet(out / "covariates.parquet")

    # ---- vectors, chunked: entities from their leaf centroid, reports from their community's,
    # text units from the mean of the entities they mention
    centroids = _centroids(rng, level, parent, dim)
    vec_rng = np.random.default_rng(seed + 1)

    def entity_chunks() -> Iterator[np.ndarray]:
        for start in range(0, n_entities, _CHUNK):
            yield _perturb(centroids[leaf[start : start + _CHUNK]], noise, vec_rng)

    _write_vectors(out / "lancedb" / "entity_description.lance", ids, entity_chunks(), dim)

    def report_chunks() -> Iterator[np.ndarray]:
        for start in range(0, n_comm, _CHUNK):
            yield _perturb(centroids[start : start + _CHUNK], 0.5 * noise, vec_rng)

    _write_vectors(out / "lancedb" / "community_full_content.lance", [f"rep{seed:02x}-{c:06d}" for c in range(n_comm)], report_chunks(), dim)

    unit_leaf = np.array([leaf[min(n_entities - 1, u * entities_per_text_unit)] for u in range(n_units)])

    def unit_chunks() -> Iterator[np.ndarray]:
        for start in range(0, n_units, _CHUNK):
            yield _perturb(centroids[unit_leaf[start : start + _CHUNK]], noise, vec_rng)

    _write_vectors(out / "lancedb" / "text_unit_text.lance", unit_ids, unit_chunks(), dim)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ingest.synthetic", description="Write a synthetic graphrag 3.x index.")
    parser.add_argument(
        "out", metavar="OUT",
        help="output folder; an existing one is replaced only if it is empty or an earlier output of this tool",
    )
    parser.add_argument("--entities", type=int, default=10_000, help="number of entities (default 10000)")
    parser.add_argument("--dim", type=int, default=1536, help="vector dimension (default 1536)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true", help="replace OUT whatever folder it is (deletes its contents)")
    args = parser.parse_args(argv)
    try:
        path = generate_index(args.out, n_entities=args.entities, dim=args.dim, seed=args.seed, overwrite=args.overwrite)
    except (FileExistsError, NotADirectoryError, ValueError) as exc:  # the user's input: one line, exit 2
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
