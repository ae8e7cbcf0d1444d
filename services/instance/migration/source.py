"""The source side of one migration (DESIGN §6): multi-stage pre-copy of
full blocks while the request keeps decoding, pre-allocate before and verify
after every stage, suspend at a step boundary, last stage, commit with the
full request state. Any failure aborts: the request goes on at the source as
if nothing happened."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, replace

import grpc

from ferry.pb import instance_pb2 as pb
from ferry.pb import instance_pb2_grpc as pb_grpc
from libs.common import convert, failpoints
from libs.common.logging import get_logger
from services.instance.migration.states import Machine, SourceState
from services.instance.streams import Event

log = get_logger("migration")
S = SourceState


class MigrationAborted(Exception):
    pass


@dataclass(frozen=True)
class MigrationConfig:
    max_stages: int = 4
    last_stage_max_blocks: int = 2
    chunk_bytes: int = 4 << 20
    max_migrate_out: int = 1
    max_migrate_in: int = 2
    deadline_ms: int = 3000
    rpc_timeout_s: float = 10.0


@dataclass
class Outcome:
    migration_id: str
    request_id: str
    committed: bool
    reason: str = ""
    stages: int = 0
    blocks: int = 0
    bytes: int = 0
    duration_ms: float = 0.0
    downtime_ms: float = 0.0

    def to_pb(self) -> pb.MigrationResult:
        return pb.MigrationResult(
            migration_id=self.migration_id, request_id=self.request_id,
            outcome="committed" if self.committed else "aborted", reason=self.reason, stages=self.stages,
            blocks=self.blocks, bytes=self.bytes, duration_ms=self.duration_ms, downtime_ms=self.downtime_ms)


def _header(layout) -> pb.KvHeader:
    return pb.KvHeader(dtype=layout.dtype, block_size=layout.block_size, num_layers=layout.num_layers,
                       num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim)


class SourceMigration:
    def __init__(self, svc, request_id: str, dest_id: str, dest_address: str, stub: pb_grpc.InstanceStub,
                 config: MigrationConfig):
        self.svc = svc
        self.engine = svc.engine
        self.runner = svc.runner
        self.request_id = request_id
        self.dest_id = dest_id
        self.dest_address = dest_address
        self.stub = stub
        self.config = config
        self.id = f"mig-{uuid.uuid4().hex[:12]}"
        self.m = Machine("source", self.id, request_id, S.SELECT)
        self.out = Outcome(self.id, request_id, False)
        self.sent = 0  # blocks already copied
        self.preemptions = 0
        self.suspended = False

    # --- helpers ---------------------------------------------------------------
    @property
    def spare_blocks(self) -> int:
        """Most blocks the last stage can need: the uncopied full blocks that
        allow it, the partial block, and one more the request may fill while
        the suspend waits for the step boundary."""
        return self.config.last_stage_max_blocks + 2

    async def _pre_allocate(self, stage: int, n: int, spare: int = 0) -> None:
        reply = await self.stub.PreAllocate(pb.PreAllocateRequest(
            migration_id=self.id, request_id=self.request_id, num_blocks=n, stage=stage,
            header=_header(self.engine.kv_layout), deadline_ms=self.config.deadline_ms,
            source_instance_id=self.svc.instance_id, spare_blocks=spare), timeout=self.config.rpc_timeout_s)
        if not reply.accepted:
            raise MigrationAborted(f"destination refused: {reply.reason}")

    async def _copy(self, stage: int, blocks: list[int]) -> int:
        """Gather the blocks in chunks (off the event loop and the engine
        thread) and stream them; returns bytes sent."""
        if not blocks:
            return 0
        bpb = self.engine.kv_layout.bytes_per_block
        per_chunk = max(1, self.config.chunk_bytes // bpb)
        total = len(blocks) * bpb
        delay = failpoints.value("source.copy_delay_ms")

        async def chunks():
            for i in range(0, len(blocks), per_chunk):
                data = await asyncio.to_thread(self.engine.gather_kv, blocks[i:i + per_chunk])
                yield pb.KvChunk(migration_id=self.id, stage=stage, num_blocks=len(blocks),
                                 offset=i * bpb, data=bytes(data), total_bytes=total)
                if failpoints.enabled("source.crash_mid_transfer") and i == 0:
                    import os

                    os._exit(17)

        reply = await self.stub.TransferKv(chunks(), timeout=self.config.rpc_timeout_s)
        if reply.blocks_written != len(blocks):
            raise MigrationAborted(f"destination wrote {reply.blocks_written} of {len(blocks)} blocks")
        if delay:
            await asyncio.sleep(float(delay) / 1000)
        return total

    async def _verify(self) -> None:
        phase = await self.runner.call(self.engine.request_phase, self.request_id)
        if phase is None:
            raise MigrationAborted("request finished or was aborted at the source")
        status, preemptions = phase
        if preemptions != self.preemptions or status != "running":
            raise MigrationAborted(f"request was preempted at the source ({status})")

    # --- the protocol ------------------------------------------------------------
    async def run(self) -> Outcome:
        t0 = time.perf_counter()
        try:
            await self._run()
        except (MigrationAborted, grpc.RpcError, Exception) as e:  # noqa: BLE001 - every failure aborts
            reason = e.details() if isinstance(e, grpc.RpcError) else str(e)
            await self._abort(reason or type(e).__name__)
        self.out.duration_ms = (time.perf_counter() - t0) * 1000
        self.out.stages = sum(1 for s in self.m.history if s in (S.COPY, S.COPY_LAST))
        return self.out

    async def _run(self) -> None:
        phase = await self.runner.call(self.engine.request_phase, self.request_id)
        if phase is None or phase[0] != "running":
            raise MigrationAborted("request is not running")
        self.preemptions = phase[1]
        stage = 0
        while True:
            full = await self.runner.call(self.engine.full_blocks, self.request_id)
            todo = full[self.sent:]
            # Stage 0 always runs (with no block if none is full yet): it
            # reserves the spare blocks of the last stage before the suspend.
            last = len(todo) <= self.config.last_stage_max_blocks or stage >= self.config.max_stages
            if stage > 0 and last:
                break
            if last:
                todo = []
            spare = 0
            if stage == 0:
                spare = self.spare_blocks
                if self.config.max_stages == 0:  # blocking baseline: the last stage is everything
                    spare += len(await self.runner.call(self.engine.all_blocks, self.request_id))
            self.m.to(S.PRE_ALLOC, stage=stage, blocks=len(todo))
            await self._pre_allocate(stage, len(todo), spare=spare)
            self.m.to(S.COPY, stage=stage, blocks=len(todo))
            nbytes = await self._copy(stage, todo)
            self.out.blocks += len(todo)
            self.out.bytes += nbytes
            self.sent += len(todo)
            self.m.to(S.VERIFY, stage=stage, blocks=len(todo), bytes=nbytes)
            await self._verify()
            stage += 1
            if last:
                break

        self.m.to(S.SUSPEND, stage=stage)
        # One engine-thread call at a step boundary: suspend, export, and list
        # what is left to copy (a second call would wait a whole step).
        suspended, t_suspend, state, rest = await self.runner.call(self._suspend_and_export)
        if not suspended:
            raise MigrationAborted("request finished or was preempted before suspend")
        self.suspended = True
        self.m.to(S.PRE_ALLOC_LAST, stage=stage, blocks=len(rest))
        await self._pre_allocate(stage, len(rest))
        self.m.to(S.COPY_LAST, stage=stage, blocks=len(rest))
        nbytes = await self._copy(stage, rest)
        self.out.blocks += len(rest)
        self.out.bytes += nbytes
        self.m.to(S.COMMIT, blocks=self.out.blocks, bytes=self.out.bytes)
        state = replace(state, num_migrations=state.num_migrations + 1)
        reply = await self.stub.Commit(pb.CommitRequest(migration_id=self.id, state=convert.state_to_pb(state)),
                                       timeout=self.config.rpc_timeout_s)
        if not reply.ok:
            raise MigrationAborted(f"commit refused: {reply.reason}")
        # The destination owns the request now: tell the client's stream where
        # to go on first (it is suspended here, no token can come between),
        # then forget it here.
        self.out.downtime_ms = (time.perf_counter() - t_suspend) * 1000
        stream = self.svc.streams.get(self.request_id)
        if stream is not None:
            stream.push(Event(len(state.output_token_ids), moved_to=(self.dest_id, self.dest_address)))
            self.svc.streams.close(self.request_id)
        self.suspended = False
        await self.runner.call(self.engine.drop_request, self.request_id)
        self.out.committed = True
        self.m.to(S.DONE, blocks=self.out.blocks, bytes=self.out.bytes,
                  downtime_ms=round(self.out.downtime_ms, 3))

    def _suspend_and_export(self):
        """On the engine thread, between two steps: take the request out of
        the batch; its state; its blocks not yet copied (the partial last
        block included). Downtime starts here."""
        if not self.engine.suspend_request(self.request_id):
            return False, 0.0, None, []
        t = time.perf_counter()
        state = self.engine.export_state(self.request_id)
        rest = self.engine.all_blocks(self.request_id)[self.sent:]
        return True, t, state, rest

    async def _abort(self, reason: str) -> None:
        self.out.reason = reason
        if self.suspended:
            try:
                await self.runner.call(self.engine.resume_request, self.request_id)
            except Exception as e:  # noqa: BLE001 - aborted meanwhile (client gone)
                log.info("request gone while suspended", request_id=self.request_id, error=str(e))
            self.suspended = False
        if not self.m.terminal:
            self.m.to(S.ABORT, reason=reason)
        try:
            await self.stub.AbortMigration(pb.AbortMigrationRequest(migration_id=self.id, reason=reason),
                                           timeout=2.0)
        except grpc.RpcError:
            pass  # the destination's reservation deadline frees its blocks
