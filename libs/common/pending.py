"""Dispatches not yet visible in an instance's reports (pure, clock passed
in): the scheduler counts them in the instance's load until a report lists
the request, or at most a TTL. Used by the live cluster view and by the
discrete-event simulator's."""

from __future__ import annotations

from collections.abc import Iterable

# A dispatched request is counted as pending on its instance until a report
# lists it, or at most this long.
PENDING_TTL_S = 2.0


class PendingDispatches:
    def __init__(self, ttl_s: float = PENDING_TTL_S):
        self.ttl_s = ttl_s
        self._pending: dict[str, dict[str, tuple[int, float]]] = {}  # instance -> rid -> (blocks, t)

    def add(self, instance_id: str, request_id: str, blocks: int, now: float) -> None:
        self._pending.setdefault(instance_id, {})[request_id] = (blocks, now)

    def settle(self, instance_id: str, seen: Iterable[str], now: float) -> None:
        """A report of ``instance_id`` listing the requests ``seen`` arrived:
        those, and any older than the TTL, are no longer pending."""
        pend = self._pending.get(instance_id)
        if not pend:
            return
        seen = set(seen)
        for rid in [r for r, (_, t) in pend.items() if r in seen or now - t > self.ttl_s]:
            del pend[rid]

    def drop(self, instance_id: str) -> None:
        self._pending.pop(instance_id, None)

    def totals(self, instance_id: str, now: float) -> tuple[int, int]:
        """(blocks, requests) pending on the instance."""
        pend = self._pending.get(instance_id)
        if not pend:
            return 0, 0
        live = [b for b, t in pend.values() if now - t <= self.ttl_s]
        return sum(live), len(live)
