"""The destination side of a migration: reservations with a deadline that
every call renews, KV chunks scattered into the reserved blocks as they
arrive, and the commit that installs the request."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from libs.common.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound
from libs.common.logging import get_logger
from libs.common.types import RequestState
from services.instance.engine.base import KvLayout
from services.instance.migration.states import DestState, Machine

log = get_logger("migration")


@dataclass
class Reservation:
    machine: Machine
    source_instance_id: str
    deadline: float
    deadline_s: float
    stages: dict[int, list[int]] = field(default_factory=dict)  # stage -> reserved block ids
    received: dict[int, int] = field(default_factory=dict)  # stage -> blocks written
    bytes: int = 0
    committed_at: float | None = None
    spare: list[int] = field(default_factory=list)  # held for the last stage

    @property
    def blocks(self) -> list[int]:
        return [b for s in sorted(self.stages) for b in self.stages[s]]

    @property
    def held(self) -> list[int]:
        return self.blocks + self.spare

    def renew(self) -> None:
        self.deadline = time.monotonic() + self.deadline_s


class Destination:
    def __init__(self, svc, max_migrate_in: int):
        self.svc = svc
        self.engine = svc.engine
        self.runner = svc.runner
        self.max_migrate_in = max_migrate_in
        self.reservations: dict[str, Reservation] = {}

    @property
    def active(self) -> int:
        return sum(1 for r in self.reservations.values() if r.machine.state is DestState.RESERVED)

    def _get(self, migration_id: str, state: DestState = DestState.RESERVED) -> Reservation:
        res = self.reservations.get(migration_id)
        if res is None:
            raise NotFound(f"no reservation for migration {migration_id!r} (expired or aborted)")
        if res.machine.state is not state:
            raise FailedPrecondition(f"migration {migration_id!r} is {res.machine.state.value}")
        res.renew()
        return res

    async def pre_allocate(self, migration_id: str, request_id: str, stage: int, num_blocks: int,
                           layout: KvLayout, deadline_ms: int, source: str, spare: int = 0) -> tuple[bool, str]:
        mine = self.engine.kv_layout
        if layout != mine:
            return False, f"kv layout mismatch: source {layout}, destination {mine}"
        res = self.reservations.get(migration_id)
        if res is None:
            if self.svc.terminating:
                return False, "destination is terminating"
            if self.active >= self.max_migrate_in:
                return False, f"migrate-in limit {self.max_migrate_in} reached"
            if request_id in self.svc.streams:
                return False, f"request {request_id!r} already lives here"
            deadline_s = max(0.05, deadline_ms / 1000)
            res = Reservation(Machine("destination", migration_id, request_id, DestState.NONE), source,
                              time.monotonic() + deadline_s, deadline_s)
        elif res.machine.state is not DestState.RESERVED:
            return False, f"migration is {res.machine.state.value}"
        if stage in res.stages:
            return False, f"stage {stage} already reserved"
        # Serve the stage from the spare blocks when they suffice (no engine
        # step needed: the last stage comes right after the suspend).
        from_spare = min(num_blocks, len(res.spare))
        want = num_blocks - from_spare + max(0, spare - (len(res.spare) - from_spare))
        fresh = await self.runner.call(self.engine.reserve_blocks, want) if want else []
        if fresh is None:
            if res.machine.state is DestState.RESERVED:  # keep earlier stages until the source aborts
                res.renew()
            return False, f"{want} blocks do not fit above the watermark"
        pool = res.spare + fresh
        res.stages[stage], res.spare = pool[:num_blocks], pool[num_blocks:]
        if migration_id not in self.reservations:
            self.reservations[migration_id] = res
        res.received[stage] = 0
        res.renew()
        res.machine.to(DestState.RESERVED, stage=stage, blocks=num_blocks, spare=len(res.spare),
                       total_blocks=len(res.blocks))
        self.svc.migrating_in = self.active
        return True, ""

    async def transfer(self, chunks) -> tuple[int, int]:
        """Consume one stage's KvChunk stream; scatter each chunk into its blocks."""
        res = None
        written = nbytes = 0
        bpb = self.engine.kv_layout.bytes_per_block
        async for chunk in chunks:
            if res is None:
                res = self._get(chunk.migration_id)
                stage = chunk.stage
                if stage not in res.stages:
                    raise InvalidArgument(f"stage {stage} was not pre-allocated")
                blocks = res.stages[stage]
            res.renew()
            if chunk.offset % bpb or len(chunk.data) % bpb:
                raise InvalidArgument("KV chunk is not aligned to whole blocks")
            first = chunk.offset // bpb
            n = len(chunk.data) // bpb
            if first + n > len(blocks):
                raise InvalidArgument(f"KV chunk for blocks {first}..{first + n} of a {len(blocks)}-block stage")
            await asyncio.to_thread(self.engine.scatter_kv, blocks[first:first + n], chunk.data)
            written += n
            nbytes += len(chunk.data)
            if res.machine.state is not DestState.RESERVED:  # aborted while we wrote
                raise Aborted("migration aborted during transfer")
        if res is not None:
            res.received[stage] += written
            res.bytes += nbytes
        return written, nbytes

    async def commit(self, migration_id: str, state: RequestState) -> None:
        res = self._get(migration_id)
        missing = {s: len(b) - res.received.get(s, 0) for s, b in res.stages.items()
                   if res.received.get(s, 0) != len(b)}
        if missing:
            raise FailedPrecondition(f"blocks not received per stage: {missing}")
        n_tokens = len(state.prompt_token_ids) + len(state.output_token_ids)
        need = -(-state.num_computed_tokens // self.engine.block_size)
        if not 0 <= state.num_computed_tokens < n_tokens or len(res.blocks) != need:
            raise InvalidArgument(f"{len(res.blocks)} blocks for {state.num_computed_tokens} computed tokens")
        # NOTE: a dict lookup from the event loop; the engine thread only adds
        # this id through _install below, which runs after this check.
        if self.engine.request_phase(state.request_id) is not None or state.request_id in self.svc.streams:
            raise FailedPrecondition(f"request {state.request_id!r} already lives here")
        # Validated: acknowledge now and install at the engine's next step
        # boundary (waiting for it here would add a step to the downtime).
        self.svc.streams.open(state.request_id, next_index=len(state.output_token_ids))
        self.runner.submit(self._install, state, res.blocks, res.spare)
        res.spare = []
        res.committed_at = time.monotonic()
        res.machine.to(DestState.COMMITTED, blocks=len(res.blocks), bytes=res.bytes)
        self.svc.migrating_in = self.active

    def _install(self, state: RequestState, blocks: list[int], spare: list[int]) -> None:
        """On the engine thread. NOTE: the commit was validated; a failure here
        is a bug, and the client's stream is ended rather than left hanging."""
        if spare:
            self.engine.release_blocks(spare)
        try:
            self.engine.install_request(state, blocks)
        except Exception as e:  # noqa: BLE001
            log.error("install after commit failed", request_id=state.request_id, error=repr(e))
            self.engine.release_blocks(blocks)
            self.runner.loop.call_soon_threadsafe(self.svc._end_stream, state.request_id, "abort")

    async def abort(self, migration_id: str, reason: str) -> bool:
        res = self.reservations.get(migration_id)
        if res is None or res.machine.terminal:
            return False
        if res.machine.state is DestState.COMMITTED:
            # Commit reply lost: the source goes on; drop our copy unless a
            # client already follows it here (then the source cannot have
            # resumed: it only sends `moved` after a successful commit).
            stream = self.svc.streams.get(res.machine.request_id)
            if stream is not None and stream.attached:
                return False
            self.svc.streams.close(res.machine.request_id)
            await self.runner.call(self.engine.abort_request, res.machine.request_id)
        else:
            await self.runner.call(self.engine.release_blocks, res.held)
        res.machine.to(DestState.ABORTED, reason=reason)
        self.svc.migrating_in = self.active
        return True

    async def expire(self) -> None:
        """Free reservations whose deadline passed (the source died), and drop
        committed requests nobody attached to in time."""
        now = time.monotonic()
        for mid, res in list(self.reservations.items()):
            st = res.machine.state
            if st is DestState.RESERVED and now > res.deadline:
                await self.runner.call(self.engine.release_blocks, res.held)
                res.machine.to(DestState.EXPIRED, blocks=len(res.held))
                self.svc.migrating_in = self.active
            elif st is DestState.COMMITTED:
                stream = self.svc.streams.get(res.machine.request_id)
                if stream is None or stream.attached:
                    del self.reservations[mid]  # the client follows the request here: done
                    continue
                if now > res.committed_at + res.deadline_s:
                    log.warning("committed request never attached; dropping", migration_id=mid,
                                request_id=res.machine.request_id)
                    await self.abort(mid, "not attached before the deadline")
            if res.machine.terminal:
                del self.reservations[mid]
