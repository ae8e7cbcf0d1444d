"""What the simulated cluster's Splitwise handoffs did (docs/design.md §8.1).

The handoffs themselves are the live code: the scheduler's Dispatch places a
request on a prefill instance and a decode instance at once
(``phases.place``), the prefill instance's MigrationManager plans the
handoff when the request enters (``Handoffs.plan``/``add``, as the agent's
``_enter``), a serialized one starts at the request's first token
(``Handoffs.on_output``) and a per-layer one with the request
(``LayerwiseHandoff``), through a DelayedPeer to the decode instance's live
Destination (ferry/sim/aio.py). A refused or failed handoff leaves the
request decoding on its prefill instance, as live.

``HandoffLog`` watches them: each handoff's task is recorded with its mode,
its blocks, what the decode instance linked instead of receiving, and how
much of it was exposed: from the prompt's end (the first token) to the
commit's acknowledgement at the source.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass

from libs.common.policies.phases import HandoffMode, handoff_mode
from services.instance.engine.base import EngineRequest


@dataclass
class HandoffRecord:
    request_id: str
    mode: str  # the mode it ran in: "serialized" | "per_layer"
    source: str
    destination: str = ""
    prompt_tokens: int = 0
    blocks: int = 0
    linked: int = 0  # of blocks, those the decode instance's prefix cache held: linked there, not sent
    transfer_s: float = 0.0  # the prompt KV not linked, over the link (bytes / bandwidth)
    exposed_s: float = 0.0  # the prompt's last step end -> the commit acknowledged at the source
    refused: bool = False  # the decode instance refused it: decoded on the prefill instance
    fallback: bool = False  # per_layer by its length, ran serialized (the engine has no layer hook)
    in_place: bool = False  # decoded on the prefill instance: no instance decodes, or the handoff aborted
    finished: bool = False  # aborted: the request ended with its prompt's token (nothing to decode)
    reason: str = ""  # why it aborted


class HandoffLog:
    """``transfer_s(src, dst, blocks)``: the link's time for blocks between two instances."""

    def __init__(self, cluster, transfer_s, per_layer_threshold: int):
        self.cluster = cluster
        self.transfer_s = transfer_s
        self.per_layer_threshold = per_layer_threshold
        self.first_token: dict[str, float] = {}  # request id -> when its prompt's last step ended
        self.records: list[HandoffRecord] = []
        self.running: set[asyncio.Task] = set()

    @property
    def active(self) -> int:
        return len(self.running)

    def watch(self, inst) -> None:
        """Record every handoff ``inst``'s manager starts."""
        handoffs = inst.manager.handoffs
        start = handoffs.hand_off

        def hand_off(request_id: str, dest_id: str, dest_address: str, mode: HandoffMode,
                     request: EngineRequest | None = None, exported=None) -> asyncio.Task:
            task = start(request_id, dest_id, dest_address, mode, request, exported)
            prompt = self.cluster.prompt_lens[request_id]
            rec = HandoffRecord(request_id, HandoffMode(mode).value, inst.instance_id, dest_id, prompt,
                                fallback=(mode is not HandoffMode.PER_LAYER and handoff_mode(
                                    prompt, self.per_layer_threshold) is HandoffMode.PER_LAYER))
            self.running.add(task)
            task.add_done_callback(lambda t: self._done(rec, t, inst))
            return task

        handoffs.hand_off = hand_off

    def on_first_token(self, request_id: str, now: float) -> None:
        self.first_token[request_id] = now

    def in_place(self, inst, request_id: str, prompt_tokens: int) -> None:
        """A request placed on a prefill instance with no instance to decode."""
        self.records.append(HandoffRecord(request_id, HandoffMode.SERIALIZED.value, inst.instance_id,
                                          prompt_tokens=prompt_tokens, in_place=True))

    def _done(self, rec: HandoffRecord, task: asyncio.Task, src) -> None:
        self.running.discard(task)
        out = None if task.cancelled() or task.exception() is not None else task.result()
        if out is not None and out.committed:
            rec.blocks, rec.linked = out.blocks + out.linked_blocks, out.linked_blocks
            rec.transfer_s = self.transfer_s(src, self.cluster.instances[rec.destination], out.blocks)
            rec.exposed_s = self.cluster.k.now - self.first_token.pop(rec.request_id, self.cluster.k.now)
        else:
            self.first_token.pop(rec.request_id, None)
            rec.reason = out.reason if out is not None else repr(task.exception() if not task.cancelled()
                                                                   else "cancelled")
            rec.finished = "finished" in rec.reason and src.engine.request_phase(rec.request_id) is None
            rec.in_place = not rec.finished
            rec.refused = "refused" in rec.reason
        self.records.append(rec)

    def summary(self) -> dict:
        recs = self.records
        by_mode = {m.value: [r for r in recs if r.mode == m.value and not r.in_place and not r.finished]
                   for m in HandoffMode}
        out = {"handoffs": len(recs), "in_place": sum(r.in_place for r in recs),
               "finished_with_prompt": sum(r.finished for r in recs),
               "blocks": sum(r.blocks for r in recs),
               "blocks_linked": sum(r.linked for r in recs),
               "fallbacks": sum(r.fallback for r in recs), "refusals": sum(r.refused for r in recs)}
        for mode, rs in by_mode.items():
            exp = sorted(r.exposed_s for r in rs)
            out[mode] = {"n": len(rs),
                         "exposed_ms_mean": 1000 * sum(exp) / len(exp) if exp else None,
                         "exposed_ms_max": 1000 * exp[-1] if exp else None,
                         "transfer_ms_mean": 1000 * sum(r.transfer_s for r in rs) / len(rs) if rs else None}
        return out

    def record_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]
