"""LanceDB on S3-compatible object storage (moto on 127.0.0.1), live re-ingest, stateless replicas.

Everything runs against a real S3 protocol server behind a counting proxy (`local_s3`): ingest,
inspect, context and DRIFT give the same results as on a local folder; a service keeps answering
from its generation while a re-ingest writes, and switches on reload (admin route or interval).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import numpy as np
import polars as pl
import pytest

from drift_lance.cli import main as cli_main
from drift_lance.config.drift import DRIFTSearchConfig
from drift_lance.config.settings import Settings
from drift_lance.errors import ConfigError, StoreError
from drift_lance.object_store import resolve_storage_options
from drift_lance.testing import HashEmbedder, ScriptedEmbedder
from drift_lance.testing.s3 import classify_request
from fixtures.s3 import REINGEST_MARKER
from fixtures.service import GatedChatModel, scripted_drift_model

QUERY = "Who leads the team inside Dulce base?"
DIM = 3072  # the dulce index's embedding dimension


# ---------------------------------------------------------------------------- storage options


@pytest.mark.parametrize(
    ("uri", "options", "environ", "expected"),
    [
        # object_store reads the endpoint from the environment but refuses http:// without allow_http
        ("s3://b/db", None, {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000"}, {"allow_http": "true"}),
        ("s3://b/db", None, {"AWS_ENDPOINT": "http://minio:9000"}, {"allow_http": "true"}),
        ("s3://b/db", None, {"AWS_ENDPOINT_URL_S3": "http://minio:9000"}, {"allow_http": "true"}),
        ("s3://b/db", {"aws_endpoint": "http://127.0.0.1:9000"}, {}, {"aws_endpoint": "http://127.0.0.1:9000", "allow_http": "true"}),
        ("s3://b/db", None, {"AWS_ENDPOINT_URL": "https://s3.example.com"}, None),
        ("s3://b/db", None, {}, None),
        # the user's explicit choice stands
        ("s3://b/db", {"allow_http": "false"}, {"AWS_ENDPOINT_URL": "http://x:1"}, {"allow_http": "false"}),
        ("s3://b/db", None, {"AWS_ENDPOINT_URL": "http://x:1", "AWS_ALLOW_HTTP": "true"}, None),
        # keys are normalised the way object_store reads them
        ("s3://b/db", {"AWS_REGION": "eu-west-1"}, {}, {"aws_region": "eu-west-1"}),
        ("gs://b/db", None, {"AWS_ENDPOINT_URL": "http://x:1"}, None),
        ("/data/index", {"timeout": "30s"}, {"AWS_ENDPOINT_URL": "http://x:1"}, {"timeout": "30s"}),
    ],
)
def test_storage_options_fill_only_what_lancedb_does_not_infer(uri, options, environ, expected):
    assert resolve_storage_options(uri, options, environ=environ) == expected


@pytest.mark.parametrize(
    ("method", "path", "query", "kind"),
    [
        ("GET", "/bucket", "list-type=2&prefix=db%2F", "list"),
        ("GET", "/bucket/db/t.lance/_versions/1.manifest", "", "get"),
        ("HEAD", "/bucket/db/t.lance/data/x.lance", "", "head"),
        ("PUT", "/bucket/db/t.lance/data/x.lance", "", "put"),
        ("POST", "/bucket/db/big", "uploads", "post"),
        ("DELETE", "/bucket/db/t.lance/_versions/1.manifest", "", "delete"),
    ],
)
def test_proxy_counts_requests_by_kind(method, path, query, kind):
    assert classify_request(method, path, query) == kind


# ---------------------------------------------------------------------------- CLI on s3://


def _run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = cli_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_ingest_and_inspect_on_s3_from_aws_environment(s3_env, s3_uri, dulce_dir, dulce_db_uri, capsys):
    """Only the standard AWS variables (endpoint, keys, region) are set: no drift-lance flag needed."""
    code, out, err = _run_cli(capsys, "ingest", str(dulce_dir), "--db", s3_uri, "--no-progress")
    assert code == 0, err
    assert f"into {s3_uri}: generation 1" in out

    code, out, err = _run_cli(capsys, "inspect", "--db", s3_uri, "--json")
    assert code == 0, err
    on_s3 = json.loads(out)
    code, out, err = _run_cli(capsys, "inspect", "--db", dulce_db_uri, "--json")
    local = json.loads(out)

    assert on_s3["generations"] == [1]
    assert set(on_s3["tables"]) == set(local["tables"])
    for name, table in local["tables"].items():
        s3_table = on_s3["tables"][name]
        for field in ("rows", "dimension", "vector_index", "indexes"):
            assert s3_table[field] == table[field], (name, field)
    # the index really is in the bucket
    assert any(key.endswith(".lance") for key in s3_env.list_keys("drift-lance-test", s3_uri.split("/", 3)[3]))


def test_cli_context_on_s3_equals_local(local_s3, clean_aws_env, dulce_s3_uri, dulce_db_uri, golden_entity_case, tmp_path, capsys):
    """context with --storage-option flags only (no AWS variables): same text and records as local."""
    vector_file = tmp_path / "q.npy"
    np.save(vector_file, np.asarray(golden_entity_case["query_vector"], dtype=np.float32))
    flags = [f"--storage-option={k}={v}" for k, v in local_s3.storage_options().items() if k != "allow_http"]

    code, out, err = _run_cli(capsys, "context", QUERY, "--db", dulce_s3_uri, "--query-vector", str(vector_file), "--json", *flags)
    assert code == 0, err
    on_s3 = json.loads(out)
    code, out, err = _run_cli(capsys, "context", QUERY, "--db", dulce_db_uri, "--query-vector", str(vector_file), "--json")
    assert code == 0, err
    local = json.loads(out)

    assert on_s3 == local
    assert on_s3["records"]["entities"] and on_s3["records"]["sources"]


def test_cli_bad_storage_option_and_unreachable_bucket(local_s3, clean_aws_env, capsys):
    code, _, err = _run_cli(capsys, "query", QUERY, "--db", "s3://drift-lance-test/x", "--storage-option", "novalue")
    assert code == 2 and "--storage-option 'novalue': expected KEY=VALUE" in err

    missing = "s3://no-such-bucket-here/db"
    flags = [f"--storage-option={k}={v}" for k, v in local_s3.storage_options().items()]
    code, _, err = _run_cli(capsys, "inspect", "--db", missing, *flags)
    assert code == 2 and missing in err


# ---------------------------------------------------------------------------- engine on s3://


def _comparable(result: Any) -> dict[str, Any]:
    data = result.model_dump(mode="json")
    data.pop("completion_time")
    return data


async def test_drift_query_on_s3_equals_local(local_s3, dulce_s3_uri, dulce_db_uri):
    from drift_lance.drift import open_drift_search

    config = DRIFTSearchConfig(n_depth=1, drift_k_followups=3, primer_folds=2, seed=7)
    results = []
    for uri, options in ((dulce_s3_uri, local_s3.storage_options()), (dulce_db_uri, None)):
        search = await open_drift_search(
            uri, config=config, chat_model=scripted_drift_model(), embedder=HashEmbedder(DIM), storage_options=options
        )
        try:
            results.append(await search.search(QUERY))
        finally:
            await search.close()
    on_s3, local = results
    assert _comparable(on_s3) == _comparable(local)
    assert on_s3.llm_calls_categories["action"] >= 1 and on_s3.context_data


async def test_warm_queries_are_served_from_the_bounded_caches(local_s3, dulce_s3_uri, golden_entity_case):
    """What a context build costs in object-store requests, cold and warm (counted by the proxy)."""
    from drift_lance._lance_store import open_store
    from drift_lance.config.ingest import StoreConfig
    from drift_lance.local import build_local_context

    vector = np.asarray(golden_entity_case["query_vector"], dtype=np.float32)

    async def cold_and_warm(config: StoreConfig) -> tuple[Any, Any, Any]:
        store = await open_store(dulce_s3_uri, storage_options=local_s3.storage_options(), config=config)
        try:
            local_s3.reset_counts()
            cold_context = await build_local_context(store, QUERY, query_vector=vector)
            cold = local_s3.counts()
            local_s3.reset_counts()
            warm_context = await build_local_context(store, QUERY, query_vector=vector)
            assert warm_context.context_text == cold_context.context_text
            return cold, local_s3.counts(), store
        finally:
            await store.close()

    # defaults: a small index is wholly in memory after the first query
    cold, warm, _ = await cold_and_warm(StoreConfig())
    assert cold.get > 0 and warm.total == 0
    # no table cache: row lookups read the store, but the vectors are not downloaded again
    cold, warm, store = await cold_and_warm(StoreConfig(table_cache_bytes=0))
    assert warm.get > 0 and warm.list == 0 and warm.put == 0
    vector_bytes = store.manifest.tables["entities"].rows * DIM * 4
    assert cold.bytes_out > vector_bytes > warm.bytes_out


async def test_vector_cache_is_bounded_and_results_do_not_depend_on_it(dulce_db_uri, golden_entity_case):
    from drift_lance._lance_store import open_store
    from drift_lance.config.ingest import StoreConfig

    vector = np.asarray(golden_entity_case["query_vector"], dtype=np.float32)
    cached = await open_store(dulce_db_uri)
    tiny = await open_store(dulce_db_uri, config=StoreConfig(vector_cache_bytes=1024))
    try:
        for table in ("entities", "text_units", "community_reports"):
            a = await cached.search(table, vector, 8, columns=["id"])
            b = await tiny.search(table, vector, 8, columns=["id"])
            assert a["id"].to_list() == b["id"].to_list(), table
            assert np.allclose(a["_similarity"].to_numpy(), b["_similarity"].to_numpy(), atol=1e-5), table
        # a batch over the bound is one LanceDB scan shared by its queries, split back per query
        queries = np.stack([vector, -vector, vector[::-1]])
        batched = await tiny.search_many("entities", queries, 8, columns=["id"])
        for query, found in zip(queries, batched):
            assert found["id"].to_list() == (await cached.search("entities", query, 8, columns=["id"]))["id"].to_list()
        assert tiny.vector_cache.bytes == 0
        assert cached.vector_cache.bytes > 0
        assert cached.vector_cache.bytes <= cached.config.vector_cache_bytes
    finally:
        await cached.close()
        await tiny.close()


def test_store_settings_from_config_file_and_environment(tmp_path, clean_aws_env):
    config = tmp_path / "drift-lance.toml"
    config.write_text(
        'db = "s3://bucket/index"\n[store]\nreload_interval_seconds = 5\nvector_cache_bytes = 1048576\n'
        '[store.storage_options]\naws_endpoint = "http://minio:9000"\n'
    )
    settings = Settings.load(config)
    assert settings.store.reload_interval_seconds == 5
    assert settings.store.storage_options == {"aws_endpoint": "http://minio:9000"}
    clean_aws_env.setenv("DRIFT_LANCE_STORE__STORAGE_OPTIONS", '{"aws_region": "eu-west-1"}')
    assert Settings.load().store.storage_options == {"aws_region": "eu-west-1"}
    with pytest.raises(ConfigError, match="store.reload_interval_seconds"):
        Settings.load(db="x").with_updates({"store.reload_interval_seconds": -1})


# ---------------------------------------------------------------------------- live re-ingest


def _service_settings(uri: str, options: dict[str, str] | None, interval: float) -> Settings:
    updates: dict[str, Any] = {
        "store.reload_interval_seconds": interval,
        "drift.n_depth": 1, "drift.drift_k_followups": 2, "drift.primer_folds": 1, "drift.seed": 7,
    }
    if options:
        updates["store.storage_options"] = options
    return Settings.load(db=uri).with_updates(updates)


def _backend(settings: Settings, vector: np.ndarray, chat_model: Any = None):
    from drift_lance.service.engine import EngineBackend

    return EngineBackend(
        settings, chat_model=chat_model or scripted_drift_model(), embedder=ScriptedEmbedder({QUERY: vector})
    )


def create_app_for(settings: Settings, vector: np.ndarray, chat_model: Any = None):
    from drift_lance.service import create_app

    return create_app(settings, backend=_backend(settings, vector, chat_model))


class _QueryLoop:
    """Local searches against each server, back to back, in a thread; records every answer."""

    def __init__(self, servers: dict[str, Any]):
        self.servers = servers
        # (replica, started_at, finished_at, status, answer has the re-ingest marker)
        self.results: list[tuple[str, float, float, int, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        clients = {name: server.client(timeout=60.0) for name, server in self.servers.items()}
        try:
            while not self._stop.is_set():
                for name, client in clients.items():
                    started = time.monotonic()
                    response = client.post("/v1/search", json={"query": QUERY, "method": "local"})
                    marker = response.status_code == 200 and REINGEST_MARKER in response.json()["context_text"]
                    self.results.append((name, started, time.monotonic(), response.status_code, marker))
        finally:
            for client in clients.values():
                client.close()

    def start(self) -> _QueryLoop:
        self._thread.start()
        return self

    def wait_for(self, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.results) < count and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        assert len(self.results) >= count, "query loop stalled"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def _wait_generation(server: Any, generation: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    with server.client() as client:
        while time.monotonic() < deadline:
            if client.get("/v1/index").json()["generation"] == generation:
                return
            time.sleep(0.05)
    raise AssertionError(f"{server.base_url} did not reach generation {generation}")


def test_replicas_keep_answering_during_reingest_and_switch_after(
    local_s3, s3_env, s3_uri, dulce_dir, reingest_source, golden_entity_case, live_server
):
    """Two replicas on one s3:// index: A reloads on POST /v1/admin/reload (explicit storage
    options), B on a short interval (AWS variables only). A re-ingest runs while both answer in a
    loop: no query fails, nothing from the new generation shows before the switch, and after it
    every answer comes from the new generation."""
    import ingest

    ingest.ingest(dulce_dir, s3_uri, progress=False)
    vector = np.asarray(golden_entity_case["query_vector"], dtype=np.float32)
    replica_a = live_server(create_app_for(_service_settings(s3_uri, local_s3.storage_options(), interval=0), vector))
    replica_b = live_server(create_app_for(_service_settings(s3_uri, None, interval=0.3), vector))
    loop = _QueryLoop({"a": replica_a, "b": replica_b}).start()
    try:
        loop.wait_for(4)
        ingest_started = time.monotonic()
        report = ingest.ingest(reingest_source, s3_uri, progress=False)
        ingest_done = time.monotonic()
        assert report.manifest.generation == 2
        with replica_a.client() as a:
            # A has not reloaded: still generation 1, old text
            before = a.post("/v1/search", json={"query": QUERY, "method": "local"})
            assert before.status_code == 200 and REINGEST_MARKER not in before.json()["context_text"]
            reload = a.post("/v1/admin/reload")
            assert reload.status_code == 200, reload.text
            assert reload.json() == {"switched": True, "previous_generation": 1, "generation": 2, "newest_generation": 2}
            switched_at = time.monotonic()
            again = a.post("/v1/admin/reload").json()
            assert again["switched"] is False and again["generation"] == 2
        _wait_generation(replica_b, 2)
        b_switched_at = time.monotonic()
        count = len(loop.results)
        loop.wait_for(count + 4)
    finally:
        loop.stop()

    assert all(status == 200 for *_, status, _ in loop.results), [r for r in loop.results if r[3] != 200][:3]
    during = [r for r in loop.results if ingest_started <= r[2] <= ingest_done]
    assert during, "no query completed while the ingest ran"
    for name, _, finished, _, marker in loop.results:
        if finished <= ingest_done:
            assert not marker, f"replica {name} answered from a generation that was not complete"
    # every search that started after its replica switched reads the new generation
    after_a = [marker for name, started, *_, marker in loop.results if name == "a" and started > switched_at]
    after_b = [marker for name, started, *_, marker in loop.results if name == "b" and started > b_switched_at]
    assert after_a and all(after_a)
    assert after_b and all(after_b)


def test_inflight_drift_search_finishes_on_its_generation(
    local_s3, clean_aws_env, s3_uri, dulce_dir, reingest_source, golden_entity_case, live_server
):
    """A DRIFT search blocked in its first LLM call while the service switches generations still
    reads the old generation afterwards (its store stays open) and succeeds; the old store is
    closed once it is done."""
    import ingest

    options = local_s3.storage_options()
    ingest.ingest(dulce_dir, s3_uri, progress=False, storage_options=options)
    gated = GatedChatModel()
    settings = _service_settings(s3_uri, options, interval=0)
    vector = np.asarray(golden_entity_case["query_vector"], dtype=np.float32)
    backend = _backend(settings, vector, gated)
    from drift_lance.service import create_app

    server = live_server(create_app(settings, backend=backend))
    answer: dict[str, Any] = {}

    def search() -> None:
        with server.client(timeout=120.0) as client:
            answer["response"] = client.post("/v1/search", json={"query": QUERY, "method": "drift"})

    thread = threading.Thread(target=search, daemon=True)
    thread.start()
    try:
        assert gated.started.wait(60), "the search never reached its first LLM call"
        ingest.ingest(reingest_source, s3_uri, progress=False, storage_options=options)
        with server.client() as client:
            assert client.post("/v1/admin/reload").json()["switched"] is True
            assert client.get("/v1/index").json()["generation"] == 2
        assert backend.open_generations() == [2, 1]  # 1 is retired but still leased
    finally:
        gated.release()
        thread.join(120)
    response = answer["response"]
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["llm_calls_categories"].get("action", 0) >= 1
    assert REINGEST_MARKER not in json.dumps(body["context_data"])
    assert backend.open_generations() == [2]

    # a new search now reads generation 2
    with server.client(timeout=120.0) as client:
        fresh = client.post("/v1/search", json={"query": QUERY, "method": "local"})
    assert fresh.status_code == 200 and REINGEST_MARKER in fresh.json()["context_text"]


def test_reload_is_behind_the_api_key(local_s3, clean_aws_env, dulce_s3_uri, golden_entity_case, live_server):
    settings = _service_settings(dulce_s3_uri, local_s3.storage_options(), interval=0).with_updates(
        {"service.api_key": "s3cret"}
    )
    server = live_server(create_app_for(settings, np.asarray(golden_entity_case["query_vector"], dtype=np.float32)))
    with server.client() as client:
        assert client.post("/v1/admin/reload").status_code == 401
        ok = client.post("/v1/admin/reload", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["switched"] is False


async def test_a_data_object_deleted_from_the_bucket_fails_the_drift_query_naming_the_table(local_s3, s3_uri, dulce_dir):
    """Object storage is not checked at open (a request per file): a data object missing from the
    bucket (a partial sync, a lifecycle rule) made every DRIFT follow-up fail and the answer come
    from the primer alone. The first failure checks the store, and the query names the table."""
    import boto3

    import ingest
    from drift_lance.drift import open_drift_search
    from drift_lance.testing.s3 import ACCESS_KEY, REGION, SECRET_KEY

    options = local_s3.storage_options()
    await ingest.run_ingest(dulce_dir, s3_uri, storage_options=options, progress=False)
    bucket, prefix = s3_uri.removeprefix("s3://").split("/", 1)
    (key,) = local_s3.list_keys(bucket, f"{prefix}/text_units.lance/data/")
    chat = scripted_drift_model()
    search = await open_drift_search(s3_uri, chat_model=chat, embedder=HashEmbedder(DIM), storage_options=options,
                                     config={"n_depth": 1, "drift_k_followups": 2, "primer_folds": 1})
    try:
        boto3.client("s3", endpoint_url=local_s3.upstream, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                     region_name=REGION).delete_object(Bucket=bucket, Key=key)
        with pytest.raises(StoreError, match=r"table 'text_units' at version \d+ cannot be read: .*[Nn]ot found"):
            await search.search(QUERY)
    finally:
        await search.close()


async def test_open_store_names_the_uri_when_nothing_was_ingested(local_s3, s3_uri):
    from drift_lance._lance_store import open_store

    with pytest.raises(StoreError, match=s3_uri):
        await open_store(s3_uri, storage_options=local_s3.storage_options())


async def test_a_missing_bucket_or_endpoint_is_said_in_a_few_words(local_s3):
    """Not LanceDB's 1.5k-character Rust debug dump: what is wrong first, naming the URI."""
    import socket

    from drift_lance._lance_store import open_store

    with pytest.raises(StoreError) as missing:
        await open_store("s3://no-such-bucket/db", storage_options=local_s3.storage_options())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: connections are refused
    refused_options = {**local_s3.storage_options(), "aws_endpoint": f"http://127.0.0.1:{port}", "max_retries": "0"}
    with pytest.raises(StoreError) as refused:
        await open_store("s3://drift-lance-test/db", storage_options=refused_options)
    for info, meaning, uri in ((missing, "the bucket does not exist", "s3://no-such-bucket/db"),
                               (refused, "cannot connect to the endpoint (connection refused)", "s3://drift-lance-test/db")):
        message = str(info.value)
        assert message.startswith(f"{uri}: cannot open LanceDB database: {meaning} (") and len(message) < 500, message


async def test_an_ingest_into_a_missing_bucket_fails_before_embedding_anything(local_s3, carol_dir):
    """Remote embedding calls cost money: the database is opened before any vector is computed."""
    import ingest
    from drift_lance.testing import HashEmbedder

    class Counting(HashEmbedder):
        calls = 0

        async def embed(self, texts, *, kind="document"):
            Counting.calls += 1
            return await super().embed(texts, kind=kind)

    with pytest.raises(StoreError, match="the bucket does not exist"):
        await ingest.run_ingest(carol_dir, "s3://no-such-bucket/db", embedder=Counting(16),
                                storage_options=local_s3.storage_options(), progress=False)
    assert Counting.calls == 0


async def test_reingest_on_s3_keeps_the_previous_generation_and_cleans_older(local_s3, s3_uri, dulce_dir):
    """After three ingests, generation 2 (what a lagging replica may still pin) is readable and
    generation 1's table versions are deleted from the bucket, its manifest with them."""
    import ingest
    from drift_lance._lance_store import open_store

    from drift_lance.config.ingest import IngestConfig

    options = local_s3.storage_options()
    config = IngestConfig(keep_replaced_seconds=0)  # generation 1 was replaced long enough ago
    for _ in range(2):
        await ingest.run_ingest(dulce_dir, s3_uri, config=config, storage_options=options, progress=False)
    first = await open_store(s3_uri, storage_options=options, generation=1)
    first_version = first.manifest.tables["entities"].version
    await first.close()
    await ingest.run_ingest(dulce_dir, s3_uri, config=config, storage_options=options, progress=False)
    from drift_lance._lancedb import lancedb

    db = await lancedb.connect_async(s3_uri, storage_options=options)
    kept = [v["version"] for v in await (await db.open_table("entities")).list_versions()]
    assert first_version not in kept and min(kept) > first_version
    previous = await open_store(s3_uri, storage_options=options, generation=2)
    try:
        assert (await previous.scan("entities", columns=["id"])).height == 39
        assert sorted(await previous.generations()) == [2, 3]
    finally:
        await previous.close()
    with pytest.raises(StoreError, match=r"no manifest generation 1 \(have \[2, 3\]\)"):
        await open_store(s3_uri, storage_options=options, generation=1)


async def test_indexed_table_on_s3_is_searched_in_memory_when_it_fits(local_s3, s3_uri, tmp_path):
    """An ANN query on object storage reads index partitions and rows from the bucket every time;
    a table whose vectors fit the vector cache is downloaded once and searched exactly instead."""
    import ingest
    from drift_lance._lance_store import open_store
    from drift_lance.config.ingest import IngestConfig, StoreConfig
    from ingest.synthetic import generate_index

    src = generate_index(tmp_path / "src", n_entities=1200, dim=32, seed=4)
    await ingest.run_ingest(src, s3_uri, config=IngestConfig(ann_min_rows=1000), storage_options=local_s3.storage_options(),
                            progress=False)
    rng = np.random.default_rng(0)
    queries = rng.standard_normal((3, 32)).astype(np.float32)

    async def warm_gets(config: StoreConfig) -> tuple[int, list[list[str]]]:
        store = await open_store(s3_uri, storage_options=local_s3.storage_options(), config=config)
        try:
            assert store.manifest.tables["entities"].vector_index == "IVF_RQ"
            await store.search("entities", queries[0], 10, columns=["id"])  # cold: loads what it needs
            local_s3.reset_counts()
            found = [(await store.search("entities", q, 10, columns=["id"]))["id"].to_list() for q in queries]
            return local_s3.counts().get, found
        finally:
            await store.close()

    in_memory_gets, in_memory = await warm_gets(StoreConfig())
    ann_gets, _ = await warm_gets(StoreConfig(exact_in_memory_on_object_storage=False))
    assert in_memory_gets == 0 and ann_gets > 0
    everything = pl.read_parquet(src / "entities.parquet")["id"].to_list()
    import lance  # pylance, a dependency of lancedb

    vectors = lance.dataset(str(src / "lancedb" / "entity_description.lance")).to_table().to_pydict()
    matrix = np.asarray(vectors["vector"], dtype=np.float32)
    matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)
    by_id = dict(zip(vectors["id"], range(len(matrix)), strict=True))
    for q, got in zip(queries, in_memory, strict=True):
        scores = matrix @ (q / np.linalg.norm(q))
        exact = sorted(everything, key=lambda i: -scores[by_id[i]])[:10]
        assert got == exact  # exact search, not approximate
