"""``ferry sim grid``: many workloads (cells), every policy on every seed,
one JSON per cell (what ``ferry sim compare --no-records`` writes, without
cluster samples) and a report over all cells: a markdown table per metric
(median [p10 - p90] over seeds) with each policy's per-seed ratio to a
baseline, and plots. Cells whose JSON already exists with the same settings
are kept, so a long grid can be resumed.
"""

from __future__ import annotations

import json
import os
import re
import time

import click

from libs.common.policies import POLICY_NAMES as POLICIES
from ferry.machine import write_json
from ferry.sim import stats
from ferry.sim.cli import JOBS_OPTION, parse_seeds, run_compare, sim_options

# (label, summary key, sub-key, unit) of the reported metrics.
REPORTED = (("P99 TTFT", "ttft_ms", "p99", "s"), ("mean TTFT", "ttft_ms", "mean", "s"),
            ("P99 decode", "decode_ms", "p99", "ms"), ("mean decode", "decode_ms", "mean", "ms"),
            ("preemption loss", "preemption_loss_ms_mean", None, "ms"), ("migrations", "migrations", None, ""))


def slug(lengths: str, arrivals: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", f"{lengths}_{arrivals}").strip("_")


def parse_cell(spec: str) -> tuple[str, str]:
    """"M-M poisson:17" -> ("M-M", "poisson:17")."""
    parts = spec.split()
    if len(parts) != 2:
        raise click.BadParameter(f"a cell is 'LENGTHS ARRIVALS', e.g. 'M-M poisson:17'; got {spec!r}")
    return parts[0], parts[1]


def run_cell(kw: dict, names: list[str], seeds: list[int], path: str, jobs: int = 1) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        same = (old["seeds"] == seeds and list(old["policies"]) == names
                and old["workload"]["num_requests"] == kw["num_requests"])
        if same:
            click.echo(f"kept {path}", err=True)
            return old
    result = run_compare(kw, names, seeds, records=False, jobs=jobs)
    for run in result["runs"].values():
        run["samples"] = []
    write_json(path, result)
    return result


def _value(summary: dict, key: str, sub: str | None, unit: str):
    v = stats.metric(summary, key, sub)
    return None if v is None else (v / 1000 if unit == "s" else v)


def _cell_text(spread: dict, digits: int) -> str:
    if spread["median"] is None:
        return "-"
    return f"{spread['median']:,.{digits}f} [{spread['p10']:,.{digits}f}-{spread['p90']:,.{digits}f}]"


def report(results: list[dict], baseline: str) -> str:
    """Markdown: one table per metric, a row per cell, a column per policy:
    median [p10-p90] over seeds; then the median per-seed ratio to the
    baseline."""
    out = []
    names = list(results[0]["policies"]) if results else []
    for label, key, sub, unit in REPORTED:
        digits = 0 if label == "migrations" else (2 if unit == "s" else 1)
        out.append(f"### {label}{f' ({unit})' if unit else ''}: median [p10-p90] over seeds; "
                   f"x = median per-seed ratio to {baseline}\n")
        out.append("| cell | seeds | " + " | ".join(names) + " |")
        out.append("|---|---|" + "---|" * len(names))
        for r in results:
            w = r["workload"]
            per = {n: [_value(s, key, sub, unit) for s in r["per_seed"][n]] for n in names}
            cells = []
            for n in names:
                text = _cell_text(stats.spread(per[n]), digits)
                if n != baseline and baseline in per:
                    ratio = stats.spread([a / b if a is not None and b else None
                                          for a, b in zip(per[n], per[baseline])])
                    if ratio["median"] is not None:
                        text += f" {ratio['median']:.2f}x"
                cells.append(text)
            out.append(f"| {w['lengths']} {w['arrivals']} n={w['num_requests']} | {len(r['seeds'])} | "
                       + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


# Metrics judged by ``verdicts`` (lower is better for each).
JUDGED = ("P99 TTFT", "mean TTFT", "P99 decode", "preemption loss")
WIN, TIE, LOSE = "win", "tie", "lose"


def verdict(ratios: list[float | None], margin: float = 0.10) -> str | None:
    """A policy against the baseline on one metric, from the per-seed ratios
    policy / baseline (lower is better): ``win`` when the median ratio is at
    most 1 - margin and the 90th percentile is below 1 (nearly every seed
    better), ``lose`` when the median is at least 1 + margin and the 10th
    percentile above 1, else ``tie``. None without a ratio."""
    s = stats.spread([min(r, 1e12) if r is not None else None for r in ratios])  # inf - inf would be nan
    if s["median"] is None:
        return None
    if s["median"] <= 1 - margin and s["p90"] < 1:
        return WIN
    if s["median"] >= 1 + margin and s["p10"] > 1:
        return LOSE
    return TIE


def _ratios(r: dict, name: str, baseline: str, key: str, sub: str | None, unit: str) -> list[float | None]:
    a = [_value(s, key, sub, unit) for s in r["per_seed"][name]]
    b = [_value(s, key, sub, unit) for s in r["per_seed"][baseline]]
    def ratio(x, y):
        if x is None or y is None:
            return None
        if y > 0:
            return x / y
        return 1.0 if x == 0 else float("inf")  # 0/0: the same; x/0: worse than any ratio

    return [ratio(x, y) for x, y in zip(a, b)]


def verdicts(results: list[dict], baseline: str) -> str:
    """Markdown: per cell and policy, win/tie/lose against the baseline on
    each judged metric (see ``verdict``), with the median per-seed ratio."""
    names = [n for n in (list(results[0]["policies"]) if results else []) if n != baseline]
    metrics = [m for m in REPORTED if m[0] in JUDGED]
    out = [f"### Against {baseline}: win / tie / lose per metric (median per-seed ratio)\n",
           ("Rule: win when the median per-seed ratio is <= 0.90 and its 90th percentile < 1; lose when the median "
            "is >= 1.10 and its 10th percentile > 1; else tie. A 0/0 ratio (e.g. no preemption in either run) "
            "counts as 1, x/0 as infinite.\n"),
           "| cell | seeds | policy | " + " | ".join(m[0] for m in metrics) + " |",
           "|---|---|---|" + "---|" * len(metrics)]
    for r in results:
        w = r["workload"]
        if baseline not in r["per_seed"]:
            continue
        for n in names:
            cells = []
            for label, key, sub, unit in metrics:
                rat = _ratios(r, n, baseline, key, sub, unit)
                v, med = verdict(rat), stats.spread([min(x, 1e12) if x is not None else None for x in rat])["median"]
                cells.append("-" if v is None else f"{v} ({'x/0' if med >= 1e12 else f'{med:.2f}x'})")
            out.append(f"| {w['lengths']} {w['arrivals']} n={w['num_requests']} | {len(r['seeds'])} | {n} | "
                       + " | ".join(cells) + " |")
    out.append("")
    return "\n".join(out)


def plot(results: list[dict], folder: str) -> list[str]:
    """One PNG per metric: a bar per policy and cell at the median over
    seeds, whiskers from the 10th to the 90th percentile."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    os.makedirs(folder, exist_ok=True)
    names = list(results[0]["policies"])
    labels = [f"{r['workload']['lengths']}\n{r['workload']['arrivals']}" for r in results]
    paths = []
    for label, key, sub, unit in REPORTED:
        fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(results)), 4))
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            sp = [stats.spread([_value(s, key, sub, unit) for s in r["per_seed"][n]]) for r in results]
            med = np.array([s["median"] or 0.0 for s in sp])
            lo = med - np.array([s["p10"] or 0.0 for s in sp])
            hi = np.array([s["p90"] or 0.0 for s in sp]) - med
            ax.bar(np.arange(len(results)) + i * width, med, width, yerr=[lo, hi], capsize=2, label=n)
        ax.set_xticks(np.arange(len(results)) + width * (len(names) - 1) / 2, labels, fontsize=7)
        ax.set_ylabel(f"{label}{f' ({unit})' if unit else ''}")
        if key == "ttft_ms":
            ax.set_yscale("log")
        ax.set_title(f"{label}: median over seeds, p10-p90 whiskers", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(folder, f"{slug(label, '')}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


@click.command("grid")
@sim_options
@click.option("--cell", "cells", multiple=True, required=True,
              help="a workload as 'LENGTHS ARRIVALS', e.g. 'M-M poisson:17' (repeatable)")
@click.option("--policies", default=",".join(POLICIES), show_default=True)
@click.option("--baseline", default="infaas++", show_default=True, help="the report's ratios are to this policy")
@click.option("--out", "out_dir", required=True, help="folder for one JSON per cell, report.md and plots/")
@JOBS_OPTION
def grid(cells, policies, baseline, out_dir, seed, seeds, json_path, plots_dir, no_records, jobs, **kw) -> None:
    """Run a grid of workloads (every policy, every seed) and report it."""
    names = [p.strip() for p in policies.split(",") if p.strip()]
    seed_list = parse_seeds(seeds) if seeds else [seed]
    os.makedirs(out_dir, exist_ok=True)
    results = []
    t0 = time.perf_counter()
    for spec in cells:
        lengths, arrivals = parse_cell(spec)
        t = time.perf_counter()
        path = os.path.join(out_dir, f"{slug(lengths, arrivals)}.json")
        results.append(run_cell({**kw, "lengths": lengths, "arrivals": arrivals}, names, seed_list, path, jobs))
        click.echo(f"[{lengths} {arrivals}] {time.perf_counter() - t:.0f} s wall", err=True)
    text = report(results, baseline) + "\n" + verdicts(results, baseline)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(text)
    click.echo(text)
    for p in plot(results, os.path.join(out_dir, "plots")):
        click.echo(f"wrote {p}")
    click.echo(f"grid: {len(cells)} cells in {time.perf_counter() - t0:.0f} s wall", err=True)
