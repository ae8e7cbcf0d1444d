"""Cache moves (services/instance/migration/cache_move.py; issue 53, move
instead of evict): a program's kept blocks, with no request attached, go to
another instance's prefix cache on the migration protocol, between
in-process instances with fake engines (which read their KV back: a wrong
block changes the tokens). The program's next turn there finds its whole
history cached and gives the tokens it gives with no cache at all; an order
moves the programs worth least first until it has moved what it was asked;
a refusal, a destination that fails mid-copy and a lost commit reply leave
no block leaked or counted twice, and the blocks in at least one cache."""

from __future__ import annotations

import asyncio

import pytest

from services.instance.engine import create_engine
from services.instance.engine.base import EngineConfig
from services.instance.engine.fake import fake_generate
from services.instance.migration.messages import PeerError
from tests.instance.migration.harness import Client, Cluster, HookedPeer, order

HISTORY = [97 + (i * 7) % 26 for i in range(64)]  # 4 full blocks of 16


def fake(keep: float = 0.5, blocks: int = 64):
    return create_engine(EngineConfig(engine="fake", num_blocks=blocks, block_size=16, token_delay_ms=1.0,
                                      program_keep=keep, program_gap_s=30.0))


async def turn(c: Cluster, rid: str, node: str, prompt: list[int], program: str, n: int = 8) -> list[int]:
    return await asyncio.wait_for(Client(c, rid).run(node, prompt, n, program_id=program), 30)


def hits(node) -> int:
    return node.engine.pool.cache.stats.hits


@pytest.fixture
async def cluster():
    c = Cluster()
    yield c
    await c.stop()


async def test_a_moved_program_continues_there_on_its_cached_history_with_exact_tokens(cluster):
    c = cluster
    a, b = c.add("a", fake()), c.add("b", fake())
    out = await turn(c, "t0", "a", HISTORY, "p")
    assert out == fake_generate(HISTORY, 8)
    assert a.engine.load().kept_blocks == 4
    res = await a.manager.migrate_out(order("b", cache_blocks=4))
    assert (res.started, res.committed) == (1, 1)
    mv = res.results[0]
    assert mv.request_id == "program:p" and mv.blocks == 4 and mv.linked_blocks == 0
    assert mv.bytes == 4 * a.engine.kv_layout.bytes_per_block
    assert a.engine.load().kept_blocks == 0 and a.engine.pool.cache.num_kept == 0  # plain cache there now
    assert b.engine.load().kept_blocks == 4 and len(b.engine.pins.blocks_of("p")) == 4
    assert a.manager.counters.cache_moved_out == 1 and b.manager.counters.cache_moved_in == 1
    nxt = HISTORY + out + [97 + (i * 11) % 26 for i in range(20)]
    assert await turn(c, "t1", "b", nxt, "p") == fake_generate(nxt, 8)
    assert hits(b) == 64  # its four full blocks, none recomputed
    await a.check_clean()
    await b.check_clean()


async def test_an_order_moves_the_programs_worth_least_until_it_moved_enough(cluster):
    c = cluster
    a, b = c.add("a", fake()), c.add("b", fake())
    for i, p in enumerate(("p", "q", "r")):
        await turn(c, f"{p}0", "a", [97 + (j * (i + 3)) % 26 for j in range(48)] + [97 + i] * 16, p)
    first = [p for p, _ in await a.runner.call(a.engine.movable_programs)]
    assert sorted(first) == ["p", "q", "r"]
    res = await a.manager.migrate_out(order("b", cache_blocks=5))  # two programs of 4 blocks each
    assert res.committed == 2
    assert [o.request_id for o in res.results] == [f"program:{p}" for p in first[:2]]
    assert [p for p in first if b.engine.pins.blocks_of(p)] == first[:2]
    assert [p for p in first if a.engine.pins.blocks_of(p)] == first[2:]
    await a.check_clean()
    await b.check_clean()


async def test_a_destination_that_keeps_nothing_refuses_and_the_blocks_stay(cluster):
    c = cluster
    a, b = c.add("a", fake()), c.add("b", fake(keep=0.0))
    await turn(c, "t0", "a", HISTORY, "p")
    res = await a.manager.migrate_out(order("b", cache_blocks=4))
    assert res.committed == 0 and res.aborted == 1 and "keeps no programs" in res.results[0].reason
    assert a.engine.load().kept_blocks == 4 and len(b.engine.pool.cache) == 0
    await a.check_clean()
    await b.check_clean()


async def test_a_destination_failing_mid_copy_frees_its_reservation_and_the_source_keeps_them(cluster):
    c = cluster
    a, b = c.add("a", fake()), c.add("b", fake())

    async def fail():
        raise PeerError("UNAVAILABLE: destination gone mid-copy")
    c.peer_wrappers["b"] = lambda p: HookedPeer(p, before={"transfer": fail})
    await turn(c, "t0", "a", HISTORY, "p")
    res = await a.manager.migrate_out(order("b", cache_blocks=4))
    assert res.aborted == 1
    assert a.engine.load().kept_blocks == 4 and len(a.engine.pins.blocks_of("p")) == 4
    await a.check_clean()
    await b.check_clean()  # its reservation freed (the abort, else its deadline)
    assert len(b.engine.pool.cache) == 0


async def test_a_lost_commit_reply_leaves_a_copy_in_both_caches_and_none_leaked(cluster):
    c = cluster
    a, b = c.add("a", fake()), c.add("b", fake())
    c.peer_wrappers["b"] = lambda p: HookedPeer(p, lose={"commit_cache"})
    out = await turn(c, "t0", "a", HISTORY, "p")
    res = await a.manager.migrate_out(order("b", cache_blocks=4))
    assert res.aborted == 1
    assert a.engine.load().kept_blocks == 4 and b.engine.load().kept_blocks == 4
    await a.check_clean()
    await b.check_clean()
    nxt = HISTORY + out + [98] * 20
    assert await turn(c, "t1", "b", nxt, "p") == fake_generate(nxt, 8)
    assert hits(b) == 64


async def test_what_the_destination_caches_already_is_linked_not_sent(cluster):
    c = cluster
    a, b = c.add("a", fake()), c.add("b", fake())
    out = await turn(c, "t0", "a", HISTORY, "p")
    await turn(c, "x", "b", HISTORY[:32], "")  # b caches the first two blocks itself
    res = await a.manager.migrate_out(order("b", cache_blocks=4))
    mv = res.results[0]
    assert mv.committed and mv.linked_blocks == 2 and mv.blocks == 2
    assert len(b.engine.pool.cache) == 4 and len(b.engine.pins.blocks_of("p")) == 4
    nxt = HISTORY + out + [99] * 20
    assert await turn(c, "t1", "b", nxt, "p") == fake_generate(nxt, 8)
    await a.check_clean()
    await b.check_clean()


async def test_a_cache_move_holds_no_step_boundary_at_the_destination(cluster):
    """No request joins the destination's batch: it keeps stepping (no join
    hold, which a migration's last stage takes), and expects no context."""
    c = cluster
    a, b = c.add("a", fake()), c.add("b", fake())
    assert b.manager.dest.join_hold_s > 0
    held, expected = [], []
    b.runner.hold = lambda key, seconds: held.append(key)
    b.engine.expect_context = lambda n: expected.append(n)
    await turn(c, "t0", "a", HISTORY, "p")
    res = await a.manager.migrate_out(order("b", cache_blocks=4))
    assert res.committed == 1 and held == [] and expected == []
    await a.check_clean()
    await b.check_clean()
