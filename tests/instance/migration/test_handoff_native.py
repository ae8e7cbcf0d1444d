"""Splitwise's handoff between two native engines on the real default model
(SmolLM2-135M), in one process: the request prefilled on one engine and
decoded on the other emits exactly the tokens of a colocated run (greedy and
seeded), and both block pools end whole."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")

from services.instance.engine import create_engine
from services.instance.engine.base import EngineConfig
from tests.instance.migration.harness import Client, Cluster

pytestmark = pytest.mark.model

PROMPT = [100 + (i * 37) % 5000 for i in range(90)]  # 5 full blocks of 16 and a partial one
N = 16


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def native():
    return create_engine(EngineConfig(engine="native", model="smollm2", num_blocks=64, block_size=16,
                                      max_model_len=512, dtype="float32",
                                      extra={"share_weights": True, "warmup": False}))


@pytest.fixture(scope="module")
def engines():
    return native(), native()


@pytest.fixture
async def pd(engines):
    c = Cluster()
    c.add("p", engines[0])
    c.add("d", engines[1])
    yield c
    await c.stop()


@pytest.mark.parametrize("n_prompt, sampling", [
    (90, {}), (90, {"temperature": 0.8, "top_p": 0.9, "seed": 7}),
    (17, {}),  # one full block and one token: the partial block goes in the same last stage
])
async def test_handoff_tokens_equal_the_colocated_run(pd, sampling, n_prompt):
    prompt = PROMPT[:n_prompt]
    want = await asyncio.wait_for(Client(pd, "ref").run("p", prompt, N, **sampling), 120)
    cl = Client(pd, "r")
    got = await asyncio.wait_for(cl.run("p", prompt, N, handoff="d", **sampling), 120)
    assert got == want
    assert cl.path == ["p", "d"] and cl.moved_at == [1]
    assert pd.nodes["p"].manager.counters.handed_off >= 1
    for node in pd.nodes.values():
        await node.check_clean()
