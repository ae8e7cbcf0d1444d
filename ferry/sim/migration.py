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
``next_to_migrate``. Failures (crashes, lost replies, deadlines) are not
modelled: nothing fails in a simulated run.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator
from dataclasses import dataclass, field, replace

from ferry.sim.instance import SimInstance
from ferry.sim.kernel import Delay
from ferry.sim.params import Delays, TransferModel
from libs.common.types import RequestState
from services.instance.migration.policy import next_to_migrate
from services.instance.migration.source import MigrationConfig
from services.instance.migration.states import DestState

_ids = itertools.count()


class Aborted(Exception):
    pass


@dataclass
class Reservation:
    request_id: str
    state: DestState = DestState.NONE
    stages: dict[int, list[int]] = field(default_factory=dict)
    spare: list[int] = field(default_factory=list)

    @property
    def blocks(self) -> list[int]:
        return [b for s in sorted(self.stages) for b in self.stages[s]]


@dataclass
class Outcome:
    request_id: str
    committed: bool = False
    reason: str = ""
    stages: int = 0
    blocks: int = 0
    downtime_s: float = 0.0
    duration_s: float = 0.0


@dataclass
class MigrationModel:
    config: MigrationConfig
    delays: Delays
    transfer: TransferModel
    outcomes: list[Outcome] = field(default_factory=list)

    # --- destination (destination.py) ----------------------------------------------
    def _active_in(self, dst: SimInstance) -> int:
        return sum(1 for r in dst.reservations.values() if r.state is DestState.RESERVED)

    def pre_allocate(self, dst: SimInstance, mid: str, rid: str, stage: int, n: int, spare: int):
        res = dst.reservations.get(mid)
        if res is None:
            if dst.terminating:
                return False, "destination is terminating"
            if self._active_in(dst) >= self.config.max_migrate_in:
                return False, f"migrate-in limit {self.config.max_migrate_in} reached"
            if rid in dst.engine.requests:
                return False, f"request {rid!r} already lives here"
            res = Reservation(rid)
        elif res.state is not DestState.RESERVED:
            return False, f"migration is {res.state.value}"
        if stage in res.stages:
            return False, f"stage {stage} already reserved"
        from_spare = min(n, len(res.spare))
        want = n - from_spare + max(0, spare - (len(res.spare) - from_spare))
        fresh = (yield dst.call(dst.engine.reserve_blocks, want)) if want else []
        if fresh is None:
            return False, f"{want} blocks do not fit above the watermark"
        pool = res.spare + fresh
        res.stages[stage], res.spare = pool[:n], pool[n:]
        dst.reservations[mid] = res
        res.state = DestState.RESERVED
        dst.migrating_in = self._active_in(dst)
        return True, ""

    def commit(self, dst: SimInstance, mid: str, state: RequestState) -> None:
        res = dst.reservations[mid]
        blocks, spare = res.blocks, res.spare

        def install() -> None:
            if spare:
                dst.engine.release_blocks(spare)
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
                ok, reason = yield from self._rpc(dst, self.pre_allocate(dst, mid, rid, stage, len(todo), spare))
                if not ok:
                    raise Aborted(f"destination refused: {reason}")
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
                    use_priorities: bool, max_requests: int = 64):
        """Returns (started, committed)."""
        if src.migrating_out >= self.config.max_migrate_out:
            return 0, 0
        src.orders += 1
        started = committed = 0
        tried: set[str] = set()
        try:
            while started < max_requests:
                status = src.status()
                while status is None:  # the published load was not kept: read the next one
                    yield src.call(lambda: None)
                    status = src.status()
                rid = next_to_migrate(status, started, stop_when_freeness_above, use_priorities,
                                      frozenset(tried))
                if rid is None or dst.stopped:
                    break
                tried.add(rid)
                started += 1
                out = yield from self.migrate_one(src, dst, rid)
                if out.committed:
                    committed += 1
                elif "refused" in out.reason:
                    break  # the destination is full: ask the scheduler again
        finally:
            src.orders -= 1
        return started, committed
