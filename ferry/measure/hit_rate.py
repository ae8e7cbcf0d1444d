"""Prefix-cache hit rates of a run, and what they are measured against. Pure.

- ``cluster``: the instances' own counters summed (PrefixCacheStats: tokens
  of each request's first admission, and apart those of preempted requests
  admitted again);
- ``upper_bound``: the hit rate of one unbounded cache that sees every
  request in order (each request looks up its prompt, longest prefix of whole
  blocks, never its last token, as an engine does; then its prompt and its
  answer, but the last token, stay cached forever). Placement, eviction and
  requests computing the same prefix at once can only lower the live rate.
"""

from __future__ import annotations

from collections.abc import Iterable

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
