"""DRIFTSearchConfig: graphrag's fields and defaults, validation, file / env / --set loading, prompts."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from drift_lance.config.drift import DRIFTSearchConfig, load_drift_config, parse_set_options
from drift_lance.drift.prompts import load_prompts
from drift_lance.errors import ConfigError

GRAPHRAG_FIELDS = {
    "prompt", "reduce_prompt", "completion_model_id", "embedding_model_id", "data_max_tokens",
    "reduce_max_tokens", "reduce_temperature", "reduce_max_completion_tokens", "concurrency",
    "drift_k_followups", "primer_folds", "primer_llm_max_tokens", "n_depth",
    "local_search_text_unit_prop", "local_search_community_prop", "local_search_top_k_mapped_entities",
    "local_search_top_k_relationships", "local_search_max_data_tokens", "local_search_temperature",
    "local_search_top_p", "local_search_n", "local_search_llm_max_gen_tokens",
    "local_search_llm_max_gen_completion_tokens",
}


def test_every_graphrag_field_exists_with_graphrag_defaults():
    cfg = DRIFTSearchConfig()
    assert GRAPHRAG_FIELDS <= set(DRIFTSearchConfig.model_fields)
    assert (cfg.drift_k_followups, cfg.primer_folds, cfg.n_depth, cfg.concurrency) == (20, 5, 3, 32)
    assert (cfg.local_search_text_unit_prop, cfg.local_search_community_prop) == (0.9, 0.1)
    assert (cfg.local_search_top_k_mapped_entities, cfg.local_search_top_k_relationships) == (10, 10)
    assert cfg.local_search_max_data_tokens == cfg.data_max_tokens == cfg.primer_llm_max_tokens == 12_000
    assert cfg.reduce_temperature == cfg.local_search_temperature == 0
    assert (cfg.local_search_top_p, cfg.local_search_n) == (1, 1)
    assert cfg.reduce_max_tokens is None and cfg.local_search_llm_max_gen_tokens is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("concurrency", 0), ("drift_k_followups", 0), ("primer_folds", 0), ("n_depth", -1),
     ("local_search_top_p", 1.5), ("reduce_temperature", -0.1), ("data_max_tokens", 0),
     ("community_level", 2**31), ("seed", -1), ("seed", 2**31)],
)
def test_impossible_values_are_rejected_naming_the_field(field, value):
    with pytest.raises(ValidationError, match=field):
        DRIFTSearchConfig(**{field: value})


@pytest.mark.parametrize("field", ["local_search_temperature", "reduce_temperature", "local_search_top_p", "llm_timeout"])
def test_nan_and_infinity_are_not_numbers_here(field):
    """NaN passes a `<= 2` check nowhere and inf would mean no bound: both are refused as what they are."""
    for value in (float("nan"), float("inf")):
        with pytest.raises(ValidationError, match=rf"{field}\n  Input should be a finite number"):
            DRIFTSearchConfig(**{field: value})


def test_props_must_fit_in_one_budget():
    with pytest.raises(ValidationError, match="local_search_text_unit_prop \\+ local_search_community_prop"):
        DRIFTSearchConfig(local_search_text_unit_prop=0.8, local_search_community_prop=0.5)


def test_completion_tokens_cap_wins_over_max_tokens():
    cfg = DRIFTSearchConfig(reduce_max_tokens=500, local_search_llm_max_gen_tokens=300)
    assert (cfg.reduce_output_cap, cfg.action_output_cap) == (500, 300)
    cfg = DRIFTSearchConfig(reduce_max_tokens=500, reduce_max_completion_tokens=200)
    assert cfg.reduce_output_cap == 200


def test_precedence_file_then_env_then_set(tmp_path):
    path = tmp_path / "drift.toml"
    path.write_text("[drift_search]\nn_depth = 1\nprimer_folds = 2\nconcurrency = 4\n")
    env = {"DRIFT_LANCE_DRIFT__PRIMER_FOLDS": "3", "DRIFT_LANCE_DRIFT__CONCURRENCY": "8", "HOME": "/x"}
    cfg = load_drift_config(path, ["concurrency=2", "seed=7", "reduce_max_tokens=none"], env=env)
    assert (cfg.n_depth, cfg.primer_folds, cfg.concurrency, cfg.seed) == (1, 3, 2, 7)
    assert cfg.reduce_max_tokens is None


def test_a_set_key_may_name_the_drift_section():
    """`query --set drift.n_depth=2` was "unknown drift config field 'drift.n_depth'", where `query
    --method local --set local.top_k_entities=5` and `context --set local....` take their section's name."""
    assert load_drift_config(None, ["drift.n_depth=2", "seed=7"], env={}).n_depth == 2


def test_graphrag_settings_yaml_block_is_accepted_as_is(tmp_path, caplog):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "drift.txt").write_text("Data:\n{context_data}\nQ: {global_query}\n")
    settings = tmp_path / "settings.yaml"
    settings.write_text(
        "completion_models:\n  default_completion_model:\n    model: gpt-4.1\n"
        "drift_search:\n"
        "  prompt: prompts/drift.txt\n"
        "  reduce_prompt: prompts/drift_reduce.txt\n"
        "  chat_model_id: my_chat\n"
        "  embedding_model_id: my_embed\n"
        "  drift_k_followups: 5\n"
        "  temperature: 0.3\n"  # graphrag 1.x key we do not use
    )
    with caplog.at_level(logging.WARNING):
        cfg = load_drift_config(settings, env={})
    assert cfg.drift_k_followups == 5 and cfg.completion_model_id == "my_chat" and cfg.embedding_model_id == "my_embed"
    assert cfg.prompt == str(tmp_path / "prompts" / "drift.txt")  # resolved against the settings file
    assert "temperature" in caplog.text
    assert "{global_query}" in load_prompts(cfg.model_copy(update={"reduce_prompt": None})).local


def test_yaml_without_drift_section_gives_defaults_and_bare_file_works(tmp_path):
    other = tmp_path / "other.yaml"
    other.write_text("input:\n  type: file\n")
    assert load_drift_config(other, env={}) == DRIFTSearchConfig()
    bare = tmp_path / "bare.yml"
    bare.write_text("n_depth: 2\naction_ranking: parent_score\n")
    cfg = load_drift_config(bare, env={})
    assert (cfg.n_depth, cfg.action_ranking) == (2, "parent_score")


def test_errors_name_the_source_and_field(tmp_path):
    with pytest.raises(ConfigError, match=r"n_depth.*--set n_depth.*greater than or equal to 0"):
        load_drift_config(None, ["n_depth=-2"], env={})
    with pytest.raises(ConfigError, match=r"DRIFT_LANCE_DRIFT__CONCURENCY.*did you mean 'concurrency'"):
        load_drift_config(None, env={"DRIFT_LANCE_DRIFT__CONCURENCY": "3"})
    with pytest.raises(ConfigError, match=r"--set drift_k=3.*did you mean 'drift_k_followups'"):
        load_drift_config(None, ["drift_k=3"], env={})
    with pytest.raises(ConfigError, match=r"primer_folds.*abc"):
        load_drift_config(None, {"primer_folds": "abc"}, env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("n_depth = [")
    with pytest.raises(ConfigError, match=r"bad\.toml.*cannot parse"):
        load_drift_config(bad, env={})
    with pytest.raises(ConfigError, match="missing.yaml: not found"):
        load_drift_config(tmp_path / "missing.yaml", env={})
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_set_options(["n_depth"])
    # drift-lance's own file: a misspelt key is an error (graphrag's drift_search block only warns)
    for name, text in (("ours.toml", "[drift]\nn_dpeth = 1\n"), ("bare.yaml", "n_depth: 1\nn_dpeth: 1\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=rf"{name}: unknown drift config field 'n_dpeth'; did you mean 'n_depth'"):
            load_drift_config(tmp_path / name, env={})


def test_prompt_files_are_checked_at_load(tmp_path):
    defaults = load_prompts(DRIFTSearchConfig())
    for placeholder in ("{global_query}", "{followups}", "{context_data}", "{response_type}"):
        assert placeholder in defaults.local
    assert '"follow_up_queries"' in defaults.primer.format(query="q", community_reports="r", followups=5)

    typo = tmp_path / "local.txt"
    typo.write_text("{context_data} {globl_query}")
    with pytest.raises(ConfigError, match=r"'prompt'.*local\.txt.*\{globl_query\}"):
        load_prompts(DRIFTSearchConfig(prompt=str(typo)))
    with pytest.raises(ConfigError, match=r"'reduce_prompt'.*nope\.txt.*cannot read"):
        load_prompts(DRIFTSearchConfig(reduce_prompt=str(tmp_path / "nope.txt")))
    no_data = tmp_path / "reduce.txt"
    no_data.write_text("Answer in {response_type}")
    with pytest.raises(ConfigError, match=r"missing placeholder.*\{context_data\}"):
        load_prompts(DRIFTSearchConfig(reduce_prompt=str(no_data)))


def test_bundled_prompts_are_ours_in_a_graphrag_project_directory(tmp_path):
    """`graphrag init` leaves a prompts/ folder (its own local_search_system_prompt.txt among them)
    in the project, and Python puts the working directory first on sys.path: the bundled prompts
    must still be drift-lance's."""
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "local_search_system_prompt.txt").write_text("graphrag's prompt {context_data}")
    script = (
        "from drift_lance.config.drift import DRIFTSearchConfig\n"
        "from drift_lance.drift.prompts import load_prompts\n"
        "from drift_lance.local import load_local_prompt\n"
        "prompts = load_prompts(DRIFTSearchConfig())\n"
        "print(load_local_prompt() == open(prompts_dir + '/local_search_system_prompt.txt').read(), prompts.hyde == open(prompts_dir + '/drift_hyde.txt').read())\n"
    )
    repo_prompts = Path(__file__).resolve().parent.parent / "prompts"
    run = subprocess.run([sys.executable, "-c", f"prompts_dir = {str(repo_prompts)!r}\n" + script],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True", "True"]
