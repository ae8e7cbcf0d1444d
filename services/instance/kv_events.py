"""An instance's KV events for its subscribers (the scheduler's prefix index):
each engine step's events become one numbered batch (``seq`` from 1, no
gap), and a subscriber starts from a snapshot of every held block at the
current ``seq``. The snapshot comes from a mirror of the engine's cache kept
here from the events themselves, so it is consistent with the numbering by
construction and never needs the engine thread.

A subscriber that falls behind by more than its queue is dropped (its queue
gets None): it reconnects and starts from a new snapshot, as after any other
break. Pure asyncio (one loop), no gRPC: the servicer translates.
"""

from __future__ import annotations

import asyncio

from libs.common import kv_events
from libs.common.kv_events import KvEvent, KvEventBatch, KvSnapshot
from libs.common.prefix_hash import BlockHash


class KvEventPublisher:
    def __init__(self, instance_id: str, queue_size: int = 4096):
        self.instance_id = instance_id
        self.seq = 0
        self.held: dict[BlockHash, BlockHash | None] = {}
        self._queue_size = queue_size
        self._subscribers: set[asyncio.Queue] = set()

    def publish(self, events: list[KvEvent]) -> KvEventBatch | None:
        """One step's events (on the loop, in step order)."""
        if not events:
            return None
        self.seq += 1
        kv_events.apply(self.held, events)
        batch = KvEventBatch(self.instance_id, self.seq, tuple(events))
        for q in list(self._subscribers):
            try:
                q.put_nowait(batch)
            except asyncio.QueueFull:
                self._drop(q)
        return batch

    def snapshot(self) -> KvSnapshot:
        return KvSnapshot(self.instance_id, self.seq, dict(self.held))

    def subscribe(self) -> asyncio.Queue:
        """A queue holding the snapshot, then every batch from the next one."""
        q: asyncio.Queue = asyncio.Queue(maxsize=self._queue_size + 1)
        q.put_nowait(self.snapshot())
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._subscribers.discard(q)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def _drop(self, q: asyncio.Queue) -> None:
        self._subscribers.discard(q)
        while not q.empty():
            q.get_nowait()
        q.put_nowait(None)

    def close(self) -> None:
        """Every subscriber's stream ends (the instance stops)."""
        for q in list(self._subscribers):
            self._drop(q)
