"""Live migration with prefix caching (in-process instances, fake engines):
a request whose blocks are shared at the source leaves them to the others,
its full blocks are named at the destination as if computed there, and the
destination links the blocks of the request's prefix that its cache holds
already instead of receiving them (the fake engine reads its KV back: a
wrong block changes the tokens)."""

from __future__ import annotations

import asyncio

from services.instance.engine import create_engine
from services.instance.engine.base import EngineConfig
from dataclasses import replace

import pytest

from services.instance.engine.fake import fake_generate
from services.instance.migration.messages import MigrationAborted
from tests.instance.migration.harness import CONFIG, Client, Cluster, HookedPeer, order

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
        out = res.results[0]
        assert res.committed == 1 and out.held_blocks == 4 and out.linked_blocks == 4  # b held the shared prefix
        # x's first 4 blocks at b are y's there (linked, referenced twice); only the rest was sent
        bx, by = await b_blocks(c, "x"), await b_blocks(c, "y")
        assert bx[:4] == by[:4] and not set(bx[4:]) & set(by)
        assert out.blocks + 4 == await blocks_at_the_move(x)
        assert out.bytes == out.blocks * b.kv_layout.bytes_per_block
        assert b.load().shared_blocks == 4
        assert await asyncio.wait_for(tx, 30) == fake_generate(X, 150)
        assert await asyncio.wait_for(ty, 30) == fake_generate(Y, 150)
        assert x.path == y.path == ["a", "b"]
        for node in c.nodes.values():
            await node.check_clean()
    finally:
        await c.stop()


async def b_blocks(c: Cluster, rid: str) -> list[int]:
    node = c.nodes["b"]
    return await node.runner.call(lambda: list(node.engine.requests[rid].block_ids))


async def blocks_at_the_move(client: Client) -> int:
    """The request's blocks when it was suspended: its prompt and the tokens
    it had then, all but the last computed."""
    while not client.moved_at:
        await asyncio.sleep(0.002)
    return -(-(len(X) + client.moved_at[0] - 1) // 16)


async def _x_and_y_at(c: Cluster, where: str) -> tuple[Client, asyncio.Task, Client, asyncio.Task]:
    x, y = Client(c, "x"), Client(c, "y")
    tx = asyncio.create_task(x.run(where, X, 200))
    await x.wait_tokens(3)
    ty = asyncio.create_task(y.run("b" if where == "a" else "a", Y, 200))
    await y.wait_tokens(3)
    return x, tx, y, ty


async def test_without_linking_every_block_is_sent():
    """MigrationConfig.link_cached off: the prefix is held at b, but sent."""
    c = Cluster()
    c.add("a", fake(), replace(CONFIG, link_cached=False))
    c.add("b", fake())
    try:
        x, tx, y, ty = await _x_and_y_at(c, "a")  # y at b: b caches the shared prefix
        res = await c.nodes["a"].manager.migrate_out(order("b", "x"))
        out = res.results[0]
        assert res.committed == 1 and out.held_blocks == 4 and out.linked_blocks == 0
        bx, by = await b_blocks(c, "x"), await b_blocks(c, "y")
        assert not set(bx) & set(by) and out.blocks == await blocks_at_the_move(x)
        assert await asyncio.wait_for(tx, 30) == fake_generate(X, 200)
        assert await asyncio.wait_for(ty, 30) == fake_generate(Y, 200)
        for node in c.nodes.values():
            await node.check_clean()
    finally:
        await c.stop()


@pytest.mark.parametrize("call", ["transfer", "commit"])
async def test_an_aborted_migration_gives_its_linked_blocks_back(call):
    """The transfer or the commit fails after the destination linked the
    prefix: the abort drops the links (the blocks stay cached, y's), the
    request goes on at the source, and nothing leaks at either end."""
    c = Cluster()
    c.add("a", fake())
    c.add("b", fake())

    async def fail():
        raise MigrationAborted("injected")

    c.peer_wrappers["b"] = lambda p: HookedPeer(p, before={call: fail})
    try:
        x, tx, y, ty = await _x_and_y_at(c, "a")
        b = c.nodes["b"].engine
        res = await c.nodes["a"].manager.migrate_out(order("b", "x"))
        assert res.committed == 0 and res.aborted == 1 and res.results[0].linked_blocks == 4
        assert await asyncio.wait_for(tx, 30) == fake_generate(X, 200)
        assert await asyncio.wait_for(ty, 30) == fake_generate(Y, 200)
        assert x.path == ["a"]
        for node in c.nodes.values():
            await node.check_clean()
        assert await c.nodes["b"].runner.call(lambda: b.pool.num_linked) == 0
    finally:
        await c.stop()


@pytest.mark.parametrize("per_layer_threshold", [0, 1], ids=["serialized", "per_layer"])
async def test_a_prefill_instances_cache_serves_later_prompts(per_layer_threshold):
    """Splitwise: a handed-off request's blocks stay cached at the prefill
    instance (dropped there after the commit, not lost): the next prompt with
    the same prefix hits them; both decode elsewhere with exact tokens. The
    decode instance links the prefix it holds already: the second handoff
    sends only the rest, serialized or per layer (whose layers of the linked
    blocks are not sent either)."""
    c = Cluster()
    c.add("p", fake(), config=replace(CONFIG, handoff_per_layer_threshold=per_layer_threshold))
    c.add("d", fake())
    try:
        first = Client(c, "first")
        assert await asyncio.wait_for(first.run("p", X, 20, handoff="d"), 30) == fake_generate(X, 20)
        counters = c.nodes["p"].manager.counters
        assert counters.blocks_linked == 0 and counters.blocks_sent == 6  # 84 tokens: 5 full blocks and a partial
        second = Client(c, "second")
        assert await asyncio.wait_for(second.run("p", Y, 20, handoff="d"), 30) == fake_generate(Y, 20)
        assert first.path == second.path == ["p", "d"]
        # d holds the shared prefix (the first request's blocks, cached): the second hands over only the rest
        assert counters.blocks_linked == 4 and counters.blocks_sent == 6 + 2  # 94 tokens: 6 blocks, 4 linked
        if per_layer_threshold:  # the bytes too: 8 blocks' layers, no more
            layout = c.nodes["p"].engine.kv_layout
            assert counters.bytes_sent == 8 * layout.bytes_per_block
        pc = c.nodes["p"].engine.load().prefix_cache
        assert pc.hits == 64 and pc.requests == 2  # the shared prefix, from the first request's blocks
        for node in c.nodes.values():
            await node.check_clean()
    finally:
        await c.stop()


class _ForeignHashes:
    """A source (buggy or hostile) that names another prompt's blocks at its first pre-allocation."""

    def __init__(self, inner, hashes):
        self.inner, self.hashes = inner, hashes

    async def pre_allocate(self, p):
        if p.block_hashes:
            p = replace(p, block_hashes=tuple(self.hashes[:len(p.block_hashes)]))
        return await self.inner.pre_allocate(p)

    def __getattr__(self, name):
        return getattr(self.inner, name)


async def test_linked_blocks_that_are_not_the_requests_prefix_fail_the_commit():
    """b links what the source named, then the commit checks the names
    against the request's own tokens: another prompt's blocks are refused
    (INVALID_ARGUMENT), the migration aborts, x goes on at a, nothing leaks."""
    other = [97 + (i * 11) % 26 for i in range(80)]
    c = Cluster()
    c.add("a", fake())
    c.add("b", fake())
    try:
        z = Client(c, "z")
        tz = asyncio.create_task(z.run("b", other, 200))
        await z.wait_tokens(3)
        b = c.nodes["b"].engine
        foreign = await c.nodes["b"].runner.call(lambda: b.block_hashes("z"))
        c.peer_wrappers["b"] = lambda p: _ForeignHashes(p, foreign)
        x = Client(c, "x")
        tx = asyncio.create_task(x.run("a", X, 200))
        await x.wait_tokens(3)
        res = await c.nodes["a"].manager.migrate_out(order("b", "x"))
        out = res.results[0]
        assert res.committed == 0 and out.linked_blocks == 5 and "linked blocks" in out.reason  # 80 tokens: 5 blocks
        assert await asyncio.wait_for(tx, 30) == fake_generate(X, 200)
        assert await asyncio.wait_for(tz, 30) == fake_generate(other, 200)
        assert x.path == ["a"]
        for node in c.nodes.values():
            await node.check_clean()
    finally:
        await c.stop()
