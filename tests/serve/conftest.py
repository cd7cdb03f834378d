"""A live server in this process: the app over an engine stepping in a thread (``AsyncEngine.in_thread``),
served by jaxpaged's uvicorn ``Server`` (timeouts, shutdown) in a thread of its own."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

pytest.importorskip("fastapi")


@contextlib.contextmanager
def live_server(llm, limits, api_key: str | None = None):
    """Yields ``(base_url, server)`` for a server over ``llm`` with ``limits``; stops it on exit."""
    import uvicorn

    from jaxpaged.serve.api_server import build_app
    from jaxpaged.serve.async_engine import AsyncEngine
    from jaxpaged.serve.http_server import Server, header_timeout_protocol

    engine = AsyncEngine.in_thread(llm)
    app = build_app(engine, "tiny", api_key, limits)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                            http=header_timeout_protocol(limits.header_timeout),
                            timeout_keep_alive=max(1, round(limits.keep_alive_timeout)),
                            timeout_graceful_shutdown=limits.shutdown_timeout + 2)
    server = Server(config, engine, limits)
    thread = threading.Thread(target=server.run, name="test-server", daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        if not thread.is_alive() or time.time() > deadline:
            raise AssertionError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    server.thread = thread
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()  # (a forced exit skips the app's own shutdown: the engine thread must not outlive it)
