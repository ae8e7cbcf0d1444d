"""Where the decode p99 of a simulated run comes from (prefix_migration.md,
"Decode p99 on sessions"): runs the doc's workload for some seeds and
policies with two probes, the steps that compute prompt tokens (each step's
prefill tokens and the requests decoding in it) and every dispatch (the
request's missed tokens where it went, the running requests there and the
fewest running anywhere, whether an instance held more of its prompt), and
writes per policy and seed:

- decode p99, and decode p99 with each request's share of its steps' prefill
  time taken out (prefill tokens x the profile's prefill_ms_per_token, over
  its tokens after the first);
- big steps (>= BIG prefill tokens): how many, the requests decoding in
  them on average, and how many of those had at most SHORT output tokens;
- the placements of BIG missed tokens or more, by kind: ``holder`` (went to
  the instance holding most of its prompt, held somewhere), ``nohit`` (held
  nowhere), ``away`` (an instance held more than where it went): how many,
  the mean running requests where each went and the mean fewest running.

``--interference``: llumnix-prefix's tier-2 cost becomes the experiment of
that section, ``queued prefill + missed tokens x the batch`` (the latency its
prefill adds summed over the requests it delays) instead of ``queued prefill
+ missed tokens``; the policy's code is not changed.

Usage (from the repository root; about 11 s of one core per run):
  python docs/results/sim/decode_p99_stalls.py --seeds 0-9 --prefix sessions:4 \
      --policies llumnix-prefix,sglang-cache-aware --json OUT.json
The probes wrap the simulator's step timing and Dispatcher.choose; they
change nothing the runs do (the same summaries as `ferry sim compare`)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from ferry.sim import instance as siminst  # noqa: E402
from ferry.sim import run as simrun  # noqa: E402
from libs.common.policies import base, llumnix_prefix  # noqa: E402
from libs.common.policies.base import blocks_for, fit_key, hit_blocks  # noqa: E402
from libs.common.policies.freeness import llumnix_dispatch_terms, queued_prefill_tokens  # noqa: E402

BIG = 1024  # prefill tokens: half a chunk (--max-num-batched-tokens 2048) or more
SHORT = 32  # output tokens: a request whose mean TBT one big step can double

STEPS: list = []  # (prefill tokens, ids of the requests decoding in the step)
DISPATCHES: list = []


def _probe() -> None:
    advance, choose = siminst._Timed._advance, base.Dispatcher.choose

    def timed(self, chunks):
        advance(self, chunks)
        pf = sum(c.num_new for c in chunks if c.num_new > 1)
        if pf:
            STEPS.append((pf, tuple(c.request.request_id for c in chunks if c.num_new == 1)))

    def chosen(self, views, req):
        iid = choose(self, views, req)
        if iid is not None and len(views) > 1:
            v = next(w for w in views if w.instance_id == iid)
            bs = max(1, v.status.block_size)
            DISPATCHES.append(dict(missed=req.num_prompt_tokens - hit_blocks(v, req) * bs,
                                   hit=hit_blocks(v, req), most=max(hit_blocks(w, req) for w in views),
                                   running=v.status.num_running,
                                   fewest=min(w.status.num_running for w in views)))
        return iid

    siminst._Timed._advance, base.Dispatcher.choose = timed, chosen


def interference_key(v, req) -> tuple:
    """llumnix_prefix.prefix_key with the tier-2 cost ``queued + missed x batch``."""
    t = llumnix_dispatch_terms(v)
    if t.terminating:
        return (-1, 0.0, 0.0)
    bs = max(1, v.status.block_size)
    hit = hit_blocks(v, req)
    tier, value = fit_key(t.total, t.usage + blocks_for(req.num_prompt_tokens, bs) - hit, t.batch)
    cost = queued_prefill_tokens(v) + (req.num_prompt_tokens - hit * bs) * t.batch
    if tier == 1 and value >= llumnix_prefix.ROOMY:
        return (2, -cost, value)
    return (tier, value, -cost)


def analyse(run: dict, prefill_ms_per_token: float) -> dict:
    recs = {f"req-{q['index']}": q for q in run["requests"]}
    stall = defaultdict(float)
    for pf, dec in STEPS:
        for rid in dec:
            stall[rid] += prefill_ms_per_token * pf
    dec_ms = {rid: q["decode_s"] * 1000 for rid, q in recs.items() if q.get("decode_s") is not None}
    clean = [v - stall[rid] / (recs[rid]["tokens"] - 1) for rid, v in dec_ms.items()]
    big = [(pf, dec) for pf, dec in STEPS if pf >= BIG]
    kinds = defaultdict(list)
    for d in DISPATCHES:
        if d["missed"] >= BIG:
            kind = "nohit" if d["most"] == 0 else ("holder" if d["hit"] == d["most"] else "away")
            kinds[kind].append((d["running"], d["fewest"]))
    return {
        "decode_p99_ms": float(np.percentile(list(dec_ms.values()), 99)),
        "decode_p99_without_prefill_ms": float(np.percentile(clean, 99)),
        "big_steps": len(big),
        "decoding_per_big_step": float(np.mean([len(dec) for _, dec in big])) if big else 0.0,
        "short_in_big_steps": sum(1 for _, dec in big for rid in dec if recs[rid]["tokens"] <= SHORT),
        "big_placements": {k: {"n": len(v), "running": float(np.mean([a for a, _ in v])),
                               "fewest_running": float(np.mean([b for _, b in v]))} for k, v in sorted(kinds.items())},
    }


def seeds_of(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


@click.command()
@click.option("--seeds", default="0-9")
@click.option("--prefix", default="sessions:4")
@click.option("--policies", default="llumnix-prefix,sglang-cache-aware")
@click.option("--json", "out", default=None)
@click.option("--interference", is_flag=True, help="llumnix-prefix with the experiment's cost (module docstring)")
def main(seeds: str, prefix: str, policies: str, out: str | None, interference: bool) -> None:
    _probe()
    if interference:
        llumnix_prefix.prefix_key = interference_key
    res: dict = {"prefix": prefix, "interference": interference, "big": BIG, "short": SHORT, "per_seed": defaultdict(list)}
    for seed in seeds_of(seeds):
        for pol in policies.split(","):
            STEPS.clear()
            DISPATCHES.clear()
            opts = simrun.SimOptions(arrivals="poisson:8", prefix=prefix, num_requests=800, seed=seed,
                                     instances=16, profile="llama-7b-a10", progress=False)
            run = simrun.simulate(opts, pol)
            a = analyse(run, simrun.profile_of(opts).prefill_ms_per_token)
            res["per_seed"][pol].append(a)
            click.echo(f"{pol} seed {seed}: {json.dumps(a)}", err=True)
    res["median"] = {}
    for pol, rows in res["per_seed"].items():
        med = {k: float(np.median([r[k] for r in rows])) for k in rows[0] if k != "big_placements"}
        for kind in ("holder", "nohit", "away"):
            got = [r["big_placements"][kind] for r in rows if kind in r["big_placements"]]
            med[kind] = {k: float(np.median([g[k] for g in got])) for k in ("n", "running", "fewest_running")}
        res["median"][pol] = med
        click.echo(f"{pol}: {json.dumps(med)}")
    if out:
        Path(out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
