"""``ferry sim queueing``: where each policy's queueing goes (ferry/sim/queueing.py),
over seeds: the shares of ``local``, ``fragmented`` and ``short`` waiting in all
requests and in the P99 tail, and the P99 TTFT a perfect de-fragmenter could
at best reach from each run (its ``fragmented`` waits removed). With
``--baseline``: per seed, the baseline's P99 TTFT over each policy's P99 TTFT
and over that bound. Writes JSON; the same command writes the same JSON.
"""

from __future__ import annotations

import sys
import time

import click

from libs.common.policies import POLICY_NAMES as POLICIES
from ferry.machine import write_json
from ferry.sim import stats
from ferry.sim.cli import JOBS_OPTION, options_from, parse_seeds, run_parallel, sim_options
from ferry.sim.queueing import CAUSES, QueueProbe, breakdown
from ferry.sim.run import simulate

# (label, path into a seed's row, scale)
ROWS = (("P99 TTFT (s)", ("ttft_p99_ms",), 1e-3),
        ("P99 TTFT, fragmented waits removed (s)", ("ttft_p99_without_fragmented_ms",), 1e-3),
        ("mean queueing per request (s)", ("queueing_s_mean",), 1.0),
        *((f"all queueing: {c} (%)", ("share_all", c), 100.0) for c in CAUSES),
        *((f"P99 tail's queueing: {c} (%)", ("share_tail", c), 100.0) for c in CAUSES),
        ("time with a short request (s)", ("short_time_s",), 1.0),
        ("time with a fragmented request (s)", ("fragmented_time_s",), 1.0),
        ("preemptions while a request was short (%)", ("preemptions_while_short",), 100.0),
        ("preemption loss, mean (ms)", ("preemption_loss_ms_mean",), 1.0))


def run_one(kw: dict, seed: int, policy: str, interval_s: float) -> dict:
    run = simulate(options_from(kw, seed), policy, extend=lambda c: QueueProbe(c, interval_s))
    row = breakdown(run["sim"]["extension"], run["requests"])
    row["preemption_loss_ms_mean"] = run["summary"].get("preemption_loss_ms_mean")
    return {"row": row, "summary": run["summary"], "_wall_s": run["_wall_s"], "workload": run["workload"],
            "options": run["options"]}


def _get(row: dict, path: tuple):
    for p in path:
        row = row.get(p) if isinstance(row, dict) else None
    return row


def table(per_seed: dict[str, list[dict]]) -> str:
    rows = [(label, lambda n, path=path, scale=scale: [None if _get(r, path) is None else _get(r, path) * scale
                                                       for r in per_seed[n]])
            for label, path, scale in ROWS]
    return stats.spread_markdown("median [p10-p90] over seeds", list(per_seed), rows, digits=1)


def ratios(per_seed: dict[str, list[dict]], baseline: str) -> dict:
    """Per seed, the baseline's P99 TTFT over each policy's, and over its bound."""
    out = {}
    base = per_seed[baseline]
    for n, rows in per_seed.items():
        if n == baseline:
            continue
        got = [b["ttft_p99_ms"] / r["ttft_p99_ms"] for b, r in zip(base, rows)]
        best = [b["ttft_p99_ms"] / r["ttft_p99_without_fragmented_ms"] for b, r in zip(base, rows)]
        out[n] = {"measured": {"per_seed": got, **stats.spread(got)},
                  "bound": {"per_seed": best, **stats.spread(best)}}
    return out


def ratio_table(r: dict, baseline: str) -> str:
    lines = [f"| policy | {baseline} P99 TTFT / its P99 TTFT | / its P99 TTFT with fragmented waits removed |",
             "|---|---|---|"]
    for n, v in r.items():
        a, b = v["measured"], v["bound"]
        lines.append(f"| {n} | {a['median']:.2f}x [{a['p10']:.2f}-{a['p90']:.2f}] | "
                     f"{b['median']:.2f}x [{b['p10']:.2f}-{b['p90']:.2f}] |")
    return "\n".join(lines)


@click.command("queueing")
@sim_options
@click.option("--policies", default="infaas++,llumnix_base", show_default=True, help="comma-separated")
@click.option("--baseline", default="infaas++", show_default=True, help="ratios against this policy")
@click.option("--interval-s", type=click.FloatRange(min=0, min_open=True), default=0.02, show_default=True,
              help="the probe's period (model time)")
@JOBS_OPTION
def queueing(policies, baseline, interval_s, jobs, seed, seeds, json_path, plots_dir, no_records, **kw) -> None:
    """Where each policy's queueing goes: local, fragmented (a perfect de-fragmenter could
    remove it) or short (the cluster has not the memory), over seeds (simulated)."""
    names = [p.strip() for p in policies.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise click.UsageError(f"unknown policies {bad}; known: {', '.join(POLICIES)}")
    if baseline not in names:
        raise click.UsageError(f"--baseline {baseline!r} is not among --policies")
    seed_list = parse_seeds(seeds) if seeds else [seed]
    kw = {**kw, "no_progress": True}
    t0 = time.perf_counter()
    tasks = [(kw, s, n, interval_s) for s in seed_list for n in names]
    per_seed: dict[str, list[dict]] = {n: [] for n in names}
    first = None
    for (_, s, n, _), res in zip(tasks, run_parallel(run_one, tasks, jobs)):
        click.echo(f"[{n} seed {s}] {res['_wall_s']:.1f} s wall", err=True)
        per_seed[n].append(res["row"])
        first = first or res
    r = ratios(per_seed, baseline)
    click.echo(f"workload: {first['workload']['arrivals']} {first['workload']['lengths']} "
               f"n={first['workload']['num_requests']} seeds={seed_list}; {kw['instances']} instances "
               f"({kw['profile']})")
    click.echo(table(per_seed))
    click.echo(ratio_table(r, baseline))
    click.echo(f"{len(tasks)} runs in {time.perf_counter() - t0:.1f} s wall", err=True)
    if json_path:
        write_json(json_path, {"command": " ".join(sys.argv), "workload": first["workload"],
                               "options": first["options"], "interval_s": interval_s, "seeds": seed_list,
                               "per_seed": per_seed, "ratios": r})
        click.echo(f"wrote {json_path}")
