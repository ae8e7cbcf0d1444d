"""``ferry sim crosscheck LIVE.json``: replay the workload of a live ``ferry
bench compare --engine sim`` run in the simulator (same options, same seed,
and optionally more seeds) and set the two side by side: per policy and
metric the live value, the simulated one, their difference against the
tolerance (10% for latencies, 20% for preemption and migration counts), and
where the live value falls among the simulated seeds.

The live sim engine's KV holds token ids (8 bytes per token over loopback
gRPC), so migrations are simulated with that transfer, not the profile's
modelled one.
"""

from __future__ import annotations

import sys

import click

from ferry.machine import write_json
from ferry.sim import stats
from ferry.sim.cli import parse_seeds
from ferry.sim.params import Delays
from ferry.sim.run import SimOptions, simulate

LIVE_SIM_KV_BYTES_PER_TOKEN = 8
# (label, key, sub-key, tolerance)
CHECKS = (("TTFT mean", "ttft_ms", "mean", 0.10), ("TTFT p50", "ttft_ms", "p50", 0.10),
          ("decode mean", "decode_ms", "mean", 0.10), ("decode p50", "decode_ms", "p50", 0.10),
          ("e2e mean", "e2e_ms", "mean", 0.10), ("e2e p50", "e2e_ms", "p50", 0.10),
          ("TTFT p99", "ttft_ms", "p99", None), ("decode p99", "decode_ms", "p99", None),
          ("preemptions", "preemptions", None, 0.20), ("migrations", "migrations", None, 0.20),
          ("prefix hit rate", "prefix_cache", "hit_rate", 0.05))


def sim_options_for(live_options: dict, seed: int, delays: Delays | None = None) -> SimOptions:
    o = live_options
    if o.get("engine", "sim") != "sim":
        raise click.UsageError("only runs of sim instances can be simulated")
    return SimOptions(arrivals=o["arrivals"], lengths=o["lengths"], prefix=o.get("prefix", "none"),
                      num_requests=o["num_requests"], seed=seed,
                      time_scale=o["time_scale"], high_priority_fraction=o["high_priority_fraction"],
                      max_model_len=o["max_model_len"], traces_dir=o["traces_dir"], instances=o["instances"],
                      profile=o["profile"], sim_slowdown=o["sim_slowdown"],
                      instance_args=tuple(o["instance_args"]), scheduler_args=tuple(o["scheduler_args"]),
                      delays=delays or Delays(), kv_bytes_per_token=LIVE_SIM_KV_BYTES_PER_TOKEN, progress=False)


def rank(value: float | None, samples: list[float | None]) -> float | None:
    """Fraction of the samples below ``value`` (ties count half)."""
    xs = [x for x in samples if x is not None]
    if value is None or not xs:
        return None
    return (sum(x < value for x in xs) + 0.5 * sum(x == value for x in xs)) / len(xs)


def compare(live: dict, des: dict, des_seeds: list[dict]) -> list[dict]:
    """One row per metric: live, simulated (same seed), relative difference,
    within tolerance, and the simulated seeds' spread and the live rank."""
    rows = []
    for label, key, sub, tol in CHECKS:
        lv, dv = stats.metric(live, key, sub), stats.metric(des, key, sub)
        diff = None
        if lv is not None and dv is not None:
            diff = (dv - lv) / lv if lv else (0.0 if dv == lv else float("inf"))
        seeds = [stats.metric(s, key, sub) for s in des_seeds]
        rows.append({"metric": label, "live": lv, "sim": dv, "diff": diff, "tolerance": tol,
                     "ok": None if tol is None or diff is None else abs(diff) <= tol,
                     "sim_seeds": stats.spread(seeds), "live_rank_in_sim_seeds": rank(lv, seeds)})
    return rows


def table(policy: str, rows: list[dict]) -> str:
    f = (lambda v: "-" if v is None else f"{v:,.1f}")
    lines = [(f"[{policy}]  {'metric':14}{'live':>12}{'sim':>12}{'diff':>8}{'tol':>6}{'ok':>5}"
             f"{'sim seeds [min-max]':>26}{'live rank':>10}")]
    for r in rows:
        s = r["sim_seeds"]
        spread = "-" if s["median"] is None else f"{f(s['median'])} [{f(s['min'])}-{f(s['max'])}]"
        lines.append(f"   {r['metric']:14}{f(r['live']):>12}{f(r['sim']):>12}"
                     f"{'-' if r['diff'] is None else format(r['diff'], '+.0%'):>8}"
                     f"{'' if r['tolerance'] is None else format(r['tolerance'], '.0%'):>6}"
                     f"{'' if r['ok'] is None else ('yes' if r['ok'] else 'NO'):>5}{spread:>26}"
                     f"{'-' if r['live_rank_in_sim_seeds'] is None else format(r['live_rank_in_sim_seeds'], '.0%'):>10}")
    return "\n".join(lines)


@click.command("crosscheck")
@click.argument("live_json", type=click.Path(exists=True, dir_okay=False))
@click.option("--seeds", default=None, help="more simulated seeds for the spread, e.g. 0-9 (the live seed runs too)")
@click.option("--json", "json_path", default=None)
def crosscheck(live_json, seeds, json_path) -> None:
    """Set a live `ferry bench compare --engine sim` run beside the simulator's."""
    import json

    with open(live_json) as fh:
        live = json.load(fh)
    o = live["options"]
    seed_list = list(dict.fromkeys([o["seed"], *(parse_seeds(seeds) if seeds else [])]))
    out = {"command": " ".join(sys.argv), "live": live_json, "live_command": live.get("command"),
           "seeds": seed_list, "policies": {}}
    for policy, live_summary in live["policies"].items():
        per = [simulate(sim_options_for(o, s), policy)["summary"] for s in seed_list]
        rows = compare(live_summary, per[0], per)
        out["policies"][policy] = {"rows": rows, "live_send_lag_p99_ms": live_summary["send_lag_ms"]["p99"],
                                   "live_wall_s": live_summary.get("wall_s")}
        click.echo(table(policy, rows))
    if json_path:
        write_json(json_path, out)
        click.echo(f"wrote {json_path}")
