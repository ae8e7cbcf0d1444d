"""Splitwise's prefill->decode handoff on the instance that prefills
(docs/design.md §8.1): the request's KV moves to a decode instance on the migration
protocol once its prompt is done, and its client stream follows it with a
`moved` event exactly as across a migration.

Where the decode instance is chosen: by the scheduler, at dispatch, with the
prefill instance (libs/common/policies/phases.place, by the same load rules);
the frontend passes it with the request (GenerateRequest.handoff). Nothing
asks the scheduler when the prompt is done, so the handoff adds no round trip
and goes on in the frontend's bypass mode. The price: the choice is as old
as the prompt's computation; a decode instance that filled up meanwhile
refuses the pre-allocation, and the request then decodes here (the abort
rules of any migration).

The seam: ``plan`` at Generate (the mode is chosen there, by prompt length,
because a per-layer handoff must reserve before the prompt computes), then
``add``, which gives the request to the engine, and ``start``, the one
function that starts a handoff given its mode:
- serialized: ``add`` has the engine hold the request right after the step
  that produced its first token (EngineRequest.hold_after_prefill); on the
  engine thread, at that step's boundary, the held request is exported
  (``at_boundary``, the runner's hook), and the token starts the handoff
  (``on_output``) with that export: the whole prompt KV goes in one last
  stage (SourceMigration(handoff=True)) without waiting for the engine's
  next boundary, a whole step later;
- per-layer: ``add`` starts the handoff at once and the handoff adds the
  request itself, with the engine's layer tap on, in one engine-thread call
  (layerwise.LayerwiseHandoff): the destination reserves the prompt's blocks
  first, each layer's KV goes as the prompt computes, and the request is
  suspended right after the step that produced its first token.
Either runs as an outgoing migration of the manager (its counters, its
close()); a failure leaves the request decoding here."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from libs.common.logging import get_logger
from libs.common.policies.phases import HandoffMode, handoff_mode
from libs.common.types import RequestPhase, TokenOutput
from services.instance.engine.base import EngineBroken, EngineError, EngineRequest
from services.instance.migration.host import MigrationHost
from services.instance.migration.source import Exported, export_suspended

log = get_logger("migration")


@dataclass(frozen=True)
class HandoffPlan:
    request_id: str
    dest_id: str
    dest_address: str
    num_prompt_tokens: int
    mode: HandoffMode


class Handoffs:
    """The handoffs planned on this instance: serialized ones start as their
    prompts end, per-layer ones with their requests. Lives on the event loop.
    ``hand_off(request id, destination id, address, mode, request)`` starts
    one as an outgoing migration (MigrationManager.hand_off) and records it
    in ``outgoing`` (request id -> its migration)."""

    def __init__(self, host: MigrationHost, hand_off: Callable[..., asyncio.Task],
                 outgoing: Mapping[str, Any], per_layer_threshold: int = 0):
        self.host = host
        self.hand_off = hand_off
        self.outgoing = outgoing
        self.per_layer_threshold = per_layer_threshold
        self.plans: dict[str, HandoffPlan] = {}  # request id -> planned, not started yet
        self.running: dict[str, asyncio.Task] = {}
        # Serialized plans' requests exported where the engine held them: written on the engine
        # thread (at_boundary) before the step's outputs reach the loop, taken by on_output.
        self.exported: dict[str, Exported] = {}
        # Told of every handoff started (request id, its task): ferry bench handoff-modes times the live path.
        self.on_start: Callable[[str, asyncio.Task], None] | None = None
        host.runner.at_boundary = self.at_boundary

    def plan(self, request_id: str, dest_id: str, dest_address: str, num_prompt_tokens: int) -> HandoffPlan:
        mode = handoff_mode(num_prompt_tokens, self.per_layer_threshold)
        if mode is HandoffMode.PER_LAYER and not self.host.engine.layer_taps:
            mode = HandoffMode.SERIALIZED  # this engine has no per-layer hook
        p = HandoffPlan(request_id, dest_id, dest_address, num_prompt_tokens, mode)
        self.plans[request_id] = p
        return p

    def forget(self, request_id: str) -> None:
        """The request ended (or its client went away) before its prompt did."""
        self.plans.pop(request_id, None)
        self.exported.pop(request_id, None)

    def at_boundary(self, outputs: list[TokenOutput]) -> None:
        """On the engine thread, right after a step (the runner's hook):
        each request of a serialized plan that this step held after its
        first token (an output, and suspended now: only a hold suspends
        within a step) is exported at once. Exports of requests gone from
        the engine are dropped (a client that left between the hold and its
        token's delivery: nothing takes its export)."""
        if not self.plans and not self.exported:  # every step of every instance: nothing planned, nothing to do
            return
        engine = self.host.engine
        for rid in [r for r in list(self.exported) if engine.request_phase(r) is None]:
            self.exported.pop(rid, None)
        for out in outputs:
            if out.finish_reason is not None or out.request_id not in self.plans:
                continue
            phase = engine.request_phase(out.request_id)
            if phase is not None and phase[0] == RequestPhase.SUSPENDED:
                self.exported[out.request_id] = export_suspended(engine, out.request_id, 0, self.host.clock)

    async def add(self, request: EngineRequest, plan: HandoffPlan | None) -> None:
        """Give a new request to the engine, ready for its planned handoff
        (None: it decodes here). Raises what Engine.add_request raises."""
        host = self.host
        if plan is not None and plan.mode is HandoffMode.PER_LAYER:
            self.plans.pop(plan.request_id, None)  # it starts now, not at its first token
            task = self.start(plan, request)
            if task is not None:
                mig = self.outgoing[plan.request_id]
                task.add_done_callback(lambda _t: mig.settle_added())  # even if cancelled before it ran
                error = await mig.added
                if error is not None:
                    raise error
                return
            request = replace(request, hold_after_prefill=False)  # not started: it decodes here
        elif plan is not None:
            request = replace(request, hold_after_prefill=True)
        await host.runner.call(host.engine.add_request, request)

    def on_output(self, out: TokenOutput) -> None:
        """Every token output of this instance (on the loop, after the client's
        stream has it): the first one of a request with a serialized plan
        starts its handoff; a final one ends the plan (a one-token request
        has nothing to hand)."""
        p = self.plans.get(out.request_id)
        exported = self.exported.pop(out.request_id, None)
        if p is None:
            return
        del self.plans[out.request_id]
        if out.finish_reason is not None:
            return
        self.start(p, exported=exported)

    def start(self, p: HandoffPlan, request: EngineRequest | None = None,
              exported: Exported | None = None) -> asyncio.Task | None:
        """The one place a handoff starts, by mode; None if it could not
        (the request then decodes here). Per-layer: ``request`` is not in the
        engine yet and the handoff adds it. Serialized: ``exported``, the
        request's export where it was held (None: the handoff exports it at
        the engine's next boundary)."""
        try:
            task = self.hand_off(p.request_id, p.dest_id, p.dest_address, p.mode, request, exported)
        except Exception as e:  # noqa: BLE001 - the request must not stay held: it decodes here
            log.warning("handoff not started; decoding here", request_id=p.request_id, mode=p.mode.value,
                        error=repr(e))
            if request is None:
                self.host.runner.submit(_resume_if_held, self.host.engine, p.request_id)
            return None
        self.running[p.request_id] = task
        task.add_done_callback(lambda t, rid=p.request_id: self._done(rid, t))
        if self.on_start is not None:
            self.on_start(p.request_id, task)
        return task

    def _done(self, request_id: str, task: asyncio.Task) -> None:
        if self.running.get(request_id) is task:
            del self.running[request_id]
        if task.cancelled():
            return
        out = task.exception() or task.result()
        if isinstance(out, (EngineError, EngineBroken)):  # a per-layer handoff's request refused: its client was told
            log.info("handoff not started: the engine refused the request", request_id=request_id, error=repr(out))
        elif isinstance(out, BaseException):
            log.error("handoff failed", request_id=request_id, error=repr(out))
        elif not out.committed:
            log.info("handoff aborted; decoding here", request_id=request_id, reason=out.reason)


def _resume_if_held(engine, request_id: str) -> None:
    """On the engine thread: put a held request back into the batch."""
    phase = engine.request_phase(request_id)
    if phase is not None and phase[0] == "suspended":
        engine.resume_request(request_id)
