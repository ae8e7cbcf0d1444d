"""The llumnix-v0 sensitivity runs (issue 55), one table: for each variant,
the median over seeds of infaas++'s P99 and mean TTFT over llumnix-v0's (the
paper's direction: higher is llumnix better), llumnix-v0's own P99 TTFT and
preemptions. Reads the four `ferry sim compare` JSON files beside this file
(commands in ../policies.md, "llumnix-v0's sensitivity") and writes
summary.json.

    python docs/results/sim/llumnix_v0_sensitivity/table.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
VARIANTS = {"default": "as built", "nopending": "--no-dispatch-pending (the release's dispatch)",
            "prefillfirst": "--prefill-first, 4,096-token budget (vLLM 0.4's scheduling)",
            "unpaced": "--migration-copy-duty=1 (pre-copy unpaced)"}


def main() -> None:
    rows = {}
    for name, what in VARIANTS.items():
        path = HERE / f"{name}.json"
        if not path.exists():
            continue
        d = json.loads(path.read_text())
        inf, v0 = d["per_seed"]["infaas++"], d["per_seed"]["llumnix-v0"]
        p99 = [a["ttft_ms"]["p99"] / b["ttft_ms"]["p99"] for a, b in zip(inf, v0)]
        mean = [a["ttft_ms"]["mean"] / b["ttft_ms"]["mean"] for a, b in zip(inf, v0)]
        rows[name] = {"variant": what, "seeds": d["seeds"], "p99_ttft_infaas_over_v0": p99,
                      "mean_ttft_infaas_over_v0": mean,
                      "v0_p99_ttft_ms": [b["ttft_ms"]["p99"] for b in v0],
                      "v0_preemptions": [b["preemptions"] for b in v0],
                      "v0_decode_p50_ms": [b["decode_ms"]["p50"] for b in v0]}
    (HERE / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("| variant | P99 TTFT infaas++ / llumnix-v0, median [min-max] | mean TTFT ratio | llumnix-v0 P99 TTFT (s) "
          "| its preemptions | its P50 decode (ms) |")
    print("|---|---|---|---|---|---|")
    for r in rows.values():
        p, m = r["p99_ttft_infaas_over_v0"], r["mean_ttft_infaas_over_v0"]
        print(f"| {r['variant']} | {statistics.median(p):.2f}x [{min(p):.2f}-{max(p):.2f}] | "
              f"{statistics.median(m):.2f}x [{min(m):.2f}-{max(m):.2f}] | "
              f"{statistics.median(r['v0_p99_ttft_ms']) / 1e3:.2f} | {statistics.median(r['v0_preemptions']):.0f} | "
              f"{statistics.median(r['v0_decode_p50_ms']):.1f} |")


if __name__ == "__main__":
    main()
