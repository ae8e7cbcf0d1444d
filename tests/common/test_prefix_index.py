"""The cluster-wide prefix index (pure): snapshots, batches in order only,
instances forgotten whole, prefix matches."""

from __future__ import annotations

from libs.common.kv_events import AllCleared, BlockRemoved, BlockStored, KvEventBatch, KvSnapshot
from libs.common.prefix_index import PrefixIndex


def test_snapshot_then_batches_in_order():
    idx = PrefixIndex()
    idx.reset(KvSnapshot("a", 4, {1: None, 2: 1}))
    assert not idx.apply(KvEventBatch("a", 6, (BlockStored((3,), 2),))), "a gap is refused"
    assert idx.hashes_of("a") == {1, 2}
    assert idx.apply(KvEventBatch("a", 5, (BlockStored((3, 4), 2), BlockRemoved((1,)))))
    assert idx.hashes_of("a") == {2, 3, 4} and idx.seq_of("a") == 5
    assert not idx.apply(KvEventBatch("b", 1, (BlockStored((9,)),))), "no snapshot of b yet"
    assert idx.apply(KvEventBatch("a", 6, (AllCleared(), BlockStored((7,)))))
    assert idx.hashes_of("a") == {7} and idx.holders(3) == frozenset()


def test_holders_and_match_over_instances():
    idx = PrefixIndex()
    idx.reset(KvSnapshot("a", 1, {10: None, 11: 10, 12: 11}))
    idx.reset(KvSnapshot("b", 7, {10: None, 11: 10, 20: 11}))
    assert idx.holders(10) == {"a", "b"} and idx.num_entries == 6
    assert idx.match([10, 11, 12, 13]) == {"a": 3, "b": 2}
    assert idx.match([30, 10]) == {}  # a miss ends the prefix
    assert idx.match([10, 20]) == {"a": 1, "b": 2}
    idx.remove("a")
    assert idx.holders(10) == {"b"} and idx.instances() == ["b"] and idx.seq_of("a") is None
    idx.reset(KvSnapshot("b", 9, {}))
    assert idx.num_entries == 0 and idx.holders(10) == frozenset()


def test_removing_a_hash_not_held_is_harmless_and_shared_holders_stay():
    idx = PrefixIndex()
    idx.reset(KvSnapshot("a", 0, {}))
    idx.reset(KvSnapshot("b", 0, {5: None}))
    assert idx.apply(KvEventBatch("a", 1, (BlockStored((5,)), BlockRemoved((6,)))))
    assert idx.apply(KvEventBatch("a", 2, (BlockRemoved((5,)),)))
    assert idx.holders(5) == {"b"}
