"""``serve``: the engine in its own process, the app (``api_server``) under uvicorn, and what a server needs
around them: timeouts on slow clients, a bounded shutdown, and an exit status an orchestrator can act on.

* Header timeout: a connection must send a request's headers within ``header_timeout`` seconds of its
  first byte (or of the previous response); uvicorn's keep-alive timer is reset by every byte, so a
  client sending one byte a second would otherwise hold its connection forever. The body's own
  deadline is ``GuardMiddleware``'s.
* Shutdown: the first SIGTERM / SIGINT stops accepting connections and new requests (503), lets running
  requests finish for up to ``shutdown_timeout`` seconds, then ends what is left with an error (a
  stream's last event says so); a second signal exits at once.
* If the engine stops (its process died), ``/health`` answers 503 and the server exits with status 1.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .api_server import build_app
from .async_engine import AsyncEngine
from .protocol import ServerLimits

log = logging.getLogger(__name__)


def header_timeout_protocol(seconds: float) -> type:
    """uvicorn's httptools protocol with a deadline on each request's headers."""

    class Protocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(seconds, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return Protocol


class Server(uvicorn.Server):
    """uvicorn's server with jaxpaged's shutdown: drain, then abort; a second signal forces the exit."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, limits: ServerLimits):
        super().__init__(config)
        self.engine, self.limits, self.app = engine, limits, config.app
        self.engine_failed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine.on_error = self._engine_stopped
        await super().serve(sockets)

    def _engine_stopped(self, err: BaseException) -> None:
        log.error("jaxpaged: the engine stopped (%s); the server exits", err)
        self.engine_failed = True
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:  # a second signal: now
            self.force_exit = True
            return
        super().handle_exit(sig, frame)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        guard = self.app.state.guard
        if guard is not None:
            guard.draining = True
        self._loop.call_later(self.limits.shutdown_timeout, self._abort_rest)

    def _abort_rest(self) -> None:
        n = self.engine.abort_all(f"the server shut down before the request finished "
                                  f"(after {self.limits.shutdown_timeout:g} s of draining)")
        if n:
            log.warning("jaxpaged: %d requests aborted at shutdown", n)


def serve(llm_kwargs: dict, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          api_key: str | None = None, limits: ServerLimits | None = None) -> None:
    """Starts the engine process (``LLM(**llm_kwargs)``, warmed up on a GPU), then serves until a signal stops it:
    the server is ready when it listens. Raises ``SystemExit(1)`` if the engine stopped."""
    limits = limits or ServerLimits()
    engine = AsyncEngine.in_process(llm_kwargs)
    app = build_app(engine, served_model_name, api_key, limits)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", http=header_timeout_protocol(limits.header_timeout),
                     timeout_keep_alive=max(1, round(limits.keep_alive_timeout)),
                     timeout_graceful_shutdown=limits.shutdown_timeout + 2)
    server = Server(config, engine, limits)
    compiled = "steps compiled at start-up" if engine.model.warmed_up else "steps compile on first use"
    print(f"jaxpaged: engine ready ({compiled}); serving {served_model_name or engine.model.model_path} on "
          f"http://{host}:{port}", flush=True)
    server.run()  # (a signal that stopped it is raised again once it has shut down, as uvicorn does)
    if server.engine_failed or engine.error is not None:
        raise SystemExit(1)
