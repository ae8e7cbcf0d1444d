"""``ferry sim autoscale``: the paper's auto-scaling experiment (§6.5) in the
simulator. For each arrival process, the same workload runs

- on fixed fleets of N instances (``--fleets``), and
- auto-scaled (the scheduler's autoscaler, ``decide``) from ``--initial``
  instances up to ``--max-instances``, for each pair of thresholds
  (``--thresholds x:y``: scale out below mean freeness x, in above y);

each over the seeds. Cost is instance-seconds from the first request to the
last finish (an auto-scaled instance counts from its launch). Saving at the
same P99 TTFT: against the smallest fixed fleet whose P99 TTFT (median over
seeds) is no worse than the auto-scaled run's, and against the fixed-fleet
curve interpolated (in log P99) at that P99.
"""

from __future__ import annotations

import itertools
import math
import sys

import click

from ferry.machine import write_json
from ferry.sim import stats
from ferry.sim.cli import options_from as sim_options_from
from ferry.sim.cli import parse_seeds, sim_options
from ferry.sim.run import simulate


def _run(kw: dict, seeds: list[int], instances: int, extra: list[str], policy: str) -> dict:
    per = []
    for seed in seeds:
        opts = sim_options_from({**kw, "instances": instances,
                                 "scheduler_args": tuple(kw["scheduler_args"]) + tuple(extra)}, seed)
        r = simulate(opts, policy)
        per.append({"p99_ttft_s": r["summary"]["ttft_ms"]["p99"] / 1000, "mean_ttft_s": r["summary"]["ttft_ms"]["mean"]
                    / 1000, "p99_decode_ms": r["summary"]["decode_ms"]["p99"],
                    "instance_seconds": r["sim"]["instance_seconds"], "duration_s": r["summary"]["duration_s"],
                    "scale_events": len(r["sim"].get("scale_events", []))})
    out = {k: stats.spread([p[k] for p in per]) for k in per[0]}
    out["per_seed"] = per
    return out


def match(auto_p99: float, fixed: list[tuple[int, float, float]]) -> dict:
    """fixed: (N, median instance-seconds, median P99 TTFT) by N. The smallest
    fleet no worse than ``auto_p99``, and the fleet curve interpolated there."""
    ok = [f for f in fixed if f[2] <= auto_p99]
    out = {"fleet": ok[0][0] if ok else None, "fleet_instance_seconds": ok[0][1] if ok else None,
           "interpolated_instance_seconds": None}
    for (n0, i0, p0), (n1, i1, p1) in itertools.pairwise(fixed):
        if p1 <= auto_p99 <= p0 and p0 > 0 and p1 > 0:
            w = 0.0 if p0 == p1 else (math.log(p0) - math.log(auto_p99)) / (math.log(p0) - math.log(p1))
            out["interpolated_instance_seconds"] = i0 + w * (i1 - i0)
            break
    return out


@click.command("autoscale")
@sim_options
@click.option("--arrival", "arrival_list", multiple=True, required=True,
              help="an arrival process to test, e.g. poisson:12 or gamma:12:3 (repeatable)")
@click.option("--fleets", default="6,8,10,12,14,16", show_default=True, help="fixed fleet sizes")
@click.option("--thresholds", default="10:60,20:80,30:120", show_default=True,
              help="auto-scaling thresholds x:y (scale out below x, in above y), comma-separated")
@click.option("--initial", type=click.IntRange(1), default=4, show_default=True,
              help="auto-scaled runs: the initial fleet (never scaled in, as on a live cluster)")
@click.option("--max-instances", type=click.IntRange(1), default=16, show_default=True)
@click.option("--policy", default="llumnix", show_default=True)
def autoscale(arrival_list, fleets, thresholds, initial, max_instances, policy, seed, seeds, json_path, plots_dir,
              no_records, **kw) -> None:
    """Auto-scaling vs fixed fleets: instance-seconds at the same P99 TTFT (simulated)."""
    seed_list = parse_seeds(seeds) if seeds else [seed]
    sizes = [int(x) for x in fleets.split(",")]
    pairs = [tuple(float(v) for v in t.split(":")) for t in thresholds.split(",")]
    result = {"command": " ".join(sys.argv), "policy": policy, "seeds": seed_list, "lengths": kw["lengths"],
              "num_requests": kw["num_requests"], "launch_s": kw["launch_s"], "initial": initial,
              "max_instances": max_instances, "arrivals": {}}
    for arrivals in arrival_list:
        kwa = {**kw, "arrivals": arrivals}
        fixed = {n: _run(kwa, seed_list, n, [], policy) for n in sizes}
        curve = [(n, f["instance_seconds"]["median"], f["p99_ttft_s"]["median"]) for n, f in fixed.items()]
        auto = {}
        for x, y in pairs:
            extra = ["--autoscale", "--scale-out-below", f"{x:g}", "--scale-in-above", f"{y:g}",
                     "--min-instances", str(initial), "--max-instances", str(max_instances)]
            a = _run(kwa, seed_list, initial, extra, policy)
            m = match(a["p99_ttft_s"]["median"], curve)
            inst = a["instance_seconds"]["median"]
            m["saving_vs_fleet"] = 1 - inst / m["fleet_instance_seconds"] if m["fleet_instance_seconds"] else None
            m["saving_interpolated"] = (1 - inst / m["interpolated_instance_seconds"]
                                        if m["interpolated_instance_seconds"] else None)
            auto[f"{x:g}:{y:g}"] = {**a, "match": m}
        result["arrivals"][arrivals] = {"fixed": fixed, "autoscaled": auto}
        click.echo(table(arrivals, fixed, auto))
    if json_path:
        write_json(json_path, result)
        click.echo(f"wrote {json_path}")


def _f(v, d=1):
    return "-" if v is None else f"{v:,.{d}f}"


def table(arrivals: str, fixed: dict, auto: dict) -> str:
    head = (f"  {'run':16}{'inst-s':>10}{'mean inst':>10}{'P99 TTFT s':>12}{'mean TTFT s':>12}{'P99 dec ms':>11}"
            f"{'same-P99 fleet':>16}{'saved':>8}{'saved (interp)':>16}")
    lines = [f"{arrivals}: median over seeds", head]
    for n, f in fixed.items():
        i, dur = f["instance_seconds"]["median"], f["duration_s"]["median"]
        lines.append(f"  {'fixed ' + str(n):16}{_f(i, 0):>10}{_f(i / dur if dur else None):>10}"
                     f"{_f(f['p99_ttft_s']['median'], 2):>12}{_f(f['mean_ttft_s']['median'], 2):>12}"
                     f"{_f(f['p99_decode_ms']['median']):>11}")
    for name, a in auto.items():
        i, dur, m = a["instance_seconds"]["median"], a["duration_s"]["median"], a["match"]
        pct = (lambda v: "-" if v is None else f"{v:.0%}")
        lines.append(f"  {'auto ' + name:16}{_f(i, 0):>10}{_f(i / dur if dur else None):>10}"
                     f"{_f(a['p99_ttft_s']['median'], 2):>12}{_f(a['mean_ttft_s']['median'], 2):>12}"
                     f"{_f(a['p99_decode_ms']['median']):>11}{m['fleet'] or '-'!s:>16}"
                     f"{pct(m['saving_vs_fleet']):>8}{pct(m['saving_interpolated']):>16}")
    return "\n".join(lines)
