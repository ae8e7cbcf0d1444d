"""``ferry bench chaos``: a fake-engine cluster (auto-scaling on) under steady
streaming load while a seeded schedule kills and restarts instances, the
scheduler and the meta store, and kills migration peers mid-transfer.

Every response is checked against the fake model's deterministic tokens.
Reports requests, completed, lost, duplicated_tokens, leaked_blocks (after
idle: total - free blocks on every live instance), errors_by_kind and, per
fault, the recovery time: from the fault until the instance count is back and
a probe request is served exactly."""

from __future__ import annotations

import asyncio
import collections
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

import click
import grpc
import httpx

from ferry.bench.harness import (bench_command, expected_fake_text, leaks, log_dir_for, log_dir_option,
                                 migrate_out, running, running_ids, scheduler_view, seed_option)
from ferry.bench.sse import Completion, StreamError, stream_completion
from ferry.cluster import ClusterSpec, LocalCluster, free_port
from libs.pb import meta_store_pb2 as mpb
from libs.pb import meta_store_pb2_grpc as mpb_grpc
from libs.common import rpc

FAULT_KINDS = ("instance", "scheduler", "meta_store", "migration_dest", "migration_source")


@dataclass
class Fault:
    kind: str
    target: str
    at_s: float  # since the start of the load
    recovery_s: float | None = None
    note: str = ""


@dataclass
class Stats:
    requests: int = 0
    completed: int = 0
    lost: int = 0
    duplicated_tokens: int = 0
    resumes: int = 0
    migrations: int = 0
    errors_by_kind: collections.Counter = field(default_factory=collections.Counter)
    # The steady migration load (orders of single running requests between live instances).
    orders: int = 0
    orders_committed: int = 0
    orders_aborted: int = 0
    orders_failed: int = 0
    abort_reasons: collections.Counter = field(default_factory=collections.Counter)
    # One record per lost request (when, its id, what went wrong): a loss in a
    # long run must be traceable to the logs.
    lost_requests: list[dict] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    def lose(self, kind: str, request_id: str | None, detail: str = "") -> None:
        self.lost += 1
        self.errors_by_kind[kind] += 1
        self.lost_requests.append({"at_s": round(time.monotonic() - self.t0, 2), "kind": kind,
                                   "request_id": request_id, "detail": detail[:300]})

    def results(self, leaked: int, integrity_errors: list[str], live: list[str]) -> dict:
        """The counts of a run under faults (the leak check's with them), as chaos and failover report them:
        committed migrations seen by completed requests' clients (``migrations``) and the steady load's orders."""
        return {"requests": self.requests, "completed": self.completed, "lost": self.lost,
                "duplicated_tokens": self.duplicated_tokens, "leaked_blocks": leaked,
                "integrity_errors": integrity_errors, "live_instances_at_end": live,
                "errors_by_kind": dict(self.errors_by_kind), "lost_requests": self.lost_requests,
                "resumes": self.resumes, "migrations": self.migrations,
                "migration_orders": {"orders": self.orders, "committed": self.orders_committed,
                                     "aborted": self.orders_aborted, "failed": self.orders_failed,
                                     "abort_reasons": dict(self.abort_reasons)}}


def print_counts(res: dict) -> None:
    """The lines of ``Stats.results`` that chaos and failover print alike."""
    print(f"requests {res['requests']}  completed {res['completed']}  lost {res['lost']}  "
          f"duplicated_tokens {res['duplicated_tokens']}  leaked_blocks {res['leaked_blocks']}  "
          f"resumes {res['resumes']}  migrations {res['migrations']}")
    print(f"errors_by_kind {res['errors_by_kind']}  integrity_errors {res['integrity_errors']}")


async def checked_stream(http: httpx.AsyncClient, stats: Stats, prompt: str, n: int,
                         on_chunk: Callable[[Completion], Awaitable[None]] | None = None) -> None:
    """One stream of the fake model, counted in ``stats``: exact, lost (by
    kind, with the request id that arrived before the failure) or wrong."""
    stats.requests += 1
    seen = Completion()

    async def note(c: Completion) -> None:
        seen.request_id = c.request_id
        if on_chunk is not None:
            await on_chunk(c)

    try:
        done = await stream_completion(http, {"prompt": prompt, "max_tokens": n}, note)
    except Exception as e:  # noqa: BLE001 - every failure is counted by kind
        stats.lose(e.kind if isinstance(e, StreamError) else type(e).__name__, seen.request_id, str(e))
        return
    want = expected_fake_text(prompt, n)
    if done.text == want:
        stats.completed += 1
    else:
        # Tokens delivered more than once: the answer is longer than it must
        # be, or repeats its own tail where the expected text goes on.
        stats.duplicated_tokens += max(0, len(done.text) - len(want))
        stats.lose("wrong_tokens", done.request_id, f"{len(done.text)} characters, {len(want)} expected")
    if done.final:
        stats.resumes += done.final.get("resumes", 0)
        stats.migrations += done.final.get("migrations", 0)


async def steady_client(http: httpx.AsyncClient, stats: Stats, stop: asyncio.Event, tag: str, k: int,
                        seed: int) -> None:
    """Client ``k``: one stream after another until ``stop`` (seeded prompts
    of 1-4 repeats, 20-120 tokens), each outcome counted in ``stats``."""
    i = 0
    crng = random.Random(seed * 1000 + k)
    while not stop.is_set():
        prompt, n = f"{tag} {k} {i} " * crng.randint(1, 4), crng.randint(20, 120)
        i += 1
        await checked_stream(http, stats, prompt, n)


async def _meta_instances(address: str) -> list:
    async with rpc.channel(address) as ch:
        return list((await mpb_grpc.MetaStoreStub(ch).List(mpb.ListRequest(), timeout=1.0)).instances)


class Chaos:
    def __init__(self, cluster: LocalCluster, n_instances: int, seed: int, down_s: float = 1.0,
                 stats: Stats | None = None, recover_timeout_s: float = 60.0):
        self.c = cluster
        self.recover_timeout_s = recover_timeout_s
        self.stats = stats or Stats()
        self.victims: list[asyncio.Task] = []  # the long requests of migration-peer faults
        self.n = n_instances
        self.rng = random.Random(seed)
        self.down_s = down_s
        self.faults: list[Fault] = []
        self.t0 = time.monotonic()

    @property
    def t0(self) -> float:
        """When the load started: one clock for the faults and the lost
        requests (``Stats.t0``)."""
        return self.stats.t0

    @t0.setter
    def t0(self, t: float) -> None:
        self.stats.t0 = t

    async def bounce(self, name: str, killed: bool = False) -> None:
        """Kill process ``name`` (unless ``killed`` already) and start it again ``down_s`` later."""
        if not killed:
            await asyncio.to_thread(self.c.kill, name)
        await asyncio.sleep(self.down_s)
        await asyncio.to_thread(self.c.restart, name)

    def _live_static(self):
        return [i for i in self.c.instances() if i.alive()]

    async def healthy(self, http: httpx.AsyncClient) -> bool:
        """Scheduler and meta store see >= n live instances, and a probe is exact."""
        try:
            view = await scheduler_view(self.c.scheduler)
            live = [i for i in view.instances if i.HasField("status") and not i.status.terminating]
            if len(live) < self.n or len(await _meta_instances(self.c.meta_store)) < self.n:
                return False
            p = f"probe {self.rng.random():.6f}"
            async with asyncio.timeout(5):
                c = await stream_completion(http, {"prompt": p, "max_tokens": 4})
            return c.text == expected_fake_text(p, 4)
        except (TimeoutError, grpc.RpcError, StreamError, httpx.HTTPError):
            return False

    async def inject(self, kind: str, http: httpx.AsyncClient) -> Fault:
        t = time.monotonic()
        f = Fault(kind, "", round(t - self.t0, 2))
        if kind == "instance":
            f.target = self.rng.choice(self._live_static()).name
        elif kind in ("scheduler", "meta_store"):
            f.target = "scheduler" if kind == "scheduler" else "meta-store"
        else:  # the peer is killed mid-transfer
            f.target, f.note = await self._kill_migration_peer(kind == "migration_dest", http)
        if f.target:
            await self.bounce(f.target, killed=kind.startswith("migration_"))
        while not await self.healthy(http):
            if time.monotonic() - t > self.recover_timeout_s:
                # A cluster that does not come back (a restarted process that
                # fails at start) ends the run with its name, not a hang.
                raise RuntimeError(f"fault {kind} on {f.target or '-'}: not recovered in {self.recover_timeout_s:g} s "
                                   f"(logs: {self.c.spec.log_dir})")
            await asyncio.sleep(0.1)
        f.recovery_s = round(time.monotonic() - t, 2)
        self.faults.append(f)
        return f

    async def _kill_migration_peer(self, kill_dest: bool, http: httpx.AsyncClient) -> tuple[str, str]:
        """Start a long request (its first copy stage is slowed by a
        failpoint: at least copy_delay_min_blocks full blocks), order its
        migration between two static instances, and kill one side while its
        KV is in transit. The request itself must still finish exactly."""
        prompt, n = f"victim {self.rng.random():.6f} " * 18, 300
        ids: list[str] = []

        async def note_id(c) -> None:
            if not ids:
                ids.append(c.request_id)

        self.victims.append(asyncio.create_task(checked_stream(http, self.stats, prompt, n, note_id)))
        for _ in range(100):
            if ids:
                break
            await asyncio.sleep(0.02)
        live = self._live_static()
        for src in live:
            if not ids or ids[0] not in await running_ids(src):
                continue
            dst = self.rng.choice([i for i in live if i is not src])
            task = asyncio.create_task(migrate_out(src, ids[0], dst, timeout=30))
            await asyncio.sleep(0.15)  # inside the first copy stage (slowed by a failpoint)
            victim = dst if kill_dest else src
            in_flight = not task.done()
            await asyncio.to_thread(self.c.kill, victim.name)
            try:
                reply = await task
                note = f"committed={reply.committed} aborted={reply.aborted}"
            except grpc.RpcError as e:
                note = f"order failed: {e.code().name}"
            except Exception as e:  # noqa: BLE001
                note = f"order failed: {e!r}"
            return victim.name, ("mid-transfer " if in_flight else "after transfer ") + note
        return "", "the long request was not running on a static instance"

    async def migration_load(self, stop: asyncio.Event, every_s: float = 0.1) -> None:
        """A steady MigrateOut driver: a running request of a random live
        instance to another, one order at a time, so that migrations keep
        committing beside every fault."""
        st_ = self.stats
        while not stop.is_set():
            await asyncio.sleep(every_s)
            live = self._live_static()
            if len(live) < 2:
                continue
            src = self.rng.choice(live)
            running = await running_ids(src)
            if not running:
                continue
            dst = self.rng.choice([i for i in live if i is not src])
            st_.orders += 1
            try:
                reply = await migrate_out(src, self.rng.choice(running), dst, timeout=10)
            except grpc.RpcError as e:
                st_.orders_failed += 1
                st_.abort_reasons[f"order: {e.code().name}"] += 1
                continue
            st_.orders_committed += reply.committed
            st_.orders_aborted += reply.aborted
            for r in reply.results:
                if r.outcome != "committed":
                    st_.abort_reasons[re.sub(r"'[^']*'", "'…'", r.reason)[:60]] += 1  # grouped without ids


async def run_chaos(duration_s: float = 60.0, seed: int = 0, instances: int = 4, concurrency: int = 8,
                    fault_every_s: float | None = None, log_dir: str | None = None,
                    token_delay_ms: float = 10.0, min_faults: int = 0, migration_load: bool = True) -> dict:
    """``min_faults``: go on past ``duration_s`` until this many faults were
    injected (a slow machine recovers slowly; tests want every kind once)."""
    log_dir = log_dir_for(log_dir, "chaos")
    spec = ClusterSpec(
        instances=instances, engine="fake", port=free_port(), log_dir=log_dir, launcher=True,
        instance_args=["--token-delay-ms", str(token_delay_ms), "--num-blocks", "96",
                       "--migration-last-stage-max-blocks", "1", "--migration-deadline-ms", "1000",
                       # Only the fault injector's long request (>= 12 full blocks in a stage) is slowed.
                       "--failpoints", "source.copy_delay_ms=400,source.copy_delay_min_blocks=12",
                       "--heartbeat-s", "0.2"],
        meta_store_args=["--ttl-s", "1.5"],
        scheduler_args=["--migrate-interval-s", "0.1", "--migrate-out-threshold", "8",
                        "--migrate-in-threshold", "24", "--autoscale", "--scale-out-below", "8",
                        "--scale-in-above", "60", "--scale-window-s", "3", "--scale-cooldown-s", "3",
                        "--min-instances", str(instances), "--max-instances", str(instances + 2),
                        "--autoscale-interval-s", "0.2"],
        frontend_args=["--max-resumes", "6", "--bypass-retry-s", "0.5"],
    )
    rng = random.Random(seed)
    stats = Stats()
    stop = asyncio.Event()
    kinds = list(FAULT_KINDS)
    rng.shuffle(kinds)
    every = fault_every_s or max(3.0, duration_s / (len(kinds) + 1))
    async with running(spec) as cluster:
        chaos = Chaos(cluster, instances, seed, stats=stats)
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as http:
            clients = [asyncio.create_task(steady_client(http, stats, stop, "chaos", k, seed))
                       for k in range(concurrency)]
            if migration_load:
                clients.append(asyncio.create_task(chaos.migration_load(stop)))
            chaos.t0 = time.monotonic()
            end = chaos.t0 + duration_s
            j = 0
            await asyncio.sleep(min(every, duration_s) * rng.uniform(0.5, 1.0))
            while time.monotonic() < end - 2.0 or j < min_faults:
                kind = kinds[j % len(kinds)]
                j += 1
                f = await chaos.inject(kind, http)
                print(f"  fault {f.kind:<16} {f.target:<14} at {f.at_s:6.1f}s  recovered in "
                      f"{f.recovery_s:5.2f}s  {f.note}", flush=True)
                await asyncio.sleep(max(0.0, min(max(end - time.monotonic(), 1.0), every * rng.uniform(0.5, 1.0))))
            while time.monotonic() < end:
                await asyncio.sleep(0.1)
            stop.set()
            await asyncio.gather(*clients, *chaos.victims)
            load_s = time.monotonic() - chaos.t0
            leaked, integrity_errors, live = await leaks(cluster)
    return {
        "duration_s": round(load_s, 1), "seed": seed, "instances": instances, "concurrency": concurrency,
        **stats.results(leaked, integrity_errors, live),
        "faults": [asdict(f) for f in chaos.faults],
        "max_recovery_s": max((f.recovery_s or 0.0 for f in chaos.faults), default=0.0),
        "log_dir": log_dir,
    }


def print_report(res: dict) -> None:
    print(f"\nchaos: {res['duration_s']}s, seed {res['seed']}, {res['instances']} instances, "
          f"{res['concurrency']} streams")
    print(f"{'fault':<17}{'target':<16}{'at (s)':>8}{'recovery (s)':>14}  note")
    for f in res["faults"]:
        print(f"{f['kind']:<17}{f['target']:<16}{f['at_s']:>8.1f}{f['recovery_s']:>14.2f}  {f['note']}")
    print()
    print_counts(res)
    mo = res["migration_orders"]
    print(f"migration load: {mo['orders']} orders, {mo['committed']} committed, {mo['aborted']} aborted, "
          f"{mo['failed']} failed  {mo['abort_reasons']}")
    for lost in res.get("lost_requests", []):
        print(f"  lost at {lost['at_s']:.1f}s  {lost['kind']}  {lost['request_id']}  {lost['detail']}")


@bench_command("chaos", print_report, lambda res: res["lost"] or res["duplicated_tokens"] or res["leaked_blocks"])
@click.option("--duration", "duration", type=float, default=60.0, show_default=True, help="seconds of load")
@seed_option("fault schedule and workload seed")
@click.option("--instances", type=int, default=4, show_default=True, help="instances (auto-scaling min)")
@click.option("--concurrency", type=int, default=8, show_default=True, help="concurrent client streams")
@click.option("--fault-every", "fault_every", type=float, default=None,
              help="seconds between faults (default: spread five over the run)")
@log_dir_option()
def chaos(duration, seed, instances, concurrency, fault_every, log_dir) -> dict:
    """Faults under streaming load: no request lost, no token duplicated, no block leaked."""
    return asyncio.run(run_chaos(duration, seed, instances, concurrency, fault_every, log_dir))
