"""Workloads with prefix structure (prefix caching), on top of the plain
workloads of workload.py, the same live (``ferry bench serving``/``compare``)
and in the simulator (``ferry sim``). The ``--prefix`` spec:

- ``none``: every prompt its own random tokens (as before);
- ``system:K:LEN[:ALPHA]``: K shared system prompts of LEN tokens, each
  request's one drawn with Zipf popularity (P(rank r) ∝ r^-ALPHA, default 1),
  followed by the request's own tokens (its length from the lengths spec);
- ``sessions:TURNS[:THINK_S]``: multi-turn conversations. The arrivals spec
  starts sessions; each has TURNS turns whose new message and output lengths
  come from the lengths spec; a turn sends the whole conversation so far (every
  earlier message and the tokens the model answered) plus its new message,
  THINK_S seconds (exponential, mean 5) after the previous answer ended.
  Turns that would pass the context length are dropped (the session ends);
- ``agentic[:TURNS[:TOOL_S[:SCALE]]]``: agent programs (coding agents), from
  published parameters (``agentic`` below, AGENTIC): the arrivals spec starts
  programs (``-n`` counts programs, not turns); every turn resends the whole
  history (a 3,000-token system prompt shared by all programs, every earlier
  turn's input and output) plus its new input, the program's tool latency
  after the previous turn's end. TURNS is the median number of turns per
  program (default 38), TOOL_S the mean tool latency (default 15), SCALE
  divides every token count (default 1: the published sizes; 10 fits them to
  a small context). The lengths spec is not used;
- ``trace:PATH[:BLOCK]``: a trace in the format of the Mooncake public traces,
  JSON lines ``{"timestamp" (ms), "input_length", "output_length",
  "hash_ids"}``, one hash id per BLOCK tokens of the input (default 512, the
  traces' own): arrivals, lengths and the prompts' block structure all come
  from it (requests sharing their first k hash ids share their first k*BLOCK
  tokens). The arrivals and lengths specs are not used.

Prompts are built from ``Segment``s: runs of tokens drawn from a key, so that
the same key gives the same tokens in every process (live client, simulator,
hit-rate bound), and the block hashes of the engines follow the structure.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np

from ferry.measure import workload as wl
from ferry.measure.workload import Request, Segment, Workload, WorkloadError

THINK_S = 5.0
TRACE_BLOCK = 512
# Key spaces of the segments (high bits): a system prompt, a request's own
# tokens, a session turn's new message, a trace block, the agents' system prompt.
SYSTEM, OWN, MESSAGE, TRACE, AGENT_SYSTEM = 1, 2, 3, 4, 5

# ``agentic``: agent programs GENERATED from published parameters, not a trace.
# - llm-d's agentic code-generation profile (as issue 53 quotes it): a 3,000-token
#   system prompt shared by every program, per-turn new input about 1,500 tokens
#   and output about 425, tool latency between turns with a mean of 15 s, the
#   context growing turn by turn (lognormal).
# - The public coding-agent traces issue 53 cites: a median of 33-43 turns a
#   program (input:output 131:1 over whole programs, > 94% prefix hits).
# This project's choices (the sources give means or medians, not shapes):
#   new input per turn = round(exp(N(ln 1500, 0.5))), clipped to [16, 16000]
#     (lognormal increments: the context grows by a lognormal step a turn)
#   output per turn    = round(exp(N(ln 425, 0.5))), clipped to [1, 4000]
#   tool latency       = exponential, mean TOOL_S (memoryless tool calls)
#   turns per program  = max(1, round(exp(N(ln TURNS, 0.6)))) (lognormal:
#     right-skewed like session lengths; median TURNS = 38, the middle of 33-43)
#   programs arrive as the arrivals spec says (poisson:RATE: a Poisson process)
# SCALE divides the token counts (system prompt, input, output) before the
# clips, so that a run fits a simulated context of a few thousand tokens.
AGENTIC = {"system": 3000, "input": (1500.0, 0.5, 16, 16000), "output": (425.0, 0.5, 1, 4000),
           "turns": 38.0, "turns_sigma": 0.6, "tool_s": 15.0}


def key(kind: int, *parts: int) -> int:
    k = kind
    for p in parts:
        k = (k << 32) | (p & 0xFFFFFFFF)
    return k


@functools.lru_cache(maxsize=4096)
def segment_tokens(seg: Segment, seed: int, lo: int, hi: int) -> tuple[int, ...]:
    """The segment's tokens: the same in every process for the same key."""
    rng = np.random.default_rng([seed, seg.key >> 64, (seg.key >> 32) & 0xFFFFFFFF, seg.key & 0xFFFFFFFF])
    return tuple(rng.integers(lo, hi, seg.length).tolist())


def tokens_of(segments, seed: int, lo: int, hi: int) -> list[int]:
    out: list[int] = []
    for s in segments:
        out += segment_tokens(s, seed, lo, hi)
    return out


# --- the spec ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class WorkloadOptions:
    """What a run sends, shared by the live benchmark (ferry/bench/serving.py)
    and the simulator (ferry/sim/run.py): the same options give both the same
    requests."""
    arrivals: str = "poisson:2"
    lengths: str = "M-M"
    prefix: str = "none"  # prefix structure (module doc)
    num_requests: int = 100
    seed: int = 0
    time_scale: float = 1.0
    high_priority_fraction: float = 0.0
    max_model_len: int | None = None  # clip to this (None: the caller's default)
    traces_dir: str | None = None

    def workload(self, slowdown: float, max_model_len: int | None) -> Workload:
        """The requests, with arrivals stretched by ``time_scale / slowdown``
        and prompts clipped to ``max_model_len``."""
        return build(self.arrivals, self.lengths, self.num_requests, self.prefix, self.seed,
                     self.time_scale / slowdown, self.high_priority_fraction, max_model_len, self.traces_dir)


def build(arrivals: str, lengths: str, num_requests: int, prefix: str = "none", seed: int = 0,
          time_scale: float = 1.0, high_priority_fraction: float = 0.0, max_model_len: int | None = None,
          folder=None) -> Workload:
    """workload.build with the prefix structure of ``prefix`` (module doc)."""
    kind, _, rest = (prefix or "none").partition(":")
    args = rest.split(":") if rest else []
    try:
        if kind == "none" and not args:
            return wl.build(arrivals, lengths, num_requests, seed, time_scale, high_priority_fraction,
                            max_model_len, folder)
        if kind == "system" and len(args) in (2, 3):
            base = wl.build(arrivals, lengths, num_requests, seed, time_scale, high_priority_fraction,
                            max_model_len, folder)
            alpha = float(args[2]) if len(args) == 3 else 1.0
            return system_prompts(base, int(args[0]), int(args[1]), alpha, seed, max_model_len, prefix)
        if kind == "sessions" and len(args) in (1, 2):
            think = float(args[1]) if len(args) == 2 else THINK_S
            return sessions(arrivals, lengths, num_requests, int(args[0]), think, seed, time_scale,
                            high_priority_fraction, max_model_len, folder, prefix)
        if kind == "agentic" and len(args) <= 3:
            turns = float(args[0]) if args else AGENTIC["turns"]
            tool = float(args[1]) if len(args) >= 2 else AGENTIC["tool_s"]
            scale = float(args[2]) if len(args) >= 3 else 1.0
            return agentic(arrivals, num_requests, turns, tool, scale, seed, time_scale, high_priority_fraction,
                           max_model_len, folder, prefix)
        if kind == "trace" and args:
            block = int(args[1]) if len(args) == 2 else TRACE_BLOCK
            return mooncake(args[0], num_requests, block, seed, time_scale, high_priority_fraction,
                            max_model_len, folder, prefix)
    except ValueError as e:
        if isinstance(e, WorkloadError):
            raise
        raise WorkloadError(f"bad number in prefix spec {prefix!r}: {e}") from e
    raise WorkloadError(f"unknown prefix spec {prefix!r}; use none, system:K:LEN[:ALPHA], "
                        f"sessions:TURNS[:THINK_S], agentic[:TURNS[:TOOL_S[:SCALE]]] or trace:PATH[:BLOCK]")


def _with(base: Workload, requests: list[Request], prefix: str, clip=None) -> Workload:
    return dataclasses.replace(base, requests=requests, prefix=prefix, clip=clip or base.clip)


# --- shared system prompts ----------------------------------------------------------------

def zipf_choice(rng: np.random.Generator, k: int, alpha: float, n: int) -> np.ndarray:
    p = np.arange(1, k + 1, dtype=float) ** -alpha
    return rng.choice(k, n, p=p / p.sum())


def system_prompts(base: Workload, k: int, length: int, alpha: float, seed: int, max_model_len: int | None,
                   prefix: str) -> Workload:
    if k < 1 or length < 1 or alpha < 0:
        raise WorkloadError(f"system:K:LEN[:ALPHA] needs K >= 1, LEN >= 1, ALPHA >= 0; got {prefix!r}")
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(4)[3])
    which = zipf_choice(rng, k, alpha, len(base.requests))
    out = []
    for r, s in zip(base.requests, which):
        own = r.prompt_len
        if max_model_len is not None:
            own = max(1, min(own, max_model_len - length - r.output_len))
        segs = (Segment(key(SYSTEM, int(s)), length), Segment(key(OWN, r.index), own))
        out.append(dataclasses.replace(r, prompt_len=length + own, segments=segs))
    return _with(base, out, prefix)


# --- multi-turn sessions -------------------------------------------------------------------

def sessions(arrivals: str, lengths: str, num_requests: int, turns: int, think_s: float, seed: int,
             time_scale: float, high_fraction: float, max_model_len: int | None, folder, prefix: str) -> Workload:
    """Sessions of ``turns`` turns (``num_requests`` turns in all, before the
    context length drops some). A turn's ``prompt_len`` is its whole context;
    its ``segments`` are its new message only (the client prepends the
    conversation so far, answers included)."""
    if turns < 1 or think_s < 0:
        raise WorkloadError(f"sessions:TURNS[:THINK_S] needs TURNS >= 1, THINK_S >= 0; got {prefix!r}")
    n_sessions = -(-num_requests // turns)
    starts = wl.build(arrivals, "fixed:1:1", n_sessions, seed, time_scale, high_fraction, None, folder)
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(5)[4])
    folder_path = wl.traces_dir(str(folder) if folder else None)
    msg, out = wl.lengths(lengths, num_requests, np.random.default_rng(np.random.SeedSequence(seed).spawn(3)[1]),
                          folder_path)
    think = rng.exponential(think_s, num_requests) if think_s > 0 else np.zeros(num_requests)
    reqs, dropped, j = [], 0, 0
    for s, start in enumerate(starts.requests):
        context = 0
        for t in range(turns):
            if j >= num_requests:
                break
            m, o = int(msg[j]), int(out[j])
            j += 1
            if max_model_len is not None and context + m + o > max_model_len:
                dropped += turns - t
                j += turns - t - 1
                break
            reqs.append(Request(len(reqs), start.arrival_s, context + m, o, start.priority,
                                segments=(Segment(key(MESSAGE, s, t), m),), session=s, turn=t,
                                think_s=float(think[j - 1]) / time_scale if t else 0.0))
            context += m + o
    clip = None if max_model_len is None else wl.ClipReport(max_model_len, dropped, num_requests, 0, 0)
    return _with(starts, reqs, prefix, clip)


# --- agent programs --------------------------------------------------------------------------

def agentic(arrivals: str, num_programs: int, turns: float, tool_s: float, scale: float, seed: int,
            time_scale: float, high_fraction: float, max_model_len: int | None, folder, prefix: str) -> Workload:
    """``num_programs`` agent programs (AGENTIC). As ``sessions``: a turn's
    ``prompt_len`` is its whole context, its ``segments`` what it adds (the
    first turn: the shared system prompt and its input; later ones: their
    input; the client prepends the history, answers included), ``think_s``
    its tool latency; ``session`` is the program. A turn that would pass the
    context length ends its program (counted in the clip report)."""
    if turns < 1 or tool_s < 0 or scale <= 0:
        raise WorkloadError(f"agentic[:TURNS[:TOOL_S[:SCALE]]] needs TURNS >= 1, TOOL_S >= 0, SCALE > 0; "
                            f"got {prefix!r}")
    starts = wl.build(arrivals, "fixed:1:1", num_programs, seed, time_scale, high_fraction, None, folder)
    r_turns, r_in, r_out, r_tool = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(9)[5:9])
    n_turns = np.maximum(1, np.rint(np.exp(r_turns.normal(np.log(turns), AGENTIC["turns_sigma"], num_programs))))
    total = int(n_turns.sum())

    def sized(rng, median, sigma, lo, hi):
        raw = np.exp(rng.normal(np.log(median), sigma, total)) / scale
        return np.clip(np.rint(raw), max(1, round(lo / scale)), max(1, round(hi / scale))).astype(np.int64)

    ins, outs = sized(r_in, *AGENTIC["input"]), sized(r_out, *AGENTIC["output"])
    tool = r_tool.exponential(tool_s, total) if tool_s > 0 else np.zeros(total)
    system = max(1, round(AGENTIC["system"] / scale))
    reqs, dropped, j = [], 0, 0
    for s, start in enumerate(starts.requests):
        context = system
        for t in range(int(n_turns[s])):
            m, o = int(ins[j]), int(outs[j])
            think = float(tool[j]) / time_scale if t else 0.0
            j += 1
            if max_model_len is not None and context + m + o > max_model_len:
                dropped += int(n_turns[s]) - t
                j += int(n_turns[s]) - t - 1
                break
            segs = (Segment(key(AGENT_SYSTEM, 0), system),) if t == 0 else ()
            reqs.append(Request(len(reqs), start.arrival_s, context + m, o, start.priority,
                                segments=segs + (Segment(key(MESSAGE, s, t), m),), session=s, turn=t,
                                think_s=think))
            context += m + o
    if not reqs:
        raise WorkloadError(f"{prefix!r}: no turn fits the context of {max_model_len} tokens")
    clip = None if max_model_len is None else wl.ClipReport(max_model_len, dropped, total, 0, 0)
    return _with(starts, reqs, prefix, clip)


# --- Mooncake-format traces -----------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def load_mooncake(path: str) -> tuple[dict, ...]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append({"timestamp": float(row["timestamp"]), "input_length": int(row["input_length"]),
                             "output_length": int(row["output_length"]),
                             "hash_ids": tuple(int(h) for h in row["hash_ids"])})
            except (ValueError, KeyError, TypeError) as e:
                raise WorkloadError(f"{path}:{n}: not a Mooncake trace line ({e!r})") from None
    return tuple(rows)


def mooncake(path: str, num_requests: int, block: int, seed: int, time_scale: float, high_fraction: float,
             max_model_len: int | None, folder, prefix: str) -> Workload:
    p = wl.trace_file(path, wl.traces_dir(str(folder) if folder else None))
    rows = load_mooncake(str(p))
    if num_requests > len(rows):
        raise WorkloadError(f"the trace has {len(rows)} requests; asked for {num_requests}")
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(3)[2])
    high = rng.random(num_requests) < high_fraction
    t0 = rows[0]["timestamp"]
    reqs, clipped = [], 0
    for i, row in enumerate(rows[:num_requests]):
        hashes, n_in = row["hash_ids"], row["input_length"]
        if not hashes or not (len(hashes) - 1) * block < n_in <= len(hashes) * block:
            raise WorkloadError(f"{p}: request {i} has {n_in} input tokens for {len(hashes)} hash ids of "
                                f"{block} tokens (wrong block size?)")
        segs = [Segment(key(TRACE, h >> 32, h), block) for h in hashes]
        segs[-1] = Segment(segs[-1].key, n_in - block * (len(hashes) - 1))
        out = max(1, row["output_length"])
        if max_model_len is not None and n_in + out > max_model_len:  # keep whole blocks of the prefix
            clipped += 1
            keep, rest = max(1, max_model_len - out), []
            for s in segs:
                if keep <= 0:
                    break
                rest.append(Segment(s.key, min(s.length, keep)))
                keep -= rest[-1].length
            segs, n_in, out = rest, sum(s.length for s in rest), min(out, max_model_len - 1)
        arrival = (row["timestamp"] - t0) / 1000.0 / time_scale
        reqs.append(Request(i, arrival, n_in, out, "high" if high[i] else "normal",
                            clipped=n_in != row["input_length"], segments=tuple(segs)))
    clip = None if max_model_len is None else wl.ClipReport(max_model_len, clipped, num_requests, 0, 0)
    return Workload(reqs, f"trace:{path}", f"trace:{path}", seed, time_scale, clip, prefix=prefix)
