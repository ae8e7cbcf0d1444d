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

NOTE: on, a span costs its process little on the way (``ferry bench overhead
--tracing``; docs/observability.md, "Traces"): a span here is a ``_Span``
holding its ids, start time and attributes, no SDK span (the SDK's made 25-90
µs of work each, locks, attribute validation and processors' hooks, at its
start); it becomes the SDK's ``ReadableSpan`` only when it ends, handed to the
provider's span processors as the SDK's own spans are, and from there goes the
SDK's way: batched, encoded and sent by its OTLP exporter on the batch
processor's thread, and flushed (the SDK's ``force_flush``, on a thread of
its own) as soon as the process has no request in flight (``settled``:
``_IdleFlush``), so that the encoding (30-100 µs of Python a span, holding
the GIL) runs between requests rather than in the middle of one. Sampling is
the SDK sampler's (ParentBased), asked once per new trace. The W3C ``traceparent`` is written and read here (the
propagator's inject and extract cost 20-60 µs a call in a loaded process).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

_NULL = contextlib.nullcontext()
# Spans of the past and attributes made while a request is served, kept to be
# recorded once its response is out (``deferred``): off its critical path.
_later: contextvars.ContextVar[list | None] = contextvars.ContextVar("ferry_trace_later", default=None)
_CLOSED = object()  # ends a request's list: a task it started that outlives it records at once
_enabled = False
_provider = None
_endpoint = ""  # the OTLP endpoint the spans go to ("" when off or to an in-process exporter)
_processor = None  # the provider's span processors (all of them, in one)
_resource = None
_scope = None
_otel = None  # opentelemetry.context, .trace and the SDK's pieces, imported when tracing turns on
_flusher = None  # exports what the batch processor holds once this process is idle (_IdleFlush)
_in_flight = 0  # requests being served here (``serving``)
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# W3C trace context: version-trace_id-parent_id-flags (a later version may append fields).
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


def enabled() -> bool:
    return _enabled


def configure(service: str, endpoint: str = "", ratio: float = 1.0, instance: str = "",
              exporter=None) -> bool:
    """Turn tracing on for this process: spans of ``service`` (``ferry-frontend``
    ...) to the OTLP/gRPC ``endpoint`` (``http://host:4317``; plain text
    unless ``https://``), or to ``exporter`` (an SDK SpanExporter, synchronously:
    tests). Neither: off. Returns whether it is on."""
    global _enabled, _provider, _processor, _resource, _scope, _otel, _endpoint, _flusher
    if not endpoint and exporter is None:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    attrs = {"service.name": service}
    if instance:
        attrs["service.instance.id"] = instance
    provider = TracerProvider(resource=Resource.create(attrs), sampler=ParentBased(TraceIdRatioBased(ratio)),
                              id_generator=_own_ids())
    flusher = None
    if exporter is not None:
        processor = SimpleSpanProcessor(exporter)
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        # The batch processor's delay and sizes: OTEL_BSP_* as the SDK reads them.
        processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint,
                                                        insecure=not endpoint.startswith("https://")))
        flusher = _IdleFlush(provider)
    provider.add_span_processor(processor)  # (its flush and shutdown are the provider's)
    _stop_flusher()
    if _provider is not None:
        _provider.shutdown()
    # NOTE: not the global provider: vLLM, in an instance's process, sets its own.
    _provider, _resource, _scope = provider, provider.resource, InstrumentationScope("ferry")
    _processor = processor  # what our spans end into, as the SDK's own spans do
    _otel = _Otel()
    _flusher = flusher
    _enabled, _endpoint = True, endpoint if exporter is None else ""
    return True


def _own_ids():
    """The SDK's random ids, drawn from the OS (``random.SystemRandom``: no
    state to seed, the same in a forked child). The SDK's default draws from
    the ``random`` module, which engines seed: vLLM seeds it with 0 in every
    instance, and two instances then made the same span ids in the same
    order, so a span of one had the id of a span of the other (a trace's tree
    could not be told apart)."""
    import random

    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
    from opentelemetry.trace import INVALID_SPAN_ID, INVALID_TRACE_ID

    class OwnIds(RandomIdGenerator):
        _random = random.SystemRandom()

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


class _IdleFlush:
    """Exports the spans the batch processor holds when this process has
    no request in flight (``idle``), on a thread of its own, through the
    SDK's ``force_flush`` (the batch processor's own export, under its lock):
    encoding a span for OTLP costs 30-40 µs of Python here, holding the GIL,
    and the batch processor's thread, left to itself (every 5 s, or at 512
    spans), encodes hundreds at once in the middle of whatever requests are
    then on their way to a first token, each wait for the GIL up to the
    interpreter's switch interval (5 ms). Flushed at an idle moment, at most
    every ``MIN_INTERVAL_S``: a busy process, never idle, exports as the
    batch processor does."""

    MIN_INTERVAL_S = 0.05

    def __init__(self, provider):
        import threading

        self._provider = provider
        self._wake = threading.Event()
        self._stopped = False
        self._last = 0.0
        self._thread = threading.Thread(target=self._run, name="ferry-trace-flush", daemon=True)
        self._thread.start()

    def idle(self) -> None:
        now = time.monotonic()
        if now - self._last >= self.MIN_INTERVAL_S:
            self._last = now
            self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stopped:
                return
            self._provider.force_flush()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(5)


def _stop_flusher() -> None:
    global _flusher
    if _flusher is not None:
        _flusher.stop()
        _flusher = None


def settled() -> None:
    """Nothing is in flight in this process now (no request of its on the
    way to a first token): what the batch processor holds is exported now
    (``_IdleFlush``). ``serving`` calls it as its last request ends; an
    instance as its last traced request leaves."""
    if _flusher is not None:
        _flusher.idle()


def endpoint() -> str:
    """The OTLP endpoint this process's spans go to ("" when off, or when
    they go to an in-process exporter): vLLM's own tracer, in an instance's
    process, exports there too."""
    return _endpoint


class _Otel:
    """The OpenTelemetry names this module uses, imported once tracing is on."""

    def __init__(self):
        from opentelemetry import context, trace
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.attributes import BoundedAttributes
        from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
        from opentelemetry.trace.span import TraceState

        self.context, self.trace, self.ReadableSpan, self.BoundedAttributes = context, trace, ReadableSpan, BoundedAttributes
        self.NonRecordingSpan, self.SpanContext, self.TraceFlags, self.TraceState = (NonRecordingSpan, SpanContext,
                                                                                     TraceFlags, TraceState)
        self.Status, self.StatusCode, self.Context = Status, StatusCode, context.Context
        self.Span = _span_class(trace.Span)
        self.kinds = {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER, "client": SpanKind.CLIENT}
        self.flags = {f: TraceFlags(f) for f in range(4)}  # sampled (1), random trace id (2), as the SDK sets them
        self.ok = Status(StatusCode.UNSET)


def reset() -> None:
    """Off again (tests), after exporting what is pending."""
    global _enabled, _provider, _processor, _endpoint, _in_flight
    _stop_flusher()
    if _provider is not None:
        _provider.shutdown()
    _enabled, _provider, _processor, _endpoint, _in_flight = False, None, None, "", 0


def flush(timeout_ms: int = 5000) -> None:
    if _provider is not None:
        _provider.force_flush(timeout_ms)


# --- spans -----------------------------------------------------------------------------
def _span_class(api_span):
    """``_Span``: a span of ours, an OpenTelemetry API ``Span`` (so that the
    API's ``get_current_span`` and the rest take it), made when tracing turns
    on (the API is not imported before)."""

    class _Span(api_span):
        """A sampled span while it runs: its ids, start and attributes; at its
        end the SDK's ReadableSpan, to the provider's span processors."""

        __slots__ = ("name", "_context", "_parent", "_kind", "start_time", "_attributes", "_events", "_status",
                     "_ended")

        def __init__(self, name, context, parent, kind, start_time, attributes):
            self.name, self._context, self._parent, self._kind = name, context, parent, kind
            self.start_time, self._attributes = start_time, attributes
            self._events, self._status, self._ended = None, _otel.ok, False

        def get_span_context(self):
            return self._context

        def is_recording(self) -> bool:
            return not self._ended

        def set_attribute(self, key, value) -> None:
            if not self._ended:
                self._attributes[key] = value

        def set_attributes(self, attributes) -> None:
            if not self._ended:
                self._attributes.update(attributes)

        def add_event(self, name, attributes=None, timestamp=None) -> None:
            from opentelemetry.sdk.trace import Event

            if not self._ended:
                self._events = [*(self._events or ()), Event(name, _clean(attributes or {}), timestamp)]

        def update_name(self, name) -> None:
            if not self._ended:
                self.name = name

        def set_status(self, status, description=None) -> None:
            if self._ended:
                return
            if not isinstance(status, _otel.Status):
                status = _otel.Status(status, description)
            self._status = status

        def record_exception(self, exception, attributes=None, timestamp=None, escaped=False) -> None:
            import traceback

            self.add_event("exception", {
                "exception.type": type(exception).__name__, "exception.message": str(exception),
                "exception.stacktrace": "".join(traceback.format_exception(exception)),
                "exception.escaped": str(escaped), **(attributes or {})}, timestamp)

        def end(self, end_time: int | None = None) -> None:
            if self._ended:
                return
            self._ended = True
            _processor.on_end(_otel.ReadableSpan(
                self.name, self._context, self._parent, _resource, _clean(self._attributes), self._events or (),
                (), self._kind, status=self._status, start_time=self.start_time,
                end_time=end_time or time.time_ns(), instrumentation_scope=_scope))

    return _Span


def _clean(attributes: Mapping[str, Any]):
    """Attributes as the SDK keeps a span's (its checks: a value of a type OTLP
    cannot carry is dropped with a warning), None values left out."""
    return _otel.BoundedAttributes(attributes={k: v for k, v in attributes.items() if v is not None},
                                   immutable=False)


def _new(name: str, attributes, context, kind: str, start_time: int | None):
    """A span under ``context`` (default: the current one), sampled as the
    SDK's ParentBased sampler decides (a parent's decision is followed; a new
    trace asks the sampler): a ``_Span``, else a non-recording span that
    carries the decision on."""
    o = _otel
    parent = o.trace.get_current_span(context).get_span_context()
    ids = _provider.id_generator
    if parent.is_valid:
        trace_id, state, flags = parent.trace_id, parent.trace_state, parent.trace_flags & 3
        sampled = flags & 1
    else:
        parent, state = None, None
        trace_id = ids.generate_trace_id()
        sampled = _provider.sampler.should_sample(None, trace_id, name).decision.is_sampled()
        flags = (1 if sampled else 0) | (2 if ids.is_trace_id_random() else 0)
    sc = o.SpanContext(trace_id, ids.generate_span_id(), False, o.flags[flags], state)
    if not sampled:
        return o.NonRecordingSpan(sc)
    return o.Span(name, sc, parent, o.kinds[kind], start_time or time.time_ns(),
                  dict(attributes) if attributes else {})


class _Scope:
    """``span()``'s context manager: the span current inside; an exception
    leaving it fails the span (as the SDK's ``start_as_current_span``)."""

    __slots__ = ("span", "token")

    def __init__(self, span):
        self.span = span

    def __enter__(self):
        o = _otel
        self.token = o.context.attach(o.trace.set_span_in_context(self.span))
        return self.span

    def __exit__(self, typ, exc, tb) -> None:
        try:
            if isinstance(exc, Exception) and self.span.is_recording():
                self.span.record_exception(exc, escaped=True)
                self.span.set_status(_otel.Status(_otel.StatusCode.ERROR, f"{typ.__name__}: {exc}"))
        finally:
            _otel.context.detach(self.token)
            self.span.end()


def span(name: str, attributes: Mapping[str, Any] | None = None, context=None, kind: str = "internal",
         start_time: int | None = None):
    """A context manager: a span current inside it (None when off). ``context``:
    its parent (default: the current span); ``kind``: internal, server, client."""
    if not _enabled:
        return _NULL
    return _Scope(_new(name, attributes, context, kind, start_time))


def start(name: str, attributes: Mapping[str, Any] | None = None, context=None, kind: str = "internal",
          start_time: int | None = None):
    """A span started but not made current (end it with ``end``); None when off."""
    if not _enabled:
        return None
    return _new(name, attributes, context, kind, start_time)


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
        s.set_status(_otel.Status(_otel.StatusCode.ERROR, error))


class _Current:
    """A context current inside a ``with`` (OpenTelemetry's ``use_span`` is a
    generator-based context manager: a few times slower)."""

    __slots__ = ("ctx", "token")

    def __init__(self, ctx):
        self.ctx = ctx

    def __enter__(self):
        self.token = _otel.context.attach(self.ctx)
        return self

    def __exit__(self, *exc) -> None:
        _otel.context.detach(self.token)


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
    otel = _otel.context
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
    _new(name, attributes, context, kind, start_ns).end(end_time=end_ns)


def annotate(**attributes: Any) -> None:
    """Attributes on the current span (nothing when off or none is
    recording); inside ``deferred``, set at its end."""
    if not _enabled:
        return
    s = _otel.trace.get_current_span()
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
    global _in_flight
    if not _enabled:
        yield None
        return
    s = _new(name, attributes, context, kind, None)
    later: list = []
    token = _later.set(later)
    error = ""
    _in_flight += 1
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
        try:
            for item in later[:-1]:
                if len(item) == 2:
                    item[0].set_attributes({k: v for k, v in item[1].items() if v is not None})
            if error:
                fail(s, error)
            s.end(end_time=end_ns)
            for item in later[:-1]:
                if len(item) == 6:
                    name_, start_ns, stop_ns, attrs, ctx, kind_ = item
                    _new(name_, attrs, ctx, kind_, start_ns).end(end_time=stop_ns)
        finally:
            _in_flight -= 1
            if not _in_flight:
                settled()


# --- context -----------------------------------------------------------------------------
def current_context():
    """The current context (to parent spans made later elsewhere), or None when off."""
    if not _enabled:
        return None
    return _otel.context.get_current()


def sampled_context():
    """The current context if its span is sampled (ours recording, or a
    caller's remote one flagged sampled), else None."""
    if not _enabled:
        return None
    ctx = _otel.context.get_current()
    sc = _otel.trace.get_current_span(ctx).get_span_context()
    return ctx if sc.is_valid and sc.trace_flags.sampled else None


def context_of(s):
    """A context whose current span is ``s`` (None: None)."""
    if s is None:
        return None
    return _otel.trace.set_span_in_context(s)


def headers(context=None) -> dict[str, str]:
    """W3C trace headers of ``context`` (default: the current one); {} when
    off or no span is active."""
    if not _enabled:
        return {}
    sc = _otel.trace.get_current_span(context).get_span_context()
    if not sc.is_valid:
        return {}
    carrier = {TRACEPARENT: f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{sc.trace_flags:02x}"}
    if sc.trace_state:
        carrier[TRACESTATE] = sc.trace_state.to_header()
    return carrier


def traceparent(context=None) -> str:
    if not _enabled:
        return ""
    sc = _otel.trace.get_current_span(context).get_span_context()
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{sc.trace_flags:02x}" if sc.is_valid else ""


def extract(carrier: Mapping[str, str] | Iterable[tuple[str, str]] | None):
    """The context a carrier names (HTTP headers, gRPC metadata pairs); None
    when off or it names none (or one that is not valid W3C trace context)."""
    if not _enabled or not carrier:
        return None
    if not isinstance(carrier, Mapping):
        carrier = {k: v for k, v in carrier if k in (TRACEPARENT, TRACESTATE)}
    value = carrier.get(TRACEPARENT)
    return _remote(value, carrier.get(TRACESTATE, "")) if value else None


def from_traceparent(value: str, state: str = ""):
    """The context of a traceparent carried in a message (None: none)."""
    if not value or not _enabled:
        return None
    return _remote(value, state)


def _remote(value: str, state: str):
    """A context whose current span is the remote one a ``traceparent`` (and
    ``tracestate``) names; None where it is not valid (W3C Trace Context: a
    version of two hex digits but ff, version 00 with no more fields, ids
    not all zeros)."""
    m = _TRACEPARENT.fullmatch(value.strip(" \t"))
    if m is None or m[1] == "ff" or (m[1] == "00" and m[5]):
        return None
    o = _otel
    sc = o.SpanContext(int(m[2], 16), int(m[3], 16), True, o.TraceFlags(int(m[4], 16)),
                       o.TraceState.from_header([state]) if state else None)
    if not sc.is_valid:
        return None
    return o.trace.set_span_in_context(o.NonRecordingSpan(sc), o.Context())
