"""The frontend's spans (with tracing on, libs/common/tracing.py): one server
span per API request at the HTTP edge (plain ASGI, outermost), under the
client's ``traceparent`` where it sent one, lasting until the response's last
byte (an SSE stream's end); inside it, the router's dispatch and one client
span per instance call (generate, attach after a move, resume elsewhere:
services/frontend/peers.py), so that a request's timeline is the sequence of
its instance calls."""

from __future__ import annotations

from libs.common import tracing


class TraceRequests:
    """ASGI middleware: a server span around each /v1/ request."""

    def __init__(self, app, prefix: str = "/v1/"):
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())
                   if k in (b"traceparent", b"tracestate")}
        status = 0

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        with tracing.span(f"{scope['method']} {scope['path']}", {"http.method": scope["method"],
                          "http.route": scope["path"]}, context=tracing.extract(headers), kind="server") as s:
            try:
                await self.app(scope, receive, send_status)
            finally:
                if s is not None:
                    s.set_attribute("http.status_code", status)
                    if status >= 500:
                        tracing.fail(s, f"HTTP {status}")


def call_span(kind: str, address: str, request_id: str, resumed_tokens: int = 0):
    """The client span of one instance call (None when off): ``generate``,
    ``resume`` (a generate with the tokens delivered so far) or ``attach``."""
    if not tracing.enabled():
        return None
    name = "resume" if kind == "generate" and resumed_tokens else kind
    return tracing.start(f"ferry.{name}", {"ferry.request_id": request_id, "ferry.instance_address": address,
                                           "ferry.resumed_tokens": resumed_tokens}, kind="client")
