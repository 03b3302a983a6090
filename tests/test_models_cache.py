"""On-disk response cache: repeated calls do not reach the model; different inputs do."""

from __future__ import annotations

import gc
import os

import pytest
from pydantic import BaseModel

from drift_lance.models import ChatParams, Message, get_chat_model
from drift_lance.models.cache import CachedChatModel
from drift_lance.testing import ScriptedChatModel
from drift_lance.testing.openai_server import Reply

Q = [Message("user", "What is DRIFT?")]


class Answer(BaseModel):
    answer: str


async def test_repeated_call_is_served_from_disk_across_instances(tmp_path):
    inner = ScriptedChatModel(["first answer"])
    cached = CachedChatModel(inner, tmp_path)
    first = await cached.complete(Q, params=ChatParams(temperature=0))
    assert first.text == "first answer" and first.usage.calls == 1

    # a new process would build a new wrapper over the same directory
    again = CachedChatModel(ScriptedChatModel([]), tmp_path)
    hit = await again.complete(Q, params=ChatParams(temperature=0))
    assert hit.text == "first answer"
    assert hit.usage.calls == 0 and hit.raw["cache"] == "hit"
    assert again.inner.calls == [] and again.hits == 1


async def test_key_covers_messages_params_and_schema(tmp_path):
    inner = ScriptedChatModel(lambda messages, params, model: '{"answer": "x"}')
    cached = CachedChatModel(inner, tmp_path)
    await cached.complete(Q)
    await cached.complete([Message("user", "another question")])
    await cached.complete(Q, params=ChatParams(temperature=0.5))
    structured = await cached.complete(Q, response_model=Answer)
    assert len(inner.calls) == 4 and cached.store.__len__() == 4
    hit = await cached.complete(Q, response_model=Answer)
    assert len(inner.calls) == 4 and hit.parsed == structured.parsed == Answer(answer="x")


async def test_failures_are_not_cached(tmp_path):
    inner = ScriptedChatModel([RuntimeError("boom"), "recovered"])
    cached = CachedChatModel(inner, tmp_path)
    try:
        await cached.complete(Q)
    except RuntimeError:
        pass
    assert (await cached.complete(Q)).text == "recovered"
    assert len(inner.calls) == 2


async def test_streams_are_cached_once_complete(tmp_path):
    cached = CachedChatModel(ScriptedChatModel(["streamed words here"]), tmp_path)
    stream = cached.stream(Q)
    assert "".join([d async for d in stream]) == "streamed words here"
    assert stream.usage.calls == 1
    replay = cached.stream(Q)
    assert "".join([d async for d in replay]) == "streamed words here"
    assert len(cached.inner.calls) == 1


async def test_registry_wraps_model_when_cache_dir_is_set(openai_server, openai_settings, tmp_path):
    openai_server.queue_chat(Reply(text="from the server"))
    chat = get_chat_model(openai_settings.model_copy(update={"cache_dir": tmp_path / "cache"}))
    assert isinstance(chat, CachedChatModel)
    assert (await chat.complete(Q)).text == "from the server"
    assert (await chat.complete(Q)).text == "from the server"
    assert len(openai_server.chat_requests) == 1
    assert (tmp_path / "cache" / "responses.sqlite").is_file()


@pytest.mark.parametrize("streamed", [False, True], ids=["blocking", "streamed"])
async def test_drift_query_answered_from_the_cache_counts_no_calls(dulce_db_uri, tmp_path, streamed):
    """A repeated DRIFT query costs no LLM call in any stage, the follow-ups and reduce included."""
    from drift_lance.config.drift import DRIFTSearchConfig
    from drift_lance.drift import open_drift_search
    from drift_lance.testing import HashEmbedder
    from fixtures.service import scripted_drift_model

    config = DRIFTSearchConfig(drift_k_followups=2, primer_folds=1, n_depth=1, seed=0)
    results = []
    for _ in range(2):
        chat = CachedChatModel(scripted_drift_model(), tmp_path)
        search = await open_drift_search(dulce_db_uri, config=config, chat_model=chat, embedder=HashEmbedder(3072))
        try:
            if streamed:
                stream = search.stream_search("Who runs the Dulce base?")
                _ = [delta async for delta in stream]
                results.append(stream.result)
            else:
                results.append(await search.search("Who runs the Dulce base?"))
        finally:
            await search.close()
    first, repeated = results
    assert first.llm_calls_categories["action"] == 2 and first.llm_calls == 5
    assert repeated.response == first.response
    assert repeated.llm_calls == 0 and set(repeated.llm_calls_categories.values()) == {0}
    assert repeated.prompt_tokens == 0 and chat.inner.calls == []


async def test_the_cache_keeps_the_inner_models_context_window_for_budgets(dulce_db_uri, tmp_path):
    """Budgets fit a small fixed window (the embedded llama.cpp model's) through the cache too: the
    wrapper used to hide `n_ctx`, so 12,000-token contexts went to an 8192-token model."""
    from drift_lance.drift import open_drift_search
    from drift_lance.testing import HashEmbedder

    inner = ScriptedChatModel([])
    inner.n_ctx = 4096
    search = await open_drift_search(dulce_db_uri, chat_model=CachedChatModel(inner, tmp_path), embedder=HashEmbedder(3072))
    try:
        config = search.config
        assert (config.local_search_max_data_tokens, config.primer_llm_max_tokens, config.data_max_tokens) == (2048, 2048, 2048)
    finally:
        await search.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists open files through /proc")
async def test_the_cache_holds_a_fixed_set_of_files_open(tmp_path):
    """Lookups and stores share the store's one connection, which `aclose()` closes. A connection per
    call sits in a reference cycle, so each call's file handles stayed open until the garbage
    collector ran: `drift-lance serve` with a cache went from 24 open files to 80-97."""

    def open_cache_files() -> list[str]:
        paths = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                paths.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # the listing's own descriptor, closed meanwhile
                pass
        return [p for p in paths if p.startswith(str(tmp_path))]

    cached = CachedChatModel(ScriptedChatModel(lambda messages, params, model: "answer"), tmp_path)
    gc.disable()  # only what the calls themselves close counts
    try:
        await cached.complete([Message("user", "question 0")])
        after_one = len(open_cache_files())
        for i in range(1, 20):
            await cached.complete([Message("user", f"question {i}")])
            assert (await cached.complete([Message("user", f"question {i}")])).raw["cache"] == "hit"
        after_many = len(open_cache_files())
        await cached.aclose()
        after_close = open_cache_files()
    finally:
        gc.enable()
    assert after_many == after_one <= 3  # the database, its -wal and -shm
    assert after_close == []


_CACHE_USER = """
import asyncio, json, sys
from drift_lance.models import Message
from drift_lance.models.cache import CachedChatModel
from drift_lance.testing import ScriptedChatModel

async def main(cache_dir, name):
    chat = CachedChatModel(ScriptedChatModel(lambda messages, params, model: "answer to " + messages[-1].content), cache_dir)
    questions = [f"shared question {i}" if i % 2 else f"{name}'s question {i}" for i in range(300)]
    results = await asyncio.gather(*(chat.complete([Message("user", q)]) for q in questions))
    assert [r.text for r in results] == ["answer to " + q for q in questions]
    await chat.aclose()
    print(json.dumps(questions))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_two_processes_share_one_cache_dir(tmp_path):
    """Two processes (two `drift-lance query` runs, or serve and a query) start on one new cache
    dir at once and store 300 answers each, half of them for the same questions: both finish, and
    every answer either stored is then served from the file."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import drift_lance

    env = {**os.environ, "PYTHONPATH": str(Path(drift_lance.__file__).parent.parent)}
    users = [subprocess.Popen([sys.executable, "-c", _CACHE_USER, str(tmp_path / "cache"), name], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    questions: set[str] = set()
    for user in users:
        out, err = user.communicate(timeout=300)
        assert user.returncode == 0, err
        assert "response cache" not in err  # no lookup or store gave up on a lock
        questions.update(json.loads(out))

    replay = CachedChatModel(ScriptedChatModel([]), tmp_path / "cache")
    for question in sorted(questions):
        assert (await replay.complete([Message("user", question)])).text == "answer to " + question
    assert replay.inner.calls == [] and len(questions) == len(replay.store) == 450


async def test_a_cache_that_cannot_be_written_costs_a_model_call_not_the_query(tmp_path, monkeypatch, caplog):
    """Another process holding the cache's write lock past the timeout (or a full disk) used to fail
    the call with "database is locked" after the model had answered; the answer is returned, not
    stored, and the failure logged once."""
    import sqlite3

    from drift_lance.models import cache

    monkeypatch.setattr(cache, "_BUSY_TIMEOUT", 0.05)
    cached = CachedChatModel(ScriptedChatModel(lambda messages, params, model: "fresh answer"), tmp_path)
    other = sqlite3.connect(tmp_path / "responses.sqlite", isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another process mid-write, for longer than the timeout
    try:
        for question in ("one", "two"):
            assert (await cached.complete([Message("user", question)])).text == "fresh answer"
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert len(cached.inner.calls) == 2 and len(cached.store) == 0
    assert [r.getMessage() for r in caplog.records].count(
        f"response cache {cached.store.path}: store failed (database is locked); answers come from the model meanwhile"
    ) == 1
    await cached.complete([Message("user", "three")])
    assert len(cached.store) == 1


@pytest.mark.parametrize("problem", ["parent is a file", "not a database"])
def test_an_unusable_cache_dir_is_a_setting_error_naming_the_path(tmp_path, problem):
    """A cache dir that cannot hold the cache fails model construction as a settings error naming
    the file (the CLI's exit 2, the service's failed start), not as an OSError traceback."""
    from drift_lance.errors import ConfigError

    if problem == "parent is a file":
        (tmp_path / "file").write_text("x")
        cache_dir = tmp_path / "file" / "cache"
    else:
        cache_dir = tmp_path / "cache"
        cache_dir.mkdir()
        (cache_dir / "responses.sqlite").write_bytes(b"not sqlite at all " * 100)
    with pytest.raises(ConfigError, match=r"cache_dir: cannot use .*responses\.sqlite") as error:
        CachedChatModel(ScriptedChatModel([]), cache_dir)
    assert str(cache_dir / "responses.sqlite") in str(error.value)


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
async def test_the_cache_is_private_to_its_owner(tmp_path):
    """The cache holds every answer: its directory is created 0700 and its files 0600 under the usual
    022 umask (they were 0755 / 0644, readable by every local user), and a file an older version
    left readable is tightened."""
    old_umask = os.umask(0o022)
    try:
        cached = CachedChatModel(ScriptedChatModel(["secret answer"]), tmp_path / "new" / "cache")
        await cached.complete(Q)
        for path in (tmp_path / "new" / "cache").iterdir():  # the database, and its -wal / -shm while open
            assert path.stat().st_mode & 0o777 == 0o600, path
        assert (tmp_path / "new" / "cache").stat().st_mode & 0o777 == 0o700
        await cached.aclose()

        old = tmp_path / "old"
        old.mkdir()
        (old / "responses.sqlite").touch(mode=0o644)
        CachedChatModel(ScriptedChatModel([]), old)
        assert (old / "responses.sqlite").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old_umask)


@pytest.mark.parametrize("backend", ["openai", "azure"])
async def test_two_endpoints_serving_one_model_name_do_not_share_answers(tmp_path, backend, monkeypatch):
    """Two servers whose models share a name (two vLLM "llama3"s, or Azure resources with a
    deployment of one name) each get their own answers: the key used to hold the model id only, so
    the second server's question was answered with the first one's cached answer."""
    from drift_lance.config.models import ModelSettings
    from drift_lance.testing import FakeOpenAIServer

    for name in ("OPENAI_BASE_URL", "AZURE_OPENAI_ENDPOINT", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)

    def settings(server: FakeOpenAIServer) -> ModelSettings:
        if backend == "azure":
            where = {"azure_endpoint": server.base_url.removesuffix("/v1"), "api_version": "2024-10-21", "deployment": "llama3"}
        else:
            where = {"base_url": server.base_url}
        return ModelSettings(chat_backend=backend, chat_model="llama3", api_key="k", max_retries=0,
                             cache_dir=tmp_path, **where)

    with FakeOpenAIServer() as first, FakeOpenAIServer() as second:
        first.default_text, second.default_text = "the first server's answer", "the second server's answer"
        answers = []
        for server in (first, second, first, second):
            chat = get_chat_model(settings(server))
            answers.append((await chat.complete(Q)).text)
            await chat.aclose()
        assert answers == ["the first server's answer", "the second server's answer"] * 2
        assert len(first.chat_requests) == len(second.chat_requests) == 1  # the repeats were hits


async def test_a_cache_file_of_the_first_version_opens_and_its_answers_are_not_served(tmp_path):
    """The first version's table was keyed by model id alone: which server an answer came from is
    unknown, so its entries are dropped, never served to anyone; the file is reused."""
    import sqlite3

    old = sqlite3.connect(tmp_path / "responses.sqlite")
    old.execute("PRAGMA journal_mode=WAL")
    old.execute("CREATE TABLE responses (key TEXT PRIMARY KEY, model TEXT, text TEXT, prompt_tokens INTEGER, "
                "output_tokens INTEGER, created REAL)")
    old.execute("INSERT INTO responses VALUES ('k', 'scripted', 'an answer from some server', 1, 1, 0)")
    old.commit()
    old.close()

    cached = CachedChatModel(ScriptedChatModel(["this server's answer"]), tmp_path)
    assert (await cached.complete(Q)).text == "this server's answer"
    assert (await cached.complete(Q)).raw["cache"] == "hit"
    await cached.aclose()
    db = sqlite3.connect(tmp_path / "responses.sqlite")
    assert [name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] == ["chat_responses"]
    db.close()


async def test_the_cache_stays_within_its_bound_evicting_the_least_recently_used(tmp_path, monkeypatch):
    """Every distinct prompt used to add a row for good (a long-running `serve` grew the file without
    limit). Past `cache_max_bytes` the answers used longest ago go, in batches, and a hit counts as
    a use."""
    from drift_lance.models import cache

    monkeypatch.setattr(cache, "_TOUCH_INTERVAL", 0.0)  # every hit records its use
    bound = 256 * 1024
    cached = CachedChatModel(ScriptedChatModel(lambda messages, params, model: "x" * 2048), tmp_path, max_bytes=bound)
    ask = lambda i: cached.complete([Message("user", f"question {i}")])  # noqa: E731
    await ask("kept")
    counts = []
    for i in range(400):
        await ask(i)
        if i % 10 == 0:
            assert (await ask("kept")).raw["cache"] == "hit"  # used now and then: never the oldest
        counts.append(len(cached.store))
        assert cached.store.size_bytes() <= bound
    evictions = sum(1 for before, after in zip(counts, counts[1:]) if after < before)
    assert 0 < evictions <= 40  # about 10% of the bound at a time, not one entry per insert
    assert (await ask("kept")).raw["cache"] == "hit"
    assert (await ask(399)).raw["cache"] == "hit"
    calls = len(cached.inner.calls)
    assert "cache" not in (await ask(0)).raw and len(cached.inner.calls) == calls + 1  # the oldest was evicted


async def test_a_cache_bound_of_zero_is_unbounded_and_the_setting_reaches_the_store(tmp_path, openai_settings):
    from drift_lance.config.models import ModelSettings

    cached = CachedChatModel(ScriptedChatModel(lambda messages, params, model: "x" * 2048), tmp_path / "a", max_bytes=0)
    for i in range(100):
        await cached.complete([Message("user", f"question {i}")])
    assert len(cached.store) == 100

    assert ModelSettings().cache_max_bytes == 256 * 2**20
    chat = get_chat_model(openai_settings.model_copy(update={"cache_dir": tmp_path / "b", "cache_max_bytes": 10**6}))
    assert chat.store.max_bytes == 10**6
    await chat.aclose()


async def test_a_stored_structured_answer_that_no_longer_validates_is_asked_again(tmp_path):
    """An entry that does not parse for its schema (stored by a version that validated or repaired
    differently) failed that call with StructuredOutputError on every repeat until the cache was
    deleted; it is now a miss, and the fresh answer replaces it."""
    from drift_lance.models.base import Usage

    cached = CachedChatModel(ScriptedChatModel(['{"answer": "fresh"}']), tmp_path)
    key = cached.key(Q, None, Answer)
    cached.store.put(key, cached.endpoint, cached.model_id, "no JSON here", Usage(1, 1, 1))
    assert (await cached.complete(Q, response_model=Answer)).parsed == Answer(answer="fresh")
    hit = await cached.complete(Q, response_model=Answer)
    assert hit.raw["cache"] == "hit" and hit.parsed == Answer(answer="fresh")
    assert len(cached.inner.calls) == 1
