"""``ferry bench autoscale``: the cost of auto-scaling. A workload whose rate
steps over time (Poisson arrivals, low -> high -> low by default) runs twice
on fake-engine clusters: once with auto-scaling (one static instance, the
scheduler launches and stops the rest) and once on a fixed fleet sized for
the peak. Reports instance-seconds used by each (the live instance count
integrated over the run) and TTFT percentiles of both."""

from __future__ import annotations

import asyncio
import random
import tempfile
import time

import click
import grpc
import httpx

from ferry.bench.harness import bench_command, expected_fake_text, running, scheduler_view, seed_option
from ferry.bench.sse import stream_completion
from ferry.cluster import ClusterSpec, free_port
from ferry.measure.metrics import percentile as pct


def parse_steps(spec: str) -> list[tuple[float, float]]:
    """"20:3,20:12,20:3" -> [(seconds, requests per second), ...]"""
    out = []
    for part in spec.split(","):
        secs, rate = part.split(":")
        out.append((float(secs), float(rate)))
    return out


def arrivals(steps: list[tuple[float, float]], seed: int) -> list[float]:
    rng, t, out, start = random.Random(seed), 0.0, [], 0.0
    for secs, rate in steps:
        t = start
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= start + secs:
                break
            out.append(t)
        start += secs
    return out


async def run_once(autoscale: bool, steps, seed: int, peak_instances: int, max_tokens: int,
                   instance_args: list[str], scheduler_args: list[str], log_dir: str) -> dict:
    spec = ClusterSpec(instances=1 if autoscale else peak_instances, engine="fake", port=free_port(),
                       log_dir=log_dir, launcher=autoscale, instance_args=instance_args,
                       scheduler_args=scheduler_args if autoscale else scheduler_args[:6])
    times = arrivals(steps, seed)
    total = sum(s for s, _ in steps)
    ttft, wrong, errors, counts = [], 0, 0, []
    async with running(spec) as cluster:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as http:
            t0 = time.monotonic()

            async def one(i: int, at: float):
                nonlocal wrong, errors
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                prompt = f"scale {i} " * 3
                start = time.perf_counter()
                try:
                    c = await stream_completion(http, {"prompt": prompt, "max_tokens": max_tokens})
                except Exception:  # noqa: BLE001
                    errors += 1
                    return
                if c.text != expected_fake_text(prompt, max_tokens):
                    wrong += 1
                if c.token_times:
                    ttft.append(c.token_times[0] - start)

            async def sample():
                while True:
                    try:
                        v = await scheduler_view(cluster.scheduler)
                        counts.append((time.monotonic() - t0, len([i for i in v.instances if i.HasField("status")])))
                    except grpc.RpcError:
                        pass
                    await asyncio.sleep(0.25)
            sampler = asyncio.create_task(sample())
            await asyncio.gather(*(one(i, at) for i, at in enumerate(times)))
            elapsed = time.monotonic() - t0
            sampler.cancel()
    # Instance-seconds over the workload's span (until the last request ended).
    inst_s, prev_t, prev_n = 0.0, 0.0, counts[0][1] if counts else 0
    for t, n in counts:
        inst_s += prev_n * (t - prev_t)
        prev_t, prev_n = t, n
    inst_s += prev_n * max(0.0, elapsed - prev_t)
    return {"autoscale": autoscale, "requests": len(times), "errors": errors, "wrong": wrong,
            "elapsed_s": round(elapsed, 1), "workload_s": total, "instance_seconds": round(inst_s, 1),
            "max_instances_seen": max((n for _, n in counts), default=0),
            "ttft_p50_s": round(pct(ttft, 50), 3), "ttft_p99_s": round(pct(ttft, 99), 3),
            "instances_over_time": [(round(t, 1), n) for t, n in counts[::4]]}


def print_report(res: dict) -> None:
    a, f = res["autoscale"], res["fixed"]
    print(f"{'mode':<10}{'requests':>9}{'errors':>7}{'wrong':>6}{'inst-s':>9}{'max inst':>9}"
          f"{'TTFT p50':>10}{'TTFT p99':>10}")
    for name, r in (("autoscale", a), ("fixed", f)):
        print(f"{name:<10}{r['requests']:>9}{r['errors']:>7}{r['wrong']:>6}{r['instance_seconds']:>9.1f}"
              f"{r['max_instances_seen']:>9}{r['ttft_p50_s']:>10.3f}{r['ttft_p99_s']:>10.3f}")
    print(f"instance-seconds saved: {res['saving']:.1%}   P99 TTFT autoscale/fixed: {res['p99_ttft_ratio']}x "
          f"(target: >= 25% saved at <= 1.2x)")
    print("autoscale instances over time (s, n):", a["instances_over_time"])


@bench_command("autoscale", print_report)
@click.option("--steps", default="20:3,25:12,25:3", show_default=True,
              help="rate steps as seconds:requests_per_second, comma-separated")
@click.option("--peak-instances", type=int, default=3, show_default=True, help="the fixed fleet's size")
@click.option("--max-tokens", type=int, default=80, show_default=True)
@click.option("--num-blocks", type=int, default=48, show_default=True, help="KV blocks per instance")
@click.option("--token-delay-ms", type=float, default=10.0, show_default=True)
@click.option("--scale-out-below", type=float, default=8.0, show_default=True)
@click.option("--scale-in-above", type=float, default=25.0, show_default=True)
@click.option("--window", type=float, default=2.0, show_default=True)
@click.option("--cooldown", type=float, default=3.0, show_default=True)
@seed_option()
def autoscale(steps, peak_instances, max_tokens, num_blocks, token_delay_ms, scale_out_below, scale_in_above,
              window, cooldown, seed) -> dict:
    """Auto-scaling vs a fixed fleet sized for the peak: instance-seconds and TTFT."""
    st = parse_steps(steps)
    inst = ["--token-delay-ms", str(token_delay_ms), "--num-blocks", str(num_blocks),
            "--migration-last-stage-max-blocks", "1"]
    sched = ["--migrate-interval-s", "0.1", "--migrate-out-threshold", "4", "--migrate-in-threshold", "12",
             "--autoscale", "--scale-out-below", str(scale_out_below), "--scale-in-above", str(scale_in_above),
             "--scale-window-s", str(window), "--scale-cooldown-s", str(cooldown), "--min-instances", "1",
             "--max-instances", str(peak_instances), "--autoscale-interval-s", "0.25"]
    log_dir = tempfile.mkdtemp(prefix="ferry-autoscale-")
    res = {}
    for mode in (True, False):
        r = asyncio.run(run_once(mode, st, seed, peak_instances, max_tokens, inst, sched,
                                 f"{log_dir}/{'auto' if mode else 'fixed'}"))
        res["autoscale" if mode else "fixed"] = r
    a, f = res["autoscale"], res["fixed"]
    res["saving"] = round(1 - a["instance_seconds"] / f["instance_seconds"], 3)
    res["p99_ttft_ratio"] = round(a["ttft_p99_s"] / f["ttft_p99_s"], 2)
    res["steps"], res["log_dir"] = steps, log_dir
    return res
