"""The prefix cache of a block pool (vLLM v1's automatic prefix caching): full
blocks named by their chained hash (libs/common/prefix_hash.py), kept while
free and evicted least-recently-used when the pool needs blocks.

Only the pool calls this (under its lock); it owns which blocks are free.
A cached block is either in use (refcount > 0) or *evictable*: free, on the
LRU queue, still findable by its hash. One hash names at most one block: a
block computed a second time while the first copy is cached (two requests
with the same prefix in one step) stays unnamed and is freed as a plain block.

NOTE: evictable blocks count as free everywhere (admission, freeness): taking
one costs only its cached content. The queue is ordered by the time a block
was last freed; a request's blocks are queued last block first, so a chain
loses its tail before its head (a lookup stops at the first miss).

Kept blocks (issue 53's keep, core/pins.py ProgramKeep): a block that one or
more programs keep (``keep``) is, while free, evictable but not on the LRU
queue: it waits apart and goes only when the LRU queue is empty, in the
order the keeper's ``choose`` gives (which program's blocks first). A block
no program keeps any longer (``unkeep``: its retention ended) goes to the
front of the LRU queue, tail first: past-due retention is plain LRU cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from libs.common.kv_events import AllCleared, BlockRemoved, BlockStored, KvEvent
from libs.common.prefix_hash import BlockHash
from services.instance.engine.base import IntegrityError


@dataclass
class PrefixStats:
    """Counters since start. ``queries`` and ``hits`` are in tokens, as vLLM's
    ``prefix_cache_queries`` / ``prefix_cache_hits``: a request admitted with
    N tokens of which its cached prefix covers H counts N queries, H hits. A
    preempted request admitted again counts apart (``preempted_*``), as in
    vLLM: its own blocks are what it finds."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    evictions: int = 0  # cached blocks whose content went (reused, retired or cleared)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class PrefixCache:
    def __init__(self) -> None:
        self._block: dict[BlockHash, int] = {}  # hash -> block id
        self._hash: dict[int, BlockHash] = {}  # block id -> hash
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable block ids, least recent first
        self._keepers: dict[int, set[str]] = {}  # block id -> the programs that keep it (in use or evictable)
        self._kept: dict[int, None] = {}  # evictable blocks some program keeps (not on the LRU queue)
        self._victims: list[int] = []  # the keeper's last choice, popped from the end (stale ids skipped)
        # The keeper's eviction order: the kept evictable blocks to take next, the last first (ProgramKeep).
        self.choose: Callable[[], list[int]] | None = None
        self.kept_evictions = 0  # kept blocks evicted before their program's retention ended
        self.events: list[KvEvent] | None = None  # recorded only once someone takes them
        self.stats = PrefixStats()

    # --- queries ------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._block)

    @property
    def num_evictable(self) -> int:
        return len(self._lru) + len(self._kept)

    @property
    def num_kept(self) -> int:
        """Blocks some program keeps, in use or evictable."""
        return len(self._keepers)

    @property
    def num_kept_evictable(self) -> int:
        return len(self._kept)

    def is_kept_evictable(self, block_id: int) -> bool:
        return block_id in self._kept

    def keepers_of(self, block_id: int) -> frozenset[str]:
        return frozenset(self._keepers.get(block_id, ()))

    def hash_of(self, block_id: int) -> BlockHash | None:
        return self._hash.get(block_id)

    def block_of(self, block_hash: BlockHash) -> int | None:
        return self._block.get(block_hash)

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._lru or block_id in self._kept

    def lookup(self, hashes) -> list[int]:
        """The blocks of the longest prefix of ``hashes`` held here."""
        out = []
        for h in hashes:
            b = self._block.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def hashes(self) -> list[BlockHash]:
        return list(self._block)

    # --- changes (the pool's) --------------------------------------------------
    def register(self, blocks: list[int], hashes: list[BlockHash], parent: BlockHash | None) -> int:
        """Name newly full blocks; a hash already held (or a block already
        named) is skipped. Returns how many were named."""
        run: list[BlockHash] = []
        run_parent = parent
        named = 0
        for b, h in zip(blocks, hashes):
            if h in self._block or b in self._hash:
                self._stored(run, run_parent)
                run, run_parent = [], h
                continue
            self._block[h] = b
            self._hash[b] = h
            run.append(h)
            named += 1
        self._stored(run, run_parent)
        return named

    def park(self, block_id: int) -> bool:
        """A block came free: queue it as evictable if it is cached (True)."""
        if block_id not in self._hash:
            return False
        if block_id in self._keepers:
            self._kept[block_id] = None
        else:
            self._lru[block_id] = None
        return True

    def unpark(self, block_id: int) -> None:
        """A hit on an evictable block: it is in use again."""
        if self._lru.pop(block_id, False) is False:
            del self._kept[block_id]

    def keep(self, program: str, blocks: list[int]) -> None:
        """``program`` keeps these blocks (the named ones): while free they
        wait apart from the LRU queue."""
        for b in blocks:
            if b not in self._hash:
                continue
            self._keepers.setdefault(b, set()).add(program)
            if b in self._lru:
                del self._lru[b]
                self._kept[b] = None
        self._victims = []

    def unkeep(self, program: str, blocks: list[int]) -> None:
        """``program`` no longer keeps these blocks (given head first): those
        nobody keeps go to the front of the LRU queue, tail first."""
        to_lru = []
        for b in blocks:
            s = self._keepers.get(b)
            if not s or program not in s:
                continue
            s.discard(program)
            if not s:
                del self._keepers[b]
                if b in self._kept:
                    del self._kept[b]
                    to_lru.append(b)
        for b in to_lru:
            self._lru[b] = None
            self._lru.move_to_end(b, last=False)
        self._victims = []

    def evict_lru(self) -> int | None:
        """The least recently used evictable block, its content forgotten;
        when none is on the LRU queue, the kept block the keeper's order
        gives."""
        if self._lru:
            b, _ = self._lru.popitem(last=False)
        elif self._kept:
            b = self._next_kept()
            del self._kept[b]
            self.kept_evictions += 1
        else:
            return None
        self._forget(b)
        return b

    def _next_kept(self) -> int:
        while self._victims:
            b = self._victims.pop()
            if b in self._kept:
                return b
        self._victims = [b for b in (self.choose() if self.choose else []) if b in self._kept]
        if not self._victims:  # the keeper gave none: any kept block
            return next(iter(self._kept))
        return self._victims.pop()

    def forget(self, block_id: int) -> None:
        """An in-use block leaves circulation (retired): drop its name."""
        if block_id in self._lru or block_id in self._kept:
            raise IntegrityError(f"forget of evictable block {block_id}")
        if block_id in self._hash:
            self._forget(block_id)

    def clear(self) -> list[int]:
        """Forget every name; returns the evictable blocks (now plain free)."""
        freed = list(self._lru) + list(self._kept)
        if self._block:
            self.stats.evictions += len(freed)
            self._emit(AllCleared())
        self._block.clear()
        self._hash.clear()
        self._lru.clear()
        self._kept.clear()
        self._keepers.clear()
        self._victims = []
        return freed

    def take_events(self) -> list[KvEvent]:
        """The events since the last call; recording starts with the first call."""
        if self.events is None:
            self.events = []
            return []
        out, self.events = self.events, []
        return out

    def _forget(self, block_id: int) -> None:
        h = self._hash.pop(block_id)
        del self._block[h]
        self._keepers.pop(block_id, None)
        self.stats.evictions += 1
        if self.events is not None:
            last = self.events[-1] if self.events else None
            if isinstance(last, BlockRemoved):  # one event for a run of evictions
                self.events[-1] = BlockRemoved(last.block_hashes + (h,))
            else:
                self.events.append(BlockRemoved((h,)))

    def _stored(self, run: list[BlockHash], parent: BlockHash | None) -> None:
        if run:
            self._emit(BlockStored(tuple(run), parent))

    def _emit(self, event: KvEvent) -> None:
        if self.events is not None:
            self.events.append(event)

    # --- integrity ----------------------------------------------------------
    def check(self, ref: list[int], retired: set[int]) -> None:
        """The two maps are inverse; evictable blocks are named, unowned and
        in circulation; ``ref``: the pool's refcounts."""
        if len(self._block) != len(self._hash) or any(self._hash.get(b) != h for h, b in self._block.items()):
            raise IntegrityError("the prefix cache's hash and block maps disagree")
        for b in [*self._lru, *self._kept]:
            if b not in self._hash:
                raise IntegrityError(f"evictable block {b} has no hash")
            if ref[b] != 0:
                raise IntegrityError(f"evictable block {b} has refcount {ref[b]}")
        for b in self._lru:
            if b in self._kept or b in self._keepers:
                raise IntegrityError(f"block {b} is kept by {sorted(self._keepers.get(b, ()))} but on the LRU queue")
        for b in self._kept:
            if not self._keepers.get(b):
                raise IntegrityError(f"kept evictable block {b} has no keeper")
        for b in self._keepers:
            if b not in self._hash:
                raise IntegrityError(f"kept block {b} is not cached")
        for b in self._hash:
            if b in retired:
                raise IntegrityError(f"retired block {b} is still cached")
            if ref[b] == 0 and b not in self._lru and b not in self._kept:
                raise IntegrityError(f"cached block {b} is neither in use nor evictable")
