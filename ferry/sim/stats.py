"""Statistics over seeds (pure): per policy and metric the median and the
spread (min/max and 10th-90th percentile) of the per-seed values, and per
pair of policies the per-seed ratio of P99 TTFT with its spread. A policy
claim is a median over seeds, never one run."""

from __future__ import annotations

import itertools

import numpy as np

# (label, summary key, sub-key) of every metric aggregated over seeds.
METRICS = (("TTFT mean", "ttft_ms", "mean"), ("TTFT p50", "ttft_ms", "p50"), ("TTFT p99", "ttft_ms", "p99"),
           ("decode mean", "decode_ms", "mean"), ("decode p99", "decode_ms", "p99"),
           ("e2e mean", "e2e_ms", "mean"), ("e2e p99", "e2e_ms", "p99"),
           ("preempt loss mean", "preemption_loss_ms_mean", None), ("preemptions", "preemptions", None),
           ("migrations", "migrations", None))
GROUPS = ("all", "high", "normal")


def metric(summary: dict, key: str, sub: str | None, group: str = "all"):
    s = summary if group == "all" else summary[group]
    v = s.get(key)
    return v.get(sub) if sub and isinstance(v, dict) else v


def spread(values: list[float | None]) -> dict:
    """median, p10, p90, min, max of the values that exist; n counts them."""
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if not len(v):
        return {"n": 0, "median": None, "p10": None, "p90": None, "min": None, "max": None}
    return {"n": len(v), "median": float(np.median(v)), "p10": float(np.percentile(v, 10)),
            "p90": float(np.percentile(v, 90)), "min": float(v.min()), "max": float(v.max())}


def over_seeds(per_seed: dict[str, list[dict]]) -> dict:
    """{policy: {group: {metric label: spread}}} from {policy: [summary per seed]}."""
    out = {}
    for policy, sums in per_seed.items():
        groups = {}
        with_high = any(s["high"]["requests"] for s in sums)
        for g in GROUPS if with_high else ("all",):
            groups[g] = {label: spread([metric(s, key, sub, g) for s in sums]) for label, key, sub in METRICS}
        out[policy] = groups
    return out


def ratios(per_seed: dict[str, list[dict]], key: str = "ttft_ms", sub: str = "p99") -> dict:
    """{"A/B": spread of A's metric / B's, seed by seed, plus the per-seed list}
    for every ordered pair of policies (the same seeds for both)."""
    out = {}
    for a, b in itertools.permutations(per_seed, 2):
        vals = []
        for sa, sb in zip(per_seed[a], per_seed[b]):
            x, y = metric(sa, key, sub), metric(sb, key, sub)
            vals.append(x / y if x is not None and y else None)
        out[f"{a}/{b}"] = {**spread(vals), "per_seed": vals}
    return out


def _fmt(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def spread_markdown(header: str, names: list[str], rows, digits: int) -> str:
    """A markdown table, a column per name and a row per ``(label, values_of)``
    of ``rows`` (``values_of(name)``: that column's value per seed); each cell
    is the median [p10-p90] over seeds, "-" when no value exists."""
    lines = [f"| {header} | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, values_of in rows:
        cells = []
        for n in names:
            sp = spread(values_of(n))
            cells.append("-" if sp["median"] is None else
                         f"{_fmt(sp['median'], digits)} [{_fmt(sp['p10'], digits)}-{_fmt(sp['p90'], digits)}]")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spread_table(stats: dict, group: str = "all") -> str:
    """Rows: metrics; columns: policies; cells: median [min - max] over seeds."""
    names = [p for p in stats if group in stats[p]]
    if not names:
        return ""
    rows = []
    for label, _, _ in METRICS:
        digits = 2 if label.startswith("decode") else (0 if label in ("preemptions", "migrations") else 1)
        cells = []
        for n in names:
            s = stats[n][group][label]
            cells.append(f"{_fmt(s['median'], digits)} [{_fmt(s['min'], digits)} - {_fmt(s['max'], digits)}]")
        rows.append((label, cells))
    width = max(len(n) for n in names)
    width = 2 + max(width, *(len(c) for _, cells in rows for c in cells))
    lines = [f"[{group}] median [min - max] over seeds", f"  {'':20}" + "".join(f"{n:>{width}}" for n in names)]
    lines += [f"  {label:20}" + "".join(f"{c:>{width}}" for c in cells) for label, cells in rows]
    return "\n".join(lines)


def ratio_table(rat: dict, names: list[str]) -> str:
    """P99 TTFT of the row policy / the column policy: median [min - max]."""
    width = max(24, *(len(n) + 4 for n in names))
    lines = ["P99 TTFT ratio, row / column, per seed: median [min - max]",
             f"  {'':16}" + "".join(f"{n:>{width}}" for n in names)]
    for a in names:
        cells = []
        for b in names:
            r = rat.get(f"{a}/{b}")
            cells.append("1" if a == b else f"{_fmt(r['median'], 2)} [{_fmt(r['min'], 2)} - {_fmt(r['max'], 2)}]")
        lines.append(f"  {a:16}" + "".join(f"{c:>{width}}" for c in cells))
    return "\n".join(lines)
