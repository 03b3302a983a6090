"""The one Settings model: file (TOML/YAML) + DRIFT_LANCE_* environment + explicit overrides."""

from __future__ import annotations

import json
import logging

import pytest

from drift_lance.config import DRIFTSearchConfig, ServiceConfig, Settings
from drift_lance.config.settings import parse_assignments
from drift_lance.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for var in list(os.environ):
        if var.startswith("DRIFT_LANCE_") and var != "DRIFT_LANCE_SHARED":
            monkeypatch.delenv(var)


def test_defaults_compose_every_area():
    settings = Settings.load()
    assert settings.db is None
    assert settings.drift == DRIFTSearchConfig()
    assert settings.service == ServiceConfig()
    assert settings.service.api_key is None
    assert settings.local.top_k_entities == 10


def test_toml_file_sections(tmp_path):
    path = tmp_path / "drift-lance.toml"
    path.write_text(
        'db = "/data/index"\n[drift]\nn_depth = 1\n[service]\nport = 9001\n[service.caps]\nn_depth = 2\n'
        "[local]\ntop_k_entities = 5\n"
    )
    settings = Settings.load(path)
    assert settings.db == "/data/index"
    assert settings.drift.n_depth == 1
    assert settings.service.port == 9001 and settings.service.caps.n_depth == 2
    assert settings.local.top_k_entities == 5


def test_yaml_file_accepts_graphrag_section_names(tmp_path):
    path = tmp_path / "settings.yaml"
    path.write_text("drift_search:\n  drift_k_followups: 4\nlocal_search:\n  top_k_relationships: 3\n")
    settings = Settings.load(path)
    assert settings.drift.drift_k_followups == 4
    assert settings.local.top_k_relationships == 3


def test_environment_overrides_file_and_explicit_overrides_win(tmp_path, monkeypatch):
    path = tmp_path / "s.toml"
    path.write_text('db = "from-file"\n[service]\nport = 9001\nmax_concurrent_searches = 2\n[drift]\nn_depth = 1\n')
    monkeypatch.setenv("DRIFT_LANCE_SERVICE__PORT", "9002")
    monkeypatch.setenv("DRIFT_LANCE_DRIFT__N_DEPTH", "2")
    monkeypatch.setenv("DRIFT_LANCE_DB", "from-env")
    settings = Settings.load(path, db="from-flag")
    assert settings.db == "from-flag"
    assert settings.service.port == 9002
    assert settings.service.max_concurrent_searches == 2  # untouched file value survives
    assert settings.drift.n_depth == 2


def test_config_file_from_environment_variable(tmp_path, monkeypatch):
    path = tmp_path / "s.yaml"
    path.write_text("service:\n  max_query_chars: 77\n")
    monkeypatch.setenv("DRIFT_LANCE_CONFIG", str(path))
    assert Settings.load().service.max_query_chars == 77


def test_api_key_short_variable_goes_to_service_not_to_the_model_endpoint(monkeypatch):
    monkeypatch.setenv("DRIFT_LANCE_API_KEY", "bearer-token")
    settings = Settings.load()
    assert settings.service.api_key.get_secret_value() == "bearer-token"
    assert settings.models.api_key is None
    assert "bearer-token" not in repr(settings)


@pytest.mark.parametrize("variable", ["DRIFT_LANCE_API_KEY", "DRIFT_LANCE_SERVICE__API_KEY"])
def test_an_empty_api_key_variable_does_not_turn_off_the_files_key(tmp_path, monkeypatch, variable):
    """docker compose passes `DRIFT_LANCE_API_KEY=${KEY}` of an unset KEY as an empty string: that
    turned off the key the settings file sets, and the service answered without auth."""
    path = tmp_path / "s.toml"
    path.write_text('[service]\napi_key = "file-key"\n')
    monkeypatch.setenv(variable, "")
    assert Settings.load(path).service.api_key.get_secret_value() == "file-key"
    assert Settings.load().service.api_key is None  # and without a file, no key: no auth, as before
    monkeypatch.setenv(variable, "env-key")
    assert Settings.load(path).service.api_key.get_secret_value() == "env-key"


def test_an_empty_model_path_variable_is_unset_not_the_current_directory(tmp_path, monkeypatch):
    """`DRIFT_LANCE_CACHE_DIR=` (an env file's "no cache") was Path(""), the current directory: every
    answer was cached in responses.sqlite wherever the command ran."""
    monkeypatch.setenv("DRIFT_LANCE_CACHE_DIR", "")
    monkeypatch.setenv("DRIFT_LANCE_LLAMA_MODEL_PATH", " ")
    models = Settings.load().models
    assert models.cache_dir is None and models.llama_model_path is None
    path = tmp_path / "s.toml"
    path.write_text('[models]\ncache_dir = ""\n')
    monkeypatch.delenv("DRIFT_LANCE_CACHE_DIR")
    assert Settings.load(path).models.cache_dir is None


def test_an_empty_prompt_path_is_the_bundled_prompt(tmp_path, monkeypatch):
    """`prompt = ""` (or DRIFT_LANCE_LOCAL__PROMPT=) was the current directory: the search failed
    with "prompt file : Is a directory"; DRIFT_LANCE_DRIFT__PROMPT= already meant the bundled one."""
    path = tmp_path / "s.toml"
    path.write_text('[drift]\nprompt = ""\nreduce_prompt = " "\n[local]\nprompt = ""\n')
    settings = Settings.load(path)
    assert settings.drift.prompt is None and settings.drift.reduce_prompt is None and settings.local.prompt is None
    monkeypatch.setenv("DRIFT_LANCE_LOCAL__PROMPT", "")
    assert Settings.load().local.prompt is None


def test_model_settings_keep_their_own_variables(monkeypatch):
    monkeypatch.setenv("DRIFT_LANCE_CHAT_MODEL", "my-model")
    assert Settings.load().models.chat_model == "my-model"


@pytest.mark.parametrize(("variable", "right"), [("DRIFT_LANCE_MODELS__CHAT_MODEL", "DRIFT_LANCE_CHAT_MODEL"),
                                                 ("DRIFT_LANCE_MODELS__API_KEY", "DRIFT_LANCE_MODEL_API_KEY")])
def test_a_section_style_model_variable_is_refused_naming_the_right_one(monkeypatch, variable, right):
    # The other sections take DRIFT_LANCE_<SECTION>__<FIELD>; models would silently ignore it.
    monkeypatch.setenv(variable, "my-model")
    with pytest.raises(ConfigError, match=f"{variable}: .*use {right}$"):
        Settings.load()


def test_a_bad_model_variable_is_blamed_on_the_variable_not_on_the_config_file(tmp_path, monkeypatch):
    """With --config, DRIFT_LANCE_REQUEST_TIMEOUT=-1 was reported as "config file f.toml: field
    models.request_timeout", a file that has no models section."""
    path = tmp_path / "f.toml"
    path.write_text("[drift]\nn_depth = 1\n")
    monkeypatch.setenv("DRIFT_LANCE_REQUEST_TIMEOUT", "-1")
    with pytest.raises(ConfigError) as info:
        Settings.load(path)
    assert str(info.value).startswith("environment variable DRIFT_LANCE_REQUEST_TIMEOUT: field models.request_timeout: ")
    assert str(path) not in str(info.value)


def test_a_bad_model_setting_found_when_the_model_is_built_names_the_file_or_variable(tmp_path, monkeypatch):
    """`chat_backend = "nope"` in a settings file failed at the first model build with
    "chat_backend: unknown backend 'nope'", naming neither the file nor the variable."""
    from drift_lance.models import get_chat_model

    monkeypatch.delenv("DRIFT_LANCE_CHAT_BACKEND", raising=False)
    path = tmp_path / "f.toml"
    path.write_text('[models]\nchat_backend = "nope"\n')
    with pytest.raises(ConfigError) as info:
        get_chat_model(Settings.load(path).models)
    assert str(info.value).startswith(f"config file {path}: field models.chat_backend: unknown backend 'nope'; registered: ")
    monkeypatch.setenv("DRIFT_LANCE_CHAT_BACKEND", "nah")  # the variable wins over the file, and is named
    with pytest.raises(ConfigError) as info:
        get_chat_model(Settings.load(path).models)
    assert str(info.value).startswith("environment variable DRIFT_LANCE_CHAT_BACKEND: field models.chat_backend: unknown backend 'nah'")


def test_an_empty_model_name_variable_is_named(tmp_path, monkeypatch):
    """`DRIFT_LANCE_CHAT_MODEL=` (compose's ${CHAT_MODEL} of an unset variable) failed at the first
    model call with "no chat model configured for the openai backend", naming no variable."""
    from drift_lance.models import get_chat_model

    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "x")
    monkeypatch.setenv("DRIFT_LANCE_CHAT_MODEL", "")
    for load in (Settings.load, get_chat_model):  # the CLI and service; the Python API's default
        with pytest.raises(ConfigError, match=r"^environment variable DRIFT_LANCE_CHAT_MODEL: field models.chat_model: .*empty"):
            load()
    monkeypatch.delenv("DRIFT_LANCE_CHAT_MODEL")
    path = tmp_path / "s.toml"
    path.write_text('[models]\nembedding_model = " "\n')
    with pytest.raises(ConfigError, match=rf"^config file {path}: field models.embedding_model: .*empty"):
        Settings.load(path)


def test_each_bad_value_is_blamed_on_the_file_or_variable_that_gave_it(tmp_path, monkeypatch):
    """`DRIFT_LANCE_SERVICE__PORT=-1` with `--config f.toml` was reported as "config file f.toml:
    field service.port ... (from the config file, DRIFT_LANCE_SERVICE__PORT or a flag)"."""
    path = tmp_path / "f.toml"
    path.write_text("[local]\nmax_context_tokens = -5\n")
    monkeypatch.setenv("DRIFT_LANCE_SERVICE__PORT", "-1")
    with pytest.raises(ConfigError) as info:
        Settings.load(path)
    assert str(info.value) == (
        f"config file {path}: field local.max_context_tokens: Input should be greater than or equal to 0, got -5; "
        "environment variable DRIFT_LANCE_SERVICE__PORT: field service.port: Input should be greater than or equal to 0, got '-1'"
    )
    monkeypatch.setenv("DRIFT_LANCE_SERVICE__PORT", "")  # an env file's empty line
    with pytest.raises(ConfigError, match="^environment variable DRIFT_LANCE_SERVICE__PORT: field service.port: .*got ''$"):
        Settings.load()


def test_none_in_a_section_variable_clears_an_optional_setting(monkeypatch):
    """As DRIFT_LANCE_DRIFT__SEED=none does: DRIFT_LANCE_INGEST__TARGET_RECALL=none (no probe
    calibration) or DRIFT_LANCE_STORE__INDEX_CACHE_BYTES=none (LanceDB's own bound) failed with
    "Input should be a valid number"."""
    monkeypatch.setenv("DRIFT_LANCE_INGEST__TARGET_RECALL", "none")
    monkeypatch.setenv("DRIFT_LANCE_STORE__INDEX_CACHE_BYTES", "Null")
    monkeypatch.setenv("DRIFT_LANCE_LOCAL__LLM_TIMEOUT", "none")
    monkeypatch.setenv("DRIFT_LANCE_EMBEDDING_DIMENSION", "none")  # the models' own variables too
    settings = Settings.load()
    assert settings.ingest.target_recall is None and settings.store.index_cache_bytes is None
    assert settings.local.llm_timeout is None and settings.models.embedding_dimension is None
    monkeypatch.setenv("DRIFT_LANCE_SERVICE__PORT", "none")  # not optional: still an error
    with pytest.raises(ConfigError, match="DRIFT_LANCE_SERVICE__PORT: field service.port: .*got 'none'"):
        Settings.load()


def test_a_variable_for_a_misspelt_section_is_refused_naming_it(monkeypatch):
    """DRIFT_LANCE_SERIVCE__PORT=9000 was read by nothing: the service started on 8000."""
    monkeypatch.setenv("DRIFT_LANCE_SERIVCE__PORT", "9000")
    with pytest.raises(ConfigError, match=r"DRIFT_LANCE_SERIVCE__PORT: unknown section 'serivce'; did you mean 'service'\?"):
        Settings.load()


@pytest.mark.parametrize(
    ("text", "suffix", "needle"),
    [
        ("[service]\nport = 99999\n", ".toml", "service.port"),
        ("[service]\nportt = 1\n", ".toml", "service.portt: unknown field"),
        ("[models]\nchat_modle = 'gpt-4o'\n", ".toml", "models.chat_modle: unknown field"),
        ("models:\n  bogus_field: 1\n", ".yaml", "models.bogus_field: unknown field"),
        ("[drift]\nn_depth = 'deep'\n", ".toml", "n_depth"),
        ("[nonsense]\nx = 1\n", ".toml", "unknown section 'nonsense'"),
        ("service: [1, 2\n", ".yaml", "cannot parse"),
        ("- 1\n- 2\n", ".yaml", "top level"),
        ("x = 1", ".ini", "unknown format"),
    ],
)
def test_bad_files_name_the_file_and_field(tmp_path, text, suffix, needle):
    path = tmp_path / f"bad{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        Settings.load(path)
    assert needle in str(info.value)
    assert str(path) in str(info.value) or "drift config field" in str(info.value)


@pytest.mark.parametrize(("text", "field"), [
    ("service:\n  api_key: 20261207\n", "service.api_key"),
    ("models:\n  api_key: 20261207\n", "models.api_key"),
    ("store:\n  storage_options:\n    aws_secret_access_key: 20261207\n", "store.storage_options.aws_secret_access_key"),
])
def test_a_bad_secret_is_named_but_never_shown(tmp_path, text, field):
    """YAML reads an all-digit key as a number; the error quoted it to the terminal and the logs."""
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        Settings.load(path)
    assert f"field {field}: Input should be a valid string, got a value of type int" in str(info.value)
    assert "20261207" not in str(info.value)


def test_a_yaml_section_whose_keys_are_all_commented_out_is_empty(tmp_path):
    """`service:` with every key commented out is null in YAML: `models:` and `drift:` were empty
    sections, `service:`, `local:` and `store:` failed with "Input should be a valid dictionary"."""
    path = tmp_path / "s.yaml"
    path.write_text("service:\n#  port: 9000\nlocal:\nstore:\n  search:\n  storage_options:\ningest:\ndrift:\nmodels:\n")
    settings = Settings.load(path)
    assert settings.service.port == 8000 and settings.store.storage_options == {}
    assert settings.store.search.probing(500, calibrated=84) == (84, "calibrated")


def test_a_misspelt_field_name_in_the_request_caps_is_an_error(tmp_path):
    """`[service.caps] fields = {comunity_level = 4}` capped nothing and `server_only =
    ["concurency"]` kept nothing server-side, silently."""
    path = tmp_path / "s.toml"
    path.write_text('[service.caps]\nfields = {comunity_level = 4}\nserver_only = ["concurency", "seed"]\n')
    with pytest.raises(ConfigError) as info:
        Settings.load(path)
    message = str(info.value)
    assert "field service.caps.fields: Value error, 'comunity_level' is no drift or local search setting; did you mean 'community_level'?" in message
    assert "field service.caps.server_only: Value error, 'concurency' is no drift or local search setting" in message
    path.write_text('[service.caps]\nfields = {community_level = 4}\nserver_only = ["concurrency", "context_concurrency", "llm_timeout", "seed"]\n')
    assert Settings.load(path).service.caps.cap_for("community_level") == 4


def test_a_resource_setting_taken_off_server_only_needs_a_cap(tmp_path):
    """`server_only` replaces its default list: `["seed"]` alone let a request set `concurrency`
    (LLM calls in flight) to any number."""
    path = tmp_path / "s.toml"
    path.write_text('[service.caps]\nserver_only = ["seed"]\n')
    with pytest.raises(ConfigError, match=r"server_only leaves concurrency, context_concurrency, llm_timeout to requests with no cap"):
        Settings.load(path)
    path.write_text('[service.caps]\nserver_only = ["seed", "context_concurrency", "llm_timeout"]\nfields = {concurrency = 8}\n')
    caps = Settings.load(path).service.caps
    assert caps.cap_for("concurrency") == 8 and "seed" in caps.server_only


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        Settings.load(tmp_path / "nope.toml")


def test_a_directory_given_as_the_settings_file_is_named_as_one(tmp_path):
    """`--config conf.d.toml` (a folder) said "not found" though the path is there."""
    (tmp_path / "conf.toml").mkdir()
    with pytest.raises(ConfigError, match=r"conf.toml: is a directory, not a settings file"):
        Settings.load(tmp_path / "conf.toml")


def test_bad_environment_value_names_the_field(monkeypatch):
    monkeypatch.setenv("DRIFT_LANCE_SERVICE__MAX_CONCURRENT_SEARCHES", "zero")
    with pytest.raises(ConfigError, match="service.max_concurrent_searches"):
        Settings.load()


def test_with_updates_validates_dotted_paths():
    settings = Settings.load()
    updated = settings.with_updates({"drift.n_depth": 1, "service.caps.token_budget": 500})
    assert updated.drift.n_depth == 1 and updated.service.caps.token_budget == 500
    assert settings.drift.n_depth == 3, "the original is unchanged"
    with pytest.raises(ConfigError, match="drift.n_depth"):
        settings.with_updates({"drift.n_depth": -1})
    with pytest.raises(ConfigError, match="drift.bogus"):
        settings.with_updates({"drift.bogus": 1})


def test_updated_settings_still_probe_the_count_ingest_calibrated(tmp_path):
    """`drift-lance serve --port N` (any flag) went through with_updates, after which the store
    probed 30% of the partitions instead of ingest's calibrated count (150 of 500, not 84)."""
    settings = Settings.load()
    for updated in (settings.with_updates({"service.port": 9000}),
                    settings.with_updates({"service.port": 9000}).with_updates({"store.reload_interval_seconds": 0})):
        assert updated.store.search.probing(500, calibrated=84) == (84, "calibrated")
        assert updated.service.port == 9000
    # a value the file sets is still set, and still wins over the calibration
    (tmp_path / "s.toml").write_text("[store.search]\nnprobes_fraction = 0.3\n")
    from_file = Settings.load(tmp_path / "s.toml").with_updates({"service.port": 9000})
    assert from_file.store.search.probing(500, calibrated=84) == (150, "nprobes_fraction")


def test_parse_assignments():
    assert parse_assignments(["n_depth=2", "service.port=80", "response_type=two lines", "seed=null"], section="drift") == {
        "drift.n_depth": 2,
        "service.port": 80,
        "drift.response_type": "two lines",
        "drift.seed": None,
    }
    with pytest.raises(ConfigError, match="key=value"):
        parse_assignments(["n_depth"])


def test_a_set_key_may_be_graphrags_name_for_a_local_search_field():
    """`context --set top_k_mapped_entities=5` worked; `query --method local` refused the same key."""
    updates = parse_assignments(["top_k_mapped_entities=5"], section="local")
    assert updates == {"local.top_k_entities": 5}
    assert Settings.load().with_updates(updates).local.top_k_entities == 5
    with pytest.raises(ConfigError, match="unknown local setting.*top_k_entities"):
        parse_assignments(["top_k_entitie=5"], section="local")


def test_an_environment_mapping_that_is_not_json_names_the_variable(monkeypatch):
    monkeypatch.setenv("DRIFT_LANCE_STORE__STORAGE_OPTIONS", "{bad")
    with pytest.raises(ConfigError, match=r"environment: cannot parse DRIFT_LANCE_STORE__STORAGE_OPTIONS \(section 'store'\)"):
        Settings.load()


GRAPHRAG_SETTINGS = (
    "completion_models:\n  default_completion_model:\n    model: gpt-4.1\n"
    "input:\n  type: file\noutput:\n  type: file\nvector_store:\n  type: lancedb\n"
    "drift_search:\n  n_depth: 1\n  prompt: prompts/drift.txt\n"
    "local_search:\n  prompt: prompts/local.txt\n  max_context_tokens: 900\n  top_k_mapped_entities: 4\n  future_key: 1\n"
)


def test_a_graphrag_settings_file_gives_the_search_commands_its_search_blocks(tmp_path):
    path = tmp_path / "settings.yaml"
    path.write_text(GRAPHRAG_SETTINGS)
    settings = Settings.load(path, graphrag=True)
    assert settings.drift.n_depth == 1
    assert settings.local.max_context_tokens == 900 and settings.local.top_k_entities == 4
    assert settings.models.chat_model is None  # graphrag's model sections are not read
    with pytest.raises(ConfigError, match="unknown section 'completion_models'.*read by query, context, serve, inspect and config only"):
        Settings.load(path)  # ingest, inspect: drift-lance settings only


def test_a_misspelt_search_block_in_a_graphrag_settings_file_is_named(tmp_path, caplog, capsys):
    """`drift_serach:` in graphrag's settings.yaml was skipped without a word: the search ran at the
    defaults. graphrag's other blocks (global_search, basic_search, ...) are no misspellings."""
    from drift_lance.cli import main

    path = tmp_path / "settings.yaml"
    path.write_text(GRAPHRAG_SETTINGS.replace("drift_search:", "drift_serach:").replace("local_search:", "localsearch:")
                    + "global_search:\n  max_context_tokens: 1000\nbasic_search:\n  k: 5\n")
    with caplog.at_level(logging.WARNING):
        settings = Settings.load(path, graphrag=True)
    assert settings.drift.n_depth == DRIFTSearchConfig().n_depth  # graphrag too ignores an unknown block
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"config file {path}: ignoring unknown block 'drift_serach'; did you mean 'drift_search'?",
                        f"config file {path}: ignoring unknown block 'localsearch'; did you mean 'local_search'?"]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert main(["config", "--config", str(path)]) == 0
    assert sum("drift_serach" in r.getMessage() for r in caplog.records) == 1  # once, though config reads the file twice
    capsys.readouterr()
    ours = tmp_path / "ours.yaml"  # a drift-lance file: an error, now with the suggestion too
    ours.write_text("drift_serach:\n  n_depth: 1\n")
    with pytest.raises(ConfigError, match="unknown section 'drift_serach'; did you mean 'drift_search'"):
        Settings.load(ours, graphrag=True)


def test_a_graphrag_init_settings_file_works_though_it_names_a_prompt_file_graphrag_never_wrote(tmp_path, caplog):
    """graphrag 3.3.0's `graphrag init` writes prompts/drift_reduce_prompt.txt but its settings.yaml
    says prompts/drift_search_reduce_prompt.txt; graphrag then uses its built-in prompt. The same
    file must work here (bundled prompt, with a warning), while a drift-lance file stays strict."""
    from drift_lance.drift.prompts import load_prompts

    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "drift_search_system_prompt.txt").write_text("{context_data} {global_query} {followups}")
    (tmp_path / "prompts" / "drift_reduce_prompt.txt").write_text("{context_data}")
    (tmp_path / "prompts" / "local_search_system_prompt.txt").write_text("{context_data}")
    path = tmp_path / "settings.yaml"
    path.write_text(
        "completion_models:\n  default_completion_model:\n    model: gpt-4.1\n"
        "local_search:\n  prompt: \"prompts/local_search_system_prompt.txt\"\n"
        "drift_search:\n"
        "  completion_model_id: default_completion_model\n"
        "  prompt: \"prompts/drift_search_system_prompt.txt\"\n"
        "  reduce_prompt: \"prompts/drift_search_reduce_prompt.txt\"\n"
    )
    with caplog.at_level(logging.WARNING):
        settings = Settings.load(path, graphrag=True)
    assert settings.drift.prompt == str(tmp_path / "prompts" / "drift_search_system_prompt.txt")
    assert settings.drift.reduce_prompt is None  # the bundled reduce prompt
    assert "drift_search.reduce_prompt file" in caplog.text and "drift_search_reduce_prompt.txt does not exist" in caplog.text
    assert settings.local.prompt == str(tmp_path / "prompts" / "local_search_system_prompt.txt")
    assert load_prompts(settings.drift).local == "{context_data} {global_query} {followups}"

    ours = tmp_path / "ours.toml"
    ours.write_text('[drift]\nreduce_prompt = "prompts/drift_search_reduce_prompt.txt"\n')
    with pytest.raises(ConfigError, match="drift_search_reduce_prompt.txt: cannot read"):
        load_prompts(Settings.load(ours, graphrag=True).drift)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("s.toml", '[local]\nprompt = "prompts/local.txt"\n[drift]\nprompt = "prompts/drift.txt"\n'),
        ("s.yaml", "local_search:\n  prompt: prompts/local.txt\ndrift_search:\n  prompt: prompts/drift.txt\n"),
        ("settings.yaml", GRAPHRAG_SETTINGS),
    ],
)
def test_prompt_paths_in_a_settings_file_are_relative_to_the_file(tmp_path, monkeypatch, name, text):
    folder = tmp_path / "project"
    (folder / "prompts").mkdir(parents=True)
    (folder / name).write_text(text)
    for prompt in ("local.txt", "drift.txt"):
        (folder / "prompts" / prompt).write_text("{context_data}")
    monkeypatch.chdir(tmp_path)  # not the file's folder
    settings = Settings.load(folder / name, graphrag=True)
    assert settings.local.prompt == str(folder / "prompts" / "local.txt")
    assert settings.drift.prompt == str(folder / "prompts" / "drift.txt")


def test_path_settings_in_a_file_are_relative_to_the_file_and_home_is_expanded(tmp_path, monkeypatch):
    """`serve --config /etc/drift/settings.toml` with `db = "index"` opened ./index of wherever the
    service was started, and cache_dir / llama_model_path likewise; `~` was a folder named "~"."""
    folder = tmp_path / "etc"
    folder.mkdir()
    path = folder / "settings.toml"
    path.write_text('db = "index"\n[models]\ncache_dir = "~/cache"\nllama_model_path = "models/m.gguf"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for config in (path, "~/../etc/settings.toml"):  # --config and DRIFT_LANCE_CONFIG expand ~ too
        settings = Settings.load(config)
        assert settings.db == str(folder / "index")
        assert settings.models.cache_dir == tmp_path / "home" / "cache"
        assert settings.models.llama_model_path == folder / "models" / "m.gguf"
    monkeypatch.setenv("DRIFT_LANCE_CONFIG", "~/../etc/settings.toml")
    assert Settings.load().db == str(folder / "index")

    path.write_text('db = "s3://bucket/index"\n[models]\ncache_dir = "/var/cache/drift"\n')
    settings = Settings.load(path)
    assert settings.db == "s3://bucket/index" and str(settings.models.cache_dir) == "/var/cache/drift"
    # The environment and flags stay relative to the working directory (with ~ expanded).
    monkeypatch.setenv("DRIFT_LANCE_CACHE_DIR", "cache")
    monkeypatch.setenv("DRIFT_LANCE_LLAMA_MODEL_PATH", "~/m.gguf")
    settings = Settings.load(path, db="index")
    assert settings.db == "index" and str(settings.models.cache_dir) == "cache"
    assert settings.models.llama_model_path == tmp_path / "home" / "m.gguf"
    assert Settings.load(path, db="~/index").db == str(tmp_path / "home" / "index")


def test_repr_of_the_settings_masks_storage_secrets_but_lancedb_still_gets_them(monkeypatch):
    """repr(settings), in a log line or a traceback's locals, showed AWS keys from store.storage_options."""
    options = {"aws_access_key_id": "AKIA-SECRET", "aws_secret_access_key": "aws-SECRET",
               "aws_session_token": "tok-SECRET", "azure_storage_sas_key": "sas-SECRET", "region": "eu-west-1"}
    monkeypatch.setenv("DRIFT_LANCE_STORE__STORAGE_OPTIONS", json.dumps(options))
    settings = Settings.load()
    for shown in (repr(settings), str(settings), repr(settings.store), str(settings.store)):
        assert "SECRET" not in shown and "'aws_secret_access_key': '**********'" in shown and "'region': 'eu-west-1'" in shown
    assert settings.store.storage_options == options  # what open_store hands LanceDB
    assert settings.with_updates({"store.fetch_chunk_size": 10}).store.storage_options == options


def test_config_command_shows_each_effective_setting_with_its_source_and_no_secret(tmp_path, monkeypatch, capsys):
    """`drift-lance config`: what query, context and serve will use, and which file or variable set it."""
    from drift_lance.cli import main

    path = tmp_path / "s.toml"
    path.write_text('db = "/data/index"\n[drift]\nn_depth = 1\n[local]\ntop_k_mapped_entities = 4\n'
                    '[service]\nport = 9001\napi_key = "file-SECRET"\n')
    monkeypatch.setenv("DRIFT_LANCE_SERVICE__PORT", "9002")
    monkeypatch.setenv("DRIFT_LANCE_STORE__STORAGE_OPTIONS", '{"aws_secret_access_key": "aws-SECRET", "region": "eu"}')
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-SECRET")
    monkeypatch.delenv("AZURE_OPENAI_ENDPOINT", raising=False)
    assert main(["config", "--config", str(path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    file = f"config file {path}"
    assert shown["db"] == {"value": "/data/index", "source": file}
    assert shown["drift.n_depth"] == {"value": 1, "source": file}
    assert shown["local.top_k_entities"] == {"value": 4, "source": file}  # graphrag's name in the file
    assert shown["service.port"] == {"value": 9002, "source": "DRIFT_LANCE_SERVICE__PORT"}  # environment > file
    assert shown["service.api_key"] == {"value": "**********", "source": file}
    assert shown["store.storage_options.aws_secret_access_key"]["value"] == "**********"
    assert shown["store.storage_options.region"] == {"value": "eu", "source": "DRIFT_LANCE_STORE__STORAGE_OPTIONS"}
    assert shown["models.chat_backend"] == {"value": "openai", "source": "auto (selection rule)"}
    assert shown["models.base_url"] == {"value": "http://127.0.0.1:9/v1", "source": "auto (OPENAI_BASE_URL)"}
    assert shown["drift.primer_folds"] == {"value": 5, "source": "default"}
    assert main(["config", "--config", str(path)]) == 0
    text = capsys.readouterr().out
    assert "SECRET" not in text and "SECRET" not in json.dumps(shown)
    assert any(line.startswith("drift.n_depth = 1 ") and line.endswith(f"# {file}") for line in text.splitlines())
