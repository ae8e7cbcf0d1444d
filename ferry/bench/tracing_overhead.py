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

from ferry.cluster import LocalCluster, free_port
from ferry.machine import write_json

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


def run(spec, samples: int, json_path: str | None, ratio: float = 1.0) -> None:
    from ferry.bench.overhead import added_ttft_ab

    port = free_port()
    log = tempfile.TemporaryFile("w+")
    sink = subprocess.Popen([sys.executable, "-m", "ferry.trace_sink", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=log)
    endpoint = f"http://127.0.0.1:{port}"
    on = f"on ({ratio:.0%} sampled)"
    clusters = {"off": LocalCluster(spec()), on: LocalCluster(spec(otlp_endpoint=endpoint)),
                "off, again": LocalCluster(spec())}
    try:
        for c in clusters.values():
            c.start(timeout_s=60)
        res = asyncio.run(added_ttft_ab(clusters, samples))
        time.sleep(6)  # the batch processors' last exports (every 5 s by default)
    finally:
        for c in clusters.values():
            c.stop()
        sink.terminate()
        sink.wait(10)
    log.seek(0)
    counts = re.findall(r"spans (\d+)", log.read())
    spans = int(counts[-1]) if counts else 0
    hooks = off_path_ns()
    off, on, again = (res[k]["frontend_ttft_ms_p50"] for k in clusters)
    out = {"clusters": res, "samples": samples, "sample_ratio": ratio, "spans_exported": spans,
           "tracing_on_minus_off_ttft_ms_p50": on - off, "off_again_minus_off_ttft_ms_p50": again - off,
           "off_path_ns_per_call": hooks, "off_path_ns_per_request": sum(hooks.values())}
    click.echo(f"\n{'cluster':22s}{'frontend TTFT p50':>19s}{'direct p50':>12s}{'added p50':>11s}")
    for k, r in res.items():
        click.echo(f"{k:22s}{r['frontend_ttft_ms_p50']:19.3f}{r['direct_ttft_ms_p50']:12.3f}"
                   f"{r['added_ttft_ms_p50']:11.3f}")
    click.echo(f"\ntracing on - off, TTFT p50: {on - off:+.3f} ms   (off again - off: {again - off:+.3f} ms)")
    click.echo(f"spans exported by the traced cluster: {spans}")
    click.echo("tracing off, the calls a request makes (ns each): "
               + ", ".join(f"{k} {v:.0f}" for k, v in hooks.items())
               + f"; {sum(hooks.values()):.0f} ns per request")
    if json_path:
        write_json(json_path, out, indent=2)
