"""Data-parallel replicas on Ray Serve (``pip install 'jaxpaged[ray]'``): one jaxpaged engine per replica, the
OpenAI routes through Ray Serve's HTTP proxy, requests routed by prefix (``prefix_router.PrefixCacheRouter``).

Two deployments:

* ``JaxpagedReplica`` (``num_replicas``; each ``num_gpus`` = its ``tensor_parallel_size`` on a GPU cluster): an
  ``LLM`` stepping in a thread and the server's own FastAPI app over it (``api_server.build_app``: the same
  routes, limits, validation, errors and streaming as ``jaxpaged serve``). ``forward`` runs one HTTP request
  through that app and streams its response back: first ``(status, headers)``, then the body's chunks. Ray's
  health check calls ``check_health``, which fails once the engine stopped: Ray then replaces the replica.
* ``OpenAIIngress`` (the HTTP entry): reads the body (at most ``max_body_bytes``), takes the text to route by
  (``routing_text``), and forwards the request through a handle whose router is ``PrefixCacheRouter``. A replica
  that dies before answering is a 503 in OpenAI's error shape; one that dies mid-stream ends the stream with an
  error event and ``[DONE]``, as the server's own shutdown does.

``run(...)`` is what ``jaxpaged serve --data-parallel-size N`` calls: it starts (or joins, with ``RAY_ADDRESS``) a
Ray cluster, deploys both and serves until a signal stops it. ``build(...)`` returns the application for
``serve.run`` (tests, or a user's own Ray code).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import threading
from typing import Any, AsyncIterator

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from .limits import ServerLimits
from .protocol import error_body

log = logging.getLogger(__name__)
MAX_ROUTING_CHARS = 65_536  # the prefix the router looks at (a longer prompt is routed by its start)


@dataclasses.dataclass
class ForwardedRequest:
    """One HTTP request on its way to a replica; ``routing_text`` is what the router matches prefixes on."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    routing_text: str = ""


def routing_text(path: str, body: bytes) -> str:
    """The prompt's text or token ids (``/v1/completions``: the prompt, or the first of several) or the chat
    messages' roles and contents in order (``/v1/chat/completions``), at most ``MAX_ROUTING_CHARS``; ``""`` for
    anything else (routed by load alone)."""
    if not body or not path.startswith("/v1/"):
        return ""
    try:
        data = json.loads(body)  # (the ingress has bounded the body)
    except ValueError:
        return ""
    if not isinstance(data, dict):
        return ""
    if path.endswith("/chat/completions"):
        parts = []
        for m in data.get("messages") or []:
            if isinstance(m, dict):
                content = m.get("content")
                if isinstance(content, list):  # OpenAI's content parts
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                parts.append(f"{m.get('role', '')}:{content if isinstance(content, str) else ''}\n")
        return "".join(parts)[:MAX_ROUTING_CHARS]
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):  # several prompts
        prompt = prompt[0]
    if isinstance(prompt, list):  # token ids
        prompt = " ".join(str(t) for t in prompt[:MAX_ROUTING_CHARS // 8])
    return prompt[:MAX_ROUTING_CHARS] if isinstance(prompt, str) else ""


class JaxpagedReplica:
    """One engine and the server's app over it (module doc)."""

    def __init__(self, llm_kwargs: dict, served_model_name: str | None = None, limits: ServerLimits | None = None):
        from ..llm import LLM
        from .api_server import build_app
        from .async_engine import AsyncEngine

        context = serve.get_replica_context()
        rank = getattr(context, "rank", None)
        rank = getattr(rank, "rank", rank)
        self.replica_id = context.replica_id.unique_id
        if isinstance(rank, int) and "data_parallel_rank" not in llm_kwargs:  # (KV events' ports, per replica)
            llm_kwargs = dict(llm_kwargs, data_parallel_rank=rank)
        self.llm = LLM(**llm_kwargs)
        self.engine = AsyncEngine.in_thread(self.llm)
        self.app = build_app(self.engine, served_model_name, None, limits)
        self._bound = False

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[Any]:
        """Runs ``request`` through the app: yields ``(status, headers)``, then the body's chunks. Leaving early (the
        client went away) disconnects the app's request, which aborts its engine requests."""
        if not self._bound:
            self.engine.bind(asyncio.get_running_loop())
            self._bound = True
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
                 "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "root_path": "",
                 "query_string": request.query_string, "headers": request.headers, "client": ("ray-serve", 0),
                 "server": ("jaxpaged", 0)}
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body = [request.body]

        async def receive() -> dict:
            if body:
                return {"type": "http.request", "body": body.pop(), "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await messages.put(message)

        task = asyncio.create_task(self.app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = [(k.decode(), v.decode()) for k, v in message.get("headers", [])]
                    yield message["status"], headers + [("x-jaxpaged-replica", self.replica_id)]
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        break
        finally:
            gone.set()
            if not task.done():
                await asyncio.wait([task], timeout=10)

    def check_health(self) -> None:
        """Ray's health check: fails once the engine stopped, so Ray replaces this replica."""
        if self.engine.error is not None:
            raise RuntimeError(f"the engine stopped: {self.engine.error}")

    def stats(self) -> dict:
        """This replica's id and ``LLMEngine.stats()`` (for tests and operators)."""
        return {"replica_id": self.replica_id, **self.llm.engine.stats()}


class OpenAIIngress:
    """The HTTP entry: forwards every request to a replica chosen by the router (module doc)."""

    def __init__(self, replicas: DeploymentHandle, max_body_bytes: int = ServerLimits.max_body_bytes):
        self.replicas = replicas.options(stream=True)
        self.max_body_bytes = max_body_bytes

    async def __call__(self, request: Request):
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                return JSONResponse(error_body(f"the body is larger than {self.max_body_bytes} bytes"), status_code=413)
        path, root = request.url.path, request.scope.get("root_path", "")
        if root and path.startswith(root):  # (an application under a route prefix: the app's own routes)
            path = path[len(root):] or "/"
        forwarded = ForwardedRequest(request.method, path, request.url.query.encode(), list(request.headers.raw),
                                     bytes(body), routing_text(path, bytes(body)))
        stream = self.replicas.forward.remote(forwarded)
        try:
            status, headers = await stream.__anext__()
        except Exception as err:  # noqa: BLE001  (the replica died or could not be reached: the client's 503)
            log.warning("jaxpaged: a replica failed before answering %s: %s", path, err)
            return JSONResponse(error_body(f"the replica serving the request failed ({type(err).__name__}); retry",
                                           "server_error", code="replica_failed"), status_code=503)
        sse = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in headers)

        async def rest() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    yield chunk
            except Exception as err:  # noqa: BLE001  (mid-stream: the stream's last event says so)
                log.warning("jaxpaged: a replica failed while streaming %s: %s", path, err)
                if sse:
                    message = error_body(f"the replica serving the request failed ({type(err).__name__})",
                                         "server_error", code="replica_failed")
                    yield f"data: {json.dumps(message)}\n\ndata: [DONE]\n\n".encode()

        response = StreamingResponse(rest(), status_code=status)
        response.raw_headers = [(k.lower().encode(), v.encode()) for k, v in headers]
        return response


def build(llm_kwargs: dict, num_replicas: int, *, served_model_name: str | None = None,
          limits: ServerLimits | None = None, num_gpus: float | None = None, num_cpus: float = 1,
          request_router_class: Any = None, request_router_kwargs: dict | None = None,
          health_check_period_s: float = 10.0):
    """The Ray Serve application: ``OpenAIIngress`` over ``num_replicas`` ``JaxpagedReplica``s of
    ``LLM(**llm_kwargs)``. ``num_gpus`` per replica: default its ``tensor_parallel_size`` where the cluster has GPUs,
    else 0. ``request_router_class``: default ``PrefixCacheRouter`` (its settings: ``request_router_kwargs``)."""
    import ray

    from .prefix_router import PrefixCacheRouter

    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"data_parallel_size must be a positive integer, got {num_replicas!r}")
    limits = limits or ServerLimits()
    if num_gpus is None:
        num_gpus = llm_kwargs.get("tensor_parallel_size", 1) if ray.cluster_resources().get("GPU", 0) else 0
    router = RequestRouterConfig(request_router_class=request_router_class or PrefixCacheRouter,
                                 request_router_kwargs=request_router_kwargs or {})
    replica = serve.deployment(
        JaxpagedReplica, name="JaxpagedReplica", num_replicas=num_replicas,
        max_ongoing_requests=max(limits.max_concurrent_requests, 1),
        ray_actor_options={"num_gpus": num_gpus, "num_cpus": num_cpus}, request_router_config=router,
        health_check_period_s=health_check_period_s, health_check_timeout_s=max(30.0, health_check_period_s))
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress", max_ongoing_requests=100_000,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(replica.bind(llm_kwargs, served_model_name, limits), limits.max_body_bytes)


def run(llm_kwargs: dict, num_replicas: int, host: str = "127.0.0.1", port: int = 8000,
        served_model_name: str | None = None, limits: ServerLimits | None = None) -> None:
    """``jaxpaged serve --data-parallel-size N``: a Ray cluster (``RAY_ADDRESS``'s, else a local one), ``build``'s
    application behind Ray Serve's HTTP proxy on ``host:port``, until SIGTERM / SIGINT."""
    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build(llm_kwargs, num_replicas, served_model_name=served_model_name, limits=limits),
              name="jaxpaged", route_prefix="/")
    print(f"jaxpaged: {num_replicas} replicas ready; serving {served_model_name or llm_kwargs.get('model')} on "
          f"http://{host}:{port} through Ray Serve", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
