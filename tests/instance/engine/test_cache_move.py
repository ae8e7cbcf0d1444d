"""A program's kept blocks leave one engine and join another's prefix cache
(services/instance/engine/core/engine.py ``export_program`` /
``end_export`` / ``import_program``, the engine half of a cache move): the
fake engine computes from the KV it reads back, so the next turn at the
destination gives the tokens it gives with no cache at all only if the moved
content is right; the destination keeps the blocks for the program (and
says so in its KV events), the source holds them as plain cache (evicted
before any kept block), and both pools stay exact, whether the move commits
or not."""

from __future__ import annotations

from libs.common.kv_events import BlockStored
from libs.common.types import SamplingParams
from services.instance.engine.base import EngineConfig, EngineRequest
from services.instance.engine.fake import FakeEngine, fake_generate

SP = SamplingParams(max_tokens=6, min_tokens=6, ignore_eos=True)


def engine(blocks: int = 64, keep: float = 0.75) -> tuple[FakeEngine, list[float]]:
    now = [100.0]
    e = FakeEngine(EngineConfig(num_blocks=blocks, token_delay_ms=0.0, program_keep=keep, program_gap_s=10.0))
    e.clock = e.pins.clock = lambda: now[0]
    return e, now


def run(e, rid: str, prompt, program: str = "") -> list[int]:
    e.add_request(EngineRequest(rid, tuple(prompt), SP, program_id=program))
    out = []
    while rid in e.requests:
        out += [o.token_id for o in e.step() if o.request_id == rid and o.token_id is not None]
        e.check_integrity()
    return out


def move(src: FakeEngine, dst: FakeEngine, program: str, commit: bool = True) -> list[int]:
    """The engine calls of a cache move, the copy done by hand."""
    kv = src.export_program(program)
    assert kv is not None
    src.check_integrity()  # the pinned blocks are owned by the export
    blocks = dst.reserve_blocks(len(kv.block_hashes))
    dst.scatter_kv(blocks, src.gather_kv(list(kv.block_ids)))
    if commit:
        dst.import_program(kv, blocks)
    else:
        dst.release_blocks(blocks)
    src.end_export(program, moved=commit)
    return blocks


def test_a_moved_programs_next_turn_hits_its_whole_history_there_with_exact_tokens():
    a, _ = engine()
    b, _ = engine()
    prompt = list(range(100, 164))  # 4 full blocks
    first = run(a, "t0", prompt, "p")
    kept = a.pins.blocks_of("p")
    assert len(kept) == 4 and a.movable_programs() == [("p", 4)]
    a.pool.take_events(), b.pool.take_events()  # start recording
    hashes = [a.pool.cache.hash_of(x) for x in kept]
    move(a, b, "p")
    stored = [h for ev in b.pool.take_events() if isinstance(ev, BlockStored) for h in ev.block_hashes]
    assert stored == hashes and a.pool.take_events() == []  # the index adds the destination's copy
    # at the source: plain cache now, no longer kept (the first to go when room is needed)
    assert a.pins.blocks_of("p") == [] and a.load().kept_blocks == 0 and len(a.pool.cache) == 4
    assert a.pool.cache.num_kept == 0 and a.pool.num_evictable == 4
    assert len(b.pins.blocks_of("p")) == 4 and b.load().kept_blocks == 4
    # the source's admission takes the moved copy before anything kept: a program kept there stays
    run(a, "q0", range(300, 364), "q")
    q = [a.pool.cache.hash_of(x) for x in a.pins.blocks_of("q")]
    run(a, "big", range(400, 400 + 16 * 59))  # 60 blocks with its answer: all but the 4 kept ones of q
    assert all(a.pool.cache.block_of(h) is not None for h in q)
    assert not any(a.pool.cache.block_of(h) is not None for h in hashes)
    # the next turn: the history plus a new message, at the destination
    turn = prompt + first + list(range(200, 230))
    out = run(b, "t1", turn, "p")
    assert out == fake_generate(turn, 6)
    assert b.pool.cache.stats.hits == 64  # its 4 full blocks, none recomputed
    a.check_integrity(), b.check_integrity()
    assert b.pool.num_free == b.pool.capacity


def test_a_move_that_does_not_commit_leaves_everything_as_it_was():
    a, _ = engine()
    b, _ = engine()
    run(a, "t0", range(100, 164), "p")
    kept = a.pins.blocks_of("p")
    move(a, b, "p", commit=False)
    assert a.pins.blocks_of("p") == kept and a.load().kept_blocks == 4
    assert len(b.pool.cache) == 0 and b.pool.num_free == b.pool.capacity
    a.check_integrity(), b.check_integrity()


def test_blocks_shared_with_another_programs_history_stay_at_the_source():
    a, _ = engine()
    b, _ = engine()
    system = list(range(100, 132))  # 2 blocks both programs start with
    run(a, "p0", system + list(range(300, 332)), "p")
    run(a, "q0", system + list(range(400, 432)), "q")
    move(a, b, "p")
    # q still keeps the shared head: kept at the source; p's own blocks are plain cache there
    assert [a.pool.cache.hash_of(x) is not None for x in a.pins.blocks_of("q")] == [True] * 4
    assert a.load().kept_blocks == 4 and a.pool.cache.num_kept == 4 and len(a.pool.cache) == 6
    a.check_integrity(), b.check_integrity()


def test_what_the_destination_holds_already_is_linked_not_copied_and_kept_once():
    a, _ = engine()
    b, _ = engine()
    prompt = list(range(100, 164))
    run(a, "t0", prompt, "p")
    run(b, "x", prompt[:32])  # b caches the first 2 blocks itself
    kv = a.export_program("p")
    linked = b.link_cached(list(kv.block_hashes))
    assert len(linked) == 2
    fresh = b.reserve_blocks(2)
    b.scatter_kv(fresh, a.gather_kv(list(kv.block_ids[2:])))
    b.import_program(kv, linked + fresh)
    a.end_export("p", moved=True)
    assert len(b.pins.blocks_of("p")) == 4 and len(b.pool.cache) == 4
    b.check_integrity(), a.check_integrity()


def test_a_program_in_use_cannot_move():
    a, _ = engine()
    run(a, "t0", range(100, 164), "p")
    a.add_request(EngineRequest("t1", tuple(range(100, 180)), SP, program_id="p"))
    a.step()  # the next turn holds the kept blocks now
    assert a.movable_programs() == [] and a.export_program("p") is None
