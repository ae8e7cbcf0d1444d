"""A pool of fixed-size KV blocks: a FIFO free list, reference counts, a
prefix cache (prefix_cache.py), and blocks held in reserve for incoming
migrations.

NOTE: the free list is FIFO (allocate from the front, freed blocks go to the
back) so a just-freed block is reused last; tests assert exact ids. Free
blocks that are cached (named by a hash) wait on the cache's LRU queue
instead and are taken only when the plain free list is empty: a cached
block's content goes only when nothing else is free.
Running out of blocks is an expected result (``can_allocate`` is False,
``reserve`` returns None); misuse (double free, freeing an unknown block) raises.
"""

from __future__ import annotations

import threading
from collections import deque

from libs.common.prefix_hash import BlockHash
from services.instance.engine.base import IntegrityError
from services.instance.engine.core.prefix_cache import PrefixCache


class BlockPool:
    def __init__(self, num_blocks: int, watermark_blocks: int = 0, caching: bool = True):
        """``caching``: full blocks are named and kept while free (prefix caching)."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.watermark_blocks = watermark_blocks
        self.caching = caching
        self.cache = PrefixCache()
        self._free: deque[int] = deque(range(num_blocks))  # free blocks with no name
        self._ref = [0] * num_blocks
        self._shared: set[int] = set()  # blocks with more than one reference (the load's shared split)
        self._reserved: set[int] = set()
        # Cached blocks an incoming migration linked instead of copying
        # (``link``): block -> how many reservations hold it (one reference each).
        self._linked: dict[int, int] = {}
        # Capacity given back (KunServe's restore, ``shrink``): ids out of
        # circulation, and how many more to take out as blocks are freed.
        self._retired: set[int] = set()
        self._to_retire = 0
        # The pool is mutated by the engine thread only; the lock keeps the
        # counters coherent for readers on other threads (status reports).
        self._lock = threading.Lock()

    # --- queries ------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Blocks in circulation: ``num_blocks`` less the retired ones."""
        return self.num_blocks - len(self._retired)

    @property
    def shrinking(self) -> int:
        """Blocks a ``shrink`` still has to take out (in use until freed)."""
        return self._to_retire

    @property
    def num_free(self) -> int:
        """Free blocks, cached ones (evictable) included."""
        return len(self._free) + self.cache.num_evictable

    @property
    def num_cached(self) -> int:
        """Blocks named in the prefix cache (in use or evictable)."""
        return len(self.cache)

    @property
    def num_evictable(self) -> int:
        return self.cache.num_evictable

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    @property
    def num_used(self) -> int:
        """Blocks requests hold: in circulation, neither free nor reserved."""
        return self.capacity - self.num_free - self.num_reserved

    def can_allocate(self, n: int, keep_watermark: bool = False) -> bool:
        floor = self.watermark_blocks if keep_watermark else 0
        return n <= self.num_free - floor

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def shared_of(self, block_ids: list[int]) -> list[int]:
        """Those of these blocks that have more than one reference (a prefix
        hit, a link): kept as a set, so a load with no sharing costs nothing."""
        shared = self._shared
        return [b for b in block_ids if b in shared] if shared else []

    # --- actions --------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take n blocks (refcount 1): plain free ones first, then the least
        recently used cached ones (evicted). Call can_allocate first: running
        out here is a programming error."""
        with self._lock:
            if n > self.num_free:
                raise IntegrityError(f"allocate({n}) with {self.num_free} free: call can_allocate first")
            ids = [self._free.popleft() if self._free else self.cache.evict_lru() for _ in range(n)]
            for b in ids:
                self._ref[b] = 1
            return ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block. Blocks reaching zero go to the
        back of the free list in the given order, or, when cached, to the
        back of the evictable queue in reverse order (a sequence's tail is
        evicted before its head)."""
        with self._lock:
            parked = []
            for b in block_ids:
                if self._ref[b] <= 0:
                    raise IntegrityError(f"double free of block {b}")
                self._ref[b] -= 1
                if self._ref[b] == 1:
                    self._shared.discard(b)
                elif self._ref[b] == 0:
                    if self._to_retire:
                        self.cache.forget(b)
                        self._retired.add(b)
                        self._to_retire -= 1
                    elif self.cache.hash_of(b) is not None:
                        parked.append(b)
                    else:
                        self._free.append(b)
            for b in reversed(parked):
                self.cache.park(b)

    def share(self, block_ids: list[int]) -> None:
        """Add a reference (a block used by a second owner, e.g. a prefix)."""
        with self._lock:
            for b in block_ids:
                if self._ref[b] <= 0:
                    raise IntegrityError(f"share of free block {b}")
                self._ref[b] += 1
                if self._ref[b] == 2:
                    self._shared.add(b)

    # --- the prefix cache ---------------------------------------------------------
    def lookup(self, hashes) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes`` ([] when caching is off)."""
        if not self.caching:
            return []
        with self._lock:
            return self.cache.lookup(hashes)

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks a request hits (evictable ones
        leave the queue)."""
        with self._lock:
            for b in block_ids:
                if self.cache.hash_of(b) is None:
                    raise IntegrityError(f"touch of block {b}, which is not cached")
                if self._ref[b] == 0:
                    self.cache.unpark(b)
                self._ref[b] += 1
                if self._ref[b] == 2:
                    self._shared.add(b)

    def keep(self, program: str, block_ids: list[int]) -> None:
        """A program keeps these cached blocks between its turns (pins.ProgramKeep):
        still evictable, but after every plain cached block, in the keeper's order."""
        with self._lock:
            self.cache.keep(program, block_ids)

    def unkeep(self, program: str, block_ids: list[int]) -> None:
        """Its retention ended: the blocks nobody keeps are plain LRU cache again."""
        with self._lock:
            self.cache.unkeep(program, block_ids)

    def num_evictable_of(self, block_ids: list[int]) -> int:
        """How many of these (cached) blocks are evictable: a hit takes them off the free count."""
        return sum(1 for b in block_ids if self._ref[b] == 0)

    def cache_blocks(self, block_ids: list[int], hashes: list[BlockHash], parent: BlockHash | None) -> int:
        """Name newly full blocks (in use) by their hashes; a hash already
        cached stays with its block. Returns how many were named."""
        if not self.caching or not block_ids:
            return 0
        with self._lock:
            for b in block_ids:
                if self._ref[b] <= 0:
                    raise IntegrityError(f"caching free block {b}")
            return self.cache.register(block_ids, hashes, parent)

    def clear_cache(self) -> None:
        """Forget every cached block (evictable ones become plain free)."""
        with self._lock:
            self._free.extend(self.cache.clear())

    def take_events(self):
        """KV events since the last call (libs/common/kv_events.py); the first call starts recording."""
        with self._lock:
            return self.cache.take_events()

    def holding(self) -> list[int]:
        """The ids whose contents matter (in use, reserved or cached), in
        order: what a larger cache copies over (``CoreEngine.grow_blocks``)."""
        with self._lock:
            idle = set(self._free) | self._retired
            return [b for b in range(self.num_blocks) if b not in idle]

    def ids_after_grow(self, n: int) -> int:
        """``num_blocks`` once ``grow(n)`` has run: a shrink under way and
        retired ids are reused before new ids are made."""
        with self._lock:
            return self.num_blocks + max(0, n - min(n, self._to_retire) - len(self._retired))

    def grow(self, n: int) -> int:
        """Add n free blocks (KunServe: memory freed by dropping parameters).
        A shrink still under way is cancelled first, then retired ids come
        back before new ones are made. Returns the new capacity."""
        if n < 0:
            raise ValueError(f"grow({n}): n must be >= 0")
        with self._lock:
            cancel = min(n, self._to_retire)
            self._to_retire -= cancel
            n -= cancel
            back = sorted(self._retired)[:n]
            self._retired.difference_update(back)
            self._free.extend(back)
            new = n - len(back)
            self._free.extend(range(self.num_blocks, self.num_blocks + new))
            self._ref.extend([0] * new)
            self.num_blocks += new
            return self.capacity

    def shrink(self, n: int) -> int:
        """Take n blocks out of circulation (KunServe: memory given back to
        restored parameters): free ones at once, the rest as they are freed
        (``shrinking`` says how many are left). Only the count matters here:
        the ids retired are whichever come free. Returns how many are left."""
        if n < 0 or n > self.capacity - self._to_retire:
            raise ValueError(f"shrink({n}) of a pool of {self.capacity} blocks ({self._to_retire} already going)")
        with self._lock:
            now = min(n, self.num_free)
            for _ in range(now):
                self._retired.add(self._free.pop() if self._free else self.cache.evict_lru())
            self._to_retire += n - now
            return self._to_retire

    def reserve(self, n: int) -> list[int] | None:
        """Blocks for an incoming migration, keeping the watermark free."""
        if not self.can_allocate(n, keep_watermark=True):
            return None
        ids = self.allocate(n)
        with self._lock:
            self._reserved.update(ids)
        return ids

    def is_reserved(self, block_id: int) -> bool:
        return block_id in self._reserved

    def link(self, hashes) -> list[int]:
        """An incoming migration's blocks that this cache holds already: the
        blocks of the longest cached prefix of ``hashes``, each with a
        reference taken for the reservation (an evictable one leaves the LRU
        queue). They are never written (``is_reserved`` is False for them);
        ``adopt`` hands them to the installed request, ``release`` drops the
        reference. [] when caching is off."""
        if not self.caching:
            return []
        with self._lock:
            ids = self.cache.lookup(hashes)
            for b in ids:
                if self._ref[b] == 0:
                    self.cache.unpark(b)
                self._ref[b] += 1
                if self._ref[b] == 2:
                    self._shared.add(b)
                self._linked[b] = self._linked.get(b, 0) + 1
            return ids

    @property
    def num_linked(self) -> int:
        """References held by incoming migrations on cached blocks."""
        return sum(self._linked.values())

    def adopt(self, block_ids: list[int]) -> None:
        """Reserved (or linked) blocks become owned by an installed request."""
        with self._lock:
            counts: dict[int, int] = {}
            for b in block_ids:
                counts[b] = counts.get(b, 0) + 1
            missing = [b for b, n in counts.items()
                       if n > (1 if b in self._reserved else 0) + self._linked.get(b, 0)]
            if missing:
                raise IntegrityError(f"blocks {missing} are not reserved")
            for b in block_ids:
                if b in self._reserved:
                    self._reserved.discard(b)
                elif self._linked[b] == 1:
                    del self._linked[b]
                else:
                    self._linked[b] -= 1

    def release(self, block_ids: list[int]) -> None:
        """Return reserved blocks that were never installed."""
        self.adopt(block_ids)
        self.free(block_ids)

    # --- integrity ----------------------------------------------------------
    def check_integrity(self, owned: list[list[int]] = ()) -> None:
        """``owned``: the block lists of every live request. Each allocated
        block's refcount must equal its owners (+1 if reserved)."""
        with self._lock:
            free = list(self._free)
            if len(set(free)) != len(free):
                raise IntegrityError("a block is on the free list twice")
            if any(self.cache.hash_of(b) is not None for b in free):
                raise IntegrityError("a cached block is on the plain free list")
            self.cache.check(self._ref, self._retired)
            free += [b for b in range(self.num_blocks) if self.cache.is_evictable(b)]
            counts = [0] * self.num_blocks
            for ids in owned:
                for b in ids:
                    counts[b] += 1
            for b in self._reserved:
                counts[b] += 1
            for b, n in self._linked.items():
                counts[b] += n
            for b in range(self.num_blocks):
                if self._ref[b] != counts[b]:
                    raise IntegrityError(f"block {b}: refcount {self._ref[b]} but {counts[b]} owners")
            if self._shared != {b for b in range(self.num_blocks) if counts[b] > 1}:
                raise IntegrityError("the set of shared blocks does not match their refcounts")
            if self._retired & ({b for b in range(self.num_blocks) if counts[b]} | set(free)):
                raise IntegrityError("a retired block is in use or on the free list")
            if set(free) != {b for b in range(self.num_blocks) if counts[b] == 0} - self._retired:
                raise IntegrityError("free list does not match unowned blocks (leak)")
