"""An instance's KV event publisher: numbered batches, a snapshot consistent
with the numbering, slow subscribers dropped; and the runner feeding it from
a live engine in order."""

from __future__ import annotations

import asyncio

from libs.common.kv_events import BlockRemoved, BlockStored, KvSnapshot
from libs.common.prefix_index import PrefixIndex
from services.instance.engine import create_engine
from services.instance.engine.base import EngineConfig
from services.instance.kv_events import KvEventPublisher
from services.instance.runner import EngineRunner
from tests.instance.engine.helpers import req


async def test_batches_are_numbered_and_a_late_subscriber_starts_from_a_snapshot():
    pub = KvEventPublisher("i")
    early = pub.subscribe()
    assert pub.publish([]) is None and pub.seq == 0
    pub.publish([BlockStored((1, 2))])
    late = pub.subscribe()
    pub.publish([BlockRemoved((1,)), BlockStored((3,), 2)])
    assert early.get_nowait() == KvSnapshot("i", 0, {})
    assert [early.get_nowait().seq for _ in range(2)] == [1, 2]
    snap = late.get_nowait()
    assert snap == KvSnapshot("i", 1, {1: None, 2: 1})
    idx = PrefixIndex()
    idx.reset(snap)
    assert idx.apply(late.get_nowait())
    assert idx.hashes_of("i") == set(pub.held) == {2, 3}


async def test_a_subscriber_that_falls_behind_is_dropped():
    pub = KvEventPublisher("i", queue_size=2)
    q = pub.subscribe()
    for h in range(5):
        pub.publish([BlockStored((h,))])
    assert pub.num_subscribers == 0
    assert q.get_nowait() is None and q.empty()


async def test_the_runner_hands_a_live_engines_events_over_in_order():
    engine = create_engine(EngineConfig(engine="fake", num_blocks=10, token_delay_ms=0.0, watermark=0.0))
    pub = KvEventPublisher("i")
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    runner = EngineRunner(engine, loop, lambda outs, load: [done.set() for o in outs if o.finish_reason],
                          on_kv_events=pub.publish)
    runner.start()
    try:
        prompt = [97 + i % 26 for i in range(60)]
        for i in range(4):
            done.clear()
            await runner.call(engine.add_request, req(f"r{i}", prompt[i * 10:] + prompt[:i * 10], max_tokens=20))
            await asyncio.wait_for(done.wait(), 10)
        await asyncio.sleep(0.1)
        assert set(pub.held) == set(await runner.call(engine.cached_hashes))
        assert pub.seq > 1 and engine.load().prefix_cache.evictions > 0
    finally:
        runner.stop()
