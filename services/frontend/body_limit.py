"""A limit on HTTP request bodies, as plain ASGI middleware (Starlette's
BaseHTTPMiddleware would cost every request a third of the frontend's CPU):
a declared Content-Length over the limit is answered 413 before the body is
read (and the HTTP server holds a body to its declared length); a body sent
without one (chunked) is read here, counted, and answered 413 as soon as it
passes the limit."""

from __future__ import annotations

import json

from libs.common.errors import TooLarge, openai_error


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        try:
            too_big = declared is not None and int(declared) > self.max_bytes
        except ValueError:
            too_big = False  # a bad header: the HTTP parser's problem, not ours
        if too_big:
            return await self._refuse(send)
        if declared is not None or scope.get("method") in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        # No declared length (chunked): read it all here, counting, and hand
        # the app a replay. NOTE: an error raised from inside receive() would
        # be taken by the app's body parsing for a malformed body (a 400).
        messages, seen = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break
        replay = iter(messages)

        async def replayed_receive():
            return next(replay, None) or await receive()

        await self.app(scope, replayed_receive, send)

    async def _refuse(self, send) -> None:
        status, body = openai_error(TooLarge(f"the request body is larger than {self.max_bytes} bytes"))
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})
