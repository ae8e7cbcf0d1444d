"""Splitwise's prefill -> decode handoff on the virtual clock (docs/design.md §8.1).

A request dispatched to a ``prefill`` instance runs its prompt there; the step
that computes the prompt's last chunk samples the first token (TTFT is the
prefill instance's). At that step's boundary the request is suspended and
its state and KV exported (an engine-thread call between steps, as
migration does), so it never decodes there. Then its KV goes to a decode
instance chosen by ``choose_for_phase(..., Phase.DECODE)`` on the
scheduler's view, over the migration model's pieces: the destination's
pre-allocation (``MigrationModel.pre_allocate(handoff=True)``: consent as
``accepts_migration`` gives it for a handoff, the handoff-in limit, blocks
reserved above the watermark), the transfer
(``TransferModel.seconds``: bytes / bandwidth, a round trip per stream), the
commit that installs the request there, and the drop at the source.

Two modes, chosen per request by ``handoff_mode(prompt tokens)``:
- **serialized**: after the prompt, pre-allocate (one round trip), send the
  whole prompt KV (a round trip + bytes / bandwidth), commit (half a round
  trip): all of it is exposed before the second token.
- **per_layer**: the destination is chosen and its blocks reserved when the
  request is dispatched, before its prompt runs; during each prompt step the
  KV of every layer leaves as soon as that layer is computed. With a step of
  D seconds over L layers and X seconds of transfer for the chunk's KV, the
  link is done at ``max(start + D/L + X, end + X/L, previous done + X)``
  (layers computed at D/L each, one layer's transfer X/L, in order on one
  link). Only what is left after the prompt's last step (at least the last
  layer's X/L) plus the commit is exposed. If the reservation is not
  confirmed by the end of the prompt (refused), the request falls back to
  serialized.

A destination that refuses (full above its watermark, terminating, its
handoff-in limit; a queue of its own does not refuse a handoff): the
request WAITS on the prefill instance, holding its blocks there, and asks
again every ``retry_s`` (the scheduler may pick another instance each
time). It decodes in place only when the cluster has no instance that
decodes at all (``phase_views`` then offers every instance).
Failures are not modelled (nothing fails in a simulated run).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

from ferry.sim.instance import SimInstance
from ferry.sim.kernel import Delay, Kernel
from ferry.sim.migration import MigrationModel
from ferry.sim.params import TransferModel
from ferry.sim.scheduler import SimScheduler
from libs.common.policies.base import blocks_for
from libs.common.policies.phases import (
    DEFAULT_PER_LAYER_THRESHOLD,
    HandoffMode,
    Phase,
    handoff_mode,
    needs_handoff,
)
from libs.common.types import Priority
from services.instance.engine.core.scheduler import ScheduledChunk

_ids = itertools.count()


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
    exposed_s: float = 0.0  # the prompt's last step end -> the commit reaches the decode instance
    refusals: int = 0  # pre-allocations refused before one was taken
    fallback: bool = False  # per_layer asked, no reservation by the prompt's end: ran serialized
    in_place: bool = False  # no instance decodes: decoded on the prefill instance


@dataclass
class _Early:
    """A per-layer handoff's reservation and its link."""

    source: SimInstance
    mid: str
    prompt_tokens: int
    dst: SimInstance | None = None
    confirmed: bool = False
    failed: bool = False
    abandoned: bool = False
    refusals: int = 0
    link_done: float = 0.0  # when the KV sent so far has arrived
    backlog_tokens: int = 0  # computed before the reservation was confirmed: sent once it is


class HandoffModel:
    def __init__(self, kernel: Kernel, migration: MigrationModel, scheduler: SimScheduler,
                 instances: dict[str, SimInstance], per_layer_threshold: int = DEFAULT_PER_LAYER_THRESHOLD,
                 retry_s: float = 0.010, wall: float = 1.0):
        self.k = kernel
        self.migration = migration
        self.scheduler = scheduler
        self.instances = instances
        self.per_layer_threshold = per_layer_threshold
        self.retry_s = retry_s
        self.wall = wall
        self.early: dict[str, _Early] = {}
        self.records: list[HandoffRecord] = []
        self.active = 0

    def transfer(self, src: SimInstance, dst: SimInstance) -> TransferModel:
        """The KV link between two machines: the slower one's bandwidth."""
        gbps = min(src.profile.migration_bandwidth_gbps, dst.profile.migration_bandwidth_gbps)
        return TransferModel(src.profile.kv_bytes_per_token * src.profile.block_size, gbps * 1e9 / 8 / self.wall)

    def _token_s(self, src: SimInstance, dst: SimInstance, tokens: int) -> float:
        t = self.transfer(src, dst)
        return tokens * t.bytes_per_block / src.profile.block_size / t.bandwidth_bytes_per_s

    # --- dispatch time: the per-layer reservation --------------------------------------------
    def on_dispatch(self, src: SimInstance, rid: str, prompt_tokens: int) -> None:
        if not needs_handoff(src.role):
            return
        if handoff_mode(prompt_tokens, self.per_layer_threshold) is not HandoffMode.PER_LAYER:
            return
        e = _Early(src, f"ho-{next(_ids)}", prompt_tokens)
        self.early[rid] = e
        self.k.spawn(self._reserve_early(rid, e))

    def _reserve_early(self, rid: str, e: _Early):
        dst = self._pick(e.source, rid, e.prompt_tokens)
        if dst is None or dst is e.source:
            e.failed = True
            return
        n = blocks_for(e.prompt_tokens, dst.profile.block_size)
        ok, _ = yield from self.migration._rpc(
            dst, self.migration.pre_allocate(dst, e.mid, rid, 0, n, 0, None, handoff=True))
        if not ok:
            e.failed, e.refusals = True, e.refusals + 1
            self._unpend(dst, rid)
            return
        if e.abandoned:  # the prompt ended first (fell back) or the request finished
            self._unpend(dst, rid)
            yield from self.migration._rpc(dst, self.migration.abort_at_destination(dst, e.mid))
            return
        e.dst, e.confirmed = dst, True
        e.link_done = max(e.link_done, self.k.now) + self._token_s(e.source, dst, e.backlog_tokens)
        e.backlog_tokens = 0

    def on_chunks(self, inst: SimInstance, chunks: list[ScheduledChunk], start: float, end: float) -> None:
        """A step ran on a prefill instance: advance the link of every
        per-layer request whose prompt it computed part of."""
        if not self.early:
            return
        layers = max(1, inst.profile.num_layers)
        d = end - start
        for c in chunks:
            e = self.early.get(c.request.request_id)
            if e is None or e.failed:
                continue
            if not e.confirmed:
                e.backlog_tokens += c.num_new
                continue
            x = self._token_s(inst, e.dst, c.num_new)
            e.link_done = max(start + d / layers + x, end + x / layers, e.link_done + x)

    # --- the prompt is done ---------------------------------------------------------------------
    def on_first_token(self, src: SimInstance, rid: str, prompt_tokens: int, finished: bool) -> None:
        """Called at the boundary after the step that sampled the request's
        first token on ``src`` (before the next step is scheduled)."""
        e = self.early.pop(rid, None)
        if finished or not needs_handoff(src.role):
            if e is not None:
                self._abandon(rid, e)
            return
        self.active += 1

        def exported(result, exc) -> None:
            if exc is not None:
                raise exc
            self.k.spawn(self._handoff(src, rid, prompt_tokens, e, *result))

        src.submit(self._suspend_and_export, src.engine, rid, done=exported)

    @staticmethod
    def _suspend_and_export(eng, rid: str):
        if not eng.suspend_request(rid):
            raise RuntimeError(f"handoff: {rid} is not running after its prompt")
        blocks = eng.all_blocks(rid)
        return eng.export_state(rid), blocks, eng.gather_kv(blocks)

    def _abandon(self, rid: str, e: _Early) -> None:
        e.abandoned = True
        if e.confirmed:
            self._unpend(e.dst, rid)
            self.k.spawn(self.migration._rpc(e.dst, self.migration.abort_at_destination(e.dst, e.mid)))

    def _pick(self, src: SimInstance, rid: str, tokens: int, token_ids=None) -> SimInstance | None:
        """``token_ids``: the prompt, for a policy that scores prefixes (a
        serialized handoff links the prefix the decode instance holds)."""
        iid = self.scheduler.choose(rid, tokens, Priority.NORMAL, Phase.DECODE, token_ids=token_ids)
        return None if iid is None else self.instances[iid]

    def _unpend(self, dst: SimInstance, rid: str) -> None:
        """A refused destination no longer counts the request as coming."""
        self.scheduler.pending.settle(dst.instance_id, (rid,), self.k.now)

    def _handoff(self, src: SimInstance, rid: str, prompt_tokens: int, e: _Early | None, state, blocks, kv):
        t0 = self.k.now
        rec = HandoffRecord(rid, HandoffMode.SERIALIZED.value, src.instance_id, prompt_tokens=prompt_tokens,
                            blocks=len(blocks))
        rpc = self.migration.delays.rpc_s
        if e is not None and e.confirmed:
            rec.mode, dst, mid = HandoffMode.PER_LAYER.value, e.dst, e.mid
            rec.refusals = e.refusals
            if e.link_done > self.k.now:
                yield Delay(e.link_done - self.k.now)
        else:
            if e is not None:
                rec.fallback, rec.refusals = True, e.refusals
                self._abandon(rid, e)
            mid = f"ho-{next(_ids)}"
            # The prompt's blocks cached at the decode instance are linked there, not sent (PreAllocate.link).
            link = (tuple(src.engine.block_hashes(rid)[:state.num_computed_tokens // src.profile.block_size])
                    if self.migration.config.link_cached else ())
            while True:
                dst = self._pick(src, rid, prompt_tokens, state.prompt_token_ids if link else None)
                if dst is None or dst is src:
                    rec.in_place = True
                    yield src.call(src.engine.resume_request, rid)
                    self._done(rec, t0)
                    return
                ok, _ = yield from self.migration._rpc(
                    dst, self.migration.pre_allocate(dst, mid, rid, 0, len(blocks), 0, None, handoff=True,
                                                     link=link))
                if ok:
                    break
                self._unpend(dst, rid)
                rec.refusals += 1
                yield Delay(self.retry_s)
            rec.linked = len(dst.reservations[mid].linked)
            if rec.linked and kv is not None:
                kv = memoryview(kv)[rec.linked * len(kv) // len(blocks):]
            yield Delay(rpc + self.transfer(src, dst).seconds(len(blocks) - rec.linked))
        rec.destination = dst.instance_id
        rec.transfer_s = self.transfer(src, dst).seconds(len(blocks) - rec.linked)
        yield Delay(rpc / 2)
        self.migration.commit(dst, mid, state, kv)
        rec.exposed_s = self.k.now - t0
        yield Delay(rpc / 2)
        yield src.call(src.engine.drop_request, rid)
        self._done(rec, t0)

    def _done(self, rec: HandoffRecord, t0: float) -> None:
        self.active -= 1
        self.records.append(rec)

    def summary(self) -> dict:
        recs = self.records
        by_mode = {m.value: [r for r in recs if r.mode == m.value and not r.in_place] for m in HandoffMode}
        out = {"handoffs": len(recs), "in_place": sum(r.in_place for r in recs),
               "blocks": sum(r.blocks for r in recs if not r.in_place),
               "blocks_linked": sum(r.linked for r in recs),
               "fallbacks": sum(r.fallback for r in recs), "refusals": sum(r.refusals for r in recs)}
        for mode, rs in by_mode.items():
            exp = sorted(r.exposed_s for r in rs)
            out[mode] = {"n": len(rs),
                         "exposed_ms_mean": 1000 * sum(exp) / len(exp) if exp else None,
                         "exposed_ms_max": 1000 * exp[-1] if exp else None,
                         "transfer_ms_mean": 1000 * sum(r.transfer_s for r in rs) / len(rs) if rs else None}
        return out

    def record_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]
