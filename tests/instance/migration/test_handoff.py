"""Splitwise's prefill->decode handoff in one process (fake engines, whose
tokens are computed from what they read back from their KV caches, so a
broken transfer changes the output): the request's tokens equal a colocated
run's, it decodes nowhere on the prefill instance when the handoff commits,
it decodes there when the handoff fails at any point, and no block leaks on
either side."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from services.instance.engine import create_engine
from services.instance.engine.base import EngineConfig
from services.instance.engine.fake import fake_generate
from services.instance.migration.messages import PeerError
from services.instance.migration.states import SourceState
from tests.instance.migration.harness import CONFIG, Client, Cluster, HookedPeer


def fake(num_blocks=256, delay_ms=2.0):
    return create_engine(EngineConfig(engine="fake", num_blocks=num_blocks, block_size=16, token_delay_ms=delay_ms))


def prompt_of(n: int) -> list[int]:
    return [97 + (i * 7) % 26 for i in range(n)]


@pytest.fixture
async def pd():
    c = Cluster()
    c.add("p", fake())
    c.add("d", fake())
    yield c
    await c.stop()


async def clean(c: Cluster) -> None:
    for node in c.nodes.values():
        await node.check_clean()


def handoffs(node) -> tuple[int, int]:
    m = node.manager.counters
    return m.handed_off, m.handoffs_aborted


# Prompt lengths around block boundaries: the partial last block goes too.
@pytest.mark.parametrize("n_prompt", [1, 15, 16, 17, 100])
async def test_handoff_tokens_equal_the_colocated_run(pd, n_prompt):
    prompt = prompt_of(n_prompt)
    colocated = await asyncio.wait_for(Client(pd, "ref").run("p", prompt, 30), 30)
    assert colocated == fake_generate(prompt, 30)
    cl = Client(pd, "r")
    assert await asyncio.wait_for(cl.run("p", prompt, 30, handoff="d"), 30) == colocated
    assert cl.path == ["p", "d"]
    assert cl.moved_at == [1]  # the prefill instance emitted the first token only
    assert handoffs(pd.nodes["p"]) == (1, 0)
    await clean(pd)


async def test_many_prompts_hand_off_together_past_the_migrate_in_limit(pd):
    """A burst of prompts finishing in one step hands off at once: handoffs
    are not load-balancing migrations (max_migrate_in does not bound them)."""
    prompts = [prompt_of(20 + i) for i in range(8)]
    clients = [Client(pd, f"r{i}") for i in range(8)]
    outs = await asyncio.wait_for(asyncio.gather(*[
        cl.run("p", pr, 20, handoff="d") for cl, pr in zip(clients, prompts)]), 60)
    assert outs == [fake_generate(pr, 20) for pr in prompts]
    assert all(cl.path == ["p", "d"] for cl in clients)
    await clean(pd)


async def test_one_token_request_has_nothing_to_hand_off(pd):
    cl = Client(pd, "r")
    assert await cl.run("p", prompt_of(40), 1, handoff="d") == fake_generate(prompt_of(40), 1)
    assert cl.path == ["p"] and not pd.nodes["p"].manager.handoffs.plans
    await clean(pd)


async def test_seeded_sampling_state_moves_with_the_request(pd):
    # The fake engine samples nothing, but the state (seeded sampling, counters)
    # goes through the same commit: the request counts one migration.
    prompt = prompt_of(33)
    cl = Client(pd, "r")
    await cl.run("p", prompt, 12, handoff="d", temperature=0.7, seed=3)
    assert cl.tokens == fake_generate(prompt, 12)


async def test_destination_full_refuses_and_the_request_decodes_where_it_is():
    c = Cluster()
    c.add("p", fake())
    c.add("d", fake(num_blocks=4))  # 100 prompt tokens need 7 blocks
    try:
        cl = Client(c, "r")
        prompt = prompt_of(100)
        assert await asyncio.wait_for(cl.run("p", prompt, 30, handoff="d"), 30) == fake_generate(prompt, 30)
        assert cl.path == ["p"]
        assert handoffs(c.nodes["p"]) == (0, 1)
        await clean(c)
    finally:
        await c.stop()


async def test_handoff_limit_at_the_destination_refuses_the_rest():
    c = Cluster()
    c.add("p", fake())
    c.add("d", fake(), config=dataclasses.replace(CONFIG, max_handoff_in=1))
    try:
        gate = asyncio.Event()

        async def hold():
            await gate.wait()

        c.peer_wrappers["d"] = lambda p: HookedPeer(p, before={"transfer": hold})
        clients = [Client(c, f"r{i}") for i in range(3)]
        tasks = [asyncio.create_task(cl.run("p", prompt_of(30), 20, handoff="d")) for cl in clients]
        await asyncio.wait_for(_until(lambda: sum(handoffs(c.nodes["p"])) >= 2), 10)  # two refused
        gate.set()
        assert await asyncio.wait_for(asyncio.gather(*tasks), 30) == [fake_generate(prompt_of(30), 20)] * 3
        assert sorted(len(cl.path) for cl in clients) == [1, 1, 2]
        await clean(c)
    finally:
        await c.stop()


@pytest.mark.parametrize("call", ["pre_allocate", "transfer", "commit"])
async def test_decode_instance_unreachable_mid_handoff(pd, call):
    """The decode instance dies at each call (its reservation, if any, runs
    out its deadline): the request decodes on the prefill instance with the
    same tokens, and both pools end whole."""
    async def die():
        raise PeerError("UNAVAILABLE: decode instance gone")

    pd.peer_wrappers["d"] = lambda p: HookedPeer(p, before={call: die})
    prompt = prompt_of(70)
    cl = Client(pd, "r")
    assert await asyncio.wait_for(cl.run("p", prompt, 30, handoff="d"), 30) == fake_generate(prompt, 30)
    assert cl.path == ["p"]
    assert handoffs(pd.nodes["p"]) == (0, 1)
    await clean(pd)


async def test_commit_reply_lost_the_request_stays_at_the_prefill_instance(pd):
    """The decode instance took the request but its reply never came: the
    source aborts; the destination drops its unattached copy."""
    pd.peer_wrappers["d"] = lambda p: HookedPeer(p, lose={"commit"})
    prompt = prompt_of(50)
    cl = Client(pd, "r")
    assert await asyncio.wait_for(cl.run("p", prompt, 30, handoff="d"), 30) == fake_generate(prompt, 30)
    assert cl.path == ["p"]
    await clean(pd)


@pytest.mark.parametrize("state", [SourceState.SUSPEND, SourceState.PRE_ALLOC_LAST, SourceState.COPY_LAST])
async def test_prefill_side_cancelled_at_each_state(pd, state):
    """The prefill instance stops its handoff at each state before the commit
    (the instance is stopping): the request resumes there, the decode
    instance frees what it reserved."""
    p = pd.nodes["p"]
    p.faults[f"source.{state.value}"] = lambda: asyncio.current_task().cancel()
    prompt = prompt_of(60)
    cl = Client(pd, "r")
    assert await asyncio.wait_for(cl.run("p", prompt, 30, handoff="d"), 30) == fake_generate(prompt, 30)
    assert cl.path == ["p"]
    await clean(pd)


async def test_client_gone_while_held_frees_everything(pd):
    """The client leaves while the request is held for its handoff: the abort
    frees its blocks at the prefill instance and the handoff aborts."""
    gate = asyncio.Event()

    async def hold():
        await gate.wait()

    pd.peer_wrappers["d"] = lambda p: HookedPeer(p, before={"pre_allocate": hold})
    p = pd.nodes["p"]
    cl = Client(pd, "r")
    task = asyncio.create_task(cl.run("p", prompt_of(50), 30, handoff="d"))
    await cl.wait_tokens(1)
    await _until(lambda: "r" in p.manager.outgoing)
    assert await p.runner.call(p.engine.request_phase, "r") == ("suspended", 0)
    assert await p.runner.call(p.engine.abort_request, "r")
    p.host.end_stream("r", "abort")
    gate.set()
    await asyncio.wait_for(task, 10)
    assert cl.finish_reason == "abort" and cl.tokens == fake_generate(prompt_of(50), 1)
    await clean(pd)


async def _until(cond, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def test_a_serialized_handoff_does_not_wait_for_the_next_prefill_step():
    """The request is exported where the engine held it (Handoffs.at_boundary),
    so its handoff commits while the prefill instance's next step (1 s here,
    another request keeps it busy) is still running: it used to wait for
    that step's end before its last stage could start."""
    c = Cluster()
    p = c.add("p", fake(delay_ms=1000.0))
    c.add("d", fake())
    at_commit = []

    async def commit():
        at_commit.append(p.runner.steps)

    c.peer_wrappers["d"] = lambda peer: HookedPeer(peer, before={"commit": commit})
    try:
        busy = Client(c, "busy")
        busy_task = asyncio.create_task(busy.run("p", prompt_of(20), 6))
        await busy.wait_tokens(1, timeout_s=30)
        cl = Client(c, "r")
        task = asyncio.create_task(cl.run("p", prompt_of(50), 8, handoff="d"))
        await cl.wait_tokens(1, timeout_s=30)
        at_first = p.runner.steps
        assert await asyncio.wait_for(task, 30) == fake_generate(prompt_of(50), 8)
        assert cl.path == ["p", "d"]
        assert at_commit == [at_first]  # no prefill step ended between the first token and the commit
        await asyncio.wait_for(busy_task, 30)
        await clean(c)
    finally:
        await c.stop()


async def test_a_destination_that_became_prefill_refuses(pd):
    """The decode instance's role changed after the dispatch chose it: it
    refuses, and the request decodes where it prefilled."""
    pd.nodes["d"].host.decodes = lambda: False
    cl = Client(pd, "r")
    assert await asyncio.wait_for(cl.run("p", prompt_of(40), 20, handoff="d"), 30) == fake_generate(prompt_of(40), 20)
    assert cl.path == ["p"] and handoffs(pd.nodes["p"]) == (0, 1)
    await clean(pd)
