"""How long a Splitwise handoff is exposed (the prompt's last step end -> the
commit acknowledged at the source), per seed, on the coding workload: 2
prefill instances of llama2-70b-h100, 3 decode instances of llama2-70b-a100,
poisson:6, 300 requests, policy llumnix; every handoff serialized
(``--per-layer-threshold`` above every prompt) and with the default
threshold (512: most coding prompts stream per layer).

    python docs/results/sim/splitwise/handoff_exposure.py OUT.json [--seeds 5]

Run from the repository root of the tree to measure (it imports ``ferry``
from the working directory).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ferry.sim.run import SimOptions, simulate


def run(seed: int, threshold: int | None) -> dict:
    t = time.time()
    extra = {} if threshold is None else {"per_layer_threshold": threshold}
    r = simulate(SimOptions(arrivals="poisson:6", lengths="coding", num_requests=300, seed=seed, progress=False,
                            pools=("prefill:llama2-70b-h100:2", "decode:llama2-70b-a100:3"),
                            instance_args=("--max-handoff-in", "64", "--max-num-seqs", "1024"), **extra), "llumnix")
    h, s = r["sim"]["handoff"], r["summary"]
    return {"seed": seed, "per_layer_threshold": threshold if threshold is not None else "default",
            "serialized": h["serialized"], "per_layer": h["per_layer"],
            "ttft_ms": s["ttft_ms"], "decode_ms": s["decode_ms"], "wall_s": round(time.time() - t, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seeds", type=int, default=5)
    a = ap.parse_args()
    rows = [run(seed, th) for th in (1_000_000, None) for seed in range(a.seeds)]
    print(f"{'threshold':>10} {'seed':>4} {'ser n':>5} {'ser exp mean':>12} {'ser exp max':>11} {'pl n':>4} "
          f"{'pl exp mean':>11} {'TTFT p50':>8} {'TTFT p99':>8} {'dec p99':>7}")
    for r in rows:
        se, pl = r["serialized"], r["per_layer"]
        f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        print(f"{r['per_layer_threshold']:>10} {r['seed']:>4} {se['n']:>5} {f(se['exposed_ms_mean']):>12} "
              f"{f(se['exposed_ms_max']):>11} {pl['n']:>4} {f(pl['exposed_ms_mean']):>11} "
              f"{r['ttft_ms']['p50']:>8.1f} {r['ttft_ms']['p99']:>8.1f} {r['decode_ms']['p99']:>7.1f}")
    for th in (1_000_000, "default"):
        sel = [r for r in rows if r["per_layer_threshold"] == th]
        vals = [r["serialized"]["exposed_ms_mean"] for r in sel if r["serialized"]["n"]]
        if vals:
            print(f"threshold {th}: serialized exposed mean, median over seeds {statistics.median(vals):.1f} ms "
                  f"[{min(vals):.1f}-{max(vals):.1f}]")
    with open(a.out, "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
