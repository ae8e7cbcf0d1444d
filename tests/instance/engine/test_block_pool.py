import pytest

from services.instance.engine.base import IntegrityError
from services.instance.engine.core.block_pool import BlockPool


def test_allocate_takes_from_the_front_and_free_appends_to_the_back():
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.free([1, 0])
    assert pool.allocate(3) == [3, 4, 5]
    assert pool.allocate(2) == [1, 0]  # freed order, after never-used blocks
    assert pool.num_free == 0
    pool.check_integrity([[1, 0], [2], [3, 4, 5]])


def test_running_out_is_a_result_and_misuse_raises():
    pool = BlockPool(4, watermark_blocks=1)
    assert pool.can_allocate(4) and not pool.can_allocate(5)
    assert pool.can_allocate(3, keep_watermark=True) and not pool.can_allocate(4, keep_watermark=True)
    assert pool.reserve(4) is None  # watermark kept for reservations
    ids = pool.allocate(2)
    pool.free(ids)
    with pytest.raises(IntegrityError):
        pool.free(ids)  # double free
    with pytest.raises(IntegrityError):
        pool.allocate(5)


def test_reserve_adopt_release():
    pool = BlockPool(5)
    r = pool.reserve(2)
    assert r == [0, 1] and pool.num_reserved == 2
    assert pool.num_used == 0  # reserved is not used
    pool.check_integrity([])  # reserved blocks are owned by the reservation
    pool.adopt([0])
    pool.check_integrity([[0]])
    assert pool.num_used == 1 and pool.num_reserved == 1  # adopted: a request's now
    with pytest.raises(IntegrityError):
        pool.adopt([2])  # never reserved
    pool.release([1])
    pool.free([0])
    assert pool.num_free == 5 and pool.num_reserved == 0
    pool.check_integrity([])


def test_shared_blocks_are_freed_with_their_last_reference():
    pool = BlockPool(3)
    ids = pool.allocate(1)
    pool.share(ids)
    pool.check_integrity([ids, ids])
    pool.free(ids)
    assert pool.num_free == 2
    pool.free(ids)
    assert pool.num_free == 3


def test_integrity_detects_leaks_and_double_ownership():
    pool = BlockPool(4)
    a = pool.allocate(2)
    with pytest.raises(IntegrityError):
        pool.check_integrity([])  # leaked: allocated, no owner
    with pytest.raises(IntegrityError):
        pool.check_integrity([a, a])  # two owners, refcount 1
    pool.check_integrity([a])
    pool.free(a)


# --- grow / shrink (KunServe: parameter memory lent to the KV cache and given back) ---


def test_grow_adds_free_blocks_after_the_existing_ones():
    pool = BlockPool(4)
    held = pool.allocate(4)
    assert not pool.can_allocate(1)
    assert pool.grow(3) == 7 and pool.num_free == 3
    assert pool.allocate(3) == [4, 5, 6]
    pool.free(held)
    pool.check_integrity([[4, 5, 6]])


def test_shrink_takes_free_blocks_at_once_and_the_rest_as_they_are_freed():
    pool = BlockPool(6)
    a = pool.allocate(4)
    assert pool.shrink(3) == 1  # two free ones now, one more to come
    assert pool.capacity == 4 and pool.num_free == 0 and pool.shrinking == 1
    assert not pool.can_allocate(1)
    pool.free(a[:2])  # the first freed block is retired, the second is free again
    assert pool.capacity == 3 and pool.shrinking == 0 and pool.num_free == 1
    pool.check_integrity([a[2:]])
    pool.free(a[2:])
    assert pool.num_free == 3
    pool.check_integrity()


def test_holding_is_what_a_grown_cache_copies_over_in_use_reserved_and_cached_not_free_or_retired():
    pool = BlockPool(8)
    a = pool.allocate(4)  # 0..3
    pool.cache_blocks(a[:1], [1000], None)
    pool.free(a[:2])  # 0 free but cached (a prefix hit may still take it), 1 free
    assert pool.reserve(1) is not None  # an incoming migration's block
    pool.shrink(1)  # one free id retired
    held = pool.holding()
    assert 0 in held and 2 in held and 3 in held and 1 not in held
    assert len(held) == 4 and held == sorted(held)  # 0, 2, 3 and the reserved one
    assert len(set(range(8)) - set(held)) == 4  # 1, the retired one and the two other free ones


def test_grow_after_shrink_reuses_retired_ids_and_cancels_a_shrink_under_way():
    pool = BlockPool(4)
    a = pool.allocate(3)
    pool.shrink(2)  # 1 free retired now, 1 pending
    assert pool.ids_after_grow(1) == 4 and pool.ids_after_grow(3) == 5  # reuse first, then new ids
    assert pool.grow(1) == 3 and pool.shrinking == 0  # cancels the pending one
    assert pool.ids_after_grow(2) == 5
    assert pool.grow(2) == 5 and pool.num_blocks == 5  # one retired id back, one new
    pool.free(a)
    assert pool.num_free == 5
    pool.check_integrity()


def test_shrink_more_than_the_capacity_is_refused_and_a_leak_is_still_caught():
    pool = BlockPool(3)
    with pytest.raises(ValueError):
        pool.shrink(4)
    pool.shrink(1)
    with pytest.raises(ValueError):
        pool.shrink(3)
    held = pool.allocate(2)
    with pytest.raises(IntegrityError):
        pool.check_integrity([held[:1]])  # the second block is owned by nobody


def test_an_engine_reports_the_capacity_in_circulation():
    from services.instance.engine.base import EngineConfig
    from services.instance.engine.core.engine import CoreEngine
    from services.instance.engine.fake import FakeExecutor

    eng = CoreEngine(EngineConfig(block_size=4), FakeExecutor(16, 4, 0.0), 16, 64)
    assert eng.grow_blocks(8) == 24 and eng.executor.cache.shape[0] == 24  # storage for the new ids
    assert eng.load().total_blocks == 24 and eng.load().free_blocks == 24
    eng.pool.shrink(10)
    assert eng.load().total_blocks == 14


def test_an_executor_that_cannot_grow_its_kv_refuses_and_the_pool_is_unchanged():
    from services.instance.engine.base import EngineConfig, EngineError, KvLayout
    from services.instance.engine.core.engine import CoreEngine
    from services.instance.engine.core.executor import Executor

    class Fixed(Executor):
        kv_layout = KvLayout("float32", 4, 1, 1, 1)

        def execute(self, chunks):
            return []

        def gather_kv(self, block_ids):
            return memoryview(b"")

        def scatter_kv(self, block_ids, data):
            pass

    eng = CoreEngine(EngineConfig(block_size=4), Fixed(), 16, 64)
    with pytest.raises(EngineError, match="cannot grow"):
        eng.grow_blocks(4)
    assert eng.pool.capacity == 16
