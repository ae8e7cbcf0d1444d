"""Backoffs. ``RestartBackoff``: when to start a dead process again: at
once the first time, then after a delay that doubles with every death in a
row (up to ``max_s``); a process that stayed up ``stable_s`` starts the
count afresh. Pure (the clock is passed in): ``ferry up``'s supervisor and
the scheduler's launcher use it.

``Reconnect``: the wait of a loop that keeps a connection to a peer (the
reporter's to the meta store, the cluster view's watch, the KV index's
event streams, the leader's and the etcd registry's sessions): from
``first_s``, doubling after each failure up to ``max_s``, back to
``first_s`` once the connection delivered again (``reset``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass
class Reconnect:
    first_s: float = 0.05
    max_s: float = 1.0
    next_s: float = field(default=-1.0)

    def __post_init__(self) -> None:
        if self.next_s < 0:
            self.next_s = self.first_s

    def reset(self) -> None:
        """The connection delivered: the next failure waits ``first_s`` again."""
        self.next_s = self.first_s

    async def wait(self) -> None:
        """Wait before the next attempt; the one after waits twice as long."""
        delay = self.next_s
        self.next_s = min(self.max_s, self.next_s * 2)
        await asyncio.sleep(delay)


@dataclass
class RestartBackoff:
    base_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0
    deaths: int = 0  # in a row
    started_at: float = 0.0
    due_at: float | None = field(default=None)  # when the pending restart may run

    def died(self, now: float) -> float:
        """Record a death at ``now``; returns the delay before the restart."""
        if now - self.started_at >= self.stable_s:
            self.deaths = 0
        delay = 0.0 if self.deaths == 0 else min(self.max_s, self.base_s * 2 ** (self.deaths - 1))
        self.deaths += 1
        self.due_at = now + delay
        return delay

    def due(self, now: float) -> bool:
        return self.due_at is not None and now >= self.due_at

    def started(self, now: float) -> None:
        self.started_at = now
        self.due_at = None
