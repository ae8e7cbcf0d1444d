"""Distributed tracing with OpenTelemetry: one trace per request across every
process and migration. Off unless a service is given an OTLP endpoint
(``--otlp-endpoint``, ``FERRY_OTLP_ENDPOINT``); then its spans go to that
OTLP/gRPC collector in batches, new traces sampled at ``--trace-sample-ratio``
and every other span following its parent's decision (ParentBased).

W3C trace context (``traceparent``, ``tracestate``) rides on every call:
as gRPC metadata on the channels of libs/common/rpc.py (the server skeleton,
libs/common/server.py, opens each call's server span under it), in the
message where one stream carries many requests (DispatchStream), and into
vLLM's engine (``trace_headers``). A client's ``traceparent`` at the HTTP
edge is honoured.

NOTE: off means off. Nothing here imports the SDK then; ``span()`` returns
one shared null context and the rest return None or nothing, so a call site
costs a function call and a flag test (``ferry bench overhead --tracing``
measures it). Call sites that compute attributes check ``enabled()`` first.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterable, Mapping
from typing import Any

_NULL = contextlib.nullcontext()
# Spans of the past and attributes made while a request is served, kept to be
# recorded once its response is out (``deferred``): off its critical path.
_later: contextvars.ContextVar[list | None] = contextvars.ContextVar("ferry_trace_later", default=None)
_CLOSED = object()  # ends a request's list: a task it started that outlives it records at once
_enabled = False
_tracer = None
_provider = None
_propagator = None
_endpoint = ""  # the OTLP endpoint the spans go to ("" when off or to an in-process exporter)
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"


def enabled() -> bool:
    return _enabled


def configure(service: str, endpoint: str = "", ratio: float = 1.0, instance: str = "",
              exporter=None) -> bool:
    """Turn tracing on for this process: spans of ``service`` (``ferry-frontend``
    ...) to the OTLP/gRPC ``endpoint`` (``http://host:4317``; plain text
    unless ``https://``), or to ``exporter`` (an SDK SpanExporter, synchronously:
    tests). Neither: off. Returns whether it is on."""
    global _enabled, _tracer, _provider, _propagator, _endpoint
    if not endpoint and exporter is None:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    attrs = {"service.name": service}
    if instance:
        attrs["service.instance.id"] = instance
    provider = TracerProvider(resource=Resource.create(attrs), sampler=ParentBased(TraceIdRatioBased(ratio)),
                              id_generator=_own_ids())
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        # The batch processor's delay and sizes: OTEL_BSP_* as the SDK reads them.
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
            endpoint=endpoint, insecure=not endpoint.startswith("https://"))))
    if _provider is not None:
        _provider.shutdown()
    _provider, _propagator = provider, TraceContextTextMapPropagator()
    # NOTE: not the global provider: vLLM, in an instance's process, sets its own.
    _tracer = provider.get_tracer("ferry")
    _enabled, _endpoint = True, endpoint if exporter is None else ""
    return True


def _own_ids():
    """The SDK's random ids, drawn from a generator of this process's own,
    seeded from the OS (and again in a forked child). The SDK's default draws
    from the ``random`` module, which engines seed: vLLM seeds it with 0 in
    every instance, and two instances then made the same span ids in the same
    order, so a span of one had the id of a span of the other (a trace's tree
    could not be told apart)."""
    import os
    import random

    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
    from opentelemetry.trace import INVALID_SPAN_ID, INVALID_TRACE_ID

    class OwnIds(RandomIdGenerator):
        def __init__(self):
            self._random = random.Random(os.urandom(16))
            os.register_at_fork(after_in_child=lambda: self._random.seed(os.urandom(16)))

        def generate_span_id(self) -> int:
            span_id = self._random.getrandbits(64)
            while span_id == INVALID_SPAN_ID:
                span_id = self._random.getrandbits(64)
            return span_id

        def generate_trace_id(self) -> int:
            trace_id = self._random.getrandbits(128)
            while trace_id == INVALID_TRACE_ID:
                trace_id = self._random.getrandbits(128)
            return trace_id

    return OwnIds()


def endpoint() -> str:
    """The OTLP endpoint this process's spans go to ("" when off, or when
    they go to an in-process exporter): vLLM's own tracer, in an instance's
    process, exports there too."""
    return _endpoint


def reset() -> None:
    """Off again (tests), after exporting what is pending."""
    global _enabled, _tracer, _provider, _endpoint
    if _provider is not None:
        _provider.shutdown()
    _enabled, _tracer, _provider, _endpoint = False, None, None, ""


def flush(timeout_ms: int = 5000) -> None:
    if _provider is not None:
        _provider.force_flush(timeout_ms)


# --- spans -----------------------------------------------------------------------------
def span(name: str, attributes: Mapping[str, Any] | None = None, context=None, kind: str = "internal",
         start_time: int | None = None):
    """A context manager: a span current inside it (None when off). ``context``:
    its parent (default: the current span); ``kind``: internal, server, client."""
    if not _enabled:
        return _NULL
    return _tracer.start_as_current_span(name, context=context, kind=_kind(kind), attributes=attributes,
                                         start_time=start_time, record_exception=True, set_status_on_exception=True)


def start(name: str, attributes: Mapping[str, Any] | None = None, context=None, kind: str = "internal",
          start_time: int | None = None):
    """A span started but not made current (end it with ``end``); None when off."""
    if not _enabled:
        return None
    return _tracer.start_span(name, context=context, kind=_kind(kind), attributes=attributes, start_time=start_time)


def end(s, end_time: int | None = None, error: str = "") -> None:
    """End ``s`` (None or already ended: nothing), failed with ``error`` if given."""
    if s is None or not s.is_recording():
        return
    if error:
        fail(s, error)
    s.end(end_time=end_time)


def fail(s, error: str) -> None:
    """Mark ``s`` failed (None: nothing)."""
    if s is not None and s.is_recording():
        from opentelemetry.trace import Status, StatusCode

        s.set_status(Status(StatusCode.ERROR, error))


class _Current:
    """A context current inside a ``with`` (OpenTelemetry's ``use_span`` is a
    generator-based context manager: a few times slower)."""

    __slots__ = ("ctx", "token")

    def __init__(self, ctx):
        self.ctx = ctx

    def __enter__(self):
        from opentelemetry import context

        self.token = context.attach(self.ctx)
        return self

    def __exit__(self, *exc) -> None:
        from opentelemetry import context

        context.detach(self.token)


def use(s):
    """Make ``s`` current inside a ``with`` (None: nothing)."""
    if s is None:
        return _NULL
    return _Current(context_of(s))


async def stepper(steps, ctx, first_only: bool = False):
    """``steps`` (an async iterator) with the context ``ctx`` current while
    each step runs (``first_only``: the first, where a servicer takes its
    caller's context), not across the yields between them (so that any
    context may close it)."""
    from opentelemetry import context as otel

    it = steps.__aiter__()
    try:
        while True:
            token = otel.attach(ctx) if ctx is not None else None
            try:
                item = await it.__anext__()
            except StopAsyncIteration:
                return
            finally:
                if token is not None:
                    otel.detach(token)
            if first_only:
                ctx = None
            yield item
    finally:
        close = getattr(it, "aclose", None)
        if close is not None:
            await close()


def record(name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any] | None = None,
           context=None, kind: str = "internal") -> None:
    """A span of the past (a phase measured as it went), under ``context``
    (default: the current one); inside ``deferred``, recorded at its end."""
    if not _enabled or end_ns < start_ns:
        return
    if context is None:
        context = current_context()
    later = _later.get()
    if later is not None and (not later or later[-1] is not _CLOSED):
        later.append((name, start_ns, end_ns, attributes, context, kind))
        return
    _tracer.start_span(name, context=context, kind=_kind(kind), attributes=attributes,
                       start_time=start_ns).end(end_time=end_ns)


def annotate(**attributes: Any) -> None:
    """Attributes on the current span (nothing when off or none is
    recording); inside ``deferred``, set at its end."""
    if not _enabled:
        return
    from opentelemetry import trace

    s = trace.get_current_span()
    if s.is_recording():
        later = _later.get()
        if later is not None and (not later or later[-1] is not _CLOSED):
            later.append((s, attributes))
        else:
            s.set_attributes({k: v for k, v in attributes.items() if v is not None})


@contextlib.contextmanager
def serving(name: str, attributes: Mapping[str, Any] | None = None, context=None, kind: str = "server"):
    """A request's span, current inside, whose spans of the past and
    attributes (``record``, ``annotate``, from any task started inside) are
    made only once it ends (after the response is out: its duration is not
    theirs). Yields the span (None when off)."""
    if not _enabled:
        yield None
        return
    s = _tracer.start_span(name, context=context, kind=_kind(kind), attributes=attributes)
    later: list = []
    token = _later.set(later)
    error = ""
    try:
        with use(s):
            yield s
    except Exception as e:
        error = type(e).__name__
        raise
    finally:
        _later.reset(token)
        end_ns = time.time_ns()
        later.append(_CLOSED)
        for item in later[:-1]:
            if len(item) == 2:
                item[0].set_attributes({k: v for k, v in item[1].items() if v is not None})
        if error:
            fail(s, error)
        s.end(end_time=end_ns)
        for item in later[:-1]:
            if len(item) == 6:
                name_, start_ns, stop_ns, attrs, ctx, kind_ = item
                _tracer.start_span(name_, context=ctx, kind=_kind(kind_), attributes=attrs,
                                   start_time=start_ns).end(end_time=stop_ns)


def _kind(kind: str):
    from opentelemetry.trace import SpanKind

    return {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER, "client": SpanKind.CLIENT}[kind]


# --- context -----------------------------------------------------------------------------
def current_context():
    """The current context (to parent spans made later elsewhere), or None when off."""
    if not _enabled:
        return None
    from opentelemetry import context

    return context.get_current()


def sampled_context():
    """The current context if its span is sampled (ours recording, or a
    caller's remote one flagged sampled), else None."""
    if not _enabled:
        return None
    from opentelemetry import trace

    ctx = current_context()
    sc = trace.get_current_span(ctx).get_span_context()
    return ctx if sc.is_valid and sc.trace_flags.sampled else None


def context_of(s):
    """A context whose current span is ``s`` (None: None)."""
    if s is None:
        return None
    from opentelemetry import trace

    return trace.set_span_in_context(s)


def headers(context=None) -> dict[str, str]:
    """W3C trace headers of ``context`` (default: the current one); {} when
    off or no span is active."""
    if not _enabled:
        return {}
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=context)
    return carrier


def traceparent(context=None) -> str:
    if not _enabled:
        return ""
    return headers(context).get(TRACEPARENT, "")


def extract(carrier: Mapping[str, str] | Iterable[tuple[str, str]] | None):
    """The context a carrier names (HTTP headers, gRPC metadata pairs); None
    when off or it names none."""
    if not _enabled or not carrier:
        return None
    if not isinstance(carrier, Mapping):
        carrier = {k: v for k, v in carrier if k in (TRACEPARENT, TRACESTATE)}
    if TRACEPARENT not in carrier:
        return None
    return _propagator.extract(carrier)


def from_traceparent(value: str, state: str = ""):
    """The context of a traceparent carried in a message (None: none)."""
    if not value or not _enabled:
        return None
    return extract({TRACEPARENT: value, **({TRACESTATE: state} if state else {})})
