"""The in-process cluster's Client (ferry/inprocess.py)
reads with the frontend's loop (run_generation) and still checks delivery
strictly: events pushed by hand onto the nodes' streams, each fault one the
frontend's loop alone would raise on (a gap) or let pass (a repeat, a move
at another index), and a move to a node with nothing to attach to."""

from __future__ import annotations

import asyncio

import pytest

from services.instance.engine import create_engine
from services.instance.engine.base import EngineConfig
from services.instance.streams import Event
from tests.instance.migration.harness import Client, Cluster


@pytest.fixture
async def two():
    c = Cluster()
    for name in "ab":
        c.add(name, create_engine(EngineConfig(engine="fake", num_blocks=16, block_size=16)))
    yield c
    await c.stop()


def push(c: Cluster, node: str, *events: Event) -> None:
    """Open request r's stream at ``node`` with these events on it."""
    stream = c.nodes[node].streams.open("r")
    for ev in events:
        stream.push(ev)


async def follow(c: Cluster) -> Client:
    cl = Client(c, "r")
    await asyncio.wait_for(cl.follow("a"), 5)
    return cl


async def test_a_move_is_followed_with_the_path_and_its_index(two):
    push(two, "b", Event(2, 7), Event(3, 8, "length"))
    push(two, "a", Event(0, 5), Event(1, 6), Event(2, moved_to=("b", "b")))
    cl = await follow(two)
    assert cl.tokens == [5, 6, 7, 8] and cl.finish_reason == "length"
    assert cl.path == ["a", "b"] and cl.where == "b" and cl.moved_at == [2] and len(cl.times) == 4
    assert cl.first_token.is_set()
    assert "r" not in two.nodes["a"].streams and "r" not in two.nodes["b"].streams


@pytest.mark.parametrize("second", [Event(0, 6), Event(2, 6)], ids=["repeat", "gap"])
async def test_a_token_out_of_place_fails_the_client(two, second):
    push(two, "a", Event(0, 5), second, Event(3, None, "length"))
    with pytest.raises(AssertionError, match="after 1 tokens"):
        await follow(two)


async def test_a_move_at_another_index_fails_the_client(two):
    push(two, "b", Event(0, 5), Event(1, 6, "length"))
    push(two, "a", Event(0, 5), Event(0, moved_to=("b", "b")))
    with pytest.raises(AssertionError, match="moved at an index"):
        await follow(two)


@pytest.mark.parametrize("at_b", ["nothing", "attached"])
async def test_a_move_with_nothing_to_attach_to_fails_the_client(two, at_b):
    if at_b == "attached":
        push(two, "b", Event(1, 6, "length"))
        two.nodes["b"].streams.get("r").attached = True
    push(two, "a", Event(0, 5), Event(1, moved_to=("b", "b")))
    with pytest.raises(AssertionError, match="nothing to attach to at b"):
        await follow(two)
