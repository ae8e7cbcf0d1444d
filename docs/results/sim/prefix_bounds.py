"""TTFT floors no placement can beat on the prefix workloads of prefix_migration.md (16 x llama-7b-a10,
poisson:8, 800 requests, seeds 0-9): every request alone on an idle instance (chunked prefill of 2048
tokens) whose cache holds everything any earlier request computed (the hit-rate upper bound's infinite
cache): a session turn hits its whole conversation so far, a system-prompt request its system prompt once
an earlier request used it. From the workload and the profile; no simulation.
Usage, from the repository root: python docs/results/sim/prefix_bounds.py OUT.json"""
import json
import sys

import numpy as np

from ferry.measure import prefixes
from services.instance.engine.sim import SimProfile

prof = SimProfile.load("llama-7b-a10")
BS = prof.block_size


def prefill_ms(tokens: int) -> float:
    ms, done = 0.0, 0
    while done < tokens:
        c = min(2048, tokens - done)
        ms += prof.step_ms(1, c, 0)
        done += c
    return ms


def floors(spec: str, seed: int) -> np.ndarray:
    w = prefixes.build("poisson:8", "M-M", 800, spec, seed, max_model_len=13616)  # the runs' clip (their JSON: workload.clip)
    seen_system: set[int] = set()
    out = []
    for r in w.requests:
        if r.session >= 0:  # the conversation so far: the prompt less its new message (the answer's last token not computed)
            context = r.prompt_len - r.segments[0].length
            hit = max(0, context - 1) // BS * BS
        else:
            system = r.segments[0]
            hit = system.length // BS * BS if system.key in seen_system else 0
            seen_system.add(system.key)
        out.append(prefill_ms(max(1, r.prompt_len - hit)))
    return np.array(out)


res = {}
for name, spec in (("sessions", "sessions:4"), ("system", "system:200:2048")):
    res[name] = {}
    for seed in range(10):
        f = floors(spec, seed)
        res[name][seed] = {"ttft_p50_floor_ms": float(np.percentile(f, 50)),
                           "ttft_p99_floor_ms": float(np.percentile(f, 99)), "ttft_mean_floor_ms": float(f.mean())}
        print(name, seed, {k: round(v) for k, v in res[name][seed].items()})
with open(sys.argv[1], "w") as fh:
    json.dump(res, fh, indent=1)
