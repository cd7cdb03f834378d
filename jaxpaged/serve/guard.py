"""The checks every ``/v1`` request passes before a route sees it, as one plain ASGI middleware: the API
key (401), the server draining for shutdown (503), the number of requests in progress (429), and the
body: its declared size (413 before a byte is read), its actual size while it is read, chunked or not
(413), and the time it takes to arrive (408).

Why not ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` relays every chunk of a streamed
response through a second task and a memory stream, a cost per chunk on every stream.
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from .protocol import ServerLimits, error_body


class BodyTooLarge(Exception):
    pass


class GuardMiddleware:
    """``limits``: the deployment's (``ServerLimits``); ``api_key``: None for an open server.
    ``in_progress`` counts the ``/v1`` requests between their first byte and their response's last."""

    def __init__(self, app, api_key: str | None, limits: ServerLimits):
        self.app, self.limits = app, limits
        self.api_key = None if api_key is None else f"Bearer {api_key}".encode()
        self.in_progress = 0
        self.draining = False

    def refusal(self, scope) -> JSONResponse | None:
        headers = Headers(scope=scope)
        if self.api_key is not None:
            given = headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, self.api_key):
                return JSONResponse(error_body("invalid or missing API key", "authentication_error",
                                               code="invalid_api_key"), status_code=401)
        if self.draining:
            return JSONResponse(error_body("the server is shutting down", "server_error", code="shutting_down"),
                                status_code=503)
        if self.in_progress >= self.limits.max_concurrent_requests:
            return JSONResponse(error_body(f"too many requests in progress (the limit is "
                                           f"{self.limits.max_concurrent_requests}); retry later", "rate_limit_error",
                                           code="too_many_requests"), status_code=429)
        size = headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > self.limits.max_body_bytes):
            return JSONResponse(error_body(f"the body is {size} bytes, more than the limit of "
                                           f"{self.limits.max_body_bytes}"), status_code=413)
        return None

    async def read_body(self, receive) -> list[dict]:
        """The request's body messages, read whole (at most ``max_body_bytes``: ``BodyTooLarge``)."""
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages  # (a disconnect: handed on as is)
            size += len(message.get("body", b""))
            if size > self.limits.max_body_bytes:
                raise BodyTooLarge
            if not message.get("more_body", False):
                return messages

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        response = self.refusal(scope)
        if response is not None:
            await response(scope, receive, send)
            return
        self.in_progress += 1
        try:
            try:
                messages = await asyncio.wait_for(self.read_body(receive), self.limits.body_timeout)
            except BodyTooLarge:
                await JSONResponse(error_body(f"the body is more than the limit of {self.limits.max_body_bytes} "
                                              f"bytes"), status_code=413)(scope, receive, send)
                return
            except TimeoutError:
                await JSONResponse(error_body(f"the body did not arrive within {self.limits.body_timeout:g} s"),
                                   status_code=408)(scope, receive, send)
                return

            async def replay():  # the body as read, then the connection's own messages (a disconnect)
                return messages.pop(0) if messages else await receive()

            await self.app(scope, replay, send)
        finally:
            self.in_progress -= 1
