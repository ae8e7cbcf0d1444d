"""The prefill -> decode handoff between two native engines on the real
default model (SmolLM2-135M, 30 layers): a request prefilled on a (in
chunks that end inside blocks) with its KV streamed layer by layer to b,
then decoded on b, emits exactly the tokens of a run that stays on a
(greedy and seeded); so does a handoff started half way through the prompt,
and a handoff whose destination fails mid-stream (the request decodes on at
a). No block leaks on either side. (The serialized handoff, the migration
itself with handoff=True: test_handoff_native.py.)"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

pytest.importorskip("torch")

from services.instance.engine.base import LayerKv
from services.instance.migration.messages import PeerError
from tests.instance.migration.harness import CONFIG, Client, Cluster
from tests.instance.migration.layerwise_harness import (
    WatchedPeer,
    engine_request,
    handoff,
    open_client,
    run_with_handoff,
)
from tests.instance.migration.native_engines import (
    cluster_of,
    one_torch_thread,  # noqa: F401 - a fixture
)
from tests.instance.migration.native_engines import native as native_engine

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("one_torch_thread")]

PROMPT = [100 + (i * 37) % 5000 for i in range(150)]  # 10 blocks of 16, the last partial
N = 16
BUDGET = 56  # the prompt takes 3 steps: [0,56) [56,112) [112,150)
LAYERS = 30
CFG = dataclasses.replace(CONFIG, chunk_bytes=1 << 20, deadline_ms=5000)
GREEDY, SEEDED = {}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}


def native(**config):
    return native_engine(num_blocks=48, max_num_batched_tokens=BUDGET, **config)


@pytest.fixture(scope="module")
def engines():
    # No prefix cache: these tests count the layers each prompt chunk streams,
    # and a module's tests share the engines (a cached prompt computes in one
    # chunk; tests/instance/migration/test_handoff_per_layer.py has that case).
    return native(prefix_caching=False), native(prefix_caching=False)


@pytest.fixture
async def two(engines):
    async with cluster_of(engines, config=CFG) as c:
        yield c


_REFERENCE: dict[str, list[int]] = {}


async def reference(c: Cluster, sampling: dict) -> list[int]:
    """The tokens of a run that stays on a."""
    key = repr(sorted(sampling.items()))
    if key not in _REFERENCE:
        _REFERENCE[key] = await asyncio.wait_for(Client(c, f"ref-{len(_REFERENCE)}").run("a", PROMPT, N, **sampling),
                                                 120)
    return _REFERENCE[key]


async def clean(c: Cluster) -> None:
    for node in c.nodes.values():
        await node.check_clean()


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_handoff_gives_exactly_the_colocated_tokens(two, sampling):
    want = await reference(two, sampling)
    layers = []
    two.peer_wrappers["b"] = lambda p: WatchedPeer(p, lambda ch: layers.append(ch.layer) if ch.data or ch.src_blocks else None)
    cl, task, _, ht = await run_with_handoff(two, "r", PROMPT, N, config=CFG, **sampling)
    out = await asyncio.wait_for(ht, 120)
    assert out.committed, out
    assert await asyncio.wait_for(task, 120) == want
    assert cl.path == ["a", "b"]
    # every layer of each of the 3 prompt chunks, in layer order within a chunk
    assert layers == list(range(LAYERS)) * 3
    assert out.bytes == 10 * 24 * 1024 * LAYERS  # each block once per layer (fp32: 24 KiB a layer)
    await clean(two)


async def test_the_tap_hands_over_what_the_layer_wrote(engines):
    """The engine hook alone: per layer, the chunk's blocks of that layer
    equal what the KV cache holds for them after the step."""
    import torch

    eng = engines[0]
    got: list[LayerKv] = []
    eng.add_request(engine_request("tap", PROMPT[:40], 1))
    assert eng.tap_layers("tap", got.append)
    assert not eng.tap_layers("nobody", got.append)
    while eng.has_work():
        eng.step()
    assert [k.layer for k in got] == list(range(LAYERS))
    blocks = list(got[0].block_ids)
    assert len(blocks) == 3
    assert all(k.samples and (k.start, k.end, k.first_block) == (0, 40, 0) and list(k.block_ids) == blocks
               for k in got)
    eng.check_integrity()
    # The blocks went back to the pool but nobody wrote them since: compare.
    cache = eng.executor.kv_cache
    for k in got:
        want = cache[blocks, k.layer].contiguous().view(torch.uint8).numpy().tobytes()
        assert bytes(k.data) == want


async def test_handoff_started_half_way_through_the_prompt(two):
    """The blocks computed before the tap go first (gathered, split per
    layer), the rest as it computes."""
    want = await reference(two, GREEDY)
    a = two.nodes["a"]
    cl = open_client(two, "r", "a")
    h = handoff(two, "r", PROMPT, N, config=CFG, add=False)
    await a.runner.call(a.engine.add_request, engine_request("r", PROMPT, N))
    while a.engine.requests["r"].num_computed_tokens < BUDGET:
        await asyncio.sleep(0.001)
    task = asyncio.create_task(cl.follow("a"))
    out = await asyncio.wait_for(h.run(), 120)
    assert out.committed, out
    assert h.caught_up >= 3
    assert await asyncio.wait_for(task, 120) == want
    assert cl.path == ["a", "b"]
    await clean(two)


async def test_destination_fails_mid_stream_the_request_decodes_at_the_source(two):
    want = await reference(two, SEEDED)
    seen = []

    def break_at_layer_20(ch):
        seen.append(ch)
        if ch.layer == 20:
            raise PeerError("UNAVAILABLE: destination went away")

    two.peer_wrappers["b"] = lambda p: WatchedPeer(p, break_at_layer_20)
    cl, task, _, ht = await run_with_handoff(two, "r", PROMPT, N, config=CFG, **SEEDED)
    out = await asyncio.wait_for(ht, 120)
    assert not out.committed and "destination went away" in out.reason
    assert await asyncio.wait_for(task, 120) == want
    assert cl.path == ["a"]
    await clean(two)
