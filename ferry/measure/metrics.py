"""Per-request latency metrics and their aggregates. Pure: timelines in,
numbers out, so they are tested on hand-made timelines.

Definitions (the Llumnix paper's, §6.1):
- TTFT (prefill latency): first token received − request sent;
- decode latency: mean time per output token after the first,
  (last token − first token) / (tokens − 1);
- end-to-end latency: last event of the stream − request sent;
- preemption loss: extra queuing and recompute time the instances attribute to
  preemptions (the frontend's ``ferry.preemption_loss_ms``).

All times are seconds on one monotonic clock; aggregates are milliseconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

PRIORITIES = ("high", "normal")


@dataclass
class RequestRecord:
    """One request's timeline as the client saw it."""

    index: int
    priority: str
    prompt_len: int
    output_len: int  # requested
    scheduled_at: float  # when the workload said to send it
    sent_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    tokens: int = 0  # completion tokens received (usage)
    finish_reason: str | None = None
    error: str | None = None
    preemptions: int = 0
    preemption_loss_ms: float = 0.0
    migrations: int = 0
    resumes: int = 0
    instances: list[str] = field(default_factory=list)
    server_ttft_ms: float | None = None
    max_gap_s: float | None = None  # streaming: the largest gap between two tokens (a stall)
    max_gap_end: float | None = None  # ... when it ended (epoch seconds: beside the services' logs)
    # Prompt tokens served from a prefix cache (the simulator: the engine's hit at
    # the admission that gave the first token); None: not known (programs.py).
    cached_tokens: int | None = None
    # The tokens sent and answered (prefix workloads: the hit-rate bound, the
    # next turn of a session); kept out of the JSON.
    prompt_ids: list[int] | None = field(default=None, repr=False)
    output_ids: list[int] | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finished_at is not None and self.first_token_at is not None

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_at is None or self.sent_at is None:
            return None
        return self.first_token_at - self.sent_at

    @property
    def decode_s(self) -> float | None:
        """Mean seconds per token after the first; None with one token."""
        if self.first_token_at is None or self.last_token_at is None or self.tokens < 2:
            return None
        return (self.last_token_at - self.first_token_at) / (self.tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        if self.finished_at is None or self.sent_at is None:
            return None
        return self.finished_at - self.sent_at

    @property
    def send_lag_s(self) -> float | None:
        """How late the client sent it: a busy client shows here, not in TTFT."""
        return None if self.sent_at is None else self.sent_at - self.scheduled_at

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["prompt_ids"], d["output_ids"]
        if d["max_gap_s"] is None:  # not streamed (or simulated): absent, as before the field existed
            del d["max_gap_s"], d["max_gap_end"]
        d.update(ttft_s=self.ttft_s, decode_s=self.decode_s, e2e_s=self.e2e_s)
        return d


def percentile(xs, q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``xs`` by nearest rank (the sample
    at rank floor(q/100 x n), a value that occurred; None for no samples):
    the benches' one convention for tails of their own samples. (stats_ms
    and summarize interpolate, numpy's default, for the serving summaries.)"""
    s = sorted(xs)
    if not s:
        return None
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def stats_ms(values_s: list[float], scale: float = 1.0) -> dict:
    """mean/p50/p99 in milliseconds of seconds-valued samples divided by
    ``scale`` (the sim time scale; 1 = wall time). None when there are none."""
    if not values_s:
        return {"mean": None, "p50": None, "p99": None}
    a = np.asarray(values_s, dtype=float) * 1000.0 / scale
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def _group(records: list[RequestRecord], scale: float) -> dict:
    ok = [r for r in records if r.ok]
    loss = [r.preemption_loss_ms for r in ok]
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "ttft_ms": stats_ms([r.ttft_s for r in ok], scale),
        "decode_ms": stats_ms([r.decode_s for r in ok if r.decode_s is not None], scale),
        "e2e_ms": stats_ms([r.e2e_s for r in ok], scale),
        "preemptions": int(sum(r.preemptions for r in ok)),
        "preempted_requests": sum(r.preemptions > 0 for r in ok),
        "preemption_loss_ms_mean": float(np.mean(loss)) / scale if loss else None,
        "migrations": int(sum(r.migrations for r in ok)),
        "migrated_requests": sum(r.migrations > 0 for r in ok),
    }


def summarize(records: list[RequestRecord], scale: float = 1.0) -> dict:
    """Overall numbers plus ``high`` and ``normal`` sub-objects with the same
    per-priority numbers. ``scale`` divides every duration (sim time scale)."""
    out = _group(records, scale)
    ok = [r for r in records if r.ok]
    gaps = [r.max_gap_s for r in ok if r.max_gap_s is not None]
    if gaps:  # streamed: each request's longest stall between two tokens, over requests
        out["max_gap_ms"] = stats_ms(gaps, scale)
    if ok:
        start = min(r.sent_at for r in ok)
        end = max(r.finished_at for r in ok)
        span = max(end - start, 1e-9)
        out["duration_s"] = span / scale
        out["throughput_rps"] = len(ok) / span * scale
        out["output_tokens_per_s"] = sum(r.tokens for r in ok) / span * scale
    else:
        out.update(duration_s=None, throughput_rps=None, output_tokens_per_s=None)
    out["short_outputs"] = sum(r.ok and r.tokens != r.output_len for r in records)
    lags = [r.send_lag_s for r in records if r.send_lag_s is not None]
    out["send_lag_ms"] = stats_ms(lags)  # wall time: a property of the client, not the cluster
    errors: dict[str, int] = {}
    for r in records:
        if r.error:
            key = r.error.splitlines()[0][:120]
            errors[key] = errors.get(key, 0) + 1
    out["errors"] = errors
    for p in PRIORITIES:
        out[p] = _group([r for r in records if r.priority == p], scale)
    return out


def ttft_cdf(records: list[RequestRecord], scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(sorted TTFT in ms, cumulative fraction) for a CDF plot."""
    x = np.sort([r.ttft_s * 1000.0 / scale for r in records if r.ok])
    return x, (np.arange(1, len(x) + 1) / len(x)) if len(x) else np.zeros(0)
