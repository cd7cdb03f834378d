"""The JSON pieces of the server's answers: OpenAI's ``usage`` and ``logprobs`` objects, and the merge of a
request's several prompt streams into one."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from ..io.outputs import CompletionOutput, RequestOutput

def usage(outs: list[RequestOutput], completion: int | None = None) -> dict:
    """OpenAI's ``usage`` over a request's prompts (final outputs), with the prefix cache's share of the
    prompt tokens; ``completion``: the output tokens when ``outs`` are the last deltas of a stream."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    if completion is None:
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_logprobs(c: CompletionOutput, tokenizer) -> dict | None:
    """OpenAI's legacy completions ``logprobs`` object for one choice's (new) tokens."""
    if c.logprobs is None:
        return None
    text = lambda t: tokenizer.decode([t]) if tokenizer is not None else str(t)  # noqa: E731
    return {"tokens": [text(t) for t in c.token_ids],
            "token_logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
            "top_logprobs": [{text(k): v.logprob for k, v in lp.items()} for lp in c.logprobs],
            "text_offset": []}


def chat_logprobs(c: CompletionOutput, tokenizer, top: int) -> dict | None:
    """OpenAI's chat ``logprobs`` object (``content``: one entry per token, ``top`` alternatives each)."""
    if c.logprobs is None:
        return None
    text = lambda t: tokenizer.decode([t]) if tokenizer is not None else str(t)  # noqa: E731
    content = []
    for t, lp in zip(c.token_ids, c.logprobs):
        best = sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:top]
        content.append({"token": text(t), "logprob": lp[t].logprob, "bytes": list(text(t).encode()),
                        "top_logprobs": [{"token": text(k), "logprob": v.logprob, "bytes": list(text(k).encode())}
                                         for k, v in best]})
    return {"content": content}


async def interleave(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(prompt index, output)`` from every prompt's stream as each output arrives: a request with several
    prompts streams them side by side, not one after another. Closing it stops reading every stream."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    merged: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                merged.put_nowait((i, out))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001  (raised to the reader below)
            merged.put_nowait((i, err))
            return
        merged.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await merged.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
