"""Both sides of migration on one instance: the scheduler's migrate-out
orders (choose requests, migrate one at a time until no longer a source) and
the destination RPCs."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc

from ferry.pb import instance_pb2 as pb
from ferry.pb import instance_pb2_grpc as pb_grpc
from libs.common import convert, failpoints, rpc
from libs.common.errors import ResourceExhausted, Unavailable
from libs.common.logging import get_logger
from services.instance.engine.base import KvLayout
from services.instance.migration import metrics
from services.instance.migration.destination import Destination
from services.instance.migration.policy import next_to_migrate
from services.instance.migration.source import MigrationConfig, Outcome, SourceMigration

log = get_logger("migration")


class MigrationManager:
    def __init__(self, svc, config: MigrationConfig):
        self.svc = svc
        self.config = config
        self.dest = Destination(svc, config.max_migrate_in)
        self.outgoing: dict[str, SourceMigration] = {}  # request id -> migration
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._expiry = asyncio.create_task(self._expire_forever())

    @property
    def reservations(self):
        return self.dest.reservations

    async def close(self) -> None:
        self._expiry.cancel()
        for ch in self._channels.values():
            await ch.close()

    def _stub(self, address: str) -> pb_grpc.InstanceStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = rpc.channel(address)
        return pb_grpc.InstanceStub(ch)

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            try:
                await self.dest.expire()
            except Exception as e:  # noqa: BLE001
                log.error("reservation expiry failed", error=repr(e))

    # --- source ------------------------------------------------------------------
    async def migrate_one(self, request_id: str, dest_id: str, dest_address: str,
                          blocking: bool = False) -> Outcome:
        if len(self.outgoing) >= self.config.max_migrate_out:
            raise ResourceExhausted(f"migrate-out limit {self.config.max_migrate_out} reached")
        config = replace(self.config, max_stages=0) if blocking else self.config
        mig = SourceMigration(self.svc, request_id, dest_id, dest_address, self._stub(dest_address), config)
        self.outgoing[request_id] = mig
        self.svc.migrating_out = len(self.outgoing)
        try:
            out = await mig.run()
        finally:
            self.outgoing.pop(request_id, None)
            self.svc.migrating_out = len(self.outgoing)
            if self.svc.reporter:
                self.svc.reporter.poke()
        metrics.MIGRATIONS.labels("source", "committed" if out.committed else "aborted").inc()
        metrics.STAGES.observe(out.stages)
        metrics.BLOCKS.inc(out.blocks)
        metrics.BYTES.inc(out.bytes)
        metrics.DURATION.observe(out.duration_ms / 1000)
        if out.committed:
            metrics.DOWNTIME.observe(out.downtime_ms / 1000)
        return out

    async def migrate_out(self, req: pb.MigrateOutRequest) -> pb.MigrateOutReply:
        if self.svc.migrating_out >= self.config.max_migrate_out:
            raise ResourceExhausted("already migrating out")
        reply = pb.MigrateOutReply()
        tried: set[str] = set()
        limit = req.max_requests or 64
        while reply.started < limit:
            if req.request_id:
                if req.request_id in tried:
                    break
                rid = req.request_id
            else:
                rid = next_to_migrate(self.svc.status(), reply.started, req.stop_when_freeness_above,
                                      req.use_priorities, frozenset(tried))
                if rid is None:
                    break  # no longer a source, or nothing left to move
            tried.add(rid)
            reply.started += 1
            out = await self.migrate_one(rid, req.dest_instance_id, req.dest_address, req.blocking)
            reply.results.append(out.to_pb())
            if out.committed:
                reply.committed += 1
            else:
                reply.aborted += 1
                if "refused" in out.reason or "UNAVAILABLE" in out.reason.upper():
                    break  # the destination is full or gone: ask the scheduler again
        return reply

    # --- destination ---------------------------------------------------------------
    async def pre_allocate(self, req: pb.PreAllocateRequest) -> pb.PreAllocateReply:
        h = req.header
        layout = KvLayout(h.dtype, h.block_size, h.num_layers, h.num_kv_heads, h.head_dim)
        ok, reason = await self.dest.pre_allocate(req.migration_id, req.request_id, req.stage, req.num_blocks,
                                                  layout, req.deadline_ms, req.source_instance_id,
                                                  req.spare_blocks)
        if not ok:
            log.info("pre-allocate refused", migration_id=req.migration_id, reason=reason)
        return pb.PreAllocateReply(accepted=ok, reason=reason)

    async def transfer_kv(self, chunks) -> pb.TransferKvReply:
        if failpoints.enabled("dest.crash_mid_transfer"):
            import os

            async for _ in chunks:
                os._exit(17)  # killed with a transfer under way
        written, nbytes = await self.dest.transfer(chunks)
        return pb.TransferKvReply(blocks_written=written, bytes=nbytes)

    async def commit(self, req: pb.CommitRequest) -> pb.CommitReply:
        await self.dest.commit(req.migration_id, convert.state_from_pb(req.state))
        metrics.MIGRATIONS.labels("destination", "committed").inc()
        if self.svc.reporter:
            self.svc.reporter.poke()
        if failpoints.enabled("dest.drop_commit_reply"):
            raise Unavailable("failpoint: commit reply lost")
        return pb.CommitReply(ok=True)

    async def abort(self, req: pb.AbortMigrationRequest) -> pb.AbortMigrationReply:
        found = await self.dest.abort(req.migration_id, req.reason or "aborted by the source")
        return pb.AbortMigrationReply(found=found)
