"""Live migration with prefix caching (in-process instances, fake engines):
a request whose blocks are shared at the source leaves them to the others,
its full blocks are named at the destination as if computed there, and the
destination's pre-allocation reply says which block hashes it held already."""

from __future__ import annotations

import asyncio

from services.instance.engine import create_engine
from services.instance.engine.base import EngineConfig
from services.instance.engine.fake import fake_generate
from tests.instance.migration.harness import Client, Cluster, order

SHARED = [97 + (i * 7) % 26 for i in range(64)]  # 4 full blocks of 16
X = SHARED + [97 + (i * 3) % 26 for i in range(20)]
Y = SHARED + [97 + (i * 5) % 26 for i in range(30)]


def fake():
    return create_engine(EngineConfig(engine="fake", num_blocks=128, block_size=16, token_delay_ms=2.0))


async def test_shared_blocks_stay_at_the_source_and_are_named_at_the_destination():
    c = Cluster()
    c.add("a", fake())
    c.add("b", fake())
    try:
        x = Client(c, "x")
        tx = asyncio.create_task(x.run("a", X, 150))
        await x.wait_tokens(3)
        y = Client(c, "y")
        ty = asyncio.create_task(y.run("a", Y, 150))
        await y.wait_tokens(3)
        a, b = c.nodes["a"].engine, c.nodes["b"].engine
        assert a.load().shared_blocks == 4  # y hit x's prefix
        res = await c.nodes["a"].manager.migrate_out(order("b", "y"))
        assert res.committed == 1 and res.results[0].held_blocks == 0
        await y.wait_tokens(len(y.tokens) + 2)
        # y's full blocks were named at b when it was installed
        assert set(b.block_hashes("y")[:4]) <= set(b.cached_hashes())
        assert a.load().shared_blocks == 0 and a.requests["x"].num_cached_blocks >= 4
        res = await c.nodes["a"].manager.migrate_out(order("b", "x"))
        assert res.committed == 1 and res.results[0].held_blocks == 4  # b held the shared prefix
        assert await asyncio.wait_for(tx, 30) == fake_generate(X, 150)
        assert await asyncio.wait_for(ty, 30) == fake_generate(Y, 150)
        assert x.path == y.path == ["a", "b"]
        for node in c.nodes.values():
            await node.check_clean()
    finally:
        await c.stop()


async def test_a_prefill_instances_cache_serves_later_prompts():
    """Splitwise: a handed-off request's blocks stay cached at the prefill
    instance (dropped there after the commit, not lost): the next prompt with
    the same prefix hits them; both decode elsewhere with exact tokens."""
    c = Cluster()
    c.add("p", fake())
    c.add("d", fake())
    try:
        first = Client(c, "first")
        assert await asyncio.wait_for(first.run("p", X, 20, handoff="d"), 30) == fake_generate(X, 20)
        second = Client(c, "second")
        assert await asyncio.wait_for(second.run("p", Y, 20, handoff="d"), 30) == fake_generate(Y, 20)
        assert first.path == second.path == ["p", "d"]
        pc = c.nodes["p"].engine.load().prefix_cache
        assert pc.hits == 64 and pc.requests == 2  # the shared prefix, from the first request's blocks
        for node in c.nodes.values():
            await node.check_clean()
    finally:
        await c.stop()
