"""Build the bundled sample GraphRAG 3.x index from its human-editable source.

The source (`corpus/`) holds what graphrag's LLM steps would have produced: documents split into
text units (markdown), entities, relationships and claims (`corpus.yaml`), and the community
hierarchy with one report per community (`communities.yaml`). Everything graphrag derives
mechanically is computed here, so the parquet files are internally consistent by construction:
ids, human_readable_ids, n_tokens, which text units mention which entity, entity frequency and
degree, relationship combined_degree and text_unit_ids, community membership, relationship_ids,
text_unit_ids, size and period, report full_content, and the text units' reverse links.

Column names, order and Arrow types follow graphrag 3.x's output parquet files exactly.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from drift_lance.errors import DriftLanceError

SOURCE_DIR = Path(__file__).parent / "corpus"
CORPUS_FILE = "corpus.yaml"
COMMUNITIES_FILE = "communities.yaml"
DOCUMENTS_DIR = "documents"
TOKEN_ENCODING = "o200k_base"  # graphrag 3.x's default chunking encoding

# Stable ids: the same source always yields the same index (uuid5 for the ids graphrag draws from
# uuid4, sha512 hex for the ids graphrag hashes from content).
_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://drift-lance.invalid/sample/harrowgate-point")


_M = TypeVar("_M", bound=BaseModel)


class SampleCorpusError(DriftLanceError, ValueError):
    """The sample source files are inconsistent; the message names the file and the field."""


# --------------------------------------------------------------------------------------------------
# Source models (what a human edits)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DocumentSpec(_Strict):
    title: str
    creation_date: str
    units: list[str] = Field(min_length=1)  # markdown files under documents/, in reading order


class EntitySpec(_Strict):
    title: str
    type: Literal["PERSON", "ORGANIZATION", "GEO", "EVENT"]
    description: str
    aliases: list[str] = Field(default_factory=list)

    @field_validator("title")
    @classmethod
    def _upper_case(cls, title: str) -> str:
        if title != title.upper():
            raise ValueError(f"entity titles are upper case like graphrag's, got {title!r}")
        return title


class RelationshipSpec(_Strict):
    source: str
    target: str
    description: str
    weight: float = Field(gt=0)


class ClaimSpec(_Strict):
    subject: str
    object: str = "NONE"
    type: str
    status: Literal["TRUE", "FALSE", "SUSPECTED"]
    start_date: str = "NONE"
    end_date: str = "NONE"
    description: str
    source_text: str


class CorpusSpec(_Strict):
    period: str
    documents: list[DocumentSpec] = Field(min_length=1)
    entities: list[EntitySpec] = Field(min_length=1)
    relationships: list[RelationshipSpec]
    claims: list[ClaimSpec] = Field(default_factory=list)


class FindingSpec(_Strict):
    summary: str
    explanation: str
    entities: list[str] = Field(default_factory=list)
    relationships: list[tuple[str, str]] = Field(default_factory=list)


class ReportSpec(_Strict):
    title: str
    summary: str
    rating: float = Field(ge=0, le=10)
    rating_explanation: str
    findings: list[FindingSpec] = Field(min_length=1)


class CommunitySpec(_Strict):
    key: str  # stable name, the seed of the community's ids
    entities: list[str] = Field(default_factory=list)  # members not in any child
    report: ReportSpec
    children: list[CommunitySpec] = Field(default_factory=list)


class CommunitiesSpec(_Strict):
    communities: list[CommunitySpec] = Field(min_length=1)


@dataclass(frozen=True, slots=True)
class SampleCorpus:
    """The parsed source: specs plus the text of every unit, keyed by its path under documents/."""

    corpus: CorpusSpec
    communities: CommunitiesSpec
    unit_texts: dict[str, str]
    source_dir: Path


def load_sample_corpus(source_dir: Path | None = None) -> SampleCorpus:
    """Read and validate the sample source (the bundled one unless `source_dir` is given)."""
    source_dir = Path(source_dir) if source_dir is not None else SOURCE_DIR
    corpus = _load_yaml_model(source_dir / CORPUS_FILE, CorpusSpec)
    communities = _load_yaml_model(source_dir / COMMUNITIES_FILE, CommunitiesSpec)
    unit_texts: dict[str, str] = {}
    for doc in corpus.documents:
        for unit in doc.units:
            path = source_dir / DOCUMENTS_DIR / unit
            if not path.is_file():
                raise SampleCorpusError(
                    f"{source_dir / CORPUS_FILE}: document {doc.title!r} lists unit {unit!r}, but {path} does not exist"
                )
            if unit in unit_texts:
                raise SampleCorpusError(f"{source_dir / CORPUS_FILE}: unit {unit!r} is listed twice")
            text = path.read_text(encoding="utf-8").strip()
            if not text:
                raise SampleCorpusError(f"{path}: text unit is empty")
            unit_texts[unit] = text
    return SampleCorpus(corpus, communities, unit_texts, source_dir)


def _load_yaml_model(path: Path, model: type[_M]) -> _M:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SampleCorpusError(f"{path}: sample source file is missing") from None
    except yaml.YAMLError as exc:
        raise SampleCorpusError(f"{path}: invalid YAML: {exc}") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
        )
        raise SampleCorpusError(f"{path}: {problems}") from exc


# --------------------------------------------------------------------------------------------------
# graphrag 3.x output layout (column order and Arrow types as graphrag writes them)

_str, _i64, _f64 = pa.string(), pa.int64(), pa.float64()
_strs, _i64s = pa.list_(pa.string()), pa.list_(pa.int64())
_findings = pa.list_(pa.struct([("explanation", _str), ("summary", _str)]))

GRAPHRAG3_SCHEMAS: dict[str, pa.Schema] = {
    "documents": pa.schema(
        [("id", _str), ("human_readable_id", _i64), ("title", _str), ("text", _str),
         ("text_unit_ids", _strs), ("creation_date", _str), ("metadata", pa.null())]
    ),
    "text_units": pa.schema(
        [("id", _str), ("human_readable_id", _i64), ("text", _str), ("n_tokens", _i64),
         ("document_id", _str), ("entity_ids", _strs), ("relationship_ids", _strs), ("covariate_ids", _strs)]
    ),
    "entities": pa.schema(
        [("id", _str), ("human_readable_id", _i64), ("title", _str), ("type", _str), ("description", _str),
         ("text_unit_ids", _strs), ("frequency", _i64), ("degree", _i64)]
    ),
    "relationships": pa.schema(
        [("id", _str), ("human_readable_id", _i64), ("source", _str), ("target", _str), ("description", _str),
         ("weight", _f64), ("combined_degree", _i64), ("text_unit_ids", _strs)]
    ),
    "communities": pa.schema(
        [("id", _str), ("human_readable_id", _i64), ("community", _i64), ("level", _i64), ("parent", _i64),
         ("children", _i64s), ("title", _str), ("entity_ids", _strs), ("relationship_ids", _strs),
         ("text_unit_ids", _strs), ("period", _str), ("size", _i64)]
    ),
    "community_reports": pa.schema(
        [("id", _str), ("human_readable_id", _i64), ("community", _i64), ("level", _i64), ("parent", _i64),
         ("children", _i64s), ("title", _str), ("summary", _str), ("full_content", _str), ("rank", _f64),
         ("rating_explanation", _str), ("findings", _findings), ("full_content_json", _str),
         ("period", _str), ("size", _i64)]
    ),
    "covariates": pa.schema(
        [("id", _str), ("human_readable_id", _i64), ("covariate_type", _str), ("type", _str),
         ("description", _str), ("subject_id", _str), ("object_id", _str), ("status", _str),
         ("start_date", _str), ("end_date", _str), ("source_text", _str), ("text_unit_id", _str)]
    ),
}
TABLE_NAMES = tuple(GRAPHRAG3_SCHEMAS)


# --------------------------------------------------------------------------------------------------
# Derivation


def _uuid(kind: str, name: str) -> str:
    return str(uuid.uuid5(_ID_NAMESPACE, f"{kind}:{name}"))


def _sha512(text: str) -> str:
    return hashlib.sha512(text.encode("utf-8")).hexdigest()


def _pair(a: str, b: str) -> frozenset[str]:
    return frozenset((a, b))


class _MentionFinder:
    """Which entities a text mentions: case-sensitive whole-word alias matching, longest alias first
    at each position, so "Harrowgate Light Trust" never also counts as "Harrowgate Light"."""

    def __init__(self, entities: list[EntitySpec], where: str):
        self._title_of: dict[str, str] = {}
        for entity in entities:
            for alias in {entity.title, *entity.aliases}:
                other = self._title_of.setdefault(alias, entity.title)
                if other != entity.title:
                    raise SampleCorpusError(f"{where}: alias {alias!r} is used by both {other!r} and {entity.title!r}")
        alternatives = "|".join(re.escape(a) for a in sorted(self._title_of, key=len, reverse=True))
        self._pattern = re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)")

    def titles_in(self, text: str) -> set[str]:
        return {self._title_of[m.group(0)] for m in self._pattern.finditer(text)}


@dataclass(slots=True)
class _Community:
    spec: CommunitySpec
    number: int
    level: int
    parent: int
    children: list[int]
    members: set[str]  # entity titles, including all descendants'


def _flatten_communities(spec: CommunitiesSpec) -> list[_Community]:
    """Number communities as graphrag does: all of level 0 first, then level 1, and so on."""
    flat: list[_Community] = []
    frontier: list[tuple[CommunitySpec, _Community | None]] = [(c, None) for c in spec.communities]
    level = 0
    while frontier:
        next_frontier: list[tuple[CommunitySpec, _Community | None]] = []
        for community_spec, parent in frontier:
            node = _Community(community_spec, len(flat), level, parent.number if parent else -1, [], set())
            flat.append(node)
            if parent is not None:
                parent.children.append(node.number)
            next_frontier.extend((child, node) for child in community_spec.children)
        frontier, level = next_frontier, level + 1
    by_number = {c.number: c for c in flat}
    for node in reversed(flat):  # children come after parents, so members roll up in one pass
        node.members |= set(node.spec.entities)
        if node.parent >= 0:
            by_number[node.parent].members |= node.members
    return flat


def _data_reference(entity_ids: Iterable[int], relationship_ids: Iterable[int]) -> str:
    parts = []
    if entity_ids:
        parts.append(f"Entities ({', '.join(map(str, entity_ids))})")
    if relationship_ids:
        parts.append(f"Relationships ({', '.join(map(str, relationship_ids))})")
    return f" [Data: {'; '.join(parts)}]" if parts else ""


def _render_full_content(title: str, summary: str, findings: list[dict[str, str]]) -> str:
    sections = [f"## {f['summary']}\n\n{f['explanation']}" for f in findings]
    return "\n\n".join([f"# {title}", summary, *sections])


def derive_tables(sample: SampleCorpus, *, encoding: str = TOKEN_ENCODING) -> dict[str, pa.Table]:
    """All seven graphrag 3.x tables for the sample, as Arrow tables in graphrag's layout."""
    from drift_lance.models.tokens import get_tokenizer

    corpus, corpus_file = sample.corpus, sample.source_dir / CORPUS_FILE
    communities_file = sample.source_dir / COMMUNITIES_FILE
    tokenizer = get_tokenizer(encoding)

    # Entities: unique titles, in source order.
    entity_specs: dict[str, EntitySpec] = {}
    for entity in corpus.entities:
        if entity.title in entity_specs:
            raise SampleCorpusError(f"{corpus_file}: entities: title {entity.title!r} appears twice")
        entity_specs[entity.title] = entity
    entity_hrid = {title: i for i, title in enumerate(entity_specs)}
    entity_id = {title: _uuid("entity", title) for title in entity_specs}

    # Text units and documents.
    units: list[dict] = []
    documents: list[dict] = []
    for doc_index, doc in enumerate(corpus.documents):
        texts = [sample.unit_texts[u] for u in doc.units]
        doc_text = "\n\n".join(texts)
        doc_id = _sha512(doc_text)
        unit_ids = []
        for unit_path, text in zip(doc.units, texts, strict=True):
            unit_id = _sha512(text)
            unit_ids.append(unit_id)
            units.append({"path": unit_path, "id": unit_id, "human_readable_id": len(units), "text": text,
                          "n_tokens": tokenizer.count(text), "document_id": doc_id})
        documents.append({"id": doc_id, "human_readable_id": doc_index + 1, "title": doc.title, "text": doc_text,
                          "text_unit_ids": unit_ids, "creation_date": doc.creation_date, "metadata": None})

    # Which entities each unit mentions.
    finder = _MentionFinder(corpus.entities, f"{corpus_file}: entities")
    mentions = {u["id"]: finder.titles_in(u["text"]) for u in units}
    entity_units = {t: [u["id"] for u in units if t in mentions[u["id"]]] for t in entity_specs}
    for title, unit_ids in entity_units.items():
        if not unit_ids:
            aliases = sorted({title, *entity_specs[title].aliases})
            raise SampleCorpusError(
                f"{corpus_file}: entities: {title!r} is not mentioned in any text unit (aliases {aliases})"
            )

    # Relationships: endpoints must exist; a relationship is evidenced by every unit naming both ends.
    seen_pairs: set[frozenset[str]] = set()
    relationships: list[dict] = []
    for i, rel in enumerate(corpus.relationships):
        where = f"{corpus_file}: relationships[{i}] ({rel.source} -> {rel.target})"
        for end in (rel.source, rel.target):
            if end not in entity_specs:
                raise SampleCorpusError(f"{where}: {end!r} is not an entity title")
        if rel.source == rel.target or _pair(rel.source, rel.target) in seen_pairs:
            raise SampleCorpusError(f"{where}: self-loop or duplicate pair")
        seen_pairs.add(_pair(rel.source, rel.target))
        unit_ids = [u["id"] for u in units if {rel.source, rel.target} <= mentions[u["id"]]]
        if not unit_ids:
            raise SampleCorpusError(f"{where}: no text unit mentions both entities")
        relationships.append({"id": _uuid("relationship", f"{rel.source}->{rel.target}"), "human_readable_id": i,
                              "source": rel.source, "target": rel.target, "description": rel.description,
                              "weight": float(rel.weight), "text_unit_ids": unit_ids})
    neighbours: dict[str, set[str]] = {t: set() for t in entity_specs}
    for rel in relationships:
        neighbours[rel["source"]].add(rel["target"])
        neighbours[rel["target"]].add(rel["source"])
    degree = {t: len(n) for t, n in neighbours.items()}
    for rel in relationships:
        rel["combined_degree"] = degree[rel["source"]] + degree[rel["target"]]
    rel_by_pair = {_pair(r["source"], r["target"]): r for r in relationships}

    entities = [
        {"id": entity_id[t], "human_readable_id": entity_hrid[t], "title": t, "type": spec.type,
         "description": spec.description, "text_unit_ids": entity_units[t], "frequency": len(entity_units[t]),
         "degree": degree[t]}
        for t, spec in entity_specs.items()
    ]

    # Claims: each belongs to the one text unit that quotes its source_text.
    covariates: list[dict] = []
    for i, claim in enumerate(corpus.claims):
        where = f"{corpus_file}: claims[{i}] ({claim.subject} {claim.type})"
        if claim.subject not in entity_specs:
            raise SampleCorpusError(f"{where}: subject {claim.subject!r} is not an entity title")
        if claim.object != "NONE" and claim.object not in entity_specs:
            raise SampleCorpusError(f"{where}: object {claim.object!r} is neither an entity title nor NONE")
        quoting = [u["id"] for u in units if claim.source_text in u["text"]]
        if len(quoting) != 1:
            raise SampleCorpusError(f"{where}: source_text must occur in exactly one text unit, found {len(quoting)}")
        covariates.append({"id": _uuid("claim", f"{i}:{claim.subject}:{claim.type}"), "human_readable_id": i,
                           "covariate_type": "claim", "type": claim.type, "description": claim.description,
                           "subject_id": claim.subject, "object_id": claim.object, "status": claim.status,
                           "start_date": claim.start_date, "end_date": claim.end_date,
                           "source_text": claim.source_text, "text_unit_id": quoting[0]})

    # Text units' reverse links.
    text_units = []
    for u in units:
        text_units.append({
            "id": u["id"], "human_readable_id": u["human_readable_id"], "text": u["text"], "n_tokens": u["n_tokens"],
            "document_id": u["document_id"],
            "entity_ids": [entity_id[t] for t in entity_specs if t in mentions[u["id"]]],
            "relationship_ids": [r["id"] for r in relationships if u["id"] in r["text_unit_ids"]],
            "covariate_ids": [c["id"] for c in covariates if c["text_unit_id"] == u["id"]],
        })

    community_rows, report_rows = _derive_communities(
        sample, communities_file, entity_specs, entity_id, entity_hrid, relationships, rel_by_pair, units
    )

    rows = {"documents": documents, "text_units": text_units, "entities": entities, "relationships": relationships,
            "communities": community_rows, "community_reports": report_rows, "covariates": covariates}
    return {name: _to_table(rows[name], schema) for name, schema in GRAPHRAG3_SCHEMAS.items()}


def _derive_communities(
    sample: SampleCorpus,
    communities_file: Path,
    entity_specs: dict[str, EntitySpec],
    entity_id: dict[str, str],
    entity_hrid: dict[str, int],
    relationships: list[dict],
    rel_by_pair: dict[frozenset[str], dict],
    units: list[dict],
) -> tuple[list[dict], list[dict]]:
    flat = _flatten_communities(sample.communities)
    unit_order = {u["id"]: u["human_readable_id"] for u in units}

    # Membership must be a partition: every entity listed exactly once in the whole tree.
    listed: dict[str, str] = {}
    for node in flat:
        for title in node.spec.entities:
            if title not in entity_specs:
                raise SampleCorpusError(
                    f"{communities_file}: community {node.spec.key!r}: {title!r} is not an entity title"
                )
            if title in listed:
                raise SampleCorpusError(
                    f"{communities_file}: {title!r} is listed in both {listed[title]!r} and {node.spec.key!r}"
                )
            listed[title] = node.spec.key
    unassigned = [t for t in entity_specs if t not in listed]
    if unassigned:
        raise SampleCorpusError(f"{communities_file}: entities in no community: {unassigned}")

    period = sample.corpus.period
    community_rows, report_rows = [], []
    for node in flat:
        where = f"{communities_file}: community {node.spec.key!r}"
        members = [t for t in entity_specs if t in node.members]  # source order, like graphrag's
        rels = [r for r in relationships if r["source"] in node.members and r["target"] in node.members]
        unit_ids = sorted({u for r in rels for u in r["text_unit_ids"]}, key=unit_order.__getitem__)
        community_rows.append({
            "id": _uuid("community", node.spec.key), "human_readable_id": node.number, "community": node.number,
            "level": node.level, "parent": node.parent, "children": node.children, "title": f"Community {node.number}",
            "entity_ids": [entity_id[t] for t in members], "relationship_ids": [r["id"] for r in rels],
            "text_unit_ids": unit_ids, "period": period, "size": len(members),
        })
        findings = [_render_finding(f, node.members, rels, entity_hrid, rel_by_pair, f"{where}: finding {i}")
                    for i, f in enumerate(node.spec.report.findings)]
        report = node.spec.report
        report_rows.append({
            "id": _sha512(f"community_report:{node.spec.key}"), "human_readable_id": node.number,
            "community": node.number, "level": node.level, "parent": node.parent, "children": node.children,
            "title": report.title, "summary": report.summary,
            "full_content": _render_full_content(report.title, report.summary, findings),
            "rank": float(report.rating), "rating_explanation": report.rating_explanation,
            "findings": [{"explanation": f["explanation"], "summary": f["summary"]} for f in findings],
            "full_content_json": json.dumps(
                {"title": report.title, "summary": report.summary, "findings": findings,
                 "rating": float(report.rating), "rating_explanation": report.rating_explanation},
                indent=4, ensure_ascii=False,
            ),
            "period": period, "size": len(members),
        })
    # graphrag summarises the deepest level first, and writes reports in that order.
    report_rows.sort(key=lambda r: (-r["level"], r["community"]))
    return community_rows, report_rows


def _render_finding(
    finding: FindingSpec,
    members: set[str],
    community_rels: list[dict],
    entity_hrid: dict[str, int],
    rel_by_pair: dict[frozenset[str], dict],
    where: str,
) -> dict[str, str]:
    """A finding's explanation with graphrag's data reference appended, e.g.
    "... of the crew [Data: Entities (3, 7); Relationships (12)]." (ids are human_readable_ids)."""
    community_rel_ids = {r["id"] for r in community_rels}
    entity_refs = []
    for title in finding.entities:
        if title not in members:
            raise SampleCorpusError(f"{where}: entity {title!r} is not a member of this community")
        entity_refs.append(entity_hrid[title])
    rel_refs = []
    for source, target in finding.relationships:
        rel = rel_by_pair.get(_pair(source, target))
        if rel is None or rel["id"] not in community_rel_ids:
            raise SampleCorpusError(
                f"{where}: relationship {source} -> {target} is not a relationship of this community"
            )
        rel_refs.append(rel["human_readable_id"])
    explanation = " ".join(finding.explanation.split()).rstrip(".")
    return {"summary": finding.summary, "explanation": f"{explanation}{_data_reference(entity_refs, rel_refs)}."}


def _to_table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    columns = {field.name: [row[field.name] for row in rows] for field in schema}
    return pa.Table.from_pydict(columns, schema=schema)


def build_sample_index(out_dir: Path, *, source_dir: Path | None = None) -> Path:
    """Write the sample index as graphrag 3.x parquet files (`entities.parquet`, ...) into `out_dir`
    (created if needed; existing sample files are overwritten) and return `out_dir`. No embeddings:
    ingest computes them with the configured embedder."""
    out_dir = Path(out_dir)
    tables = derive_tables(load_sample_corpus(source_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, table in tables.items():
        tmp = out_dir / f".{name}.parquet.tmp"
        pq.write_table(table, tmp)
        tmp.replace(out_dir / f"{name}.parquet")  # never leave a half-written file under the real name
    return out_dir
