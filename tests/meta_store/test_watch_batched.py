"""WatchBatched: the Watch's events, several per message when they queue up."""

import asyncio

import pytest

from libs.pb import common_pb2 as cpb
from libs.pb import meta_store_pb2 as pb
from tests.meta_store.test_service import _info, store, store_address  # noqa: F401 - fixtures


@pytest.mark.parametrize("store_address", [60.0], indirect=True)  # a TTL no loaded machine outlasts
async def test_a_burst_arrives_in_order_without_duplicates_ending_with_the_newest(store):  # noqa: F811
    await store.Register(pb.RegisterRequest(info=_info("b0")))
    batched = store.WatchBatched(pb.WatchRequest()).__aiter__()
    first = await batched.__anext__()
    assert [e.type for e in first.events] == [pb.WatchEvent.ADDED, pb.WatchEvent.SYNCED]
    # 200 reports at once while the watcher reads nothing. NOTE: sent at once,
    # they may reach the store in any order (on a loaded machine seq 197 came
    # fourth), and it ignores a report older than the last one (registry.py):
    # what the watch delivers is every accepted one, in order, none twice,
    # ending with the newest. How many are accepted, and how they are batched
    # over gRPC, depends on who runs first: the batching is tested in process below.
    # (With the other tests' 0.4 s TTL a loaded machine can expire b0 first: its reports refused, the
    # watch waits for a seq 200 that never comes: a CI run timed out so.)
    replies = await asyncio.gather(*(store.ReportStatus(cpb.InstanceStatus(instance_id="b0", seq=s))
                                     for s in range(1, 201)))
    assert all(r.known for r in replies)
    seqs, messages = [], 0
    while not seqs or seqs[-1] != 200:
        msg = await asyncio.wait_for(batched.__anext__(), 30)  # a liveness wait
        messages += 1
        seqs += [e.record.status.seq for e in msg.events]
    assert seqs == sorted(set(seqs)) and seqs[-1] == 200 and messages <= len(seqs)


async def test_changes_queued_for_a_watcher_go_in_one_message():
    """Whether a burst over gRPC queues up depends on who runs first; here
    the changes are queued before the watch loop takes the next one."""
    from libs.common.types import InstanceInfo, InstanceStatus
    from services.meta_store.registry import Registry
    from services.meta_store.service import MetaStoreServicer

    reg = Registry(ttl_s=60)
    reg.register(InstanceInfo("q0", "127.0.0.1:1", "fake", "fake", 16, 64, 2048, 0))
    watch = MetaStoreServicer(reg)._watch(pb.WatchRequest(), context=None)
    first = await watch.__anext__()
    assert [e.type for e in first] == [pb.WatchEvent.ADDED, pb.WatchEvent.SYNCED]
    for seq in range(1, 201):
        assert reg.report(InstanceStatus(instance_id="q0", seq=seq))
    batch = await asyncio.wait_for(watch.__anext__(), 5)
    assert [e.record.status.seq for e in batch] == list(range(1, 201))  # all 200, in order, one message
    await watch.aclose()


async def test_a_thinned_batched_watch_holds_updates_as_watch_does(store):  # noqa: F811
    await store.Register(pb.RegisterRequest(info=_info("b1")))
    thin = store.WatchBatched(pb.WatchRequest(min_update_interval_s=0.3)).__aiter__()
    await thin.__anext__()  # snapshot
    for seq in range(1, 11):
        await store.ReportStatus(cpb.InstanceStatus(instance_id="b1", seq=seq))
    got = []
    while not got or got[-1] != 10:
        msg = await asyncio.wait_for(thin.__anext__(), 2)
        got += [e.record.status.seq for e in msg.events]
    assert got[0] == 1 and got[-1] == 10 and len(got) < 10


async def test_changes_within_the_gap_after_a_message_go_in_the_next_one(monkeypatch):
    """A watch sends at most one message per BATCH_GAP_S: reports that come
    while it waits go together, in order (the gap made long here, so that
    the test does not depend on the machine's speed)."""
    from libs.common.types import InstanceInfo, InstanceStatus
    from services.meta_store import service
    from services.meta_store.registry import Registry

    monkeypatch.setattr(service, "BATCH_GAP_S", 0.5)
    reg = Registry(ttl_s=60)
    for iid in ("g0", "g1"):
        reg.register(InstanceInfo(iid, "127.0.0.1:1", "fake", "fake", 16, 64, 2048, 0))
    watch = service.MetaStoreServicer(reg)._watch(pb.WatchRequest(), context=None)
    assert [e.type for e in await watch.__anext__()][-1] == pb.WatchEvent.SYNCED
    nxt = asyncio.create_task(watch.__anext__())
    assert reg.report(InstanceStatus(instance_id="g0", seq=1))
    for _ in range(5):
        await asyncio.sleep(0)  # the watch takes it in, or waits for the gap to end
    assert not nxt.done()
    assert reg.report(InstanceStatus(instance_id="g1", seq=1))
    assert reg.report(InstanceStatus(instance_id="g0", seq=2))
    batch = await asyncio.wait_for(nxt, 5)
    assert [(e.record.info.instance_id, e.record.status.seq) for e in batch] == [("g0", 1), ("g1", 1), ("g0", 2)]
    await watch.aclose()


async def test_the_watch_queue_keeps_order_wakes_its_reader_and_times_out():
    from services.meta_store.registry import WatchQueue

    q = WatchQueue(maxsize=3)
    assert not await q.wait(0.01)  # nothing came
    getter = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    q.put_nowait("a")
    assert await asyncio.wait_for(getter, 5) == "a"
    waiter = asyncio.create_task(q.wait(30))
    await asyncio.sleep(0)
    q.put_nowait("b")
    q.put_nowait("c")
    assert await asyncio.wait_for(waiter, 5)
    q.put_nowait("d")
    with pytest.raises(asyncio.QueueFull):
        q.put_nowait("e")
    assert [q.get_nowait() for _ in range(q.qsize())] == ["b", "c", "d"]
    assert q.empty()
    with pytest.raises(asyncio.QueueEmpty):
        q.get_nowait()
