"""``ferry sim splitwise``: the Splitwise provisioning study (ferry/sim/provision.py)
for one or more workloads: per design the highest throughput within the
SLOs at iso-power and at iso-cost (a budget of N DGX-H100 machines' power or
cost), and the cheapest cluster that meets the SLOs at a target rate (by
default what Baseline-H100 reaches at iso-power). Prints tables, writes JSON
(and a plot). The same command writes the same JSON, byte for byte."""

from __future__ import annotations

import math
import sys
import time

import click
import numpy as np

from ferry.measure import workload as wl
from ferry.machine import write_json
from ferry.sim import stats
from ferry.sim.cli import parse_seeds
from ferry.sim.provision import (
    DESIGNS,
    POLICY,
    REFERENCE,
    Config,
    Design,
    Slo,
    Study,
    capacity_guess,
    configs_within,
    machine_rates,
    profile,
)

BASELINE = "Baseline-H100"


def _means(lengths: str, n: int, seed: int) -> tuple[float, float]:
    w = wl.build("poisson:1", lengths, n, seed, max_model_len=profile(REFERENCE).max_model_len)
    return (float(np.mean([r.prompt_len for r in w.requests])), float(np.mean([r.output_len for r in w.requests])))


def best_config(study: Study, configs: list[Config], means, seed: int) -> tuple[Config, dict[int, float]]:
    """Hill-climb on the prompt-machine count (configs are in its order) from
    the configuration the capacity guess likes best; first seed only."""
    guess = [capacity_guess(c, *means) for c in configs]
    rates: dict[int, float] = {}

    def val(i: int) -> float:
        if i not in rates:
            rates[i] = study.max_rate(configs[i], seed, max(0.05, 0.7 * guess[i]))[0]
        return rates[i]

    i = int(np.argmax(guess))
    val(i)
    while True:
        near = [j for j in (i - 1, i + 1) if 0 <= j < len(configs)]
        for j in near:
            val(j)
        best = max([i, *near], key=lambda j: (rates[j], -j))
        if best == i:
            return configs[i], rates
        i = best


def budget_study(study: Study, designs: list[Design], budget: float, measure: str, means, log) -> dict:
    out = {}
    for d in designs:
        configs = configs_within(d, budget, measure)
        if not configs:
            out[d.name] = {"configs": [], "best": None}
            continue
        log(f"[{measure} budget {budget:g}] {d.name}: {len(configs)} configurations")
        best, rates = best_config(study, configs, means, study.seeds[0])
        per_seed = [rates[configs.index(best)]]
        for s in study.seeds[1:]:
            guess = max(0.05, per_seed[0])
            rate = study.max_rate(best, s, guess, step=1.1)[0]
            if rate == 0.0:  # far from the first seed's: search wider
                rate = study.max_rate(best, s, guess / 3)[0]
            per_seed.append(rate)
        out[d.name] = {"explored_first_seed": [{**configs[i].to_dict(), "max_rate_rps": r}
                                               for i, r in sorted(rates.items())],
                       "best": best.to_dict(), "max_rate_per_seed": per_seed,
                       "max_rate": stats.spread(per_seed),
                       "at_max_rate_first_seed": (study.point(best, per_seed[0], study.seeds[0]).to_dict()
                                                  if per_seed[0] else None)}
    base = out.get(BASELINE, {}).get("max_rate_per_seed")
    for res in out.values():
        if res.get("best") and base:
            ratio = [a / b if b else None for a, b in zip(res["max_rate_per_seed"], base)]
            res["vs_baseline_h100"] = {**stats.spread(ratio), "per_seed": ratio}
    return out


def cheapest(study: Study, d: Design, target: float, means, log, max_steps: int = 3) -> dict:
    """The least-cost configuration meeting the SLOs at ``target`` on a
    majority of the seeds (as the rates are medians over seeds)."""
    need = len(study.seeds) // 2 + 1

    def ok(cfg: Config) -> bool:
        good = bad = 0
        for s in study.seeds:
            if study.point(cfg, target, s).ok:
                good += 1
            else:
                bad += 1
            if good >= need or bad > len(study.seeds) - need:
                break
        return good >= need

    def fewest(p: int, t0: int) -> int | None:
        t = max(1, t0)
        if ok(Config(d, p, t)):
            while t > 1 and ok(Config(d, p, t - 1)):
                t -= 1
            return t
        for _ in range(max(max_steps, t0)):
            t += 1
            if ok(Config(d, p, t)):
                return t
        return None

    prompt_rps, decode_rps = machine_rates(d, *means)
    found: list[Config] = []
    if not d.split:
        t = fewest(0, math.ceil(target * (1 / prompt_rps + 1 / decode_rps)))
        if t is not None:
            found.append(Config(d, 0, t))
    else:
        p0 = max(1, math.ceil(target / prompt_rps))
        for p in range(max(1, p0 - 1), p0 + 3):
            if found and Config(d, p, 1).cost >= min(c.cost for c in found):
                break  # more prompt machines cannot be cheaper
            t = fewest(p, math.ceil(target / decode_rps))
            if t is not None:
                found.append(Config(d, p, t))
    log(f"[cheapest at {target:g}/s] {d.name}: " + ", ".join(f"{c.label()} cost {c.cost:.2f}" for c in found))
    if not found:
        return {"best": None, "candidates": []}
    best = min(found, key=lambda c: (round(c.cost, 6), c.power_w, c.prompt))
    return {"best": best.to_dict(), "candidates": [c.to_dict() for c in found]}


def fmt_spread(s: dict | None, digits: int = 2) -> str:
    if not s or s.get("median") is None:
        return "-"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def print_tables(res: dict) -> None:
    for wname, w in res["workloads"].items():
        click.echo(f"\n== {wname}: {w['workload']}; n={res['num_requests']} per run, seeds {res['seeds']}; "
                   f"max rate: median [min-max] over seeds")
        for key, title in (("iso_power", f"iso-power ({w['power_budget_kw']:g} kW)"),
                           ("iso_cost", f"iso-cost ({w['cost_budget']:g} DGX-A100-hours per hour)")):
            if key not in w:
                continue
            click.echo(f"  {title}")
            click.echo(f"    {'design':16} {'config':11} {'kW':>6} {'cost':>6} {'max req/s':>22} {'x Baseline-H100':>20}")
            for name, r in w[key].items():
                if not r.get("best"):
                    click.echo(f"    {name:16} (no configuration fits)")
                    continue
                b = r["best"]
                cfg = f"{b['prompt_machines']}P+{b['token_machines']}T" if b["prompt_machines"] else \
                    f"{b['token_machines']} mixed"
                click.echo(f"    {name:16} {cfg:11} {b['power_kw']:6.1f} {b['cost']:6.2f} "
                           f"{fmt_spread(r['max_rate']):>22} {fmt_spread(r.get('vs_baseline_h100')):>20}")
        click.echo("  handoffs at the iso-power max rate (first seed): exposed ms mean / max (count)")
        for name, r in w.get("iso_power", {}).items():
            h = (r.get("at_max_rate_first_seed") or {}).get("handoff")
            if h:
                cells = [f"{m} {h[m]['exposed_ms_mean']:.2f} / {h[m]['exposed_ms_max']:.2f} ({h[m]['n']})"
                         for m in ("serialized", "per_layer") if h[m]["n"]]
                click.echo(f"    {name:16} " + "; ".join(cells) + f"; refusals {h['refusals']}, "
                           f"per-layer fallbacks {h['fallbacks']}")
        ch = w.get("cheapest")
        if not ch:
            continue
        click.echo(f"  cheapest cluster meeting the SLOs on most seeds at {ch['target_rps']:g} req/s")
        for name, r in ch["designs"].items():
            b = r["best"]
            if not b:
                click.echo(f"    {name:16} (none found in the searched range)")
                continue
            cfg = f"{b['prompt_machines']}P+{b['token_machines']}T" if b["prompt_machines"] else \
                f"{b['token_machines']} mixed"
            click.echo(f"    {name:16} {cfg:11} {b['power_kw']:6.1f} kW  cost {b['cost']:6.2f}")


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = list(res["workloads"])
    fig, axes = plt.subplots(len(ws), 2, figsize=(11, 3.6 * len(ws)), squeeze=False)
    for row, wname in enumerate(ws):
        for col, key in enumerate(("iso_power", "iso_cost")):
            ax = axes[row][col]
            items = [(n, r) for n, r in res["workloads"][wname].get(key, {}).items() if r.get("best")]
            med = [r["max_rate"]["median"] for _, r in items]
            lo = [r["max_rate"]["median"] - r["max_rate"]["min"] for _, r in items]
            hi = [r["max_rate"]["max"] - r["max_rate"]["median"] for _, r in items]
            ax.bar(range(len(items)), med, yerr=[lo, hi], capsize=4, color="#5b8bd0")
            ax.set_xticks(range(len(items)))
            ax.set_xticklabels([n.replace("Splitwise-", "SW-").replace("Baseline-", "B-") for n, _ in items],
                               fontsize=8)
            ax.set_ylabel("req/s within SLOs")
            ax.set_title(f"{wname}: {key.replace('_', '-')} (median, min-max over seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


@click.command("splitwise")
@click.option("--workloads", default="conv,coding", show_default=True,
              help="comma-separated length specs (ferry bench workload: conv, coding, ...); Poisson arrivals")
@click.option("-n", "--num-requests", type=click.IntRange(10), default=600, show_default=True,
              help="requests per simulated run")
@click.option("--seeds", default="0-2", show_default=True)
@click.option("--budget-h100", type=click.FloatRange(min=0, min_open=True), default=4.0, show_default=True,
              help="iso-power and iso-cost budgets: the power and the cost of this many DGX-H100 machines")
@click.option("--target-rps", type=float, default=None,
              help="cheapest-cluster target rate (default: Baseline-H100's median at iso-power, per workload)")
@click.option("--slo-ttft", type=float, default=Slo.ttft, show_default=True, help="P99 TTFT slowdown limit")
@click.option("--slo-tbt", type=float, default=Slo.tbt, show_default=True, help="P99 TBT slowdown limit")
@click.option("--slo-e2e", type=float, default=Slo.e2e, show_default=True, help="P99 E2E slowdown limit")
@click.option("--rate-precision", type=click.FloatRange(min=1.001), default=1.05, show_default=True,
              help="bisection stops when the failing / passing rate ratio is below this")
@click.option("--designs", default=",".join(d.name for d in DESIGNS), show_default=True,
              help=f"comma-separated designs ({BASELINE} is always run: ratios are to it)")
@click.option("--parts", default="iso-power,iso-cost,cheapest", show_default=True,
              help="which searches to run (cheapest without iso-power needs --target-rps)")
@click.option("--json", "json_path", default=None)
@click.option("--plot", "plot_path", default=None, help="write a PNG bar chart here")
@click.option("--quiet", is_flag=True, help="no per-run log on stderr")
def splitwise(workloads, num_requests, seeds, budget_h100, target_rps, slo_ttft, slo_tbt, slo_e2e,
              rate_precision, designs, parts, json_path, plot_path, quiet) -> None:
    """Splitwise provisioning study (simulated): iso-power / iso-cost throughput and the cheapest cluster."""
    seed_list = tuple(parse_seeds(seeds))
    known = {d.name: d for d in DESIGNS}
    names = {n.strip() for n in designs.split(",") if n.strip()} | {BASELINE}
    if names - set(known):
        raise click.UsageError(f"unknown designs {sorted(names - set(known))}; known: {', '.join(known)}")
    chosen = [d for d in DESIGNS if d.name in names]
    todo = {p.strip() for p in parts.split(",") if p.strip()}
    if todo - {"iso-power", "iso-cost", "cheapest"} or not todo:
        raise click.UsageError("--parts: a comma-separated subset of iso-power, iso-cost, cheapest")
    if "cheapest" in todo and "iso-power" not in todo and target_rps is None:
        raise click.UsageError("--parts cheapest without iso-power needs --target-rps")
    slo = Slo(slo_ttft, slo_tbt, slo_e2e)
    h100 = profile("llama2-70b-h100")
    log = (lambda m: None) if quiet else (lambda m: click.echo(m, err=True))
    t0 = time.perf_counter()
    res = {"command": " ".join(sys.argv),
           "policy": POLICY, "reference_machine": REFERENCE, "num_requests": num_requests, "seeds": list(seed_list),
           "slo_p99_slowdown": {"ttft": slo.ttft, "tbt": slo.tbt, "e2e": slo.e2e},
           "budget_h100_machines": budget_h100,
           "machines": {n: {"hardware": p.hardware, "power_kw": p.machine_power_w / 1000, "cost": p.machine_cost}
                        for n in ("llama2-70b-a100", "llama2-70b-h100", "llama2-70b-h100cap")
                        for p in [profile(n)]},
           "workloads": {}}
    total_runs = 0
    for spec in [w.strip() for w in workloads.split(",") if w.strip()]:
        study = Study(spec, num_requests, seed_list, slo, rate_precision=rate_precision, log=log)
        means = _means(spec, 4000, 0)
        power, cost = budget_h100 * h100.machine_power_w, budget_h100 * h100.machine_cost
        w = {"workload": f"poisson arrivals, lengths {spec}", "prompt_mean": means[0], "output_mean": means[1],
             "power_budget_kw": power / 1000, "cost_budget": cost}
        if "iso-power" in todo:
            w["iso_power"] = budget_study(study, chosen, power, "power_w", means, log)
        if "iso-cost" in todo:
            w["iso_cost"] = budget_study(study, chosen, cost, "cost", means, log)
        if "cheapest" in todo:
            target = target_rps or w["iso_power"][BASELINE]["max_rate"]["median"]
            w["cheapest"] = {"target_rps": target,
                             "designs": {d.name: cheapest(study, d, target, means, log) for d in chosen}}
        w["simulated_runs"] = study.runs
        total_runs += study.runs
        res["workloads"][spec] = w
    print_tables(res)
    click.echo(f"{total_runs} simulated runs in {time.perf_counter() - t0:.0f} s wall", err=True)
    if json_path:
        write_json(json_path, res)
        click.echo(f"wrote {json_path}")
    if plot_path:
        plot(res, plot_path)
        click.echo(f"wrote {plot_path}")

