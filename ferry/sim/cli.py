"""``ferry sim``: the discrete-event simulator's commands.

``ferry sim compare`` takes the workload and cluster flags of ``ferry bench
compare`` (``--instance-arg`` / ``--scheduler-arg`` are parsed by the live
services' configs) and prints the same table and writes the same JSON and
plots, from one process on a virtual clock. ``--seeds 0-9`` runs every
policy on every seed and adds the spread over seeds and the per-seed P99 TTFT
ratios of every pair of policies. The same command gives the same JSON, byte
for byte (wall-clock figures go to stderr only).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import click

from ferry.measure import workload as wl
from ferry.bench.compare import compare_table
from ferry.bench.serving import (
    POLICIES,
    PROFILE_OPTION,
    SERVICE_ARG_OPTIONS,
    WORKLOAD_OPTIONS,
    apply_options,
)
from ferry.cli import LazyGroup
from ferry.machine import write_json
from ferry.sim import stats
from ferry.sim.params import Delays
from ferry.sim.run import SimOptions, simulate
from libs.common.policies.phases import DEFAULT_PER_LAYER_THRESHOLD


def parse_seeds(spec: str) -> list[int]:
    """"0-9" | "0,2,5" | "3" -> seeds, in order, each once."""
    out: list[int] = []
    try:
        for part in spec.split(","):
            part = part.strip()
            if "-" in part:
                a, b = part.split("-")
                out += range(int(a), int(b) + 1)
            elif part:
                out.append(int(part))
    except ValueError:
        raise click.BadParameter(f"seeds: use 0-9, 1,4,7 or 3; got {spec!r}") from None
    if not out:
        raise click.BadParameter("no seeds")
    return list(dict.fromkeys(out))


def sim_options(f):
    """Workload and cluster flags (those of `ferry bench compare` that a
    simulated sim cluster has), then the simulator's model parameters."""
    d = Delays()
    opts = [
        *WORKLOAD_OPTIONS,
        click.option("--seeds", default=None, help="several seeds, e.g. 0-9 or 0,3,5 (overrides --seed)"),
        click.option("--instances", type=click.IntRange(1), default=2, show_default=True),
        PROFILE_OPTION,
        click.option("--pool", "pools", multiple=True,
                     help="ROLE:PROFILE:COUNT (repeatable), e.g. --pool prefill:llama2-70b-h100:2 "
                          "--pool decode:llama2-70b-a100:3; replaces --instances/--profile (Splitwise)"),
        click.option("--per-layer-threshold", type=click.IntRange(0), default=DEFAULT_PER_LAYER_THRESHOLD,
                     show_default=True,
                     help="prefill->decode handoff layer by layer from this many prompt tokens (0: always serialized)"),
        click.option("--sim-slowdown", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
                     help="model a live run at this --sim-slowdown: its wall-time intervals and delays become "
                          "model time / K"),
        *SERVICE_ARG_OPTIONS,
        click.option("--dispatch-ms", type=float, default=d.dispatch_s * 1e3, show_default=True,
                     help="model: request at the frontend -> the scheduler's pick"),
        click.option("--generate-ms", type=float, default=d.generate_s * 1e3, show_default=True,
                     help="model: the scheduler's pick -> queued at the instance"),
        click.option("--token-ms", type=float, default=d.token_s * 1e3, show_default=True,
                     help="model: a step's token -> the frontend"),
        click.option("--report-lag-ms", type=float, default=d.report_s * 1e3, show_default=True,
                     help="model: a status report -> the scheduler's view"),
        click.option("--rpc-ms", type=float, default=d.rpc_s * 1e3, show_default=True,
                     help="model: one gRPC round trip (migration handshakes, migrate-out orders)"),
        click.option("--hop-ms", type=float, default=d.hop_s * 1e3, show_default=True,
                     help="model: engine thread -> agent event loop after a call between steps"),
        click.option("--launch-s", type=float, default=d.launch_s, show_default=True,
                     help="model: auto-scaling launch -> the instance serves"),
        click.option("--kv-bytes-per-token", type=click.IntRange(1), default=None,
                     help="model: KV bytes per token for migration transfers (default: the profile's)"),
        click.option("--migration-bandwidth-gbps", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="model: migration link bandwidth (default: the profile's)"),
        click.option("--capacity-bound", is_flag=True,
                     help="also the programs' floor: their metrics with one cache of the cluster's every KV block "
                          "and the optimal eviction (summary.programs_floor; slower)"),
        click.option("--no-progress", "no_progress", is_flag=True, help="no progress bar"),
        click.option("--no-records", "no_records", is_flag=True, help="leave per-request records out of the JSON"),
        click.option("--json", "json_path", default=None, help="write results here"),
        click.option("--plots", "plots_dir", default=None, help="write PNG plots into this folder (first seed)"),
    ]
    return apply_options(f, opts)


JOBS_OPTION = click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True,
                           help="simulations run at once, in worker processes (the JSON does not change)")


def options_from(kw: dict, seed: int) -> SimOptions:
    delays = Delays(dispatch_s=kw["dispatch_ms"] / 1e3, generate_s=kw["generate_ms"] / 1e3,
                    token_s=kw["token_ms"] / 1e3, report_s=kw["report_lag_ms"] / 1e3, rpc_s=kw["rpc_ms"] / 1e3,
                    hop_s=kw["hop_ms"] / 1e3, launch_s=kw["launch_s"])
    return SimOptions(
        arrivals=kw["arrivals"], lengths=kw["lengths"], prefix=kw.get("prefix", "none"),
        num_requests=kw["num_requests"], seed=seed,
        time_scale=kw["time_scale"], high_priority_fraction=kw["high_priority_fraction"],
        max_model_len=kw["max_model_len"], traces_dir=kw["traces_dir"], instances=kw["instances"],
        profile=kw["profile"], sim_slowdown=kw["sim_slowdown"], instance_args=tuple(kw["instance_args"]),
        scheduler_args=tuple(kw["scheduler_args"]), delays=delays, kv_bytes_per_token=kw["kv_bytes_per_token"],
        migration_bandwidth_gbps=kw["migration_bandwidth_gbps"], progress=not kw["no_progress"],
        pools=tuple(kw["pools"]), per_layer_threshold=kw["per_layer_threshold"],
        capacity_bound=kw.get("capacity_bound", False))


def _simulate_one(kw: dict, seed: int, name: str, keep: bool) -> dict:
    """One run (in a worker process when ``--jobs`` > 1); a run whose records
    are not kept comes back as its summary and timing only."""
    run = simulate(options_from(kw, seed), name)
    if not keep:
        run = {"summary": run["summary"], "sim": run["sim"], "_wall_s": run["_wall_s"]}
    return run


def run_parallel(fn: Callable, tasks: list[tuple], jobs: int):
    """fn(*task) for each task, in order. With ``jobs`` > 1 they run in that
    many forked processes; each simulation is a pure function of its
    arguments, so the results do not depend on ``jobs``."""
    if jobs <= 1:
        for t in tasks:
            yield fn(*t)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = [pool.submit(fn, *t) for t in tasks]
        for f in futures:
            yield f.result()


def run_compare(kw: dict, names: list[str], seeds: list[int], records: bool = True, jobs: int = 1) -> dict:
    """Every policy on every seed; the `ferry bench compare` JSON of the first
    seed plus ``seeds``, ``per_seed``, ``over_seeds`` and ``p99_ttft_ratios``.
    ``jobs``: run that many simulations at once, in worker processes."""
    per_seed: dict[str, list[dict]] = {n: [] for n in names}
    runs: dict[str, dict] = {}
    if jobs > 1:
        kw = {**kw, "no_progress": True}  # one bar per worker would interleave
    tasks = [(kw, seed, name, seed == seeds[0]) for seed in seeds for name in names]
    results = run_parallel(_simulate_one, tasks, jobs)
    for _, seed, name, _ in tasks:
        try:
            run = next(results)
        except wl.WorkloadError as e:
            raise click.UsageError(str(e)) from e
        wall = run.pop("_wall_s")
        click.echo(f"[{name} seed {seed}] {run['summary']['completed']}/{run['summary']['requests']} in "
                   f"{wall:.1f} s wall, {run['sim']['model_s']:.0f} s simulated "
                   f"({run['sim']['model_s'] / wall:.3g} sim-s per wall-s)", err=True)
        per_seed[name].append(run["summary"])
        if seed == seeds[0]:
            if not records:
                run["requests"] = []
            runs[name] = run
    first = next(iter(runs.values()))
    return {"command": " ".join(sys.argv), "mode": "des", "workload": first["workload"],
            "time_scale": first["time_scale"], "options": first["options"],
            "policies": {n: r["summary"] for n, r in runs.items()}, "runs": runs, "seeds": seeds,
            "per_seed": per_seed, "over_seeds": stats.over_seeds(per_seed),
            "p99_ttft_ratios": stats.ratios(per_seed)}


def print_compare(result: dict) -> None:
    w, o = result["workload"], result["options"]
    click.echo(f"workload: {w['arrivals']} {w['lengths']} n={w['num_requests']} seeds={result['seeds']}; "
               f"{o['instances']} simulated sim instances ({o['profile']}); latencies in ms of model time")
    click.echo(f"seed {result['seeds'][0]}:")
    click.echo(compare_table(result["policies"]))
    from ferry.measure import programs

    if programs.table(result["policies"]):
        click.echo(programs.table(result["policies"]))
    if len(result["seeds"]) > 1:
        with_high = any("high" in s for s in result["over_seeds"].values())
        for group in ("all", "high", "normal") if with_high else ("all",):
            click.echo(stats.spread_table(result["over_seeds"], group))
        click.echo(stats.ratio_table(result["p99_ttft_ratios"], list(result["policies"])))


@click.group(cls=LazyGroup, lazy={"autoscale": "ferry.sim.autoscale_cli:autoscale",
                                  "calibrate": "ferry.sim.calibrate:calibrate",
                                  "crosscheck": "ferry.sim.crosscheck:crosscheck",
                                  "grid": "ferry.sim.grid:grid",
                                  "kunserve": "ferry.sim.kunserve_cli:kunserve",
                                  "queueing": "ferry.sim.queueing_cli:queueing",
                                  "splitwise": "ferry.sim.splitwise_cli:splitwise",
                                  "sweep-stats": "ferry.sim.sweep_stats:sweep_stats_cmd"})
def sim() -> None:
    """Discrete-event simulation of a sim cluster: Ferry's own policies and engine core on a virtual clock."""


@sim.command("compare")
@sim_options
@click.option("--policies", default=",".join(POLICIES), show_default=True, help="comma-separated dispatch policies")
@JOBS_OPTION
def compare(policies, seed, seeds, json_path, plots_dir, no_records, jobs, **kw) -> None:
    """Compare dispatch policies on one workload over one or more seeds (simulated)."""
    names = [p.strip() for p in policies.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise click.UsageError(f"unknown policies {bad}; known: {', '.join(POLICIES)}")
    seed_list = parse_seeds(seeds) if seeds else [seed]
    t0 = time.perf_counter()
    result = run_compare({**kw, "no_records": no_records}, names, seed_list, records=not no_records, jobs=jobs)
    print_compare(result)
    click.echo(f"{len(names) * len(seed_list)} runs in {time.perf_counter() - t0:.1f} s wall", err=True)
    if json_path:
        write_json(json_path, result)
        click.echo(f"wrote {json_path}")
    if plots_dir:
        from ferry.measure import plots

        for p in plots.write_all(result["runs"], plots_dir):
            click.echo(f"wrote {p}")
