"""Which instance moves programs' kept blocks to which (issue 53, move
instead of evict; the ``llumnix-move`` policy), pure.

An instance keeps programs' cached blocks between their turns
(InstanceStatus.kept_blocks: free, withheld from free_blocks); its own
admission evicts them once its plain free blocks run out. Before that, the
rescheduler moves them (a cache move: services/instance/migration/
cache_move.py) to an instance with room, where the program's next turn finds
them (dispatch follows the prefix index, which follows the blocks).

- A source is short of room: the blocks its queue and the dispatches
  pending there need, plus ``SOURCE_FLOOR`` of its pool kept free for what
  comes next, exceed its plain free blocks; it moves what it keeps, at most
  that shortfall.
- A destination has room: its plain free blocks less its queue's and its
  pending dispatches' needs less ``DEST_FLOOR`` of its pool, no queue, not
  terminating, decoding, migratable, not busy with an order. The blocks it
  takes are kept there too, so the floor is higher than the source's: a
  destination never becomes a source by taking them.
- Pairs: the sources shortest of room first, each with the destination that
  has the most room left, for the smaller of the shortfall and that room
  (at least ``MIN_BLOCKS``); a destination takes one order a round.

A move costs the blocks it sends over the instances' link and nothing on
either instance's steps (no request is attached); the alternative is the
program's next turn recomputing those blocks."""

from __future__ import annotations

from dataclasses import dataclass

from libs.common.policies.base import InstanceView

SOURCE_FLOOR = 0.10  # of the pool: plain free blocks a source keeps for its next admissions
DEST_FLOOR = 0.30  # of the pool: plain free blocks a destination keeps after taking others' kept blocks
MIN_BLOCKS = 1  # smaller moves are not ordered


@dataclass(frozen=True)
class CacheMovePair:
    source: str
    destination: str
    blocks: int  # kept blocks to move (the order's cache_blocks)


def _needed(v: InstanceView) -> int:
    """Blocks the queue and the pending dispatches need here."""
    return v.status.waiting_demand_blocks + v.pending_blocks


def shortfall(v: InstanceView) -> int:
    """Kept blocks ``v`` should move now (0: none, or it keeps none)."""
    s = v.status
    if s.kept_blocks <= 0 or s.terminating:
        return 0
    short = _needed(v) + int(SOURCE_FLOOR * s.total_blocks) - s.free_blocks
    return max(0, min(s.kept_blocks, short))


def room(v: InstanceView) -> int:
    """Kept blocks ``v`` can take from others now (0: none)."""
    s = v.status
    if s.terminating or s.num_waiting or v.pending_requests or not s.role.decodes:
        return 0
    return max(0, s.free_blocks - _needed(v) - int(DEST_FLOOR * s.total_blocks))


def pair_cache_moves(views: list[InstanceView], busy: frozenset[str] = frozenset()) -> list[CacheMovePair]:
    live = [v for v in views if v.instance_id not in busy and v.migratable and not v.status.unschedulable]
    sources = sorted(((shortfall(v), v) for v in live), key=lambda p: (-p[0], p[1].instance_id))
    dests = {v.instance_id: room(v) for v in live}
    pairs = []
    for want, src in sources:
        if want < MIN_BLOCKS:
            break
        left = [(n, iid) for iid, n in dests.items() if iid != src.instance_id and n >= MIN_BLOCKS]
        if not left:
            break
        n, iid = min(left, key=lambda p: (-p[0], p[1]))  # the most room; of equals the lowest id
        del dests[iid]
        dests.pop(src.instance_id, None)  # a source takes nothing this round
        pairs.append(CacheMovePair(src.instance_id, iid, min(want, n)))
    return pairs


__all__ = ["DEST_FLOOR", "MIN_BLOCKS", "SOURCE_FLOOR", "CacheMovePair", "pair_cache_moves", "room", "shortfall"]
