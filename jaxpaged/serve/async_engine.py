"""AsyncEngine: an ``LLMEngine`` stepping in its own thread, fed and read by an asyncio server.

The engine is not thread-safe, so only its thread touches it: adding, aborting and reading statistics
are commands the server posts to that thread, which runs them between two steps and answers through a
future (a lock instead starved the server: the engine thread took it back after every step). Each
request's outputs reach its handler through an ``asyncio.Queue``: one ``call_soon_threadsafe`` per step
hands the event loop all of that step's outputs (one wake-up of the loop per step, not one per request).
A streaming handler that fell behind takes the deltas queued for it as one (``merge_deltas``), so a
saturated server writes fewer, larger chunks instead of falling further behind. With nothing to do, the
engine thread sleeps until a command arrives.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import AsyncIterator, Callable

from ..engine.llm_engine import LLMEngine
from ..io.outputs import RequestOutput, merge_deltas
from ..sampling import RequestOutputKind, SamplingParams

log = logging.getLogger(__name__)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


class AsyncEngine:
    """``engine`` stepped continuously in a daemon thread; ``generate`` streams one request's outputs.
    ``on_abort``: called for each request withdrawn before it finished."""

    def __init__(self, engine: LLMEngine, on_abort: Callable[[], None] | None = None):
        self.engine = engine
        self.on_abort = on_abort
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self.error: BaseException | None = None  # what stopped the engine thread, if anything did
        self._thread = threading.Thread(target=self._run, name="jaxpaged-engine", daemon=True)
        self._thread.start()

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped:
                self._run_commands(block=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
        except BaseException as err:  # noqa: BLE001  (reported to every waiting request, then /health)
            log.exception("jaxpaged: the engine loop stopped")
            self.error = err
            for loop, q in list(self._queues.values()):
                loop.call_soon_threadsafe(q.put_nowait, err)

    def _run_commands(self, block: bool) -> None:
        """Runs the posted commands (waiting up to 0.1 s for one when ``block``)."""
        try:
            item = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, future = item
            try:
                future.set_result(fn())
            except BaseException as err:  # noqa: BLE001  (the caller's to handle)
                future.set_exception(err)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, outs: list[RequestOutput]) -> None:
        """Hands one step's outputs to their handlers' queues: one callback per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outs:
            entry = self._queues.get(out.request_id)
            if entry is None:
                continue
            if out.finished:
                del self._queues[out.request_id]
            by_loop.setdefault(entry[0], []).append((entry[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _call(self, fn: Callable) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.error is not None:
            future.set_exception(RuntimeError(f"the engine stopped: {self.error}"))
        else:
            self._commands.put((fn, future))
        return future

    async def call(self, fn: Callable):
        """``fn()`` run in the engine thread between two steps; its result (or exception)."""
        return await asyncio.wrap_future(self._call(fn))

    # ---- the server's side ------------------------------------------------------------------------
    async def add(self, prompt, sampling_params: SamplingParams, cache_salt: str | None = None
                  ) -> tuple[str, asyncio.Queue]:
        """Queues a request (``LLMEngine.add_request``: its ``ValueError``/``TypeError`` propagate, and a
        refused request leaves the engine untouched). Returns its id and the queue its outputs arrive on."""
        loop, q = asyncio.get_running_loop(), asyncio.Queue()

        def add() -> str:
            request_id = self.engine.add_request(prompt, sampling_params, cache_salt=cache_salt)
            self._queues[request_id] = (loop, q)
            return request_id

        return await self.call(add), q

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
                if isinstance(out, BaseException):
                    raise RuntimeError(f"the engine stopped: {out}") from out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._call(lambda: self._abort(request_id))  # (not awaited: the handler may be cancelled)

    def _abort(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        try:
            self.engine.abort_request(request_id)
        except KeyError:  # finished meanwhile
            return
        if self.on_abort is not None:
            self.on_abort()

    async def abort(self, request_id: str) -> None:
        """Withdraws a request if it is still unfinished (a no-op otherwise)."""
        await self.call(lambda: self._abort(request_id))

    async def snapshot(self) -> tuple[int, int, dict]:
        """``(requests running, requests waiting, LLMEngine.stats())`` now."""
        def read():
            sched = self.engine.scheduler
            return (len({s.parent for s in sched.running}), len({s.parent for s in sched.waiting}),
                    self.engine.stats())

        return await self.call(read)

    def shutdown(self) -> None:
        self._stopped = True
        self._thread.join(timeout=10)
