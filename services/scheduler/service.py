"""The global scheduler: Dispatch, the cluster view, terminating marks, and
(when the policy migrates) the rescheduling loop."""

from __future__ import annotations

import dataclasses

import grpc

from ferry.pb import instance_pb2 as ipb
from ferry.pb import instance_pb2_grpc as ipb_grpc
from ferry.pb import scheduler_pb2 as pb
from ferry.pb import scheduler_pb2_grpc as pb_grpc
from libs.common import convert
from libs.common.config import CommonConfig, opt
from libs.common.errors import FailedPrecondition, NotFound, Unavailable, abort_with
from libs.common.logging import get_logger
from libs.common.server import GRPC_OPTIONS, Service
from libs.common.types import Priority
from libs.common.cluster_view import ClusterView
from services.scheduler.policies import DISPATCH_POLICIES, Dispatcher, DispatchRequest, blocks_for

log = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig(CommonConfig):
    port: int = opt(7001, "port to listen on", min=0, max=65535)
    meta_store: str = opt("127.0.0.1:7000", "meta store address host:port")
    dispatch: str = opt("llumnix", "dispatch policy", choices=tuple(DISPATCH_POLICIES))
    migrate_interval_s: float = opt(0.1, "rescheduling loop interval (s)", min=0.005)
    migrate_out_threshold: float = opt(10.0, "instances with freeness below this are migration sources")
    migrate_in_threshold: float = opt(60.0, "instances with freeness above this are destinations")
    migration: bool = opt(True, "run the rescheduling loop (for policies that migrate)")


class SchedulerServicer(pb_grpc.SchedulerServicer):
    def __init__(self, svc: "SchedulerService"):
        self.svc = svc

    async def Dispatch(self, request, context):
        view = self.svc.view
        if not view.synced.is_set():
            await abort_with(context, Unavailable("scheduler has no cluster view yet"))
        req = DispatchRequest(request.request_id, request.num_prompt_tokens, Priority(request.priority),
                              frozenset(request.exclude_instance_ids))
        iid = self.svc.dispatcher.choose(view.views(), req)
        if iid is None:
            await abort_with(context, Unavailable("no live instance to dispatch to"))
        rec = view.records[iid]
        view.add_pending(iid, request.request_id, blocks_for(request.num_prompt_tokens, rec.info.block_size))
        return pb.DispatchReply(instance_id=iid, address=rec.info.address, policy=self.svc.dispatcher.name)

    async def GetClusterView(self, request, context):
        return pb.ClusterViewReply(
            instances=[convert.record_to_pb(r) for r in self.svc.view.records.values()],
            dispatch_policy=self.svc.dispatcher.name,
            migrations_ordered=self.svc.migrations_ordered,
        )

    async def SetTerminating(self, request, context):
        address = self.svc.view.address(request.instance_id)
        if address is None:
            await abort_with(context, NotFound(f"unknown instance {request.instance_id!r}"))
        try:
            async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as ch:
                await ipb_grpc.InstanceStub(ch).SetTerminating(
                    ipb.SetInstanceTerminatingRequest(terminating=request.terminating), timeout=5)
        except grpc.RpcError as e:
            await abort_with(context, FailedPrecondition(f"instance unreachable: {e.details()}"))
        return pb.SetTerminatingReply(ok=True)


class SchedulerService(Service):
    name = "scheduler"
    service_names = ("ferry.v1.Scheduler",)

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.dispatcher = Dispatcher(config.dispatch)
        self.view = ClusterView(config.meta_store)
        self.migrations_ordered = 0
        self.rescheduler = None

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_SchedulerServicer_to_server(SchedulerServicer(self), server)

    async def start(self, bound_address: str) -> None:
        self.view.start()
        if self.config.migration and self.dispatcher.migrates:
            from services.scheduler.rescheduler import Rescheduler

            self.rescheduler = Rescheduler(self)
            self.rescheduler.start()

    async def stop(self) -> None:
        if self.rescheduler is not None:
            await self.rescheduler.stop()
        await self.view.stop()
