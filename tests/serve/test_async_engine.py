"""``AsyncEngine.in_thread``: the engine stepping in a thread of this process, driven from asyncio (the
server runs the same protocol with the engine in its own process: ``test_api_server.py``)."""

from __future__ import annotations

import asyncio

import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.models.tiny import tiny_checkpoint_path
from jaxpaged.sampling import RequestOutputKind
from jaxpaged.serve.async_engine import AsyncEngine


def test_streams_equal_generate_and_a_leaver_is_aborted():
    llm = LLM(tiny_checkpoint_path("qwen3"), dtype="float32", max_model_len=128, num_blocks=32, block_size=16,
              max_num_seqs=4, max_num_batched_tokens=64, warmup=False)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = llm.generate([[1, 2, 3, 4, 5]], sp, use_tqdm=False)[0].outputs[0].token_ids
    aborted = []
    engine = AsyncEngine.in_thread(llm, on_abort=lambda: aborted.append(1))
    stream = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def whole():
        return [t async for out in engine.generate([1, 2, 3, 4, 5], stream) for t in out.outputs[0].token_ids]

    async def leaver():
        async for out in engine.generate([9, 8, 7, 6], stream):
            return out.outputs[0].token_ids  # leaves after its first delta

    async def main():
        got, first = await asyncio.gather(whole(), leaver())
        with pytest.raises(ValueError, match="prompt"):
            await engine.add("", sp)  # refused by the engine: nothing queued
        for _ in range(100):  # the abort is posted, not awaited, by the leaver
            if aborted:
                break
            await asyncio.sleep(0.01)
        return got, first, await engine.snapshot()

    try:
        got, first, (running, waiting, stats) = asyncio.run(main())
    finally:
        engine.shutdown()
    assert got == want and len(first) >= 1
    assert aborted == [1] and running == waiting == 0 and stats["blocks_used"] == 0


def test_the_engine_process_answers_then_stops_when_asked():
    """``AsyncEngine.in_process`` (what the server runs): a command round trip over the pipe, then
    ``shutdown`` stops the child by a message: it returns by itself (exit code 0) rather than being
    terminated (the pipe's closing alone did not reach it while the reader thread sat in ``recv``)."""
    engine = AsyncEngine.in_process(dict(model=tiny_checkpoint_path("qwen3"), dtype="float32", max_model_len=64,
                                         num_blocks=8, block_size=16, max_num_seqs=2, max_num_batched_tokens=32,
                                         warmup=False))
    proc = engine._transport._proc
    try:
        running, waiting, stats = asyncio.run(engine.snapshot())
    finally:
        engine.shutdown()
    assert (running, waiting, stats["num_blocks"]) == (0, 0, 8)
    assert not proc.is_alive() and proc.exitcode == 0
