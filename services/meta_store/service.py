"""gRPC edge of the meta store: thin servicer over the Registry."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc

from ferry.pb import common_pb2 as pb_common
from ferry.pb import meta_store_pb2 as pb
from ferry.pb import meta_store_pb2_grpc as pb_grpc
from libs.common import convert
from libs.common.config import CommonConfig, opt
from libs.common.errors import FailedPrecondition, InvalidArgument
from libs.common.logging import get_logger
from libs.common.server import Service
from libs.common.validation import request_id_problem
from services.meta_store.registry import Change, ChangeType, Registry, TakenOver

log = get_logger(__name__)

_TYPES = {
    ChangeType.ADDED: pb.WatchEvent.ADDED,
    ChangeType.UPDATED: pb.WatchEvent.UPDATED,
    ChangeType.REMOVED: pb.WatchEvent.REMOVED,
    ChangeType.SYNCED: pb.WatchEvent.SYNCED,
}


@dataclasses.dataclass(frozen=True)
class MetaStoreConfig(CommonConfig):
    port: int = opt(7000, "port to listen on", min=0, max=65535)
    ttl_s: float = opt(3.0, "an instance not reporting for this long disappears", min=0.05)


class MetaStoreServicer(pb_grpc.MetaStoreServicer):
    def __init__(self, registry: Registry):
        self.registry = registry

    async def Register(self, request, context):
        info = convert.info_from_pb(request.info)
        problem = request_id_problem(info.instance_id)  # ids are request-id-like: bounded, not empty
        if problem:
            raise InvalidArgument(f"instance id: {problem.replace('request_id', 'it')}")
        try:
            self.registry.register(info)
        except TakenOver as e:
            log.warning("registration refused: id taken", instance_id=info.instance_id, address=info.address)
            raise FailedPrecondition(str(e)) from None
        log.info("instance registered", instance_id=info.instance_id, address=info.address)
        return pb.RegisterReply(ttl_s=self.registry.ttl_s)

    async def Deregister(self, request, context):
        existed = self.registry.deregister(request.instance_id)
        log.info("instance deregistered", instance_id=request.instance_id, existed=existed)
        return pb.DeregisterReply(existed=existed)

    async def ReportStatus(self, request, context):
        # Kept in wire form: the store reads only its id and seq, and passes
        # it on to watchers as received (no decode and re-encode per report).
        return pb.ReportReply(known=self.registry.report(request))

    async def StreamStatus(self, request_iterator, context):
        async for status in request_iterator:
            if not self.registry.report(status):
                yield pb.ReportReply(known=False)
                return

    async def List(self, request, context):
        if request.info_only:
            return pb.ListReply(instances=[pb_common.InstanceRecord(info=convert.info_to_pb(r.info),
                                                                   last_seen=r.last_seen)
                                           for r in self.registry.list()])
        return pb.ListReply(instances=[convert.record_to_pb(r) for r in self.registry.list()])

    async def Watch(self, request, context):
        q = self.registry.subscribe()
        interval = max(0.0, request.min_update_interval_s)
        held: dict[str, Change] = {}  # instance -> latest status update not sent yet
        last_sent: dict[str, float] = {}  # instance -> when its last update went
        try:
            while True:
                if held:
                    due = min(last_sent[i] for i in held) + interval
                    try:
                        change = await asyncio.wait_for(q.get(), max(0.0, due - time.monotonic()))
                    except TimeoutError:
                        now = time.monotonic()
                        for iid in [i for i in held if now - last_sent[i] >= interval]:
                            last_sent[iid] = now
                            yield _wire(held.pop(iid))
                        continue
                else:
                    change = await q.get()
                if change is None:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "watcher fell behind; watch again")
                if interval > 0 and change.record is not None:
                    iid = change.record.info.instance_id
                    if change.type == ChangeType.UPDATED:
                        now = time.monotonic()
                        if now - last_sent.get(iid, -interval) < interval:
                            held[iid] = change  # replaces an older one
                            continue
                        last_sent[iid] = now
                    held.pop(iid, None)  # this change is newer than what is held
                yield _wire(change)
        finally:
            self.registry.unsubscribe(q)


def _wire(change: Change) -> pb.WatchEvent:
    if not change.wire:
        ev = pb.WatchEvent(type=_TYPES[change.type])
        if change.record is not None:
            ev.record.CopyFrom(convert.record_to_pb(change.record))
        change.wire.append(ev)
    return change.wire[0]


class MetaStoreService(Service):
    name = "meta-store"
    service_names = ("ferry.v1.MetaStore",)

    def __init__(self, config: MetaStoreConfig):
        self.config = config
        self.registry = Registry(config.ttl_s)
        self._reaper: asyncio.Task | None = None

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_MetaStoreServicer_to_server(MetaStoreServicer(self.registry), server)

    async def start(self, bound_address: str) -> None:
        self._reaper = asyncio.create_task(self._reap())

    async def stop(self) -> None:
        if self._reaper:
            self._reaper.cancel()

    async def _reap(self) -> None:
        interval = max(0.02, self.config.ttl_s / 4)
        while True:
            await asyncio.sleep(interval)
            for instance_id in self.registry.expire():
                log.warning("instance expired", instance_id=instance_id, ttl_s=self.config.ttl_s)
