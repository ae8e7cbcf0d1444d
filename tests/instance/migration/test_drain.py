"""A role change's drain in one process (fake engines): the requests
decoding on an instance that becomes prefill move to instances that decode by
live migration with exactly their tokens; one that nobody takes stays and
decodes where it is; nothing leaks."""

from __future__ import annotations

import asyncio

from services.instance.engine import create_engine
from services.instance.engine.base import EngineConfig
from services.instance.engine.fake import fake_generate
from tests.instance.migration.harness import Client, Cluster


def fake(num_blocks=256, delay_ms=3.0):
    return create_engine(EngineConfig(engine="fake", num_blocks=num_blocks, block_size=16, token_delay_ms=delay_ms))


def prompt_of(n: int, k: int = 0) -> list[int]:
    return [97 + (i * 7 + k) % 26 for i in range(n)]


async def test_drain_moves_every_decoding_request_with_exact_tokens():
    c = Cluster()
    a, b, d = c.add("a", fake()), c.add("b", fake()), c.add("d", fake())
    try:
        prompts = [prompt_of(20 + 9 * i, i) for i in range(5)]
        clients = [Client(c, f"r{i}") for i in range(5)]
        tasks = [asyncio.create_task(cl.run("a", p, 150)) for cl, p in zip(clients, prompts)]
        for cl in clients:
            await cl.wait_tokens(3)
        result = await asyncio.wait_for(a.manager.drain([("b", "b"), ("d", "d")]), 30)
        assert sorted(result.moved) == [f"r{i}" for i in range(5)] and not result.stayed
        assert a.manager.decoding_here() == ([], 0)
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert outs == [fake_generate(p, 150) for p in prompts]
        assert {cl.path[-1] for cl in clients} == {"b", "d"}  # spread over the targets
        for node in (a, b, d):
            await node.check_clean()
    finally:
        await c.stop()


async def test_a_request_no_target_takes_stays_and_decodes_here():
    c = Cluster()
    a = c.add("a", fake())
    c.add("b", fake(num_blocks=3))  # a 60-token prompt needs 4 blocks
    try:
        cl = Client(c, "r")
        task = asyncio.create_task(cl.run("a", prompt_of(60), 100))
        await cl.wait_tokens(3)
        result = await asyncio.wait_for(a.manager.drain([("b", "b")]), 30)
        assert result.stayed == ["r"] and not result.moved
        assert await asyncio.wait_for(task, 30) == fake_generate(prompt_of(60), 100)
        assert cl.path == ["a"]
        for node in c.nodes.values():
            await node.check_clean()
    finally:
        await c.stop()


async def test_requests_planned_for_a_handoff_leave_by_their_handoff():
    c = Cluster()
    a, b = c.add("a", fake()), c.add("b", fake())
    try:
        cl = Client(c, "r")
        outs = await asyncio.gather(cl.run("a", prompt_of(40), 30, handoff="b"),
                                    a.manager.drain([("b", "b")]))
        assert outs[0] == fake_generate(prompt_of(40), 30) and cl.path == ["a", "b"]
        assert "r" not in outs[1].moved
        for node in (a, b):
            await node.check_clean()
    finally:
        await c.stop()
