"""`drift-lance query`: DRIFT and local search from the command line, against the real OpenAI
backend on a FakeOpenAIServer (127.0.0.1) and the ingested dulce index."""

from __future__ import annotations

import io
import json
import logging

import networkx as nx
import pytest

from drift_lance.cli import main
from drift_lance.models import get_tokenizer
from drift_lance.testing import FakeOpenAIServer, Reply

QUERY = "Who leads the Dulce mission?"
FINAL = "Alex Mercer leads the mission [Data: Sources (0)]."


def _model(request) -> Reply:
    messages = request.messages
    system = messages[0]["content"] if messages[0]["role"] == "system" else ""
    user = messages[-1]["content"]
    if user.startswith("Write a hypothetical answer"):
        return Reply(text="# Mission leadership\n\nA hypothetical report.")
    if "---Community reports---" in user:
        return Reply(json={"intermediate_answer": "primer", "score": 60,
                           "follow_up_queries": ["Who is Alex Mercer?", "Who is Taylor Cruz?", "What is Dulce?"]})
    if "---Data tables---" in system and "follow_up_queries" in system:  # DRIFT follow-up, not local search
        return Reply(json={"response": f"about {user}", "score": 50, "follow_up_queries": []})
    if "---Research notes---" in system:
        return Reply(text=FINAL)
    return Reply(text="local answer from the tables")  # local search's own prompt


@pytest.fixture
def server(monkeypatch, no_network):
    with FakeOpenAIServer(embedding_dim=3072) as fake:
        fake.on_chat = _model
        for var in list(__import__("os").environ):
            if var.startswith("DRIFT_LANCE_"):
                monkeypatch.delenv(var)
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
        monkeypatch.setenv("DRIFT_LANCE_MAX_RETRIES", "0")
        yield fake


def test_query_json_with_set_and_graph_export(server, dulce_db_uri, tmp_path, capsys):
    graph_path = tmp_path / "graph.graphml"
    code = main(["query", QUERY, "--db", dulce_db_uri, "--json", "--graph-out", str(graph_path),
                 "--set", "drift_k_followups=2", "--set", "n_depth=1", "--set", "primer_folds=1"])
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads(out)
    assert result["response"] == FINAL
    assert result["llm_calls_categories"] == {"build_context": 1, "primer": 1, "action": 2, "reduce": 1}
    assert set(result["prompt_tokens_categories"]) == set(result["output_tokens_categories"]) == {
        "build_context", "primer", "action", "reduce"}
    assert result["llm_calls"] == len(server.chat_requests) == 5
    graph = nx.read_graphml(graph_path)
    assert graph.number_of_nodes() == 4 and graph.nodes["0"]["query"] == QUERY


def test_query_exempts_start_up_objects_from_garbage_collection(server, dulce_db_uri, capsys, unfrozen_gc):
    import gc

    assert main(["query", QUERY, "--db", dulce_db_uri, "--json", "--set", "n_depth=1", "--set", "primer_folds=1"]) == 0
    assert json.loads(capsys.readouterr().out)["response"] == FINAL
    assert gc.get_freeze_count() > 10_000


def test_query_prints_answer_then_stage_table_and_streams(server, dulce_db_uri, capsys):
    assert main(["query", QUERY, "--db", dulce_db_uri, "--set", "drift_k_followups=1", "--set", "n_depth=1",
                 "--set", "primer_folds=1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(FINAL)
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:] if line.strip()}
    assert rows["primer"][0] == "1" and rows["action"][0] == "1" and rows["total"][0] == "4"
    assert "completion time:" in out

    assert "degraded" not in out

    assert main(["query", QUERY, "--db", dulce_db_uri, "--stream", "--set", "drift_k_followups=1",
                 "--set", "n_depth=0", "--set", "primer_folds=1"]) == 0
    streamed = capsys.readouterr().out
    assert streamed.startswith(FINAL + "\n") and "reduce" in streamed
    assert server.chat_requests[-1].stream


def test_graphrag_settings_yaml_drives_the_query(server, dulce_db_uri, tmp_path, capsys):
    settings = tmp_path / "settings.yaml"
    settings.write_text(
        "completion_models:\n  default_completion_model:\n    model: gpt-4.1\n"
        "drift_search:\n  drift_k_followups: 3\n  primer_folds: 1\n  n_depth: 1\n  chat_model_id: default\n"
    )
    assert main(["query", QUERY, "--db", dulce_db_uri, "--config", str(settings), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["llm_calls_categories"]["action"] == 3


def test_graphrag_settings_yaml_local_search_block_drives_local_search(server, dulce_db_uri, tmp_path, capsys, caplog):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "local.txt").write_text("PROJECT PROMPT ({response_type})\n{context_data}")
    settings = tmp_path / "settings.yaml"
    graphrag_blocks = "completion_models:\n  default_completion_model:\n    model: gpt-4.1\n"
    settings.write_text(graphrag_blocks + "local_search:\n  prompt: prompts/local.txt\n  max_context_tokens: 1500\n"
                        "  completion_model_id: default_completion_model\n  some_future_key: 1\n")
    with caplog.at_level(logging.WARNING):
        assert main(["query", QUERY, "--db", dulce_db_uri, "--method", "local", "--config", str(settings), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    system = server.chat_requests[-1].messages[0]["content"]
    assert system.startswith("PROJECT PROMPT (multiple paragraphs)\n-----")
    assert get_tokenizer("o200k_base").count(result["context_text"]) <= 1500
    assert "ignoring unknown local_search key 'some_future_key'" in caplog.text

    settings.write_text(graphrag_blocks + "local_search:\n  max_context_tokens: -5\n")
    assert main(["query", QUERY, "--db", dulce_db_uri, "--method", "local", "--config", str(settings)]) == 2
    assert f"config file {settings}: field local.max_context_tokens" in capsys.readouterr().err


def test_local_method(server, dulce_db_uri, capsys):
    assert main(["query", QUERY, "--db", dulce_db_uri, "--method", "local", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["response"] == "local answer from the tables"
    assert "-----Entities-----" in result["context_text"]
    assert main(["query", QUERY, "--db", dulce_db_uri, "--method", "local"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()
            if line.split() and line.split()[0] in ("response", "total", "primer")}
    assert rows["response"] == rows["total"] and rows["response"][0] == "1" and "primer" not in rows


EMPTY, UNDECODABLE = ("  ", "the question is empty"), ("Who leads \udcff?", "the question is not valid UTF-8 text")


# "\udcff": what Python makes of a byte that is not UTF-8 in a command-line argument. (`context ""`
# is graphrag's context of the --set include_entity_names alone, so it is not refused.)
@pytest.mark.parametrize(("method", "question", "message"),
                         [("drift", *EMPTY), ("local", *EMPTY), ("drift", *UNDECODABLE), ("local", *UNDECODABLE),
                          ("context", *UNDECODABLE)])
def test_an_empty_or_undecodable_question_is_a_usage_error(server, dulce_db_uri, capsys, method, question, message):
    argv = ["context", question, "--db", dulce_db_uri] if method == "context" else ["query", question, "--db", dulce_db_uri, "--method", method]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert server.chat_requests == [] and server.embedding_requests == []


def _stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


def test_a_dash_reads_the_question_from_standard_input(server, dulce_db_uri, capsys, monkeypatch):
    """`echo "..." | drift-lance query -` searched for the question "-"."""
    _stdin(monkeypatch, f"{QUERY}\n".encode())
    assert main(["query", "-", "--db", dulce_db_uri, "--json", "--set", "drift_k_followups=1", "--set", "n_depth=1",
                 "--set", "primer_folds=1"]) == 0
    assert json.loads(capsys.readouterr().out)["state"]["nodes"][0]["query"] == QUERY

    _stdin(monkeypatch, f"\ufeff{QUERY}\r\n".encode())  # as a Windows editor saves it
    server.reset_stats()
    assert main(["context", "-", "--db", dulce_db_uri]) == 0
    assert server.embedding_requests[0].body["input"] in (QUERY, [QUERY])


def test_a_question_on_standard_input_that_is_not_utf8_is_a_usage_error(server, dulce_db_uri, capsys, monkeypatch):
    _stdin(monkeypatch, b"Who leads \xff?")
    assert main(["query", "-", "--db", dulce_db_uri]) == 2
    assert "the question read from standard input is not UTF-8 text" in capsys.readouterr().err
    assert server.chat_requests == []


def test_half_an_escaped_emoji_in_a_models_answer_does_not_fail_the_query(server, dulce_db_uri, capsys):
    """A follow-up answer cut by max_tokens inside a JSON escape (a lone surrogate) is repaired into
    text the next request can carry."""
    def cut_follow_ups(request):
        if "---Data tables---" in request.messages[0]["content"] and "follow_up_queries" in request.messages[0]["content"]:
            return Reply(text='{"score": 70, "follow_up_queries": ["Who is Jordan Hayes \\ud83d?"], "response": "Mercer smiled \\ud83d',
                         finish_reason="length")
        return _model(request)

    server.on_chat = cut_follow_ups
    assert main(["query", QUERY, "--db", dulce_db_uri, "--json", "--set", "n_depth=2", "--set", "drift_k_followups=2",
                 "--set", "primer_folds=1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["response"] == FINAL and result["failures"] == 0
    answers = [node["answer"] for node in result["state"]["nodes"][1:]]
    assert answers and all(answer == "Mercer smiled \ufffd" for answer in answers)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--set", "n_depth=-1"], "n_depth"),
        (["--set", "depth=2"], "unknown drift config field 'depth'"),
        (["--set", "community_level=-1"], "drift config field 'community_level' (from --set community_level)"),
        (["--set", "community_level=top"], "drift config field 'community_level'"),
        (["--graph-out", "graph.png"], "graph.png"),
        (["--method", "local", "--graph-out", "g.json"], "--graph-out needs --method drift"),
        (["--graph-out", "/no/such/dir/g.json"], "no such directory '/no/such/dir'"),
        (["--method", "local", "--set", "top_k_entitie=3"], "--set top_k_entitie: unknown local setting; did you mean 'top_k_entities'?"),
        (["--method", "local", "--set", "models.chat_modle=x"], "--set chat_modle: unknown models setting; did you mean 'chat_model'?"),
    ],
)
def test_bad_input_exits_2_naming_the_problem(server, dulce_db_uri, capsys, argv, message):
    assert main(["query", QUERY, "--db", dulce_db_uri, *argv]) == 2
    assert message in capsys.readouterr().err
    assert server.chat_requests == []  # rejected before any model call


def test_a_graph_out_path_that_is_a_directory_is_refused_before_any_model_call(server, dulce_db_uri, capsys, tmp_path):
    (tmp_path / "graph.html").mkdir()
    assert main(["query", QUERY, "--db", dulce_db_uri, "--graph-out", str(tmp_path / "graph.html")]) == 2
    assert "graph.html: is a directory" in capsys.readouterr().err and server.chat_requests == []


def test_a_settings_file_finds_its_local_prompt_from_any_directory(server, dulce_db_uri, tmp_path, monkeypatch, capsys):
    project = tmp_path / "project"
    (project / "prompts").mkdir(parents=True)
    (project / "prompts" / "local.txt").write_text("PROJECT PROMPT ({response_type})\n{context_data}")
    config = project / "drift-lance.toml"
    config.write_text('[local]\nprompt = "prompts/local.txt"\n')
    monkeypatch.chdir(tmp_path)
    assert main(["query", QUERY, "--db", dulce_db_uri, "--method", "local", "--config", str(config), "--json"]) == 0
    assert server.chat_requests[-1].messages[0]["content"].startswith("PROJECT PROMPT (multiple paragraphs)")


def test_community_level_chooses_the_primers_reports(server, dulce_db_uri, capsys):
    """graphrag's --community-level for a DRIFT query; the dulce reports are at levels 0 and 1."""

    def primer_report_levels(*sets: str) -> list[int]:
        argv = ["query", QUERY, "--db", dulce_db_uri, "--json", "--set", "n_depth=0", "--set", "primer_folds=1"]
        assert main(argv + [x for s in sets for x in ("--set", s)]) == 0, capsys.readouterr().err
        reports = json.loads(capsys.readouterr().out)["context_data"][QUERY]["reports"]
        return sorted({report["level"] for report in reports})

    assert primer_report_levels() == [0, 1]
    assert primer_report_levels("community_level=0") == [0]


def test_query_says_when_the_answer_had_to_do_without_a_failed_step(server, dulce_db_uri, capsys):
    def one_follow_up_fails(request):
        if request.messages[-1]["content"] == "Who is Taylor Cruz?":
            return Reply(status=500, body={"error": {"message": "boom"}})
        return _model(request)

    server.on_chat = one_follow_up_fails
    assert main(["query", QUERY, "--db", dulce_db_uri, "--set", "n_depth=1", "--set", "primer_folds=1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(FINAL)
    assert "degraded: answered without 1 failed step(s) (action 1; the log says why)" in out


def test_the_bundled_demo_chat_model_is_named_when_it_answers(monkeypatch, tmp_path):
    """Without an endpoint, query and serve answer with SmolLM2-135M: they say so on stderr."""
    from drift_lance.cli.query_cmd import uses_bundled_chat_model
    from drift_lance.config.models import ModelSettings

    for var in ("OPENAI_BASE_URL", "OPENAI_API_KEY", "AZURE_OPENAI_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert uses_bundled_chat_model(ModelSettings())
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"GGUF")
    assert not uses_bundled_chat_model(ModelSettings(chat_backend="local", llama_model_path=str(gguf)))
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:8080/v1")
    assert not uses_bundled_chat_model(ModelSettings())


@pytest.mark.parametrize("method", ["drift", "local"])
def test_the_bundled_model_notice_does_not_precede_a_setup_error(monkeypatch, dulce_db_uri, capsys, method):
    """Without an endpoint the embedded embedder (384-d) cannot search dulce's 3072-d vectors: the
    query must fail with that error alone, not first announce that SmolLM2 is answering."""
    import drift_lance.models as models
    from drift_lance.testing import ScriptedChatModel

    for var in ("OPENAI_BASE_URL", "OPENAI_API_KEY", "AZURE_OPENAI_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(models, "get_chat_model", lambda settings=None: ScriptedChatModel([]))  # no weights to load
    assert main(["query", QUERY, "--db", dulce_db_uri, "--method", method]) == 2
    err = capsys.readouterr().err
    assert "3072" in err and "SmolLM2" not in err


def test_a_streamed_answer_cut_by_a_failure_ends_its_line_before_the_error(server, dulce_db_uri, capsys):
    """The reduce stream broke after two words: stdout ended in "Alex Mercer leads " with no newline,
    so on a terminal the error line ran on from the half-written answer."""
    def cut_reduce(request):
        if "---Research notes---" in request.messages[0]["content"]:
            def chunks():
                for word in ("Alex Mercer ", "leads "):
                    delta = {"choices": [{"index": 0, "delta": {"content": word}}]}
                    yield f"data: {json.dumps(delta)}\n\n".encode()
                raise ConnectionResetError("the endpoint went away")
            return Reply(body_chunks=chunks(), headers={"content-type": "text/event-stream"})
        return _model(request)

    server.on_chat = cut_reduce
    assert main(["query", QUERY, "--db", dulce_db_uri, "--stream", "--set", "n_depth=0", "--set", "primer_folds=1"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "Alex Mercer leads \n"
    assert "stream failed" in captured.err


@pytest.mark.parametrize("stream", [[], ["--stream"]], ids=["blocking", "streamed"])
def test_an_empty_reduce_answer_fails_the_query(server, dulce_db_uri, capsys, stream):
    """The model's final answer was "" (finish_reason stop): a blank answer was printed, exit status 0."""
    server.on_chat = lambda request: (Reply(text="") if "---Research notes---" in request.messages[0]["content"]
                                      else _model(request))
    assert main(["query", QUERY, "--db", dulce_db_uri, *stream, "--set", "n_depth=0", "--set", "primer_folds=1"]) == 1
    captured = capsys.readouterr()
    assert captured.out.strip() == ""
    assert "failed: EmptyAnswerError: DRIFT reduce: chat model 'gpt-4.1' returned an empty answer (nothing)" in captured.err


@pytest.mark.parametrize("stream", [[], ["--stream"]], ids=["blocking", "streamed"])
def test_an_empty_local_answer_fails_the_query(server, dulce_db_uri, capsys, stream):
    """`--method local` printed a blank answer and its stage table, exit status 0."""
    server.on_chat = lambda request: Reply(text="  \n")
    assert main(["query", QUERY, "--db", dulce_db_uri, "--method", "local", *stream]) == 1
    captured = capsys.readouterr()
    assert captured.out.strip() == "" and "llm_calls" not in captured.out
    assert ("failed: EmptyAnswerError: local search answer: chat model 'gpt-4.1' returned an empty answer "
            "(only whitespace)") in captured.err


def test_a_call_the_client_retried_counts_once_with_its_answers_tokens(server, dulce_db_uri, capsys, monkeypatch):
    """The stage counts are model calls, not HTTP attempts: a 500 then an answer is one call, with
    the tokens the server reported for the answer."""
    monkeypatch.setenv("DRIFT_LANCE_MAX_RETRIES", "2")
    monkeypatch.setenv("DRIFT_LANCE_RETRY_BASE_WAIT", "0")
    answer = "local answer from the tables"
    server.queue_chat(Reply.server_error(500), Reply(text=answer))
    assert main(["query", QUERY, "--db", dulce_db_uri, "--method", "local", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    first, answered = server.chat_requests
    usage = server._usage(answered, answer)
    assert result["response"] == answer
    assert result["llm_calls_categories"] == {"build_context": 0, "response": 1} and result["llm_calls"] == 1
    assert (result["prompt_tokens"], result["output_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])


def test_a_database_missing_a_table_is_refused_before_any_model_call(server, dulce_db_uri, tmp_path, capsys):
    """A copy of the database without its entities table answered exit 0 from the primer alone: every
    follow-up failed opening the table, after the HyDE and primer calls were paid for, and the answer
    was only called "degraded"."""
    import shutil

    partial = tmp_path / "partial"
    shutil.copytree(dulce_db_uri, partial)
    shutil.rmtree(partial / "entities.lance")
    for method in ("drift", "local"):
        assert main(["query", QUERY, "--db", str(partial), "--method", method]) == 2
        err = capsys.readouterr().err
        assert f"{partial}: cannot open table 'entities'" in err and "Traceback" not in err
    assert server.chat_requests == [] and server.embedding_requests == []


def test_a_failed_json_query_still_prints_json(server, dulce_db_uri, tmp_path, capsys):
    """`query --json > result.json` that failed left result.json empty (the error was on stderr only),
    so a script's `jq` read no JSON at all."""
    def reduce_fails(request):
        if "---Research notes---" in request.messages[0]["content"]:
            return Reply.server_error(500, "overloaded")
        return _model(request)

    assert main(["query", QUERY, "--db", str(tmp_path / "nothing"), "--json"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"error": {"code": "error", "type": "StoreError", "message": captured.err.split(": error: ", 1)[1].strip()}}

    server.on_chat = reduce_fails
    assert main(["query", QUERY, "--db", dulce_db_uri, "--json", "--set", "n_depth=0", "--set", "primer_folds=1"]) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["code"] == "failed" and error["type"] == "ModelRequestError" and "overloaded" in error["message"]


def test_a_manifest_without_a_required_table_is_refused_before_any_model_call(server, dulce_db_uri, tmp_path, capsys):
    """A manifest that lists no entities table (not one an ingest writes) was searched: every follow-up
    failed with "table 'entities' is not in manifest generation 1", and the answer came from the primer
    alone with exit 0."""
    import shutil

    import lancedb

    edited = tmp_path / "edited"
    shutil.copytree(dulce_db_uri, edited)
    table = lancedb.connect(str(edited)).open_table("drift_lance_manifest")
    row = table.to_arrow().to_pylist()[-1]
    manifest = json.loads(row["manifest"])
    del manifest["tables"]["entities"]
    table.update(where=f"generation = {row['generation']}", values={"manifest": json.dumps(manifest)})
    assert main(["query", QUERY, "--db", str(edited)]) == 2
    assert "lists no table 'entities', which every ingest writes" in capsys.readouterr().err
    assert server.chat_requests == [] and server.embedding_requests == []


@pytest.mark.parametrize("command", ["drift", "local", "context"])
def test_a_missing_data_file_names_its_table(server, dulce_db_uri, tmp_path, capsys, command):
    """A partial copy without community_reports' data files failed with exit 1 and LanceDB's bare
    "RuntimeError: lance error: Not found: <file>, <a Rust source line>", naming no table."""
    import shutil

    partial = tmp_path / "partial"
    shutil.copytree(dulce_db_uri, partial)
    shutil.rmtree(partial / "community_reports.lance" / "data")
    argv = (["context", QUERY, "--db", str(partial)] if command == "context"
            else ["query", QUERY, "--db", str(partial), "--method", command])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{partial}: table 'community_reports' at version" in err and "cannot be read" in err
