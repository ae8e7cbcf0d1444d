"""Live migration on simulated instances: the protocol of
services/instance/migration (source.py, destination.py, manager.py) step by
step, as processes on the virtual clock, over the real engines' migration
hooks (full_blocks, reserve_blocks, suspend_request, export_state,
install_request, drop_request, release_blocks).

Costs: every call the live source makes on an engine thread waits for that
engine's next step boundary (EngineCall); every RPC is a round trip
(Delays.rpc_s); a KV stage takes TransferModel.seconds(blocks). The stage
decisions (last stage at <= last_stage_max_blocks uncopied or after
max_stages) and limits (max_migrate_out, max_migrate_in, the destination's
watermark) are MigrationConfig's, the choice of requests is
``next_to_migrate`` and the destination's consent ``accepts_migration``
(libs/common/policies/migration.py). A migrate-out order runs up to
``max_migrate_out`` migrations at once: while some are in flight, the status
the order chooses from counts their blocks as freed already. Failures (crashes, lost replies, deadlines) are not
modelled: nothing fails in a simulated run.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator
from dataclasses import dataclass, field, replace

from ferry.sim.instance import SimInstance
from ferry.sim.kernel import Delay, Kernel, Wait
from ferry.sim.params import Delays, TransferModel
from libs.common.types import InstanceStatus, RequestState
from libs.common.policies.migration import accepts_migration, next_to_migrate
from services.instance.migration.selection import status_without
from services.instance.migration.source import MigrationConfig
from services.instance.migration.states import DestState
from services.instance.status import instance_status

_ids = itertools.count()


class Aborted(Exception):
    pass


class _Signal(Wait):
    """Resumes the waiting process when ``fire`` is called (at most one waiter)."""

    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        self._resume = None
        self._pending = False

    def arm(self, kernel, resume, fail) -> None:
        if self._pending:
            self._pending = False
            kernel.after(0.0, resume, None)
        else:
            self._resume = resume

    def fire(self) -> None:
        if self._resume is not None:
            resume, self._resume = self._resume, None
            self.kernel.after(0.0, resume, None)
        else:
            self._pending = True


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
class Outcome:
    request_id: str
    committed: bool = False
    reason: str = ""
    stages: int = 0
    blocks: int = 0  # sent
    linked: int = 0  # linked at the destination from its prefix cache, not sent
    downtime_s: float = 0.0
    duration_s: float = 0.0


@dataclass
class MigrationModel:
    config: MigrationConfig
    delays: Delays
    transfer: TransferModel
    outcomes: list[Outcome] = field(default_factory=list)
    # The destination's freeness floor for accepts_migration (None: it refuses
    # only with a queue of its own; see the NOTE there).
    dest_keep_freeness_above: float | None = None

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

    # --- source (source.py) ------------------------------------------------------------
    def migrate_one(self, src: SimInstance, dst: SimInstance, rid: str):
        """One migration (manager.migrate_one + SourceMigration.run)."""
        mid = f"mig-{next(_ids)}"
        out = Outcome(rid)
        t0 = src.k.now
        src.migrating_out += 1
        suspended = False
        stages = 0
        try:
            eng, cfg = src.engine, self.config
            phase = yield src.call(eng.request_phase, rid)
            if phase is None or phase[0] != "running":
                raise Aborted("request is not running")
            preemptions, sent, stage = phase[1], 0, 0
            while True:
                full = yield src.call(eng.full_blocks, rid)
                todo = full[sent:]
                last = len(todo) <= cfg.last_stage_max_blocks or stage >= cfg.max_stages
                if stage > 0 and last:
                    break
                if last:
                    todo = []
                spare = cfg.last_stage_max_blocks + 2 if stage == 0 else 0
                link = tuple(eng.block_hashes(rid)[:len(full)]) if stage == 0 and cfg.link_cached else ()
                ok, reason = yield from self._rpc(dst, self.pre_allocate(
                    dst, mid, rid, stage, len(todo), spare, self.dest_keep_freeness_above if stage == 0 else False,
                    link=link))
                if not ok:
                    raise Aborted(f"destination refused: {reason}")
                if link:  # linked there, not sent (sent was 0)
                    out.linked = sent = len(dst.reservations[mid].linked)
                    todo = todo[sent:]
                if todo:
                    yield Delay(self.delays.rpc_s + self.transfer.seconds(len(todo)))
                stages += 1
                out.blocks += len(todo)
                sent += len(todo)
                phase = yield src.call(eng.request_phase, rid)
                if phase is None:
                    raise Aborted("request finished or was aborted at the source")
                if phase[1] != preemptions or phase[0] != "running":
                    raise Aborted(f"request was preempted at the source ({phase[0]})")
                stage += 1
                if last:
                    break
            suspended, state, rest = yield src.call(self._suspend_and_export, eng, rid, sent)
            if not suspended:
                raise Aborted("request finished or was preempted before suspend")
            t_suspend = src.k.now
            ok, reason = yield from self._rpc(dst, self.pre_allocate(dst, mid, rid, stage, len(rest), 0))
            if not ok:
                raise Aborted(f"destination refused: {reason}")
            if rest:
                yield Delay(self.delays.rpc_s + self.transfer.seconds(len(rest)))
            stages += 1
            out.blocks += len(rest)
            yield Delay(self.delays.rpc_s / 2)
            self.commit(dst, mid, replace(state, num_migrations=state.num_migrations + 1))
            yield Delay(self.delays.rpc_s / 2)
            out.downtime_s = src.k.now - t_suspend
            suspended = False
            yield src.call(eng.drop_request, rid)
            out.committed = True
        except Exception as e:  # noqa: BLE001 - every failure aborts, as in source.py
            out.reason = str(e) or type(e).__name__
            if suspended:
                yield src.call(self._resume, src, rid)
            yield from self._rpc(dst, self.abort_at_destination(dst, mid))
        finally:
            src.migrating_out -= 1
            src.poke()
        out.stages = stages
        out.duration_s = src.k.now - t0
        self.outcomes.append(out)
        return out

    @staticmethod
    def _suspend_and_export(eng, rid: str, sent: int):
        if not eng.suspend_request(rid):
            return False, None, []
        return True, eng.export_state(rid), eng.all_blocks(rid)[sent:]

    @staticmethod
    def _resume(src: SimInstance, rid: str) -> None:
        if src.engine.request_phase(rid) is not None:
            src.engine.resume_request(rid)

    # --- a migrate-out order (manager.migrate_out) --------------------------------------
    def migrate_out(self, src: SimInstance, dst: SimInstance, stop_when_freeness_above: float,
                    use_priorities: bool, max_requests: int = 64, linkable: dict | None = None):
        """Returns (started, committed). Up to ``max_migrate_out`` migrations
        run at once; a refusal by the destination ends the order (the
        scheduler pairs again next round)."""
        limit = self.config.max_migrate_out
        if src.migrating_out >= limit:
            return 0, 0
        src.orders += 1
        started = committed = 0
        tried: set[str] = set()
        inflight: dict[str, int] = {}  # request id -> its blocks
        done: list[Outcome] = []
        signal = _Signal(src.k)
        stop = False

        def finished(out: Outcome) -> None:
            inflight.pop(out.request_id, None)
            done.append(out)
            signal.fire()

        try:
            while True:
                while not stop and len(inflight) < limit and src.migrating_out < limit and started < max_requests:
                    load = src.published_load()
                    while load is None:  # the published load was not kept: read the next one
                        yield src.call(lambda: None)
                        load = src.published_load()
                    # As the live manager's order_status: the requests already leaving excluded.
                    view = status_without(src.instance_id, load, src.headroom, src.terminating,
                                          frozenset(inflight))
                    rid = next_to_migrate(view, started, stop_when_freeness_above, use_priorities, frozenset(tried),
                                          linkable)
                    if rid is None or dst.stopped:
                        stop = True
                        break
                    tried.add(rid)
                    started += 1
                    inflight[rid] = next((r.physical_blocks for r in load.requests if r.request_id == rid), 0)
                    src.k.spawn(self.migrate_one(src, dst, rid), finished)
                if not inflight and (stop or started >= max_requests or not done):
                    break
                if inflight:
                    yield signal
                for out in done:
                    if out.committed:
                        committed += 1
                    elif "refused" in out.reason:
                        stop = True  # the destination is full: ask the scheduler again
                done.clear()
                if stop and not inflight:
                    break
        finally:
            src.orders -= 1
        return started, committed
