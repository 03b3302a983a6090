"""Cross-cutting CLI behaviour, through the real entry point in a subprocess: --help for every
command, exit codes, one-line errors without tracebacks, missing database, ingest -> inspect -> query,
`serve`, `demo`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

COMMANDS = ("ingest", "query", "context", "inspect", "serve", "config", "demo")
REPO = Path(__file__).resolve().parents[1]


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DRIFT_LANCE_", "OPENAI_", "AZURE_OPENAI_"))}
    env.update(extra)
    return env


def drift_lance(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "drift_lance", *args],
        capture_output=True,
        text=True,
        env=env or cli_env(),
        cwd=REPO,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_top_level_help_lists_every_command():
    proc = drift_lance("--help")
    assert proc.returncode == 0
    for command in COMMANDS:
        assert command in proc.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command):
    proc = drift_lance(command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: drift-lance {command}")


def test_serve_help_states_the_settings_defaults():
    # The CLI builds its parser without importing the settings models (start-up time), so the
    # defaults in `serve --help` are written out; this keeps them the settings' own.
    from drift_lance.config.ingest import StoreConfig
    from drift_lance.config.service import ServiceConfig

    help_text = " ".join(drift_lance("serve", "--help").stdout.split())
    service, store = ServiceConfig(), StoreConfig()
    assert f"(default {service.host})" in help_text and f"(default {service.port})" in help_text
    assert f"(default {store.reload_interval_seconds:g}," in help_text


def test_no_command_prints_usage_and_exits_2():
    proc = drift_lance()
    assert proc.returncode == 2
    assert "usage: drift-lance" in proc.stderr


def test_bad_arguments_exit_2_with_one_error_line():
    proc = drift_lance("serve", "--port", "not-a-number")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "--port" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["qeury", "what?"], "drift-lance: error: argument COMMAND: invalid choice: 'qeury' (choose from "),
        (["qeury", "what?"], "; did you mean 'query'?"),
        (["query", "what?", "--jsn"], "drift-lance query: error: unrecognized arguments: --jsn; did you mean '--json'?"),
        (["query", "what?", "--grpah-out=g.html"], "unrecognized arguments: --grpah-out=g.html; did you mean '--graph-out'?"),
        (["query", "what?", "--method", "drfit"], "invalid choice: 'drfit' (choose from 'drift', 'local'); did you mean 'drift'?"),
        (["inspect", "--jason"], "drift-lance inspect: error: unrecognized arguments: --jason; did you mean '--json'?"),
        (["query", "Who", "leads?", "--db", "x"], "unrecognized arguments: leads?; a question of several words must be quoted"),
    ],
)
def test_a_misspelt_command_option_or_choice_names_the_nearest_one(capsys, argv, line):
    """argparse on Python 3.11 only said "unrecognized arguments: --jsn", as an error of
    `drift-lance` rather than of the subcommand whose options the user has to look up."""
    from drift_lance.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert line in capsys.readouterr().err


@pytest.mark.parametrize(
    "args",
    [
        ("serve", "--db", "{missing}"),
        ("query", "what?", "--db", "{missing}"),
        ("context", "what?", "--db", "{missing}"),
        ("inspect", "--db", "{missing}"),
    ],
)
def test_missing_database_is_one_line_and_exit_2(tmp_path, args):
    missing = str(tmp_path / "no-such-db")
    proc = drift_lance(*(a.format(missing=missing) for a in args), env=cli_env(DRIFT_LANCE_EMBEDDING_BACKEND="hash"))
    assert_one_line_error(proc, args[0], "no-such-db")


def test_a_graphrag_output_folder_given_as_the_database_suggests_ingesting_it_elsewhere(dulce_dir):
    proc = drift_lance("query", "what?", "--db", str(dulce_dir))
    assert_one_line_error(proc, f"run `drift-lance ingest {dulce_dir} --db {dulce_dir.resolve()}.lancedb`")


@pytest.mark.parametrize("command", ["ingest", "inspect"])
def test_a_file_given_as_the_database_is_one_line_and_exit_2(tmp_path, dulce_dir, command):
    afile = tmp_path / "index.lancedb"
    afile.write_text("not a database")
    args = ("ingest", str(dulce_dir), "--db", str(afile), "--no-progress") if command == "ingest" else ("inspect", "--db", str(afile))
    assert_one_line_error(drift_lance(*args), command, "index.lancedb: is a file; a LanceDB database is a folder")
    assert afile.read_text() == "not a database"


def test_serve_without_db_is_a_usage_error():
    assert_one_line_error(drift_lance("serve"), "--db")


@pytest.mark.parametrize("command", ["serve", "inspect"])
def test_an_empty_db_setting_is_no_database_not_the_current_directory(dulce_db_uri, command):
    """`DRIFT_LANCE_DB=` (an env file's empty line) made `serve` open the current directory: it served
    the database it was started in, or failed with ": no complete ingest found"."""
    args = [command, "--port", "0"] if command == "serve" else [command]
    proc = subprocess.run([sys.executable, "-m", "drift_lance", *args], capture_output=True, text=True, timeout=60,
                          env=cli_env(DRIFT_LANCE_DB="", PYTHONPATH=str(REPO)), cwd=dulce_db_uri, stdin=subprocess.DEVNULL)
    assert_one_line_error(proc, f"drift-lance {command}: error: no database: pass --db URI")


def test_bad_config_file_names_file_and_field(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[service]\nmax_concurrent_searches = 0\n")
    line = assert_one_line_error(drift_lance("serve", "--db", str(tmp_path), "--config", str(config)))
    assert str(config) in line and "service.max_concurrent_searches" in line


def test_a_failure_inside_concurrent_work_is_reported_by_its_cause(dulce_dir, tmp_path):
    """Ingest embeds its tables concurrently; when the endpoint is down each fails, and the message
    must be the cause, not "unhandled errors in a TaskGroup"."""
    down = cli_env(DRIFT_LANCE_BASE_URL="http://127.0.0.1:9/v1", OPENAI_API_KEY="sk-unused", DRIFT_LANCE_CONNECT_RETRIES="0")
    proc = drift_lance("ingest", str(dulce_dir), "--db", str(tmp_path / "db"), "--embedder", "openai", "--reembed",
                       "--no-progress", env=down)
    assert proc.returncode == 1 and "TaskGroup" not in proc.stderr, proc.stderr
    assert "connection failed" in proc.stderr and "127.0.0.1:9" in proc.stderr
    assert not (tmp_path / "db").exists()


def test_a_remote_embedder_without_credentials_is_refused_before_any_work(dulce_dir, tmp_path):
    proc = drift_lance("ingest", str(dulce_dir), "--db", str(tmp_path / "db"), "--embedder", "openai", "--reembed", "--no-progress")
    assert proc.returncode == 2, proc.stderr
    assert "no API key for https://api.openai.com/v1: set OPENAI_API_KEY" in proc.stderr
    assert not (tmp_path / "db").exists()


def test_ingest_draws_no_progress_bar_into_a_log_file(dulce_dir, tmp_path):
    """Run from a script or CI, ingest's stderr is a file or a pipe: a progress bar there is a
    string of carriage-return redraws, not a log line."""
    proc = drift_lance("ingest", str(dulce_dir), "--db", str(tmp_path / "db"), "--embedder", "hash", "--reembed")
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr and "embed entities" not in proc.stderr, proc.stderr
    assert "relationships.parquet" in proc.stderr  # the warnings still come


def test_inspect_reads_the_database_from_settings_and_a_closed_pipe_is_quiet(dulce_db_uri):
    """`DRIFT_LANCE_DB` as for query/context/serve; `drift-lance inspect | head -1` prints no error."""
    proc = subprocess.Popen([sys.executable, "-m", "drift_lance", "inspect"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=cli_env(DRIFT_LANCE_DB=dulce_db_uri), cwd=REPO, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader went away before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == ""
    proc = drift_lance("inspect", env=cli_env(DRIFT_LANCE_DB=dulce_db_uri))
    assert proc.returncode == 0 and f"database   {dulce_db_uri}" in proc.stdout


def test_query_on_a_database_missing_a_data_file_exits_2_naming_it_before_any_model_call(dulce_db_uri, tmp_path):
    """`drift-lance query` on a partial copy (the entities data file deleted) answered from the primer
    alone, exit 0, every follow-up's local context having failed; it is one line and exit 2, and no
    model is called."""
    import shutil

    from drift_lance.testing import FakeOpenAIServer

    partial = tmp_path / "partial"
    shutil.copytree(dulce_db_uri, partial)
    (data_file,) = (partial / "entities.lance" / "data").iterdir()
    data_file.unlink()
    with FakeOpenAIServer(embedding_dim=3072) as server:
        env = cli_env(OPENAI_BASE_URL=server.base_url, OPENAI_API_KEY="sk-test", DRIFT_LANCE_MAX_RETRIES="0")
        proc = drift_lance("query", "Who leads?", "--db", str(partial), env=env)
        assert_one_line_error(proc, "table 'entities'", f"file {data_file} is missing")
        assert server.requests == []


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_inspect_of_a_database_with_a_damaged_data_file_names_it_keeps_the_report_and_exits_2(dulce_db_uri, tmp_path, damage):
    """`drift-lance inspect` on a copy whose text_units data file was deleted or truncated listed
    every table as usual, exit 0, while `query` refused the same database: the damaged table is now
    marked in the report (text and --json), and the error naming the file goes to stderr, exit 2."""
    import shutil

    partial = tmp_path / "partial"
    shutil.copytree(dulce_db_uri, partial)
    (data_file,) = (partial / "text_units.lance" / "data").iterdir()
    if damage == "deleted":
        data_file.unlink()
        problem = f"file {data_file} is missing"
    else:
        os.truncate(data_file, 100)
        problem = f"file {data_file} is 100 bytes"
    proc = drift_lance("inspect", "--db", str(partial))
    assert_one_line_error(proc, "drift-lance inspect: error: ", "table 'text_units'", problem)
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.split()}
    assert "UNREADABLE" in rows["text_units"]
    assert "id:BTree" in rows["entities"] and "UNREADABLE" not in rows["entities"]  # the healthy tables still shown
    assert rows["generation"].startswith("generation 1")

    proc = drift_lance("inspect", "--db", str(partial), "--json")
    assert_one_line_error(proc, "table 'text_units'", problem)
    info = json.loads(proc.stdout)
    assert len(info["problems"]) == 1 and problem in info["problems"][0]
    assert info["tables"]["text_units"]["problem"] == info["problems"][0]
    assert info["tables"]["entities"]["problem"] is None and info["tables"]["entities"]["indexes"]
    assert info["manifest"]["generation"] == 1


@pytest.mark.parametrize("shadow", ["ingest.py", "ingest/__init__.py"])
def test_python_m_ingest_from_a_folder_with_its_own_ingest_module_uses_ours(dulce_dir, tmp_path, shadow):
    """`python -m drift_lance ingest` puts the working directory first on sys.path: a user's own
    `ingest.py` (or `ingest/` package) there was imported instead of ours, its code run, and the
    command failed ("'ingest' is not a package", "module 'ingest' has no attribute 'ingest'")."""
    project = tmp_path / "project"
    (project / shadow).parent.mkdir(parents=True, exist_ok=True)
    (project / shadow).write_text("raise SystemExit('the user ingest module was imported')\n")
    proc = subprocess.run([sys.executable, "-m", "drift_lance", "ingest", str(dulce_dir), "--db", "db", "--no-progress"],
                          capture_output=True, text=True, env=cli_env(PYTHONPATH=str(REPO)), cwd=project,
                          timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "generation 1" in proc.stdout and (project / "db" / "entities.lance").is_dir()


# `python -m drift_lance` with the demo's embedded models replaced by a hash embedder and the scripted
# DRIFT model (the real ones take minutes on two cores); `python -c` puts the working directory first
# on sys.path as `-m` does.
SCRIPTED_DEMO = """
import runpy

import drift_lance.models as models
from drift_lance.testing import HashEmbedder
from fixtures.service import scripted_drift_model

models.get_embedder = lambda settings: HashEmbedder(64)
models.get_chat_model = lambda settings: scripted_drift_model()
runpy.run_module("drift_lance", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("shadow", ["ingest.py", "ingest/__init__.py"])
def test_python_m_demo_from_a_folder_with_its_own_ingest_module_uses_ours(tmp_path, shadow):
    """The demo's ingest step imported `ingest` by sys.path too: from a folder holding the user's own
    `ingest.py` (or `ingest/`) it ran that module instead of ingesting the sample."""
    from fixtures.service import REDUCE_ANSWER

    project = tmp_path / "project"
    (project / shadow).parent.mkdir(parents=True, exist_ok=True)
    (project / shadow).write_text("raise SystemExit('the user ingest module was imported')\n")
    proc = subprocess.run([sys.executable, "-c", SCRIPTED_DEMO, "demo", "--workdir", "work"],
                          capture_output=True, text=True, env=cli_env(PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")])),
                          cwd=project, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ingesting the sample index" in proc.stderr and REDUCE_ANSWER in proc.stdout
    assert (project / "work" / "lancedb" / "entities.lance").is_dir()


def test_an_ingest_module_imported_before_ours_is_named(monkeypatch, tmp_path):
    import types

    from drift_lance._ingest_package import import_ingest
    from drift_lance.errors import ConfigError

    theirs = types.ModuleType("ingest")
    theirs.__file__ = str(tmp_path / "ingest.py")
    monkeypatch.setitem(sys.modules, "ingest", theirs)
    with pytest.raises(ConfigError, match=rf"another module named 'ingest' is imported \({tmp_path / 'ingest.py'}\)"):
        import_ingest()


def test_a_closed_standard_output_is_refused_before_any_work(dulce_db_uri):
    """`drift-lance query ... >&-`: the result has nowhere to go, so say so before paying for a
    search (it used to end in an AttributeError traceback after the work)."""
    closed = ["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, "-m", "drift_lance", "inspect", "--db", dulce_db_uri]
    proc = subprocess.run(closed, stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=REPO, stdin=subprocess.DEVNULL, timeout=120)
    assert_one_line_error(proc, "drift-lance inspect: error: standard output is closed")


def test_an_answer_on_a_stdout_that_is_not_utf8_is_printed_not_lost(dulce_db_uri):
    """With a latin-1 locale (or a Windows code page) an answer with "—" or "日本" failed with
    UnicodeEncodeError, exit 1, after every LLM call of the search had been paid for; `--json` and
    `context --json` too. Text now gets \\u escapes and JSON is the same JSON, in ASCII."""
    import json

    from drift_lance.testing import FakeOpenAIServer

    answer = "Alex Mercer — “leads” the mission 日本 🚀."
    with FakeOpenAIServer(embedding_dim=3072, default_text=answer) as server:
        env = cli_env(OPENAI_BASE_URL=server.base_url, OPENAI_API_KEY="sk-test", DRIFT_LANCE_MAX_RETRIES="0",
                      PYTHONIOENCODING="latin-1")
        query = ["query", "Who leads?", "--db", dulce_db_uri, "--method", "local"]
        proc = drift_lance(*query, env=env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("Alex Mercer \\u2014 \\u201cleads\\u201d the mission \\u65e5\\u672c \\U0001f680.")
        proc = drift_lance(*query, "--json", env=env)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["response"] == answer
        proc = drift_lance("context", "Who leads?", "--db", dulce_db_uri, "--json", env=env)
        assert proc.returncode == 0, proc.stderr
        assert "’" in json.loads(proc.stdout)["context_text"]  # the dulce reports' apostrophes


def test_inspect_reports_an_nprobes_above_the_partition_count_as_clamped(dulce_dir, tmp_path):
    import asyncio

    import ingest
    from drift_lance.config.ingest import IngestConfig

    db = str(tmp_path / "db")
    asyncio.run(ingest.run_ingest(dulce_dir, db, config=IngestConfig(ann_min_rows=20), progress=False))  # ANN on entities
    proc = drift_lance("inspect", "--db", db, env=cli_env(DRIFT_LANCE_STORE__SEARCH__NPROBES="999"))
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("entities: "))
    assert line.startswith("entities: IVF_RQ probes 3 of 3 partitions (store.search.nprobes")
    assert "store.search.nprobes 999 is more than the index's 3 partitions, so all are probed" in line
    assert "WARNING" not in line  # a 1-bit index of 39 rows fits any cache
    # A vector index larger than the index cache: every query would re-read partitions.
    proc = drift_lance("inspect", "--db", db, "--json", env=cli_env(DRIFT_LANCE_STORE__INDEX_CACHE_BYTES="1024"))
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["tables"]["entities"]["vector_index_bytes"] > 1024
    assert "is larger than store.index_cache_bytes (0 MiB), so queries re-read partitions" in info["probing"]["entities"]


# `-v` at the end, where a user who just saw a one-line error adds it, was an unrecognized argument.
@pytest.mark.parametrize("where", ["before the command", "after it"])
def test_verbose_shows_the_traceback(tmp_path, where):
    args = ["serve", "--db", str(tmp_path / "no-such-db")]
    proc = drift_lance(*(["--verbose", *args] if where == "before the command" else [*args, "-v"]))
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "StoreError" in proc.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_runs_the_service_until_sigterm(service_db):
    port = _free_port()
    # A loopback OpenAI endpoint that is never called: readiness needs models built, not reached.
    env = cli_env(
        DRIFT_LANCE_CHAT_BACKEND="openai",
        DRIFT_LANCE_BASE_URL="http://127.0.0.1:9/v1",
        OPENAI_API_KEY="sk-unused",
        DRIFT_LANCE_EMBEDDING_BACKEND="hash",
        DRIFT_LANCE_API_KEY="k3y",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "drift_lance", "serve", "--db", str(service_db), "--port", str(port)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        ready = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                ready = httpx.get(f"{base}/readyz")
                if ready.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        assert ready is not None and ready.status_code == 200, proc.stderr.read() if proc.poll() is not None else ready
        assert httpx.get(f"{base}/v1/index").status_code == 401
        manifest = httpx.get(f"{base}/v1/index", headers={"Authorization": "Bearer k3y"})
        assert manifest.status_code == 200 and manifest.json()["tables"]["entities"]["rows"] > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    # uvicorn re-raises the captured SIGTERM once shutdown is complete, the conventional exit status.
    assert proc.returncode in (0, -signal.SIGTERM), stderr
    assert f"serving {service_db}" in stderr
    assert "Application shutdown complete" in stderr


def _serve_startup_log(service_db: Path, terminal: str, **env: str) -> str:
    """What `drift-lance serve` writes to stderr up to "Application startup complete", with a
    pseudo-terminal as its `terminal` ("stdout" or "stderr") and a pipe for the other stream."""
    import pty
    import select

    master, slave = pty.openpty()
    pipe_r, pipe_w = os.pipe()
    stdout, stderr = (slave, pipe_w) if terminal == "stdout" else (pipe_w, slave)
    env = cli_env(DRIFT_LANCE_CHAT_BACKEND="openai", DRIFT_LANCE_BASE_URL="http://127.0.0.1:9/v1",
                  OPENAI_API_KEY="sk-unused", DRIFT_LANCE_EMBEDDING_BACKEND="hash", **env)
    proc = subprocess.Popen([sys.executable, "-m", "drift_lance", "serve", "--db", str(service_db), "--port", "0"],
                            env=env, cwd=REPO, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
    os.close(slave), os.close(pipe_w)
    log_fd = master if terminal == "stderr" else pipe_r
    log = b""
    try:
        deadline = time.monotonic() + 60
        while b"Application startup complete" not in log and time.monotonic() < deadline and proc.poll() is None:
            if select.select([log_fd], [], [], 0.5)[0]:
                log += os.read(log_fd, 65536)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        os.close(master), os.close(pipe_r)
    assert b"Application startup complete" in log, log
    return log.decode()


def test_serve_writes_no_colour_codes_into_a_log_file_or_under_no_color(service_db):
    """uvicorn coloured its log lines when stdout was a terminal, although it writes them to stderr:
    `drift-lance serve 2>server.log` from a terminal filled the log with escape codes. NO_COLOR
    (no-color.org) was not honoured either."""
    assert "\x1b[" not in _serve_startup_log(service_db, "stdout")
    assert "\x1b[" not in _serve_startup_log(service_db, "stderr", NO_COLOR="1")
    assert "\x1b[" in _serve_startup_log(service_db, "stderr")  # a terminal still gets its colours


@pytest.mark.parametrize("host", ["127.0.0.1", "192.0.2.1"])  # 192.0.2.1: TEST-NET, no interface of this machine
def test_serve_on_an_unusable_address_is_one_line_and_exit_2(service_db, host):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = drift_lance("serve", "--db", str(service_db), "--host", host, "--port", str(port))
    reason = "Address already in use" if host == "127.0.0.1" else "Cannot assign requested address"
    assert_one_line_error(proc, f"drift-lance serve: error: cannot listen on {host}:{port}: {reason}")


def test_serve_with_an_empty_host_setting_refuses_instead_of_listening_on_every_interface(service_db):
    """`DRIFT_LANCE_SERVICE__HOST=` (an env file's empty line) listened on 0.0.0.0 and [::] instead
    of the default 127.0.0.1, and said "serving ... on http://:PORT"."""
    proc = drift_lance("serve", "--db", str(service_db), "--port", "0", env=cli_env(DRIFT_LANCE_SERVICE__HOST=""), timeout=60)
    assert_one_line_error(proc, "field service.host: Value error, empty; give an address")


GRAPHRAG_SETTINGS = (
    "completion_models:\n  default_completion_model:\n    model: gpt-4.1\n"
    "input:\n  type: file\noutput:\n  type: file\nvector_store:\n  type: lancedb\n"
    "drift_search:\n  n_depth: 1\nlocal_search:\n  max_context_tokens: 300\n"
)


def test_context_and_serve_read_a_graphrag_settings_file(dulce_db_uri, tmp_path, monkeypatch, capsys):
    """As `query` does: only its drift_search and local_search blocks."""
    import json

    from drift_lance.cli import main
    from drift_lance.models import get_tokenizer
    from drift_lance.service import server

    config = tmp_path / "settings.yaml"
    config.write_text(GRAPHRAG_SETTINGS)
    for var in [v for v in os.environ if v.startswith("DRIFT_LANCE_")]:
        monkeypatch.delenv(var)
    assert main(["context", "", "--db", dulce_db_uri, "--config", str(config), "--json"]) == 0
    context = json.loads(capsys.readouterr().out)["context_text"]
    assert 0 < get_tokenizer("o200k_base").count(context) <= 300

    served = []

    def serve(settings, sockets):  # instead of running the server: what it would serve
        served.append(settings)
        for sock in sockets:
            sock.close()

    monkeypatch.setattr(server, "serve", serve)
    assert main(["serve", "--db", dulce_db_uri, "--port", "0", "--config", str(config)]) == 0, capsys.readouterr().err
    assert served[0].drift.n_depth == 1 and served[0].local.max_context_tokens == 300


def test_inspect_runs_with_the_graphrag_settings_file_query_and_serve_are_given(dulce_db_uri, tmp_path):
    """With DRIFT_LANCE_CONFIG=graphrag/settings.yaml exported for query and serve, `inspect`
    refused to run ("unknown section 'completion_models'") though it reads neither block."""
    config = tmp_path / "settings.yaml"
    config.write_text(GRAPHRAG_SETTINGS)
    proc = drift_lance("inspect", "--db", dulce_db_uri, env=cli_env(DRIFT_LANCE_CONFIG=str(config)))
    assert proc.returncode == 0, proc.stderr
    assert f"database   {dulce_db_uri}" in proc.stdout


@pytest.mark.parametrize(
    ("workdir", "reason"),
    [
        ("{file}", "is a file, not a folder"),
        ("{file}/demo", "Not a directory"),
        pytest.param("/proc/nope", "No such file or directory", marks=pytest.mark.skipif(not Path("/proc/self").exists(), reason="no /proc")),
    ],
)
def test_demo_in_an_unusable_workdir_is_one_line_and_exit_2(tmp_path, workdir, reason):
    afile = tmp_path / "afile"
    afile.write_text("kept")
    workdir = workdir.format(file=afile)
    assert_one_line_error(drift_lance("demo", "--workdir", workdir), f"drift-lance demo: error: --workdir {workdir}: ", reason)
    assert afile.read_text() == "kept"


@pytest.mark.slow
def test_demo_runs_offline_end_to_end(tmp_path):
    """The README's main command: bundled sample -> ingest -> DRIFT query on the embedded models."""
    proc = drift_lance("demo", "--workdir", str(tmp_path / "demo"), timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "answer" in out.lower()
    for stage in ("primer", "action", "reduce", "total"):
        assert stage in out
    assert (tmp_path / "demo" / "lancedb").is_dir()
    # an ingest of another sample, embedder or drift-lance version is redone, the same one reused
    (tmp_path / "demo" / "sample-ingested.sha256").write_text("made by an older drift-lance\n")
    for expected in ("ingesting the sample index", "using the sample index already ingested"):
        proc = drift_lance("demo", "--workdir", str(tmp_path / "demo"), "--query", "Who is Ruth Marsh?", timeout=1800)
        assert proc.returncode == 0 and expected in proc.stderr, proc.stderr[-2000:]


def test_public_api_names_resolve():
    import drift_lance

    missing = [name for name in drift_lance.__all__ if not hasattr(drift_lance, name)]
    assert missing == []


def test_help_on_every_public_name_and_search_method_shows_its_own_documentation():
    # help(DRIFTSearch) showed no description, help(SearchResult) / help(Manifest) pydantic's
    # "Usage Documentation" text and help(IndexStore) "Base class for protocol classes."
    import inspect

    import drift_lance

    def own_doc(obj):  # a class's own docstring, not one inherited from BaseModel or Protocol
        return obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__

    undocumented = [name for name in drift_lance.__all__[1:] if not own_doc(getattr(drift_lance, name))]
    methods = [(drift_lance.DRIFTSearch, ("search", "stream_search", "close")),
               (drift_lance.LocalSearch, ("search", "stream_search", "build_context")),
               (drift_lance.LocalContextBuilder, ("build",))]
    undocumented += [f"{owner.__name__}.{name}" for owner, names in methods for name in names
                     if not inspect.getdoc(getattr(owner, name))]
    assert undocumented == []


def test_ingest_inspect_and_query_through_the_real_entry_point(dulce_dir, tmp_path):
    """The user's path in separate processes: ingest the dulce index, inspect it, then query it
    (blocking, streamed, --json, and --graph-out in all three formats) against an OpenAI-protocol
    server on 127.0.0.1."""
    import json

    import networkx as nx

    from drift_lance.testing import FakeOpenAIServer, Reply

    db = str(tmp_path / "db")
    proc = drift_lance("ingest", str(dulce_dir), "--db", db, "--embedding-model", "text-embedding-3-large",
                       "--no-progress", timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "entities" in proc.stdout and "generation 1" in proc.stdout

    proc = drift_lance("inspect", "--db", db, "--json")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads(proc.stdout)["manifest"]
    assert manifest["tables"]["entities"]["rows"] == 39 and manifest["vectors"]["entities"]["dimension"] == 3072

    def answer(request) -> Reply:
        system, user = request.messages[0]["content"], request.messages[-1]["content"]
        if "---Community reports---" in user:
            return Reply(json={"intermediate_answer": "primer", "score": 60, "follow_up_queries": ["Who is Alex Mercer?"]})
        if "---Data tables---" in system:
            return Reply(json={"response": "local", "score": 50, "follow_up_queries": []})
        if "---Research notes---" in system:
            return Reply(text="Alex Mercer leads the mission.")
        return Reply(text="# A hypothetical report")

    with FakeOpenAIServer(embedding_dim=3072) as server:
        server.on_chat = answer
        env = cli_env(OPENAI_BASE_URL=server.base_url, OPENAI_API_KEY="sk-test", DRIFT_LANCE_MAX_RETRIES="0")
        base = ["query", "Who leads the Dulce mission?", "--db", db, "--set", "drift_k_followups=1",
                "--set", "primer_folds=1", "--set", "n_depth=1"]

        proc = drift_lance(*base, env=env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("Alex Mercer leads the mission.")
        assert "reduce" in proc.stdout and "total" in proc.stdout  # the per-stage table follows

        streamed = drift_lance(*base, "--stream", env=env)
        assert streamed.returncode == 0, streamed.stderr
        assert "Alex Mercer leads the mission." in streamed.stdout

        proc = drift_lance(*base, "--json", env=env)
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout)
        assert result["response"] == "Alex Mercer leads the mission."
        assert result["llm_calls_categories"] == {"build_context": 1, "primer": 1, "action": 1, "reduce": 1}

        for suffix in ("json", "graphml", "html"):
            graph_file = tmp_path / f"graph.{suffix}"
            proc = drift_lance(*base, "--graph-out", str(graph_file), env=env)
            assert proc.returncode == 0, proc.stderr
            assert graph_file.stat().st_size > 0
        assert nx.read_graphml(tmp_path / "graph.graphml").nodes["0"]["query"] == "Who leads the Dulce mission?"
        assert json.loads((tmp_path / "graph.json").read_text())["nodes"]
        assert (tmp_path / "graph.html").read_text().lstrip().lower().startswith("<!doctype html")


def test_ctrl_c_while_the_commands_import_is_one_line_and_exit_130(monkeypatch, capsys):
    """Ctrl-C in the first half second of `drift-lance query` (the commands' modules importing) ended
    in a KeyboardInterrupt traceback; it is the same one line and exit code as later on."""
    import drift_lance.cli as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    monkeypatch.setattr(sys, "argv", ["drift-lance"])
    with pytest.raises(SystemExit) as exit_info:
        cli.run()
    assert exit_info.value.code == 130
    assert capsys.readouterr().err.strip() == "drift-lance: interrupted"
