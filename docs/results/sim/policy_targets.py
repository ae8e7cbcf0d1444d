"""Issue 16's target table from two `ferry sim compare` JSONs (priorities off,
and 10% high priority): every entry is the median over seeds of the per-seed
ratio, [min - max].

    python docs/results/sim/policy_targets.py policy_now_mm17.json policy_now_mm17_hp10.json
"""

from __future__ import annotations

import json
import statistics
import sys


def runs(path: str) -> dict[str, list[dict]]:
    with open(path) as f:
        return json.load(f)["per_seed"]


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def ratio(a: list[dict], b: list[dict], get) -> list[float]:
    return [get(x) / get(y) for x, y in zip(a, b, strict=True) if get(y)]


def main(base_path: str, hp_path: str) -> None:
    p = runs(base_path)
    rr, inf, base = p["round_robin"], p["infaas++"], p["llumnix_base"]
    ttft = lambda r: r["ttft_ms"]["p99"]  # noqa: E731
    rows = [
        ("P99 TTFT infaas++ / llumnix_base (target >= 3)", spread(ratio(inf, base, ttft))),
        ("P99 TTFT round_robin / llumnix_base (>= 10)", spread(ratio(rr, base, ttft), "{:.1f}")),
        ("P99 decode infaas++ / llumnix_base (>= 1.3)", spread(ratio(inf, base, lambda r: r["decode_ms"]["p99"]))),
        ("preemption loss, llumnix_base vs round_robin (>= 70% lower)",
         spread([100 * (1 - x) for x in ratio(base, rr, lambda r: r["preemption_loss_ms_mean"] or 0.0)],
                "{:.0f}%")),
    ]
    h = runs(hp_path)
    hb, hl = h["llumnix_base"], h["llumnix"]
    rows += [
        ("high-prio P99 e2e llumnix_base / llumnix (>= 1.3)", spread(ratio(hb, hl, lambda r: r["high"]["e2e_ms"]["p99"]))),
        ("normal P99 e2e llumnix / llumnix_base (<= 1.10)",
         spread(ratio(hl, hb, lambda r: r["normal"]["e2e_ms"]["p99"]), "{:.3f}")),
        ("normal P99 TTFT llumnix / llumnix_base", spread(ratio(hl, hb, lambda r: r["normal"]["ttft_ms"]["p99"]), "{:.1f}")),
    ]
    for name, value in rows:
        print(f"{name:<62s} {value}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
