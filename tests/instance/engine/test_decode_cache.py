"""The native engine's dense decode cache (decode_cache.py) without a model:
a slot holds exactly its request's KV from the paged cache (full blocks and a
partial last one), resizes keep the slots and reuse two arenas instead of
allocating, and a hint makes the memory a long request's joining needs ready
before it joins."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from services.instance.engine.native.decode_cache import DecodeCache

LAYERS, BS, KVH, D = 3, 4, 2, 8


class Req:
    def __init__(self, blocks: list[int]):
        self.block_ids = blocks


def _cache(num_blocks: int = 64, k_transposed: bool = False) -> DecodeCache:
    kv = torch.randn(num_blocks, LAYERS, 2, BS, KVH, D)
    return DecodeCache(kv, 2**24, k_transposed=k_transposed)


def _expected(dc: DecodeCache, r: Req, n: int) -> torch.Tensor:
    """[layers, 2, kvh, n, d]: the request's first n tokens from the paged cache."""
    blocks = dc.kv_cache[torch.tensor(r.block_ids)]  # [nb, layers, 2, bs, kvh, d]
    return blocks.permute(1, 2, 4, 0, 3, 5).reshape(LAYERS, 2, KVH, -1, D)[:, :, :, :n]


def _check_slots(dc: DecodeCache, reqs: list[Req], starts: list[int]) -> None:
    for r, n in zip(reqs, starts):
        slot = next(i for i, o in enumerate(dc.owner) if o is r)
        assert dc.lens[slot] == n
        want = _expected(dc, r, n)
        assert torch.equal(dc.slot_kv(slot, n), want)
        cap = dc.buf.shape[4]
        raw_k = dc.buf[:, 0, slot]  # [layers, kvh, cap, d] of memory
        if dc.k_transposed:  # what vLLM's CPU attention reads: K^T ([d, cap]) per head, V plain
            raw_k = raw_k.reshape(LAYERS, KVH, D, cap).transpose(-1, -2)
        assert torch.equal(raw_k[:, :, :n], want[:, 0])
        assert torch.equal(dc.buf[:, 1, slot, :, :n], want[:, 1])


def _arena_ptrs(dc: DecodeCache) -> set[int]:
    """The arena behind the buffer and the spares."""
    return {a.data_ptr() for a in [dc._arena, *dc._spares["arena"]] if a is not None}


def _settle(dc: DecodeCache) -> None:
    for _ in range(500):  # the helper thread zeroes spares
        if not dc._fills:
            return
        time.sleep(0.01)
    raise AssertionError("a fill never ended")


@pytest.mark.parametrize("k_transposed", [False, True], ids=["plain", "k-transposed"])
def test_slots_hold_their_requests_kv_through_resizes_and_reuse_the_arenas(k_transposed):
    dc = _cache(k_transposed=k_transposed)
    a, b, c = Req(list(range(10))), Req(list(range(10, 20))), Req(list(range(20, 64)))
    seen = set()
    # Which spares the first cycle ends with depends on when the helper
    # thread's fills end; from the second cycle on, the pool holds what a
    # cycle needs (one small arena, two large ones) and nothing is allocated.
    for cycle in range(4):
        # two short decodes; a long one joins (grow); it leaves (shrink); the short ones stay
        assert dc.prepare([a, b], [5, 9]) is not None
        _check_slots(dc, [a, b], [5, 9])
        assert dc.prepare([a, b, c], [5, 9, 170]) is not None  # 170 = 42 blocks and a partial one
        assert dc.buf.shape[4] >= 171
        _check_slots(dc, [a, b, c], [5, 9, 170])
        assert dc.prepare([a, b], [5, 9]) is not None
        assert dc.buf.shape[4] < 171  # shrunk: attention reads what the batch needs
        _check_slots(dc, [a, b], [5, 9])
        _settle(dc)
        if cycle == 1:
            seen = _arena_ptrs(dc)
        elif cycle > 1:  # warm: no resize allocated anything
            assert _arena_ptrs(dc) == seen
    assert 2 <= len(seen) <= 3


@pytest.mark.parametrize("k_transposed", [False, True], ids=["plain", "k-transposed"])
def test_compaction_moves_a_slot_with_its_kv(k_transposed):
    dc = _cache(k_transposed=k_transposed)
    a, b, c = Req(list(range(10))), Req(list(range(10, 20))), Req(list(range(20, 30)))
    assert dc.prepare([a, b, c], [7, 30, 21]) is not None
    _check_slots(dc, [a, b, c], [7, 30, 21])
    assert dc.prepare([b, c], [30, 21]) is not None  # a left: c's slot (2) moves into 0..1
    assert {id(o) for o in dc.owner[:2]} == {id(b), id(c)}
    _check_slots(dc, [b, c], [30, 21])


def test_a_hint_makes_a_long_joins_memory_ready_off_the_step():
    dc = _cache()
    a, c = Req(list(range(10))), Req(list(range(20, 64)))
    assert dc.prepare([a], [9]) is not None
    _settle(dc)
    before = _arena_ptrs(dc)
    dc.prewarm(170)
    _settle(dc)
    made = _arena_ptrs(dc) - before  # zeroed for the join, on the helper thread
    staging = dc._spares["staging"][0].data_ptr()
    assert len(made) == 1
    assert dc.prepare([a, c], [9, 170]) is not None
    assert {dc._arena.data_ptr()} == made and dc._staging.data_ptr() == staging
    _check_slots(dc, [a, c], [9, 170])


def test_a_fill_under_way_goes_on_with_a_larger_size_asked_meanwhile():
    dc = _cache()
    dc._make_ready("arena", 1000)
    dc._make_ready("arena", 50_000)  # asked while the first may still run
    _settle(dc)
    assert max(t.numel() for t in dc._spares["arena"]) >= 50_000


def test_drop_frees_everything():
    dc = _cache()
    assert dc.prepare([Req([0, 1])], [7]) is not None
    dc.drop()
    assert dc.buf is None and _arena_ptrs(dc) == set() and dc._staging is None
    assert not any(dc._spares.values())


def test_a_short_budget_still_leaves_headroom_instead_of_resizing_every_step():
    """With a budget too small for the usual 25% headroom, the capacity takes
    what the budget holds: a growing batch must not resize (and copy every
    slot) at each step."""
    kv = torch.randn(64, LAYERS, 2, BS, KVH, D)
    per_token = LAYERS * 2 * KVH * D * kv.element_size()  # one slot's bytes per token
    dc = DecodeCache(kv, 2 * 40 * per_token)  # two slots of 40 tokens at most
    a, b = Req(list(range(10))), Req(list(range(10, 20)))
    caps = []
    for n in range(10, 40):
        assert dc.prepare([a, b], [n, n]) is not None
        dc.advance(2)
        caps.append(dc.buf.shape[4])
    assert caps[0] == 40 and set(caps) == {40}
    assert dc.prepare([a, b], [40, 40]) is None  # past the budget: the runner gathers instead
