"""``ferry bench overhead``: what the frontend and scheduler add. On a
fake-engine cluster: time to first token through the frontend (HTTP, SSE)
vs calling an instance's Generate directly (gRPC); and the largest request
rate the frontend+scheduler sustain with < 5% errors.

The direct path keeps its gRPC channel; the frontend path is measured on a
kept HTTP connection (a pooled client: the OpenAI SDK, a benchmark client)
and, printed beside it, on a new connection per request. Until 2026-11-26 the
bench read each stream only to its first token and dropped the connection, so
its "added TTFT" included a TCP connect and accept (0.5 ms here) that the
direct path never paid.

The HTTP side is driven with aiohttp: with httpx the bench's own process was
the limit (100% of a core at 300 req/s, while the frontend used 18%), and
httpx added ~2.5 ms per request to the measured TTFT."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import aiohttp
import click
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from ferry.bench.harness import bench_command, first_token_s, started
from ferry.cluster import ClusterSpec, LocalCluster, free_port
from ferry.measure.metrics import percentile as pct
from libs.pb import instance_pb2_grpc as ipb_grpc
from libs.common import rpc

PROMPT = "measure the overhead of the serving path"


async def _direct_ttft(address: str, n: int) -> list[float]:
    out = []
    async with rpc.channel(address) as ch:
        stub = ipb_grpc.InstanceStub(ch)
        for _ in range(n):
            out.append(await first_token_s(stub, uuid.uuid4().hex, list(PROMPT.encode()), 2))
            await asyncio.sleep(0.005)  # let the abort land; keep both paths equally idle
    return out


async def _frontend_ttft(http: aiohttp.ClientSession, n: int) -> list[float]:
    """TTFT through the frontend, each stream read to its end (as a client
    does; on a session that keeps its connection, the next request reuses it,
    as the direct path reuses its channel)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        first = None
        async with http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": True}) as r:
            async for line in r.content:
                if first is None and line.startswith(b"data: ") and b'"text": "' in line:
                    first = time.perf_counter() - t0
        out.append(first)
        await asyncio.sleep(0.005)
    return out


async def _rate_step(http: aiohttp.ClientSession, rate: float, duration_s: float, timeout_s: float) -> dict:
    """Open-loop arrivals at ``rate``/s for ``duration_s``; errors = non-200,
    exceptions, or slower than ``timeout_s``."""
    n = int(rate * duration_s)
    results: list[tuple[bool, float]] = []

    async def one():
        t0 = time.perf_counter()
        try:
            async with http.post("/v1/completions", json={"prompt": "rps", "max_tokens": 1},
                                 timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                await r.read()
                ok = r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        results.append((ok, time.perf_counter() - t0))

    start = time.perf_counter()
    tasks = []
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    errors = sum(1 for ok, _ in results if not ok)
    lat = [t for ok, t in results if ok] or [float("nan")]
    return {"offered_rps": rate, "achieved_rps": (n - errors) / wall, "error_rate": errors / max(1, n),
            "latency_ms_p50": 1000 * pct(lat, 50), "latency_ms_p99": 1000 * pct(lat, 99)}


async def _frontend_ttft_total(http: aiohttp.ClientSession) -> tuple[float, float]:
    """The frontend's own TTFT histogram (from its request's arrival, after
    parsing and tokenization, to the first token from the instance): (sum, count)."""
    name = "ferry_time_to_first_token_seconds"
    async with http.get("/metrics") as r:
        text = await r.text()
    got = {s.name: s.value for family in text_string_to_metric_families(text) if family.name == name
           for s in family.samples}
    return got.get(f"{name}_sum", 0.0), got.get(f"{name}_count", 0.0)


@dataclass
class _Samples:
    """TTFT samples (seconds) of one cluster: calling an instance directly,
    through the frontend on a kept connection, through the frontend on a new
    connection per request; and the frontend's own TTFT histogram (sum,
    count) over the kept-connection samples, where it was read."""
    direct: list[float] = field(default_factory=list)
    frontend: list[float] = field(default_factory=list)
    frontend_new_conn: list[float] = field(default_factory=list)
    inside_s: float = 0.0
    inside_n: float = 0.0


async def _ttft_samples(targets: dict[str, tuple[str, str]], samples: int, rounds: int,
                        read_inside: bool = True) -> dict[str, _Samples]:
    """For each target (a frontend URL, an instance address): warm up the
    paths, then samples taken in ``rounds`` rounds that interleave the paths
    and the targets, so drift hits all alike."""
    kept = {k: aiohttp.ClientSession(base_url=url) for k, (url, _) in targets.items()}
    new = {k: aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(force_close=True))
           for k, (url, _) in targets.items()}
    try:
        for k, (_, address) in targets.items():
            await _frontend_ttft(kept[k], 20)
            await _frontend_ttft(new[k], 10)
            await _direct_ttft(address, 20)
        out = {k: _Samples() for k in targets}
        n = samples // rounds
        for _ in range(rounds):
            for k, (_, address) in targets.items():
                got = out[k]
                got.direct.extend(await _direct_ttft(address, n))
                if read_inside:
                    s0, c0 = await _frontend_ttft_total(kept[k])
                got.frontend.extend(await _frontend_ttft(kept[k], n))
                if read_inside:
                    s1, c1 = await _frontend_ttft_total(kept[k])
                    got.inside_s += s1 - s0
                    got.inside_n += c1 - c0
                got.frontend_new_conn.extend(await _frontend_ttft(new[k], n))
        return out
    finally:
        for h in (*kept.values(), *new.values()):
            await h.close()


async def added_ttft_ab(clusters: dict[str, LocalCluster], samples: int) -> dict:
    """Added TTFT p50 of each cluster, their samples interleaved in rounds
    (the same machine state for all): {label: {frontend, direct, added}}."""
    got = await _ttft_samples({k: (c.url, c.instances()[0].address) for k, c in clusters.items()},
                              samples, rounds=8, read_inside=False)
    out = {}
    for k, g in got.items():
        f, fn, d = (1000 * pct(x, 50) for x in (g.frontend, g.frontend_new_conn, g.direct))
        out[k] = {"frontend_ttft_ms_p50": f, "direct_ttft_ms_p50": d, "added_ttft_ms_p50": f - d,
                  "frontend_new_conn_ttft_ms_p50": fn, "added_new_conn_ttft_ms_p50": fn - d}
    return out


async def _run(cluster: LocalCluster, samples: int, rates: list[float], step_s: float) -> dict:
    got = (await _ttft_samples({"": (cluster.url, cluster.instances()[0].address)}, samples, rounds=4))[""]
    async with aiohttp.ClientSession(base_url=cluster.url, connector=aiohttp.TCPConnector(limit=2000),
                                     timeout=aiohttp.ClientTimeout(total=30)) as http:
        steps = []
        for rate in rates:
            s = await _rate_step(http, rate, step_s, timeout_s=5.0)
            steps.append(s)
            click.echo(f"  {rate:7.0f} req/s offered: {s['achieved_rps']:7.1f} achieved, "
                       f"{100 * s['error_rate']:5.1f}% errors, p50 {s['latency_ms_p50']:.1f} ms", err=True)
            if s["error_rate"] >= 0.05 or s["achieved_rps"] < 0.9 * rate:
                break
    d, f, fn = (np.array(x) * 1000 for x in (got.direct, got.frontend, got.frontend_new_conn))
    inside = 1000 * got.inside_s / got.inside_n if got.inside_n else float("nan")
    ok = [s for s in steps if s["error_rate"] < 0.05 and s["achieved_rps"] >= 0.9 * s["offered_rps"]]
    return {
        "direct_ttft_ms_p50": pct(d, 50), "direct_ttft_ms_p99": pct(d, 99),
        "frontend_ttft_ms_p50": pct(f, 50), "frontend_ttft_ms_p99": pct(f, 99),
        "added_ttft_ms_p50": pct(f, 50) - pct(d, 50), "added_ttft_ms_p99": pct(f, 99) - pct(d, 99),
        # The same, each request on a new HTTP connection (a client without a pool).
        "frontend_new_conn_ttft_ms_p50": pct(fn, 50), "added_new_conn_ttft_ms_p50": pct(fn, 50) - pct(d, 50),
        # Where the added time goes, in means (the frontend's histogram gives no
        # per-request values): inside = dispatch + the instance call as the
        # frontend sees it, against the same call made directly; edge = HTTP,
        # validation, tokenization, SSE and the client's parsing.
        "split_ms_mean": {
            "direct": float(d.mean()), "frontend": float(f.mean()), "frontend_inside": inside,
            "dispatch_and_hop": inside - float(d.mean()), "http_edge": float(f.mean()) - inside,
        },
        "frontend_inside_count": int(got.inside_n),
        "max_rps": max((s["offered_rps"] for s in ok), default=0.0),
        "rate_steps": steps, "samples": samples,
    }


@bench_command()
@click.option("--instances", default=2, show_default=True)
@click.option("--samples", default=200, show_default=True, help="TTFT samples per path")
@click.option("--rates", default="100,200,300,400,500,600,800,1000,1200", show_default=True,
              help="offered request rates to step through (stops at the first that fails)")
@click.option("--step-s", default=4.0, show_default=True, help="seconds per rate step")
@click.option("--token-delay-ms", default=1.0, show_default=True, help="fake engine step time")
@click.option("--cluster-token/--no-cluster-token", default=True, show_default=True,
              help="the inner services check a cluster token on every call, as under `ferry up`")
@click.option("--tracing", is_flag=True,
              help="instead of the rate steps, what tracing adds: clusters with tracing off (two: the noise floor) "
                   "and on at 100%% sampling (spans exported to a local OTLP receiver in its own process), their "
                   "TTFT sampled in turns; and the cost of the tracing calls a request makes with tracing off")
@click.option("--trace-sample-ratio", type=click.FloatRange(0, 1), default=1.0, show_default=True,
              help="with --tracing: the traced cluster's sampling ratio")
@click.option("--ab-frontend-arg", "ab_args", multiple=True,
              help="instead of the rate steps, compare added TTFT against a second cluster whose frontend has this "
                   "extra argument (repeatable), the two sampled in turns, e.g. --ab-frontend-arg=--no-dispatch-stream")
def overhead(instances, samples, rates, step_s, token_delay_ms, cluster_token, tracing, trace_sample_ratio,
             ab_args) -> dict:
    """Frontend + scheduler overhead on a fake-engine cluster."""
    token = rpc.new_token() if cluster_token else ""
    before = rpc.current()
    if token:  # the direct calls to an instance carry it too
        rpc.configure(rpc.Credentials(token=token))
    try:
        return _overhead(instances, samples, rates, step_s, token_delay_ms, token, ab_args, tracing, trace_sample_ratio)
    finally:  # this process's credentials as they were (the command also runs in-process, in tests)
        rpc.configure(before)


def _overhead(instances, samples, rates, step_s, token_delay_ms, token, ab_args, tracing=False,
              trace_sample_ratio=1.0) -> dict:
    """The results of one of the three runs: tracing's cost, an A/B of two frontends, or the rate steps."""
    def spec(frontend_args=(), otlp_endpoint=""):
        return ClusterSpec(instances=instances, engine="fake", port=free_port(), log_level="warning",
                           instance_args=["--token-delay-ms", str(token_delay_ms), "--num-blocks", "65536"],
                           frontend_args=list(frontend_args), cluster_token=token, otlp_endpoint=otlp_endpoint,
                           trace_sample_ratio=trace_sample_ratio)
    if tracing:
        from ferry.bench.tracing_overhead import run

        return run(spec, samples, trace_sample_ratio)
    if ab_args:
        return _overhead_ab(spec, samples, list(ab_args))
    with started(spec(), timeout_s=60) as cluster:
        res = asyncio.run(_run(cluster, samples, [float(r) for r in rates.split(",")], step_s))
    res["config"] = {"instances": instances, "token_delay_ms": token_delay_ms, "step_s": step_s,
                     "cluster_token": bool(token)}
    click.echo(f"\n{'metric':28s}{'value':>12s}")
    for k in ("direct_ttft_ms_p50", "frontend_ttft_ms_p50", "added_ttft_ms_p50", "direct_ttft_ms_p99",
              "frontend_ttft_ms_p99", "added_ttft_ms_p99", "added_new_conn_ttft_ms_p50", "max_rps"):
        click.echo(f"{k:28s}{res[k]:12.2f}")
    for k, v in res["split_ms_mean"].items():
        click.echo(f"{'mean ' + k:28s}{v:12.2f}")
    return res


def _overhead_ab(spec, samples: int, ab_args: list[str]) -> dict:
    labels = {"default": [], " ".join(ab_args): ab_args}
    with started(*(spec(a) for a in labels.values()), timeout_s=60) as clusters:
        res = asyncio.run(added_ttft_ab(dict(zip(labels, clusters)), samples))
    click.echo(f"\n{'frontend':28s}{'added p50 ms':>14s}{'new conn':>10s}{'frontend p50':>14s}{'direct p50':>12s}")
    for k, r in res.items():
        click.echo(f"{k:28s}{r['added_ttft_ms_p50']:14.2f}{r['added_new_conn_ttft_ms_p50']:10.2f}"
                   f"{r['frontend_ttft_ms_p50']:14.2f}{r['direct_ttft_ms_p50']:12.2f}")
    return {"ab": res, "samples": samples}
