"""The client's view of a simulated run: one RequestRecord per request, filled
from the engines' token outputs (first token, finish, counters)."""

from __future__ import annotations

from ferry.measure import metrics
from ferry.measure import workload as wl
from libs.common.types import TokenOutput


class Recorder:
    """The client's view of every request (RequestRecord), from token outputs."""

    def __init__(self, work: wl.Workload, t0: float, token_s: float, wall: float):
        self.t0 = t0
        self.token_s = token_s
        self.records = [metrics.RequestRecord(r.index, r.priority, r.prompt_len, r.output_len,
                                              t0 + r.arrival_s * wall) for r in work.requests]
        self.index = {f"req-{r.index}": r.index for r in work.requests}
        self.done = 0

    def on_tokens(self, now: float, outputs: list[TokenOutput]) -> None:
        t = now + self.token_s
        for o in outputs:
            if o.index == 0 or o.finish_reason is not None:
                rec = self.records[self.index[o.request_id]]
                if o.index == 0:
                    rec.first_token_at = t
                if o.finish_reason is not None:
                    rec.last_token_at = rec.finished_at = t
                    rec.tokens = o.index + 1
                    rec.finish_reason = o.finish_reason.value
                    st = o.stats or {}
                    rec.preemptions = int(st.get("num_preemptions", 0))
                    rec.preemption_loss_ms = float(st.get("preemption_loss_ms", 0.0))
                    rec.migrations = int(st.get("num_migrations", 0))
                    self.done += 1

    def fail(self, index: int, now: float, error: str) -> None:
        rec = self.records[index]
        rec.error, rec.finished_at = error, now
        self.done += 1
