"""The migration protocol in one process between two native engines on the
real default model (SmolLM2-135M): a migrated request emits exactly the
tokens of an unmigrated run (greedy and seeded), across a cancel too; in
float32 (the path checked against transformers) and in bf16 with vLLM's CPU
kernel attending over the paged cache in its own layout (k_transposed
blocks move as they are). An engine of the other layout is refused."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

pytest.importorskip("torch")

from tests.instance.migration.harness import CONFIG, Client, Cluster, order
from tests.instance.migration.native_engines import (
    cluster_of,
    kernel_native,
    native,
    one_torch_thread,  # noqa: F401 - a fixture
)

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("one_torch_thread")]

PROMPT = [100 + (i * 37) % 5000 for i in range(90)]
N = 40


@pytest.fixture(scope="module", params=["float32", "bf16-kernel"])
def engines(request):
    if request.param == "float32":
        return native(), native()
    return kernel_native(), kernel_native()


@pytest.mark.parametrize("transport", ["shared", "bytes"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}])
async def test_migrated_tokens_equal_the_unmigrated_run(engines, sampling, transport):
    """The KV through the source's shared cache (b copies a's blocks) or as bytes."""
    config = CONFIG if transport == "shared" else dataclasses.replace(CONFIG, shared_kv=False)
    async with cluster_of(engines, config=config) as two:
        ref = Client(two, "ref")
        want = await asyncio.wait_for(ref.run("a", PROMPT, N, **sampling), 120)
        cl = Client(two, "r")
        task = asyncio.create_task(cl.run("a", PROMPT, N, **sampling))
        await cl.wait_tokens(5, timeout_s=60)
        res = await two.nodes["a"].manager.migrate_out(order("b", "r"))
        assert res.committed == 1, res
        assert res.results[0].kv_shared == (transport == "shared")
        assert await asyncio.wait_for(task, 120) == want
        assert cl.path == ["a", "b"]
        for node in two.nodes.values():
            await node.check_clean()


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}])
async def test_a_migration_that_links_the_destinations_cached_prefix_emits_the_same_tokens(engines, sampling):
    """b computed the same prompt before (its blocks cached there): the
    migration links them instead of sending them, and the request goes on
    over b's own KV of the prefix with exactly the unmigrated run's tokens."""
    async with cluster_of(engines) as two:
        ref = Client(two, "ref")
        want = await asyncio.wait_for(ref.run("a", PROMPT, N, **sampling), 120)
        at_b = Client(two, "at-b")
        assert await asyncio.wait_for(at_b.run("b", PROMPT, N, **sampling), 120) == want
        cl = Client(two, "r")
        task = asyncio.create_task(cl.run("a", PROMPT, N, **sampling))
        await cl.wait_tokens(5, timeout_s=60)
        res = await two.nodes["a"].manager.migrate_out(order("b", "r"))
        assert res.committed == 1, res
        out = res.results[0]
        full = len(PROMPT) // engines[1].block_size
        assert out.linked_blocks >= full and out.held_blocks >= out.linked_blocks
        assert await asyncio.wait_for(task, 120) == want
        assert cl.path == ["a", "b"]
        for node in two.nodes.values():
            await node.check_clean()


@pytest.mark.parametrize("fuse", [True, False], ids=["last-stage-in-commit", "last-stage-apart"])
async def test_cancel_after_suspend_resumes_with_the_same_tokens(engines, fuse):
    """Cancelled after the suspend: while the commit's copy of the last
    stage runs at the destination, or at the last pre-allocation."""
    async with cluster_of(engines, config=dataclasses.replace(CONFIG, fuse_last_stage=fuse)) as two:
        ref = Client(two, "ref")
        want = await asyncio.wait_for(ref.run("a", PROMPT, N), 120)
        cl = Client(two, "r")
        task = asyncio.create_task(cl.run("a", PROMPT, N))
        await cl.wait_tokens(5, timeout_s=60)
        a = two.nodes["a"]
        a.faults["source.commit" if fuse else "source.pre_alloc_last"] = lambda: asyncio.current_task().cancel()
        mig = asyncio.create_task(a.manager.migrate_one("r", "b", "b"))
        with pytest.raises(asyncio.CancelledError):
            await mig
        assert await asyncio.wait_for(task, 120) == want
        assert cl.path == ["a"]
        for node in two.nodes.values():
            await node.check_clean()


async def test_a_k_transposed_cache_is_refused_by_a_plain_one():
    """Same dtype and block size, the other block layout: the bytes would
    be read as the wrong positions, so the destination refuses them."""
    c = Cluster()
    c.add("a", kernel_native(num_blocks=16))
    c.add("b", native(16, block_size=32, dtype="bfloat16", extra={"vllm_kernels": False}))
    try:
        cl = Client(c, "r")
        task = asyncio.create_task(cl.run("a", PROMPT, N))
        await cl.wait_tokens(3, timeout_s=60)
        out = await c.nodes["a"].manager.migrate_one("r", "b", "b")
        assert not out.committed and "kv layout mismatch" in out.reason
        assert len(await asyncio.wait_for(task, 120)) == N
        assert cl.path == ["a"]
        for node in c.nodes.values():
            await node.check_clean()
    finally:
        await c.stop()


def test_the_shared_cache_holds_the_engines_blocks(engines):
    """What a destination maps (kv_share) is this engine's cache, block for
    block as gather_kv lays it out."""
    import numpy as np

    from services.instance.engine.shared_kv import PeerKv

    e = engines[0]
    bpb = e.kv_layout.bytes_per_block
    peer = PeerKv(e.kv_share(), bpb)
    assert peer.num_blocks == e.num_total_blocks
    ids = e.reserve_blocks(3)
    try:
        data = np.random.default_rng(0).integers(0, 255, 3 * bpb, dtype=np.uint8)
        e.scatter_kv(ids, memoryview(data))
        assert b"".join(bytes(peer.blocks(b, 1)) for b in ids) == data.tobytes() == bytes(e.gather_kv(ids))
    finally:
        e.release_blocks(ids)
