"""``ferry bench compare``: the same workload (same seed) against each
dispatch policy, a fresh cluster each; one table with ratios to llumnix, one
JSON, plots side by side.

JSON: {"command", "workload", "time_scale", "policies": {policy: {ttft_ms,
decode_ms, e2e_ms (each mean/p50/p99), preemption_loss_ms_mean, migrations,
high: {...}, normal: {...}, ...}}, "runs": {policy: per-request records and
cluster samples}}.
"""

from __future__ import annotations

import sys

import click

from ferry.measure import workload as wl
from ferry.bench.harness import report
from ferry.bench.serving import POLICIES, options_from, run_serving, serving_options, write_plots

BASELINE = "llumnix"
ROWS = (("TTFT mean", "ttft_ms", "mean"), ("TTFT p50", "ttft_ms", "p50"), ("TTFT p99", "ttft_ms", "p99"),
        ("decode mean", "decode_ms", "mean"), ("decode p99", "decode_ms", "p99"),
        ("e2e mean", "e2e_ms", "mean"), ("e2e p99", "e2e_ms", "p99"),
        ("preempt loss mean", "preemption_loss_ms_mean", None))


def _get(summary: dict, key: str, sub: str | None):
    v = summary.get(key)
    return v.get(sub) if sub and isinstance(v, dict) else v


def _cell(v, base) -> str:
    if v is None:
        return "-"
    text = f"{v:,.1f}"
    if base:
        text += f" ({v / base:.2f}x)"
    return text


def compare_table(summaries: dict[str, dict], baseline: str | None = BASELINE) -> str:
    """Rows: metrics (ms) for all / high / normal; columns: policies; each cell
    with its ratio to the baseline policy when that policy ran."""
    names = list(summaries)
    base = baseline if baseline in summaries else None
    width = max(18, *(len(n) + 12 for n in names))
    head = f"{'':24}" + "".join(f"{n:>{width}}" for n in names)
    lines = [head + (f"   (ratio to {base})" if base else "")]
    for group in ("all", "high", "normal"):
        pick = (lambda s: s) if group == "all" else (lambda s, g=group: s[g])
        if group != "all" and not any(pick(s)["requests"] for s in summaries.values()):
            continue
        lines.append(f"[{group}]")
        for label, key, sub in ROWS:
            b = _get(pick(summaries[base]), key, sub) if base else None
            lines.append(f"  {label:22}" + "".join(f"{_cell(_get(pick(s), key, sub), b):>{width}}"
                                                   for s in summaries.values()))
    if any("max_gap_ms" in s for s in summaries.values()):  # streamed: each request's longest token gap
        for label, sub in (("longest gap p50", "p50"), ("longest gap p99", "p99")):
            b = _get(summaries[base].get("max_gap_ms") or {}, sub, None) if base else None
            lines.append(f"  {label:22}" + "".join(
                f"{_cell((s.get('max_gap_ms') or {}).get(sub), b):>{width}}" for s in summaries.values()))
    lines.append(f"  {'preemptions':22}" + "".join(f"{s['preemptions']:>{width}}" for s in summaries.values()))
    lines.append(f"  {'migrations':22}" + "".join(f"{s['migrations']:>{width}}" for s in summaries.values()))
    lines.append(f"  {'completed':22}" + "".join(f"{str(s['completed']) + '/' + str(s['requests']):>{width}}"
                                                for s in summaries.values()))
    lines.append(f"  {'send lag p99 (wall ms)':22}" + "".join(f"{_cell(s['send_lag_ms']['p99'], None):>{width}}"
                                                            for s in summaries.values()))
    if any(s.get("wall_s") is not None for s in summaries.values()):  # not in simulated runs
        lines.append(f"  {'wall s':22}" + "".join(f"{s['wall_s']:>{width}.1f}" for s in summaries.values()))
    return "\n".join(lines)


@click.command("compare")
@serving_options
@click.option("--policies", default=",".join(POLICIES), show_default=True, help="comma-separated dispatch policies")
def compare(policies, json_path, plots_dir, **kw) -> None:
    """Compare dispatch policies on one workload (a fresh cluster per policy)."""
    names = [p.strip() for p in policies.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise click.UsageError(f"unknown policies {bad}; known: {', '.join(POLICIES)}")
    opts = options_from(kw)
    runs = {}
    for name in names:
        try:
            runs[name] = run_serving(opts, name)
        except wl.WorkloadError as e:
            raise click.UsageError(str(e)) from e
        s = runs[name]["summary"]
        click.echo(f"[{name}] {s['completed']}/{s['requests']} completed in {s['wall_s']:.1f}s", err=True)
    first = next(iter(runs.values()))
    summaries = {n: r["summary"] for n, r in runs.items()}
    click.echo(f"workload: {first['workload']['arrivals']} {first['workload']['lengths']} "
               f"n={first['workload']['num_requests']} seed={opts.seed}; {opts.instances} {opts.engine} instances; "
               f"latencies in ms" + (f" of model time (sim slowdown {opts.scale:g})" if opts.scale != 1 else ""))
    click.echo(compare_table(summaries))
    report({"command": " ".join(sys.argv), "workload": first["workload"], "time_scale": first["time_scale"],
            "options": first["options"], "policies": summaries, "runs": runs}, json_path)
    write_plots(runs, plots_dir)
