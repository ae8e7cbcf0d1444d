"""``ferry sim kunserve``: KunServe (ferry/sim/kunserve.py) against the
Llumnix baselines of its paper (§5) on one workload, over seeds:

- ``replication``: Llumnix's dispatch over full replicas, no migration;
- ``migration``: the same with Llumnix's live migration;
- ``pipeline``: static pipeline groups of ``--pipeline-stages`` instances
  from the start (the paper sizes them as KunServe's planner would for one
  throttle), Llumnix's dispatch, no migration;
- ``kunserve``: Llumnix's dispatch, no migration, parameters dropped into
  buddy groups under throttling and restored after.

SLOs as the paper sets them: 5x the P50 TTFT and the P50 TBT (a request's
mean time between tokens) of ``replication`` at a modest load, the same
workload at ``--slo-load`` of its rate, per seed. Prints the spread over
seeds and, per seed, each baseline's P99 TTFT over KunServe's; writes JSON.
The same command writes the same JSON, byte for byte.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict

import click

from ferry.measure import workload as wl
from ferry.machine import write_json
from ferry.sim import stats
from ferry.sim.cli import JOBS_OPTION, options_from, parse_seeds, run_parallel, sim_options
from ferry.sim.kunserve import KunServe, KunServeParams
from ferry.sim.run import simulate

MODES = ("replication", "migration", "pipeline", "kunserve")
SLO_FACTOR = 5.0
# (label, summary key, sub-key, scale to the unit shown)
ROWS = (("TTFT p50 (s)", "ttft_ms", "p50", 1e-3), ("TTFT p99 (s)", "ttft_ms", "p99", 1e-3),
        ("TTFT mean (s)", "ttft_ms", "mean", 1e-3), ("TBT p50 (ms)", "decode_ms", "p50", 1.0),
        ("TBT p99 (ms)", "decode_ms", "p99", 1.0), ("SLO violations (%)", "slo_violation_pct", None, 1.0),
        ("preemptions", "preemptions", None, 1.0), ("migrations", "migrations", None, 1.0),
        ("drops", "drops", None, 1.0), ("merges", "merges", None, 1.0), ("restores", "restores", None, 1.0))


def _opts(kw: dict, seed: int, mode: str, time_factor: float = 1.0):
    args = tuple(kw["scheduler_args"]) + (() if mode == "migration" else ("--no-migration",))
    return options_from({**kw, "scheduler_args": args, "time_scale": kw["time_scale"] * time_factor}, seed)


def slo_of(kw: dict, seed: int, load: float) -> dict:
    """5x the P50 TTFT and P50 TBT of ``replication`` at ``load`` of the rate."""
    s = simulate(_opts(kw, seed, "replication", load), "llumnix", label=f"slo seed {seed}")["summary"]
    return {"ttft_ms": SLO_FACTOR * s["ttft_ms"]["p50"], "tbt_ms": SLO_FACTOR * s["decode_ms"]["p50"],
            "modest_load": load}


def violation_pct(requests: list[dict], slo: dict) -> float:
    bad = 0
    ok = [r for r in requests if r["error"] is None]
    for r in ok:
        if r["ttft_s"] * 1000 > slo["ttft_ms"] or (r["decode_s"] is not None and r["decode_s"] * 1000 > slo["tbt_ms"]):
            bad += 1
    return 100.0 * bad / max(1, len(ok))


def run_mode(kw: dict, seed: int, mode: str, params: KunServeParams, stages: int, slo: dict) -> dict:
    extend = None
    if mode == "kunserve":
        extend = lambda c: KunServe(c, params)
    elif mode == "pipeline":
        extend = lambda c: KunServe(c, KunServeParams(**{**asdict(params), "static_group_size": stages}))
    run = simulate(_opts(kw, seed, mode), "llumnix", label=f"{mode} seed {seed}", extend=extend)
    summary = run["summary"]
    ext = run["sim"].get("extension") or {}
    summary["slo_violation_pct"] = violation_pct(run["requests"], slo)
    summary["drops"] = ext.get("drops", 0)
    summary["merges"] = ext.get("merges", 0)
    summary["restores"] = ext.get("restores", 0)
    timeline = [(r["sent_at"], r["ttft_s"], r["decode_s"]) for r in run["requests"] if r["error"] is None]
    return {"summary": summary, "extension": ext, "model_s": run["sim"]["model_s"], "_wall_s": run["_wall_s"],
            "workload": run["workload"], "options": run["options"], "timeline": timeline}


def plot_timeline(timelines: dict[str, list], slo: dict, path: str) -> None:
    """TTFT and TBT of every request against its arrival, one series per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for m, tl in timelines.items():
        t0 = min(x[0] for x in tl)
        a.scatter([x[0] - t0 for x in tl], [x[1] for x in tl], s=2, label=m)
        b.scatter([x[0] - t0 for x in tl if x[2] is not None], [1000 * x[2] for x in tl if x[2] is not None], s=2,
                  label=m)
    a.axhline(slo["ttft_ms"] / 1000, color="k", lw=0.8, ls="--", label="TTFT SLO")
    b.axhline(slo["tbt_ms"], color="k", lw=0.8, ls="--", label="TBT SLO")
    a.set_yscale("log")
    a.set_ylabel("TTFT (s)")
    b.set_ylabel("TBT (ms)")
    b.set_xlabel("arrival (s of model time)")
    a.legend(fontsize=7, markerscale=4)
    a.set_title("per request, first seed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _value(summary: dict, key: str, sub: str | None, scale: float):
    v = stats.metric(summary, key, sub)
    return None if v is None else v * scale


def table(per_seed: dict[str, list[dict]]) -> str:
    rows = [(label, lambda m, key=key, sub=sub, scale=scale: [_value(s, key, sub, scale) for s in per_seed[m]])
            for label, key, sub, scale in ROWS]
    return stats.spread_markdown("metric", list(per_seed), rows, digits=2)


def ratios(per_seed: dict[str, list[dict]]) -> dict:
    """Per seed: each baseline's P99 TTFT over KunServe's (x times lower
    with KunServe), and KunServe's P50 TBT over each baseline's."""
    out = {}
    if "kunserve" not in per_seed:
        return out
    ks = per_seed["kunserve"]
    for m, sums in per_seed.items():
        if m == "kunserve":
            continue
        ttft = [b["ttft_ms"]["p99"] / k["ttft_ms"]["p99"] for b, k in zip(sums, ks)]
        tbt = [k["decode_ms"]["p50"] / b["decode_ms"]["p50"] for b, k in zip(sums, ks)]
        out[m] = {"p99_ttft_over_kunserve": {"per_seed": ttft, **stats.spread(ttft)},
                  "kunserve_p50_tbt_over": {"per_seed": tbt, **stats.spread(tbt)}}
    return out


def ratio_table(r: dict) -> str:
    lines = ["| baseline | its P99 TTFT / KunServe's | KunServe's P50 TBT / its |", "|---|---|---|"]
    for m, v in r.items():
        a, b = v["p99_ttft_over_kunserve"], v["kunserve_p50_tbt_over"]
        lines.append(f"| {m} | {a['median']:.2f}x [{a['p10']:.2f}-{a['p90']:.2f}] | "
                     f"{b['median']:.2f}x [{b['p10']:.2f}-{b['p90']:.2f}] |")
    return "\n".join(lines)


@click.command("kunserve")
@sim_options
@click.option("--modes", default=",".join(MODES), show_default=True, help=f"comma-separated, of {', '.join(MODES)}")
@click.option("--pipeline-stages", type=click.IntRange(min=2), default=2, show_default=True,
              help="instances per group of the static pipeline baseline")
@click.option("--slo-load", type=click.FloatRange(min=0, min_open=True, max=1), default=0.5, show_default=True,
              help="the modest load the SLOs come from: this fraction of the workload's rate")
@click.option("--interval-s", type=float, default=KunServeParams.interval_s, show_default=True,
              help="KunServe's monitor period")
@click.option("--horizon-s", type=float, default=KunServeParams.horizon_s, show_default=True,
              help="drop when throttling is predicted within this long")
@click.option("--hop-ms-stage", "stage_hop_ms", type=float, default=KunServeParams.hop_ms, show_default=True,
              help="model: a micro-batch's activations from one pipeline stage to the next")
@click.option("--pipeline-overhead", type=float, default=KunServeParams.pipeline_overhead, show_default=True,
              help="model: step time x (1 + this) in a pipeline group")
@click.option("--remote-attention-overhead", type=float, default=KunServeParams.remote_attention_overhead,
              show_default=True, help="model: step time x (1 + this) while the KV exchange runs")
@click.option("--restore-margin", type=float, default=KunServeParams.restore_margin, show_default=True,
              help="restore once each member's requirement fits (1 - this) of its own memory")
@click.option("--min-group-s", type=float, default=KunServeParams.min_group_s, show_default=True,
              help="a group lasts at least this long")
@click.option("--reload-gbps", type=float, default=KunServeParams.reload_gbps, show_default=True,
              help="model: link the dropped parameters and the remote KV come back over")
@click.option("--max-group-size", type=click.IntRange(min=2), default=None)
@JOBS_OPTION
def kunserve(modes, pipeline_stages, slo_load, interval_s, horizon_s, stage_hop_ms, pipeline_overhead,
             remote_attention_overhead,
             restore_margin, min_group_s, reload_gbps, max_group_size, jobs, seed, seeds, json_path, plots_dir,
             no_records, **kw) -> None:
    """KunServe vs Llumnix (replication, migration, static pipeline), simulated, over seeds."""
    names = [m.strip() for m in modes.split(",") if m.strip()]
    bad = [m for m in names if m not in MODES]
    if bad or not names:
        raise click.UsageError(f"unknown modes {bad}; known: {', '.join(MODES)}")
    params = KunServeParams(interval_s=interval_s, horizon_s=horizon_s, hop_ms=stage_hop_ms,
                            pipeline_overhead=pipeline_overhead,
                            remote_attention_overhead=remote_attention_overhead, restore_margin=restore_margin,
                            min_group_s=min_group_s, reload_gbps=reload_gbps, max_group_size=max_group_size)
    try:
        params.validate()
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    seed_list = parse_seeds(seeds) if seeds else [seed]
    kw = {**kw, "no_progress": True}
    t0 = time.perf_counter()
    try:
        slos = list(run_parallel(slo_of, [(kw, s, slo_load) for s in seed_list], jobs))
        tasks = [(kw, s, m, params, pipeline_stages, slo) for s, slo in zip(seed_list, slos) for m in names]
        per_seed: dict[str, list[dict]] = {m: [] for m in names}
        extensions: dict[str, list[dict]] = {m: [] for m in names}
        timelines, first = {}, None
        for (_, s, m, *_), run in zip(tasks, run_parallel(run_mode, tasks, jobs)):
            first = first or run
            if s == seed_list[0]:
                timelines[m] = run["timeline"]
            click.echo(f"[{m} seed {s}] {run['summary']['completed']}/{run['summary']['requests']} in "
                       f"{run['_wall_s']:.1f} s wall, {run['model_s']:.0f} s simulated", err=True)
            per_seed[m].append(run["summary"])
            ext = dict(run["extension"])
            if s != seed_list[0]:
                ext.pop("log", None)
            extensions[m].append(ext)
    except wl.WorkloadError as e:
        raise click.UsageError(str(e)) from e
    w, o = first["workload"], first["options"]
    result = {"command": " ".join(sys.argv), "mode": "des", "workload": w, "options": o,
              "params": asdict(params), "pipeline_stages": pipeline_stages, "seeds": seed_list, "slo": slos,
              "per_seed": per_seed, "extensions": extensions, "ratios": ratios(per_seed)}
    click.echo(f"workload: {w['arrivals']} {w['lengths']} n={w['num_requests']}, {o['instances']} instances of "
               f"{o['profile']}, seeds {seed_list}; SLO (seed {seed_list[0]}): TTFT {slos[0]['ttft_ms'] / 1000:.2f} s, "
               f"TBT {slos[0]['tbt_ms']:.1f} ms; median [p10-p90] over seeds")
    click.echo(table(per_seed))
    if result["ratios"]:
        click.echo(ratio_table(result["ratios"]))
    click.echo(f"{len(tasks) + len(seed_list)} runs in {time.perf_counter() - t0:.1f} s wall", err=True)
    if json_path:
        write_json(json_path, result)
        click.echo(f"wrote {json_path}")
    if plots_dir:
        import os

        os.makedirs(plots_dir, exist_ok=True)
        path = os.path.join(plots_dir, "kunserve_timeline.png")
        plot_timeline(timelines, slos[0], path)
        click.echo(f"wrote {path}")
