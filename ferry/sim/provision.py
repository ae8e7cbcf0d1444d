"""The Splitwise provisioning study on the simulator (pure search over
simulated runs; the command is ferry/sim/splitwise_cli.py).

Designs (Splitwise, ISCA'24): Baseline-A100 and Baseline-H100 are mixed
instances of one machine type; Splitwise-XY runs prompts on a pool of X
machines and tokens on a pool of Y machines (A: DGX-A100, H: DGX-H100, Hcap:
DGX-H100 power-capped). A configuration is a machine count per pool.

SLOs, as the Splitwise paper sets them, are multiples of each request's
latency on an unloaded reference machine (a DGX-A100 running the request
alone): the 99th percentile over requests of the slowdown (measured /
unloaded) of TTFT, of TBT (the request's mean time between tokens after the
first: it includes the handoff) and of E2E. A run meets the SLOs when every
request completed and the three P99 slowdowns are within ``Slo``.

Searches (every run is one ``simulate`` call, cached by its inputs):
- ``max_rate``: the highest Poisson rate a configuration serves within the
  SLOs: a geometric bracket (x1.25; x1.1 around the first seed's result for
  the other seeds) from a first guess, then bisection down to
  ``rate_precision`` (the rate is assumed to pass below a failing one);
- ``best_config``: over the configurations that fit a power or cost budget,
  hill-climbing on the prompt-machine count from a balanced start (the
  throughput is assumed unimodal in it), on the first seed only;
- ``cheapest``: for a target rate, the least-cost configuration that meets
  the SLOs on every seed, trying prompt-machine counts around the balance
  and the fewest token machines for each.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ferry.sim.params import Delays
from ferry.sim.run import SimOptions, simulate
from services.instance.engine.base import IntegrityError
from services.instance.engine.sim import SimProfile

REFERENCE = "llama2-70b-a100"
POLICY = "infaas++"  # least memory load with queued demand, no migration: the baselines do not migrate


@dataclass(frozen=True)
class Slo:
    """P99 slowdown limits over the unloaded reference machine."""

    ttft: float = 6.0
    tbt: float = 5.0
    e2e: float = 5.0


@dataclass(frozen=True)
class Design:
    name: str
    prompt: str | None  # prompt pool's profile; None: a baseline of mixed machines
    token: str  # token pool's profile (the mixed machines' for a baseline)

    @property
    def split(self) -> bool:
        return self.prompt is not None


DESIGNS = (
    Design("Baseline-A100", None, "llama2-70b-a100"),
    Design("Baseline-H100", None, "llama2-70b-h100"),
    Design("Splitwise-AA", "llama2-70b-a100", "llama2-70b-a100"),
    Design("Splitwise-HH", "llama2-70b-h100", "llama2-70b-h100"),
    Design("Splitwise-HA", "llama2-70b-h100", "llama2-70b-a100"),
    Design("Splitwise-HHcap", "llama2-70b-h100", "llama2-70b-h100cap"),
)


def profile(name: str) -> SimProfile:
    p = SimProfile.load(name)
    if not (p.machine_power_w > 0 and p.machine_cost > 0):
        raise ValueError(f"profile {name!r} has no machine power or cost (machine_power_w, machine_cost)")
    return p


@dataclass(frozen=True)
class Config:
    """Machines per pool: (prompt, token) for Splitwise, (0, n) for a baseline."""

    design: Design
    prompt: int
    token: int

    def pools(self) -> tuple[str, ...]:
        d = self.design
        if not d.split:
            return (f"mixed:{d.token}:{self.token}",)
        return (f"prefill:{d.prompt}:{self.prompt}", f"decode:{d.token}:{self.token}")

    def _sum(self, attr: str) -> float:
        d = self.design
        total = self.token * getattr(profile(d.token), attr)
        if d.split:
            total += self.prompt * getattr(profile(d.prompt), attr)
        return total

    @property
    def power_w(self) -> float:
        return self._sum("machine_power_w")

    @property
    def cost(self) -> float:
        return self._sum("machine_cost")

    def label(self) -> str:
        return f"{self.prompt}P+{self.token}T" if self.design.split else f"{self.token} mixed"

    def to_dict(self) -> dict:
        return {"prompt_machines": self.prompt, "token_machines": self.token, "pools": list(self.pools()),
                "power_kw": round(self.power_w / 1000, 3), "cost": round(self.cost, 3)}


def configs_within(design: Design, budget: float, measure: str) -> list[Config]:
    """Every configuration that fits ``budget`` of ``measure`` ("power_w" or
    "cost") and to which no machine of either pool can be added."""
    unit = "machine_power_w" if measure == "power_w" else "machine_cost"
    ut = getattr(profile(design.token), unit)
    if not design.split:
        n = math.floor(budget / ut + 1e-9)
        return [Config(design, 0, n)] if n >= 1 else []
    up = getattr(profile(design.prompt), unit)
    out = []
    for p in range(1, math.floor(budget / up + 1e-9) + 1):
        t = math.floor((budget - p * up) / ut + 1e-9)
        if t >= 1:
            out.append(Config(design, p, t))
    return out


# --- SLOs --------------------------------------------------------------------------------

def unloaded(ref: SimProfile, prompt: int, output: int, budget_tokens: int, delays: Delays) -> tuple[float, float, float]:
    """(TTFT, TBT, E2E) seconds of a request alone on ``ref``: its prompt in
    chunks of the step's token budget, then one-request decode steps at its
    mean context; plus the control plane's dispatch, generate and token delays."""
    ttft, left = delays.dispatch_s + delays.generate_s + delays.token_s, prompt
    while left > 0:
        chunk = min(left, budget_tokens)
        ttft += ref.step_ms(1, chunk if chunk > 1 else 0, 0 if chunk > 1 else 1) / 1000.0
        left -= chunk
    tbt = ref.step_ms(1, 0, prompt + output // 2) / 1000.0
    return ttft, tbt, ttft + max(0, output - 1) * tbt


def p99_slowdowns(records: list[dict], ref: SimProfile, budget_tokens: int, delays: Delays) -> dict:
    ttft, tbt, e2e = [], [], []
    for r in records:
        t0, b0, e0 = unloaded(ref, r["prompt_len"], r["output_len"], budget_tokens, delays)
        ttft.append(r["ttft_s"] / t0)
        e2e.append(r["e2e_s"] / e0)
        if r["decode_s"] is not None:
            tbt.append(r["decode_s"] / b0)
    p99 = (lambda v: float(np.percentile(v, 99)) if v else 0.0)
    return {"ttft": p99(ttft), "tbt": p99(tbt), "e2e": p99(e2e)}


# --- runs --------------------------------------------------------------------------------

@dataclass
class Point:
    rate: float
    seed: int
    ok: bool
    p99: dict
    completed: int
    requests: int
    handoff: dict | None = None

    def to_dict(self) -> dict:
        d = {"rate_rps": self.rate, "seed": self.seed, "meets_slo": self.ok,
             "p99_slowdown": {k: round(v, 3) if isinstance(v, float) else v for k, v in self.p99.items()},
             "completed": self.completed, "requests": self.requests}
        if self.handoff and self.handoff.get("handoffs"):
            d["handoff"] = self.handoff
        return d


@dataclass
class Study:
    lengths: str
    num_requests: int
    seeds: tuple[int, ...]
    slo: Slo = field(default_factory=Slo)
    # Handoffs are not rate limited like migrations, and machines batch until memory is full (Splitwise's
    # token machines): neither flag changes a mixed cluster (no handoffs) except the batch cap.
    instance_args: tuple[str, ...] = ("--max-handoff-in", "64", "--max-num-seqs", "1024")
    rate_precision: float = 1.05
    per_layer_threshold: int | None = None  # None: handoff_mode's default
    log: Callable[[str], None] | None = None
    runs: int = 0
    _cache: dict = field(default_factory=dict)

    def __post_init__(self):
        self.ref = profile(REFERENCE)
        self.delays = Delays()
        self.budget_tokens = 2048  # InstanceConfig's max_num_batched_tokens default (not overridden here)

    def point(self, cfg: Config, rate: float, seed: int) -> Point:
        rate = float(f"{rate:.4g}")
        key = (cfg.pools(), rate, seed)
        if key in self._cache:
            return self._cache[key]
        extra = {} if self.per_layer_threshold is None else {"per_layer_threshold": self.per_layer_threshold}
        opts = SimOptions(arrivals=f"poisson:{rate}", lengths=self.lengths, num_requests=self.num_requests,
                          seed=seed, instance_args=self.instance_args, pools=cfg.pools(), progress=False,
                          report_clip=False,
                          **extra)
        try:
            run = simulate(opts, POLICY, label=f"{cfg.design.name} {cfg.label()}")
        except RuntimeError as e:  # stalled: a request that can never run
            pt = Point(rate, seed, False, {"error": str(e)}, 0, self.num_requests)
        else:
            left = run["sim"]["left_at_end"]
            if any(left.values()):  # a bug, never a result: stop the study
                raise IntegrityError(f"{cfg.design.name} {cfg.label()} at {rate}/s seed {seed}: left at the end {left}")
            recs = run["requests"]
            done = [r for r in recs if r["error"] is None and r["finished_at"] is not None]
            p99 = p99_slowdowns(done, self.ref, self.budget_tokens, self.delays)
            ok = (len(done) == len(recs) and p99["ttft"] <= self.slo.ttft and p99["tbt"] <= self.slo.tbt
                  and p99["e2e"] <= self.slo.e2e)
            pt = Point(rate, seed, ok, p99, len(done), len(recs), run["sim"].get("handoff"))
        self.runs += 1
        if self.log:
            self.log(f"  {cfg.design.name:16} {cfg.label():10} {rate:8.4g}/s seed {seed}: "
                     f"{'ok  ' if pt.ok else 'FAIL'} p99 slowdown " +
                     " ".join(f"{k} {v:.2f}" for k, v in pt.p99.items() if isinstance(v, float)))
        self._cache[key] = pt
        return pt

    def max_rate(self, cfg: Config, seed: int, guess: float, step: float = 1.25) -> tuple[float, list[Point]]:
        """The highest rate meeting the SLOs: bracketed by factors of ``step``
        from ``guess``, then bisected (0 if even guess / step**12 fails)."""
        tried: list[Point] = []
        lo, hi = None, None
        r = guess
        for _ in range(12):
            pt = self.point(cfg, r, seed)
            tried.append(pt)
            if pt.ok:
                lo = r
                if hi is not None:
                    break
                r *= step
            else:
                hi = r
                if lo is not None:
                    break
                r /= step
        if lo is None:
            return 0.0, tried
        if hi is None:
            return lo, tried
        while hi / lo > self.rate_precision:
            mid = math.sqrt(lo * hi)
            pt = self.point(cfg, mid, seed)
            tried.append(pt)
            if pt.ok:
                lo = mid
            else:
                hi = mid
        return float(f"{lo:.4g}"), tried


# --- analytic starting points (only where searches begin) -------------------------------

def machine_rates(design: Design, prompt_mean: float, output_mean: float,
                  max_step_ms: float = 44.0) -> tuple[float, float]:
    """(requests/s one prompt machine, one token machine could serve) by the
    step model: 2,048-token prompt steps; decode steps of the largest batch
    (up to 1,024) whose step stays within ``max_step_ms`` (about 3x the
    reference machine's unloaded TBT). Where searches start, never a result."""
    tok = profile(design.token)
    ctx = prompt_mean + output_mean / 2
    per_req = tok.decode_ms_per_seq + tok.decode_ms_per_kv_token * ctx
    batch = int(min(1024, max(1, (max_step_ms - tok.decode_base_ms) // per_req)))
    decode_rps = batch / (tok.step_ms(batch, 0, int(batch * ctx)) / 1000) / max(1.0, output_mean)
    pro = profile(design.prompt or design.token)
    prompt_rps = 2048 / (pro.step_ms(1, 2048, 0) / 1000) / prompt_mean
    return prompt_rps, decode_rps


def capacity_guess(cfg: Config, prompt_mean: float, output_mean: float) -> float:
    """Requests/s of a configuration if only its busiest pool limited it."""
    prompt_rps, decode_rps = machine_rates(cfg.design, prompt_mean, output_mean)
    if not cfg.design.split:  # one machine does both: the times add
        return cfg.token / (1 / prompt_rps + 1 / decode_rps)
    return min(cfg.prompt * prompt_rps, cfg.token * decode_rps)
