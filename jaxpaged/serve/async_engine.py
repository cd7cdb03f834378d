"""AsyncEngine: the server's handle on an ``LLMEngine`` that steps continuously in its own process (or thread).

The engine side (``EngineCore``) runs the server's commands (add, abort, snapshot) between two steps and
hands each step's outputs back in one message. The server side (``AsyncEngine``) owns the requests'
``asyncio.Queue``s: it registers a request's queue under an id it chose *before* sending the add, so no
output can arrive for a queue that does not exist yet, and it touches the queues only on the event loop.

Two transports, one protocol:

* ``AsyncEngine.in_process(llm_kwargs)`` (what ``jaxpaged serve`` runs): the engine lives in a child process
  (``spawn``) that builds ``LLM(**llm_kwargs)``, warms up, then loops; commands and outputs travel over a
  pipe, read on the server's side by one thread. The engine's host work (scheduling, building step
  inputs, detokenising) and the server's (parsing, JSON, HTTP) then run on two cores instead of taking
  turns on one interpreter lock: in one process, the saturated server's decode steps took 5x as long as
  the same steps offline. Deltas travel as tuples of their completions' fields (``_pack``).
* ``AsyncEngine.in_thread(llm)``: the engine in a daemon thread of this process (tests, notebooks).

A streaming handler that fell behind takes the deltas queued for it as one (``merge_deltas``): a saturated
server writes fewer, larger chunks instead of falling further behind.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import multiprocessing
import pickle
import queue
import threading
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from ..engine.llm_engine import LLMEngine
from ..io.outputs import CompletionOutput, RequestOutput, merge_deltas
from ..io.prompts import chat_prompts
from ..sampling import RequestOutputKind, SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ServedModel:
    """What the HTTP side needs to know of the model (the engine itself may be in another process)."""

    model_path: Path
    tokenizer: Any  # jaxpaged.io.tokenizer.Tokenizer or None
    default_sampling_params: SamplingParams
    max_model_len: int
    warmed_up: bool = False  # the steps were compiled at start-up (else they compile on first use)
    vocab_size: int = 0  # the model's (the width of structured outputs' token masks)
    eos_token_ids: tuple[int, ...] = ()

    @functools.cached_property
    def grammars(self):
        """Structured outputs' compiler, to refuse a grammar that cannot be compiled with a 400 before the
        request reaches the engine (which compiles it again, from its own cache)."""
        from ..sampling.grammar import GrammarCompiler

        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer")
        return GrammarCompiler(self.tokenizer.to_json(), self.vocab_size, self.eos_token_ids)

    def chat_prompts(self, messages, chat_template_kwargs: dict | None = None) -> list[str]:
        return chat_prompts(self.tokenizer, messages, chat_template_kwargs=chat_template_kwargs)

    @functools.cached_property
    def max_prompt_bytes(self) -> int | None:
        """The most bytes a prompt of ``max_model_len`` tokens can be (None without a tokenizer)."""
        return None if self.tokenizer is None else self.max_model_len * self.tokenizer.max_token_bytes()


class EngineCore:
    """The engine's side: executes commands between steps; ``emit`` gets each step's outputs."""

    def __init__(self, engine: LLMEngine, emit: Callable[[list[RequestOutput]], None]):
        self.engine, self.emit = engine, emit

    def execute(self, command: tuple) -> Any:
        """``("add", prompt, sampling_params, cache_salt, request_id)`` -> the request id (or the engine's
        ``ValueError``/``TypeError``); ``("abort", request_id)`` -> whether it was still unfinished;
        ``("snapshot",)`` -> (requests running, requests waiting, ``LLMEngine.stats()``)."""
        name, *args = command
        if name == "add":
            prompt, sampling_params, cache_salt, request_id = args
            return self.engine.add_request(prompt, sampling_params, request_id=request_id, cache_salt=cache_salt)
        if name == "abort":
            try:
                self.engine.abort_request(args[0])
            except KeyError:  # finished meanwhile
                return False
            return True
        if name == "snapshot":
            sched = self.engine.scheduler
            return (len({s.parent.request_id for s in sched.running}),
                    len({s.parent.request_id for s in sched.waiting}), self.engine.stats())
        raise ValueError(f"unknown engine command {name!r}")

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> None:
        outs = self.engine.step()
        if outs:
            self.emit(outs)


# ---- transports: run an EngineCore somewhere, carry commands to it and outputs back -----------------------
class _ThreadTransport:
    """The engine in a daemon thread; commands through a queue, each answered through its future."""

    def __init__(self, engine: LLMEngine, on_outputs: Callable, on_error: Callable):
        self._core = EngineCore(engine, on_outputs)
        self._on_error = on_error
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="jaxpaged-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._run_commands(block=not self._core.busy())
                if self._core.busy():
                    self._core.step()
        except BaseException as err:  # noqa: BLE001  (reported to every waiting request, then /health)
            log.exception("jaxpaged: the engine loop stopped")
            self._on_error(err)

    def _run_commands(self, block: bool) -> None:
        """Runs the posted commands (waiting up to 0.1 s for one when ``block``)."""
        try:
            item = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            command, future = item
            try:
                future.set_result(self._core.execute(command))
            except BaseException as err:  # noqa: BLE001  (the caller's to handle)
                future.set_exception(err)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def submit(self, command: tuple) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((command, future))
        return future

    def shutdown(self) -> None:
        self._stopped = True
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._run_commands(block=False)  # (aborts posted last, e.g. at shutdown, still release their blocks)


def _pack(out: RequestOutput):
    """An output for the pipe: a final one whole; a delta as a tuple of its completions' fields only (the
    prompt, metrics and counts travel once, with the final output). Pickling 256 outputs a step as
    dataclasses took ~2 ms on each side; as tuples ~0.1 ms."""
    if out.finished:
        return out
    return out.request_id, [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs,
                             c.cumulative_logprob) for c in out.outputs]


def _unpack(item) -> RequestOutput:
    """``_pack``'s inverse on the server's side (a delta's prompt fields empty, its metrics ``None``)."""
    if isinstance(item, RequestOutput):
        return item
    request_id, completions = item
    return RequestOutput(request_id, None, [], [CompletionOutput(*c) for c in completions], False, 0, None)


def _portable(err: Exception) -> Exception:
    """``err`` if it survives pickling (to cross the pipe), else a ``RuntimeError`` with its text."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(err).__name__}: {err}")


def _engine_process(conn, llm_kwargs: dict) -> None:
    """The engine process: builds and warms up ``LLM(**llm_kwargs)``, reports ready, then steps and runs
    commands until the pipe closes."""
    try:
        from ..llm import LLM

        llm = LLM(**llm_kwargs)
        cfg = llm.engine.params.config
        conn.send(("ready", (str(llm.model_path), llm.default_sampling_params, llm.engine.max_model_len,
                             llm.warmed_up, cfg.vocab_size, tuple(cfg.eos_token_id))))
        core = EngineCore(llm.engine, lambda outs: conn.send(("outputs", [_pack(o) for o in outs])))
        while True:
            while conn.poll(0 if core.busy() else 0.1):
                kind, command_id, command = conn.recv()
                if kind == "stop":
                    return
                try:
                    reply = ("reply", command_id, True, core.execute(command))
                except Exception as err:  # noqa: BLE001  (the request's failure, not the engine's)
                    reply = ("reply", command_id, False, _portable(err))
                conn.send(reply)
            if core.busy():
                core.step()
    except (EOFError, BrokenPipeError, KeyboardInterrupt):  # the server went away
        return
    except BaseException as err:  # noqa: BLE001
        log.exception("jaxpaged: the engine process stopped")
        try:
            conn.send(("error", f"{type(err).__name__}: {err}"))
        except (OSError, ValueError):
            pass


class _ProcessTransport:
    """The engine in a child process; one pipe both ways, read here by a daemon thread."""

    def __init__(self, llm_kwargs: dict, on_outputs: Callable, on_error: Callable):
        ctx = multiprocessing.get_context("spawn")  # (a forked JAX runtime is unusable)
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_process, args=(child, llm_kwargs), name="jaxpaged-engine",
                                 daemon=True)
        self._proc.start()
        child.close()
        try:
            kind, payload = self._conn.recv()  # blocks through the model's load and warm-up
        except EOFError:
            kind, payload = "error", f"exit code {self._proc.exitcode}"
        if kind != "ready":
            self._proc.join(timeout=5)
            raise RuntimeError(f"the engine process failed to start: {payload}")
        self.ready = payload
        self._on_outputs, self._on_error = on_outputs, on_error
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        # One thread at a time waits for the child: two that reap it at once can each miss its exit code
        # (one's waitpid finds it already reaped), and a stopped child then looks alive.
        self._reap_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="jaxpaged-engine-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "outputs":
                    self._on_outputs([_unpack(item) for item in msg[1]])
                elif msg[0] == "reply":
                    _, command_id, ok, result = msg
                    future = self._futures.pop(command_id)
                    future.set_result(result) if ok else future.set_exception(result)
                else:
                    raise RuntimeError(msg[1])
        except (EOFError, OSError) as err:
            with self._reap_lock:
                self._proc.join(timeout=1)
                exitcode = self._proc.exitcode
            self._fail(RuntimeError(f"the engine process exited (exit code {exitcode}; "
                                    f"{type(err).__name__} on its pipe)"))
        except BaseException as err:  # noqa: BLE001
            self._fail(err)

    def _fail(self, err: BaseException) -> None:
        for future in list(self._futures.values()):
            future.set_exception(err)
        self._futures.clear()
        self._on_error(err)

    def submit(self, command: tuple) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._send_lock:
            command_id = next(self._ids)
            self._futures[command_id] = future
            self._conn.send(("command", command_id, command))
        return future

    def shutdown(self) -> None:
        """Asks the engine process to stop and waits for it. (Closing the pipe alone did not reach the child
        while this side's reader thread sat in ``recv`` on it: the child ran on until the join timed out,
        10 s.)"""
        try:
            with self._send_lock:
                self._conn.send(("stop", None, None))
        except (OSError, ValueError):  # the engine process is gone already
            pass
        with self._reap_lock:
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.terminate()
        self._conn.close()


# ---- the server's side ------------------------------------------------------------------------------------
class EngineStopped(RuntimeError):
    """The engine is gone: no request can run any more."""


class RequestAborted(RuntimeError):
    """The server ended a request before it finished (shutdown)."""


class AsyncEngine:
    """The server's handle: ``generate`` streams one request's outputs. Build it with ``in_process`` or
    ``in_thread``. ``on_abort``: called for each request withdrawn before it finished."""

    def __init__(self, model: ServedModel | None, on_abort: Callable[[], None] | None = None):
        self.model = model
        self.on_abort = on_abort
        self._queues: dict[str, asyncio.Queue] = {}  # touched on the event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._transport: _ThreadTransport | _ProcessTransport | None = None
        self.error: BaseException | None = None  # what stopped the engine, if anything did
        self.on_error: Callable[[BaseException], None] | None = None  # called (on the loop) if the engine stops

    @classmethod
    def in_thread(cls, llm, on_abort: Callable[[], None] | None = None) -> AsyncEngine:
        """Over ``llm`` (``jaxpaged.LLM``, already built) stepping in a thread of this process."""
        cfg = llm.engine.params.config
        self = cls(ServedModel(llm.model_path, llm.tokenizer, llm.default_sampling_params,
                               llm.engine.max_model_len, llm.warmed_up, cfg.vocab_size, tuple(cfg.eos_token_id)),
                   on_abort)
        self._transport = _ThreadTransport(llm.engine, self._post_outputs, self._post_error)
        return self

    @classmethod
    def in_process(cls, llm_kwargs: dict, on_abort: Callable[[], None] | None = None) -> AsyncEngine:
        """Over ``LLM(**llm_kwargs)`` built (warmed up on a GPU) in a child process; returns once it is ready."""
        from ..io.tokenizer import load_tokenizer

        self = cls(None, on_abort)  # (its model is known once the engine process is ready)
        transport = _ProcessTransport(llm_kwargs, self._post_outputs, self._post_error)
        path, defaults, max_model_len, warmed_up, vocab_size, eos_token_ids = transport.ready
        self.model = ServedModel(Path(path), load_tokenizer(path), defaults, max_model_len, warmed_up, vocab_size,
                                 eos_token_ids)
        self._transport = transport
        return self

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Delivers outputs and errors on ``loop`` from now on (the server calls it as it starts)."""
        self._loop = loop
        if self.error is not None:
            loop.call_soon(self._dispatch_error, self.error)

    # ---- from the engine's thread (or the pipe's reader thread) ----------------------------------------
    def _post_outputs(self, outs: list[RequestOutput]) -> None:
        self._post(self._dispatch, outs)

    def _post_error(self, err: BaseException) -> None:
        self.error = err
        self._post(self._dispatch_error, err)

    def _post(self, fn: Callable, arg) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, arg)
            except RuntimeError:  # closed meanwhile: the server is gone, nobody is listening
                pass

    # ---- on the event loop ----------------------------------------------------------------------------
    def _dispatch(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            q = self._queues.get(out.request_id)
            if q is None:
                continue  # aborted by its handler meanwhile
            if out.finished:
                del self._queues[out.request_id]
            q.put_nowait(out)

    def _dispatch_error(self, err: BaseException) -> None:
        for q in self._queues.values():
            q.put_nowait(err)
        self._queues.clear()
        if self.on_error is not None:
            self.on_error(err)

    def abort_all(self, reason: str) -> int:
        """Ends every request still running with ``reason`` as its error (their streams end with it) and
        withdraws them from the engine (shutdown). Returns how many there were. On the event loop."""
        ids = list(self._queues)
        for request_id in ids:
            self._queues.pop(request_id).put_nowait(RequestAborted(reason))
            if self.error is None:
                self._transport.submit(("abort", request_id))
        return len(ids)

    async def call(self, command: tuple):
        """Runs ``command`` (``EngineCore.execute``) on the engine's side between two steps."""
        if self.error is not None:
            raise EngineStopped(f"the engine stopped: {self.error}")
        return await asyncio.wrap_future(self._transport.submit(command))

    async def add(self, prompt, sampling_params: SamplingParams, cache_salt: str | None = None
                  ) -> tuple[str, asyncio.Queue]:
        """Queues a request (``LLMEngine.add_request``: its ``ValueError``/``TypeError`` propagate, and a
        refused request leaves the engine untouched). Returns its id and the queue its outputs arrive on."""
        self._loop = asyncio.get_running_loop()
        request_id, q = uuid.uuid4().hex, asyncio.Queue()
        self._queues[request_id] = q  # before the engine can make any output for it
        try:
            await self.call(("add", prompt, sampling_params, cache_salt, request_id))
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        return request_id, q

    async def generate(self, prompt, sampling_params: SamplingParams, cache_salt: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine makes them (one final output, or deltas when
        ``sampling_params.output_kind`` asks). Leaving the iteration early (a client that went away)
        aborts the request: its blocks are freed at once."""
        request_id, q = await self.add(prompt, sampling_params, cache_salt)
        async for out in self.outputs(request_id, q, sampling_params.output_kind == RequestOutputKind.DELTA):
            yield out

    async def outputs(self, request_id: str, q: asyncio.Queue, merge: bool = False) -> AsyncIterator[RequestOutput]:
        """The outputs of a request ``add`` queued; leaving early aborts it. ``merge`` (``DELTA`` outputs
        only): the deltas already queued when one is taken come as one."""
        finished = False
        try:
            while not finished:
                out = await q.get()
                while merge and not q.empty() and isinstance(out, RequestOutput) and not out.finished:
                    later = q.get_nowait()
                    out = merge_deltas(out, later) if isinstance(later, RequestOutput) else later
                if isinstance(out, RequestAborted):
                    raise out
                if isinstance(out, BaseException):
                    raise EngineStopped(f"the engine stopped: {out}") from out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.withdraw(request_id)

    def withdraw(self, request_id: str) -> None:
        """Aborts a request if it is unfinished, a no-op otherwise (not awaited: its handler may be
        being cancelled)."""
        if self._queues.pop(request_id, None) is None or self.error is not None:
            return
        future = self._transport.submit(("abort", request_id))
        if self.on_abort is not None:
            future.add_done_callback(lambda f: f.exception() is None and f.result() and self.on_abort())

    async def abort(self, request_id: str) -> None:
        """Withdraws a request if it is still unfinished (a no-op otherwise)."""
        self._queues.pop(request_id, None)
        if await self.call(("abort", request_id)) and self.on_abort is not None:
            self.on_abort()

    async def snapshot(self) -> tuple[int, int, dict]:
        """``(requests running, requests waiting, LLMEngine.stats())`` now."""
        return await self.call(("snapshot",))

    def shutdown(self) -> None:
        if self._transport is not None:
            self._transport.shutdown()
