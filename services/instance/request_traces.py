"""An instance's part of each request's trace (with tracing on,
libs/common/tracing.py). The agent tells it what happens to its requests,
as it tells the serving metrics (arrived, committed in by a migration or a
handoff, each step's outputs, left); it keeps each request's trace context
(its Generate caller's, the frontend's call span; or, for a request that
migrated in, the span of the commit that brought it)
and, when the request's stream here ends, records its phases here as spans
of the past under it: ``ferry.queue`` (arrival to the step that first ran
it), ``ferry.prefill`` (to its first token), ``ferry.decode`` (to its last
token here, or its move elsewhere). Migrations out of here take the request's
context as their parent (``migration_span``): a request's trace goes from
instance to instance with it."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from libs.common import tracing
from libs.common.types import RequestPhase, RequestState, TokenOutput
from services.instance.engine.base import EngineLoad


@dataclass
class _Phases:
    context: object
    arrival: int  # ns (time.time_ns)
    migrated_in: bool = False
    resumed_tokens: int = 0
    scheduled: int = 0
    first_token: int = 0
    tokens: int = 0


class RequestTraces:
    MAX_TRACKED = 100_000  # a request nobody attached to after a migration in is forgotten at last

    def __init__(self, instance_id: str):
        self.instance_id = instance_id
        self._requests: dict[str, _Phases] = {}
        self._waiting: set[str] = set()
        self._last_step = time.time_ns()

    def context_of(self, request_id: str):
        p = self._requests.get(request_id)
        return p.context if p is not None else None

    def _track(self, request_id: str, p: _Phases) -> None:
        if p.context is None:
            return  # not traced (its caller sent no context)
        if len(self._requests) >= self.MAX_TRACKED:
            self._requests.pop(next(iter(self._requests)))
        self._requests[request_id] = p

    # --- what happens to requests --------------------------------------------------------
    def arrived(self, request_id: str, prompt_tokens: int, resumed_tokens: int) -> None:
        ctx = tracing.sampled_context()
        self._track(request_id, _Phases(ctx, time.time_ns(), resumed_tokens=resumed_tokens))
        if ctx is not None:
            self._waiting.add(request_id)

    def committed_in(self, state: RequestState) -> None:
        now = time.time_ns()
        self._track(state.request_id, _Phases(tracing.sampled_context(), now, migrated_in=True, scheduled=now,
                                              first_token=now, tokens=len(state.output_token_ids)))

    def on_step(self, outputs: list[TokenOutput], load: EngineLoad | None) -> None:
        if not self._requests:
            return
        now, before = time.time_ns(), self._last_step
        self._last_step = now
        if self._waiting and load is not None:
            running = {r.request_id for r in load.requests if r.state is RequestPhase.RUNNING}
            for rid in [r for r in self._waiting if r in running]:
                self._scheduled(rid, before)
        for out in outputs:
            p = self._requests.get(out.request_id)
            if p is None:
                continue
            if out.request_id in self._waiting:
                self._scheduled(out.request_id, before)
            if out.token_id is not None:
                if not p.first_token:
                    p.first_token = now
                p.tokens += 1
            if out.finish_reason is not None:
                self._record(out.request_id, now, out.finish_reason.value)

    def _scheduled(self, request_id: str, step_started: int) -> None:
        """It ran first in the step that began at the end of the previous one."""
        self._waiting.discard(request_id)
        p = self._requests.get(request_id)
        if p is not None and not p.scheduled:
            p.scheduled = max(p.arrival, step_started)

    def left(self, request_id: str) -> None:
        """Its stream here ended without a finish: moved on, aborted or failed."""
        if request_id in self._requests:
            self._record(request_id, time.time_ns(), "left")

    def _record(self, request_id: str, end: int, outcome: str) -> None:
        p = self._requests.pop(request_id)
        self._waiting.discard(request_id)
        try:
            self._spans(request_id, p, end, outcome)
        finally:
            if not self._requests:  # none on its way here: the spans go out now, not during the next one's
                tracing.settled()

    def _spans(self, request_id: str, p: _Phases, end: int, outcome: str) -> None:
        attrs = {"ferry.request_id": request_id, "ferry.instance_id": self.instance_id}
        ctx = p.context
        if not p.migrated_in:
            scheduled = p.scheduled or end
            tracing.record("ferry.queue", p.arrival, scheduled, attrs, ctx)
            if p.scheduled:
                first = p.first_token or end
                tracing.record("ferry.prefill", scheduled, first, {**attrs, "ferry.resumed_tokens": p.resumed_tokens},
                               ctx)
                if p.first_token:
                    tracing.record("ferry.decode", first, end, {**attrs, "ferry.tokens": p.tokens,
                                                                "ferry.outcome": outcome}, ctx)
        else:
            tracing.record("ferry.decode", p.arrival, end, {**attrs, "ferry.migrated_in": True,
                                                            "ferry.tokens": p.tokens, "ferry.outcome": outcome}, ctx)


def migration_span(parent, mig):
    """The span of one migration or handoff out of here, under its request's
    context (nothing where the request is not traced); ``describe`` it with the
    outcome once it ran."""
    if parent is None:
        return contextlib.nullcontext()
    name = "ferry.handoff" if mig.handoff else "ferry.migration"
    return tracing.span(name, {"ferry.migration_id": mig.id, "ferry.request_id": mig.request_id,
                               "ferry.source": mig.host.instance_id, "ferry.destination": mig.dest_id},
                        context=parent)


def describe(s, mig, out) -> None:
    """The outcome on the migration's span, and its stages as child spans
    (the source's state machine's transitions, timed), the downtime too."""
    s.set_attributes({"ferry.outcome": "committed" if out.committed else "aborted", "ferry.reason": out.reason,
                      "ferry.stages": out.stages, "ferry.blocks": out.blocks, "ferry.bytes": out.bytes,
                      "ferry.linked_blocks": out.linked_blocks, "ferry.downtime_ms": out.downtime_ms,
                      "ferry.commit_ack_ms": out.commit_ack_ms, "ferry.kv_shared": out.kv_shared})
    if not out.committed:
        tracing.fail(s, out.reason or "aborted")
    ctx = tracing.context_of(s)
    m = mig.m
    stage = 0
    for state, t0, t1 in zip(m.history, m.stamps, m.stamps[1:]):
        if state.value in ("pre_alloc", "pre_alloc_last"):
            stage += 1
        tracing.record(f"ferry.migration.{state.value}", t0, t1, {"ferry.stage": stage}, ctx)
    if out.committed and out.downtime_ms and out.suspended_at:
        t = int(out.suspended_at * 1e9)
        tracing.record("ferry.migration.downtime", t, t + int(out.downtime_ms * 1e6), {}, ctx)
