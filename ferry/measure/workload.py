"""Benchmark workloads: when each request arrives, how long its prompt and
output are, and its priority. Pure and seeded: the same spec and seed give the
same workload on every machine, so policies are compared on identical input.

Arrival specs: ``poisson:RATE``, ``gamma:RATE:CV``, ``phases:RATE@SECONDS,...``
(a Poisson process whose rate steps through the phases and starts over after
the last: ``phases:4@60,12@60`` alternates a minute at 4/s and a minute at
12/s; a time-varying load for auto-scaling), ``trace:PATH`` (an Azure LLM
inference trace CSV; its TIMESTAMP column). ``time_scale`` divides every
arrival time (2 = twice the rate).

Length specs: ``sharegpt`` (the ShareGPT stats CSV in the traces folder, input
and output drawn together), ``S``/``M``/``L`` pairs like ``M-M`` or ``S-L``
(input-output, the Llumnix paper's generated power-law distributions, Table 1),
``fixed:IN:OUT``, ``trace`` (the Azure trace's ContextTokens/GeneratedTokens,
its first n rows in order), ``conv`` (rows of the Azure conversation trace
drawn at random with the seed: its lengths under any arrivals, a different
sample per seed), ``coding`` (a generated coding-like workload: long prompts,
short outputs; CODING below).
"""

from __future__ import annotations

import csv
import datetime as dt
import functools
import os
import pathlib
from dataclasses import dataclass

import numpy as np

AZURE_CONV = "AzureLLMInferenceTrace_conv.csv"
SHAREGPT_STATS = "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
POWER_LAW_MAX = 6000

# The paper gives means, quantiles and the 6k maximum of S/M/L but not the
# formula. A shifted power law P(x) ∝ (x + c)^-a on [1, 6000], with `a` solved
# so the mean is exact and `c` fitted to the quantiles, lands within ~15% of
# every quantile in Table 1 (see tests/bench/test_workload.py):
#          mean  p50  p80  p95   p99     (paper: p50/p80/p95/p99)
#   S c=50  128   38  133  491  1655     (38/113/413/1464)
#   M c=9.5 256   30  197 1407  4106     (32/173/1288/4208)
#   L c=4   512   55  605 3102  5228     (55/582/3113/5166)
POWER_LAW = {"S": (128.0, 50.0), "M": (256.0, 9.5), "L": (512.0, 4.0)}

# ``coding``: a coding-like workload (code completion: long prompts, short
# outputs) GENERATED here, not a trace. The Splitwise paper (ISCA'24) runs a
# production coding trace this repository does not carry; our reading of the
# paper is that its median prompt is about 1,500 tokens and its median output
# about 13 tokens (the project's slides only say "coding" vs "conversation").
# Prompt and output are independent log-normals with those medians:
#   prompt = round(exp(N(ln 1500, 0.6))) clipped to [64, 4000]
#            (p10/p50/p90 about 690/1500/3240 tokens, mean about 1,730)
#   output = round(exp(N(ln 13, 0.9))) clipped to [1, 512]
#            (p10/p50/p90 about 4/13/41 tokens, mean about 19)
# The spreads (sigma) are this project's choice.
CODING = {"prompt": (1500.0, 0.6, 64, 4000), "output": (13.0, 0.9, 1, 512)}


class WorkloadError(ValueError):
    """A bad workload spec; the message says what is accepted."""


@dataclass(frozen=True)
class Segment:
    """A run of ``length`` prompt tokens drawn from ``key`` (prefixes.py): the
    same key gives the same tokens everywhere, so prompts that share
    segments share prefixes."""

    key: int
    length: int


@dataclass(frozen=True)
class Request:
    index: int
    arrival_s: float  # seconds after the start of the run (a later session turn: its session's start)
    prompt_len: int  # (a session turn: its whole context, earlier turns and answers included)
    output_len: int
    priority: str  # "high" | "normal"
    clipped: bool = False
    # Prefix structure (prefixes.py): the prompt's segments (a session turn:
    # its new message only); () = random tokens of its own.
    segments: tuple[Segment, ...] = ()
    session: int = -1  # >= 0: a turn of this session (sent after the previous one ended)
    turn: int = 0
    think_s: float = 0.0  # a later turn: sent this long after the previous answer ended


@dataclass(frozen=True)
class ClipReport:
    max_model_len: int
    clipped: int
    total: int
    tokens_before: int
    tokens_after: int

    @property
    def fraction(self) -> float:
        return self.clipped / self.total if self.total else 0.0

    def line(self) -> str:
        return (f"clipped {self.clipped}/{self.total} requests ({self.fraction:.1%}) to {self.max_model_len} "
                f"tokens; {self.tokens_before - self.tokens_after} tokens dropped")


@dataclass(frozen=True)
class Workload:
    requests: list[Request]
    arrivals: str
    lengths: str
    seed: int
    time_scale: float
    clip: ClipReport | None
    prefix: str = "none"  # the prefix structure (prefixes.py)

    @property
    def duration_s(self) -> float:
        return max((q.arrival_s for q in self.requests), default=0.0)

    def describe(self) -> dict:
        r = self.requests
        pl = np.array([q.prompt_len for q in r]) if r else np.zeros(1)
        ol = np.array([q.output_len for q in r]) if r else np.zeros(1)
        return {"arrivals": self.arrivals, "lengths": self.lengths, "prefix": self.prefix, "seed": self.seed,
                "time_scale": self.time_scale, "num_requests": len(r), "duration_s": self.duration_s,
                "rate_rps": (len(r) - 1) / self.duration_s if self.duration_s > 0 else None,
                "prompt_len_mean": float(pl.mean()), "output_len_mean": float(ol.mean()),
                "prompt_len_max": int(pl.max()), "output_len_max": int(ol.max()),
                "high_priority": sum(q.priority == "high" for q in r),
                "clip": None if self.clip is None else {**self.clip.__dict__, "fraction": self.clip.fraction}}


# The repository's own traces (data/traces, each with its license).
DEFAULT_TRACES_DIR = pathlib.Path(__file__).resolve().parents[2] / "data" / "traces"


def traces_dir(explicit: str | None = None) -> pathlib.Path:
    """--traces-dir, else $FERRY_TRACES_DIR, else the repository's data/traces."""
    if explicit:
        return pathlib.Path(explicit)
    if os.environ.get("FERRY_TRACES_DIR"):
        return pathlib.Path(os.environ["FERRY_TRACES_DIR"])
    return DEFAULT_TRACES_DIR


def trace_file(spec_path: str, folder: pathlib.Path) -> pathlib.Path:
    """A trace file given as a path, or a name in the traces folder."""
    return _csv_path(spec_path, folder)


def _csv_path(spec_path: str, folder: pathlib.Path) -> pathlib.Path:
    p = pathlib.Path(spec_path)
    if not p.is_file() and (folder / spec_path).is_file():
        p = folder / spec_path
    if not p.is_file():
        raise WorkloadError(f"trace file not found: {spec_path} (also looked in {folder}; "
                            f"set --traces-dir or FERRY_TRACES_DIR)")
    return p


# --- arrivals --------------------------------------------------------------------

def _parse_timestamp(s: str) -> float:
    # Azure writes 7 fractional digits; datetime takes at most 6.
    head, _, frac = s.strip().partition(".")
    t = dt.datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp()
    return t + (float("0." + frac) if frac else 0.0)


@functools.lru_cache(maxsize=4)
def load_azure(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seconds since the first request, context tokens, generated tokens)."""
    ts, ctx, gen = [], [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            ts.append(_parse_timestamp(row["TIMESTAMP"]))
            ctx.append(int(row["ContextTokens"]))
            gen.append(int(row["GeneratedTokens"]))
    t = np.array(ts)
    return t - t[0], np.array(ctx), np.array(gen)


def _positive(v: float, spec: str) -> float:
    if not v > 0:
        raise WorkloadError(f"rate and CV must be > 0 in {spec!r}")
    return v


def _phases(spec: str, args: str) -> list[tuple[float, float]]:
    phases = []
    for part in args.split(","):
        rate, at, secs = part.partition("@")
        if not at:
            raise WorkloadError(f"phase {part!r} in {spec!r}: use RATE@SECONDS")
        rate_v, secs_v = float(rate), float(secs)
        if not (rate_v >= 0 and secs_v > 0):
            raise WorkloadError(f"phase {part!r} in {spec!r}: the rate must be >= 0 and the seconds > 0")
        phases.append((rate_v, secs_v))
    if not any(r > 0 for r, _ in phases):
        raise WorkloadError(f"every phase of {spec!r} has rate 0")
    return phases


def phase_arrivals(phases: list[tuple[float, float]], n: int, rng: np.random.Generator) -> np.ndarray:
    """n arrivals of a Poisson process with a piecewise-constant rate, the
    phases repeating. Within a phase the gaps are exponential; a gap that
    runs past the phase's end is dropped and drawing starts again at the
    boundary at the next phase's rate (exact: the process is memoryless)."""
    out: list[float] = []
    start, i = 0.0, 0
    while len(out) < n:
        rate, secs = phases[i % len(phases)]
        end = start + secs
        t = start
        while rate > 0 and len(out) < n:
            t += rng.exponential(1.0 / rate)
            if t >= end:
                break
            out.append(t)
        start, i = end, i + 1
    return np.array(out)


def arrival_times(spec: str, n: int, rng: np.random.Generator, folder: pathlib.Path) -> np.ndarray:
    """n arrival times in seconds, the first at 0, before time scaling."""
    kind, _, rest = spec.partition(":")
    args = rest.split(":") if rest else []
    try:
        if kind == "poisson" and len(args) == 1:
            rate = _positive(float(args[0]), spec)
            gaps = rng.exponential(1.0 / rate, n)
        elif kind == "gamma" and len(args) == 2:
            rate, cv = _positive(float(args[0]), spec), _positive(float(args[1]), spec)
            shape = 1.0 / (cv * cv)  # a Gamma's CV is 1/sqrt(shape)
            gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
        elif kind == "phases" and rest:
            t = phase_arrivals(_phases(spec, rest), n, rng)
            return t - t[0]
        elif kind == "trace" and rest:
            t, _, _ = load_azure(str(_csv_path(rest, folder)))
            if n > len(t):
                raise WorkloadError(f"the trace has {len(t)} requests; asked for {n}")
            return t[:n].astype(float)
        else:
            raise WorkloadError(f"unknown arrivals {spec!r}; use poisson:RATE, gamma:RATE:CV, "
                                f"phases:RATE@SECONDS,... or trace:PATH")
    except ValueError as e:
        if isinstance(e, WorkloadError):
            raise
        raise WorkloadError(f"bad number in arrivals {spec!r}: {e}") from e
    t = np.cumsum(gaps)
    return t - t[0]


# --- lengths ---------------------------------------------------------------------

@functools.lru_cache(maxsize=8)
def power_law_pmf(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(values 1..6000, probabilities) of the S, M or L distribution."""
    mean, c = POWER_LAW[name]
    x = np.arange(1, POWER_LAW_MAX + 1, dtype=float)

    def pmf(a: float) -> np.ndarray:
        p = (x + c) ** -a
        return p / p.sum()

    lo, hi = 0.0, 10.0  # the mean falls as the exponent grows
    for _ in range(80):
        mid = (lo + hi) / 2
        if (pmf(mid) * x).sum() > mean:
            lo = mid
        else:
            hi = mid
    return x.astype(np.int64), pmf((lo + hi) / 2)


@functools.lru_cache(maxsize=2)
def load_sharegpt(path: str) -> tuple[np.ndarray, np.ndarray]:
    ins, outs = [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            ins.append(int(row["num_prefill_tokens"]))
            outs.append(int(row["num_decode_tokens"]))
    return np.array(ins), np.array(outs)


def lengths(spec: str, n: int, rng: np.random.Generator, folder: pathlib.Path,
            trace_path: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, output lengths), n each, every length >= 1."""
    if spec == "sharegpt":
        ins, outs = load_sharegpt(str(_csv_path(SHAREGPT_STATS, folder)))
        idx = rng.integers(0, len(ins), n)
        p, o = ins[idx], outs[idx]
    elif spec == "conv":
        _, ctx, gen = load_azure(str(_csv_path(AZURE_CONV, folder)))
        idx = rng.integers(0, len(ctx), n)
        p, o = ctx[idx], gen[idx]
    elif spec == "coding":
        p, o = (_log_normal(rng, n, *CODING[k]) for k in ("prompt", "output"))
    elif spec == "trace":
        _, ctx, gen = load_azure(str(_csv_path(trace_path or AZURE_CONV, folder)))
        if n > len(ctx):
            raise WorkloadError(f"the trace has {len(ctx)} requests; asked for {n}")
        p, o = ctx[:n], gen[:n]
    elif spec.startswith("fixed:"):
        try:
            a, b = (int(v) for v in spec.split(":")[1:])
        except ValueError as e:
            raise WorkloadError(f"use fixed:IN:OUT, got {spec!r}") from e
        p, o = np.full(n, a), np.full(n, b)
    elif len(spec) == 3 and spec[1] == "-" and spec[0] in POWER_LAW and spec[2] in POWER_LAW:
        xi, pi = power_law_pmf(spec[0])
        xo, po = power_law_pmf(spec[2])
        p, o = rng.choice(xi, n, p=pi), rng.choice(xo, n, p=po)
    else:
        raise WorkloadError(f"unknown lengths {spec!r}; use sharegpt, trace, conv, coding, fixed:IN:OUT or "
                            f"IN-OUT with each of S, M, L (e.g. M-M)")
    return np.maximum(p, 1).astype(np.int64), np.maximum(o, 1).astype(np.int64)


def _log_normal(rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.rint(np.exp(rng.normal(np.log(median), sigma, n))), lo, hi).astype(np.int64)


def clip_to_context(p: int, o: int, max_model_len: int) -> tuple[int, int]:
    """Scale prompt and output down together (keeping their ratio) until they
    fit the context; both stay >= 1."""
    if p + o <= max_model_len:
        return p, o
    f = max_model_len / (p + o)
    p2 = max(1, min(max_model_len - 1, int(p * f)))
    o2 = max(1, min(max_model_len - p2, int(o * f)))
    return p2, o2


# --- the whole workload ----------------------------------------------------------

def build(arrivals: str, length_spec: str, num_requests: int, seed: int = 0, time_scale: float = 1.0,
          high_priority_fraction: float = 0.0, max_model_len: int | None = None,
          folder: str | pathlib.Path | None = None) -> Workload:
    """The workload. Arrivals, lengths and priorities draw from independent
    streams of the seed, so changing one spec leaves the others unchanged."""
    if num_requests < 1:
        raise WorkloadError("num_requests must be >= 1")
    if time_scale <= 0:
        raise WorkloadError("time_scale must be > 0")
    if not 0.0 <= high_priority_fraction <= 1.0:
        raise WorkloadError("high_priority_fraction must be in [0, 1]")
    folder = traces_dir(str(folder) if folder else None)
    r_arr, r_len, r_pri = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
    t = arrival_times(arrivals, num_requests, r_arr, folder) / time_scale
    trace_path = arrivals.partition(":")[2] if arrivals.startswith("trace:") else None
    p, o = lengths(length_spec, num_requests, r_len, folder, trace_path)
    high = r_pri.random(num_requests) < high_priority_fraction
    reqs, clipped, before, after = [], 0, 0, 0
    for i in range(num_requests):
        pi, oi = int(p[i]), int(o[i])
        before += pi + oi
        was = False
        if max_model_len is not None and pi + oi > max_model_len:
            pi, oi = clip_to_context(pi, oi, max_model_len)
            clipped += 1
            was = True
        after += pi + oi
        reqs.append(Request(i, float(t[i]), pi, oi, "high" if high[i] else "normal", was))
    clip = None if max_model_len is None else ClipReport(max_model_len, clipped, num_requests, before, after)
    return Workload(reqs, arrivals, length_spec, seed, time_scale, clip)


def program_id(req: Request) -> str:
    """The program (``prompt_cache_key``) a session's or an agent program's
    turn names; "" for a request of no session."""
    return f"program-{req.session}" if req.session >= 0 else ""


def prompt_ids(req: Request, seed: int, lo: int, hi: int) -> list[int]:
    """Token ids in [lo, hi) for the request's prompt (deterministic): its
    segments' (prefixes.py; a session turn: its new message), else random."""
    if req.segments:
        from ferry.measure.prefixes import tokens_of

        return tokens_of(req.segments, seed, lo, hi)
    rng = np.random.default_rng([seed, req.index])
    return rng.integers(lo, hi, req.prompt_len).tolist()
