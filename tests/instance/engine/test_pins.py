"""Continuum's TTL pinning (services/instance/engine/core/pins.py): a
finished turn of a named program keeps its cached blocks pinned (not
evictable, not free) until the TTL passes or the program's next turn here
took them; aborted turns and engines without a TTL pin nothing; the pool's
bookkeeping stays exact throughout."""

from __future__ import annotations

from libs.common.types import SamplingParams
from services.instance.engine.base import EngineConfig, EngineRequest
from services.instance.engine.fake import FakeEngine

SP = SamplingParams(max_tokens=4, min_tokens=4, ignore_eos=True)


def engine(ttl: float, blocks: int = 64):
    now = [100.0]
    e = FakeEngine(EngineConfig(num_blocks=blocks, token_delay_ms=0.0, program_ttl_s=ttl))
    e.clock = e.pins.clock = lambda: now[0]
    return e, now


def run(e, rid: str, prompt, program: str = "") -> None:
    e.add_request(EngineRequest(rid, tuple(prompt), SP, program_id=program))
    while rid in e.requests:
        e.step()
    e.check_integrity()


def test_a_finished_turn_pins_its_blocks_until_the_ttl():
    e, now = engine(ttl=30.0)
    free0 = e.num_free_blocks
    run(e, "t0", range(3, 67), "p")  # 64 prompt tokens + 4 out: 4 full blocks named
    pinned = e.pins.blocks_of("p")
    assert len(pinned) == 4 and e.num_free_blocks == free0 - 4
    assert e.pool.num_evictable_of(pinned) == 0  # LRU cannot take them
    now[0] += 29.0
    e.load()
    assert e.pins.blocks_of("p") == pinned
    now[0] += 2.0
    e.load()  # the TTL passed: cached again like any free block
    assert e.pins.blocks_of("p") == [] and e.num_free_blocks == free0 and e.pool.num_evictable_of(pinned) == 4
    assert e.pins.expired_total == 1
    e.check_integrity()


def test_the_next_turn_takes_the_pinned_history_and_pins_anew():
    e, now = engine(ttl=30.0)
    first = list(range(3, 67))
    run(e, "t0", first, "p")
    old = e.pins.blocks_of("p")
    run(e, "other", range(500, 564))  # no program: nothing pinned for it
    assert len(e.pins) == 1
    now[0] += 5.0
    second = first + [7, 7, 7, 7] + list(range(900, 940))
    e.add_request(EngineRequest("t1", tuple(second), SP, program_id="p"))
    e.step()  # the pin goes back to the cache as the step admits t1, which finds its history there
    assert e.requests["t1"].prefix_hit_tokens == 64 and e.requests["t1"].block_ids[:4] == old
    assert e.pins.blocks_of("p") == []
    while "t1" in e.requests:
        e.step()
    assert len(e.pins.blocks_of("p")) == len(second) // 16  # the new turn's history, pinned
    e.check_integrity()


def test_pinned_blocks_survive_pressure_that_evicts_unpinned_ones():
    e, now = engine(ttl=30.0, blocks=24)
    run(e, "a", range(3, 67), "p")  # pinned
    run(e, "b", range(300, 364))  # cached, unpinned
    run(e, "c", range(600, 600 + 16 * 19))  # 20 blocks with its output: every free one, b's too, not a's
    assert len(e.pins.blocks_of("p")) == 4
    e.add_request(EngineRequest("a2", tuple(range(3, 67)) + (7, 7, 7, 7, 5), SP, program_id="p"))
    e.add_request(EngineRequest("b2", tuple(range(300, 364)) + (5,), SP))
    e.step()
    assert e.requests["a2"].prefix_hit_tokens == 64 and e.requests["b2"].prefix_hit_tokens == 0
    while e.requests:
        e.step()
    e.check_integrity()


def test_aborted_turns_and_engines_without_a_ttl_pin_nothing():
    e, _ = engine(ttl=30.0)
    e.add_request(EngineRequest("x", tuple(range(3, 67)), SP, program_id="p"))
    e.step()
    e.abort_request("x")
    assert len(e.pins) == 0
    e.check_integrity()
    off, _ = engine(ttl=0.0)
    free0 = off.num_free_blocks
    run(off, "t0", range(3, 67), "p")
    assert len(off.pins) == 0 and off.num_free_blocks == free0
