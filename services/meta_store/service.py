"""gRPC edge of the meta store: thin servicer over the Registry."""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import math
import time

import grpc

from libs.pb import common_pb2 as pb_common
from libs.pb import meta_store_pb2 as pb
from libs.pb import meta_store_pb2_grpc as pb_grpc
from libs.common import convert
from libs.common.config import CommonConfig, opt
from libs.common.errors import FailedPrecondition, InvalidArgument
from libs.common.logging import get_logger
from libs.common.server import Service
from libs.common.validation import request_id_problem
from services.meta_store.documents import MAX_DOCUMENT_BYTES, Documents, EtcdDocuments, MemoryDocuments
from services.meta_store.registry import Change, ChangeType, Registry, TakenOver
from services.meta_store.metrics import EXPIRED

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
    metrics_port: int = opt(-1, "Prometheus /metrics port (-1 = off, 0 = any)", min=-1)
    # The replicated store (services/meta_store/etcd_registry.py).
    etcd: str = opt("", "etcd endpoints host:port[,host:port...]: keep the registry and the instances' leases in "
                        "etcd, so that several meta-store replicas serve one cluster (empty = in memory)")
    etcd_prefix: str = opt("/ferry", "etcd: key prefix of this cluster")
    etcd_share_interval_s: float = opt(0.2, "etcd: share an instance's status with the other replicas at most "
                                            "this often", min=0.01)
    documents_mb: float = opt(256.0, "documents the frontends share (stored responses) kept in memory without "
                              "--etcd, MiB; the oldest go first", min=0.0)


MAX_BATCH = 512  # events in one WatchBatched message at most
# A watch sends at most one message this often: changes that come meanwhile
# wait and go together. NOTE: a message costs the store's gRPC and the
# watcher's far more than an event in it; sent as soon as one was ready, the
# scheduler's watch carried ~5 reports a message at 2,500 reports/s (ferry
# bench control-plane). At most this much is added to a change's delay.
BATCH_GAP_S = 0.005


class MetaStoreServicer(pb_grpc.MetaStoreServicer):
    def __init__(self, registry: Registry, documents: Documents | None = None):
        self.registry = registry
        self.documents = documents or MemoryDocuments()

    async def PutDocument(self, request, context):
        if not request.key.kind or not request.key.key:
            raise InvalidArgument("a document needs its kind and key")
        if len(request.data) > MAX_DOCUMENT_BYTES:
            raise InvalidArgument(f"a document has at most {MAX_DOCUMENT_BYTES} bytes, got {len(request.data)}")
        await self.documents.put(request.key.kind, request.key.key, request.data, request.ttl_s)
        return pb.PutDocumentReply()

    async def GetDocument(self, request, context):
        data = await self.documents.get(request.kind, request.key)
        return pb.GetDocumentReply(found=data is not None, data=data or b"")

    async def DeleteDocument(self, request, context):
        return pb.DeleteDocumentReply(existed=await self.documents.delete(request.kind, request.key))

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
        async for batch in self._watch(request, context):
            for ev in batch:
                yield ev

    async def WatchBatched(self, request, context):
        async for batch in self._watch(request, context):
            yield pb.WatchEvents(events=batch)

    async def _watch(self, request, context):
        """The watch's events in lists: what is ready to go at once (at most
        MAX_BATCH) goes in one list, one list per BATCH_GAP_S at most."""
        q = self.registry.subscribe()
        interval = max(0.0, request.min_update_interval_s)
        held: dict[str, Change] = {}  # instance -> latest status update not sent yet
        last_sent: dict[str, float] = {}  # instance -> when its last update went
        # NOTE: when each held update is due, in a heap: finding the next due
        # one by a scan of every held instance per event cost O(N) per report
        # (ferry bench control-plane: 8% of the store's time at 256 instances).
        due: list[tuple[float, str]] = []
        last_out = -math.inf
        try:
            while True:
                wait = last_out + BATCH_GAP_S - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)  # what comes meanwhile goes in this message
                out: list[pb.WatchEvent] = []
                if due:
                    now = time.monotonic()
                    while due and due[0][0] <= now:
                        _, iid = heapq.heappop(due)
                        if iid not in held:
                            continue  # sent meanwhile with a newer change
                        if now - last_sent[iid] < interval:
                            heapq.heappush(due, (last_sent[iid] + interval, iid))
                            continue
                        last_sent[iid] = now
                        out.append(_wire(held.pop(iid)))
                if not out and q.empty():
                    if not await q.wait(max(0.0, due[0][0] - time.monotonic()) if due else None):
                        continue  # a held update is due
                while not q.empty() and len(out) < MAX_BATCH:
                    change = q.get_nowait()
                    if change is None:
                        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "watcher fell behind; watch again")
                    ev = self._thin(change, interval, held, last_sent, due)
                    if ev is not None:
                        out.append(ev)
                if out:
                    yield out
                    last_out = time.monotonic()
        finally:
            self.registry.unsubscribe(q)

    @staticmethod
    def _thin(change: Change, interval: float, held: dict, last_sent: dict, due: list) -> pb.WatchEvent | None:
        """The event to send for a change now, or None where a thinned watch
        holds it back (the latest status per instance, once per interval)."""
        if interval > 0 and change.record is not None:
            iid = change.record.info.instance_id
            if change.type == ChangeType.UPDATED:
                now = time.monotonic()
                if now - last_sent.get(iid, -interval) < interval:
                    if iid not in held:
                        heapq.heappush(due, (last_sent[iid] + interval, iid))
                    held[iid] = change  # replaces an older one
                    return None
                last_sent[iid] = now
            held.pop(iid, None)  # this change is newer than what is held
        return _wire(change)


# instance -> (its InstanceInfo, in wire form): an instance's info is the
# same object from one report to the next (Registry.report), so its wire
# form is built once, not once per report.
_INFO_PB: dict[str, tuple] = {}


def _info_pb(info) -> pb_common.InstanceInfo:
    cached = _INFO_PB.get(info.instance_id)
    if cached is None or cached[0] is not info:
        cached = _INFO_PB[info.instance_id] = (info, convert.info_to_pb(info))
    return cached[1]


def _wire(change: Change) -> pb.WatchEvent:
    if not change.wire:
        ev = pb.WatchEvent(type=_TYPES[change.type])
        rec = change.record
        if rec is not None:
            convert.record_to_pb(rec, into=ev.record, info=_info_pb(rec.info))
            if change.type is ChangeType.REMOVED:
                _INFO_PB.pop(rec.info.instance_id, None)
        change.wire.append(ev)
    return change.wire[0]


class MetaStoreService(Service):
    name = "meta-store"
    service_names = ("ferry.v1.MetaStore",)

    def __init__(self, config: MetaStoreConfig):
        self.config = config
        if config.etcd:
            from services.meta_store.etcd_registry import EtcdRegistry

            self.registry = EtcdRegistry(config.ttl_s, config.etcd, config.etcd_prefix,
                                         share_interval_s=config.etcd_share_interval_s)
            self.documents: Documents = EtcdDocuments(config.etcd, config.etcd_prefix)
        else:
            self.registry = Registry(config.ttl_s)
            self.documents = MemoryDocuments(int(config.documents_mb * (1 << 20)))
        self._reaper: asyncio.Task | None = None

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_MetaStoreServicer_to_server(MetaStoreServicer(self.registry, self.documents), server)

    async def start(self, bound_address: str) -> None:
        if self.config.etcd:
            self.registry.start(bound_address)
        self._reaper = asyncio.create_task(self._reap())
        if self.config.metrics_port >= 0:
            from libs.common.metrics_server import serve_metrics
            from services.meta_store import metrics

            metrics.export(self.registry)
            serve_metrics(self.config.metrics_port, self.config.host)

    async def stop(self) -> None:
        if self._reaper:
            self._reaper.cancel()
        if self.config.etcd:
            await self.registry.stop()
            await self.documents.close()

    async def _reap(self) -> None:
        interval = max(0.02, self.config.ttl_s / 4)
        while True:
            await asyncio.sleep(interval)
            for instance_id in self.registry.expire():
                EXPIRED.inc()
                log.warning("instance expired", instance_id=instance_id, ttl_s=self.config.ttl_s)
