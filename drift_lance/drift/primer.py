"""DRIFT primer: HyDE expansion, one ANN query over community reports, one call per fold.

graphrag loads every report and its embedding at start-up and computes a cosine in pandas; here the
only report data read per query is one template report (fetched by id) and the top-k rows the ANN
query returns.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from drift_lance import schema
from drift_lance.config.drift import DRIFTSearchConfig
from drift_lance.drift.action import DriftAction, PrimerFoldAnswer, follow_ups_kept
from drift_lance.drift.llm import BoundedChat
from drift_lance.drift.prompts import DriftPrompts
from drift_lance.errors import EmbeddingMismatchError
from drift_lance.models.base import ChatParams, Embedder, Message, ModelError, Usage
from drift_lance.models.compat import check_embedding_compatibility
from drift_lance.store import IndexStore

__all__ = ["DRIFTPrimer", "PrimerOutcome", "check_embedder", "failed_call_usage", "split_folds"]

log = logging.getLogger(__name__)

REPORT_COLUMNS = ("id", "human_readable_id", "community", "level", "title", "full_content", "rank")
# Report fields kept in the result's context data (the full text is in context_text).
_CONTEXT_COLUMNS = ("id", "human_readable_id", "community", "level", "title", "rank", "_similarity")
_TEMPLATE_CANDIDATES = 8  # random ids tried per template pick (ids may have gaps)
_REPORT_SEPARATOR = "\n\n"  # between the report texts of a fold


@dataclass(slots=True)
class PrimerOutcome:
    root: DriftAction
    reports: pl.DataFrame  # the top-k reports, best first
    hyde_text: str
    build_context_usage: Usage  # the HyDE call
    primer_usage: Usage  # the fold calls
    fold_errors: list[str] = field(default_factory=list)
    hyde_fell_back: bool = False  # the HyDE call failed or was empty: the query itself was embedded


def check_embedder(store: IndexStore, embedder: Embedder) -> None:
    """Query vectors must live in the same space as the stored report vectors (the primer's ANN
    query) and entity vectors (each follow-up's entity mapping): same dimension, and the same
    model unless the index does not know which model made its vectors."""
    if schema.COMMUNITY_REPORTS not in store.manifest.vectors:
        raise EmbeddingMismatchError(
            f"{store.uri}: table {schema.COMMUNITY_REPORTS!r} has no '{schema.VECTOR}' column; DRIFT's "
            "primer needs report embeddings (re-run ingest with report embeddings)"
        )
    for table in (schema.COMMUNITY_REPORTS, schema.ENTITIES):
        info = store.manifest.vectors.get(table)
        if info is not None:
            check_embedding_compatibility(info, embedder, uri=store.uri)


def failed_call_usage(exc: BaseException) -> Usage:
    """What a failed call cost: the tokens the model reported (an unusable structured answer
    carries them), and always one call."""
    return (getattr(exc, "usage", None) or Usage()).of_one_call()


def split_folds(reports: pl.DataFrame, folds: int) -> list[pl.DataFrame]:
    """`folds` contiguous slices whose sizes differ by at most one (larger first); empty slices
    are dropped, so fewer reports than folds gives one fold per report."""
    n = reports.height
    base, extra = divmod(n, folds)
    slices, start = [], 0
    for index in range(folds):
        size = base + (1 if index < extra else 0)
        if size:
            slices.append(reports.slice(start, size))
        start += size
    return slices


class DRIFTPrimer:
    def __init__(
        self,
        *,
        store: IndexStore,
        chat: BoundedChat,
        embedder: Embedder,
        tokenizer,
        config: DRIFTSearchConfig,
        prompts: DriftPrompts,
        rng: random.Random,
        community_level: int | None = None,
    ):
        self.store = store
        # Reports at or under this level (None: all), as graphrag's read_indexer_reports keeps.
        self.community_level = community_level
        self.chat = chat
        self.embedder = embedder
        self.tokenizer = tokenizer
        self.config = config
        self.prompts = prompts
        self.rng = rng

    async def run(self, query: str) -> PrimerOutcome:
        hyde_text, hyde_usage, hyde_fell_back = await self.expand_query(query)
        vector = (await self.embedder.embed([hyde_text], kind="query"))[0]
        if not np.any(vector):  # ANN would return nothing and an exact scan the first rows in table order
            raise EmbeddingMismatchError(
                f"embedder {self.embedder.model_id!r} made an all-zero vector for the expanded query: "
                "it has no direction to rank community reports by"
            )
        reports = await self.top_reports(vector)
        if reports.height == 0:
            raise ModelError(f"{self.store.uri}: table {schema.COMMUNITY_REPORTS!r} returned no reports for the primer")
        answers, primer_usage, errors = await self.decompose(query, reports)
        root = DriftAction.from_primer_folds(
            query,
            answers,
            metadata={
                "context_data": {"reports": reports.select([c for c in _CONTEXT_COLUMNS if c in reports.columns])},
                "context_text": _REPORT_SEPARATOR.join(
                    text for fold in split_folds(reports, self.config.primer_folds) for text in self._fold_texts(fold)
                ),
                "hyde_query": hyde_text,
                **({"fold_errors": errors} if errors else {}),
            },
            max_follow_ups=follow_ups_kept(self.config.drift_k_followups),
        )
        return PrimerOutcome(root, reports, hyde_text, hyde_usage, primer_usage, errors, hyde_fell_back)

    # --- HyDE ---
    async def expand_query(self, query: str) -> tuple[str, Usage, bool]:
        """A hypothetical answer shaped like a random report; falls back to the query itself when
        the model returns nothing or fails (the search can still proceed). The flag says it fell back."""
        template = await self._template_report()
        prompt = self.prompts.hyde.format(query=query, template=template)
        try:
            result = await self.chat.complete(
                [Message("user", prompt)], params=ChatParams(max_tokens=self.config.hyde_max_tokens)
            )
        except Exception as exc:  # noqa: BLE001 - any failed call degrades, as a follow-up's does
            log.warning("HyDE expansion failed (%s: %s); embedding the query as is", type(exc).__name__, exc)
            return query, failed_call_usage(exc), True
        text = result.text.strip()
        if not text:
            log.warning("HyDE expansion was empty; embedding the query as is")
            return query, result.usage.of_one_call(), True
        return text, result.usage.of_one_call(), False

    async def _template_report(self) -> str:
        """One random report's text (at or under the community level), read by id (nothing is scanned)."""
        table = schema.COMMUNITY_REPORTS
        info = self.store.manifest.tables.get(table)
        total = info.rows if info is not None else await self.store.count(table)
        if total == 0:
            return ""
        candidates = [self.rng.randrange(total) for _ in range(_TEMPLATE_CANDIDATES)]
        rows = await self.store.fetch(table, "human_readable_id", candidates, columns=["human_readable_id", "full_content", "level"])
        if self.community_level is not None:
            rows = rows.filter(pl.col("level") <= self.community_level)
        if rows.height == 0:  # ids not dense 0..n-1, or few reports at the level: draw among those there
            rows = await self._random_report_at_level()
            if rows.height == 0:
                return ""
        by_id = dict(zip(rows["human_readable_id"].to_list(), rows["full_content"].to_list(), strict=True))
        for candidate in candidates:
            if candidate in by_id:
                return by_id[candidate] or ""
        return rows["full_content"][0] or ""

    async def _random_report_at_level(self) -> pl.DataFrame:
        """One report drawn uniformly from those at or under the level, as graphrag's
        `secrets.choice(reports)` does (the first one there would shape nearly every expansion at a
        low level, where most random ids miss). Only their ids are scanned."""
        table = schema.COMMUNITY_REPORTS
        found = await self.store.scan(table, columns=["human_readable_id"], where=self._level_filter())
        ids = found["human_readable_id"].drop_nulls().sort()  # sorted: the same seed draws the same report
        if ids.len() == 0:
            return found.clear()
        chosen = ids[self.rng.randrange(ids.len())]
        return await self.store.fetch(table, "human_readable_id", [chosen], columns=["human_readable_id", "full_content"])

    # --- retrieval ---
    async def top_reports(self, vector: np.ndarray) -> pl.DataFrame:
        return await self.store.search(
            schema.COMMUNITY_REPORTS, np.asarray(vector, dtype=np.float32), self.config.drift_k_followups,
            columns=list(REPORT_COLUMNS), where=self._level_filter(),
        )

    def _level_filter(self) -> str | None:
        return None if self.community_level is None else f"level <= {int(self.community_level)}"

    # --- decomposition ---
    async def decompose(self, query: str, reports: pl.DataFrame) -> tuple[list[PrimerFoldAnswer], Usage, list[str]]:
        """One structured call per fold, concurrently. Failed folds are logged and skipped; the
        primer fails only when every fold fails."""
        folds = split_folds(reports, self.config.primer_folds)
        outcomes = await asyncio.gather(*(self._decompose_fold(query, fold) for fold in folds))
        usage = Usage()
        answers: list[PrimerFoldAnswer] = []
        failures: list[Exception] = []
        for answer, fold_usage, failure in outcomes:
            usage = usage + fold_usage
            if failure is None:
                answers.append(answer)  # type: ignore[arg-type]
            else:
                failures.append(failure)
        errors = [f"{type(exc).__name__}: {exc}" for exc in failures]
        if not answers:
            # chained to the first failure, so callers can tell its kind (HTTP status, timeout, ...)
            raise ModelError(f"DRIFT primer: all {len(folds)} primer calls failed: {'; '.join(errors)}") from failures[0]
        return answers, usage, errors

    async def _decompose_fold(self, query: str, fold: pl.DataFrame) -> tuple[PrimerFoldAnswer | None, Usage, Exception | None]:
        prompt = self.prompts.primer.format(
            query=query,
            community_reports=_REPORT_SEPARATOR.join(self._fold_texts(fold)),
            followups=min(5, self.config.drift_k_followups),
        )
        try:
            result = await self.chat.complete([Message("user", prompt)], params=ChatParams(), response_model=PrimerFoldAnswer)
        except Exception as exc:  # noqa: BLE001 - one failed fold is skipped, as a failed follow-up is
            log.warning("primer call failed: %s: %s", type(exc).__name__, exc)
            return None, failed_call_usage(exc), exc
        return result.parsed, result.usage.of_one_call(), None  # type: ignore[return-value]

    def _fold_texts(self, fold: pl.DataFrame) -> list[str]:
        """Report texts of a fold within `primer_llm_max_tokens` (a report that does not fit is
        cut; the reports after it are dropped)."""
        budget = self.config.primer_llm_max_tokens
        texts: list[str] = []
        for text in fold["full_content"].to_list():
            text = text or ""
            # With the separator a next report would follow it by (the texts are joined with it).
            cost = self.tokenizer.count(text + _REPORT_SEPARATOR)
            if cost > budget:
                if budget > 0:  # the last text: no separator after it
                    texts.append(self.tokenizer.truncate(text, budget))
                break
            texts.append(text)
            budget -= cost
        return texts
