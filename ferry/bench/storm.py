"""``ferry bench storm``: hostile load against a cluster on loopback (as
``ferry up`` starts it), bounded in count and time: thousands of concurrent
streams, clients that disconnect at random points (before the response,
before the first token, mid-stream), and slowloris sockets that send their
headers a byte at a time. Meanwhile /health is polled and a trickle of
normal probe requests measures TTFT.

Pass (issue 39): no process dies; every request ends (answered, 429/503,
or aborted by its client); no block leaked once idle; /health answers within
1 s throughout; the probes the cluster admits keep their normal TTFT (the
baseline measured before the storm) within 2x."""

from __future__ import annotations

import asyncio
import collections
import json
import random
import tempfile
import time

import click
import httpx

from ferry.bench.chaos import _leaks
from ferry.bench.retrying import Outcome, pct, stream_with_retries
from ferry.bench.sse import StreamError, stream_completion
from ferry.cluster import ClusterSpec, LocalCluster, free_port
from services.frontend.service import raise_open_file_limit


async def _probe(http: httpx.AsyncClient, max_tokens: int) -> tuple[str, float | None]:
    a = await stream_with_retries(http, {"prompt": "Tell me a short story", "max_tokens": max_tokens},
                                  retry_refused=False)
    return a.outcome.value, a.ttft_s


async def _stream(http: httpx.AsyncClient, i: int, max_tokens: int, counts: collections.Counter) -> None:
    try:
        await stream_completion(http, {"prompt": f"storm {i} " * (1 + i % 4), "max_tokens": max_tokens})
        counts["answered"] += 1
    except StreamError as e:
        counts["refused" if e.kind in ("http_429", "http_503") else f"error:{e.kind}"] += 1
    except httpx.HTTPError as e:
        counts[f"error:{type(e).__name__}"] += 1


async def _leaver(http: httpx.AsyncClient, i: int, rng: random.Random, counts: collections.Counter) -> None:
    """A client that goes away at a random point."""
    mode = rng.choice(["before_response", "before_first_token", "mid_stream"])
    body = {"prompt": f"leaver {i} " * (1 + i % 3), "max_tokens": 512}
    try:
        if mode == "before_response":
            await asyncio.wait_for(http.post("/v1/completions", json=body), rng.uniform(0.05, 3.0))
            counts["leaver_answered"] += 1
        elif mode == "before_first_token":
            await asyncio.wait_for(http.post("/v1/completions", json={**body, "stream": True}),
                                   rng.uniform(0.0, 0.3))
            counts["leaver_answered"] += 1
        else:
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                seen, stop_at = 0, rng.randint(1, 20)
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= stop_at:
                        break
            counts["leaver_mid_stream"] += 1
    except TimeoutError:
        counts[f"leaver_{mode}"] += 1
    except httpx.HTTPError as e:
        counts[f"leaver_error:{type(e).__name__}"] += 1


async def _slowloris(port: int, byte_every_s: float, max_s: float, closed_after: list[float]) -> None:
    t0 = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        closed_after.append(0.0)
        return
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: storm\r\n")
        await writer.drain()
        while time.monotonic() - t0 < max_s:
            try:
                data = await asyncio.wait_for(reader.read(1), byte_every_s)
                if not data:
                    closed_after.append(time.monotonic() - t0)
                    return
            except TimeoutError:
                writer.write(b"X")
                await writer.drain()
    except (ConnectionError, OSError):
        closed_after.append(time.monotonic() - t0)
    finally:
        writer.close()


async def run_storm(engine: str, instances: int, streams: int, leavers: int, slow: int, max_tokens: int,
                    max_s: float, frontend_args: list[str], instance_args: list[str], log_dir: str | None,
                    seed: int) -> dict:
    raise_open_file_limit()
    log_dir = log_dir or tempfile.mkdtemp(prefix="ferry-storm-")
    fake = engine == "fake"
    args = (["--token-delay-ms", "10"] if fake else []) + instance_args
    cluster = LocalCluster(ClusterSpec(instances=instances, engine=engine, port=free_port(), instance_args=args,
                                       frontend_args=["--client-timeout-s", "10", *frontend_args], log_dir=log_dir))
    await asyncio.to_thread(cluster.start, 60 if fake else 600)
    rng = random.Random(seed)
    counts: collections.Counter = collections.Counter()
    health_ms: list[float] = []
    health_bad: collections.Counter = collections.Counter()
    probes: list[tuple[str, float | None]] = []
    closed_after: list[float] = []
    try:
        limits = httpx.Limits(max_connections=streams + leavers + 100, max_keepalive_connections=200)
        timeout = httpx.Timeout(max_s, connect=60.0)
        async with httpx.AsyncClient(base_url=cluster.url, timeout=timeout, limits=limits) as http, \
                httpx.AsyncClient(base_url=cluster.url, timeout=10) as side:
            baseline = [await _probe(side, max_tokens) for _ in range(10)]
            base_ttft = [t * 1000 for o, t in baseline if o == "answered" and t is not None]
            done = asyncio.Event()

            async def poll_health():
                while not done.is_set():
                    t = time.perf_counter()
                    try:
                        r = await side.get("/health", timeout=5)
                        health_bad[r.status_code] += r.status_code != 200
                    except httpx.HTTPError as e:
                        health_bad[type(e).__name__] += 1
                    health_ms.append((time.perf_counter() - t) * 1000)
                    await asyncio.sleep(0.2)

            async def probe_loop():
                while not done.is_set():
                    probes.append(await _probe(side, max_tokens))
                    await asyncio.sleep(0.5)

            watchers = [asyncio.create_task(poll_health()), asyncio.create_task(probe_loop())]
            t0 = time.perf_counter()
            port = int(cluster.url.rsplit(":", 1)[1])
            work = [asyncio.create_task(_slowloris(port, 1.0, 60.0, closed_after)) for _ in range(slow)]
            work += [asyncio.create_task(_stream(http, i, max_tokens, counts)) for i in range(streams)]
            work += [asyncio.create_task(_leaver(http, i, rng, counts)) for i in range(leavers)]
            finished, unfinished = await asyncio.wait(work, timeout=max_s)
            for t in unfinished:
                t.cancel()
            storm_s = time.perf_counter() - t0
            done.set()
            await asyncio.gather(*watchers, *unfinished, return_exceptions=True)
            after = await _probe(side, max_tokens)
            leaked, integrity_errors, live = await _leaks(cluster, timeout_s=120)
            dead = [c.name for c in cluster.children if not c.alive()]
    finally:
        await asyncio.to_thread(cluster.stop)
    admitted = [t * 1000 for o, t in probes if o == "answered" and t is not None]
    base = pct(base_ttft, 50)
    return {
        "engine": engine, "instances": instances, "streams": streams, "leavers": leavers, "slowloris": slow,
        "max_tokens": max_tokens, "frontend_args": frontend_args, "instance_args": instance_args,
        "storm_s": round(storm_s, 1), "unended": len(unfinished), "counts": dict(sorted(counts.items())),
        "dead_processes": dead, "leaked_blocks": leaked, "integrity_errors": integrity_errors,
        "live_instances": live, "health_ms_max": round(max(health_ms, default=0.0), 1),
        "health_ms_p99": pct(health_ms, 99), "health_polls": len(health_ms), "health_not_200": dict(health_bad),
        "probe_ttft_ms_baseline_p50": base, "probes": len(probes),
        "probes_admitted": len(admitted), "probes_refused": sum(1 for o, _ in probes if o == "refused"),
        "probe_ttft_ms_storm_p50": pct(admitted, 50), "probe_ttft_ms_storm_p99": pct(admitted, 99),
        "probe_ttft_ratio_p50": round(pct(admitted, 50) / base, 2) if admitted and base else None,
        "slowloris_closed": len(closed_after), "slowloris_closed_after_s_p50": pct(closed_after, 50),
        "after_storm_probe": after[0], "log_dir": log_dir,
    }


def print_report(res: dict) -> None:
    print(f"\nstorm: {res['engine']}, {res['instances']} instances; {res['streams']} streams, {res['leavers']} "
          f"clients that leave, {res['slowloris']} slowloris sockets; {res['storm_s']}s")
    print(f"requests: {res['counts']}  unended {res['unended']}")
    print(f"dead processes {res['dead_processes']}  leaked blocks {res['leaked_blocks']}  "
          f"integrity errors {res['integrity_errors']}")
    print(f"/health: {res['health_polls']} polls, max {res['health_ms_max']} ms, p99 {res['health_ms_p99']} ms, "
          f"not 200: {res['health_not_200']}")
    print(f"probe TTFT (ms): baseline p50 {res['probe_ttft_ms_baseline_p50']}; during the storm "
          f"{res['probes_admitted']} of {res['probes']} admitted, p50 {res['probe_ttft_ms_storm_p50']} "
          f"p99 {res['probe_ttft_ms_storm_p99']} (ratio p50 {res['probe_ttft_ratio_p50']})")
    print(f"slowloris: {res['slowloris_closed']} of {res['slowloris']} closed by the frontend, p50 after "
          f"{res['slowloris_closed_after_s_p50']}s; after the storm a probe was {res['after_storm_probe']}")


@click.command("storm")
@click.option("--engine", type=click.Choice(["fake", "native"]), default="native", show_default=True)
@click.option("--instances", type=int, default=2, show_default=True)
@click.option("--streams", type=int, default=5000, show_default=True, help="concurrent streaming requests")
@click.option("--leavers", type=int, default=1000, show_default=True, help="clients that disconnect at random")
@click.option("--slowloris", "slow", type=int, default=200, show_default=True, help="sockets sending headers slowly")
@click.option("--max-tokens", type=int, default=16, show_default=True)
@click.option("--max-s", type=float, default=600.0, show_default=True, help="bound on the storm's duration")
@click.option("--frontend-arg", "frontend_args", multiple=True, help="extra `ferry serve frontend` argument")
@click.option("--instance-arg", "instance_args", multiple=True, help="extra `ferry serve instance` argument")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--log-dir", type=click.Path(file_okay=False), default=None)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write results here")
def storm(engine, instances, streams, leavers, slow, max_tokens, max_s, frontend_args, instance_args, seed, log_dir,
          json_path) -> None:
    """Thousands of streams, leaving clients and slowloris sockets: nothing dies, nothing leaks."""
    res = asyncio.run(run_storm(engine, instances, streams, leavers, slow, max_tokens, max_s, list(frontend_args),
                                list(instance_args), log_dir, seed))
    print_report(res)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(res, fh, indent=2)
    if res["dead_processes"] or res["leaked_blocks"] or res["unended"] or res["health_ms_max"] > 1000:
        raise SystemExit(1)
