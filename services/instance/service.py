"""The instance agent served over gRPC: ``InstanceServicer`` translates
protobuf to the agent's domain types and back (services/instance/agent.py
holds every decision), ``InstanceService`` is the agent plus its servicer."""

from __future__ import annotations

import grpc

from libs.common import convert
from libs.common.kv_events import KvSnapshot
from libs.pb import instance_pb2 as pb
from libs.pb import instance_pb2_grpc as pb_grpc
from services.instance.agent import Agent


class InstanceServicer(pb_grpc.InstanceServicer):
    """Translation only: every method converts, calls the agent, converts back
    (FerryErrors become gRPC statuses in libs/common/server.py)."""

    def __init__(self, agent: Agent):
        self.agent = agent

    async def Generate(self, request, context):
        async for f in self.agent.generate(convert.order_from_pb(request)):
            yield convert.stream_event_to_pb(f)

    async def Attach(self, request, context):
        async for f in self.agent.attach(request.request_id, request.from_index, request.flush_interval_ms):
            yield convert.stream_event_to_pb(f)

    async def Abort(self, request, context):
        return pb.AbortReply(found=await self.agent.abort(request.request_id))

    async def GetStatus(self, request, context):
        return convert.status_to_pb(self.agent.status())

    async def SetTerminating(self, request, context):
        self.agent.set_terminating(request.terminating)
        return pb.SetInstanceTerminatingReply(ok=True)

    async def SetRole(self, request, context):
        previous, draining = await self.agent.set_role(convert.role_from_pb(request.role),
                                                       [(h.instance_id, h.address) for h in request.drain_to])
        return pb.SetRoleReply(previous=convert.role_to_pb(previous), draining=draining)

    async def CheckIntegrity(self, request, context):
        r = await self.agent.check_integrity(request.with_cached_hashes)
        return pb.CheckIntegrityReply(ok=not r.error, error=r.error, free_blocks=r.free_blocks,
                                      total_blocks=r.total_blocks, num_requests=r.num_requests,
                                      num_reservations=r.num_reservations, cached_block_hashes=r.cached_block_hashes)

    async def WatchKvEvents(self, request, context):
        async for item in self.agent.kv_events_stream():
            if isinstance(item, KvSnapshot):
                yield pb.KvEventsMessage(snapshot=convert.kv_snapshot_to_pb(item))
            else:
                yield pb.KvEventsMessage(batch=convert.kv_batch_to_pb(item))

    # Migration: protobuf <-> domain types in services/instance/migration/servicer.py.
    async def MigrateOut(self, request, context):
        rpcs = self.agent.migrations()
        await self.agent.authorize_destination(request.dest_instance_id, request.dest_address)
        return await rpcs.migrate_out(request)

    async def PreAllocate(self, request, context):
        return await self.agent.migrations().pre_allocate(request)

    async def TransferKv(self, request_iterator, context):
        return await self.agent.migrations().transfer_kv(request_iterator)

    async def Commit(self, request, context):
        return await self.agent.migrations().commit(request)

    async def AbortMigration(self, request, context):
        return await self.agent.migrations().abort(request)

    async def ExpectCommit(self, request, context):
        return await self.agent.migrations().expect_commit(request)

    async def MigrationSettled(self, request, context):
        return await self.agent.migrations().settled(request)

    # KunServe's pipeline: services/instance/kunserve.py.
    async def DropLayers(self, request, context):
        r = await self.agent.pipelines().drop_layers(convert.layers_from_pb(request.layers), request.hold,
                                                     request.prepare)
        return pb.DropLayersReply(blocks_added=r.blocks, total_blocks=r.total_blocks)

    async def SetPipeline(self, request, context):
        moved = await self.agent.pipelines().set_pipeline(
            convert.layers_from_pb(request.own), [(convert.layers_from_pb(p.layers), p.address) for p in request.peers],
            request.pause_exchange, request.hold)
        return pb.SetPipelineReply(requests_moved=moved)

    async def RestoreLayers(self, request, context):
        r = await self.agent.pipelines().restore_layers(convert.layers_from_pb(request.layers), request.from_address)
        return pb.RestoreLayersReply(blocks_returned=r.blocks, total_blocks=r.total_blocks)

    async def FetchLayers(self, request, context):
        async for t in self.agent.pipelines().fetch_layers(request):
            yield t

    async def ForwardLayers(self, request_iterator, context):
        async for reply in self.agent.pipelines().serve(request_iterator):
            yield reply


class InstanceService(Agent):
    """The agent, served on a gRPC server by libs/common/server.serve()."""

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_InstanceServicer_to_server(InstanceServicer(self), server)


__all__ = ["InstanceService", "InstanceServicer"]
