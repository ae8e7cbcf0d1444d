"""``ferry bench overhead --tracing``: what tracing adds to TTFT. Three
fake-engine clusters, started together and sampled in turns (the same
machine state for all, ``overhead.added_ttft_ab``): tracing off, the same again (the
noise floor of the comparison), and tracing on at 100% sampling, its
processes exporting every span to a local OTLP receiver in a process of its
own (ferry/trace_sink.py: receiving costs the measured processes nothing).
With tracing off the code runs a few calls of libs/common/tracing.py per
request that return at once; their cost is timed here too, call by call."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import tempfile
import time
import timeit

import click

from ferry.bench.harness import started
from ferry.cluster import free_port

# The tracing calls one request makes with tracing off, on its way through
# the frontend (Router.dispatch and its DispatchRequest, the instance call's
# span and its use), and the scheduler (its dispatch's span).
OFF_PATH = {
    "tracing.enabled() (router)": "tracing.enabled()",
    "tracing.traceparent() (router)": "tracing.traceparent()",
    "call_span(...) (peers)": "call_span('generate', 'a:1', 'r', 0)",
    "tracing.enabled() (scheduler)": "tracing.enabled()",
}


def off_path_ns(number: int = 200_000) -> dict[str, float]:
    """ns per call of each call of OFF_PATH, tracing off (best of 5)."""
    from libs.common import tracing
    from services.frontend.tracing import call_span

    assert not tracing.enabled()
    env = {"tracing": tracing, "call_span": call_span}
    return {k: min(timeit.repeat(stmt, globals=env, number=number, repeat=5)) / number * 1e9
            for k, stmt in OFF_PATH.items()}


def on_path_us(number: int = 5000) -> dict[str, float]:
    """Tracing on (100% sampled), in this process, µs per request (median of
    ``number``): the tracing work a request's way to its first token does in
    the frontend (its span from the client's headers; the dispatch's
    traceparent; the instance call's span and the metadata it carries) and
    in the instance (the caller's context read from the metadata, made
    current for the stream's first step, the request tracked); what the
    frontend does after the response (every span ended, its spans of the past
    made); and the SDK's OTLP encoding of one span (``encode_spans``, what its
    exporter does with each span, on the batch processor's or the idle
    flush's thread): the floor of what tracing costs a process's CPU."""
    import statistics

    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from libs.common import tracing
    from services.frontend.tracing import call_span

    exporter = InMemorySpanExporter()
    tracing.configure("ferry-bench", exporter=exporter)
    try:
        ns = time.perf_counter_ns
        front, after, inst = [], [], []
        for i in range(number):
            t0 = ns()
            cm = tracing.serving("POST /v1/completions", {"http.method": "POST", "http.route": "/v1/completions"},
                                 context=tracing.extract({}))
            s = cm.__enter__()
            tracing.traceparent()
            call = call_span("generate", "127.0.0.1:1", "r", 0)
            with tracing.use(call.span):
                metadata = (("x-ferry-token", "t"), *tracing.headers().items())
            t1 = ns()
            ctx = tracing.extract(metadata)  # the instance's side
            token = tracing._otel.context.attach(ctx)
            tracing.sampled_context()
            tracing._otel.context.detach(token)
            t2 = ns()
            t0_ns = time.time_ns()
            tracing.record("ferry.dispatch", t0_ns, t0_ns + 1000, {"ferry.request_id": "r", "ferry.choice": "i"})
            tracing.annotate(**{"ferry.request_id": "r", "ferry.prompt_tokens": 8})
            t3 = ns()
            call.end()
            s.set_attribute("http.status_code", 200)
            cm.__exit__(None, None, None)
            t4 = ns()
            front.append(t1 - t0)
            inst.append(t2 - t1)
            after.append(t4 - t3)
        spans = list(exporter.get_finished_spans())[-3000:]
        enc = []
        for _ in range(5):
            t0 = ns()
            encode_spans(spans)
            enc.append((ns() - t0) / len(spans))
    finally:
        tracing.reset()
    us = 1e-3
    return {"frontend_before_first_token": statistics.median(front) * us,
            "instance_before_first_token": statistics.median(inst) * us,
            "frontend_after_response": statistics.median(after) * us,
            "otlp_encode_per_span": min(enc) * us}


def run(spec, samples: int, ratio: float = 1.0) -> dict:
    from ferry.bench.overhead import added_ttft_ab

    port = free_port()
    log = tempfile.TemporaryFile("w+")
    sink = subprocess.Popen([sys.executable, "-m", "ferry.trace_sink", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=log)
    endpoint = f"http://127.0.0.1:{port}"
    on = f"on ({ratio:.0%} sampled)"
    labels = ("off", on, "off, again")
    try:
        with started(spec(), spec(otlp_endpoint=endpoint), spec(), timeout_s=60) as clusters:
            res = asyncio.run(added_ttft_ab(dict(zip(labels, clusters)), samples))
            time.sleep(6)  # the batch processors' last exports (every 5 s by default)
    finally:
        sink.terminate()
        sink.wait(10)
    log.seek(0)
    counts = re.findall(r"spans (\d+)", log.read())
    spans = int(counts[-1]) if counts else 0
    hooks = off_path_ns()
    on_path = on_path_us()
    off, on, again = (res[k]["frontend_ttft_ms_p50"] for k in labels)
    out = {"clusters": res, "samples": samples, "sample_ratio": ratio, "spans_exported": spans,
           "tracing_on_minus_off_ttft_ms_p50": on - off, "off_again_minus_off_ttft_ms_p50": again - off,
           "off_path_ns_per_call": hooks, "off_path_ns_per_request": sum(hooks.values()),
           "on_path_us_per_request": on_path}
    click.echo(f"\n{'cluster':22s}{'frontend TTFT p50':>19s}{'direct p50':>12s}{'added p50':>11s}")
    for k, r in res.items():
        click.echo(f"{k:22s}{r['frontend_ttft_ms_p50']:19.3f}{r['direct_ttft_ms_p50']:12.3f}"
                   f"{r['added_ttft_ms_p50']:11.3f}")
    click.echo(f"\ntracing on - off, TTFT p50: {on - off:+.3f} ms   (off again - off: {again - off:+.3f} ms)")
    click.echo(f"spans exported by the traced cluster: {spans}")
    click.echo("tracing off, the calls a request makes (ns each): "
               + ", ".join(f"{k} {v:.0f}" for k, v in hooks.items())
               + f"; {sum(hooks.values()):.0f} ns per request")
    click.echo("tracing on, in process (µs per request): "
               + ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in on_path.items()))
    return out
