"""The server's end (a live server in this process): a signal drains running requests for a bounded time,
then ends what is left with an error event; a second signal exits at once; an engine that stops makes
``/health`` fail and the server exit, its open streams ending with an error event."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from jaxpaged import LLM
from jaxpaged.engine.llm_engine import EngineDeadError
from jaxpaged.models.tiny import tiny_checkpoint_path
from jaxpaged.serve.limits import ServerLimits

from conftest import live_server  # noqa: E402  (tests/serve/conftest.py)

pytestmark = pytest.mark.slow  # (end-to-end: a server per test)
LIMITS = ServerLimits(shutdown_timeout=1.0, header_timeout=2.0, keep_alive_timeout=2.0)
LONG = {"prompt": "Tell", "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_checkpoint_path("qwen3"), dtype="float32", max_model_len=256, num_blocks=512, block_size=8,
               max_num_seqs=64, max_num_batched_tokens=256, warmup=False)


async def open_streams(base: str, n: int, started: asyncio.Event, client: httpx.AsyncClient) -> list[list[str]]:
    """``n`` streams of long requests; ``started`` is set once every one has its first event."""
    firsts = 0

    async def one():
        nonlocal firsts
        events = []
        async with client.stream("POST", f"{base}/v1/completions", json=LONG) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 1:
                        firsts += 1
                        if firsts == n:
                            started.set()
        return events

    return await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)


def test_a_signal_drains_then_aborts_the_rest(llm):
    with live_server(llm, LIMITS) as (base, server):
        async def main():
            started = asyncio.Event()
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as client:
                streams = asyncio.create_task(open_streams(base, 64, started, client))
                await asyncio.wait_for(started.wait(), 60)
                t0 = time.perf_counter()
                server.handle_exit(signal.SIGTERM, None)
                await asyncio.sleep(0.3)
                try:  # the listener is closed: a new connection fails; a kept-alive one would get a 503
                    refused = (await client.post(f"{base}/v1/completions", json={"prompt": "late"})).status_code
                except httpx.ConnectError:
                    refused = "not connected"
                events = await streams
                await asyncio.get_running_loop().run_in_executor(None, server.thread.join, 30)
                return refused, events, time.perf_counter() - t0

        refused, events, seconds = asyncio.run(main())
    print(f"shutdown with 64 streams open: {seconds:.2f} s (drain limit {LIMITS.shutdown_timeout:g} s)")
    assert not server.thread.is_alive() and seconds < LIMITS.shutdown_timeout + 5
    assert refused in (503, "not connected")
    for ev in events:
        assert not isinstance(ev, BaseException), ev
        assert ev[-1] == "data: [DONE]" and "shut down" in ev[-2], ev[-3:]
    assert llm.engine.kv.num_used_blocks == 0  # (the aborted requests' blocks are back)


def test_a_second_signal_exits_at_once(llm):
    with live_server(llm, LIMITS.__class__(shutdown_timeout=30.0)) as (base, server):
        async def main():
            started = asyncio.Event()
            async with httpx.AsyncClient(timeout=60) as client:
                streams = asyncio.create_task(open_streams(base, 4, started, client))
                await asyncio.wait_for(started.wait(), 60)
                t0 = time.perf_counter()
                server.handle_exit(signal.SIGTERM, None)
                server.handle_exit(signal.SIGTERM, None)
                await asyncio.get_running_loop().run_in_executor(None, server.thread.join, 30)
                streams.cancel()
                return time.perf_counter() - t0

        seconds = asyncio.run(main())
    assert not server.thread.is_alive() and seconds < 10  # not the 30 s drain


def test_an_engine_that_stops_takes_the_server_down(llm, monkeypatch):
    with live_server(llm, LIMITS) as (base, server):
        async def main():
            started = asyncio.Event()
            async with httpx.AsyncClient(timeout=60) as client:
                streams = asyncio.create_task(open_streams(base, 2, started, client))
                await asyncio.wait_for(started.wait(), 60)

                def dead():
                    raise EngineDeadError("injected: the KV pool is gone")

                monkeypatch.setattr(llm.engine, "step", dead)
                events = await streams
                await asyncio.get_running_loop().run_in_executor(None, server.thread.join, 30)
                return events

        events = asyncio.run(main())
    assert server.engine_failed and not server.thread.is_alive()
    for ev in events:
        assert not isinstance(ev, BaseException), ev
        assert ev[-1] == "data: [DONE]" and '"engine_dead"' in ev[-2], ev[-3:]
