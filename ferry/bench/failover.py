"""``ferry bench failover``: the replicated control plane (`ferry up --etcd`:
a local etcd, two meta stores, two schedulers) under streaming load while the
leading scheduler is killed (SIGKILL) every ``--leader-every`` seconds and a
meta-store replica every ``--meta-every`` seconds (each restarted a second
later, as a standby or a fresh replica).

Every response is checked against the fake model's deterministic tokens
(lost, duplicated), blocks are counted after idle (leaked), migrations keep
being ordered (a steady driver, and the leader's own rescheduler: its orders
per term), and each takeover is timed: from the kill to the moment etcd names
the other scheduler leader. One instance is launched by the first leader
(auto-scaling's minimum is one more than the instances started with the
cluster): it must survive every takeover, adopted, never launched twice."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import click
import grpc
import httpx

from ferry.bench.chaos import Chaos, Stats, print_counts, steady_client
from ferry.bench.harness import (bench_command, leaks, log_dir_for, log_dir_option, median, running,
                                 scheduler_view, seed_option)
from ferry.cluster import ClusterSpec, LocalCluster, free_port
from libs.common import etcd as etcdlib


async def _leader(etcd, keys: etcdlib.Keys) -> str | None:
    try:
        got = await etcd.get(keys.leader)
    except etcdlib.errors():
        return None
    return got.value.decode().split()[0] if got else None


async def _orders(cluster: LocalCluster, name: str) -> int | None:
    try:
        return (await scheduler_view(cluster.child(name).address, 1.0)).migrations_ordered
    except grpc.RpcError:
        return None


async def _every(period_s: float, first: float, stop: asyncio.Event, fault: Callable[[], Awaitable[None]]) -> None:
    """``fault()`` at ``first`` (monotonic), then every ``period_s`` after the last one was due, until ``stop``."""
    due = first
    while not stop.is_set():
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        due += period_s
        if not stop.is_set():
            await fault()


async def run_failover(duration_s: float = 120.0, leader_every_s: float = 20.0, meta_every_s: float = 20.0,
                       instances: int = 3, concurrency: int = 8, seed: int = 0, down_s: float = 1.0,
                       token_delay_ms: float = 10.0, log_dir: str | None = None) -> dict:
    log_dir = log_dir_for(log_dir, "failover")
    spec = ClusterSpec(
        instances=instances, engine="fake", port=free_port(), log_dir=log_dir, launcher=True, etcd=True,
        instance_args=["--token-delay-ms", str(token_delay_ms), "--num-blocks", "96",
                       "--migration-last-stage-max-blocks", "1", "--heartbeat-s", "0.2"],
        meta_store_args=["--ttl-s", "2"],
        # Thresholds at which the leader's rescheduler keeps ordering migrations under this load.
        scheduler_args=["--migrate-interval-s", "0.1", "--migrate-out-threshold", "35",
                        "--migrate-in-threshold", "45", "--autoscale", "--scale-out-below", "-1000",
                        "--scale-in-above", "1000", "--min-instances", str(instances + 1),
                        "--max-instances", str(instances + 1), "--autoscale-interval-s", "0.2"],
        frontend_args=["--max-resumes", "6", "--bypass-retry-s", "0.5"],
    )
    async with running(spec) as cluster:
        etcd = etcdlib.client(cluster.etcd_endpoints)
        keys = etcdlib.Keys()
        stats = Stats()
        stop = asyncio.Event()
        chaos = Chaos(cluster, instances, seed, down_s=down_s, stats=stats)
        takeovers: list[dict] = []
        meta_kills: list[dict] = []
        # The first leader launches the extra instance before the faults begin.
        t_wait = time.monotonic()
        while not cluster.launched_pids() and time.monotonic() - t_wait < 60:
            await asyncio.sleep(0.2)
        launched_before = cluster.launched_pids()
        try:
            async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as http:
                async def kill_leader() -> None:
                    old = await _leader(etcd, keys)
                    if old is None:
                        return
                    orders_before = await _orders(cluster, old)
                    killed = time.monotonic()
                    await asyncio.to_thread(cluster.kill, old)
                    new = None
                    while new in (None, old):
                        await asyncio.sleep(0.01)
                        new = await _leader(etcd, keys)
                    took = time.monotonic() - killed
                    print(f"  leader {old} killed at {killed - chaos.t0:6.1f}s: {new} leads after {took:.2f}s",
                          flush=True)
                    takeovers.append({"at_s": round(killed - chaos.t0, 2), "killed": old, "new": new,
                                      "takeover_s": round(took, 3), "orders_of_killed_term": orders_before})
                    await chaos.bounce(old, killed=True)

                async def kill_meta_store() -> None:
                    name = "meta-store" if len(meta_kills) % 2 == 0 else "meta-store-1"  # in turns
                    at = time.monotonic()
                    await chaos.bounce(name)
                    meta_kills.append({"at_s": round(at - chaos.t0, 2), "killed": name,
                                       "back_s": round(time.monotonic() - at, 2)})
                    print(f"  {name} killed at {at - chaos.t0:6.1f}s, back after {time.monotonic() - at:.2f}s",
                          flush=True)

                chaos.t0 = time.monotonic()
                tasks = [asyncio.create_task(steady_client(http, stats, stop, "failover", k, seed))
                         for k in range(concurrency)]
                tasks.append(asyncio.create_task(chaos.migration_load(stop)))
                faults = [asyncio.create_task(_every(leader_every_s, chaos.t0 + leader_every_s, stop, kill_leader)),
                          asyncio.create_task(_every(meta_every_s, chaos.t0 + meta_every_s / 2, stop, kill_meta_store))]
                await asyncio.sleep(duration_s)
                stop.set()
                for f in faults:
                    f.cancel()
                await asyncio.gather(*faults, return_exceptions=True)
                await asyncio.gather(*tasks)
                load_s = time.monotonic() - chaos.t0
                leader_now = await _leader(etcd, keys)
                orders_now = await _orders(cluster, leader_now) if leader_now else None
                launched_after = cluster.launched_pids()
                leaked, integrity_errors, live = await leaks(cluster)
        finally:
            await etcd.close()
    took = [t["takeover_s"] for t in takeovers]
    return {
        "duration_s": round(load_s, 1), "seed": seed, "instances": instances + 1, "concurrency": concurrency,
        "leader_every_s": leader_every_s, "meta_every_s": meta_every_s, "down_s": down_s,
        **stats.results(leaked, integrity_errors, live),
        "rescheduler_orders_by_leader_term": [t["orders_of_killed_term"] for t in takeovers] + [orders_now],
        "takeovers": takeovers, "meta_store_kills": meta_kills,
        "takeover_s": {"n": len(took), "p50": median(took),
                       "max": max(took) if took else None},
        "launched_instance": {"before": launched_before, "after": launched_after,
                              "kept": bool(launched_before) and launched_before == launched_after},
        "log_dir": log_dir,
    }


def print_report(res: dict) -> None:
    print(f"\nfailover: {res['duration_s']}s, {res['instances']} instances, {res['concurrency']} streams, "
          f"leader killed every {res['leader_every_s']}s, a meta store every {res['meta_every_s']}s")
    print(f"{'at (s)':>8}  {'killed':<12}{'new leader':<13}{'takeover (s)':>13}{'its orders':>11}")
    for t in res["takeovers"]:
        print(f"{t['at_s']:>8.1f}  {t['killed']:<12}{t['new']:<13}{t['takeover_s']:>13.3f}"
              f"{t['orders_of_killed_term'] if t['orders_of_killed_term'] is not None else '-':>11}")
    ts = res["takeover_s"]
    print(f"takeover: n {ts['n']}, p50 {ts['p50']}, max {ts['max']}")
    print_counts(res)
    mo = res["migration_orders"]
    print(f"migration driver: {mo['orders']} orders, {mo['committed']} committed, {mo['aborted']} aborted, "
          f"{mo['failed']} failed; rescheduler orders per leader term {res['rescheduler_orders_by_leader_term']}")
    li = res["launched_instance"]
    print(f"launched instance kept across takeovers: {li['kept']} (pids before {li['before']}, after {li['after']})")


@bench_command("failover", print_report, lambda res: res["lost"] or res["duplicated_tokens"] or res["leaked_blocks"]
               or not res["launched_instance"]["kept"], json_default="docs/results/failover.json")
@click.option("--duration", type=float, default=120.0, show_default=True, help="seconds of load")
@click.option("--leader-every", type=float, default=20.0, show_default=True, help="kill the leader this often (s)")
@click.option("--meta-every", type=float, default=20.0, show_default=True,
              help="kill a meta-store replica this often (s), between the leader kills")
@click.option("--instances", type=int, default=3, show_default=True,
              help="instances started with the cluster (the leader launches one more)")
@click.option("--concurrency", type=int, default=8, show_default=True, help="concurrent client streams")
@seed_option()
@log_dir_option()
def failover(duration, leader_every, meta_every, instances, concurrency, seed, log_dir) -> dict:
    """The replicated control plane on etcd under faults: the leader scheduler and meta-store replicas killed."""
    return asyncio.run(run_failover(duration, leader_every, meta_every, instances, concurrency, seed, log_dir=log_dir))
