"""KV cache events: which block hashes an instance's prefix cache holds, as a
stream of changes (the semantics of vLLM's KV events: stored with parent,
removed, all cleared). Plain dataclasses; protobuf stays at the edge
(libs/common/convert.py).

A block is *held* from the event that stores it (it became a full, cached
block) to the event that removes it (evicted, or given back with the pool's
memory). Events are numbered by the instance that publishes them (``seq``,
one per batch, consecutive); a subscriber that sees a gap, or (re)connects,
starts again from a snapshot: every held hash at one sequence number.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.common.prefix_hash import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """Blocks that entered the cache, in chain order: ``block_hashes[0]``'s
    parent is ``parent`` (None: a sequence's first block), each next block's
    parent is the one before it."""

    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllCleared:
    """Every block left the cache (reset)."""


KvEvent = BlockStored | BlockRemoved | AllCleared


@dataclass(frozen=True)
class KvEventBatch:
    """One instance's events of one engine step, numbered: a subscriber that
    applied batch ``seq - 1`` applies this one; any other gap means resync."""

    instance_id: str
    seq: int
    events: tuple[KvEvent, ...] = ()


@dataclass(frozen=True)
class KvSnapshot:
    """Every block hash an instance holds after its batch ``seq``, with each
    one's parent (None: a first block)."""

    instance_id: str
    seq: int
    blocks: dict[BlockHash, BlockHash | None] = field(default_factory=dict)


def apply(held: dict[BlockHash, BlockHash | None], events) -> None:
    """Apply events to a ``{hash: parent}`` map of held blocks (in place)."""
    for ev in events:
        if isinstance(ev, BlockStored):
            parent = ev.parent
            for h in ev.block_hashes:
                held[h] = parent
                parent = h
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                held.pop(h, None)
        elif isinstance(ev, AllCleared):
            held.clear()
        else:
            raise TypeError(f"not a KV event: {ev!r}")
