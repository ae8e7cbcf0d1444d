"""A pool of fixed-size KV blocks: a FIFO free list, reference counts, and
blocks held in reserve for incoming migrations.

NOTE: the free list is FIFO (allocate from the front, freed blocks go to the
back) so a just-freed block is reused last; tests assert exact ids.
Running out of blocks is an expected result (``can_allocate`` is False,
``reserve`` returns None); misuse (double free, freeing an unknown block) raises.
"""

from __future__ import annotations

import threading
from collections import deque

from services.instance.engine.base import IntegrityError


class BlockPool:
    def __init__(self, num_blocks: int, watermark_blocks: int = 0):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.watermark_blocks = watermark_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._reserved: set[int] = set()
        # The pool is mutated by the engine thread only; the lock keeps the
        # counters coherent for readers on other threads (status reports).
        self._lock = threading.Lock()

    # --- queries ------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    def can_allocate(self, n: int, keep_watermark: bool = False) -> bool:
        floor = self.watermark_blocks if keep_watermark else 0
        return n <= len(self._free) - floor

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    # --- actions --------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take n blocks (refcount 1). Call can_allocate first: running out
        here is a programming error."""
        with self._lock:
            if n > len(self._free):
                raise IntegrityError(f"allocate({n}) with {len(self._free)} free: call can_allocate first")
            ids = [self._free.popleft() for _ in range(n)]
            for b in ids:
                self._ref[b] = 1
            return ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero go to the
        back of the free list in the given order."""
        with self._lock:
            for b in block_ids:
                if self._ref[b] <= 0:
                    raise IntegrityError(f"double free of block {b}")
                self._ref[b] -= 1
                if self._ref[b] == 0:
                    self._free.append(b)

    def share(self, block_ids: list[int]) -> None:
        """Add a reference (a block used by a second owner, e.g. a prefix)."""
        with self._lock:
            for b in block_ids:
                if self._ref[b] <= 0:
                    raise IntegrityError(f"share of free block {b}")
                self._ref[b] += 1

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

    def adopt(self, block_ids: list[int]) -> None:
        """Reserved blocks become owned by an installed request."""
        with self._lock:
            missing = [b for b in block_ids if b not in self._reserved]
            if missing:
                raise IntegrityError(f"blocks {missing} are not reserved")
            self._reserved.difference_update(block_ids)

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
            counts = [0] * self.num_blocks
            for ids in owned:
                for b in ids:
                    counts[b] += 1
            for b in self._reserved:
                counts[b] += 1
            for b in range(self.num_blocks):
                if self._ref[b] != counts[b]:
                    raise IntegrityError(f"block {b}: refcount {self._ref[b]} but {counts[b]} owners")
            if set(free) != {b for b in range(self.num_blocks) if counts[b] == 0}:
                raise IntegrityError("free list does not match unowned blocks (leak)")
