"""Per-layer handoffs on the instance's path (Handoffs.plan and Handoffs.add
as Generate calls them, the MigrationManager, two nodes, fake engines whose
tokens are computed from what they read back from their KV caches): a prompt
at or above the node's threshold is handed off layer by layer while it
computes, with exactly the colocated tokens and both pools whole; the
handoff is an outgoing migration of the manager; any failure leaves the
request decoding at the prefill instance."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from libs.common.types import SamplingParams
from services.instance.engine import create_engine
from services.instance.engine.base import EngineBroken, EngineConfig, EngineError, EngineRequest
from services.instance.engine.fake import fake_generate
from services.instance.migration.layerwise import LayerwiseHandoff
from services.instance.migration.messages import PeerError
from tests.instance.migration.harness import CONFIG, Client, Cluster, HookedPeer
from tests.instance.migration.layerwise_harness import WatchedPeer

THRESHOLD = 64
LONG = [97 + (i * 7) % 26 for i in range(100)]  # per-layer: 7 blocks of 16, the last partial
SHORT = LONG[:40]  # serialized
N = 30


def fake(num_blocks=64):
    # A 24-token budget: the 100-token prompt takes 5 steps, so layers stream while it computes.
    return create_engine(EngineConfig(engine="fake", num_blocks=num_blocks, block_size=16, token_delay_ms=5.0,
                                      max_num_batched_tokens=24))


@pytest.fixture
async def pd():
    c = Cluster()
    c.add("p", fake(), config=dataclasses.replace(CONFIG, handoff_per_layer_threshold=THRESHOLD))
    c.add("d", fake())
    yield c
    await c.stop()


async def clean(c: Cluster) -> None:
    for node in c.nodes.values():
        await node.check_clean()


def counts(c: Cluster) -> tuple[int, int]:
    m = c.nodes["p"].manager.counters
    return m.handed_off, m.handoffs_aborted


def watch(c: Cluster, on_chunk) -> list[tuple[int | None, int]]:
    """Record (layer, the prefill engine's computed tokens) of each data chunk
    sent to d; ``on_chunk`` may raise to break the stream."""
    p = c.nodes["p"]
    seen = []

    def record(ch):
        if ch.data or ch.src_blocks:  # bytes, or blocks of p's shared cache
            r = p.engine.requests.get("r")
            seen.append((ch.layer, r.num_computed_tokens if r else -1))
        on_chunk(seen)

    c.peer_wrappers["d"] = lambda peer: WatchedPeer(peer, record)
    return seen


async def test_long_prompt_streams_layers_while_it_computes_with_the_colocated_tokens(pd):
    # Both caches cold: the prompt computes in 5 chunks at p, and d links nothing (test_prefix_migration.py)
    colocated = fake_generate(LONG, N)
    seen = watch(pd, lambda _: None)
    p = pd.nodes["p"]
    cl = Client(pd, "r")
    task = asyncio.create_task(cl.run("p", LONG, N, handoff="d"))
    await _until(lambda: "r" in p.manager.outgoing)
    mig = p.manager.outgoing["r"]
    assert isinstance(mig, LayerwiseHandoff) and "r" not in p.manager.handoffs.plans
    assert p.manager.can_start("d")  # a handoff takes no load-balancing slot
    assert await asyncio.wait_for(task, 30) == colocated
    assert cl.path == ["p", "d"] and cl.moved_at == [1]  # the first token came from p
    assert {layer for layer, _ in seen} == {0} and len(seen) == 5  # one per prompt chunk
    assert seen[0][1] < len(LONG)  # the first layer went while the prompt still computed
    assert counts(pd) == (1, 0) and mig.out.committed and mig.out.blocks == 7
    await clean(pd)


async def test_short_prompt_below_the_threshold_hands_off_serialized(pd):
    seen = watch(pd, lambda _: None)
    cl = Client(pd, "r")
    assert await asyncio.wait_for(cl.run("p", SHORT, N, handoff="d"), 30) == fake_generate(SHORT, N)
    assert cl.path == ["p", "d"] and cl.moved_at == [1]
    assert seen == [(None, len(SHORT))]  # whole blocks in one chunk, once the prompt was done
    assert counts(pd) == (1, 0)
    await clean(pd)


async def test_an_engine_without_layer_taps_hands_long_prompts_off_serialized(pd):
    p = pd.nodes["p"]
    p.engine.executor.layer_taps = False
    seen = watch(pd, lambda _: None)
    cl = Client(pd, "r")
    assert await asyncio.wait_for(cl.run("p", LONG, N, handoff="d"), 30) == fake_generate(LONG, N)
    assert cl.path == ["p", "d"] and seen == [(None, len(LONG))]
    p.engine.executor.layer_taps = True
    await clean(pd)


async def test_many_long_prompts_hand_off_together(pd):
    prompts = [LONG[:THRESHOLD + 9 * i] for i in range(5)]
    clients = [Client(pd, f"r{i}") for i in range(5)]
    outs = await asyncio.wait_for(asyncio.gather(*[
        cl.run("p", pr, 12, handoff="d") for cl, pr in zip(clients, prompts)]), 60)
    assert outs == [fake_generate(pr, 12) for pr in prompts]
    assert all(cl.path == ["p", "d"] for cl in clients)
    assert counts(pd) == (5, 0)
    await clean(pd)


@pytest.mark.parametrize("at", [1, 3])
async def test_destination_fails_mid_stream_the_request_decodes_at_the_prefill_instance(pd, at):
    def break_at(seen):
        if len(seen) == at:
            raise PeerError("UNAVAILABLE: decode instance went away")

    seen = watch(pd, break_at)
    cl = Client(pd, "r")
    assert await asyncio.wait_for(cl.run("p", LONG, N, handoff="d"), 30) == fake_generate(LONG, N)
    assert cl.path == ["p"] and len(seen) == at
    assert counts(pd) == (0, 1)
    await clean(pd)


@pytest.mark.parametrize("call", ["pre_allocate", "commit"])
async def test_decode_instance_unreachable_the_request_decodes_at_the_prefill_instance(pd, call):
    async def die():
        raise PeerError("UNAVAILABLE: decode instance gone")

    pd.peer_wrappers["d"] = lambda p: HookedPeer(p, before={call: die})
    cl = Client(pd, "r")
    assert await asyncio.wait_for(cl.run("p", LONG, N, handoff="d"), 30) == fake_generate(LONG, N)
    assert cl.path == ["p"] and counts(pd) == (0, 1)
    await clean(pd)


async def test_destination_full_refuses_and_the_request_decodes_at_the_prefill_instance():
    c = Cluster()
    c.add("p", fake(), config=dataclasses.replace(CONFIG, handoff_per_layer_threshold=THRESHOLD))
    c.add("d", fake(num_blocks=4))  # the prompt needs 7 blocks
    try:
        cl = Client(c, "r")
        assert await asyncio.wait_for(cl.run("p", LONG, N, handoff="d"), 30) == fake_generate(LONG, N)
        assert cl.path == ["p"] and counts(c) == (0, 1)
        await clean(c)
    finally:
        await c.stop()


async def test_in_flight_handoff_is_outgoing_drain_ignores_it_and_close_aborts_it(pd):
    """While it streams the request is leaving: neither a migrate-out order
    nor a drain chooses it; stopping the manager aborts the handoff and the
    request finishes at the prefill instance with d's blocks freed."""
    p = pd.nodes["p"]
    closing = []

    def close_on_second_chunk(seen):
        if len(seen) == 2 and not closing:
            assert "r" not in [r.request_id for r in p.manager.order_status().requests]
            assert "r" not in p.manager.decoding_here()[0]
            closing.append(asyncio.ensure_future(p.manager.close()))

    watch(pd, close_on_second_chunk)
    cl = Client(pd, "r")
    assert await asyncio.wait_for(cl.run("p", LONG, N, handoff="d"), 30) == fake_generate(LONG, N)
    await asyncio.wait_for(closing[0], 10)
    assert cl.path == ["p"] and not p.manager.outgoing
    await clean(pd)


async def test_request_the_engine_refuses_fails_its_add_and_leaves_nothing(pd):
    p = pd.nodes["p"]
    plan = p.manager.handoffs.plan("r", "d", "d", 2000)
    too_long = EngineRequest("r", tuple(LONG * 20), SamplingParams(max_tokens=5, ignore_eos=True))
    with pytest.raises(EngineError):
        await asyncio.wait_for(p.manager.handoffs.add(too_long, plan), 10)
    await _until(lambda: not p.manager.outgoing and not p.manager.handoffs.running)
    assert not p.manager.handoffs.plans and counts(pd) == (0, 0)
    await clean(pd)


async def test_manager_closed_before_the_handoff_ran_fails_the_add_and_leaves_nothing(pd):
    """The instance stops between Generate's add and the handoff's first
    step: the request never reached the engine, and the add says so (the
    client gets UNAVAILABLE and resumes elsewhere) instead of waiting."""
    p = pd.nodes["p"]
    plan = p.manager.handoffs.plan("r", "d", "d", len(LONG))
    req = EngineRequest("r", tuple(LONG), SamplingParams(max_tokens=5, ignore_eos=True))
    add = asyncio.create_task(p.manager.handoffs.add(req, plan))
    close = asyncio.create_task(p.manager.close())
    with pytest.raises(EngineBroken, match="before the request was added"):
        await asyncio.wait_for(add, 10)
    await asyncio.wait_for(close, 10)
    assert await p.runner.call(p.engine.request_phase, "r") is None
    assert not p.manager.outgoing
    await clean(pd)


async def test_a_prompt_whose_prefix_is_cached_hands_the_hit_blocks_over_with_its_first_chunk(pd):
    """p's prefix cache holds LONG's first 6 blocks: the prompt computes only
    its last 4 tokens, in one chunk, and that chunk's layer hands over the 6
    hit blocks too (the destination never saw them computed)."""
    colocated = await asyncio.wait_for(Client(pd, "ref").run("p", LONG, N), 30)
    seen = watch(pd, lambda _: None)
    cl = Client(pd, "r")
    assert await asyncio.wait_for(cl.run("p", LONG, N, handoff="d"), 30) == colocated == fake_generate(LONG, N)
    assert cl.path == ["p", "d"] and counts(pd) == (1, 0)
    assert seen == [(0, 96)]  # one chunk, sent when the hit was in place
    assert pd.nodes["p"].engine.load().prefix_cache.hits == 96
    await clean(pd)


async def _until(cond, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.002)
