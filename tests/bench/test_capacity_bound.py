"""The capacity bound (ferry/measure/hit_rate.py ``capacity_bound``): one
cache of a bounded size with Belady's eviction, block by block. Checked by
hand on small sequences and against every eviction order of a cache that
small (brute force): none serves more blocks, and the best as many."""

from __future__ import annotations

import itertools
import random

from ferry.measure.hit_rate import capacity_bound, upper_bound

BS = 2


def req(*blocks: int, out: tuple = ()) -> tuple[list[int], list[int]]:
    """A prompt of these 2-token blocks (and a last token, never served)."""
    return [t for b in blocks for t in (b, b)] + [0], list(out)


def test_an_unbounded_capacity_serves_what_the_unbounded_cache_does():
    rng = random.Random(3)
    reqs = [req(*[rng.randint(1, 4) for _ in range(rng.randint(1, 5))]) for _ in range(30)]
    hits = capacity_bound(reqs, BS, 10_000)
    prefix_hits = upper_bound(reqs, BS)["hits"] // BS
    assert sum(hits) >= prefix_hits  # block by block: a prefix's blocks and more


def test_by_hand_the_block_needed_sooner_stays():
    # block hashes chain, so [1] and [1, 2] share their first block only
    reqs = [req(1), req(2), req(1), req(2)]
    assert capacity_bound(reqs, BS, 0) == [0, 0, 0, 0]
    assert capacity_bound(reqs, BS, 1) == [0, 0, 1, 0]  # keeps [1] (used at 2) over [2] (used at 3)
    assert capacity_bound(reqs, BS, 2) == [0, 0, 1, 1]


def _served(reqs, capacity: int, evict_orders) -> int:
    """Hits of one online-or-not eviction: ``evict_orders`` picks, at each
    full insertion, which cached block goes (or the new one is skipped)."""
    from libs.common.prefix_hash import block_hashes

    cache: set = set()
    total = 0
    choices = iter(evict_orders)
    for p, o in reqs:
        total += sum(1 for h in block_hashes(p[:-1], BS) if h in cache)
        for h in block_hashes((p + o)[:-1], BS):
            if h in cache:
                continue
            if len(cache) < capacity:
                cache.add(h)
                continue
            pick = next(choices, None)
            opts = sorted(cache) + [None]
            victim = opts[pick % len(opts)] if pick is not None else None
            if victim is not None:
                cache.discard(victim)
                cache.add(h)
    return total


def test_no_eviction_order_serves_more_than_the_bound_and_the_best_serves_as_much():
    rng = random.Random(7)
    for _ in range(5):
        reqs = [req(*[rng.randint(1, 3) for _ in range(rng.randint(1, 3))]) for _ in range(6)]
        bound = sum(capacity_bound(reqs, BS, 2))
        best = max(_served(reqs, 2, picks) for picks in itertools.product(range(3), repeat=8))
        assert best == bound  # MIN with bypass is the optimum of this model, not only a bound
