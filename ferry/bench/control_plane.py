"""``ferry bench control-plane``: the control plane alone at N instances.

A real meta store and a real scheduler, each in its own process, with N
impersonated instances and no engine: the impersonators (one process)
register over gRPC and report a status every ``--report-interval`` on one
``StreamStatus`` call each, as instances do; each status lists the requests
dispatched to that instance in the last second as running (so the
scheduler's pending dispatches settle as they do live). A driver (this
process) asks the scheduler for placements at ``--rate`` per second over two
``DispatchStream`` calls, as frontends do, and two frontend-like watchers
follow the meta store at the frontend's 0.5 s interval (``WatchBatched``, as
the frontends' ClusterView). The scheduler runs without its prefix index
unless ``--prefix-index``: the impersonators serve no KV event streams, and
the index would retry one to each absent address every 2 s.

Measured over a window after a warm-up:
- dispatch latency as the driver sees it (send to reply, loopback gRPC);
- report lag: from a status's timestamp (the impersonator's send) to the
  scheduler's view taking it in (the scheduler process is the real
  SchedulerService, with its view's update hook timed; ``cp_scheduler``);
- each process's CPU (seconds of CPU per second of wall time), and per
  report (meta store) and per report+dispatch (scheduler) in microseconds.

One table row per N (``--instances 16,64,256,1000``); JSON in docs/results."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import click
import grpc
import psutil

from ferry.bench.harness import bench_command, int_list
from ferry.cluster import ferry_command, free_port, grpc_healthy
from ferry.measure.metrics import percentile as pct
from libs.pb import common_pb2 as cpb
from libs.pb import meta_store_pb2 as mpb
from libs.pb import meta_store_pb2_grpc as mpb_grpc
from libs.pb import scheduler_pb2 as spb
from libs.pb import scheduler_pb2_grpc as spb_grpc

TOTAL_BLOCKS = 4096
HOLD_S = 1.0  # a dispatched request is listed as running in its instance's reports this long
PER_CHANNEL = 25  # impersonated instances per gRPC channel (connection)


# --------------------------------------------------------------- the impersonators
def _status(iid: str, seq: int, rng: random.Random, running: list[str]) -> cpb.InstanceStatus:
    free = rng.randint(TOTAL_BLOCKS // 2, TOTAL_BLOCKS)
    n = len(running)
    m = cpb.InstanceStatus(instance_id=iid, seq=seq, timestamp=time.time(), total_blocks=TOTAL_BLOCKS,
                           free_blocks=free, block_size=16, num_running=n, freeness=free / max(1, n),
                           normal_freeness=free / max(1, n), used_blocks=TOTAL_BLOCKS - free,
                           virtual_usage=TOTAL_BLOCKS - free, engine_steps=seq)
    for rid in running:
        m.requests.add(request_id=rid, state=cpb.RequestLoad.RUNNING, physical_blocks=8, num_tokens=128)
    return m


def impersonate(meta_store: str, n: int, interval_s: float, inbox, ready, stop_file: str) -> None:
    """Child process: N instances reporting to the meta store."""
    import uvloop

    async def main() -> None:
        rng = random.Random(n)
        ids = [f"sim-{i:04d}" for i in range(n)]
        channels = [grpc.aio.insecure_channel(meta_store) for _ in range((n + PER_CHANNEL - 1) // PER_CHANNEL)]
        stubs = [mpb_grpc.MetaStoreStub(channels[i // PER_CHANNEL]) for i in range(n)]
        infos = [cpb.InstanceInfo(instance_id=iid, address=f"127.0.0.1:{1 + i}", engine="fake", model="fake",
                                  block_size=16, total_blocks=TOTAL_BLOCKS, max_model_len=4096)
                 for i, iid in enumerate(ids)]
        calls: list = [None] * n
        running: dict[str, dict[str, float]] = {iid: {} for iid in ids}
        seqs = [0] * n
        reopened = [0]
        marks: dict[str, int] = {}  # window start/end -> reports sent by then

        async def open_call(i: int) -> None:
            # As an instance's reporter does: register, then one long-lived call.
            await stubs[i].Register(mpb.RegisterRequest(info=infos[i]))
            calls[i] = stubs[i].StreamStatus()
            seqs[i] += 1
            await calls[i].write(_status(ids[i], seqs[i], rng, []))

        async def report(i: int) -> None:
            # NOTE: each instance on its own timer, as instances are: writes
            # overlap. One loop writing every due instance's report after the
            # previous write completed sent only 5,400 of 10,000 a second at
            # 1,000 instances (each write waits on gRPC's poller thread).
            iid = ids[i]
            held = running[iid]
            await asyncio.sleep(rng.random() * interval_s)
            t = time.monotonic()
            while True:
                now = time.monotonic()
                for rid in [r for r, until in held.items() if until < now]:
                    del held[rid]
                seqs[i] += 1
                try:
                    await calls[i].write(_status(iid, seqs[i], rng, list(held)))
                except grpc.RpcError:  # the store forgot it (or restarted): register again
                    reopened[0] += 1
                    calls[i].cancel()
                    await open_call(i)
                t = t + interval_s if t + interval_s > now else now + interval_s
                await asyncio.sleep(t - time.monotonic())

        await asyncio.gather(*(open_call(i) for i in range(n)))
        reporters = [asyncio.create_task(report(i)) for i in range(n)]
        ready.set()
        while not os.path.exists(stop_file):
            while inbox.poll():
                now = time.monotonic()
                for iid, rid in inbox.recv():
                    if iid == "#mark":
                        marks[rid] = sum(seqs)
                        continue
                    running[iid][rid] = now + HOLD_S
            await asyncio.sleep(0.005)
        for r in reporters:
            r.cancel()
        await asyncio.gather(*reporters, return_exceptions=True)
        with open(stop_file + ".json", "w") as f:
            json.dump({"reopened": reopened[0],
                       "sent_in_window": marks.get("end", 0) - marks.get("start", 0) if "end" in marks else None}, f)
        for c in calls:
            c.cancel()
        for ch in channels:
            await ch.close()

    uvloop.run(main())


# ------------------------------------------------------------------ the driver
async def drive(scheduler: str, meta_store: str, rate: float, window: tuple[float, float], outbox,
                streams: int = 2, watchers: int = 2) -> dict:
    """Dispatch at ``rate``/s until window[1]; latencies of those sent inside the window."""
    t_start, t_end = window
    lat: list[float] = []
    errors = 0
    sent_in_window = 0
    pending: dict[str, float] = {}
    to_send: list[tuple[str, str]] = []
    chans = [grpc.aio.insecure_channel(scheduler) for _ in range(streams)]
    calls = [spb_grpc.SchedulerStub(ch).DispatchStream() for ch in chans]
    watch_ch = grpc.aio.insecure_channel(meta_store)
    watch_events = [0]

    async def watcher() -> None:
        try:
            # As a frontend's ClusterView watches (WatchBatched, 0.5 s).
            async for msg in mpb_grpc.MetaStoreStub(watch_ch).WatchBatched(
                    mpb.WatchRequest(min_update_interval_s=0.5)):
                watch_events[0] += len(msg.events)
        except grpc.RpcError:
            pass

    async def reader(call) -> None:
        nonlocal errors
        async for reply in call:
            t = time.monotonic()
            t0 = pending.pop(reply.request_id, None)
            if reply.error_code:
                errors += 1
                continue
            to_send.append((reply.instance_id, reply.request_id))
            if t0 is not None and t_start <= t0 <= t_end:
                lat.append((t - t0) * 1000)

    async def forward() -> None:
        while True:
            await asyncio.sleep(0.02)
            if to_send:
                batch = to_send[:]
                to_send.clear()
                outbox.send(batch)

    tasks = [asyncio.create_task(reader(c)) for c in calls] + [asyncio.create_task(forward())]
    tasks += [asyncio.create_task(watcher()) for _ in range(watchers)]
    rng = random.Random(1)
    seq = 0
    next_t = time.monotonic()
    while next_t < t_end:
        now = time.monotonic()
        if now < next_t:
            await asyncio.sleep(next_t - now)
        seq += 1
        rid = f"r{seq}"
        t0 = time.monotonic()
        pending[rid] = t0
        if t_start <= t0 <= t_end:
            sent_in_window += 1
        await calls[seq % streams].write(spb.DispatchRequest(request_id=rid, num_prompt_tokens=rng.randint(32, 1024)))
        next_t += rng.expovariate(rate)
    await asyncio.sleep(0.5)  # the last replies
    for c in calls:
        await c.done_writing()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for ch in [*chans, watch_ch]:
        await ch.close()
    return {"latencies_ms": lat, "sent": sent_in_window, "errors": errors, "unanswered": len(pending),
            "watch_events": watch_events[0]}


# ------------------------------------------------------------------ one point
def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def run_point(n: int, rate: float, interval_s: float, warmup_s: float, measure_s: float, log_dir: str,
              prefix_index: bool = False) -> dict:
    ms_port, sch_port = free_port(), free_port()
    meta_store, scheduler = f"127.0.0.1:{ms_port}", f"127.0.0.1:{sch_port}"
    stats_file = os.path.join(log_dir, f"lag-{n}.json")
    procs = []
    logs = []

    def spawn(args: list[str], name: str) -> subprocess.Popen:
        out = open(os.path.join(log_dir, f"{name}-{n}.log"), "wb")
        logs.append(out)
        p = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
        procs.append(p)
        return p

    ms = spawn(ferry_command(["serve", "meta-store", "--port", str(ms_port), "--ttl-s", "3",
                              "--log-level", "warning"]), "meta-store")
    sch = spawn([sys.executable, "-c", "from ferry.bench.cp_scheduler import main; main()", "--port", str(sch_port),
                 "--meta-store", meta_store, "--stats-file", stats_file, "--log-level", "warning",
                 "--prefix-index" if prefix_index else "--no-prefix-index"], "scheduler")
    for addr in (meta_store, scheduler):
        deadline = time.monotonic() + 60
        while not grpc_healthy(addr):
            assert time.monotonic() < deadline, f"{addr} did not start"
            time.sleep(0.1)
    ctx = mp.get_context("spawn")
    inbox_r, inbox_w = ctx.Pipe(duplex=False)
    ready = ctx.Event()
    stop_file = os.path.join(log_dir, f"stop-{n}")
    imp = ctx.Process(target=impersonate, args=(meta_store, n, interval_s, inbox_r, ready, stop_file), daemon=True)
    imp.start()
    try:
        assert ready.wait(120), "impersonators did not start"
        t_start = time.monotonic() + warmup_s
        t_end = t_start + measure_s
        ps = {"meta_store": psutil.Process(ms.pid), "scheduler": psutil.Process(sch.pid),
              "impersonators": psutil.Process(imp.pid), "driver": psutil.Process(os.getpid())}

        async def measure() -> tuple[dict, dict, dict]:
            cpu0: dict[str, float] = {}
            cpu1: dict[str, float] = {}

            async def window_marks() -> None:
                await asyncio.sleep(max(0.0, t_start - time.monotonic()))
                for k, p in ps.items():
                    cpu0[k] = _cpu(p)
                os.kill(sch.pid, signal.SIGUSR1)  # lag window begins
                inbox_w.send([("#mark", "start")])
                await asyncio.sleep(max(0.0, t_end - time.monotonic()))
                for k, p in ps.items():
                    cpu1[k] = _cpu(p)
                inbox_w.send([("#mark", "end")])
                os.kill(sch.pid, signal.SIGUSR2)  # lag window ends: the stats are written

            mark = asyncio.create_task(window_marks())
            d = await drive(scheduler, meta_store, rate, (t_start, t_end), inbox_w)
            await mark
            return d, cpu0, cpu1

        d, cpu0, cpu1 = asyncio.run(measure())
        cpu = {k: (cpu1[k] - cpu0[k]) / measure_s for k in ps}
        deadline = time.monotonic() + 20
        while not os.path.exists(stats_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        lag = json.load(open(stats_file)) if os.path.exists(stats_file) else {}
    finally:
        open(stop_file, "w").close()
        imp.join(10)
        if imp.is_alive():
            imp.kill()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in logs:
            f.close()
    lat = d["latencies_ms"]
    reports_per_s = n / interval_s
    dispatched = len(lat) / measure_s
    return {
        "instances": n, "report_interval_s": interval_s, "reports_per_s": reports_per_s, "rate": rate,
        "dispatched_per_s": round(dispatched, 1), "dispatch_errors": d["errors"], "unanswered": d["unanswered"],
        "dispatch_ms": {"p50": pct(lat, 50), "p90": pct(lat, 90), "p99": pct(lat, 99), "p999": pct(lat, 99.9),
                        "mean": statistics.fmean(lat) if lat else None},
        "report_lag_ms": lag,
        "cpu": {k: round(v, 3) for k, v in cpu.items()},
        "watch_events_frontend_like": d["watch_events"],
        **_impersonated(stop_file, measure_s, cpu, lag, dispatched),
    }


def _impersonated(stop_file: str, measure_s: float, cpu: dict, lag: dict, dispatched: float) -> dict:
    """Reports actually sent in the window (the impersonators may fall behind
    their nominal rate on a busy machine) and the cost per report processed."""
    try:
        with open(stop_file + ".json") as f:
            imp = json.load(f)
    except (OSError, ValueError):
        return {}
    sent = imp.get("sent_in_window") or 0
    seen = lag.get("n", 0)
    return {
        "reports_reopened": imp.get("reopened"), "reports_sent_per_s": round(sent / measure_s, 1),
        "reports_seen_by_scheduler_per_s": round(seen / measure_s, 1),
        "cpu_us_per_report_sent_meta_store": round(cpu["meta_store"] * measure_s / sent * 1e6, 1) if sent else None,
        "cpu_us_per_update_or_dispatch_scheduler":
            round(cpu["scheduler"] * measure_s / (seen + dispatched * measure_s) * 1e6, 1) if seen else None,
    }


def print_table(rows: list[dict]) -> None:
    print(f"\n{'N':>6} {'place p50':>9} {'p99':>6} {'rep/s':>7} {'sent/s':>7} {'seen/s':>7} {'disp/s':>7} {'disp p50':>9} {'p99':>7} "
          f"{'lag p50':>8} {'p99':>7} {'cpu ms':>7} {'sch':>5} {'imp':>5} {'drv':>5} {'us/rep ms':>10} "
          f"{'us/ev sch':>10}")
    for r in rows:
        d, lag, c = r["dispatch_ms"], r["report_lag_ms"], r["cpu"]

        def f(x, w=7, p=2):
            return f"{x:>{w}.{p}f}" if isinstance(x, (int, float)) else f"{'-':>{w}}"
        pl = lag.get("place_ms", {})
        print(f"{r['instances']:>6} {f(pl.get('p50'), 9, 3)} {f(pl.get('p99'), 6, 3)} {r['reports_per_s']:>7.0f} {f(r.get('reports_sent_per_s'), 7, 0)} "
              f"{f(r.get('reports_seen_by_scheduler_per_s'), 7, 0)} {r['dispatched_per_s']:>7.0f} "
              f"{f(d['p50'], 9)} {f(d['p99'])} {f(lag.get('p50'), 8, 1)} {f(lag.get('p99'), 7, 1)} "
              f"{f(c['meta_store'])} {f(c['scheduler'], 5)} {f(c['impersonators'], 5)} {f(c['driver'], 5)} "
              f"{f(r.get('cpu_us_per_report_sent_meta_store'), 10, 1)} "
              f"{f(r.get('cpu_us_per_update_or_dispatch_scheduler'), 10, 1)}")
    print("(rep/s nominal; sent/s by the impersonators and seen/s by the scheduler's view in the window; "
          "place: the scheduler's own placement time; latencies in ms; cpu in cores; us/rep: meta-store CPU per report sent; us/ev: scheduler CPU per "
          "report seen or dispatch)")


@bench_command("control-plane", lambda res: print_table(res["points"]), json_default="docs/results/control_plane.json")
@click.option("--instances", default="16,64,256,1000", show_default=True, help="N values, comma-separated")
@click.option("--rate", type=float, default=500.0, show_default=True, help="dispatches per second")
@click.option("--report-interval", type=float, default=0.1, show_default=True,
              help="seconds between two status reports of one instance")
@click.option("--warmup", type=float, default=5.0, show_default=True, help="seconds before the window")
@click.option("--measure", type=float, default=15.0, show_default=True, help="seconds measured")
@click.option("--prefix-index/--no-prefix-index", default=False, show_default=True,
              help="the scheduler's prefix index on: the impersonated instances serve no KV events, so it retries "
                   "a stream to each of the N absent addresses every 2 s (a cost of the bench, not of reports)")
def control_plane(instances, rate, report_interval, warmup, measure, prefix_index) -> dict:
    """The control plane alone: N impersonated instances, dispatches at a rate; latency, lag and CPU."""
    log_dir = tempfile.mkdtemp(prefix="ferry-cp-")
    rows = []
    for n in int_list(instances):
        print(f"N = {n} ...", flush=True)
        rows.append(run_point(n, rate, report_interval, warmup, measure, log_dir, prefix_index))
        print_table(rows[-1:])
    res = {"rate": rate, "report_interval_s": report_interval, "warmup_s": warmup, "measure_s": measure,
           "prefix_index": prefix_index,
           "cores": os.cpu_count(), "points": rows, "log_dir": log_dir}
    return res
