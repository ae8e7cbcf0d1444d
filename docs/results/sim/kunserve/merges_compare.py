"""KunServe with the live loop's merges against Llumnix with migration, per seed
(docs/kunserve.md, "Merges on the live loop"): reads the per-seed JSON of
`ferry sim kunserve --modes kunserve --seeds S` (bursts_merges_seedS.json)
and the baselines' per-seed results of the earlier runs of the same command
(bursts_base4.5.json, 2026-11-24, all modes; bursts_seed0_live_loop.json,
2026-11-28, seed 0; and where present bursts_migration_rerun_seedS.json, the
migration baseline re-run on 2026-12-03 with `--modes migration`), and writes
bursts_merges.json: per seed, KunServe's P99 TTFT, P50 TBT, preemptions,
merges, and the ratios against migration; the median over seeds [p10-p90].

    python docs/results/sim/kunserve/merges_compare.py
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent


def spread(xs: list[float]) -> dict:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) > 1 else [xs[0]] * 9
    return {"n": len(xs), "median": statistics.median(xs), "p10": q[0], "p90": q[-1], "min": xs[0], "max": xs[-1]}


def main() -> None:
    old = json.loads((HERE / "bursts_base4.5.json").read_text())
    live0 = json.loads((HERE / "bursts_seed0_live_loop.json").read_text())
    rows = []
    for path in sorted(HERE.glob("bursts_merges_seed*.json"), key=lambda p: int(p.stem.removeprefix("bursts_merges_seed"))):
        d = json.loads(path.read_text())
        seed = d["seeds"][0]
        k = d["per_seed"]["kunserve"][0]
        ext = d["extensions"]["kunserve"][0] if isinstance(d["extensions"]["kunserve"], list) else d["extensions"]["kunserve"]
        i = old["seeds"].index(seed)
        bases = {"migration_2026-11-24": old["per_seed"]["migration"][i],
                 "kunserve_own_controller_2026-11-24": old["per_seed"]["kunserve"][i]}
        rerun = HERE / f"bursts_migration_rerun_seed{seed}.json"
        if rerun.exists():  # the baseline re-run on the code of today (2026-12-03)
            bases["migration_rerun"] = json.loads(rerun.read_text())["per_seed"]["migration"][0]
        if seed == live0["seeds"][0]:
            bases["migration_2026-11-28"] = live0["per_seed"]["migration"][0]
            bases["kunserve_live_loop_no_merges_2026-11-28"] = live0["per_seed"]["kunserve"][0]
        row = {"seed": seed, "file": path.name, "p99_ttft_ms": k["ttft_ms"]["p99"], "mean_ttft_ms": k["ttft_ms"]["mean"],
               "p50_tbt_ms": k["decode_ms"]["p50"], "p99_tbt_ms": k["decode_ms"]["p99"],
               "preemptions": k["preemptions"], "slo_violation_pct": k["slo_violation_pct"],
               "drops": ext.get("drops"), "groups_formed": ext.get("groups_formed"), "merges": ext.get("merges"),
               "restores": ext.get("restores"), "freed_blocks": ext.get("freed_blocks"),
               "largest_group": max((len(e["members"]) for e in ext.get("log", [])), default=0),
               "baselines": {}}
        for name, b in bases.items():
            row["baselines"][name] = {"p99_ttft_ms": b["ttft_ms"]["p99"], "p50_tbt_ms": b["decode_ms"]["p50"],
                                      "preemptions": b["preemptions"],
                                      "p99_ttft_over_kunserve": b["ttft_ms"]["p99"] / k["ttft_ms"]["p99"],
                                      "kunserve_p50_tbt_over": k["decode_ms"]["p50"] / b["decode_ms"]["p50"]}
        rows.append(row)
    if not rows:
        sys.exit("no bursts_merges_seed*.json here")
    mig = [r["baselines"]["migration_2026-11-24"] for r in rows]
    out = {"seeds": [r["seed"] for r in rows], "per_seed": rows,
           "kunserve": {key: spread([r[key] for r in rows])
                        for key in ("p99_ttft_ms", "p50_tbt_ms", "p99_tbt_ms", "preemptions", "merges", "slo_violation_pct")},
           "against_migration_2026-11-24": {
               "p99_ttft_over_kunserve": spread([m["p99_ttft_over_kunserve"] for m in mig]),
               "kunserve_p50_tbt_over": spread([m["kunserve_p50_tbt_over"] for m in mig])}}
    rerun = [r for r in rows if "migration_rerun" in r["baselines"]]
    if rerun:
        out["against_migration_rerun"] = {
            "seeds": [r["seed"] for r in rerun],
            **{key: spread([r["baselines"]["migration_rerun"][key] for r in rerun])
               for key in ("p99_ttft_over_kunserve", "kunserve_p50_tbt_over")},
            "same_seeds_against_2026-11-24": {
                key: spread([r["baselines"]["migration_2026-11-24"][key] for r in rerun])
                for key in ("p99_ttft_over_kunserve", "kunserve_p50_tbt_over")}}
    (HERE / "bursts_merges.json").write_text(json.dumps(out, indent=1) + "\n")
    for r in rows:
        m = r["baselines"]["migration_2026-11-24"]
        print(f"seed {r['seed']}: P99 TTFT {r['p99_ttft_ms'] / 1e3:.2f} s ({m['p99_ttft_over_kunserve']:.1f}x below "
              f"migration), P50 TBT {r['p50_tbt_ms']:.1f} ms ({m['kunserve_p50_tbt_over']:.2f}x), "
              f"preemptions {r['preemptions']} (migration {m['preemptions']}), merges {r['merges']}, "
              f"largest group {r['largest_group']}")
    a = out["against_migration_2026-11-24"]
    print("median [p10-p90]: P99 TTFT ratio {median:.1f}x [{p10:.1f}-{p90:.1f}]".format(**a["p99_ttft_over_kunserve"]),
          "P50 TBT ratio {median:.2f}x [{p10:.2f}-{p90:.2f}]".format(**a["kunserve_p50_tbt_over"]))
    if rerun:
        a, b = out["against_migration_rerun"], out["against_migration_rerun"]["same_seeds_against_2026-11-24"]
        for r in rerun:
            m = r["baselines"]["migration_rerun"]
            print(f"seed {r['seed']}, migration re-run: P99 TTFT {m['p99_ttft_ms'] / 1e3:.2f} s "
                  f"({m['p99_ttft_over_kunserve']:.1f}x), P50 TBT {m['p50_tbt_ms']:.1f} ms "
                  f"({m['kunserve_p50_tbt_over']:.2f}x), preemptions {m['preemptions']}")
        print(f"re-run seeds {a['seeds']}: P99 TTFT ratio {a['p99_ttft_over_kunserve']['median']:.1f}x "
              f"(the same seeds against 2026-11-24: {b['p99_ttft_over_kunserve']['median']:.1f}x), P50 TBT ratio "
              f"{a['kunserve_p50_tbt_over']['median']:.2f}x ({b['kunserve_p50_tbt_over']['median']:.2f}x)")


if __name__ == "__main__":
    main()
