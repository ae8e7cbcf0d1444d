"""Issue 53's simulator targets from one `ferry sim compare --prefix agentic...` JSON: per policy the median
[p10-p90] over seeds of the program metrics (ferry/measure/programs.py), then the candidate's per-seed ratio to
the best baseline of each metric (the baseline with the best median: the lowest, but for programs completed the
highest),
median [p10-p90] (ferry/sim/stats.spread). Prints markdown; --json writes the same numbers.

    python docs/results/sim/agentic_keep.py docs/results/sim/agentic_keep.json [MORE.json ...] \
        --candidate llumnix-keep --baselines llumnix-prefix,continuum [--json OUT]

Several JSONs (runs of the same command with other --policies) are read as one: their per-seed results merged
by policy name. A run with --capacity-bound adds the floor (summary.programs_floor: one cache of the cluster's
every block, Belady's eviction) of its seeds' prefix recomputed fraction.
"""

from __future__ import annotations

import argparse
import json

from ferry.sim.stats import spread

# (label, getter over one seed's summary, digits, issue 53's target for candidate / best baseline or None)
METRICS = (
    ("prefix recomputed (fraction)", lambda s: s["programs"]["prefix_recomputed_fraction"], 3, 0.2),
    ("prefix recomputed (M tokens)", lambda s: s["programs"]["prefix_recomputed_tokens"] / 1e6, 2, 0.2),
    ("returning computed (fraction)", lambda s: s["programs"]["returning_computed_fraction"], 3, None),
    ("PCT p50 (s)", lambda s: s["programs"]["completion_ms"]["p50"] / 1e3, 0, 1.0),
    ("PCT p99 (s)", lambda s: s["programs"]["completion_ms"]["p99"] / 1e3, 0, 0.7),
    ("turn TTFT p50 (ms)", lambda s: s["programs"]["turn_ttft_ms"]["p50"], 0, None),
    ("turn TTFT p99 (ms)", lambda s: s["programs"]["turn_ttft_ms"]["p99"], 0, None),
    ("preemptions", lambda s: s["preemptions"], 0, None),
    ("migrations", lambda s: s["migrations"], 0, None),
    ("programs completed", lambda s: s["programs"]["programs_completed"] / s["programs"]["programs"], 2, None),
)


def fmt(sp: dict, digits: int) -> str:
    if sp["median"] is None:
        return "-"
    return f"{sp['median']:,.{digits}f} [{sp['p10']:,.{digits}f}-{sp['p90']:,.{digits}f}]"


def analyse(per_seed: dict[str, list[dict]], candidate: str, baselines: list[str]) -> dict:
    policies = [*baselines, candidate]
    n = {len(per_seed[p]) for p in policies}
    assert len(n) == 1, f"policies ran different numbers of seeds: {n}"
    out = {"seeds": n.pop(), "policies": {}, "ratios": {}}
    for p in policies:
        out["policies"][p] = {label: spread([get(s) for s in per_seed[p]]) for label, get, _, _ in METRICS}
    for label, get, _, target in METRICS:
        sign = -1 if label == "programs completed" else 1
        best = min(baselines, key=lambda b: sign * out["policies"][b][label]["median"])
        vals = [get(c) / get(b) if get(b) else None for c, b in zip(per_seed[candidate], per_seed[best], strict=True)]
        out["ratios"][label] = {"best_baseline": best, "target": target, **spread(vals), "per_seed": vals}
    return out


def markdown(res: dict, candidate: str) -> str:
    pols = list(res["policies"])
    lines = [f"Medians over {res['seeds']} seeds [p10-p90]:", "", "| metric | " + " | ".join(pols) + " |",
             "|---" * (len(pols) + 1) + "|"]
    for label, _, digits, _ in METRICS:
        lines.append(f"| {label} | " + " | ".join(fmt(res["policies"][p][label], digits) for p in pols) + " |")
    lines += ["", f"{candidate} / the best baseline, per seed, median [p10-p90]:", "",
              "| metric | best baseline | ratio | target |", "|---|---|---|---|"]
    for label, _, _, _ in METRICS:
        r = res["ratios"][label]
        t = "-" if r["target"] is None else f"<= {r['target']:g}"
        lines.append(f"| {label} | {r['best_baseline']} | {fmt(r, 3)} | {t} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--candidate", default="llumnix-keep")
    ap.add_argument("--baselines", default="llumnix-prefix,continuum")
    ap.add_argument("--json")
    a = ap.parse_args()
    per_seed: dict[str, list[dict]] = {}
    for path in a.paths:
        with open(path) as f:
            per_seed.update(json.load(f)["per_seed"])
    res = analyse(per_seed, a.candidate, a.baselines.split(","))
    floors = [s["programs_floor"]["prefix_recomputed_fraction"] for runs in per_seed.values() for s in runs
              if "programs_floor" in s]
    if floors:
        res["floor_prefix_recomputed_fraction"] = spread(floors[: res["seeds"]])
    print(markdown(res, a.candidate))
    if floors:
        print(f"\nfloor of the prefix recomputed fraction (--capacity-bound): "
              f"{fmt(res['floor_prefix_recomputed_fraction'], 4)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
