"""The destination of a Splitwise handoff on simulated instances: the
handoff model's (ferry/sim/handoff.py) pre-allocation, commit and abort, as
processes on the virtual clock over the engines' migration hooks
(link_cached, reserve_blocks, install_request, release_blocks), and the
round trip of a unary call (Delays.rpc_s). Load-balancing migrations no
longer go through here: the simulator runs the live MigrationManager,
SourceMigration and Destination on its clock (ferry/sim/aio.py). A handoff's
consent is ``accepts_migration(handoff=True)``, its limit max_handoff_in
(MigrationConfig); failures are not modelled.

NOTE: what is left of the simulator's copy of the protocol (issue 41): the
handoff model still reserves here instead of at the live Destination.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator
from dataclasses import dataclass, field

from ferry.sim.instance import SimInstance
from ferry.sim.kernel import Delay
from ferry.sim.params import Delays, TransferModel
from libs.common.types import InstanceStatus, RequestState
from libs.common.policies.migration import accepts_migration
from services.instance.migration.source import MigrationConfig
from services.instance.migration.states import DestState
from services.instance.status import instance_status

_ids = itertools.count()


def _current_status(inst: SimInstance) -> InstanceStatus:
    load = inst.engine.load()  # the destination decides on its state now (pre-allocate runs between steps)
    return instance_status(inst.instance_id, inst.seq, inst.k.now, load, inst.headroom, inst.terminating,
                           inst.migrating_in, inst.migrating_out)


@dataclass
class Reservation:
    request_id: str
    handoff: bool = False  # counted against max_handoff_in, as destination.py's
    state: DestState = DestState.NONE
    linked: list[int] = field(default_factory=list)  # the request's first blocks, from this cache
    stages: dict[int, list[int]] = field(default_factory=dict)
    spare: list[int] = field(default_factory=list)

    @property
    def blocks(self) -> list[int]:
        return self.linked + [b for s in sorted(self.stages) for b in self.stages[s]]


@dataclass
class MigrationModel:
    config: MigrationConfig
    delays: Delays
    transfer: TransferModel

    # --- destination (destination.py) ----------------------------------------------
    def _active_in(self, dst: SimInstance, handoff: bool | None = None) -> int:
        """Reservations in flight into ``dst``: handoffs, migrations, or (None) both."""
        return sum(1 for r in dst.reservations.values()
                   if r.state is DestState.RESERVED and handoff in (None, r.handoff))

    def pre_allocate(self, dst: SimInstance, mid: str, rid: str, stage: int, n: int, spare: int,
                     keep_freeness_above: float | None | bool = False, handoff: bool = False,
                     link: tuple = ()):
        """``keep_freeness_above`` False: no consent check (a later stage).
        ``handoff``: a Splitwise handoff (accepts_migration's rule for it,
        and max_handoff_in instead of max_migrate_in). ``link``: the
        request's block hashes (first stage, PreAllocate.link): the blocks of
        their longest prefix cached at ``dst`` are linked (the reservation's
        ``linked``) and ``n``, counted from the request's first block,
        shrinks by as many."""
        res = dst.reservations.get(mid)
        if res is None:
            if dst.terminating:
                return False, "destination is terminating"
            if keep_freeness_above is not False:
                ok, reason = accepts_migration(_current_status(dst), n + spare, keep_freeness_above,
                                               handoff=handoff)
                if not ok:
                    return False, reason
            limit = self.config.max_handoff_in if handoff else self.config.max_migrate_in
            if self._active_in(dst, handoff) >= limit:
                return False, f"{'handoff' if handoff else 'migrate'}-in limit {limit} reached"
            if rid in dst.engine.requests:
                return False, f"request {rid!r} already lives here"
            res = Reservation(rid, handoff)
        elif res.state is not DestState.RESERVED:
            return False, f"migration is {res.state.value}"
        if stage in res.stages:
            return False, f"stage {stage} already reserved"

        def take(spare_now: int):  # one engine call, as the live destination's _take
            linked = dst.engine.link_cached(list(link)) if link else []
            m = max(0, n - len(linked))
            from_spare = min(m, spare_now)
            want = m - from_spare + max(0, spare - (spare_now - from_spare))
            fresh = dst.engine.reserve_blocks(want) if want else []
            if fresh is None and linked:
                dst.engine.release_blocks(linked)
            return linked, m, want, fresh

        if link or n + spare > len(res.spare):
            linked, n, want, fresh = yield dst.call(take, len(res.spare))
        else:  # from the spare blocks alone: no engine step to wait for
            linked, n, want, fresh = take(len(res.spare))
        if fresh is None:
            return False, f"{want} blocks do not fit above the watermark"
        res.linked += linked
        pool = res.spare + fresh
        res.stages[stage], res.spare = pool[:n], pool[n:]
        dst.reservations[mid] = res
        res.state = DestState.RESERVED
        dst.migrating_in = self._active_in(dst)
        return True, ""

    def commit(self, dst: SimInstance, mid: str, state: RequestState, kv: bytes | memoryview | None = None) -> None:
        """Install the request on its reserved blocks at ``dst``'s next step
        boundary; ``kv`` (the KV of the blocks after the linked ones, gathered
        at the source) is scattered into them first (a Splitwise handoff
        sends it in one piece)."""
        res = dst.reservations[mid]
        blocks, spare = res.blocks, res.spare

        def install() -> None:
            if spare:
                dst.engine.release_blocks(spare)
            if kv is not None:
                dst.engine.scatter_kv(blocks[len(res.linked):], kv)
            dst.engine.install_request(state, blocks)

        dst.submit(install)
        res.spare = []
        res.state = DestState.COMMITTED
        del dst.reservations[mid]  # nothing to expire: no client to wait for
        dst.migrating_in = self._active_in(dst)
        dst.poke()

    def abort_at_destination(self, dst: SimInstance, mid: str):
        res = dst.reservations.get(mid)
        if res is None or res.state is not DestState.RESERVED:
            return
        yield dst.call(dst.engine.release_blocks, res.blocks + res.spare)
        res.state = DestState.ABORTED
        del dst.reservations[mid]
        dst.migrating_in = self._active_in(dst)

    def _rpc(self, dst: SimInstance, handler: Generator | None = None):
        """A unary call to ``dst``: half a round trip there, the handler, back."""
        yield Delay(self.delays.rpc_s / 2)
        result = (yield from handler) if handler is not None else None
        yield Delay(self.delays.rpc_s / 2)
        return result
