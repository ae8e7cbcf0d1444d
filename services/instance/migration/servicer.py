"""The migration RPCs at the gRPC edge: protobuf in, domain types to the
manager and the destination, protobuf out. The destination's transport
failpoints (tests of lost replies and killed processes) live here too."""

from __future__ import annotations

from libs.pb import instance_pb2 as pb
from libs.common import convert, failpoints
from libs.common.errors import Unavailable
from libs.common.logging import get_logger
from services.instance.migration.grpc_peer import (
    chunks_from_pb,
    last_stage_from_pb,
    pre_allocate_from_pb,
    program_cache_from_pb,
)
from services.instance.migration.manager import MigrationManager

log = get_logger("migration")


class MigrationRpcs:
    def __init__(self, manager: MigrationManager):
        self.manager = manager
        self.dest = manager.dest

    async def migrate_out(self, req: pb.MigrateOutRequest) -> pb.MigrateOutReply:
        return convert.order_result_to_pb(await self.manager.migrate_out(convert.migrate_out_from_pb(req)))

    async def pre_allocate(self, req: pb.PreAllocateRequest) -> pb.PreAllocateReply:
        a = await self.dest.pre_allocate(pre_allocate_from_pb(req))
        if not a.accepted:
            log.info("pre-allocate refused", migration_id=req.migration_id, reason=a.reason)
        return pb.PreAllocateReply(accepted=a.accepted, reason=a.reason, kv_shared=a.kv_shared,
                                   held_block_hashes=a.held, linked_blocks=a.linked)

    async def transfer_kv(self, chunks) -> pb.TransferKvReply:
        if failpoints.enabled("dest.crash_mid_transfer"):
            import os

            async for _ in chunks:
                os._exit(17)  # simulates this process killed with a transfer under way
        written, nbytes = await self.dest.transfer(chunks_from_pb(chunks))
        return pb.TransferKvReply(blocks_written=written, bytes=nbytes)

    async def commit(self, req: pb.CommitRequest) -> pb.CommitReply:
        if req.HasField("program_cache"):
            await self.dest.commit_cache(req.migration_id, program_cache_from_pb(req.program_cache))
            return pb.CommitReply(ok=True)
        await self.dest.commit(req.migration_id, convert.state_from_pb(req.state), last_stage_from_pb(req))
        if failpoints.enabled("dest.drop_commit_reply"):
            raise Unavailable("failpoint: commit reply lost")
        return pb.CommitReply(ok=True)

    async def expect_commit(self, req: pb.ExpectCommitRequest) -> pb.ExpectCommitReply:
        return pb.ExpectCommitReply(expected=self.dest.expect_commit(req.migration_id, req.in_ms))

    async def abort(self, req: pb.AbortMigrationRequest) -> pb.AbortMigrationReply:
        found = await self.dest.abort(req.migration_id, req.reason or "aborted by the source")
        return pb.AbortMigrationReply(found=found)

    async def settled(self, req: pb.MigrationSettledRequest) -> pb.MigrationSettledReply:
        ms = await self.dest.settle(req.migration_id, min(max(req.wait_ms, 0), 10_000))
        return pb.MigrationSettledReply(stepped=ms is not None, after_commit_ms=ms or 0.0)
