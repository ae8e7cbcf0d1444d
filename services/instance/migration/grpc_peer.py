"""The destination peer over gRPC, and the protobuf <-> domain conversions of
the migration RPCs (used by the servicer too)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from libs.pb import instance_pb2 as pb
from libs.pb import instance_pb2_grpc as pb_grpc
from libs.common import convert
from libs.common.types import RequestState
from services.instance.engine.base import KvLayout, ProgramKv
from services.instance.engine.shared_kv import KvShare
from services.instance.migration.messages import (
    Admission,
    KvChunk,
    LastStage,
    PeerError,
    PreAllocate,
)


# --- conversions ----------------------------------------------------------------------
def header_to_pb(layout: KvLayout) -> pb.KvHeader:
    return pb.KvHeader(dtype=layout.dtype, block_size=layout.block_size, num_layers=layout.num_layers,
                       num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                       k_transposed=layout.k_transposed)


def layout_from_pb(h: pb.KvHeader) -> KvLayout:
    return KvLayout(h.dtype, h.block_size, h.num_layers, h.num_kv_heads, h.head_dim, h.k_transposed)


def pre_allocate_to_pb(p: PreAllocate) -> pb.PreAllocateRequest:
    share = p.kv_share
    return pb.PreAllocateRequest(
        migration_id=p.migration_id, request_id=p.request_id, num_blocks=p.num_blocks, stage=p.stage,
        header=header_to_pb(p.layout), deadline_ms=p.deadline_ms, source_instance_id=p.source_instance_id,
        spare_blocks=p.spare_blocks, handoff=p.handoff, last=p.last, block_hashes=p.block_hashes,
        link_cached=p.link, program_id=p.program_id,
        kv_share=None if share is None else pb.KvShare(pid=share.pid, fd=share.fd, name=share.name,
                                                      size=share.size))


def pre_allocate_from_pb(m: pb.PreAllocateRequest) -> PreAllocate:
    share = (KvShare(m.kv_share.pid, m.kv_share.fd, m.kv_share.name, m.kv_share.size)
             if m.HasField("kv_share") else None)
    return PreAllocate(m.migration_id, m.request_id, m.stage, m.num_blocks, layout_from_pb(m.header),
                       m.deadline_ms, m.source_instance_id, m.spare_blocks, m.handoff, m.last, share,
                       tuple(m.block_hashes), m.link_cached, m.program_id)


def program_cache_to_pb(kv: ProgramKv) -> pb.ProgramCache:
    return pb.ProgramCache(program_id=kv.program_id, block_hashes=kv.block_hashes, age_s=kv.age_s, gap_s=kv.gap_s)


def program_cache_from_pb(m: pb.ProgramCache) -> ProgramKv:
    return ProgramKv(m.program_id, tuple(m.block_hashes), (), m.age_s, m.gap_s)


def chunk_to_pb(c: KvChunk) -> pb.KvChunk:
    return pb.KvChunk(migration_id=c.migration_id, stage=c.stage, num_blocks=c.num_blocks, offset=c.offset,
                      data=bytes(c.data), total_bytes=c.total_bytes, layer=c.layer, src_blocks=c.src_blocks)


def chunk_from_pb(m: pb.KvChunk) -> KvChunk:
    return KvChunk(m.migration_id, m.stage, m.offset, m.data, m.num_blocks, m.total_bytes,
                   m.layer if m.HasField("layer") else None, tuple(m.src_blocks))


async def chunks_from_pb(stream) -> AsyncIterator[KvChunk]:
    async for m in stream:
        yield chunk_from_pb(m)


def _reason(e: grpc.RpcError) -> str:
    details = e.details() if hasattr(e, "details") else ""
    code = e.code().name if hasattr(e, "code") and e.code() else "UNKNOWN"
    return f"{code}: {details}" if details else code


# --- the peer ---------------------------------------------------------------------------
def last_stage_from_pb(req: pb.CommitRequest) -> LastStage | None:
    return LastStage(req.last_stage, tuple(req.last_src_blocks)) if req.has_last_stage else None


class GrpcPeer:
    """A destination instance behind a gRPC channel (made with the
    project's credentials by libs.common.rpc)."""

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float):
        self.stub = pb_grpc.InstanceStub(channel)
        self.timeout_s = timeout_s

    async def pre_allocate(self, p: PreAllocate) -> Admission:
        try:
            reply = await self.stub.PreAllocate(pre_allocate_to_pb(p), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise PeerError(_reason(e)) from None
        return Admission(reply.accepted, reply.reason, reply.kv_shared, tuple(reply.held_block_hashes),
                         reply.linked_blocks)

    async def transfer(self, chunks: AsyncIterator[KvChunk]) -> int:
        async def pbs():
            async for c in chunks:
                yield chunk_to_pb(c)  # NOTE: bytes() copies: the source may reuse its buffer

        try:
            reply = await self.stub.TransferKv(pbs(), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise PeerError(_reason(e)) from None
        return reply.blocks_written

    async def commit(self, migration_id: str, state: RequestState, last: LastStage | None = None) -> None:
        req = pb.CommitRequest(migration_id=migration_id, state=convert.state_to_pb(state))
        if last is not None:
            req.has_last_stage, req.last_stage = True, last.stage
            req.last_src_blocks.extend(last.src_blocks)
        await self._commit(req)

    async def commit_cache(self, migration_id: str, kv: ProgramKv) -> None:
        await self._commit(pb.CommitRequest(migration_id=migration_id, program_cache=program_cache_to_pb(kv)))

    async def _commit(self, req: pb.CommitRequest) -> None:
        try:
            reply = await self.stub.Commit(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise PeerError(_reason(e)) from None
        if not reply.ok:
            raise PeerError(f"commit refused: {reply.reason}")

    async def expect_commit(self, migration_id: str, in_ms: float) -> bool:
        try:
            r = await self.stub.ExpectCommit(pb.ExpectCommitRequest(migration_id=migration_id, in_ms=in_ms),
                                             timeout=2.0)
        except grpc.RpcError:
            return False  # an optimization only: the last pre-allocation still holds the boundary
        return r.expected

    async def abort(self, migration_id: str, reason: str) -> None:
        try:
            await self.stub.AbortMigration(pb.AbortMigrationRequest(migration_id=migration_id, reason=reason),
                                           timeout=2.0)
        except grpc.RpcError:
            pass  # the destination's reservation deadline frees its blocks

    async def settled(self, migration_id: str, wait_ms: int) -> float | None:
        try:
            r = await self.stub.MigrationSettled(pb.MigrationSettledRequest(migration_id=migration_id,
                                                                            wait_ms=wait_ms),
                                                 timeout=wait_ms / 1000 + 2)
        except grpc.RpcError:
            return None
        return r.after_commit_ms if r.stepped else None
