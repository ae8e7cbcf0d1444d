"""A local OTLP/gRPC trace receiver: what a collector (OpenTelemetry
Collector, Jaeger, Tempo) would be to Ferry's processes, kept in memory.
Tests read whole traces from it; ``ferry bench overhead --tracing`` sends the
cluster's spans to one (``python -m ferry.trace_sink``, in its own process,
counting them) so that receiving them costs the measured processes nothing."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import click
import grpc


@dataclass(frozen=True)
class Span:
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)
    error: bool = False
    instance: str = ""  # service.instance.id (an instance's id)

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class TraceSink:
    """An OTLP TraceService on ``127.0.0.1:port`` (0: any free one)."""

    def __init__(self, port: int = 0, keep: bool = True):
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.keep = keep
        self.count = 0
        self._spans: list[Span] = []
        self._lock = threading.Lock()
        sink = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                sink._take(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "TraceSink":
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(1)

    def _take(self, request) -> None:
        got = []
        for rs in request.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            service, instance = res.get("service.name", ""), res.get("service.instance.id", "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name, service,
                                    s.start_time_unix_nano, s.end_time_unix_nano,
                                    {a.key: _value(a.value) for a in s.attributes}, s.status.code == 2, instance))
        with self._lock:
            self.count += len(got)
            if self.keep:
                self._spans.extend(got)

    def spans(self, trace_id: str | None = None) -> list[Span]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def wait(self, predicate, timeout_s: float = 30.0) -> list[Span]:
        """The spans once ``predicate(spans)`` holds; TimeoutError with what came."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(spans)} spans received, not what was waited for")
            time.sleep(0.05)


@click.command()
@click.option("--port", type=int, default=4317, show_default=True)
def main(port: int) -> None:
    """Receive OTLP traces and count them (a line per second that saw spans)."""
    sink = TraceSink(port, keep=False).start()
    click.echo(f"trace sink on {sink.endpoint}", err=True)
    last = 0
    try:
        while True:
            time.sleep(1)
            if sink.count != last:
                last = sink.count
                click.echo(f"spans {last}", err=True)
    except KeyboardInterrupt:
        sink.stop()


if __name__ == "__main__":
    main()
