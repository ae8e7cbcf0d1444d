"""The scheduler's view of the cluster, rebuilt from the meta store's watch
stream (and rebuilt again whenever the stream breaks). Holds no durable state."""

from __future__ import annotations

import asyncio
import time

import grpc

from ferry.pb import meta_store_pb2 as mpb
from ferry.pb import meta_store_pb2_grpc as mpb_grpc
from libs.common import convert, rpc
from libs.common.logging import get_logger
from libs.common.pending import PENDING_TTL_S, PendingDispatches
from libs.common.policies import InstanceView
from libs.common.types import InstanceRecord

log = get_logger(__name__)

# After a re-watch (meta store restarted), instances missing from the fresh
# snapshot are kept this long: they re-register within a report or two.
CARRY_OVER_S = 3.0


class ClusterView:
    def __init__(self, meta_store_address: str, carry_over_s: float = CARRY_OVER_S,
                 min_update_interval_s: float = 0.0):
        """``min_update_interval_s`` above 0: the meta store sends each
        instance's status at most this often (for a view that may lag)."""
        self.meta_store_address = meta_store_address
        self.min_update_interval_s = min_update_interval_s
        self.carry_over_s = carry_over_s
        self._carried: dict[str, float] = {}  # instance -> drop after (monotonic)
        self.records: dict[str, InstanceRecord] = {}
        self._pending = PendingDispatches(PENDING_TTL_S)
        self.synced = asyncio.Event()
        self.connected = False
        self._task: asyncio.Task | None = None
        self.changed = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch_forever())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _watch_forever(self) -> None:
        backoff = 0.05
        while True:
            try:
                async with rpc.channel(self.meta_store_address) as ch:
                    stub = mpb_grpc.MetaStoreStub(ch)
                    fresh: dict[str, InstanceRecord] = {}
                    async for ev in stub.Watch(mpb.WatchRequest(min_update_interval_s=self.min_update_interval_s)):
                        backoff = 0.05
                        if ev.type == mpb.WatchEvent.SYNCED:
                            # NOTE: keep the last view (DESIGN §7): instances the
                            # fresh snapshot lacks stay for a grace period.
                            until = time.monotonic() + self.carry_over_s
                            self._carried = {i: until for i in self.records if i not in fresh}
                            self.records = {**{i: self.records[i] for i in self._carried}, **fresh}
                            self.connected = True
                            self.synced.set()
                            self.changed.set()
                            log.info("cluster view synced", instances=len(fresh))
                            continue
                        rec = convert.record_from_pb(ev.record)
                        target = self.records if self.connected else fresh
                        if ev.type == mpb.WatchEvent.REMOVED:
                            target.pop(rec.info.instance_id, None)
                            self._pending.drop(rec.info.instance_id)
                        else:
                            target[rec.info.instance_id] = rec
                            self._carried.pop(rec.info.instance_id, None)
                            self._settle(rec)
                        self._drop_carried()
                        self.changed.set()
            except asyncio.CancelledError:
                raise
            except grpc.RpcError as e:
                if self.connected:
                    log.warning("meta store watch lost; keeping last view", error=e.code().name)
                self.connected = False
            except Exception as e:  # noqa: BLE001 - NOTE: a view that stopped watching would serve stale data forever
                log.error("meta store watch failed; watching again", error=repr(e))
                self.connected = False
            await asyncio.sleep(backoff)
            backoff = min(1.0, backoff * 2)

    def _drop_carried(self) -> None:
        now = time.monotonic()
        for iid in [i for i, t in self._carried.items() if now > t]:
            del self._carried[iid]
            self.records.pop(iid, None)

    def _settle(self, rec: InstanceRecord) -> None:
        if rec.status is not None:
            self._pending.settle(rec.info.instance_id, (r.request_id for r in rec.status.requests),
                                 time.monotonic())

    def add_pending(self, instance_id: str, request_id: str, blocks: int) -> None:
        self._pending.add(instance_id, request_id, blocks, time.monotonic())

    def views(self) -> list[InstanceView]:
        self._drop_carried()
        now = time.monotonic()
        return [InstanceView(iid, rec.status, *self._pending.totals(iid, now),
                             migratable=not rec.info.no_migration)
                for iid, rec in self.records.items() if rec.status is not None]

    def address(self, instance_id: str) -> str | None:
        rec = self.records.get(instance_id)
        return rec.info.address if rec else None
