"""Local search settings: graphrag's `local_search` block plus the context builder's parameters.

Field names and defaults follow graphrag 3.x (`LocalSearchDefaults` and the parameters the graphrag
API passes to `LocalSearchMixedContext.build_context`), so a graphrag `local_search:` block can be
used as is. `top_k_mapped_entities` (the builder's name) is accepted for `top_k_entities`.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["INT32_MAX", "LOCAL_FILE_KEYS", "LOCAL_PROMPT_FIELDS", "LocalSearchConfig", "empty_prompt_is_bundled"]

# Upper bound of settings that reach LanceDB filters or a model's `seed`: a larger integer fails
# there with an overflow deep in the engine instead of a settings error naming the field.
INT32_MAX = 2**31 - 1


class LocalSearchConfig(BaseModel):
    """Every knob of a local search. Token budgets use `encoding` (o200k_base, like graphrag 3.x)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, populate_by_name=True)

    # --- graphrag's local_search settings ---
    prompt: str | None = Field(None, description="System prompt file ({context_data}, {response_type}); None = bundled.")
    completion_model_id: str = Field("default_completion_model", description="Chat model entry for the answer.")
    embedding_model_id: str = Field("default_embedding_model", description="Embedder entry for the query vector.")
    max_context_tokens: int = Field(12_000, ge=0, description="Token budget of the whole context.")
    text_unit_prop: float = Field(0.5, ge=0, le=1, description="Share of the budget for source text units.")
    community_prop: float = Field(0.15, ge=0, le=1, description="Share of the budget for community reports.")
    conversation_history_max_turns: int = Field(5, ge=0, description="Previous user turns used.")
    top_k_entities: int = Field(
        10,
        ge=0,
        validation_alias=AliasChoices("top_k_entities", "top_k_mapped_entities"),
        description="Entities mapped to the query (the ANN query asks for twice as many, like graphrag).",
    )
    top_k_relationships: int = Field(10, ge=0, description="Out-of-network relationships kept per selected entity.")

    # --- LocalSearchMixedContext parameters, with the values graphrag's API passes ---
    community_level: int = Field(2, ge=0, le=INT32_MAX, description="Deepest community level used for membership and reports.")
    include_claims: bool = Field(True, description="Add the claims (covariates) section when the index has one.")
    conversation_history_user_turns_only: bool = True
    include_entity_rank: bool = True
    rank_description: str = "number of relationships"
    include_relationship_weight: bool = True
    relationship_ranking_attribute: Literal["rank", "weight"] = "rank"
    include_community_rank: bool = False
    min_community_rank: float = 0
    use_community_summary: bool = False
    community_context_name: str = "Reports"
    column_delimiter: str = Field("|", min_length=1, max_length=1)  # one character: a CSV delimiter, as in graphrag
    include_entity_names: list[str] = Field(default_factory=list)
    exclude_entity_names: list[str] = Field(default_factory=list)

    # --- drift-lance extensions ---
    encoding: Literal["o200k_base", "cl100k_base"] = Field("o200k_base", description="Token encoding for budgets.")
    response_type: str = Field("multiple paragraphs", min_length=1, description="Target length and format of the answer.")
    reproduce_reference_defects: bool = Field(
        False,
        description=(
            "Render graphrag 3.x's defects verbatim: an empty Reports section as the literal '[]', an "
            "Entities header with no rows when the local budget is zero, a Conversation History "
            "header with no turns when none fits, and a Sources section separated by '|' whatever "
            "column_delimiter says. Off (default): the empty sections are left out and Sources uses "
            "column_delimiter."
        ),
    )
    carry_relationship_links: bool = Field(
        False,
        description=(
            "Keep graphrag's per-relationship `links` attribute from one build to the next, as "
            "graphrag's long-lived context builder does (it then shows in later contexts for "
            "relationships those builds never re-rank). Off (default): each build starts fresh, so "
            "a context depends only on its own query and settings."
        ),
    )
    llm_timeout: float | None = Field(180.0, gt=0, description="Seconds the answer may take (streams: per token).")

    @field_validator("prompt", mode="before")
    @classmethod
    def _empty_prompt_is_bundled(cls, value: object) -> object:
        return empty_prompt_is_bundled(value)

    @model_validator(mode="after")
    def _props_fit_budget(self) -> LocalSearchConfig:
        # Same rule as graphrag's validate_context.
        if self.community_prop + self.text_unit_prop > 1:
            raise ValueError(
                f"community_prop + text_unit_prop must be <= 1 (got {self.community_prop} + {self.text_unit_prop})"
            )
        return self


def empty_prompt_is_bundled(value: object) -> object:
    """A blank prompt path (`prompt = ""`, `DRIFT_LANCE_LOCAL__PROMPT=`) is no prompt file, so the
    bundled prompt, as `none` is; it read the current directory ("prompt file : Is a directory").
    A leading `~` is the home folder, as in a shell."""
    if isinstance(value, str):
        return os.path.expanduser(value) if value.strip() else None
    return value


# Fields holding prompt file paths: in a settings file they are relative to the file.
LOCAL_PROMPT_FIELDS = ("prompt",)
# Keys a `local_search` block may have: the fields and the builder's name for top_k_entities.
LOCAL_FILE_KEYS = (*LocalSearchConfig.model_fields, "top_k_mapped_entities")
