"""``ferry sim calibrate``: measure the simulator's control-plane delays on a
live sim cluster of this machine, idle and under a workload.

- idle: sequential one-token requests (16-token prompts, non-streamed) give
  the frontend's TTFT; less the profile's step time, that is what dispatch,
  the Generate call and the token's way back cost together;
- idle and loaded: round trips of Dispatch (scheduler) and GetStatus (an
  instance, in turn), and the age of the scheduler's view of each instance
  (GetClusterView: now - the report's timestamp).

Derived (printed and written with --json): dispatch_s = Dispatch RTT / 2;
generate_s = Dispatch RTT / 2 + instance RTT / 2; token_s = instance RTT / 2;
rpc_s = instance RTT; report_s = 5th percentile of the view's age less half
a GetClusterView round trip (right after a report lands the view is that
old). NOTE: Dispatch probes leave a one-block pending dispatch on an
instance for up to 2 s; at 2 probes a second that is noise in the load.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time

import click
import grpc
import httpx
import numpy as np

from ferry.bench import client
from ferry.measure import workload as wl
from ferry.bench.serving import ServingOptions, start_cluster
from libs.pb import instance_pb2 as ipb
from libs.pb import instance_pb2_grpc as ipb_grpc
from libs.pb import scheduler_pb2 as spb
from libs.pb import scheduler_pb2_grpc as spb_grpc
from services.instance.engine.sim import SimProfile
from ferry.machine import write_json


class Probes:
    def __init__(self, scheduler: str, instances: list[str]):
        self.sched = spb_grpc.SchedulerStub(grpc.aio.insecure_channel(scheduler))
        self.insts = [ipb_grpc.InstanceStub(grpc.aio.insecure_channel(a)) for a in instances]
        self.n = 0
        self.out: dict[str, list[float]] = {"dispatch_rtt": [], "instance_rtt": [], "view_rtt": [], "view_age": []}

    async def once(self) -> None:
        self.n += 1
        t = time.perf_counter()
        await self.sched.Dispatch(spb.DispatchRequest(request_id=f"calibrate-{self.n}", num_prompt_tokens=1),
                                  timeout=5)
        self.out["dispatch_rtt"].append(time.perf_counter() - t)
        t = time.perf_counter()
        await self.insts[self.n % len(self.insts)].GetStatus(ipb.GetStatusRequest(), timeout=5)
        self.out["instance_rtt"].append(time.perf_counter() - t)
        t = time.perf_counter()
        view = await self.sched.GetClusterView(spb.ClusterViewRequest(), timeout=5)
        now = time.time()
        self.out["view_rtt"].append(time.perf_counter() - t)
        self.out["view_age"] += [now - r.status.timestamp for r in view.instances if r.status.timestamp]

    async def every(self, interval_s: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.once()
            try:
                async with asyncio.timeout(interval_s):
                    await stop.wait()
            except TimeoutError:
                pass


def _ms(xs: list[float]) -> dict:
    a = np.asarray(xs) * 1000
    return {"n": len(a), "mean": float(a.mean()), "p5": float(np.percentile(a, 5)),
            "p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95))} if len(a) else {"n": 0}


async def idle_ttft(url: str, n: int) -> list[float]:
    out = []
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(n):
            r = await http.post(f"{url}/v1/completions", json={"prompt": list(range(97, 113)), "max_tokens": 1,
                                                               "stream": False, "ignore_eos": True})
            out.append(r.json()["ferry"]["ttft_ms"] / 1000)
    return out


async def measure(cluster, work: wl.Workload, idle_n: int, interval_s: float) -> dict:
    addrs = [c.address for c in cluster.instances()]
    idle, loaded = Probes(cluster.scheduler, addrs), Probes(cluster.scheduler, addrs)
    await asyncio.sleep(2.0)  # every instance has reported
    ttft = await idle_ttft(cluster.url, idle_n)
    for _ in range(idle_n):
        await idle.once()
    stop = asyncio.Event()
    task = asyncio.create_task(loaded.every(interval_s, stop))
    records = await client.replay(cluster.url, work, (97, 123), stream=False)
    stop.set()
    await task
    done = [r for r in records if r.ok]
    return {"idle_ttft": ttft, "idle": idle.out, "loaded": loaded.out, "completed": len(done),
            "send_lag_p99_ms": float(np.percentile([r.send_lag_s for r in records], 99) * 1000)}


@click.command("calibrate")
@click.option("--arrivals", default="poisson:17", show_default=True)
@click.option("--lengths", default="M-M", show_default=True)
@click.option("--num-requests", "-n", type=click.IntRange(1), default=600, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--instances", type=click.IntRange(1, 64), default=16, show_default=True)
@click.option("--profile", default="llama-7b-a10", show_default=True)
@click.option("--policy", default="llumnix", show_default=True)
@click.option("--idle-requests", type=click.IntRange(1), default=40, show_default=True)
@click.option("--probe-interval-s", type=float, default=0.5, show_default=True)
@click.option("--json", "json_path", default=None)
def calibrate(arrivals, lengths, num_requests, seed, instances, profile, policy, idle_requests, probe_interval_s,
              json_path) -> None:
    """Measure the simulator's delay defaults on a live sim cluster."""
    opts = ServingOptions(arrivals=arrivals, lengths=lengths, num_requests=num_requests, seed=seed,
                          instances=instances, engine="sim", profile=profile, progress=False)
    prof = SimProfile.load(profile)
    work = wl.build(arrivals, lengths, num_requests, seed, 1.0, 0.0, prof.max_model_len)
    with tempfile.TemporaryDirectory(prefix="ferry-calibrate-") as log_dir:
        cluster = start_cluster(opts, policy, log_dir)
        try:
            raw = asyncio.run(measure(cluster, work, idle_requests, probe_interval_s))
        finally:
            cluster.stop()
    step = prof.step_ms(1, 16, 0) / 1000
    res = {"command": f"ferry sim calibrate --arrivals {arrivals} --lengths {lengths} -n {num_requests} "
                      f"--seed {seed} --instances {instances} --profile {profile} --policy {policy}",
           "idle_ttft_ms": _ms(raw["idle_ttft"]), "idle_overhead_ms": _ms([t - step for t in raw["idle_ttft"]]),
           "idle": {k: _ms(v) for k, v in raw["idle"].items()},
           "loaded": {k: _ms(v) for k, v in raw["loaded"].items()},
           "completed": raw["completed"], "send_lag_p99_ms": raw["send_lag_p99_ms"]}
    derived = {}
    for phase in ("idle", "loaded"):
        m = res[phase]
        d, i = m["dispatch_rtt"]["p50"], m["instance_rtt"]["p50"]
        derived[phase] = {"dispatch_ms": d / 2, "generate_ms": d / 2 + i / 2, "token_ms": i / 2, "rpc_ms": i,
                          "report_lag_ms": max(0.0, m["view_age"]["p5"] - m["view_rtt"]["p50"] / 2)}
    res["derived"] = derived
    click.echo(json.dumps(res, indent=1))
    if json_path:
        write_json(json_path, res)
