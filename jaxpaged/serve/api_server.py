"""The OpenAI-compatible HTTP server (FastAPI): ``/v1/completions``, ``/v1/chat/completions`` (both with
``stream: true`` as server-sent events), ``/v1/models``, ``/health`` and ``/metrics``.

``build_app(engine, ...)`` returns the app over an ``AsyncEngine`` (warmed up); ``serve(llm_kwargs, ...)``
starts the engine in its own process and runs the app with uvicorn. Every request becomes one engine request per prompt (``AsyncEngine``); a client that goes
away aborts its requests. Errors have OpenAI's shape (``protocol.error_body``) and status codes: 400
for a bad body or a prompt the engine refuses (its message names the field), 401 for a missing or
wrong API key, 404 for an unknown model, 413 for a body over the size limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.datastructures import Headers

from ..io.outputs import CompletionOutput, RequestOutput
from ..sampling import RequestOutputKind
from .async_engine import AsyncEngine
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, error_body

MAX_BODY_BYTES = 32 << 20  # request bodies above this are refused (413)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


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


class GuardMiddleware:
    """The ``/v1`` routes' API key (401) and body size (413, from ``Content-Length``, before the body is
    read) checks, as a plain ASGI middleware. Why not ``@app.middleware("http")``: Starlette's
    ``BaseHTTPMiddleware`` relays every chunk of a streamed response through a second task and a
    memory stream, a cost per chunk on every stream."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    def refusal(self, scope) -> JSONResponse | None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return None
        headers = Headers(scope=scope)
        if self.api_key is not None and headers.get("authorization") != f"Bearer {self.api_key}":
            return JSONResponse(error_body("invalid or missing API key", "authentication_error", code="invalid_api_key"),
                                status_code=401)
        size = headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body_bytes:
            return JSONResponse(error_body(f"the body is {size} bytes, more than the limit of {self.max_body_bytes}"),
                                status_code=413)
        return None

    async def __call__(self, scope, receive, send) -> None:
        response = self.refusal(scope)
        if response is None:
            await self.app(scope, receive, send)
        else:
            await response(scope, receive, send)


def with_token_ids(body: SamplingFields, c: CompletionOutput, choice: dict) -> dict:
    """``choice`` with the choice's (new) token ids under ``token_ids`` when the body asks
    (``return_token_ids``, vLLM's extra): clients that re-send a conversation as token ids need them."""
    if body.return_token_ids:
        choice["token_ids"] = list(c.token_ids)
    return choice


def build_app(engine: AsyncEngine, served_model_name: str | None = None, api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The server's app over ``engine`` (``AsyncEngine.in_process`` or ``in_thread``, warmed up), answering to
    ``served_model_name`` (default: the model's path). ``api_key``: every ``/v1`` route needs
    ``Authorization: Bearer <api_key>``. The app shuts the engine down when it stops."""
    model = engine.model
    model_name = served_model_name or str(model.model_path)
    metrics = ServerMetrics(model_name)
    engine.on_abort = metrics.aborted.inc
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(title="jaxpaged", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError):
        return JSONResponse(err.body, status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(f"the body is not valid JSON: {first.get('msg')}"), status_code=400)
        return JSONResponse(error_body(f"{where}: {first.get('msg', 'invalid value')}", param=where), status_code=400)

    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)

    def check_model(body: SamplingFields) -> None:
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", "model", "model_not_found")

    async def start(prompts: list, sp, cache_salt) -> list[AsyncIterator[RequestOutput]]:
        """One engine request per prompt, all queued before any output is awaited; a refused prompt is
        a 400 and nothing of the request stays queued."""
        added = []
        try:
            for prompt in prompts:
                added.append(await engine.add(prompt, sp, cache_salt))
        except (ValueError, TypeError) as err:
            for request_id, _ in added:
                await engine.abort(request_id)
            raise APIError(400, str(err)) from err
        merge = sp.output_kind == RequestOutputKind.DELTA
        return [engine.outputs(request_id, queue, merge) for request_id, queue in added]

    async def collect(streams) -> list[RequestOutput]:
        outs = []
        for gen in streams:
            last = None
            async for out in gen:
                last = out
            outs.append(last)
        return outs

    def sse(obj: dict | str) -> str:
        return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"

    def sampling(body, max_tokens, logprobs):
        try:
            return body.sampling_params(model.default_sampling_params, max_tokens, logprobs, body.stream)
        except (ValueError, TypeError) as err:
            raise APIError(400, str(err)) from err

    async def run(body, prompts: list, max_tokens, logprobs, chunk_choice, final_choice, obj: str, prefix: str):
        """Runs ``prompts`` and answers: one JSON body, or (``stream``) server-sent events of deltas."""
        check_model(body)
        sp = sampling(body, max_tokens, logprobs)
        rid, now = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        chunk_obj = f"{obj}.chunk" if obj == "chat.completion" else obj
        streams = await start(prompts, sp, body.cache_salt)
        n = body.n
        if not body.stream:
            outs = await collect(streams)
            metrics.observe(outs)
            choices = [final_choice(i * n + c.index, c) for i, o in enumerate(outs) for c in o.outputs]
            return JSONResponse({"id": rid, "object": obj, "created": now, "model": model_name, "choices": choices,
                                 "usage": usage(outs)})

        async def events() -> AsyncIterator[str]:
            finals: dict[int, RequestOutput] = {}
            generated = 0
            per_sample: dict[tuple[int, int], int] = {}
            merged = interleave(streams)
            try:
                async for i, out in merged:
                    generated += sum(len(c.token_ids) for c in out.outputs)
                    for c in out.outputs:
                        per_sample[i, c.index] = per_sample.get((i, c.index), 0) + len(c.token_ids)
                        yield sse({"id": rid, "object": chunk_obj, "created": now, "model": model_name,
                                   "choices": [chunk_choice(i * n + c.index, c)]})
                    if out.finished:
                        finals[i] = out
                outs = [finals[i] for i in sorted(finals)]
                metrics.observe(outs, [max(v for (j, _), v in per_sample.items() if j == i) for i in sorted(finals)])
                if body.stream_options is not None and body.stream_options.include_usage:
                    yield sse({"id": rid, "object": chunk_obj, "created": now, "model": model_name, "choices": [],
                               "usage": usage(outs, generated)})
                yield sse("[DONE]")
            finally:
                await merged.aclose()
                for gen in streams:
                    await gen.aclose()  # (a client gone mid-stream: its requests are aborted here)

        return StreamingResponse(events(), media_type="text/event-stream")

    tokenizer = model.tokenizer

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        p = body.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts:
            raise APIError(400, "prompt: must not be empty", param="prompt")

        def choice(index: int, c: CompletionOutput) -> dict:
            return with_token_ids(body, c, {"index": index, "text": c.text,
                                            "logprobs": completion_logprobs(c, tokenizer),
                                            "finish_reason": c.finish_reason})

        return await run(body, prompts, body.max_tokens, body.logprobs, choice, choice, "text_completion", "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        try:
            prompt = model.chat_prompts(body.conversation(), chat_template_kwargs=body.chat_template_kwargs)[0]
        except (ValueError, TypeError) as err:
            raise APIError(400, f"messages: {err}", param="messages") from err
        top = body.top_logprobs or 0
        logprobs = max(top, 1) if body.logprobs else None
        sent_role: set[int] = set()

        def final_choice(index: int, c: CompletionOutput) -> dict:
            return with_token_ids(body, c, {"index": index, "message": {"role": "assistant", "content": c.text},
                                            "logprobs": chat_logprobs(c, tokenizer, top),
                                            "finish_reason": c.finish_reason})

        def chunk_choice(index: int, c: CompletionOutput) -> dict:
            delta: dict[str, Any] = {"content": c.text}
            if index not in sent_role:
                sent_role.add(index)
                delta["role"] = "assistant"
            return with_token_ids(body, c, {"index": index, "delta": delta,
                                            "logprobs": chat_logprobs(c, tokenizer, top),
                                            "finish_reason": c.finish_reason})

        return await run(body, [prompt], body.max_completion_tokens or body.max_tokens, logprobs, chunk_choice,
                         final_choice, "chat.completion", "chatcmpl")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "jaxpaged", "max_model_len": model.max_model_len}]}

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return JSONResponse(error_body(f"the engine stopped: {engine.error}", "server_error"), status_code=503)
        return PlainTextResponse("")

    @app.get("/metrics")
    async def prometheus_metrics():
        text, content_type = metrics.render(await engine.snapshot())
        return PlainTextResponse(text, media_type=content_type)

    return app


def serve(llm_kwargs: dict, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          api_key: str | None = None) -> None:
    """Starts the engine process (``LLM(**llm_kwargs)``, warmed up), then serves until interrupted: the
    server is ready when it listens."""
    import uvicorn

    engine = AsyncEngine.in_process(llm_kwargs)
    uvicorn.run(build_app(engine, served_model_name, api_key), host=host, port=port, log_level="info")
