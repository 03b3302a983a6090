"""DRIFT search settings: graphrag's `drift_search` block, field for field, plus a few extensions.

Sources, lowest precedence first: defaults (graphrag 3.x's), a config file (TOML or YAML; a
`drift_search:` / `[drift_search]` or `drift:` section, or the whole file), environment variables
`DRIFT_LANCE_DRIFT__<FIELD>` (e.g. `DRIFT_LANCE_DRIFT__N_DEPTH=2`), then `--set KEY=VALUE` strings.
A graphrag `settings.yaml` is accepted as is: its `drift_search:` block is read and keys we do not
know are ignored with a warning. Prompt paths in a file are resolved relative to that file.
"""

from __future__ import annotations

import logging
import os
import tomllib
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from drift_lance.config.local import INT32_MAX, empty_prompt_is_bundled
from drift_lance.errors import ConfigError, did_you_mean
from drift_lance.object_store import has_uri_scheme

__all__ = [
    "DRIFTSearchConfig", "ENV_PREFIX", "file_relative_prompts", "load_drift_config", "parse_set_options",
    "read_config_mapping", "section_values",
]

log = logging.getLogger(__name__)

ENV_PREFIX = "DRIFT_LANCE_DRIFT__"

# Keys graphrag versions wrote in `drift_search:` that have another name here.
_RENAMED_KEYS = {"chat_model_id": "completion_model_id"}
_SECTION_NAMES = ("drift_search", "drift")


class DRIFTSearchConfig(BaseModel):
    """Every field of graphrag's DRIFTSearchConfig (same names, same defaults) plus drift-lance
    extensions at the end. Token budgets count tokens with the query tokenizer."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, frozen=False)

    # --- prompts (paths to text files; None = the bundled prompts/drift_*.txt) ---
    prompt: str | None = Field(None, description="Local follow-up prompt file ({global_query}, {followups}, {context_data}, {response_type}).")
    reduce_prompt: str | None = Field(None, description="Reduce prompt file ({context_data}, {response_type}).")

    # --- models: names of entries in the models settings ---
    completion_model_id: str = Field("default_completion_model", description="Chat model entry used for every DRIFT call.")
    embedding_model_id: str = Field("default_embedding_model", description="Embedder entry used for the HyDE and follow-up query vectors.")

    # --- budgets and generation parameters ---
    data_max_tokens: int = Field(12_000, gt=0, description="Token budget of the intermediate answers sent to the reduce call (lowest scores dropped first).")
    reduce_max_tokens: int | None = Field(None, gt=0, description="Cap on reduce output tokens (max_tokens) when reduce_max_completion_tokens is unset.")
    reduce_temperature: float = Field(0.0, ge=0, le=2, description="Temperature of the reduce call.")
    reduce_max_completion_tokens: int | None = Field(None, gt=0, description="Cap on reduce output tokens; wins over reduce_max_tokens.")
    concurrency: int = Field(32, ge=1, description="Most LLM calls in flight at once for one query (HyDE, primer folds, actions, reduce).")
    drift_k_followups: int = Field(20, ge=1, description="Reports the primer retrieves, and actions run per epoch.")
    primer_folds: int = Field(5, ge=1, description="Primer calls; the top reports are split into this many folds.")
    primer_llm_max_tokens: int = Field(12_000, gt=0, description="Token budget of the report text in one primer call.")
    n_depth: int = Field(3, ge=0, description="Follow-up epochs after the primer.")

    # --- local search run for each action ---
    local_search_text_unit_prop: float = Field(0.9, ge=0, le=1, description="Share of the local context budget for text units.")
    local_search_community_prop: float = Field(0.1, ge=0, le=1, description="Share of the local context budget for community reports.")
    local_search_top_k_mapped_entities: int = Field(10, ge=1, description="Entities mapped to each follow-up query.")
    local_search_top_k_relationships: int = Field(10, ge=0, description="Out-of-network relationships per mapped entity.")
    local_search_max_data_tokens: int = Field(12_000, gt=0, description="Token budget of one local context.")
    local_search_temperature: float = Field(0.0, ge=0, le=2, description="Temperature of the action calls.")
    local_search_top_p: float = Field(1.0, gt=0, le=1, description="top_p of the action calls.")
    local_search_n: int = Field(1, ge=1, description="n of the action calls (the first choice is used).")
    local_search_llm_max_gen_tokens: int | None = Field(None, gt=0, description="Cap on action output tokens when the completion-tokens cap is unset.")
    local_search_llm_max_gen_completion_tokens: int | None = Field(None, gt=0, description="Cap on action output tokens; wins over local_search_llm_max_gen_tokens.")

    # --- drift-lance extensions ---
    primer_prompt: str | None = Field(None, description="Primer prompt file ({query}, {community_reports}, {followups}).")
    hyde_prompt: str | None = Field(None, description="HyDE expansion prompt file ({query}, {template}).")
    hyde_max_tokens: int | None = Field(None, gt=0, description="Cap on the HyDE expansion's output tokens (None: the model's default, as graphrag).")
    response_type: str = Field("multiple paragraphs", min_length=1, description="Target length and format of the answers.")
    action_ranking: Literal["random", "parent_score"] = Field("random", description="Order of open actions: the reference's random order, or best parent score first.")
    seed: int | None = Field(None, ge=0, le=INT32_MAX, description="Seed of the HyDE template pick and the random action order (reproducible runs).")
    community_level: int | None = Field(
        None,
        ge=0,
        le=INT32_MAX,
        description="Deepest community level of the primer's reports and the follow-ups' local contexts (graphrag's "
        "--community-level); None: the local search settings' community_level.",
    )
    context_concurrency: int = Field(
        2,
        ge=1,
        description="Follow-up local contexts built at once. Building is mostly CPU: built together they all "
        "finish late and every follow-up call leaves late; built two at a time, each call leaves as soon "
        "as its context is ready (benchmarks/FINDINGS.md, DRIFT overhead).",
    )
    time_budget: float | None = Field(
        None,
        gt=0,
        description="Seconds a DRIFT query should take. Follow-up epochs stop at 3/4 of it (counted from the "
        "query's start): follow-ups not answered by then are cancelled and marked failed, no further epoch starts, "
        "and the reduce answers from what is in, so one stuck call cannot hold the answer back. HyDE, primer and "
        "reduce are not cut (llm_timeout bounds single calls). None: no budget (the service sets its search timeout).",
    )
    llm_timeout: float | None = Field(
        None,
        gt=0,
        description="Seconds one LLM call may take, retries included (streams: the wait for the next token). "
        "None: rely on the model's own request timeout (models.request_timeout) and retries.",
    )

    @field_validator("prompt", "reduce_prompt", "primer_prompt", "hyde_prompt", mode="before")
    @classmethod
    def _empty_prompt_is_bundled(cls, value: object) -> object:
        return empty_prompt_is_bundled(value)

    @model_validator(mode="after")
    def _props_fit_budget(self) -> DRIFTSearchConfig:
        total = self.local_search_text_unit_prop + self.local_search_community_prop
        if total > 1.0 + 1e-9:
            raise ValueError(
                "local_search_text_unit_prop + local_search_community_prop must be <= 1 "
                f"(got {self.local_search_text_unit_prop} + {self.local_search_community_prop})"
            )
        return self

    # Output-token caps as sent to the model: the *_completion_tokens field wins, like OpenAI's API.
    @property
    def reduce_output_cap(self) -> int | None:
        return self.reduce_max_completion_tokens or self.reduce_max_tokens

    @property
    def action_output_cap(self) -> int | None:
        return self.local_search_llm_max_gen_completion_tokens or self.local_search_llm_max_gen_tokens


FIELDS = tuple(DRIFTSearchConfig.model_fields)
_PROMPT_FIELDS = ("prompt", "reduce_prompt", "primer_prompt", "hyde_prompt")


def load_drift_config(
    path: str | Path | None = None,
    overrides: Mapping[str, str] | Iterable[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    base: DRIFTSearchConfig | None = None,
) -> DRIFTSearchConfig:
    """Defaults (or `base`) < file < `DRIFT_LANCE_DRIFT__*` env vars < overrides (`{"n_depth": "2"}`
    or `["n_depth=2"]`). Raises ConfigError naming the file / variable / field at fault."""
    values: dict[str, Any] = base.model_dump() if base is not None else {}
    origin: dict[str, str] = {}
    if path is not None:
        file_values = _read_config_file(Path(path))
        values.update(file_values)
        origin.update({key: f"config file {path}" for key in file_values})
    env_values = _env_values(os.environ if env is None else env)
    values.update({key: value for key, (value, _) in env_values.items()})
    origin.update({key: f"environment variable {var}" for key, (_, var) in env_values.items()})
    set_values = overrides if isinstance(overrides, Mapping) else parse_set_options(overrides)
    for key, value in set_values.items():
        field = _known_field(key, where=f"--set {key}={value}")
        values[field] = _coerce_text(field, value) if isinstance(value, str) else value
        origin[field] = f"--set {key}"
    return _validate(values, origin)


def parse_set_options(items: Iterable[str]) -> dict[str, str]:
    """`["n_depth=2", "drift.seed=7"]` -> `{"n_depth": "2", "seed": "7"}` (the section's name is
    allowed, as `--set local.top_k_entities=5` is for a local search)."""
    parsed: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a DRIFT field name as KEY")
        parsed[key.strip().removeprefix("drift.")] = value.strip()
    return parsed


def _validate(values: dict[str, Any], origin: Mapping[str, str]) -> DRIFTSearchConfig:
    try:
        return DRIFTSearchConfig.model_validate(values)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = ".".join(str(part) for part in err["loc"]) or "(config)"
            source = origin.get(field)
            where = f" (from {source})" if source else ""
            got = f", got {err['input']!r}" if err["loc"] else ""
            problems.append(f"drift config field {field!r}{where}: {err['msg']}{got}")
        raise ConfigError("; ".join(problems)) from None


def _read_config_file(path: Path) -> dict[str, Any]:
    data = read_config_mapping(path)
    section = _drift_section(data, path)
    graphrag_block = "drift_search" in data
    if not graphrag_block:
        # drift-lance's own file (`drift:` or bare): a misspelt key is an error, as in every other
        # section. graphrag's `drift_search:` has keys we do not use: those only warn.
        for key in section:
            _known_field(str(key), where=f"config file {path}")
    return _known_values(section, path, missing_prompts_default=graphrag_block)


def read_config_mapping(path: Path) -> dict[str, Any]:
    """The parsed TOML (.toml) or YAML (.yaml/.yml) file as a dict (ConfigError naming the file when
    it is unusable). The one reader of settings files: `Settings.load` reads them here too."""
    if path.is_dir():
        raise ConfigError(f"config file {path}: is a directory, not a settings file")
    if not path.is_file():
        raise ConfigError(f"config file {path}: not found")
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml"):
        raise ConfigError(f"config file {path}: unknown format {suffix!r}; use .toml, .yaml or .yml")
    try:
        text = path.read_text(encoding="utf-8")
        data = tomllib.loads(text) if suffix == ".toml" else (yaml.safe_load(text) or {})
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path}: cannot parse: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a table/mapping, got {type(data).__name__}")
    return data


def _drift_section(data: dict[str, Any], path: Path) -> dict[str, Any]:
    for name in _SECTION_NAMES:
        if name in data:
            section = data[name] or {}
            if not isinstance(section, dict):
                raise ConfigError(f"config file {path}: section {name!r} must be a mapping")
            return section
    # No section: the file is a bare DRIFT config if it names any of our fields; otherwise it is
    # some other settings file (e.g. graphrag's without a drift_search block) and gives defaults.
    if any(_canonical(key) in FIELDS for key in data):
        return data
    return {}


def _known_values(section: Mapping[str, Any], path: Path, *, missing_prompts_default: bool) -> dict[str, Any]:
    return section_values(section, path, block="drift_search", fields=FIELDS, prompt_fields=_PROMPT_FIELDS,
                          canonical=_canonical, missing_prompts_default=missing_prompts_default)


def section_values(
    section: Mapping[str, Any],
    path: Path,
    *,
    block: str,
    fields: Iterable[str],
    prompt_fields: Iterable[str] = (),
    canonical: Callable[[str], str] = str,
    missing_prompts_default: bool = False,
) -> dict[str, Any]:
    """The entries of a settings file's `block:` section that name one of `fields` (after
    `canonical`; others are ignored with a warning, as graphrag's settings.yaml has keys we do not
    use), prompt file paths resolved against the file's folder. With `missing_prompts_default` (a
    graphrag block) a prompt file that does not exist gives the bundled prompt, with a warning."""
    known = set(fields)
    values: dict[str, Any] = {}
    for key, value in section.items():
        field = canonical(str(key))
        if field not in known:
            log.warning("config file %s: ignoring unknown %s key %r", path, block, key)
            continue
        values[field] = value
    values = file_relative_prompts(values, path, prompt_fields)
    return _without_missing_prompts(values, path, block, prompt_fields) if missing_prompts_default else values


def _without_missing_prompts(values: dict[str, Any], path: Path, block: str, prompt_fields: Iterable[str]) -> dict[str, Any]:
    """graphrag uses its built-in prompt when a configured prompt file does not exist, and its own
    `graphrag init` (3.x) names a DRIFT reduce prompt file it never writes: such a settings.yaml
    must work here too, with the bundled prompt."""
    for field in prompt_fields:
        value = values.get(field)
        if isinstance(value, str) and value and not Path(value).exists():
            log.warning("config file %s: %s.%s file %s does not exist; using the bundled prompt, as graphrag "
                        "uses its built-in one", path, block, field, value)
            del values[field]
    return values


def file_relative_prompts(section: Mapping[str, Any], path: Path, prompt_fields: Iterable[str]) -> dict[str, Any]:
    """`section` with its relative prompt file paths resolved against the folder of the settings
    file `path`, so the file works from any current directory."""
    resolved = dict(section)
    for field in prompt_fields:
        value = resolved.get(field)
        if isinstance(value, str) and value.strip():  # blank: the bundled one
            resolved[field] = file_relative_path(value, path)
    return resolved


def file_relative_path(value: str, path: Path) -> str:
    """A local path `value` from the settings file `path`, `~` expanded and made absolute against
    the file's folder (so the file works from any current directory); an absolute path or a URI
    with a scheme (s3://, file://) is kept as written."""
    if has_uri_scheme(value):
        return value
    local = Path(value).expanduser()
    return str(local if local.is_absolute() else (path.parent / local).resolve())


def _env_values(env: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    found: dict[str, tuple[str, str]] = {}
    for var, value in env.items():
        if var.upper().startswith(ENV_PREFIX):
            field = _known_field(var[len(ENV_PREFIX):].lower(), where=f"environment variable {var}")
            found[field] = (_coerce_text(field, value), var)
    return found


def _canonical(key: str) -> str:
    key = key.strip().lower().replace("-", "_")
    return _RENAMED_KEYS.get(key, key)


def _known_field(key: str, *, where: str) -> str:
    field = _canonical(key)
    if field in FIELDS:
        return field
    raise ConfigError(f"{where}: unknown drift config field {key!r}{did_you_mean(field, FIELDS)}")


def _coerce_text(field: str, value: str) -> Any:
    """Strings from env / --set: pydantic's lax mode turns "2" into 2 and "0.5" into 0.5; we only
    map "none"/"null"/"" to None for optional fields."""
    optional = type(None) in typing.get_args(DRIFTSearchConfig.model_fields[field].annotation)
    if optional and value.strip().lower() in ("none", "null", ""):
        return None
    return value
