"""Prefix-cache hit rates of a run, and what they are measured against. Pure.

- ``cluster``: the instances' own counters summed (PrefixCacheStats: tokens
  of each request's first admission, and apart those of preempted requests
  admitted again);
- ``upper_bound``: the hit rate of one unbounded cache that sees every
  request in order (each request looks up its prompt, longest prefix of whole
  blocks, never its last token, as an engine does; then its prompt and its
  answer, but the last token, stay cached forever). Placement, eviction and
  requests computing the same prefix at once can only lower the live rate.
- ``capacity_bound``: the same requests through one cache of a bounded size
  (a cluster's every KV block pooled, none held by a running request), with
  the offline optimal eviction (Belady's MIN, with bypass), each request's
  cached blocks counted one by one, not only its longest cached prefix:
  what no placement and no eviction over that much memory beats (an engine
  serves only a prefix, and its running requests hold blocks too).
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Iterable, Sequence

from libs.common.prefix_hash import block_hashes
from libs.common.types import PrefixCacheStats


def cluster(stats: Iterable[PrefixCacheStats]) -> dict:
    stats = list(stats)
    q = sum(s.queries for s in stats)
    h = sum(s.hits for s in stats)
    return {"queries": q, "hits": h, "hit_rate": h / q if q else None,
            "preempted_queries": sum(s.preempted_queries for s in stats),
            "preempted_hits": sum(s.preempted_hits for s in stats),
            "evictions": sum(s.evictions for s in stats),
            "cached_blocks": sum(s.cached_blocks for s in stats)}


def upper_bound(requests: Iterable[tuple[list[int], list[int]]], block_size: int) -> dict:
    """``requests``: (prompt ids, output ids) in arrival order."""
    seen: set[int] = set()
    queries = hits = 0
    for prompt, output in requests:
        hashes = block_hashes(prompt[: len(prompt) - 1], block_size)
        n = 0
        while n < len(hashes) and hashes[n] in seen:
            n += 1
        queries += len(prompt)
        hits += n * block_size
        seen.update(block_hashes((list(prompt) + list(output))[:-1], block_size))
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else None}


def capacity_bound(requests: Sequence[tuple[list[int], list[int]]], block_size: int,
                   capacity_blocks: int) -> list[int]:
    """``requests``: (prompt ids, output ids) in arrival order. Per request,
    how many of its prompt's blocks (never its last token) one cache of
    ``capacity_blocks`` blocks holds when it arrives, kept by Belady's MIN
    with bypass: after each request its prompt's and answer's blocks are
    cached when their next use comes sooner than the farthest cached one's
    (which goes), a block used never again leaves, one used again stays."""
    looks = [block_hashes(list(p)[: len(p) - 1], block_size) for p, _ in requests]
    makes = [block_hashes((list(p) + list(o))[:-1], block_size) for p, o in requests]
    uses: dict[int, list[int]] = {}
    for t, hashes in enumerate(looks):
        for h in hashes:
            uses.setdefault(h, []).append(t)
    never = len(requests)

    def next_use(h: int, t: int) -> int:
        at = uses.get(h)
        if not at:
            return never
        i = bisect_right(at, t)
        return at[i] if i < len(at) else never

    cache: dict[int, int] = {}  # hash -> its next use
    farthest: list[tuple[int, int]] = []  # (-next use, hash); stale entries skipped
    hits = []
    for t in range(len(requests)):
        hits.append(sum(1 for h in looks[t] if h in cache))
        for h in makes[t]:
            nu = next_use(h, t)
            if h in cache:
                if nu == never:
                    del cache[h]
                else:
                    cache[h] = nu
                    heapq.heappush(farthest, (-nu, h))
                continue
            if nu == never or capacity_blocks <= 0:
                continue
            if len(cache) >= capacity_blocks:
                while cache.get(farthest[0][1]) != -farthest[0][0]:
                    heapq.heappop(farthest)
                if -farthest[0][0] <= nu:
                    continue  # bypass: every cached block is needed sooner
                del cache[heapq.heappop(farthest)[1]]
            cache[h] = nu
            heapq.heappush(farthest, (-nu, h))
    return hits


def summary(instance_stats: dict[str, PrefixCacheStats], requests: list[tuple[list[int], list[int]]] | None,
            block_size: int | None) -> dict:
    """What a bench JSON carries: per instance, the cluster's, and the bound."""
    out = {"instances": {iid: s.__dict__ | {"hit_rate": s.hit_rate} for iid, s in sorted(instance_stats.items())},
           **cluster(instance_stats.values())}
    if requests is not None and block_size:
        bound = upper_bound(requests, block_size)
        out["upper_bound"] = bound
        out["of_upper_bound"] = (out["hit_rate"] / bound["hit_rate"]
                                 if out["hit_rate"] is not None and bound["hit_rate"] else None)
    return out
