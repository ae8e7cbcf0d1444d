"""Lower bounds no policy can beat (M-M, poisson:17, 2800 requests, seeds 0-9): every request alone on
an idle llama-7b-a10 instance (batch 1, chunked prefill of 2048 tokens), from the workload and the profile.
Usage, from the repository root: python docs/results/sim/policy_bounds.py HIGH_FRACTION OUT.json"""
import json
import sys

import numpy as np

from ferry.measure import workload as wl
from services.instance.engine.sim import SimProfile

prof = SimProfile.load("llama-7b-a10")
def ideal(p, o):
    ttft, done = 0.0, 0
    while done < p:
        c = min(2048, p - done)
        ttft += prof.step_ms(1, c, 0)
        done += c
    k = np.arange(1, max(1, o))
    dec = float(np.sum(prof.decode_base_ms + prof.decode_ms_per_seq + prof.decode_ms_per_kv_token * (p + k))) if o > 1 else 0.0
    return ttft, ttft + dec
hp = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
out = {}
for seed in range(10):
    w = wl.build("poisson:17", "M-M", 2800, seed, 1.0, hp, prof.max_model_len)
    t = [ideal(r.prompt_len, r.output_len) for r in w.requests]
    ttft = np.array([x[0] for x in t])
    e2e = np.array([x[1] for x in t])
    hi = np.array([r.priority == "high" for r in w.requests])
    row = {"ttft_p99_floor_ms": float(np.percentile(ttft, 99))}
    if hp:
        row["high_e2e_p99_floor_ms"] = float(np.percentile(e2e[hi], 99))
        row["normal_e2e_p99_floor_ms"] = float(np.percentile(e2e[~hi], 99))
    else:
        row["e2e_p99_floor_ms"] = float(np.percentile(e2e, 99))
    out[seed] = row
    print(seed, {k: round(v) for k, v in row.items()})
with open(sys.argv[2], "w") as fh:
    json.dump(out, fh, indent=1)
