"""CoreEngine's prefix-caching part (engine.py stays the step loop): naming a
request's full blocks in the pool's prefix cache once their KV is computed
(or installed by a migration), the load's split of shared blocks, the
cache's stats, events and queries, and the integrity check of a request's
named blocks. The cache itself is the block pool's (prefix_cache.py); the
hits at admission are the scheduler's."""

from __future__ import annotations

from libs.common.types import PrefixCacheStats
from services.instance.engine.base import IntegrityError
from services.instance.engine.core.request import Request


class PrefixCaching:
    """Mixed into CoreEngine (which has ``pool``, ``executor``, ``requests``
    and ``_block_size``)."""

    def _cache_computed(self, req: Request) -> None:
        """Name the request's blocks that are full now in the prefix cache.
        NOTE: only KV of every layer held here is named (not while a pipeline
        peer holds some of the request's layers: it is named once back)."""
        n = req.num_computed_tokens // self._block_size
        first = req.num_cached_blocks
        if n <= first or not self.pool.caching or not self.executor.kv_all_here(req.request_id):
            return
        hashes = req.full_block_hashes(self._block_size, n)
        self.pool.cache_blocks(req.block_ids[first:n], hashes[first:n], hashes[first - 1] if first else None)
        req.num_cached_blocks = n

    def _own_blocks(self, r: Request, shared: set[int]) -> int:
        """The blocks a request holds alone; those it shares go to ``shared``.
        NOTE: only named blocks are ever shared (a hit), and a request's named
        blocks are its first ``num_cached_blocks``."""
        here = self.pool.shared_of(r.block_ids[: r.num_cached_blocks])
        shared.update(here)
        return len(r.block_ids) - len(here)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        st = self.pool.cache.stats
        return PrefixCacheStats(self.pool.caching, st.requests, st.queries, st.hits, st.evictions,
                                self.pool.num_cached, self.pool.num_evictable, st.preempted_queries,
                                st.preempted_hits)

    def take_kv_events(self) -> list:
        return self.pool.take_events()

    def cached_hashes(self) -> list:
        return self.pool.cache.hashes()

    def holds_hashes(self, hashes: list) -> list:
        return [h for h in hashes if self.pool.cache.block_of(h) is not None]

    def block_hashes(self, request_id: str) -> list:
        r = self.requests.get(request_id)
        return [] if r is None else list(r.block_hashes)  # NOTE: a copy; only the engine thread extends it

    def _check_named(self, r: Request) -> None:
        """A request's named blocks are full, computed and carry its own
        hashes (or none: a duplicate of a block named elsewhere)."""
        bs = self._block_size
        if r.num_cached_blocks > r.num_computed_tokens // bs:
            raise IntegrityError(f"{r.request_id}: {r.num_cached_blocks} named blocks for "
                                 f"{r.num_computed_tokens} computed tokens")
        hashes = r.full_block_hashes(bs, r.num_cached_blocks)
        for i, b in enumerate(r.block_ids):
            h = self.pool.cache.hash_of(b)
            if h is not None and (i >= r.num_cached_blocks or h != hashes[i]):
                raise IntegrityError(f"{r.request_id}: block {b} (#{i}) is named {h:#x}, not by this request")
