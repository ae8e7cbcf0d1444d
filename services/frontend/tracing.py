"""The frontend's spans (with tracing on, libs/common/tracing.py): one server
span per API request at the HTTP edge (plain ASGI, outermost), under the
client's ``traceparent`` where it sent one, lasting until the response's last
byte (an SSE stream's end); inside it, the router's dispatches (spans of the
past, made once the response is out) and one client span per instance call
(generate, attach after a move, resume elsewhere: services/frontend/peers.py),
so that a request's timeline is the sequence of its dispatches and instance
calls. NOTE: on the way to a request's first token only the request's span
and its first instance call's are made (``ferry bench overhead --tracing``)."""

from __future__ import annotations

import time

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

        # NOTE: the request's other frontend spans are spans of the past, made once the response is out.
        with tracing.serving(f"{scope['method']} {scope['path']}", {"http.method": scope["method"],
                             "http.route": scope["path"]}, context=tracing.extract(headers)) as s:
            try:
                await self.app(scope, receive, send_status)
            finally:
                if s is not None:
                    s.set_attribute("http.status_code", status)
                    if status >= 500:
                        tracing.fail(s, f"HTTP {status}")


class CallTrace:
    """The client span of one instance call, ended once (at the stream's end,
    its failure, or the caller's cancel), its attributes set then."""

    __slots__ = ("span", "attrs", "tokens", "first_ns")

    def __init__(self, span, attrs: dict):
        self.span, self.attrs, self.tokens, self.first_ns = span, attrs, 0, 0

    def saw(self, ev) -> None:
        if ev.token_ids:
            if not self.tokens:
                self.first_ns = time.time_ns()
            self.tokens += len(ev.token_ids)
        if ev.moved is not None:
            self.attrs["ferry.moved_to"] = ev.moved.instance_id
        if ev.finish_reason:
            self.attrs["ferry.finish_reason"] = ev.finish_reason

    def end(self, error: str = "") -> None:
        if self.span is None:
            return
        self.attrs["ferry.tokens"] = self.tokens
        if self.first_ns:
            self.attrs["ferry.first_token_ms"] = (self.first_ns - self.span.start_time) / 1e6
        self.span.set_attributes(self.attrs)
        tracing.end(self.span, error=error)
        self.span = None


def call_span(kind: str, address: str, request_id: str, resumed_tokens: int = 0) -> CallTrace | None:
    """The client span of one instance call (None when off): ``generate``,
    ``resume`` (a generate with the tokens delivered so far) or ``attach``;
    its attributes are set when it ends, not on the way to the first token."""
    if not tracing.enabled():
        return None
    name = "resume" if kind == "generate" and resumed_tokens else kind
    span = tracing.start(f"ferry.{name}", kind="client")
    if not span.is_recording():  # not sampled: the request's own context goes on the call
        return None
    return CallTrace(span, {"ferry.request_id": request_id, "ferry.instance_address": address,
                            "ferry.resumed_tokens": resumed_tokens})
