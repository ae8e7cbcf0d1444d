"""The meta store's core: instance registry, latest status, liveness by TTL,
and change notification to watchers. Soft state only: everything here is
re-reported by instances."""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from dataclasses import dataclass, field
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


def _wake(w: asyncio.Future) -> None:
    if not w.done():
        w.set_result(None)


class WatchQueue:
    """One watcher's changes, in order: asyncio.Queue's methods that a watch
    uses, for one consumer. NOTE: every report is put on every watcher's
    queue; asyncio.Queue's put_nowait and get_nowait (their full/empty
    checks, the getters' wake-up) cost about twice this, per report per watcher."""

    __slots__ = ("_items", "maxsize", "_waiter")

    def __init__(self, maxsize: int = 0):
        self._items: deque = deque()
        self.maxsize = maxsize
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        if self.maxsize and len(self._items) >= self.maxsize:
            raise asyncio.QueueFull
        self._items.append(item)
        if self._waiter is not None:
            _wake(self._waiter)

    def get_nowait(self):
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self):
        while not self._items:
            await self.wait()
        return self._items.popleft()

    async def wait(self, timeout: float | None = None) -> bool:
        """Until something is queued (True) or ``timeout`` seconds pass
        (False), without a task of its own (asyncio.wait_for makes one)."""
        if self._items:
            return True
        loop = asyncio.get_running_loop()
        self._waiter = w = loop.create_future()
        timer = None if timeout is None else loop.call_later(timeout, _wake, w)
        try:
            await w
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
        return bool(self._items)

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self._items.clear()


class Registry:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 watch_queue_size: int = 10_000):
        self.ttl_s = ttl_s
        self.clock = clock
        self._records: dict[str, InstanceRecord] = {}
        self._watchers: set[WatchQueue] = set()
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
        rec = InstanceRecord(rec.info, status, self.clock())  # (dataclasses.replace costs twice this)
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
    @property
    def watchers(self) -> int:
        """Watch streams open."""
        return len(self._watchers)

    def subscribe(self) -> WatchQueue:
        """A queue that first holds the snapshot then every change. A watcher
        that falls behind by more than the queue size is dropped (its queue
        gets None) and must re-watch."""
        q = WatchQueue(maxsize=self._queue_size)
        for rec in self.list():
            q.put_nowait(Change(ChangeType.ADDED, rec))
        q.put_nowait(Change(ChangeType.SYNCED, None))
        self._watchers.add(q)
        return q

    def unsubscribe(self, q: WatchQueue) -> None:
        self._watchers.discard(q)

    def _notify(self, type_: ChangeType, rec: InstanceRecord) -> None:
        change = Change(type_, rec)
        full = None
        for q in self._watchers:
            try:
                q.put_nowait(change)
            except asyncio.QueueFull:
                full = full or []
                full.append(q)
        for q in full or ():
            self._watchers.discard(q)
            q.clear()
            q.put_nowait(None)
