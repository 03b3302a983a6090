"""The one `Settings` model shared by the CLI and the service.

Sources, highest priority first:
1. keyword overrides passed to `Settings.load(...)` (the CLI's flags);
2. environment variables with the prefix `DRIFT_LANCE_`, nested with `__`
   (`DRIFT_LANCE_DRIFT__N_DEPTH=2`, `DRIFT_LANCE_SERVICE__PORT=9000`), plus the short
   `DRIFT_LANCE_API_KEY` for `service.api_key`;
3. a TOML or YAML file (`--config FILE`, or the path in `DRIFT_LANCE_CONFIG`); for the search
   commands (`load(..., graphrag=True)`) also a graphrag settings.yaml, of which only the
   `drift_search` and `local_search` blocks are read;
4. the defaults of each area's model.

Every validation problem becomes a `ConfigError` naming the file (if any) and the dotted field.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from drift_lance.config.drift import (
    DRIFTSearchConfig, file_relative_path, file_relative_prompts, load_drift_config, read_config_mapping, section_values,
)
from drift_lance.config.ingest import IngestConfig, StoreConfig, is_secret_name
from drift_lance.config.local import LOCAL_FILE_KEYS, LOCAL_PROMPT_FIELDS, LocalSearchConfig
from drift_lance.config.models import ModelSettings
from drift_lance.config.service import ServiceConfig
from drift_lance.errors import ConfigError, did_you_mean
from drift_lance.object_store import has_uri_scheme

log = logging.getLogger(__name__)

ENV_PREFIX = "DRIFT_LANCE_"
CONFIG_FILE_ENV = "DRIFT_LANCE_CONFIG"
API_KEY_ENV = "DRIFT_LANCE_API_KEY"

# The file being loaded by the current `Settings.load` call (a ContextVar so concurrent loads of
# different files cannot see each other's data).
_file_data: ContextVar[dict[str, Any]] = ContextVar("_drift_lance_settings_file", default={})


class Settings(BaseSettings):
    """Everything configurable, one section per area."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
    )

    db: str | None = Field(None, description="LanceDB URI of the ingested index (local path, s3://...)")
    models: ModelSettings = Field(default_factory=ModelSettings)
    drift: DRIFTSearchConfig = Field(default_factory=DRIFTSearchConfig)
    local: LocalSearchConfig = Field(default_factory=LocalSearchConfig)
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    service: ServiceConfig = Field(default_factory=ServiceConfig)

    @field_validator("db", mode="before")
    @classmethod
    def _empty_db_means_none(cls, value: object) -> object:
        # `DRIFT_LANCE_DB=` in an env file, or `--db ""`: LanceDB would open the current directory.
        if isinstance(value, str) and not value.strip():
            return None
        # `~/index` from an env file (no shell expands it) is the home folder's, as connecting reads it.
        return os.path.expanduser(value) if isinstance(value, str) and not has_uri_scheme(value) else value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        def environment() -> dict[str, Any]:
            values = _without_blank_api_key(env_settings())
            _none_words_as_none(values)
            return values

        return (init_settings, _ApiKeyEnvSource(settings_cls), environment, _FileSource(settings_cls))

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, /, *, graphrag: bool = False, **overrides: Any) -> Settings:
        """Settings from `path` (or `$DRIFT_LANCE_CONFIG`), the environment and `overrides`.
        Overrides set to None are ignored, so CLI flags can be passed through unconditionally.
        With `graphrag` (the search commands), `path` may also be a graphrag settings.yaml, of which
        only the `drift_search` and `local_search` blocks are read."""
        source = config_file_path(path)
        data = read_settings_file(source, graphrag=graphrag) if source is not None else {}
        return cls._from_file_data(source, data, overrides)

    @classmethod
    def _from_file_data(cls, source: Path | None, data: dict[str, Any], overrides: dict[str, Any]) -> Settings:
        """`load` once the file `source` has been read into `data` (by `read_settings_file`)."""
        overrides = {k: v for k, v in overrides.items() if v is not None}
        # Two sections read the environment through their owners' loaders, so their documented
        # variables behave the same everywhere: DRIFT_LANCE_DRIFT__* and DRIFT_LANCE_<MODEL FIELD>.
        _refuse_unknown_section_variables()
        if "drift" not in overrides:
            overrides["drift"] = load_drift_config(source if "drift" in data else None)
        if "models" not in overrides:
            overrides["models"] = _model_settings(data.get("models"), source)
        token = _file_data.set(data)
        try:
            return cls(**overrides)
        except ValidationError as exc:
            env = {name.upper(): value for name, value in os.environ.items()}

            def origin(dotted: str) -> str:  # a flag, else the variable or file that gave the bad value
                if dotted.split(".")[0] in overrides:
                    return "command-line flag"
                where = _origin(dotted, env, data, source)
                return "settings" if where == "default" else where if where.startswith("config file") else f"environment variable {where}"

            raise ConfigError(describe_validation_error(exc, origin=origin)) from None
        except SettingsError as exc:  # an environment value that is not the JSON a mapping or list needs
            raise ConfigError(_describe_settings_error(exc)) from None
        finally:
            _file_data.reset(token)

    def with_updates(self, updates: Mapping[str, Any]) -> Settings:
        """A copy with dotted-path updates applied and validated, e.g. {"drift.n_depth": 2}."""
        # Only the values that were set: a default dumped and validated again would count as set,
        # and `store.search` tells an explicit `nprobes_fraction` from its default that way (an
        # explicit one replaces ingest's calibrated probe count).
        data = self.model_dump(exclude_unset=True)
        for dotted, value in updates.items():
            _set_dotted(data, dotted, value)
        try:
            # Validating through Settings would re-read env and file; validate the plain data instead.
            checked = _InitOnlySettings(**data)
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(exc)) from None
        checked.models._origins = self.models._origins  # values unchanged keep naming their variable or file
        return Settings.model_construct(**{name: getattr(checked, name) for name in Settings.model_fields})


def _describe_settings_error(exc: SettingsError) -> str:
    """pydantic-settings names the section ("store"), not the variable: name the variables too."""
    found = re.search(r'field "(\w+)"', str(exc))
    section = found.group(1) if found else ""
    prefix = f"{ENV_PREFIX}{section.upper()}__"
    names = sorted(name for name in os.environ if name.upper().startswith(prefix)) if section else []
    where = ", ".join(names) or f"{prefix}* variables"
    return f"environment: cannot parse {where} (section {section!r}): lists and mappings are given as JSON, e.g. '{{\"key\": \"value\"}}'"


def parse_assignments(assignments: Iterable[str], *, section: str | None = None) -> dict[str, Any]:
    """`["n_depth=2", "drift.primer_folds=3"]` -> dotted updates for `Settings.with_updates`.
    Values are read for their field's type (`parse_value`: text as written, numbers and booleans as
    YAML scalars); keys without a dot are placed under `section` when given."""
    updates: dict[str, Any] = {}
    for item in assignments:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key=value")
        if "." not in key and section is not None:
            key = f"{section}.{key}"
        key = _known_key(key)
        updates[key] = parse_value(raw, _annotation_of(key))
    return updates


def _known_key(dotted: str) -> str:
    """`dotted` with any field alias replaced by the field's name (`local.top_k_mapped_entities`,
    graphrag's name, is `local.top_k_entities`); ConfigError naming a key that is no settings field,
    with the nearest field's name."""
    model: Any = Settings
    names = dotted.split(".")
    for i, name in enumerate(names):
        fields = getattr(model, "model_fields", None)
        if fields is None:  # below a plain value (a dict setting): validation checks the rest
            break
        if name not in fields:
            name = names[i] = next((field for field, info in fields.items() if name in _aliases(info)), name)
        if name not in fields:
            where = dotted.rsplit(".", 1)[0] + " " if "." in dotted else ""
            raise ConfigError(f"--set {name}: unknown {where}setting{did_you_mean(name, fields)}")
        model = fields[name].annotation
    return ".".join(names)


def _aliases(field: FieldInfo) -> tuple[str, ...]:
    alias = field.validation_alias
    choices = getattr(alias, "choices", None)
    if choices is not None:
        return tuple(c for c in choices if isinstance(c, str))
    return (alias,) if isinstance(alias, str) else ()


def parse_value(raw: str, annotation: Any = None) -> Any:
    """A `--set` value for a field of type `annotation`: a text field takes the text as written
    ("|", "#", "yes" and "a: b" are text, not YAML), a list of texts takes a JSON/YAML list or one
    item, numbers and booleans are read as YAML scalars; "none" clears an optional field."""
    kinds = set(union_members(annotation))
    if type(None) in kinds and raw.strip().lower() in ("none", "null"):
        return None
    if str in kinds:
        return raw
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if any(typing.get_origin(k) is list for k in kinds) and not isinstance(value, list):
        return [raw]
    return value


def union_members(annotation: Any) -> tuple[Any, ...]:
    """The types of a union annotation (`int | None` -> (int, NoneType)), or the annotation alone."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return typing.get_args(annotation)
    return (annotation,)


def _annotation_of(dotted: str) -> Any:
    """The declared type of the settings field at `dotted` (None when there is no such field:
    validation then names it)."""
    model: Any = Settings
    annotation = None
    for name in dotted.split("."):
        field = getattr(model, "model_fields", {}).get(name)
        if field is None:
            return None
        annotation = field.annotation
        model = annotation
    return annotation


def config_file_path(path: str | os.PathLike[str] | None) -> Path | None:
    """The settings file to read: `path`, else `$DRIFT_LANCE_CONFIG`, `~` expanded (a systemd unit's
    `Environment=DRIFT_LANCE_CONFIG=~/...` has no shell to expand it); None for neither."""
    if path is None and os.environ.get(CONFIG_FILE_ENV):
        path = os.environ[CONFIG_FILE_ENV]
    return Path(path).expanduser() if path is not None else None


def read_settings_file(path: Path, *, graphrag: bool = False) -> dict[str, Any]:
    """A TOML (.toml) or YAML (.yaml/.yml) settings file as a dict of sections, prompt paths resolved
    against the file's folder. With `graphrag`, a graphrag settings.yaml gives its search blocks."""
    data = read_config_mapping(path)
    if graphrag and is_graphrag_settings(data):
        return _graphrag_search_sections(data, path)
    return _drift_lance_sections(data, path)


def _drift_lance_sections(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """A drift-lance settings file's sections, checked by name, prompt paths made file-relative
    (`load_drift_config` does that for the drift section, which it reads from the file itself)."""
    # graphrag's section names are accepted for the search sections.
    for graphrag_name, ours in _SECTION_ALIASES.items():
        if graphrag_name in data:
            if ours in data:
                raise ConfigError(f"config file {path}: both {graphrag_name!r} and {ours!r} given; keep one")
            data[ours] = data.pop(graphrag_name)
    unknown = sorted(set(data) - set(Settings.model_fields))
    if unknown:
        hint = "; a graphrag settings.yaml is read by query, context, serve, inspect and config only" if is_graphrag_settings(data) else ""
        raise ConfigError(
            f"config file {path}: unknown section {unknown[0]!r}{did_you_mean(unknown[0], [*Settings.model_fields, *_SECTION_ALIASES])}"
            f"; known: {', '.join(Settings.model_fields)}{hint}"
        )
    _null_sections_as_empty(data, Settings)
    if isinstance(data.get("local"), dict):
        data["local"] = file_relative_prompts(data["local"], path, LOCAL_PROMPT_FIELDS)
    _file_relative_paths(data, path)
    return data


# Settings holding local paths: in a settings file they are relative to the file, as prompts are,
# so `serve --config /etc/drift/settings.toml` with `db = "index"` does not depend on where it started.
_PATH_SETTINGS = (("db",), ("models", "cache_dir"), ("models", "llama_model_path"))


def _file_relative_paths(data: dict[str, Any], path: Path) -> None:
    for *sections, name in _PATH_SETTINGS:
        node: Any = data
        for section in sections:
            node = node.get(section) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(name), str) and node[name].strip():  # blank: unset
            node[name] = file_relative_path(node[name], path)


def _null_sections_as_empty(data: dict[str, Any], model: type[BaseModel]) -> None:
    """YAML reads a section whose keys are all commented out (`service:` alone) as null: that is
    an empty section (or mapping), as it already was for `models` and `drift`, not "Input should be a valid
    dictionary or instance of ServiceConfig"."""
    for name, value in data.items():
        field = model.model_fields.get(name)
        section = field.annotation if field is not None else None
        if isinstance(section, type) and issubclass(section, BaseModel):
            if value is None:
                data[name] = {}
            elif isinstance(value, dict):
                _null_sections_as_empty(value, section)
        elif value is None and typing.get_origin(section) is dict:  # storage_options:, caps.fields:
            data[name] = {}


def is_graphrag_settings(data: Mapping[str, Any]) -> bool:
    """Whether a parsed settings file is graphrag's settings.yaml rather than drift-lance's."""
    return any(key in data for key in _GRAPHRAG_ONLY_SECTIONS)


def _graphrag_search_sections(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """A graphrag settings.yaml as drift-lance sections: `drift_search` (which `load_drift_config`
    reads from the file itself) and `local_search`. Keys graphrag has and we do not are ignored with
    a warning; the other graphrag sections (models, input, output, ...) are not read."""
    _warn_misspelt_search_blocks(data, path)
    sections: dict[str, Any] = {}
    if "drift_search" in data:
        sections["drift"] = data["drift_search"]
    local = data.get("local_search")
    if local is not None:
        if not isinstance(local, dict):
            raise ConfigError(f"config file {path}: section 'local_search' must be a mapping")
        sections["local"] = section_values(local, path, block="local_search", fields=LOCAL_FILE_KEYS,
                                           prompt_fields=LOCAL_PROMPT_FIELDS, missing_prompts_default=True)
    return sections


def _warn_misspelt_search_blocks(data: Mapping[str, Any], path: Path) -> None:
    """graphrag ignores a block it does not know, so `drift_serach:` is not an error in its settings.yaml,
    but its settings then silently were not used: name the near-misses of the two blocks read here."""
    for key in data:
        name = str(key).lower().replace("-", "_")
        if key in _SECTION_ALIASES or name in _OTHER_GRAPHRAG_SEARCH_BLOCKS:
            continue
        # 0.8: drift_serach, drfit_search, localsearch (0.92-0.96); global_search, basic_search and every
        # other graphrag section score less (0.88 and 0.67 for those two, which are skipped by name anyway).
        if max(difflib.SequenceMatcher(None, name, block).ratio() for block in _SECTION_ALIASES) >= 0.8:
            log.warning("config file %s: ignoring unknown block %r%s", path, key, did_you_mean(name, _SECTION_ALIASES))


_SECTION_ALIASES = {"drift_search": "drift", "local_search": "local"}
# graphrag's search blocks that drift-lance does not read (not misspellings of the two it does).
_OTHER_GRAPHRAG_SEARCH_BLOCKS = ("global_search", "basic_search")
# Top-level sections of graphrag's settings.yaml that a drift-lance settings file never has.
_GRAPHRAG_ONLY_SECTIONS = ("completion_models", "embedding_models", "input", "output", "extract_graph", "vector_store")


def _model_settings(section: Any, source: Path | None) -> ModelSettings:
    """File values for `models`, overridden by ModelSettings' own DRIFT_LANCE_<FIELD> variables
    (the model key is DRIFT_LANCE_MODEL_API_KEY; DRIFT_LANCE_API_KEY is the service's token)."""
    if section is not None and not isinstance(section, dict):
        raise ConfigError(f"config file {source}: section 'models' must be a table/mapping")
    _refuse_section_style_model_variables()
    from_env = model_settings_from_env()
    env_values = {name: getattr(from_env, name) for name in from_env.model_fields_set}
    try:
        settings = ModelSettings(**{**(section or {}), **env_values})
    except ValidationError as exc:
        where = f"config file {source}" if source is not None else "model settings"
        raise ConfigError(f"{where}: {describe_validation_error(exc, prefix='models')}") from None
    # where each value came from, for the errors only its use finds (an unknown backend, a missing file)
    origins = {name: f"config file {source}" for name in (section or {}) if name in ModelSettings.model_fields and source}
    return settings.with_origins({**origins, **{name: f"environment variable {_model_variable(name)}" for name in env_values}})


def model_settings_from_env() -> ModelSettings:
    """ModelSettings from its DRIFT_LANCE_<FIELD> variables alone; a bad one is a ConfigError
    naming the variable (not a file that may not set the field)."""
    try:
        settings = ModelSettings()
    except ValidationError as exc:
        names = sorted({_model_variable(str(err["loc"][0])) for err in exc.errors() if err["loc"]})
        raise ConfigError(f"environment variable {', '.join(names)}: "
                          f"{describe_validation_error(exc, prefix='models')}") from None
    return settings.with_origins({name: f"environment variable {_model_variable(name)}" for name in settings.model_fields_set})


def _model_variable(field: str) -> str:
    """The environment variable of a `models` field (its loc may be the alias, already a name)."""
    if field.upper().startswith(ENV_PREFIX):
        return field.upper()
    return "DRIFT_LANCE_MODEL_API_KEY" if field == "api_key" else f"{ENV_PREFIX}{field.upper()}"


def _refuse_unknown_section_variables() -> None:
    """`DRIFT_LANCE_SERIVCE__PORT=9000` is read by nothing (pydantic-settings only looks for the
    variables of known sections): name it, as an unknown section in a file is named."""
    for name in sorted(os.environ):
        section, nested, _ = name[len(ENV_PREFIX):].partition("__")
        if name.upper().startswith(ENV_PREFIX) and nested and section.lower() not in Settings.model_fields:
            raise ConfigError(f"environment variable {name}: unknown section {section.lower()!r}"
                              f"{did_you_mean(section.lower(), Settings.model_fields)} (known: {', '.join(Settings.model_fields)})")


def _refuse_section_style_model_variables() -> None:
    """`DRIFT_LANCE_MODELS__CHAT_MODEL` follows the other sections' pattern but is read by nothing
    (models use `DRIFT_LANCE_CHAT_MODEL`): name the right variable instead of ignoring it."""
    prefix = f"{ENV_PREFIX}MODELS__"
    for name in sorted(os.environ):
        if name.upper().startswith(prefix):
            field = name[len(prefix):].lower()
            right = "DRIFT_LANCE_MODEL_API_KEY" if field == "api_key" else f"{ENV_PREFIX}{field.upper()}"
            raise ConfigError(f"environment variable {name}: model settings are read from {ENV_PREFIX}<FIELD> "
                              f"variables; use {right}")


def describe_validation_error(exc: ValidationError, *, prefix: str = "", origin: Callable[[str], str] | None = None) -> str:
    """One line naming each bad field by its dotted path (under `prefix`) and the value it got; each
    preceded by `origin(path)` (where that value came from) when given, else, for a section's field,
    followed by the environment variable that can also set it."""
    parts = []
    for err in exc.errors():
        path = [str(p) for p in ([prefix] if prefix else []) + list(err["loc"])]
        loc = ".".join(path) or "(root)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        elif is_secret_name(path[-1] if path else ""):  # a key YAML read as a number must not reach a log
            msg += ", got a value of type " + type(err.get("input")).__name__
        elif not isinstance(err.get("input"), dict):
            msg += f", got {err['input']!r}"
        if origin is not None:
            parts.append(f"{origin(loc)}: field {loc}: {msg}")
            continue
        if len(path) == 2 and path[0] != "models":  # DRIFT_LANCE_<SECTION>__<FIELD>; models use their own names
            msg += f" (from the config file, DRIFT_LANCE_{path[0].upper()}__{path[1].upper()} or a flag)"
        parts.append(f"field {loc}: {msg}")
    return "; ".join(parts)


class _FileSource(PydanticBaseSettingsSource):
    """The settings file chosen by the running `Settings.load` call."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return _file_data.get().get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_file_data.get())


class _ApiKeyEnvSource(PydanticBaseSettingsSource):
    """`DRIFT_LANCE_API_KEY`, the documented short name for `service.api_key`."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        key = os.environ.get(API_KEY_ENV)
        return {"service": {"api_key": key}} if key is not None and key.strip() else {}


def _without_blank_api_key(values: dict[str, Any]) -> dict[str, Any]:
    """Environment values with a blank `DRIFT_LANCE_SERVICE__API_KEY` left out: an empty variable
    (docker compose's `${KEY}` of an unset KEY) is no key, and must not turn off the key the
    settings file sets, leaving the service open."""
    service = values.get("service")
    if isinstance(service, dict) and isinstance(service.get("api_key"), str) and not service["api_key"].strip():
        values = {**values, "service": {k: v for k, v in service.items() if k != "api_key"}}
    return values


def _none_words_as_none(values: dict[str, Any], prefix: str = "") -> None:
    """`DRIFT_LANCE_INGEST__TARGET_RECALL=none` clears an optional setting, as the DRIFT section's
    variables and `--set` do; it was "Input should be a valid number", so a None default such as
    `store.index_cache_bytes = None` (LanceDB's own) could not be chosen from the environment."""
    for name, value in values.items():
        if isinstance(value, dict):
            _none_words_as_none(value, f"{prefix}{name}.")
        elif (isinstance(value, str) and value.strip().lower() in ("none", "null")
              and type(None) in union_members(_annotation_of(f"{prefix}{name}"))):
            values[name] = None


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for name in parents:
        child = node.setdefault(name, {})  # a section left at its defaults is not in the data
        if not isinstance(child, dict):
            raise ConfigError(f"setting {dotted!r}: {name!r} is not a section")
        node = child
    node[leaf] = value


class _InitOnlySettings(Settings):
    """Settings validated from explicit data only (no env, no file): for `with_updates`."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


# ------------------------------------------------------------------ effective settings, with sources

_MODEL_ENV_FALLBACKS = {"base_url": "OPENAI_BASE_URL", "azure_endpoint": "AZURE_OPENAI_ENDPOINT", "api_version": "OPENAI_API_VERSION"}
# Other names a settings file may give a field (graphrag's).
_FILE_KEY_ALIASES = {"top_k_entities": "top_k_mapped_entities", "completion_model_id": "chat_model_id"}
MASK = "**********"


def effective_settings(path: str | os.PathLike[str] | None = None) -> list[tuple[str, Any, str]]:
    """Every setting as (dotted name, value as JSON, where it came from), as `query`, `context` and
    `serve` load them from `path` (or `$DRIFT_LANCE_CONFIG`) and the environment; models as the
    selection rule resolves them; secrets masked. What `drift-lance config` prints."""
    source = config_file_path(path)
    file_data = read_settings_file(source, graphrag=True) if source is not None else {}
    settings = Settings._from_file_data(source, file_data, {})  # the file read (and warned about) once
    values = settings.model_dump(mode="json")
    values["models"] = settings.models.resolve().model_dump(mode="json")
    unresolved = settings.models.model_dump(mode="json")
    env = {name.upper(): value for name, value in os.environ.items()}
    rows = []
    for dotted, value in _leaves(values):
        where = _origin(dotted, env, file_data, source)
        field = dotted.split(".")[1] if dotted.startswith("models.") else ""
        if where == "default" and field and value != unresolved.get(field):  # filled in by ModelSettings.resolve
            fallback = _MODEL_ENV_FALLBACKS.get(field, "selection rule")
            if field == "api_key":
                fallback = "AZURE_OPENAI_API_KEY" if values["models"]["azure_endpoint"] and env.get("AZURE_OPENAI_API_KEY") else "OPENAI_API_KEY"
            where = f"auto ({fallback})"
        shown = MASK if value is not None and value != MASK and is_secret_name(dotted.rsplit(".", 1)[-1]) else value
        rows.append((dotted, shown, where))
    return rows


def _leaves(values: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for name, value in values.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


def _origin(dotted: str, env: Mapping[str, str], file_data: Mapping[str, Any], source: Path | None) -> str:
    """Where the value at `dotted` came from, by the precedence `Settings.load` applies."""
    parts = dotted.split(".")
    if parts[0] == "models":
        variables = [_model_variable(parts[1])]
    elif dotted == "service.api_key":
        variables = [API_KEY_ENV, f"{ENV_PREFIX}SERVICE__API_KEY"]
    else:  # DRIFT_LANCE_DB, DRIFT_LANCE_STORE__SEARCH__NPROBES, or a JSON mapping's DRIFT_LANCE_STORE__STORAGE_OPTIONS
        variables = [ENV_PREFIX + "__".join(parts[:i]).upper() for i in range(len(parts), 0, -1)]
    for name in variables:
        if name in env and (env[name].strip() or not name.endswith("API_KEY")):  # a blank key is no key
            return name
    node: Any = file_data
    for name in parts:
        name = name if not isinstance(node, Mapping) or name in node else _FILE_KEY_ALIASES.get(name, name)
        if not isinstance(node, Mapping) or name not in node:
            return "default"
        node = node[name]
    return f"config file {source}"
