"""The source side of a cache move (issue 53, move instead of evict): one
program's kept blocks, with no request attached, go to another instance's
prefix cache on the migration protocol, so that the program's next turn finds
its history there instead of recomputing it after an eviction here.

SELECT (the engine pins the program's kept blocks: ``export_program``) ->
PRE_ALLOC (one stage; the destination links the head it holds already) ->
COPY (the rest, through the fused buffer or the shared cache, as a
migration's stages) -> VERIFY -> COMMIT (the destination names the blocks in
its cache and keeps them for the program; its KV events tell the index) ->
DONE (here the program's hold ends, ``end_export``: its blocks are plain
cache, the first to be evicted when room is needed, and a turn sent here
meanwhile still finds them). The blocks are free and full, and nothing
writes them while they are pinned: one stage is the whole copy, and nothing
is suspended (so it is not a ``last`` stage: the destination holds no step
boundary for it, and expects no request's context).

NOTE: the source's copy stays until its room is needed, rather than being
freed at once: in the simulator (agentic workload, 120 programs, seed 0)
freeing it made returning turns recompute more than keeping nothing apart
(0.098 of their history against llumnix-keep's 0.090), leaving it cut that
to 0.055: a program's next turn is often sent back to the source (both hold
the history; of equal hits the lower id wins) before the source needs the
room.

Any failure before the commit's acknowledgement aborts: the blocks stay
kept here as before and the destination frees its reservation (or its
deadline does). After it, the blocks are the destination's: a failure then
leaves a copy in both caches, never none."""

from __future__ import annotations

import uuid

from libs.common.logging import get_logger
from libs.common.types import Outcome
from services.instance.engine.base import ProgramKv
from services.instance.migration.host import MigrationHost
from services.instance.migration.messages import MigrationAborted, MigrationConfig, PreAllocate
from services.instance.migration.peer import DestinationPeer
from services.instance.migration.source import Fault, SourceMigration, _cancel_now_if_asked, failpoint_faults
from services.instance.migration.states import Machine, SourceState

log = get_logger("migration")
S = SourceState
PREFIX = "program:"  # a cache move's id in the request's place (Outcome.request_id, the machines)


class CacheMove(SourceMigration):
    measures_downtime = False  # no request moved: nothing waits on it

    def __init__(self, host: MigrationHost, program_id: str, dest_id: str, dest_address: str,
                 peer: DestinationPeer, config: MigrationConfig, fault: Fault = failpoint_faults):
        super().__init__(host, PREFIX + program_id, dest_id, dest_address, peer, config, fault)
        self.program_id = program_id
        self.id = f"cmv-{uuid.uuid4().hex[:12]}"
        self.m = Machine("source", self.id, self.request_id, S.SELECT)
        self.out = Outcome(self.id, self.request_id, False)
        self.exported = False  # its blocks are pinned here (end_export ends it)
        self.acknowledged = False  # the destination keeps them now

    async def _run(self) -> None:
        kv = await self.runner.call(self.engine.export_program, self.program_id)
        if kv is None:
            raise MigrationAborted("no kept blocks of the program can move (in use, or none)")
        self.exported = True
        n = len(kv.block_ids)
        self._to(S.PRE_ALLOC, stage=0, blocks=n)
        share = self.engine.kv_share() if self.config.shared_kv else None
        a = await self.peer.pre_allocate(PreAllocate(
            self.id, self.request_id, 0, n, self.engine.kv_layout, self.deadline_ms, self.host.instance_id,
            kv_share=share, block_hashes=kv.block_hashes, link=self.config.link_cached,
            program_id=self.program_id))
        if not a.accepted:
            self.dest_failed = True
            raise MigrationAborted(f"destination refused: {a.reason}")
        self.shared = share if a.kv_shared else None
        linked = a.linked if self.config.link_cached else 0
        self.out.held_blocks, self.out.linked_blocks = len(a.held), linked
        self._to(S.COPY, stage=0)
        nbytes = await self._copy(0, list(kv.block_ids[linked:]))
        self._to(S.VERIFY, stage=0, bytes=nbytes)
        self._to(S.COMMIT)
        _cancel_now_if_asked()
        t = self.host.clock()
        await self.peer.commit_cache(self.id, ProgramKv(self.program_id, kv.block_hashes, (), kv.age_s, kv.gap_s))
        self.acknowledged = True
        self.out.commit_ack_ms = (self.host.clock() - t) * 1000
        await self._end_export()
        self.out.committed = True
        self.out.blocks, self.out.bytes = n - linked, nbytes
        self._to(S.DONE, blocks=n, linked=linked)

    async def _end_export(self) -> None:
        """The program's hold here ends once the destination has them, else it goes on."""
        if self.exported:
            self.exported = False
            await self.runner.call(self.engine.end_export, self.program_id, self.acknowledged)

    async def _abort(self, reason: str) -> None:
        self.out.reason = reason
        if not self.m.terminal:
            self.m.to(S.ABORT, reason=reason)
        try:
            await self._end_export()
        except Exception as e:  # noqa: BLE001 - the engine died: its blocks go with it
            log.warning("end of a cache move's export failed", migration_id=self.id, error=repr(e))
        if self.acknowledged:
            return  # the destination keeps its copy: nothing to undo there
        try:
            await self.peer.abort(self.id, reason)
        except Exception as e:  # noqa: BLE001 - the destination's deadline frees its blocks
            log.info("abort not delivered to the destination", migration_id=self.id, error=repr(e))
