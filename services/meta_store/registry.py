"""The meta store's core: instance registry, latest status, liveness by TTL,
and change notification to watchers. Soft state only: everything here is
re-reported by instances."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from libs.common.types import InstanceInfo, InstanceRecord, InstanceStatus


class ChangeType(enum.Enum):
    ADDED = "added"
    UPDATED = "updated"
    REMOVED = "removed"
    SYNCED = "synced"  # end of the initial snapshot of a watch


@dataclass(frozen=True)
class Change:
    type: ChangeType
    record: InstanceRecord | None
    # One change goes to every watcher: its wire form is built once, by the
    # first watcher that sends it (see MetaStoreServicer.Watch).
    wire: list = field(default_factory=list, compare=False, repr=False)


class TakenOver(Exception):
    """Another live instance holds this id."""


class Registry:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 watch_queue_size: int = 10_000):
        self.ttl_s = ttl_s
        self.clock = clock
        self._records: dict[str, InstanceRecord] = {}
        self._watchers: set[asyncio.Queue] = set()
        self._queue_size = watch_queue_size

    # --- commands -------------------------------------------------------------
    def register(self, info: InstanceInfo) -> None:
        """Add or refresh an instance. Raises TakenOver when the id is
        registered at another address and its owner reported within the TTL:
        NOTE: the cluster token does not let one instance take another's id
        (its clients and migrations would follow to the new address)."""
        existed = info.instance_id in self._records
        old = self._records.get(info.instance_id)
        if old is not None and old.info.address != info.address and self.clock() - old.last_seen <= self.ttl_s:
            raise TakenOver(f"instance id {info.instance_id!r} is registered at {old.info.address} and alive; "
                            f"not re-registering it at {info.address} (it expires {self.ttl_s:g}s after its last "
                            "report)")
        rec = InstanceRecord(info=info, status=old.status if old else None, last_seen=self.clock())
        self._records[info.instance_id] = rec
        self._notify(ChangeType.UPDATED if existed else ChangeType.ADDED, rec)

    def deregister(self, instance_id: str) -> bool:
        rec = self._records.pop(instance_id, None)
        if rec is not None:
            self._notify(ChangeType.REMOVED, rec)
        return rec is not None

    def report(self, status: InstanceStatus) -> bool:
        """Store a status; False if the instance is not registered (it must
        register again). Out-of-order reports (lower seq) are ignored. Only
        ``instance_id`` and ``seq`` are read: the gRPC service stores the
        wire message as it came."""
        rec = self._records.get(status.instance_id)
        if rec is None:
            return False
        if rec.status is not None and status.seq and status.seq < rec.status.seq:
            return True
        rec = replace(rec, status=status, last_seen=self.clock())
        self._records[status.instance_id] = rec
        self._notify(ChangeType.UPDATED, rec)
        return True

    def expire(self) -> list[str]:
        """Remove instances not seen for longer than the TTL."""
        now = self.clock()
        dead = [i for i, r in self._records.items() if now - r.last_seen > self.ttl_s]
        for i in dead:
            self.deregister(i)
        return dead

    # --- queries --------------------------------------------------------------
    def list(self) -> list[InstanceRecord]:
        return sorted(self._records.values(), key=lambda r: r.info.instance_id)

    # --- watch ----------------------------------------------------------------
    def subscribe(self) -> asyncio.Queue:
        """A queue that first holds the snapshot then every change. A watcher
        that falls behind by more than the queue size is dropped (its queue
        gets None) and must re-watch."""
        q: asyncio.Queue = asyncio.Queue(maxsize=self._queue_size)
        for rec in self.list():
            q.put_nowait(Change(ChangeType.ADDED, rec))
        q.put_nowait(Change(ChangeType.SYNCED, None))
        self._watchers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._watchers.discard(q)

    def _notify(self, type_: ChangeType, rec: InstanceRecord) -> None:
        change = Change(type_, rec)
        for q in list(self._watchers):
            try:
                q.put_nowait(change)
            except asyncio.QueueFull:
                self._watchers.discard(q)
                while not q.empty():
                    q.get_nowait()
                q.put_nowait(None)
