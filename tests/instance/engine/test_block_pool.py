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
    pool.check_integrity([])  # reserved blocks are owned by the reservation
    pool.adopt([0])
    pool.check_integrity([[0]])
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
