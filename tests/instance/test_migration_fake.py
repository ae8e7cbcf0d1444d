"""Live migration between real instance processes (fake engine, whose tokens
are computed from what it reads back from its KV cache, so a broken transfer
changes the output). The client's stream must see exactly the tokens of an
unmigrated run; both block pools must be intact afterwards."""

import random

import httpx
import pytest

from tests.conftest import start_fake_cluster
from tests.helpers import expected_fake_text, migrate, stream_completion, wait_idle_and_check

ARGS = ["--token-delay-ms", "8", "--num-blocks", "512", "--migration-last-stage-max-blocks", "1"]


def assert_clean(cluster):
    for inst in cluster.instances():
        if inst.alive():
            r = wait_idle_and_check(inst.address, timeout_s=8)
            assert r.ok, r.error
            assert r.num_requests == 0 and r.num_reservations == 0
            assert r.free_blocks == r.total_blocks


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_fake_cluster(tmp_path_factory, "migration", instances=3, instance_args=ARGS,
                           dispatch="round_robin")
    yield c
    c.stop()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_tokens_exact_across_1_to_3_migrations_at_random_points(cluster, seed):
    rng = random.Random(seed)
    n_migrations = seed  # 1, 2, 3
    prompt = f"migration {seed} " * rng.randint(2, 12)
    n = 120
    points = sorted(rng.sample(range(5, n - 20), n_migrations))
    done = []

    async def on_chunk(text, rid):
        if points and len(text) >= points[0]:
            points.pop(0)
            reply = await migrate(cluster, rid)
            done.append(reply)

    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
        text, final = await stream_completion(http, {"prompt": prompt, "max_tokens": n}, on_chunk)
    assert text == expected_fake_text(prompt, n)
    assert [r.committed for r in done] == [1] * n_migrations, done
    assert final["migrations"] == n_migrations
    assert len(set(final["instances"])) >= 2
    for r in done:
        res = r.results[0]
        assert res.stages >= 1 and res.blocks >= 1 and res.bytes == res.blocks * 16 * 2 * 4
    assert_clean(cluster)


async def test_many_concurrent_requests_migrating(cluster):
    """Several requests migrate while others decode beside them."""
    import asyncio

    async def one(i, http):
        prompt = f"concurrent {i} " * 3
        moved = []

        async def on_chunk(text, rid):
            if len(text) in (20, 50) and len(moved) < 2:
                moved.append(await migrate(cluster, rid))

        text, final = await stream_completion(http, {"prompt": prompt, "max_tokens": 80}, on_chunk)
        return text == expected_fake_text(prompt, 80), sum(m.committed for m in moved if m)

    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
        results = await asyncio.gather(*(one(i, http) for i in range(8)))
    assert all(ok for ok, _ in results)
    assert sum(c for _, c in results) >= 8  # most migrations committed (limits may refuse some)
    assert_clean(cluster)
