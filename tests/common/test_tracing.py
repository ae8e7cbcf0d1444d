"""libs/common/tracing.py in-process: its own W3C ``traceparent`` parsing
agrees with the OpenTelemetry propagator's; a request's span tree (its spans
of the past made at its end, under it); a client's unsampled flag leaves
nothing; the batch processor's spans go out once the process is idle, not
while a request is in flight."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ferry.trace_sink import TraceSink
from libs.common import tracing

TRACE, SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


@pytest.fixture
def exported():
    exporter = InMemorySpanExporter()
    assert tracing.configure("test", exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.reset()


CARRIERS = [
    f"00-{TRACE}-{SPAN}-01",
    f"00-{TRACE}-{SPAN}-00",
    f"00-{TRACE}-{SPAN}-03",
    f" 00-{TRACE}-{SPAN}-01\t",  # optional whitespace around the value
    f"01-{TRACE}-{SPAN}-01-later-fields",  # a later version may add fields
    f"00-{TRACE}-{SPAN}-01-extra",  # version 00 has none
    f"ff-{TRACE}-{SPAN}-01",  # the version that is not one
    f"00-{'0' * 32}-{SPAN}-01",  # all-zero trace id
    f"00-{TRACE}-{'0' * 16}-01",  # all-zero span id
    f"00-{TRACE.upper()}-{SPAN}-01",  # hex digits are lower case
    f"00-{TRACE[:-1]}-{SPAN}-01",
    f"00-{TRACE}-{SPAN}-1",
    f"00_{TRACE}_{SPAN}_01",
    "",
    "garbage",
]


@pytest.mark.parametrize("value", CARRIERS)
def test_traceparent_is_read_as_the_propagator_reads_it(exported, value):
    state = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
    ours = tracing.extract({"traceparent": value, "tracestate": state})
    theirs = TraceContextTextMapPropagator().extract({"traceparent": value, "tracestate": state})
    want = get_current_span(theirs).get_span_context()
    if not want.is_valid:
        assert ours is None
        return
    got = get_current_span(ours).get_span_context()
    assert (got.trace_id, got.span_id, got.trace_flags, got.is_remote) == \
        (want.trace_id, want.span_id, want.trace_flags, want.is_remote)
    assert got.trace_state.to_header() == want.trace_state.to_header()


def test_metadata_pairs_and_headers_round_trip(exported):
    ctx = tracing.extract([("x-ferry-token", "t"), ("traceparent", f"00-{TRACE}-{SPAN}-01"), ("tracestate", "a=b")])
    with tracing.span("child", context=ctx) as s:
        h = tracing.headers()
        assert h["traceparent"] == f"00-{TRACE}-{s.get_span_context().span_id:016x}-01"
        assert h["tracestate"] == "a=b"
        assert tracing.traceparent() == h["traceparent"]
        theirs = get_current_span(TraceContextTextMapPropagator().extract(h)).get_span_context()
        assert (theirs.trace_id, theirs.span_id, theirs.trace_flags) == \
            (int(TRACE, 16), s.get_span_context().span_id, 1)  # what vLLM's propagator reads of ours
        assert theirs.trace_state.to_header() == "a=b"
    assert tracing.extract([("x-ferry-token", "t")]) is None
    (child,) = exported.get_finished_spans()
    assert child.parent.span_id == int(SPAN, 16) and child.context.trace_id == int(TRACE, 16)


def test_a_requests_spans_of_the_past_are_made_at_its_end_under_it(exported):
    ctx = tracing.extract({"traceparent": f"00-{TRACE}-{SPAN}-01"})
    with tracing.serving("POST /v1/completions", {"http.method": "POST"}, context=ctx) as root:
        t0 = time.time_ns()
        tracing.record("ferry.dispatch", t0, t0 + 1000, {"ferry.choice": "i-0", "ferry.none": None})
        tracing.annotate(**{"ferry.request_id": "r1", "ferry.skipped": None})
        call = tracing.start("ferry.generate", kind="client")
        with tracing.use(call):
            assert tracing.traceparent().split("-")[2] == f"{call.get_span_context().span_id:016x}"
        tracing.end(call, error="boom")
        assert [s.name for s in exported.get_finished_spans()] == ["ferry.generate"]  # the rest: at the end
    spans = {s.name: s for s in exported.get_finished_spans()}
    assert set(spans) == {"POST /v1/completions", "ferry.dispatch", "ferry.generate"}
    req = spans["POST /v1/completions"]
    assert req.parent.span_id == int(SPAN, 16) and req.context.span_id == root.get_span_context().span_id
    assert dict(req.attributes) == {"http.method": "POST", "ferry.request_id": "r1"}
    for name in ("ferry.dispatch", "ferry.generate"):
        assert spans[name].parent.span_id == req.context.span_id
        assert spans[name].context.trace_id == int(TRACE, 16)
    assert dict(spans["ferry.dispatch"].attributes) == {"ferry.choice": "i-0"}
    assert spans["ferry.dispatch"].end_time - spans["ferry.dispatch"].start_time == 1000
    assert not spans["ferry.generate"].status.is_ok and spans["ferry.generate"].status.description == "boom"


def test_an_exception_fails_the_span_and_an_unsampled_caller_leaves_nothing(exported):
    with pytest.raises(ValueError), tracing.span("work"):
        raise ValueError("no")
    (work,) = exported.get_finished_spans()
    assert not work.status.is_ok and work.events[0].name == "exception"
    exported.clear()
    quiet = tracing.extract({"traceparent": f"00-{TRACE}-{SPAN}-00"})
    with tracing.serving("GET /v1/models", context=quiet) as s:
        assert not s.is_recording()
        tracing.record("ferry.dispatch", 1, 2)
        assert tracing.sampled_context() is None
        assert tracing.headers()["traceparent"].endswith("-00")  # the decision goes on
    assert exported.get_finished_spans() == ()


def test_the_batch_processors_spans_go_out_once_no_request_is_in_flight(monkeypatch):
    """With a batch delay of an hour, spans reach the OTLP receiver only
    through the flush at an idle moment (``settled``): none while the outer
    request is still in flight, all soon after it ends."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "3600000")
    sink = TraceSink().start()
    try:
        assert tracing.configure("test", endpoint=sink.endpoint)
        with tracing.serving("outer"):
            with tracing.serving("inner"):
                pass
            time.sleep(0.5)
            assert sink.count == 0  # one request still in flight
        sink.wait(lambda spans: len(spans) == 2, timeout_s=30)
        assert {s.name for s in sink.spans()} == {"outer", "inner"}
    finally:
        tracing.reset()
        sink.stop()


def test_an_instance_settles_once_its_last_traced_request_is_recorded(exported, monkeypatch):
    """services/instance/request_traces.py: the phases of each request as spans under its caller's
    context when it finishes there; the batch processor is flushed (``settled``) only when none is
    left on its way."""
    from libs.common.types import FinishReason, TokenOutput
    from services.instance.request_traces import RequestTraces

    settled = []
    monkeypatch.setattr(tracing, "settled", lambda: settled.append(1))
    traces = RequestTraces("instance-0")
    with tracing.use(tracing.start("ferry.generate", kind="client")):
        traces.arrived("a", 8, 0)
        traces.arrived("b", 8, 0)
    traces.on_step([TokenOutput("a", 0, 7), TokenOutput("b", 0, 7)], None)
    traces.on_step([TokenOutput("a", 1, 8, FinishReason.STOP)], None)
    assert settled == []  # b is still on its way
    traces.left("b")
    assert settled == [1]
    names = sorted(s.name for s in exported.get_finished_spans())
    assert names == ["ferry.decode"] * 2 + ["ferry.prefill"] * 2 + ["ferry.queue"] * 2
