"""``ferry bench rolling-restart``: a cluster on this machine under steady
streaming load while every process is restarted one by one, as a rolling
update does: each instance (SIGTERM: it drains by live migration, exits,
starts again on its port), then the scheduler, the meta store and the
frontend (SIGTERM: it refuses new requests and finishes its streams).

Clients behave as OpenAI's do (ferry/bench/retrying.py): they retry a 503
or a refused connection, never a stream that started. Reports lost
requests, cut streams, recomputed tokens (the frontend's count of tokens
instances computed again after a resume: 0 when every instance drained by
migration), text mismatches (fake engine: every token is known), and TTFT
and time between tokens of the requests that overlapped a restart against
those of a baseline period before the first one."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import time
from dataclasses import dataclass

import click
import httpx

from ferry.bench.harness import (bench_command, expected_fake_text, fmt, leaks, log_dir_for, log_dir_option,
                                 running, seed_option)
from ferry.bench.retrying import Attempted, Outcome, stream_with_retries
from ferry.cluster import ClusterSpec, LocalCluster, free_port
from ferry.measure.metrics import percentile as pct


@dataclass
class Restart:
    name: str
    began: float  # perf_counter
    stopped_s: float = 0.0  # SIGTERM -> exit (the drain)
    back_s: float = 0.0  # exit -> healthy again
    exit_code: int | None = None
    ended: float = 0.0


async def _restart(cluster: LocalCluster, name: str, stop_timeout_s: float) -> Restart:
    c = cluster.child(name)
    r = Restart(name, time.perf_counter())
    c.proc.send_signal(signal.SIGTERM)
    try:
        r.exit_code = await asyncio.to_thread(c.proc.wait, stop_timeout_s)
    except subprocess.TimeoutExpired:
        c.proc.kill()
        r.exit_code = await asyncio.to_thread(c.proc.wait, 10)
    t = time.perf_counter()
    r.stopped_s = t - r.began
    await asyncio.to_thread(cluster.restart, name, 300.0)
    r.ended = time.perf_counter()
    r.back_s = r.ended - t
    return r


def _summary(rows: list[Attempted]) -> dict:
    ttft = [a.ttft_s * 1000 for a in rows if a.ttft_s is not None]
    gaps = [g * 1000 for a in rows for g in a.gaps_s]
    return {"requests": len(rows), "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "tbt_ms_p50": pct(gaps, 50), "tbt_ms_p99": pct(gaps, 99), "tbt_ms_max": max(gaps, default=None)}


async def run_rolling(engine: str, instances: int, concurrency: int, baseline_s: float, settle_s: float,
                      seed: int, log_dir: str | None) -> dict:
    log_dir = log_dir_for(log_dir, "rolling")
    fake = engine == "fake"
    args = ["--token-delay-ms", "10", "--num-blocks", "4096"] if fake else ["--num-blocks", "1024"]
    spec = ClusterSpec(instances=instances, engine=engine, port=free_port(), instance_args=args, log_dir=log_dir,
                       frontend_args=["--shutdown-grace-s", "120"])
    rows: list[tuple[float, float, Attempted, str, int]] = []  # (sent, done, result, prompt, n)
    stop = asyncio.Event()
    restarts: list[Restart] = []
    async with running(spec, 60 if fake else 600) as cluster:
        limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=cluster.url, timeout=300, limits=limits) as http:
            async def client(k: int) -> None:
                rng, i = random.Random(seed * 1000 + k), 0
                while not stop.is_set():
                    n = rng.randint(60, 200) if fake else rng.randint(16, 64)
                    prompt = f"rolling {k} {i} " * rng.randint(1, 3)
                    i += 1
                    a = await stream_with_retries(http, {"prompt": prompt, "max_tokens": n,
                                                         **({} if fake else {"ignore_eos": True})}, deadline_s=180)
                    rows.append((a.sent_at, time.perf_counter(), a, prompt, n))
            clients = [asyncio.create_task(client(k)) for k in range(concurrency)]
            t0 = time.perf_counter()
            await asyncio.sleep(baseline_s)
            order = [c.name for c in cluster.instances()] + ["scheduler", "meta-store", "frontend"]
            for name in order:
                r = await _restart(cluster, name, stop_timeout_s=180)
                restarts.append(r)
                print(f"  restarted {name:<12} drain/stop {r.stopped_s:6.2f}s  back in {r.back_s:6.2f}s  "
                      f"exit {r.exit_code}", flush=True)
                await asyncio.sleep(settle_s)
            stop.set()
            await asyncio.gather(*clients)
            duration = time.perf_counter() - t0
            leaked, integrity_errors, live = await leaks(cluster)
    first, last = restarts[0].began, restarts[-1].ended
    windows = [(r.began, r.ended) for r in restarts]
    during = [a for s, e, a, _, _ in rows if any(s < we and e > ws for ws, we in windows)]
    baseline = [a for s, e, a, _, _ in rows if e < first]
    by = {o: sum(1 for _, _, a, _, _ in rows if a.outcome is o) for o in Outcome}
    mismatched = sum(1 for _, _, a, p, n in rows if fake and a.outcome is Outcome.ANSWERED
                     and a.text != expected_fake_text(p, n))
    finals = [a.final for _, _, a, _, _ in rows if a.final]
    return {
        "engine": engine, "instances": instances, "concurrency": concurrency, "seed": seed,
        "duration_s": round(duration, 1), "restart_span_s": round(last - first, 1),
        "requests": len(rows), "answered": by[Outcome.ANSWERED], "lost": by[Outcome.LOST], "cut": by[Outcome.CUT],
        "refused_to_the_end": by[Outcome.REFUSED], "text_mismatches": mismatched,
        "retried_requests": sum(1 for _, _, a, _, _ in rows if a.retries),
        "recomputed_tokens": sum(f.get("recomputed_tokens", 0) for f in finals),
        "resumes": sum(f.get("resumes", 0) for f in finals), "migrations": sum(f.get("migrations", 0) for f in finals),
        "leaked_blocks": leaked, "integrity_errors": integrity_errors, "live_instances_at_end": live,
        "restarts": [{"process": r.name, "drain_or_stop_s": round(r.stopped_s, 2), "back_s": round(r.back_s, 2),
                      "exit_code": r.exit_code} for r in restarts],
        "baseline": _summary(baseline), "during_restarts": _summary(during),
        "errors": sorted({a.error for _, _, a, _, _ in rows if a.outcome in (Outcome.LOST, Outcome.CUT)})[:10],
        "log_dir": log_dir,
    }


def print_report(res: dict) -> None:
    print(f"\nrolling restart: {res['engine']}, {res['instances']} instances, {res['concurrency']} streams, "
          f"{res['duration_s']}s ({res['restart_span_s']}s of restarts)")
    print(f"{'process':<14}{'drain/stop (s)':>16}{'back (s)':>10}{'exit':>6}")
    for r in res["restarts"]:
        print(f"{r['process']:<14}{r['drain_or_stop_s']:>16.2f}{r['back_s']:>10.2f}{r['exit_code']!s:>6}")
    print(f"\nrequests {res['requests']}  answered {res['answered']}  lost {res['lost']}  cut {res['cut']}  "
          f"refused to the end {res['refused_to_the_end']}  text mismatches {res['text_mismatches']}")
    print(f"recomputed tokens {res['recomputed_tokens']}  resumes {res['resumes']}  migrations {res['migrations']}  "
          f"retried {res['retried_requests']}  leaked blocks {res['leaked_blocks']}")
    print(f"\n{'':<18}{'requests':>9}{'TTFT p50':>10}{'p99':>8}{'TBT p50':>9}{'p99':>8}{'max':>8}  (ms)")
    for k in ("baseline", "during_restarts"):
        s = res[k]
        print(f"{k:<18}{s['requests']:>9}" + "".join(f"{fmt(s[c]):>{w}}" for c, w in (
            ("ttft_ms_p50", 10), ("ttft_ms_p99", 8), ("tbt_ms_p50", 9), ("tbt_ms_p99", 8), ("tbt_ms_max", 8))))
    if res["errors"]:
        print(f"errors: {res['errors']}")


@bench_command("rolling-restart", print_report,
               lambda res: res["lost"] or res["cut"] or res["text_mismatches"] or res["leaked_blocks"])
@click.option("--engine", type=click.Choice(["fake", "native"]), default="fake", show_default=True)
@click.option("--instances", type=int, default=2, show_default=True)
@click.option("--concurrency", type=int, default=8, show_default=True, help="client streams, each one after another")
@click.option("--baseline", "baseline_s", type=float, default=10.0, show_default=True,
              help="seconds of load before the first restart")
@click.option("--settle", "settle_s", type=float, default=3.0, show_default=True, help="seconds between restarts")
@seed_option()
@log_dir_option(None)
def rolling_restart(**options) -> dict:
    """Restart every process one by one under load: nothing lost, cut or recomputed."""
    return asyncio.run(run_rolling(**options))
