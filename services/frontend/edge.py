"""The HTTP edge's checks that must come before a request's body is read,
as plain ASGI middleware (Starlette's BaseHTTPMiddleware costs every request
a third of the frontend's CPU): the API key of every /v1/ route (401), and
admission of the generating routes (429 over the in-flight bound, 503 while
the frontend drains), each answered in OpenAI error JSON. A client without a
key, or over the bound, is refused before it can make the frontend read and
parse up to --max-body-bytes."""

from __future__ import annotations

import json

from libs.common.errors import FerryError, openai_error, openai_headers
from services.frontend import metrics
from services.frontend.admission import Admission
from services.frontend.auth import Keys

GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
PRIVILEGED = "ferry_may_prioritize"  # scope["state"] key: this request may ask for high priority


async def send_error(send, err: FerryError, close: bool = False) -> None:
    """An OpenAI error response, whole (for middleware that answers itself)."""
    status, body = openai_error(err)
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in openai_headers(err).items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class Edge:
    def __init__(self, app, keys: Keys, admission: Admission):
        self.app = app
        self.keys = keys
        self.admission = admission

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        try:
            authorization = next((v.decode("latin-1") for k, v in scope.get("headers") or ()
                                  if k == b"authorization"), None)
            scope.setdefault("state", {})[PRIVILEGED] = self.keys.check(authorization)
            generating = scope["path"] in GENERATE_PATHS and scope.get("method") == "POST"
            if generating:
                self.admission.enter()
        except FerryError as e:
            metrics.REQUESTS.labels(scope["path"] if scope["path"] in GENERATE_PATHS else "other",
                                    str(openai_error(e)[0])).inc()
            return await send_error(send, e)
        if not generating:
            return await self.app(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.leave()
