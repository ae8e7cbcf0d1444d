"""``ferry sim sweep-stats``: a grid's results (``ferry sim grid``'s JSON,
one per cell) read two ways, per pair of policies (a policy over a
baseline) and metric:

- **per cell**, as docs/results/sim/grid/report.md reads them: in each cell
  the median over seeds of the per-seed ratio; then the median of those
  over the cells, with [p10-p90] over the cells;
- **the paper's statistic** (Llumnix, OSDI'24, §6.3: "up to 15x P99 / 7.7x
  mean first-token latency over INFaaS++" is a maximum over its sweep of
  distributions, rates and burstiness, one trace per point): the maximum
  over the sweep's cells, taken per seed (then its median and range over
  the seeds) and over all cells and seeds at once.

A ratio reads as a gain: for latencies, the baseline's value over the
policy's (15 = 15x lower); for preemption loss, the reduction, 1 - the
policy's over the baseline's (0.84 = 84% lower; the paper's figure). A
(cell, seed) where the baseline's value is 0 or either is missing counts
nowhere; a policy at 0 against a positive baseline is an infinite latency
gain (a 100% reduction).
"""

from __future__ import annotations

import glob
import json
import math
import os

import click

from ferry.machine import write_json
from ferry.sim import stats

# (label, summary key, sub-key, kind): "speedup" = baseline / policy; "reduction" = 1 - policy / baseline.
METRICS = (("P99 TTFT", "ttft_ms", "p99", "speedup"), ("mean TTFT", "ttft_ms", "mean", "speedup"),
           ("preemption loss", "preemption_loss_ms_mean", None, "reduction"))
DEFAULT_PAIRS = ("llumnix/infaas++", "llumnix/round_robin", "llumnix_base/infaas++", "llumnix_base/round_robin")


def gain(policy: float | None, baseline: float | None, kind: str) -> float | None:
    if policy is None or baseline is None or baseline <= 0:
        return None
    if kind == "speedup":
        return math.inf if policy <= 0 else baseline / policy
    return 1.0 - policy / baseline


def cell_name(result: dict) -> str:
    w = result["workload"]
    return f"{w['lengths']} {w['arrivals']} n={w['num_requests']}"


def gains(result: dict, policy: str, baseline: str, key: str, sub: str | None, kind: str) -> dict[int, float]:
    """Seed -> the gain of ``policy`` over ``baseline`` in one cell (seeds
    where either ran and the gain is defined)."""
    per = result.get("per_seed", {})
    if policy not in per or baseline not in per:
        return {}
    out = {}
    for seed, a, b in zip(result["seeds"], per[policy], per[baseline]):
        g = gain(stats.metric(a, key, sub), stats.metric(b, key, sub), kind)
        if g is not None:
            out[seed] = g
    return out


def _spread(values: list[float]) -> dict:
    """stats.spread, with infinite values kept (numpy's percentiles of inf are nan)."""
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) == len(values):
        return stats.spread(values)
    s = sorted(values)

    def pct(q: float) -> float:  # nearest rank: inf stays inf
        return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]

    return {"n": len(s), "median": pct(50), "p10": pct(10), "p90": pct(90), "min": s[0], "max": s[-1]}


def pair_stats(results: list[dict], policy: str, baseline: str) -> dict:
    """Per metric: ``per_cell`` (each cell's median over seeds, and their
    median [p10-p90] over cells), ``max_over_cells`` (per seed: the maximum
    over the cells and which cell; its spread over seeds) and
    ``max_overall`` (the maximum over every cell and seed, where)."""
    out = {}
    for label, key, sub, kind in METRICS:
        cells = []
        by_seed: dict[int, tuple[float, str]] = {}
        best = None
        for r in results:
            g = gains(r, policy, baseline, key, sub, kind)
            if not g:
                continue
            name = cell_name(r)
            cells.append({"cell": name, "seeds": len(g), "median": _spread(list(g.values()))["median"]})
            for seed, v in g.items():
                if seed not in by_seed or v > by_seed[seed][0]:
                    by_seed[seed] = (v, name)
                if best is None or v > best["value"]:
                    best = {"value": v, "cell": name, "seed": seed}
        per_seed = [{"seed": s, "max": v, "cell": c} for s, (v, c) in sorted(by_seed.items())]
        out[label] = {
            "kind": kind,
            "per_cell": {"cells": cells, "over_cells": _spread([c["median"] for c in cells]) if cells
                         else stats.spread([])},
            "max_over_cells": {"per_seed": per_seed,
                               "over_seeds": _spread([p["max"] for p in per_seed]) if per_seed
                               else stats.spread([])},
            "max_overall": best,
        }
    return out


def sweep_stats(results: list[dict], pairs: list[tuple[str, str]]) -> dict:
    return {"cells": [cell_name(r) for r in results],
            "pairs": {f"{p}/{b}": pair_stats(results, p, b) for p, b in pairs}}


def load(folder: str) -> list[dict]:
    """The grid's cell results in ``folder`` (JSON files with per-seed summaries), in name order."""
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            r = json.load(f)
        if isinstance(r, dict) and "per_seed" in r and "seeds" in r and "workload" in r:
            out.append(r)
    return out


def _fmt(v: float | None, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "reduction":
        return f"{100 * v:.0f}%"
    return "inf" if math.isinf(v) else f"{v:.2f}x"


def table(result: dict) -> str:
    """Markdown: a row per pair and metric."""
    lines = ["| pair | metric | per cell: median over cells [p10-p90] | max over cells, per seed: median "
             "[min-max] | max over cells and seeds (where) |", "|---|---|---|---|---|"]
    for pair, by_metric in result["pairs"].items():
        for label, m in by_metric.items():
            k = m["kind"]
            pc, mx, best = m["per_cell"]["over_cells"], m["max_over_cells"]["over_seeds"], m["max_overall"]
            where = f"{_fmt(best['value'], k)} ({best['cell']}, seed {best['seed']})" if best else "-"
            lines.append(f"| {pair} | {label} | {_fmt(pc['median'], k)} [{_fmt(pc['p10'], k)}-{_fmt(pc['p90'], k)}]"
                         f" | {_fmt(mx['median'], k)} [{_fmt(mx['min'], k)}-{_fmt(mx['max'], k)}] | {where} |")
    return "\n".join(lines)


def _finite(x):
    """For JSON: an infinite gain written as "inf"."""
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def parse_pairs(spec: str) -> list[tuple[str, str]]:
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        policy, sep, baseline = part.partition("/")
        if not sep or not policy or not baseline:
            raise click.BadParameter(f"a pair is POLICY/BASELINE, e.g. llumnix/infaas++; got {part!r}")
        out.append((policy, baseline))
    if not out:
        raise click.BadParameter("no pairs")
    return out


@click.command("sweep-stats")
@click.option("--grid", "folder", default="docs/results/sim/grid", show_default=True,
              help="folder of `ferry sim grid` results (one JSON per cell)")
@click.option("--pairs", default=",".join(DEFAULT_PAIRS), show_default=True,
              help="comma-separated POLICY/BASELINE")
@click.option("--json", "json_path", default=None, help="write the statistics here")
def sweep_stats_cmd(folder: str, pairs: str, json_path: str | None) -> None:
    """A grid's gains per pair of policies: the median over cells, and the paper's maximum over the sweep."""
    results = load(folder)
    if not results:
        raise click.UsageError(f"no grid results in {folder}")
    result = {"grid": folder, **sweep_stats(results, parse_pairs(pairs))}
    click.echo(f"{len(results)} cells from {folder}\n")
    click.echo(table(result))
    if json_path:
        write_json(json_path, _finite(result))
        click.echo(f"\nwrote {json_path}")
