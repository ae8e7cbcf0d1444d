"""KV transfer of the native engine on CUDA (kv_staging.py): a side stream
and pinned host buffers. The copies give the cache's bytes, they wait for
the engine's queued work on the blocks (a gather for the writes, a scatter
for the reads), and a migration between two CUDA engines in one process
emits exactly the tokens of an unmigrated run, staged or plain. Skipped
without a CUDA GPU."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

torch = pytest.importorskip("torch")

from services.instance.engine import create_engine
from services.instance.engine.base import EngineConfig
from tests.instance.migration.harness import CONFIG, Client, order
from tests.instance.migration.native_engines import cluster_of

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT = [3 + (i * 37) % 500 for i in range(90)]
N = 40
SPIN = 200_000_000  # torch.cuda._sleep cycles: ~0.1 s of the default stream busy


def cuda_native(num_blocks: int = 64, staging: bool = True, dtype: str = "float32"):
    return create_engine(EngineConfig(
        engine="native", model="tiny-llama", num_blocks=num_blocks, block_size=16, max_model_len=512,
        device="cuda", dtype=dtype, extra={"share_weights": True, "warmup": False, "kv_staging": staging}))


@pytest.fixture(scope="module")
def engine():
    return cuda_native()


def _random_blocks(e, ids):
    ex = e.executor
    idx = torch.tensor(ids, device=ex.kv_cache.device)
    ex.kv_cache.index_copy_(0, idx, torch.randn((len(ids),) + tuple(ex.kv_cache.shape[1:]),
                                                device=ex.kv_cache.device).to(ex.kv_cache.dtype))
    torch.cuda.synchronize()
    return idx


def _host_bytes(t) -> bytes:
    return t.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def test_staged_gather_and_scatter_move_the_caches_bytes(engine):
    e = engine
    assert e.executor._staging is not None
    ids = e.reserve_blocks(5)
    try:
        order_ids = [ids[3], ids[0], ids[4]]
        idx = _random_blocks(e, order_ids)
        want = _host_bytes(e.executor.kv_cache.index_select(0, idx))
        assert bytes(e.gather_kv(order_ids)) == want
        # A scatter into other blocks, then a gather of those: the same bytes, in order.
        e.scatter_kv([ids[1], ids[2]], want[: 2 * e.kv_layout.bytes_per_block])
        assert bytes(e.gather_kv([ids[1], ids[2]])) == want[: 2 * e.kv_layout.bytes_per_block]
        # One layer of the blocks (per-layer handoffs), both ways.
        layer = e.kv_layout.num_layers - 1
        part = bytes(e.executor._gather_layer(order_ids, layer))
        assert part == _host_bytes(e.executor.kv_cache[idx, layer])
        e.executor.scatter_kv_layer([ids[1]], 0, part[: len(part) // 3])
        assert _host_bytes(e.executor.kv_cache[ids[1], 0]) == part[: len(part) // 3]
    finally:
        e.release_blocks(ids)


def test_a_gather_waits_for_the_steps_writes(engine):
    """The default stream busy for ~0.1 s, then writing the blocks (as a
    prefill chunk's step does without syncing the host): the side stream's
    gather must see the write, not the bytes before it."""
    e, ex = engine, engine.executor
    ids = e.reserve_blocks(2)
    try:
        idx = _random_blocks(e, ids)
        torch.cuda._sleep(SPIN)
        ex.kv_cache.index_fill_(0, idx, 1.0)
        ex._staging.step_done()
        got = bytes(e.gather_kv(ids))
        assert got == _host_bytes(torch.ones_like(ex.kv_cache[idx]))
        # The same for one layer gathered mid-step (the engine thread's queued work so far).
        torch.cuda._sleep(SPIN)
        ex.kv_cache.index_fill_(0, idx, 2.0)
        assert bytes(ex._gather_layer(ids, 1)) == _host_bytes(torch.full_like(ex.kv_cache[idx, 1], 2.0))
    finally:
        e.release_blocks(ids)


def test_a_scatter_waits_for_the_steps_reads(engine):
    """A step queued behind ~0.1 s still reads blocks that a scatter then
    overwrites: it must read the old bytes."""
    e, ex = engine, engine.executor
    ids = e.reserve_blocks(2)
    try:
        idx = _random_blocks(e, ids)
        before = _host_bytes(ex.kv_cache.index_select(0, idx))
        torch.cuda._sleep(SPIN)
        seen = ex.kv_cache.index_select(0, idx)  # queued on the default stream after the spin
        ex._staging.step_done()
        new = torch.zeros((2,) + tuple(ex.kv_cache.shape[1:]), dtype=ex.kv_cache.dtype)
        e.scatter_kv(ids, new.view(torch.uint8).numpy().tobytes())
        torch.cuda.synchronize()
        assert _host_bytes(seen) == before
        assert _host_bytes(ex.kv_cache.index_select(0, idx)) == new.view(torch.uint8).numpy().tobytes()
    finally:
        e.release_blocks(ids)


@pytest.mark.parametrize("staging", [True, False], ids=["staged", "plain"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}], ids=["greedy", "seeded"])
async def test_migrated_tokens_on_cuda_equal_the_unmigrated_run(staging, sampling):
    engines = (cuda_native(staging=staging), cuda_native(staging=staging))
    async with cluster_of(engines, config=dataclasses.replace(CONFIG, shared_kv=False)) as two:
        ref = Client(two, "ref")
        want = await asyncio.wait_for(ref.run("a", PROMPT, N, **sampling), 120)
        cl = Client(two, "r")
        task = asyncio.create_task(cl.run("a", PROMPT, N, **sampling))
        await cl.wait_tokens(5, timeout_s=60)
        res = await two.nodes["a"].manager.migrate_out(order("b", "r"))
        assert res.committed == 1, res
        assert res.results[0].stages >= 2 and not res.results[0].kv_shared
        assert await asyncio.wait_for(task, 120) == want
        assert cl.path == ["a", "b"]
        for node in two.nodes.values():
            await node.check_clean()
