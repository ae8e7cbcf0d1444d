"""A limit on HTTP request bodies, in size and in time, as plain ASGI
middleware (Starlette's BaseHTTPMiddleware would cost every request a third
of the frontend's CPU): a declared Content-Length over the limit is answered
413 before the body is read; otherwise the body is read here, counted,
answered 413 as soon as it passes the limit (a chunked body has no declared
length) and 408 when the client takes longer than ``timeout_s`` to send it
(a slow client holds a connection and a buffer, never a request slot for
long); the app then reads a replay."""

from __future__ import annotations

import asyncio
import time

from libs.common.errors import ClientTimeout, TooLarge
from services.frontend.edge import send_error


class BodyLimit:
    def __init__(self, app, max_bytes: int, timeout_s: float = 30.0):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        try:
            too_big = declared is not None and int(declared) > self.max_bytes
        except ValueError:
            too_big = False  # a bad header: the HTTP parser's problem, not ours
        if too_big:
            return await self._too_large(send)
        # NOTE: an error raised from inside receive() would be taken by the
        # app's body parsing for a malformed body (a 400): answered here.
        messages, seen = [], 0
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    message = await receive()
            except TimeoutError:
                return await send_error(send, ClientTimeout(
                    f"the request body did not arrive within {self.timeout_s:g}s"), close=True)
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                return await self._too_large(send)
            if not message.get("more_body", False):
                break
        replay = iter(messages)

        async def replayed_receive():
            return next(replay, None) or await receive()

        await self.app(scope, replayed_receive, send)

    async def _too_large(self, send) -> None:
        await send_error(send, TooLarge(f"the request body is larger than {self.max_bytes} bytes"), close=True)
