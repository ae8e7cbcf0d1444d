"""``ferry bench serving``: replay a workload through the frontend's HTTP API
(streaming) against a cluster it starts (or ``--url``), sample the cluster
view while it runs, print a summary table, write JSON and plots.

Sim time scale: ``--sim-slowdown K`` runs sim instances on a copy of the
profile with every millisecond figure multiplied by K and the arrivals slowed
by K, stretches the control loops (status reports, rescheduling interval) by
K, then divides every measured duration by K. The modelled system is the same.
K > 1: the cluster's Python overhead (frontend, gRPC, client, which do not
scale) shrinks by K relative to the modelled GPU time, so 16 instances fit on
a small machine. K < 1 compresses time: a run takes K of its model time, at
1/K times the CPU per wall second, and the control loops keep their wall
intervals (1/K times longer in model time); check that the machine keeps up
(the send lag, and K = 1 on the same workload). Not scaled: migration transfer time (K
times faster in model time), the frontend's batching of non-streamed tokens.
Results say which K they used.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import tempfile
import time
from dataclasses import dataclass

import click
import grpc
import httpx

from ferry.bench import client
from ferry.bench.harness import fmt, instance_status, json_option, report, scheduler_view
from ferry.cluster import ClusterSpec, LocalCluster, free_port
from ferry.measure import hit_rate, metrics, prefixes, programs
from ferry.measure import workload as wl
from libs.common import convert, rpc
from libs.common.policies import POLICY_NAMES
from libs.pb import scheduler_pb2 as spb
from libs.pb import scheduler_pb2_grpc as spb_grpc

POLICIES = POLICY_NAMES  # libs/common/policies: the one registry
LAG_WARN_MS = 100.0  # send lag (wall) above this: the client could not keep up
ENGINE_TOKEN_RANGE = {"fake": (97, 123), "sim": (97, 123)}  # the byte tokenizer's a..z


@dataclass(frozen=True)
class ServingOptions(prefixes.WorkloadOptions):  # max_model_len None: what the frontend reports
    url: str | None = None
    scheduler: str | None = None  # for cluster sampling with --url
    instances: int = 2
    prefill: int = 0  # Splitwise: of the instances, this many prefill only
    decode: int = 0  # and this many decode only (the rest are mixed)
    engine: str = "sim"
    profile: str = "llama-7b-a10"
    sim_slowdown: float = 1.0
    token_delay_ms: float | None = None
    instance_args: tuple[str, ...] = ()
    scheduler_args: tuple[str, ...] = ()
    pin_cores: bool = False  # each instance on its own share of the cores (ferry up --pin-cores)
    vocab_size: int = 32000
    sample_interval_s: float = 0.5
    log_dir: str | None = None
    log_level: str = "warning"
    progress: bool = True
    stream: bool = True
    startup_timeout_s: float = 120.0

    @property
    def scale(self) -> float:
        return self.sim_slowdown if self.engine == "sim" else 1.0

    def token_range(self) -> tuple[int, int]:
        return ENGINE_TOKEN_RANGE.get(self.engine, (1000, self.vocab_size))


# --- cluster -----------------------------------------------------------------------

def scaled_profile(name_or_path: str, factor: float, folder: str) -> str:
    """A copy of a sim profile (same JSON format) with every millisecond figure
    times ``factor``; returns its path."""
    from services.instance.engine.sim import PROFILE_DIR

    src = pathlib.Path(name_or_path)
    if not src.suffix:
        src = PROFILE_DIR / f"{name_or_path}.json"
    raw = json.loads(src.read_text())
    for k, v in raw.items():
        if "_ms" in k and isinstance(v, (int, float)):
            raw[k] = v * factor
    raw["name"] = f"{raw.get('name', src.stem)}-x{factor:g}"
    raw["source"] = f"{src.name} with every _ms figure x{factor:g} (ferry bench --sim-slowdown)"
    os.makedirs(folder, exist_ok=True)
    dst = pathlib.Path(folder) / f"{src.stem}-x{factor:g}.json"
    dst.write_text(json.dumps(raw, indent=1))
    return str(dst)


def slowed_intervals(factor: float) -> tuple[list[str], list[str]]:
    """Instance and scheduler arguments that stretch the control loops with
    the sim slowdown, so the scheduler's view is as stale in model time as it
    would be unscaled (and the status traffic, the largest CPU cost of a big
    sim cluster, shrinks by the same factor). Heartbeats stay: they guard the
    meta store's TTL, which is wall time. Compression (factor below 1) keeps
    the wall-time defaults: status reports and rescheduling then run 1/factor
    times less often in model time, which is what lets a compressed run fit
    the machine (say so with the results)."""
    if factor <= 1:
        return [], []
    from services.instance.config import InstanceConfig
    from services.scheduler.service import SchedulerConfig

    report = InstanceConfig.__dataclass_fields__["report_interval_s"].default * factor
    migrate = SchedulerConfig.__dataclass_fields__["migrate_interval_s"].default * factor
    return ["--report-interval-s", f"{report:g}"], ["--migrate-interval-s", f"{migrate:g}"]


def start_cluster(opts: ServingOptions, dispatch: str, log_dir: str):
    args, sched_args = list(opts.instance_args), list(opts.scheduler_args)
    if opts.engine == "sim":
        profile = opts.profile if opts.sim_slowdown == 1 else scaled_profile(opts.profile, opts.sim_slowdown, log_dir)
        args = ["--profile", profile, *slowed_intervals(opts.sim_slowdown)[0], *args]
        sched_args = [*slowed_intervals(opts.sim_slowdown)[1], *sched_args]  # the user's come last and win
    if opts.engine == "fake" and opts.token_delay_ms is not None:
        args = ["--token-delay-ms", str(opts.token_delay_ms), *args]
    spec = ClusterSpec(instances=opts.instances, prefill=opts.prefill, decode=opts.decode, engine=opts.engine,
                       port=free_port(), dispatch=dispatch,
                       instance_args=args, scheduler_args=sched_args, log_dir=log_dir,
                       log_level=opts.log_level, pin_cores=opts.pin_cores,
                       frontend_args=["--priority-api-key", client.BENCH_API_KEY])
    cluster = LocalCluster(spec)
    cluster.start(timeout_s=opts.startup_timeout_s)
    return cluster


def frontend_max_model_len(url: str) -> int | None:
    try:
        data = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        return int(data[0]["max_model_len"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return None


# --- cluster sampling ----------------------------------------------------------------

async def sample_cluster(address: str, interval_s: float, out: list[dict], stop: asyncio.Event) -> None:
    """Append a compact GetClusterView snapshot every interval until stopped."""
    async with rpc.channel(address) as ch:  # one channel for the run: the client's CPU is the cluster's too
        stub = spb_grpc.SchedulerStub(ch)
        while not stop.is_set():
            try:
                v = await stub.GetClusterView(spb.ClusterViewRequest(), timeout=2.0)
                out.append({"t": time.perf_counter(), "migrations_ordered": v.migrations_ordered, "instances": {
                    r.info.instance_id: {"freeness": r.status.freeness, "num_running": r.status.num_running,
                                         "num_waiting": r.status.num_waiting, "free_blocks": r.status.free_blocks,
                                         "num_preemptions": r.status.num_preemptions,
                                         "migrating_out": r.status.migrating_out} for r in v.instances}})
            except grpc.RpcError:
                pass
            try:
                async with asyncio.timeout(interval_s):
                    await stop.wait()
            except TimeoutError:
                pass


async def prefix_stats(scheduler: str) -> tuple[dict, int | None]:
    """Every instance's prefix-cache stats, asked of the instances themselves
    (fresher than the view's last report), and the cluster's block size."""
    out, block = {}, None
    try:
        for r in (await scheduler_view(scheduler, timeout=5.0)).instances:
            block = block or r.info.block_size
            try:
                st = await instance_status(r.info.address, timeout=5.0)
                out[r.info.instance_id] = convert.status_from_pb(st).prefix_cache
            except grpc.RpcError:
                out[r.info.instance_id] = convert.status_from_pb(r.status).prefix_cache
    except grpc.RpcError:
        pass
    return out, block


def prefix_summary(stats: dict, block: int | None, records: list[metrics.RequestRecord]) -> dict:
    reqs = None
    if all(r.prompt_ids is not None for r in records):
        reqs = [(r.prompt_ids, r.output_ids or []) for r in sorted(records, key=lambda r: r.sent_at or 0.0)]
    return hit_rate.summary(stats, reqs, block)


async def _drive(url: str, work: wl.Workload, opts: ServingOptions, scheduler: str | None,
                 samples: list[dict], label: str) -> list[metrics.RequestRecord]:
    stop = asyncio.Event()
    sampler = None
    if scheduler:
        sampler = asyncio.create_task(sample_cluster(scheduler, opts.sample_interval_s, samples, stop))
    bar = None
    if opts.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(work.requests), desc=label, unit="req", dynamic_ncols=True, mininterval=1.0)
    try:
        records = await client.replay(url, work, opts.token_range(), stream=opts.stream,
                                      on_done=(lambda r: bar.update()) if bar else None)
        if scheduler:
            stats, block = await prefix_stats(scheduler)
            samples.append({"t": time.perf_counter(), "prefix_cache": prefix_summary(stats, block, records)})
        return records
    finally:
        stop.set()
        if sampler:
            await sampler
        if bar:
            bar.close()


def run_serving(opts: ServingOptions, dispatch: str = "llumnix", label: str | None = None) -> dict:
    """One run: start a cluster (unless opts.url), replay, stop. Returns the
    run dict: options, workload, summary, per-request records, samples."""
    label = label or dispatch
    log_dir = opts.log_dir and os.path.join(opts.log_dir, label.replace("+", "p"))
    with contextlib.ExitStack() as stack:  # the cluster stops, then its temporary logs go
        log_dir = log_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="ferry-bench-"))
        cluster = None if opts.url else start_cluster(opts, dispatch, log_dir)
        if cluster:
            stack.callback(cluster.stop)
        url, scheduler = (cluster.url, cluster.scheduler) if cluster else (opts.url.rstrip("/"), opts.scheduler)
        max_len = opts.max_model_len or frontend_max_model_len(url)
        work = opts.workload(opts.scale, max_len)
        if work.clip and work.clip.clipped:
            click.echo(f"[{label}] {work.clip.line()}", err=True)
        samples: list[dict] = []
        t0 = time.perf_counter()
        records = asyncio.run(_drive(url, work, opts, scheduler, samples, label))
        wall = time.perf_counter() - t0
        dead = [c.name for c in cluster.children if not c.alive()] if cluster else []
    summary = metrics.summarize(records, opts.scale)
    summary["wall_s"] = wall
    summary["dead_processes"] = dead
    prog = programs.summary(work.requests, records, 16, opts.scale)  # per-turn hits from usage.cached_tokens
    if prog is not None:
        summary["programs"] = prog
    # NOTE: the sampler may add a sample after the prefix one (it stops a
    # moment later): found by its key, not its place.
    at = [i for i, x in enumerate(samples) if "prefix_cache" in x]
    if at:
        summary["prefix_cache"] = samples.pop(at[-1])["prefix_cache"]
    if samples:
        summary["migrations_ordered"] = samples[-1]["migrations_ordered"] - samples[0]["migrations_ordered"]
    return {"label": label, "dispatch": dispatch, "options": dataclasses.asdict(opts), "time_scale": opts.scale,
            "workload": work.describe(), "summary": summary, "samples": samples,
            "requests": [r.to_dict() for r in records]}


# --- output --------------------------------------------------------------------------

def summary_table(run: dict) -> str:
    s = run["summary"]
    head = (f"{run['label']}: {s['completed']}/{s['requests']} completed, wall {s['wall_s']:.1f}s, "
            f"time scale 1/{run['time_scale']:g}, throughput {fmt(s['throughput_rps'], 2)} req/s, "
            f"{fmt(s['output_tokens_per_s'], 0)} tok/s, send lag p99 {fmt(s['send_lag_ms']['p99'])} ms (wall)")
    cols = (f"{'':8}{'TTFT mean':>11}{'p50':>9}{'p99':>10}{'dec mean':>11}{'p99':>9}{'e2e mean':>11}{'p99':>10}"
            f"{'preempt':>9}{'loss ms':>9}{'migr':>6}")
    lines = [head, cols]
    for name, g in (("all", s), ("high", s["high"]), ("normal", s["normal"])):
        if not g["requests"]:
            continue
        t, d, e = g["ttft_ms"], g["decode_ms"], g["e2e_ms"]
        lines.append(f"{name:8}{fmt(t['mean']):>11}{fmt(t['p50']):>9}{fmt(t['p99']):>10}{fmt(d['mean'], 2):>11}"
                     f"{fmt(d['p99'], 2):>9}{fmt(e['mean']):>11}{fmt(e['p99']):>10}{g['preemptions']:>9}"
                     f"{fmt(g['preemption_loss_ms_mean']):>9}{g['migrations']:>6}")
    lag = s["send_lag_ms"]["p99"]
    if lag is not None and lag > LAG_WARN_MS:
        lines.append(f"WARNING: the client sent requests up to {lag:,.0f} ms late (p99, wall): this machine's CPU "
                     f"is saturated; latencies include client-side delay (raise --sim-slowdown or lower the rate)")
    if s["failed"] or s["short_outputs"]:
        lines.append(f"failed {s['failed']}, short outputs {s['short_outputs']}: {s['errors']}")
    pc = s.get("prefix_cache")
    if pc and pc.get("queries"):
        bound = pc.get("upper_bound") or {}
        lines.append(f"prefix cache: hit rate {fmt(100 * pc['hit_rate'])}% of {pc['queries']:,} prompt tokens"
                     + (f" (upper bound {fmt(100 * bound['hit_rate'])}%)" if bound.get("hit_rate") is not None
                        else "") + f", {pc['evictions']:,} blocks evicted")
    return "\n".join(lines)


# --- the command ---------------------------------------------------------------------

# The workload's flags: `ferry bench serving`, `ferry bench compare` and `ferry sim` take them alike.
WORKLOAD_OPTIONS = (
    click.option("--arrivals", default="poisson:2", show_default=True,
                 help="poisson:RATE | gamma:RATE:CV | phases:RATE@SECONDS,... (Poisson, the rate stepping through the phases, repeated) | trace:PATH (Azure CSV; a name in --traces-dir works)"),
    click.option("--lengths", default="M-M", show_default=True,
                 help="sharegpt | trace | fixed:IN:OUT | IN-OUT of S, M, L (paper Table 1), e.g. M-M"),
    click.option("--prefix", default="none", show_default=True,
                 help="prefix structure: none | system:K:LEN[:ALPHA] (K shared system prompts, Zipf popularity) | "
                      "sessions:TURNS[:THINK_S] (multi-turn conversations) | agentic[:TURNS[:TOOL_S[:SCALE]]] "
                      "(agent programs, -n of them: ferry/measure/prefixes.py) | trace:PATH[:BLOCK] (Mooncake-format "
                      "JSON lines with hash_ids; its arrivals and lengths)"),
    click.option("--num-requests", "-n", type=click.IntRange(1), default=100, show_default=True),
    click.option("--seed", type=int, default=0, show_default=True),
    click.option("--time-scale", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
                 help="divide arrival times by this (2 = twice the rate)"),
    click.option("--high-priority-fraction", type=click.FloatRange(0, 1), default=0.0, show_default=True),
    click.option("--max-model-len", type=click.IntRange(2), default=None,
                 help="clip lengths to this context (default: the frontend's)"),
    click.option("--traces-dir", default=None, help="default: $FERRY_TRACES_DIR or the repository's data/traces"),
)
PROFILE_OPTION = click.option("--profile", default="llama-7b-a10", show_default=True,
                              help="sim profile name or JSON path")
# Flags passed on to the services' own configs.
SERVICE_ARG_OPTIONS = (
    click.option("--instance-arg", "instance_args", multiple=True,
                 help="extra `ferry serve instance` argument (repeatable), e.g. --instance-arg=--max-model-len=8192"),
    click.option("--scheduler-arg", "scheduler_args", multiple=True,
                 help="extra `ferry serve scheduler` argument (repeatable)"),
)


def apply_options(f, opts):
    for o in reversed(opts):
        f = o(f)
    return f


def serving_options(f):
    """The workload and cluster options shared by `serving` and `compare`."""
    return apply_options(f, [
        *WORKLOAD_OPTIONS,
        click.option("--instances", type=click.IntRange(1, 64), default=2, show_default=True),
        click.option("--prefill", type=click.IntRange(0, 64), default=0, show_default=True,
                     help="of the instances, this many prefill only (Splitwise)"),
        click.option("--decode", type=click.IntRange(0, 64), default=0, show_default=True,
                     help="of the instances, this many decode only (the rest are mixed)"),
        click.option("--engine", type=click.Choice(["sim", "fake", "native"]), default="sim", show_default=True),
        PROFILE_OPTION,
        click.option("--sim-slowdown", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
                     help="sim: run K times slower in wall time (below 1: faster, to compress a long run), "
                          "report model time (see module doc)"),
        click.option("--token-delay-ms", type=float, default=None, help="fake engine step time"),
        *SERVICE_ARG_OPTIONS,
        click.option("--pin-cores/--no-pin-cores", default=False, show_default=True,
                     help="pin each instance to its own share of the cores (ferry up --pin-cores)"),
        click.option("--vocab-size", type=int, default=32000, show_default=True,
                     help="native: prompt token ids are drawn from [1000, this)"),
        click.option("--stream/--no-stream", default=True, show_default=True,
                     help="stream tokens (client-side TTFT) or not (frontend-measured TTFT, less CPU)"),
        click.option("--log-dir", default=None, help="keep the cluster's logs here (default: a temp dir)"),
        click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="warning",
                     show_default=True, help="the cluster's log level (info: the services' events, e.g. KunServe's "
                                             "drops and restores with their durations)"),
        click.option("--no-progress", "no_progress", is_flag=True, help="no progress bar"),
        json_option(),
        click.option("--plots", "plots_dir", default=None, help="write PNG plots into this folder"),
    ])


def options_from(kw: dict, **more) -> ServingOptions:
    names = {f.name for f in dataclasses.fields(ServingOptions)}
    vals = {k: v for k, v in kw.items() if k in names}
    vals["instance_args"] = tuple(kw.get("instance_args") or ())
    vals["scheduler_args"] = tuple(kw.get("scheduler_args") or ())
    vals["progress"] = not kw.get("no_progress")
    return ServingOptions(**vals, **more)


@click.command("serving")
@serving_options
@click.option("--dispatch", type=click.Choice(POLICIES), default="llumnix", show_default=True)
@click.option("--url", default=None, help="target this frontend instead of starting a cluster")
@click.option("--scheduler", default=None, help="with --url: scheduler host:port to sample the cluster view")
def serving(dispatch, json_path, plots_dir, **kw) -> None:
    """Serving benchmark: latency (TTFT, decode, end-to-end) of a replayed workload."""
    try:
        run = run_serving(options_from(kw), dispatch)
    except wl.WorkloadError as e:
        raise click.UsageError(str(e)) from e
    report(run, json_path, lambda r: click.echo(summary_table(r)))
    write_plots({run["label"]: run}, plots_dir)


def write_plots(runs: dict[str, dict], plots_dir: str | None) -> None:
    """PNG plots of the runs (by label) into ``plots_dir``, when given."""
    if plots_dir:
        from ferry.measure import plots

        for p in plots.write_all(runs, plots_dir):
            click.echo(f"wrote {p}")
