"""The OpenAI-compatible HTTP app (FastAPI): ``/v1/completions``, ``/v1/chat/completions`` (both with
``stream: true`` as server-sent events), ``/v1/models``, ``/health``, ``/ready`` and ``/metrics``.

``build_app(engine, ...)`` returns the app over an ``AsyncEngine``; ``http_server.serve``
runs it. A request's way in: ``GuardMiddleware`` (key, limits, body), the pydantic models of
``protocol.py`` (every field bounded), the deployment's limits (``ServerLimits``: n, stop strings,
prompt bytes), then tokenization and chat templating in a worker thread, so a long prompt never holds
the event loop and a prompt that cannot fit is refused before it is tokenized. Each prompt becomes one
engine request; a client that goes away, streaming or not, aborts its requests.

Every error has OpenAI's shape (``protocol.error_body``), ``param`` naming the field where there is one,
and its status code: 400 for a bad body or a prompt the engine refuses, 401 for a missing or wrong API
key, 404 for an unknown model or route, 405 for a wrong method, 408 / 413 for a body too slow / too
large, 429 over the concurrency limit, 500 for a request that failed inside the engine (no stack trace;
the request id to find it in the server's log), 503 while shutting down or once the engine stopped.
``/health`` and ``/metrics`` are open (as vLLM's are); the API key guards ``/v1``.

Probes (Kubernetes, KServe): ``/health`` (also ``/v2/health/live``) is liveness: 200 while the engine runs,
503 once it stopped (the process then exits). ``/ready`` (also ``/v2/health/ready``) is readiness: 200 while
the server takes new requests, 503 once it drains for shutdown or the engine stopped, so a Service stops
sending it traffic before it goes. Before the engine has loaded and warmed up nothing listens at all
(``http_server.serve`` builds the app over a ready engine): a startup probe covers that time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..io.outputs import CompletionOutput, RequestOutput
from ..sampling import RequestOutputKind
from .async_engine import AsyncEngine, EngineStopped, RequestAborted
from .formatting import chat_logprobs, completion_logprobs, interleave, usage
from .guard import GuardMiddleware
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, FieldError, SamplingFields, ServerLimits, error_body

log = logging.getLogger(__name__)
MAX_BODY_BYTES = ServerLimits.max_body_bytes
UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's names of a union's branches


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


def engine_error(err: BaseException, request_id: str) -> APIError:
    """The error for a request the engine could not finish (no stack trace: the server's log has it)."""
    if isinstance(err, RequestAborted):
        return APIError(503, f"{err} (request {request_id})", "server_error", code="shutting_down")
    if isinstance(err, EngineStopped):
        return APIError(503, f"the engine stopped (request {request_id})", "server_error", code="engine_dead")
    return APIError(500, f"the request failed inside the engine (request {request_id})", "server_error")


def build_app(engine: AsyncEngine, served_model_name: str | None = None, api_key: str | None = None,
              limits: ServerLimits | None = None) -> FastAPI:
    """The server's app over ``engine`` (``AsyncEngine.in_process`` or ``in_thread``), answering to
    ``served_model_name`` (default: the model's path). ``api_key``: every ``/v1`` route needs
    ``Authorization: Bearer <api_key>``. The app shuts the engine down when it stops."""
    limits = limits or ServerLimits()
    model = engine.model
    model_name = served_model_name or str(model.model_path)
    metrics = ServerMetrics(model_name)
    engine.on_abort = metrics.aborted.inc
    tokenizer = model.tokenizer
    max_prompt_bytes = min(b for b in (limits.max_prompt_bytes, model.max_prompt_bytes, limits.max_body_bytes)
                           if b is not None)
    # Tokenizing and templating run here, off the event loop (the tokenizer releases the interpreter lock).
    workers = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="jaxpaged-tokenize")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.bind(asyncio.get_running_loop())
        yield
        workers.shutdown(wait=False, cancel_futures=True)
        engine.shutdown()

    app = FastAPI(title="jaxpaged", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.limits = engine, metrics, limits
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError):
        return JSONResponse(err.body, status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, err: RequestValidationError):
        # The deepest error is the one that says what is wrong (of a union's branches, the one the value
        # came closest to matching).
        first = max(err.errors(), key=lambda e: len(e.get("loc", ())), default={})
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(f"the body is not valid JSON: {first.get('msg')}"), status_code=400)
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body" and not (
            isinstance(p, str) and ("[" in p or "-" in p or p in UNION_TAGS))) or None
        if first.get("type") == "model_attributes_type":
            where = None  # the body itself is not an object
        return JSONResponse(error_body(f"{where or 'body'}: {first.get('msg', 'invalid value')}", param=where),
                            status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, err: HTTPException):
        type_ = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return JSONResponse(error_body(message.get(err.status_code, str(err.detail)), type_),
                            status_code=err.status_code, headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, err: Exception):
        log.error("jaxpaged: unhandled error: %s: %s", type(err).__name__, err, exc_info=err)
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)

    app.state.guard = None

    def guard_factory(inner):
        app.state.guard = GuardMiddleware(inner, api_key, limits)
        return app.state.guard

    app.add_middleware(guard_factory)

    def check_body(body: SamplingFields) -> None:
        """What the pydantic models cannot say: the model's name and this deployment's limits."""
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", "model", "model_not_found")
        refused = body.unsupported()
        if refused is not None:
            raise APIError(400, refused[1], param=refused[0])
        if body.n > limits.max_n:
            raise APIError(400, f"n: must be <= {limits.max_n} on this server, got {body.n}", param="n")
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > limits.max_stop:
            raise APIError(400, f"stop: at most {limits.max_stop} strings on this server, got {len(stops)}",
                           param="stop")

    def encode(text: str, field: str) -> list[int]:
        """A prompt's token ids (in a worker thread); a text that cannot fit is refused untokenized."""
        size = len(text.encode())
        if size > max_prompt_bytes:
            raise APIError(400, f"{field}: the prompt is {size} bytes, more than {max_prompt_bytes} (no prompt of "
                                f"that size fits max_model_len {model.max_model_len})", param=field)
        if tokenizer is None:
            raise APIError(400, f"{field}: this model has no tokenizer: send token ids", param=field)
        return tokenizer.encode(text)

    async def in_worker(fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(workers, fn, *args)

    def check_length(ids: list[int], field: str) -> list[int]:
        if len(ids) >= model.max_model_len:
            raise APIError(400, f"{field}: the prompt is {len(ids)} tokens; max_model_len is {model.max_model_len} "
                                f"(prompt + max_tokens must fit it)", param=field)
        return ids

    async def start(token_prompts: list[list[int]], sp, cache_salt) -> list[tuple[str, asyncio.Queue]]:
        """One engine request per prompt, all queued before any output is awaited; a refused prompt is
        a 400 (500 for an engine failure) and nothing of the request stays queued."""
        added = []
        try:
            for ids in token_prompts:
                added.append(await engine.add(ids, sp, cache_salt))
        except BaseException as err:
            for request_id, _ in added:
                engine.withdraw(request_id)
            if isinstance(err, (ValueError, TypeError)):
                raise APIError(400, str(err), param="prompt" if "prompt" in str(err) else None) from err
            if isinstance(err, Exception) and not isinstance(err, APIError):
                log.error("jaxpaged: a request could not be queued: %s: %s", type(err).__name__, err)
                raise engine_error(err, "not queued") from err
            raise
        return added

    async def until_disconnected(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    def sse(obj: dict | str) -> str:
        return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"

    def compile_grammar(field: str, params) -> None:
        """Compiles a structured output's grammar (in a worker thread; cached): a 400 naming ``field`` if it
        cannot be compiled, before the request reaches the engine."""
        try:
            model.grammars.submit(params).result()
        except ValueError as err:
            raise APIError(400, f"{field}: {err}", param=field) from None

    async def sampling(body, max_tokens, logprobs):
        try:
            found = body.structured()
        except FieldError as err:
            raise APIError(400, str(err), param=err.field) from None
        if found is not None:
            await in_worker(compile_grammar, *found)
        try:
            return body.sampling_params(model.default_sampling_params, max_tokens, logprobs, body.stream,
                                        found[1] if found else None)
        except (ValueError, TypeError) as err:
            raise APIError(400, str(err)) from err

    async def run(request: Request, body, token_prompts: list[list[int]], max_tokens, logprobs, chunk_choice,
                  final_choice, obj: str, prefix: str):
        """Runs the prompts and answers: one JSON body, or (``stream``) server-sent events of deltas."""
        sp = await sampling(body, max_tokens, logprobs)
        rid, now = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        chunk_obj = f"{obj}.chunk" if obj == "chat.completion" else obj
        added = await start(token_prompts, sp, body.cache_salt)
        merge = sp.output_kind == RequestOutputKind.DELTA
        streams = [engine.outputs(request_id, q, merge) for request_id, q in added]
        n = body.n
        if not body.stream:
            return await answer(request, rid, now, added, streams, final_choice, obj)

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
                        if c.finish_reason == "error":
                            raise RuntimeError("failed inside the engine")
                        yield sse({"id": rid, "object": chunk_obj, "created": now, "model": model_name,
                                   "choices": [chunk_choice(i * n + c.index, c)]})
                    if out.finished:
                        finals[i] = out
                outs = [finals[i] for i in sorted(finals)]
                metrics.observe(outs, [max(v for (j, _), v in per_sample.items() if j == i) for i in sorted(finals)])
                if body.stream_options is not None and body.stream_options.include_usage:
                    yield sse({"id": rid, "object": chunk_obj, "created": now, "model": model_name, "choices": [],
                               "usage": usage(outs, generated)})
            except Exception as err:  # noqa: BLE001  (the stream ends with OpenAI's error event)
                yield sse(engine_error(err, rid).body)
            finally:
                await merged.aclose()
                for (request_id, _), gen in zip(added, streams):
                    await gen.aclose()  # (a client gone mid-stream: its requests are aborted here)
                    engine.withdraw(request_id)  # (a no-op for a finished one)
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    async def answer(request: Request, rid: str, now: int, added, streams, final_choice, obj: str):
        """The non-streaming answer; a client that leaves before it is ready aborts its requests."""
        async def collect() -> list[RequestOutput]:
            outs = []
            for gen in streams:
                last = None
                async for out in gen:
                    last = out
                outs.append(last)
            return outs

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(until_disconnected(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            for request_id, _ in added:
                engine.withdraw(request_id)  # (a no-op for a finished one)
        if work.cancelled():
            return PlainTextResponse("", status_code=499)  # nobody is listening
        err = work.exception()
        if err is not None:
            raise engine_error(err, rid) from err
        outs = work.result()
        if any(c.finish_reason == "error" for o in outs for c in o.outputs):
            raise engine_error(RuntimeError("failed"), rid)
        metrics.observe(outs)
        n = len(outs[0].outputs) if outs else 1
        choices = [final_choice(i * n + c.index, c) for i, o in enumerate(outs) for c in o.outputs]
        return JSONResponse({"id": rid, "object": obj, "created": now, "model": model_name, "choices": choices,
                             "usage": usage(outs)})

    def with_token_ids(body: SamplingFields, c: CompletionOutput, choice: dict) -> dict:
        """``choice`` with the choice's (new) token ids under ``token_ids`` when the body asks
        (``return_token_ids``, vLLM's extra): clients that re-send a conversation as token ids need them."""
        if body.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        return choice

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        check_body(body)
        prompts = body.prompts()
        ids = [check_length(await in_worker(encode, p, "prompt") if isinstance(p, str) else p, "prompt")
               for p in prompts]
        echoed: dict[int, str] = {}  # prompt index -> its text, sent once ahead of the output (echo)

        def echo(index: int, c: CompletionOutput) -> str:
            i = index // body.n
            if not body.echo or index in echoed:
                return c.text
            echoed[index] = p = prompts[i] if isinstance(prompts[i], str) else (
                tokenizer.decode(prompts[i]) if tokenizer is not None else "")
            return p + c.text

        def choice(index: int, c: CompletionOutput) -> dict:
            return with_token_ids(body, c, {"index": index, "text": echo(index, c),
                                            "logprobs": completion_logprobs(c, tokenizer),
                                            "finish_reason": c.finish_reason})

        return await run(request, body, ids, body.max_tokens, body.logprobs, choice, choice, "text_completion", "cmpl")

    def template(conversation: list[dict], kwargs: dict | None) -> list[int]:
        try:
            text = model.chat_prompts(conversation, chat_template_kwargs=kwargs)[0]
        except APIError:
            raise
        except Exception as err:  # noqa: BLE001  (a template that cannot render this conversation)
            raise APIError(400, f"messages: the chat template failed: {type(err).__name__}: {err}"[:2000],
                           param="messages") from err
        return encode(text, "messages")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        check_body(body)
        conversation = body.conversation()
        size = sum(len(m["content"].encode()) for m in conversation)
        if size > max_prompt_bytes:
            raise APIError(400, f"messages: {size} bytes of content, more than {max_prompt_bytes} (no prompt of that "
                                f"size fits max_model_len {model.max_model_len})", param="messages")
        ids = check_length(await in_worker(template, conversation, body.chat_template_kwargs), "messages")
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

        return await run(request, body, [ids], body.max_completion_tokens or body.max_tokens, logprobs, chunk_choice,
                         final_choice, "chat.completion", "chatcmpl")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "jaxpaged", "max_model_len": model.max_model_len}]}

    def stopped() -> JSONResponse:
        return JSONResponse(error_body(f"the engine stopped: {engine.error}", "server_error"), status_code=503)

    @app.get("/health")
    @app.get("/v2/health/live")
    async def health():
        if engine.error is not None:
            return stopped()
        return PlainTextResponse("")

    @app.get("/ready")
    @app.get("/v2/health/ready")
    async def ready():
        if engine.error is not None:
            return stopped()
        if app.state.guard is not None and app.state.guard.draining:
            return JSONResponse(error_body("the server is shutting down", "server_error", code="shutting_down"),
                                status_code=503)
        return PlainTextResponse("")

    @app.get("/metrics")
    async def prometheus_metrics():
        if engine.error is not None:
            return JSONResponse(error_body(f"the engine stopped: {engine.error}", "server_error"), status_code=503)
        text, content_type = metrics.render(await engine.snapshot())
        return PlainTextResponse(text, media_type=content_type)

    return app
