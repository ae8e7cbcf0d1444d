"""Before / after tables of `running_prefill_tokens` in the status
(prefix_migration.md, "Prompts in chunks in the status"): per policy and
metric, the median [min-max] over the seeds of each run, and the median of
the per-seed ratios after / before with how many seeds went lower.

    python docs/results/sim/running_prefill/compare.py sessions
    python docs/results/sim/running_prefill/compare.py system
"""

import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
METRICS = (("ttft_ms", "mean"), ("ttft_ms", "p50"), ("ttft_ms", "p99"), ("decode_ms", "mean"), ("decode_ms", "p99"))


def load(workload: str, when: str) -> dict:
    with open(os.path.join(HERE, f"{workload}_{when}.json")) as f:
        return json.load(f)


def spread(vals: list[float]) -> str:
    return f"{statistics.median(vals):,.1f} [{min(vals):,.1f}-{max(vals):,.1f}]"


def main(workload: str) -> None:
    before, after = load(workload, "before"), load(workload, "after")
    print(f"{workload}: median [min-max] over the seeds; after / before: median of the per-seed ratios [min-max]")
    for policy in before["per_seed"]:
        for key, stat in METRICS:
            b = [r[key][stat] for r in before["per_seed"][policy]]
            a = [r[key][stat] for r in after["per_seed"][policy]]
            ratios = [y / x for x, y in zip(b, a)]
            lower = sum(1 for r in ratios if r < 1)
            print(f"  {policy:16} {key.split('_')[0]} {stat:5} before {spread(b):>24}  after {spread(a):>24}  "
                  f"after/before {statistics.median(ratios):.3f} [{min(ratios):.2f}-{max(ratios):.2f}], "
                  f"lower on {lower}/{len(ratios)}")
        hits = [[r["prefix_cache"]["hit_rate"] for r in d["per_seed"][policy]] for d in (before, after)]
        print(f"  {policy:16} hit rate   before {statistics.median(hits[0]):.3f}  after {statistics.median(hits[1]):.3f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sessions")
