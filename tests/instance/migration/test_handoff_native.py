"""Splitwise's handoff between two native engines on the real default model
(SmolLM2-135M), in one process: the request prefilled on one engine and
decoded on the other emits exactly the tokens of a colocated run (greedy and
seeded), and both block pools end whole."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")

from tests.instance.migration.harness import Client
from tests.instance.migration.native_engines import (
    cluster_of,
    native,
    one_torch_thread,  # noqa: F401 - a fixture
)

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("one_torch_thread")]

PROMPT = [100 + (i * 37) % 5000 for i in range(90)]  # 5 full blocks of 16 and a partial one
N = 16


@pytest.fixture(scope="module")
def engines():
    return native(), native()


@pytest.fixture
async def pd(engines):
    async with cluster_of(engines, ("p", "d")) as c:
        yield c


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
