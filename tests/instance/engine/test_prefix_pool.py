"""The block pool's prefix cache: named blocks kept while free, evicted LRU
only when nothing plain is free, reference counts, events, integrity. Exact
block ids and eviction order."""

from __future__ import annotations

import pytest

from libs.common.kv_events import AllCleared, BlockRemoved, BlockStored
from services.instance.engine.base import IntegrityError
from services.instance.engine.core.block_pool import BlockPool

H = [1000 + i for i in range(10)]  # stand-in hashes


def test_cached_free_blocks_count_as_free_and_go_last():
    pool = BlockPool(6)
    a = pool.allocate(3)  # [0, 1, 2]
    assert pool.cache_blocks(a, H[:3], None) == 3
    pool.free(a)
    assert pool.num_free == 6 and pool.num_evictable == 3 and pool.num_cached == 3
    # plain free blocks first (3, 4, 5), then the least recently freed cached
    # one: a request's blocks are queued tail first, so block 2 goes first
    assert pool.allocate(4) == [3, 4, 5, 2]
    assert pool.lookup(H[:3]) == [0, 1] and pool.cache.stats.evictions == 1
    pool.check_integrity([[3, 4, 5, 2]])


def test_a_hit_takes_a_reference_and_leaves_the_queue():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.cache_blocks(a, H[:2], None)
    pool.free(a)
    hit = pool.lookup(H[:3])  # the third is not cached: the prefix stops there
    assert hit == [0, 1] and pool.num_evictable_of(hit) == 2
    pool.touch(hit)
    assert pool.num_free == 2 and pool.num_evictable == 0 and pool.ref_count(0) == 1
    pool.touch(hit[:1])  # a second request shares the first block
    assert pool.num_evictable_of(hit) == 0 and pool.ref_count(0) == 2
    pool.check_integrity([hit, hit[:1]])
    pool.free(hit)
    pool.free(hit[:1])
    assert pool.num_evictable == 2
    pool.check_integrity([])


def test_lru_order_follows_the_last_free():
    pool = BlockPool(4)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.cache_blocks(a, H[:1], None)
    pool.cache_blocks(b, H[1:2], None)
    pool.free(a)
    pool.free(b)
    pool.touch(pool.lookup(H[:1]))  # a used again: now the most recent once freed
    pool.free(a)
    pool.allocate(2)  # plain 2, 3
    assert pool.allocate(1) == b  # b was freed longest ago
    assert pool.lookup(H[1:2]) == [] and pool.lookup(H[:1]) == a


def test_a_hash_names_one_block_duplicates_stay_plain():
    pool = BlockPool(4)
    a, b = pool.allocate(2), pool.allocate(2)
    pool.take_events()  # recording on
    assert pool.cache_blocks(a, H[:2], None) == 2
    assert pool.cache_blocks(b, [H[0], H[5]], None) == 1  # H[0] is a's; b's second block is new
    assert pool.take_events() == [BlockStored((H[0], H[1]), None), BlockStored((H[5],), H[0])]
    pool.free(b)
    assert pool.num_evictable == 1 and pool.num_free == 2  # b[0] is plain free, b[1] cached
    assert pool.allocate(1) == [b[0]]
    pool.check_integrity([a, [b[0]]])


def test_events_of_evictions_and_clear():
    pool = BlockPool(3)
    assert pool.take_events() == []  # starts recording
    a = pool.allocate(3)
    pool.cache_blocks(a, H[:3], None)
    pool.free(a)
    pool.allocate(2)  # evicts 2 then 1 (tail first)
    assert pool.take_events() == [BlockStored(tuple(H[:3]), None), BlockRemoved((H[2], H[1]))]
    pool.clear_cache()
    assert pool.take_events() == [AllCleared()]
    assert pool.num_cached == 0 and pool.num_free == 1
    pool.check_integrity([[1, 2]])  # the two evicted blocks, taken above


def test_no_events_are_kept_until_someone_takes_them():
    pool = BlockPool(2)
    a = pool.allocate(1)
    pool.cache_blocks(a, H[:1], None)
    assert pool.cache.events is None
    pool.free(a)


def test_caching_off_names_nothing_and_finds_nothing():
    pool = BlockPool(3, caching=False)
    a = pool.allocate(2)
    assert pool.cache_blocks(a, H[:2], None) == 0
    pool.free(a)
    assert pool.lookup(H[:2]) == [] and pool.num_evictable == 0
    assert pool.allocate(3) == [2, 0, 1]  # the plain FIFO as before


def test_shrink_evicts_cached_blocks_and_retires_named_ones_in_use():
    pool = BlockPool(4)
    a = pool.allocate(4)
    pool.cache_blocks(a, H[:4], None)
    pool.free(a[2:])  # 2 and 3 evictable
    pool.take_events()
    assert pool.shrink(3) == 1  # two at once (cached ones evicted), one more when freed
    assert pool.capacity == 2 and pool.num_free == 0
    assert pool.take_events() == [BlockRemoved((H[3], H[2]))]
    pool.free(a[:2])  # the first one freed is retired (its name goes), the other is cached-free
    assert pool.take_events() == [BlockRemoved((H[0],))]
    assert pool.capacity == 1 and pool.num_free == 1 and pool.lookup(H[1:2]) == [1]
    pool.check_integrity([])
    assert pool.grow(3) == 4 and pool.num_free == 4
    pool.check_integrity([])


def test_integrity_sees_a_broken_cache():
    pool = BlockPool(3)
    a = pool.allocate(2)
    pool.cache_blocks(a, H[:2], None)
    pool.check_integrity([a])
    pool.free(a)
    pool.cache._lru.pop(0)  # a cached free block lost from the queue: a leak
    with pytest.raises(IntegrityError):
        pool.check_integrity([])


def test_misuse_raises():
    pool = BlockPool(3)
    a = pool.allocate(1)
    with pytest.raises(IntegrityError):
        pool.touch(a)  # not cached
    pool.free(a)
    with pytest.raises(IntegrityError):
        pool.cache_blocks(a, H[:1], None)  # free


def test_a_migration_links_the_cached_prefix_and_the_request_adopts_it():
    """An incoming migration links the longest cached prefix (a reference
    each, evictable blocks leave the queue); linked blocks are not reserved
    (nothing is written into them); the installed request adopts them with
    its reserved ones, and a second migration may link the same blocks."""
    pool = BlockPool(8)
    a = pool.allocate(3)
    pool.cache_blocks(a, H[:3], None)
    pool.free(a[2:])  # block 2 evictable; 0 and 1 in use by a
    linked = pool.link([H[0], H[1], H[2], 5555])
    assert linked == [0, 1, 2] and pool.num_evictable == 0 and pool.num_linked == 3
    assert not any(pool.is_reserved(b) for b in linked)
    again = pool.link(H[:2])
    assert again == [0, 1] and pool.ref_count(0) == 3
    fresh = pool.reserve(2)
    pool.check_integrity([a[:2]])
    pool.adopt(linked + fresh)  # the first migration's request is installed
    pool.check_integrity([a[:2], linked + fresh])
    pool.release(again)  # the second aborts: its references go
    assert pool.num_linked == 0 and pool.ref_count(0) == 2
    pool.check_integrity([a[:2], linked + fresh])
    with pytest.raises(IntegrityError):
        pool.adopt(linked)  # linked once, adopted already
    pool.free(a[:2])
    pool.free(linked + fresh)
    assert pool.num_free == 8 and pool.num_evictable == 3
    pool.check_integrity()


def test_a_link_that_is_never_released_is_a_leak():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.cache_blocks(a, H[:2], None)
    pool.free(a)
    pool.link(H[:2])
    pool.check_integrity()  # the links are counted as owners
    pool._linked.clear()  # lose track of them
    with pytest.raises(IntegrityError):
        pool.check_integrity()


def test_linking_with_caching_off_links_nothing():
    pool = BlockPool(4, caching=False)
    assert pool.link(H[:2]) == [] and pool.num_linked == 0
