"""Keep by expected return (services/instance/engine/core/pins.py
ProgramKeep, the llumnix-keep policy): a finished turn of a named program
keeps its cached blocks evictable, but evicted only after every plain cached
block, the program worth least first (recompute cost over the time until its
expected return, learned from its gaps here), its tail first; past-due
retention is plain LRU cache again; at most the budget of the pool is kept;
no request waits for kept blocks; the pool's bookkeeping stays exact
throughout (its integrity check, which a corrupted keep fails)."""

from __future__ import annotations

import random

import pytest

from libs.common.types import SamplingParams
from services.instance.engine.base import EngineConfig, EngineRequest, IntegrityError
from services.instance.engine.core.pins import RETAIN_GAPS, ProgramKeep, block_cost
from services.instance.engine.fake import FakeEngine

SP = SamplingParams(max_tokens=4, min_tokens=4, ignore_eos=True)
BS = 16


def engine(blocks: int = 64, budget: float = 0.75, gap: float = 10.0):
    now = [100.0]
    e = FakeEngine(EngineConfig(num_blocks=blocks, token_delay_ms=0.0, program_keep=budget, program_gap_s=gap))
    e.clock = e.pins.clock = lambda: now[0]
    assert isinstance(e.pins, ProgramKeep)
    return e, now


def run(e, rid: str, prompt, program: str = "", sp=SP) -> None:
    e.add_request(EngineRequest(rid, tuple(prompt), sp, program_id=program))
    while rid in e.requests:
        e.step()
        e.check_integrity()


def all_cached(e) -> list[int]:
    return [e.pool.cache.block_of(h) for h in e.pool.cache.hashes()]


def named(e, blocks) -> list:
    """The hashes that name these blocks now (their content)."""
    return [e.pool.cache.hash_of(b) for b in blocks]


def cached(e, hashes) -> int:
    """How many of these contents are still cached (on whatever block)."""
    return sum(1 for h in hashes if e.pool.cache.block_of(h) is not None)


def test_a_finished_turn_keeps_its_blocks_evictable_and_withheld_from_dispatch():
    e, now = engine(gap=10.0)
    free0 = e.num_free_blocks
    run(e, "t0", range(3, 67), "p")  # 64 prompt tokens + 4 out: 4 full blocks named
    kept = e.pins.blocks_of("p")
    assert len(kept) == 4
    assert e.num_free_blocks == free0 and e.pool.num_evictable_of(kept) == 4  # free: admission may take them
    kept_h = named(e, kept)
    assert e.load().free_blocks == free0 - 4  # held, as dispatch sees it
    assert e.pins.next_expiry() == pytest.approx(100.0 + RETAIN_GAPS * 10.0)
    now[0] += RETAIN_GAPS * 10.0 - 1.0
    e.load()
    assert e.pins.blocks_of("p") == kept
    now[0] += 2.0
    e.load()  # past due: plain LRU cache, nothing withheld
    assert e.pins.blocks_of("p") == [] and e.load().free_blocks == free0 and cached(e, kept_h) == 4
    assert e.pins.expired_total == 1 and e.pool.cache.num_kept == 0
    e.check_integrity()


def test_plain_cached_blocks_go_before_kept_ones_and_no_request_waits_for_kept_ones():
    e, now = engine(blocks=24)
    run(e, "a", range(3, 67), "p")  # kept
    a = named(e, e.pins.blocks_of("p"))
    run(e, "b", range(300, 364))  # cached, no program
    b = [h for h in named(e, all_cached(e)) if h not in a]
    assert len(b) == 4
    # 20 blocks with its output: every plain free block and b's 4, none of a's
    run(e, "c", range(600, 600 + 16 * 19))
    assert cached(e, a) == 4 and cached(e, b) == 0
    # 22 blocks: more than every block but a's: takes a's too (LRU's tail, c's, first), without waiting
    e.add_request(EngineRequest("d", tuple(range(2000, 2000 + 16 * 21)), SP))
    e.step()
    assert e.requests["d"].num_computed_tokens > 0
    assert cached(e, a) < 4 and e.pool.cache.kept_evictions > 0
    while e.requests:
        e.step()
        e.check_integrity()


def test_the_program_expected_back_last_is_evicted_first_tail_first():
    e, now = engine(blocks=40, gap=10.0)
    # learn the gaps: "far" comes back after 30 s, then "near" after 1 s
    for p, base, gap in (("far", 1003, 30.0), ("near", 3, 1.0)):
        run(e, p + "0", range(base, base + 64), p)
        now[0] += gap
        run(e, p + "1", list(range(base, base + 64)) + [7] * 4 + list(range(base + 500, base + 508)), p)
        assert e.pins.expected_gap(p) == pytest.approx(gap)
    near, far = named(e, e.pins.blocks_of("near")), named(e, e.pins.blocks_of("far"))
    assert len(near) == len(far) == 4  # 76 prompt tokens + 3 out computed
    assert e.pins.worth("far") < e.pins.worth("near")
    plain = e.pool.num_free - e.pool.cache.num_kept_evictable
    # a request that needs every plain block and two more: two of far's go, its tail first
    e.add_request(EngineRequest("x", tuple(range(5000, 5000 + 16 * (plain + 2) - 4)), SP))
    e.step()
    assert cached(e, near) == 4 and cached(e, far[:2]) == 2 and cached(e, far[2:]) == 0
    while e.requests:
        e.step()
        e.check_integrity()


def test_of_equal_returns_the_cheaper_to_recompute_goes_first():
    e, now = engine(blocks=40)
    run(e, "s", range(3, 3 + 32), "short")  # 2 blocks
    run(e, "l", range(1003, 1003 + 96), "long")  # 6 blocks, each costlier to recompute (more context)
    # same expected gap and end time: worth per block by the recompute cost
    assert block_cost(5, BS) > block_cost(0, BS)
    assert e.pins.worth("short") < e.pins.worth("long")
    short, long_ = named(e, e.pins.blocks_of("short")), named(e, e.pins.blocks_of("long"))
    plain = e.pool.num_free - e.pool.cache.num_kept_evictable
    e.add_request(EngineRequest("x", tuple(range(5000, 5000 + 16 * (plain + 2) - 4)), SP))
    e.step()
    assert cached(e, short) == 0 and cached(e, long_) == 6
    while e.requests:
        e.step()


def test_past_due_retention_is_evicted_before_fresher_plain_cache():
    e, now = engine(blocks=24, gap=1.0)
    run(e, "a", range(3, 67), "p")
    a = named(e, e.pins.blocks_of("p"))
    now[0] += RETAIN_GAPS * 1.0 + 1.0
    e.load()
    assert e.pins.blocks_of("p") == []
    run(e, "b", range(300, 364))  # plain cache, freed after a's retention ended
    b = [h for h in named(e, all_cached(e)) if h not in a]
    free_plain = len(e.pool._free)
    e.add_request(EngineRequest("c", tuple(range(600, 600 + 16 * (free_plain + 2) - 4)), SP))
    e.step()
    assert cached(e, a) == 2 and cached(e, b) == 4  # a's tail went; its head and b are still there
    while e.requests:
        e.step()


def test_the_budget_caps_what_is_kept_and_ends_the_retention_worth_least():
    e, now = engine(blocks=64, budget=0.125)  # 8 blocks
    run(e, "l", range(3, 3 + 16 * 10), "long")  # 10 blocks: its head 8 kept
    assert len(e.pins.blocks_of("long")) == 8 and e.pool.cache.num_kept == 8
    now[0] += 1.0
    run(e, "s", range(1003, 1003 + 64), "short")  # 4 more: past the budget, the other retention ends
    assert e.pins.blocks_of("long") == [] and len(e.pins.blocks_of("short")) == 4
    assert e.pool.cache.num_kept == 4
    e.check_integrity()


def test_a_returning_turn_finds_its_history_and_keeps_the_new_one():
    e, now = engine()
    first = list(range(3, 67))
    run(e, "t0", first, "p")
    old = e.pins.blocks_of("p")
    now[0] += 5.0
    second = first + [7, 7, 7, 7] + list(range(900, 940))
    e.add_request(EngineRequest("t1", tuple(second), SP, program_id="p"))
    e.step()
    assert e.requests["t1"].prefix_hit_tokens == 64 and e.requests["t1"].block_ids[:4] == old
    assert e.pins.expected_gap("p") == pytest.approx(5.0)
    while "t1" in e.requests:
        e.step()
    assert len(e.pins.blocks_of("p")) == len(second) // 16
    e.check_integrity()


def test_random_turns_under_pressure_never_leak_a_block():
    """Programs' turns, plain requests, aborts and clock jumps on a small
    pool: the integrity check holds after every step, and once every
    retention has ended the whole pool is free and nothing is kept."""
    rng = random.Random(7)
    e, now = engine(blocks=48, budget=0.5, gap=3.0)
    history = {p: list(range(10_000 * (i + 1), 10_000 * (i + 1) + rng.randrange(8, 60))) for i, p in
               enumerate("abcdef")}
    n = 0
    for _ in range(120):
        n += 1
        p = rng.choice("abcdef-")
        if p == "-":
            prompt = [rng.randrange(1, 30_000) for _ in range(rng.randrange(4, 200))]
        else:
            history[p] += [rng.randrange(1, 30_000) for _ in range(rng.randrange(4, 40))]
            if len(history[p]) > 500:
                history[p] = history[p][:40]
            prompt = history[p]
        e.add_request(EngineRequest(f"r{n}", tuple(prompt), SP, program_id="" if p == "-" else p))
        for _ in range(rng.randrange(1, 4)):
            e.step()
            e.check_integrity()
        if rng.random() < 0.1 and e.requests:
            e.abort_request(rng.choice(sorted(e.requests)))
            e.check_integrity()
        now[0] += rng.expovariate(1.0)
    while e.requests:
        e.step()
        e.check_integrity()
    assert e.pins.pinned_total > 0 and e.pool.cache.kept_evictions > 0
    now[0] += 1_000.0
    e.load()
    assert len(e.pins) == 0 and e.pool.cache.num_kept == 0 and e.pool.cache.num_kept_evictable == 0
    assert e.num_free_blocks == e.num_total_blocks == e.load().free_blocks
    e.check_integrity()


def test_the_integrity_check_sees_a_corrupted_keep():
    e, _ = engine()
    run(e, "t0", range(3, 67), "p")
    kept = e.pins.blocks_of("p")
    e.pool.cache._keepers.pop(kept[0])  # kept and evictable, but nobody keeps it
    with pytest.raises(IntegrityError, match="no keeper"):
        e.check_integrity()
    e2, _ = engine()
    run(e2, "t0", range(3, 67), "p")
    b = e2.pins.blocks_of("p")[1]
    del e2.pool.cache._kept[b]
    e2.pool.cache._lru[b] = None  # on the LRU queue while kept
    with pytest.raises(IntegrityError, match="LRU queue"):
        e2.check_integrity()


def test_aborted_turns_and_engines_without_keep_keep_nothing():
    e, _ = engine()
    e.add_request(EngineRequest("x", tuple(range(3, 67)), SP, program_id="p"))
    e.step()
    e.abort_request("x")
    assert len(e.pins) == 0 and e.pool.cache.num_kept == 0
    e.check_integrity()
    off = FakeEngine(EngineConfig(num_blocks=64, token_delay_ms=0.0))
    run(off, "t0", range(3, 67), "p")
    assert len(off.pins) == 0 and off.pool.cache.num_kept == 0
    with pytest.raises(ValueError, match="two modes"):
        FakeEngine(EngineConfig(num_blocks=64, token_delay_ms=0.0, program_keep=0.5, program_ttl_s=30.0))
