"""The scheduler's view of the cluster, rebuilt from the meta store's watch
stream (and rebuilt again whenever the stream breaks). Holds no durable state."""

from __future__ import annotations

import asyncio
import heapq
import time
from dataclasses import replace
from typing import Callable

import grpc

from libs.pb import meta_store_pb2 as mpb
from libs.pb import meta_store_pb2_grpc as mpb_grpc
from libs.common import convert, rpc
from libs.common.logging import get_logger
from libs.common.pending import PENDING_TTL_S, PendingDispatches
from libs.common.policies import InstanceView
from libs.common.types import InstanceRecord
from libs.common.backoff import Reconnect

log = get_logger(__name__)

# After a re-watch (meta store restarted), instances missing from the fresh
# snapshot are kept this long: they re-register within a report or two.
CARRY_OVER_S = 3.0


class ClusterView:
    def __init__(self, meta_store_address: str, carry_over_s: float = CARRY_OVER_S,
                 min_update_interval_s: float = 0.0, outage_ttl_s: float = 3.0):
        """``min_update_interval_s`` above 0: the meta store sends each
        instance's status at most this often (for a view that may lag).
        ``outage_ttl_s``: while the meta store is unreachable, an instance
        that does not answer its own status calls for this long leaves the
        view (libs/common/direct_status.py)."""
        self.meta_store_address = meta_store_address
        self.outage_ttl_s = outage_ttl_s
        self._outage: asyncio.Task | None = None
        self.min_update_interval_s = min_update_interval_s
        self.carry_over_s = carry_over_s
        self._carried: dict[str, float] = {}  # instance -> drop after (monotonic)
        self.records: dict[str, InstanceRecord] = {}
        self._pending = PendingDispatches(PENDING_TTL_S)
        self.synced = asyncio.Event()
        self.connected = False
        self._task: asyncio.Task | None = None
        self.changed = asyncio.Event()
        # Called with an instance's id whenever what views() shows of it may
        # have changed (record, pending dispatches, removal): the scheduler's
        # dispatch index recomputes only those rows.
        self.listeners: list[Callable[[str], None]] = []
        self._expiries: list[tuple[float, str]] = []  # (when a pending dispatch times out, instance)
        self._batched = True  # WatchBatched until a store says it has none
        self._infos: dict[str, tuple] = {}  # instance -> (its info as received, as converted)

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch_forever())

    async def stop(self) -> None:
        self._end_outage()
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _events(self, stub: mpb_grpc.MetaStoreStub):
        """The watch's events: several per message (WatchBatched), or one per
        message from a meta store without it."""
        req = mpb.WatchRequest(min_update_interval_s=self.min_update_interval_s)
        if self._batched:
            try:
                async for msg in stub.WatchBatched(req):
                    for ev in msg.events:
                        yield ev
                return
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self._batched = False
        async for ev in stub.Watch(req):
            yield ev

    async def _watch_forever(self) -> None:
        backoff = Reconnect()
        while True:
            try:
                async with rpc.channel(self.meta_store_address) as ch:
                    stub = mpb_grpc.MetaStoreStub(ch)
                    fresh: dict[str, InstanceRecord] = {}
                    async for ev in self._events(stub):
                        backoff.reset()
                        if ev.type == mpb.WatchEvent.SYNCED:
                            # NOTE: keep the last view (docs/design.md §7): instances the
                            # fresh snapshot lacks stay for a grace period.
                            until = time.monotonic() + self.carry_over_s
                            self._carried = {i: until for i in self.records if i not in fresh}
                            before = list(self.records)
                            self.records = {**{i: self.records[i] for i in self._carried},
                                            **{i: self._keep_status(r) for i, r in fresh.items()}}
                            for iid in {*before, *self.records}:
                                self.touch(iid)
                            self.connected = True
                            self._end_outage()
                            self.synced.set()
                            self.changed.set()
                            log.info("cluster view synced", instances=len(fresh))
                            continue
                        rec = self._record(ev.record)
                        target = self.records if self.connected else fresh
                        if ev.type == mpb.WatchEvent.REMOVED:
                            target.pop(rec.info.instance_id, None)
                            self._pending.drop(rec.info.instance_id)
                            self._infos.pop(rec.info.instance_id, None)
                        else:
                            target[rec.info.instance_id] = rec
                            self._carried.pop(rec.info.instance_id, None)
                            self._settle(rec)
                        if self.connected:
                            self.touch(rec.info.instance_id)
                        if self._carried:
                            self._drop_carried()
                        self.changed.set()
            except asyncio.CancelledError:
                raise
            except grpc.RpcError as e:
                if self.connected:
                    log.warning("meta store watch lost; keeping last view", error=e.code().name)
                self.connected = False
                # Only when the store cannot be reached: a watcher it dropped
                # for falling behind (RESOURCE_EXHAUSTED) just watches again.
                if self._outage is None and self.synced.is_set() and e.code() == grpc.StatusCode.UNAVAILABLE:
                    from libs.common.direct_status import poll_instances

                    self._outage = asyncio.create_task(poll_instances(self, ttl_s=self.outage_ttl_s))
            except Exception as e:  # noqa: BLE001 - NOTE: a view that stopped watching would serve stale data forever
                log.error("meta store watch failed; watching again", error=repr(e))
                self.connected = False
            await backoff.wait()

    def _record(self, m) -> InstanceRecord:
        """The record of an event; its InstanceInfo reused while unchanged
        (comparing the messages is cheaper than converting one per report)."""
        iid = m.info.instance_id
        cached = self._infos.get(iid)
        if cached is not None and cached[0] == m.info:
            info = cached[1]
        else:
            info = convert.info_from_pb(m.info)
            self._infos[iid] = (m.info, info)
        status = convert.status_from_pb(m.status) if m.HasField("status") else None
        return InstanceRecord(info=info, status=status, last_seen=m.last_seen)

    def _keep_status(self, rec: InstanceRecord) -> InstanceRecord:
        """A store that has not heard this instance's status yet (a replica
        just started, or one that learned it from etcd) must not blank the
        status this view has: the instance would vanish from dispatch and
        from the autoscaler's count until its next report."""
        old = self.records.get(rec.info.instance_id)
        if rec.status is None and old is not None and old.status is not None and old.info == rec.info:
            return replace(rec, status=old.status)
        return rec

    def _end_outage(self) -> None:
        if self._outage is not None:
            self._outage.cancel()
            self._outage = None

    def drop(self, instance_id: str) -> None:
        """Forget an instance (it is gone); its pending dispatches too."""
        self.records.pop(instance_id, None)
        self._carried.pop(instance_id, None)
        self._pending.drop(instance_id)
        self.touch(instance_id)
        self.changed.set()

    def touch(self, instance_id: str) -> None:
        for listener in self.listeners:
            listener(instance_id)

    def refresh(self) -> None:
        """Bring what views() would show up to now for the listeners: drop
        carried-over instances past their grace, and touch instances whose
        pending dispatches timed out."""
        self._drop_carried()
        now = time.monotonic()
        while self._expiries and self._expiries[0][0] <= now:
            self.touch(heapq.heappop(self._expiries)[1])

    def view_of(self, instance_id: str) -> InstanceView | None:
        """What views() shows of one instance now (None: nothing)."""
        rec = self.records.get(instance_id)
        if rec is None or rec.status is None:
            return None
        return InstanceView(instance_id, rec.status, *self._pending.totals(instance_id, time.monotonic()),
                            migratable=not rec.info.no_migration)

    def _drop_carried(self) -> None:
        now = time.monotonic()
        for iid in [i for i, t in self._carried.items() if now > t]:
            del self._carried[iid]
            self.records.pop(iid, None)
            self.touch(iid)

    def _settle(self, rec: InstanceRecord) -> None:
        if rec.status is not None:
            self._pending.settle(rec.info.instance_id, (r.request_id for r in rec.status.requests),
                                 time.monotonic())

    def add_pending(self, instance_id: str, request_id: str, blocks: int) -> None:
        now = time.monotonic()
        self._pending.add(instance_id, request_id, blocks, now)
        if self.listeners:
            self.touch(instance_id)
            heapq.heappush(self._expiries, (now + self._pending.ttl_s + 1e-3, instance_id))

    def views(self) -> list[InstanceView]:
        self._drop_carried()
        now = time.monotonic()
        return [InstanceView(iid, rec.status, *self._pending.totals(iid, now),
                             migratable=not rec.info.no_migration)
                for iid, rec in self.records.items() if rec.status is not None]

    def address(self, instance_id: str) -> str | None:
        rec = self.records.get(instance_id)
        return rec.info.address if rec else None
