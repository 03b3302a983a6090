"""End-to-end DRIFT against an OpenAI-protocol server on 127.0.0.1 that answers every chat call after a
fixed latency: wall time versus the critical-path lower bound, so the engine's own overhead shows.

Lower bound = latency x (HyDE calls + ceil(primer calls / C) + sum over epochs of
ceil(actions in epoch / C) + 1 reduce), C = DRIFTSearchConfig.concurrency. Everything above it --
embedding round trips, ANN queries, local context building, prompt rendering, JSON parsing, HTTP --
is the engine's overhead. The real `openai` client and the production OpenAI backend are used.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._harness import Record, latency_summary, log, run_case, write_records
from benchmarks.engine import ensure_ingested

FOLLOW_UPS_PER_ANSWER = 3


def stage_answerer(delay: float, follow_ups_per_answer: int = FOLLOW_UPS_PER_ANSWER) -> Callable[[Any], Any]:
    """A FakeOpenAIServer chat handler that recognises each DRIFT stage by its prompt and answers
    valid output after `delay` seconds (HyDE text, primer/local JSON with follow-ups, reduce text)."""
    from drift_lance.testing import Reply

    counter = itertools.count()

    def follow_ups() -> list[str]:
        return [f"What else is known about topic {next(counter)}?" for _ in range(follow_ups_per_answer)]

    def answer(request: Any) -> Reply:
        messages = request.messages
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
        user = messages[-1]["content"] if messages else ""
        if "---Community reports---" in user:
            return Reply(delay=delay, json={"intermediate_answer": "Primer finding.", "score": 70,
                                            "follow_up_queries": follow_ups()})
        if "---Data tables---" in system:
            return Reply(delay=delay, json={"response": "Local finding.", "score": 60,
                                            "follow_up_queries": follow_ups()})
        if "---Research notes---" in system:
            return Reply(delay=delay, text="Final answer based on the research notes.")
        return Reply(delay=delay, text="# Hypothetical report\n\nA plausible community report about the query.")

    return answer


class LLMServerProcess:
    """The fake OpenAI-protocol server in its own process, as a real LLM server is: in-process it
    would share the GIL with the engine and its JSON and HTTP work would count as engine overhead.
    `python -m benchmarks.drift_overhead DIM DELAY_S` prints its base URL, serves until its stdin
    closes, then prints its counters as JSON."""

    def __init__(self, dim: int, delay_s: float) -> None:
        import subprocess
        import sys

        from benchmarks._harness import child_env

        self._proc = subprocess.Popen([sys.executable, "-m", "benchmarks.drift_overhead", str(dim), str(delay_s)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env())
        assert self._proc.stdout is not None
        self.base_url = self._proc.stdout.readline().strip()
        if not self.base_url.startswith("http"):
            self._proc.kill()
            raise RuntimeError(f"LLM server process did not start (said {self.base_url!r})")
        self.stats: dict[str, Any] = {}

    def __enter__(self) -> LLMServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.close()
        line = self._proc.stdout.readline()
        self._proc.wait(timeout=30)
        self.stats = json.loads(line) if line.strip() else {}


def _serve(dim: int, delay_s: float) -> None:
    import sys

    from drift_lance.testing import FakeOpenAIServer

    with FakeOpenAIServer(embedding_dim=dim) as server:
        server.on_chat = stage_answerer(delay_s)
        print(server.base_url, flush=True)
        sys.stdin.read()  # until the parent closes our stdin
        print(json.dumps({"max_concurrent": server.max_concurrent, "chat_requests": len(server.chat_requests),
                          "cpu_s": time.process_time()}), flush=True)


def drift_case(db: str, dim: int, latency_ms: float, queries: int) -> dict[str, Any]:
    from drift_lance import freeze_long_lived_objects
    from drift_lance.config.drift import DRIFTSearchConfig
    from drift_lance.config.models import ModelSettings
    from drift_lance.drift import DriftCallbacks, open_drift_search
    from drift_lance.models import get_chat_model

    delay = latency_ms / 1000.0

    class EpochClock(DriftCallbacks):
        """Each epoch's size and start, and when the reduce starts (the end of the last epoch)."""

        def __init__(self) -> None:
            self.sizes: list[int] = []
            self.starts: list[float] = []
            self.reduce_start = math.inf

        def on_epoch_start(self, epoch: int, actions: list[Any]) -> None:
            self.sizes.append(len(actions))
            self.starts.append(time.perf_counter())

        def on_reduce_start(self, state: Any) -> None:
            self.reduce_start = time.perf_counter()

        def dispatch_s(self, call_starts: list[float]) -> list[float]:
            """Per epoch: from its start to the start of its last LLM call, the engine work (query
            embedding, entity search, row lookups, context builds, requests) that precedes the
            epoch's last answer. Less noisy than wall time: no LLM latency or tail in it."""
            bounds = [*self.starts[1:], self.reduce_start]
            spans = []
            for start, end in zip(self.starts, bounds):
                inside = [t for t in call_starts if start <= t < end]
                if inside:
                    spans.append(max(inside) - start)
            return spans

    class CallClock:
        """The chat model, with the start time of every call."""

        def __init__(self, model: Any) -> None:
            self.model = model
            self.starts: list[float] = []

        def __getattr__(self, name: str) -> Any:
            return getattr(self.model, name)

        async def complete(self, messages: Any, **kwargs: Any) -> Any:
            self.starts.append(time.perf_counter())
            return await self.model.complete(messages, **kwargs)

    async def run(server: Any) -> dict[str, Any]:
        settings = ModelSettings(chat_backend="openai", embedding_backend="openai", chat_model="bench-chat",
                                 embedding_model="bench-embed", embedding_dimension=dim, base_url=server.base_url,
                                 api_key="sk-bench",
                                 request_timeout=30.0, max_retries=0)
        config = DRIFTSearchConfig(seed=0)
        chat = CallClock(get_chat_model(settings))
        search = await open_drift_search(db, config=config, model_settings=settings, chat_model=chat)
        freeze_long_lived_objects()  # as `drift-lance serve` and `drift-lance query` do once open
        walls, cpus, loop_cpus, bounds, calls, prompt_tokens, output_tokens, categories = [], [], [], [], [], [], [], {}
        dispatches: list[float] = []
        try:
            for i in range(queries + 1):  # query 0 warms the store, index and HTTP pool: not counted
                epochs = EpochClock()
                chat.starts.clear()
                started, cpu_started, loop_started = time.perf_counter(), time.process_time(), time.thread_time()
                result = await search.search(f"What are the main themes of community {i}?", callbacks=[epochs])
                wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
                loop_cpu = time.thread_time() - loop_started
                if i == 0:
                    continue
                cats = result.llm_calls_categories
                rounds = (cats.get("build_context", 0) + math.ceil(cats.get("primer", 0) / config.concurrency)
                          + sum(math.ceil(n / config.concurrency) for n in epochs.sizes) + cats.get("reduce", 0))
                walls.append(wall)
                dispatches.extend(epochs.dispatch_s(chat.starts))
                cpus.append(cpu)
                loop_cpus.append(loop_cpu)
                bounds.append(rounds * delay)
                calls.append(result.llm_calls)
                prompt_tokens.append(result.prompt_tokens)
                output_tokens.append(result.output_tokens)
                categories = {"llm_calls_by_stage": cats, "epoch_sizes": epochs.sizes, "rounds": rounds}
        finally:
            await search.close()
            await chat.model.aclose()
        mean_wall = sum(walls) / len(walls)
        mean_bound = sum(bounds) / len(bounds)
        return {
            **latency_summary(walls), "queries": len(walls), "mean_wall_ms": mean_wall * 1000,
            "critical_path_ms": mean_bound * 1000, "overhead_ms": (mean_wall - mean_bound) * 1000,
            "overhead_pct": 100.0 * (mean_wall - mean_bound) / mean_wall,
            "engine_cpu_ms": 1000 * sum(cpus) / len(cpus),  # every thread of the engine's process
            # the event loop's thread alone: the work that sits on the critical path, less noisy than wall time
            "engine_loop_cpu_ms": 1000 * sum(loop_cpus) / len(loop_cpus),
            "epoch_dispatch_ms": 1000 * sum(dispatches) / len(dispatches) if dispatches else None,
            "llm_calls": sum(calls) / len(calls), "prompt_tokens": sum(prompt_tokens) / len(prompt_tokens),
            "output_tokens": sum(output_tokens) / len(output_tokens),
            "config": {"n_depth": config.n_depth, "drift_k_followups": config.drift_k_followups,
                       "primer_folds": config.primer_folds, "concurrency": config.concurrency},
            **categories,
        }

    with LLMServerProcess(dim, delay) as server:
        result = asyncio.run(run(server))
    return {**result, "max_concurrent_llm": server.stats.get("max_concurrent"),
            # the LLM server process over all queries, the uncounted warm-up one included
            "llm_server_cpu_ms": 1000 * server.stats.get("cpu_s", 0.0) / (queries + 1)}


def run_drift(latency_ms: float, queries: int, rows: int, dim: int, out: Path, work: Path) -> list[Record]:
    meta = ensure_ingested(rows, dim, work, out)
    log(f"DRIFT end to end: {rows:,} entities x {dim}, {latency_ms:g} ms simulated LLM latency, {queries} queries")
    case = run_case("benchmarks.drift_overhead:drift_case", db=meta["db"], dim=dim, latency_ms=latency_ms,
                    queries=queries)
    record = Record(
        benchmark="drift", rows=rows, dim=dim, method="drift_lance_drift",
        p50_ms=case["p50_ms"], p95_ms=case["p95_ms"], p99_ms=case["p99_ms"], peak_rss_mb=case["peak_rss_mb"],
        queries=case["queries"], params={"latency_ms": latency_ms, **case["config"]},
        extra={k: case[k] for k in ("mean_wall_ms", "critical_path_ms", "overhead_ms", "overhead_pct", "llm_calls", "prompt_tokens",
                                    "output_tokens", "max_concurrent_llm", "engine_cpu_ms", "engine_loop_cpu_ms", "epoch_dispatch_ms", "llm_server_cpu_ms", "epoch_sizes", "rounds",
                                    "llm_calls_by_stage")}
        | {"latency_ms": latency_ms},
    )
    write_records(out, "drift", [record])
    return [record]


# The configuration graphrag 3.3.0 was timed with in the DRIFT issue (8 chat calls): k=5, folds=1, depth=1.
FIRST_ANSWER_SETTINGS = {"drift_k_followups": 5, "primer_folds": 1, "n_depth": 1}


def first_answer_case(db: str, dim: int, runs: int) -> dict[str, Any]:
    """Whole-process wall time and peak RSS of `drift-lance query` (a fresh interpreter each run,
    from exec to printed answer) against an OpenAI-protocol server on 127.0.0.1 that answers at once.
    This is what a user of the CLI waits for, imports and store open included."""
    import shutil
    import subprocess
    import sys
    import tempfile

    from drift_lance.testing import FakeOpenAIServer

    exe = shutil.which("drift-lance", path=os.path.dirname(sys.executable)) or shutil.which("drift-lance")
    if exe is None:
        raise RuntimeError("the drift-lance console script is not installed next to this Python")
    walls, peaks, calls = [], [], []
    with FakeOpenAIServer(embedding_dim=dim) as server:
        # as many follow-ups as drift_k_followups, so the epoch is full: 1 + 1 + 5 + 1 = 8 chat calls
        server.on_chat = stage_answerer(0.0, FIRST_ANSWER_SETTINGS["drift_k_followups"])
        env = {**os.environ, "DRIFT_LANCE_CHAT_BACKEND": "openai", "DRIFT_LANCE_EMBEDDING_BACKEND": "openai",
               "DRIFT_LANCE_CHAT_MODEL": "bench-chat", "DRIFT_LANCE_EMBEDDING_MODEL": "bench-embed",
               "DRIFT_LANCE_EMBEDDING_DIMENSION": str(dim), "DRIFT_LANCE_BASE_URL": server.base_url,
               "DRIFT_LANCE_MODEL_API_KEY": "sk-bench", "DRIFT_LANCE_MAX_RETRIES": "0"}
        sets = [arg for key, value in FIRST_ANSWER_SETTINGS.items() for arg in ("--set", f"{key}={value}")]
        for i in range(runs + 1):  # run 0 warms the OS page cache: not counted
            before = len(server.chat_requests)
            started = time.perf_counter()
            with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
                proc = subprocess.Popen([exe, "query", f"What are the main themes of community {i}?", "--db", db,
                                         *sets, "--json"], env=env, stdout=out_f, stderr=err_f, text=True)
                _, status, usage = os.wait4(proc.pid, 0)  # the child's own peak RSS, not the harness's
                wall = time.perf_counter() - started
                proc.returncode = os.waitstatus_to_exitcode(status)
                out_f.seek(0)
                err_f.seek(0)
                stdout, stderr = out_f.read(), err_f.read()
            if proc.returncode != 0:
                raise RuntimeError(f"drift-lance query failed: {stderr.strip()[-2000:]}")
            result = json.loads(stdout)
            if i == 0:
                continue
            walls.append(wall)
            peaks.append(usage.ru_maxrss / 1024.0)
            calls.append(len(server.chat_requests) - before)
            assert result["response"], "empty answer"
    return {**latency_summary(walls), "runs": len(walls), "process_peak_rss_mb": max(peaks),
            "chat_calls": calls[-1], "settings": FIRST_ANSWER_SETTINGS}


def run_first_answer(rows: int, dim: int, runs: int, out: Path, work: Path) -> Record:
    meta = ensure_ingested(rows, dim, work, out)
    log(f"DRIFT first answer, whole process: {rows:,} entities x {dim}, instant LLM, {runs} runs")
    case = run_case("benchmarks.drift_overhead:first_answer_case", db=meta["db"], dim=dim, runs=runs)
    record = Record(
        benchmark="first_answer", rows=rows, dim=dim, method="drift_lance_cli_query",
        p50_ms=case["p50_ms"], p95_ms=case["p95_ms"], p99_ms=case["p99_ms"], peak_rss_mb=case["process_peak_rss_mb"],
        queries=case["runs"], params=case["settings"],
        extra={"chat_calls": case["chat_calls"], "targets": {"wall_s": 3.0, "rss_mb": 1024},
               "what": "exec of `drift-lance query --json` to exit; LLM server on 127.0.0.1 answering instantly"},
    )
    write_records(out, "first_answer", [record])
    return record


if __name__ == "__main__":  # the LLM server process of LLMServerProcess
    import sys

    _serve(int(sys.argv[1]), float(sys.argv[2]))
