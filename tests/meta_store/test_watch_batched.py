"""WatchBatched: the Watch's events, several per message when they queue up."""

import asyncio

from libs.pb import common_pb2 as cpb
from libs.pb import meta_store_pb2 as pb
from tests.meta_store.test_service import _info, store, store_address  # noqa: F401 - fixtures


async def test_a_burst_arrives_in_order_in_fewer_messages(store):  # noqa: F811
    await store.Register(pb.RegisterRequest(info=_info("b0")))
    batched = store.WatchBatched(pb.WatchRequest()).__aiter__()
    first = await batched.__anext__()
    assert [e.type for e in first.events] == [pb.WatchEvent.ADDED, pb.WatchEvent.SYNCED]
    # 200 reports while the watcher reads nothing: they queue, then come together.
    await asyncio.gather(*(store.ReportStatus(cpb.InstanceStatus(instance_id="b0", seq=s)) for s in range(1, 201)))
    seqs, messages = [], 0
    while len(seqs) < 200:
        msg = await asyncio.wait_for(batched.__anext__(), 30)  # a liveness wait: 5 s ran out under CI-like load
        messages += 1
        seqs += [e.record.status.seq for e in msg.events]
    assert sorted(seqs) == list(range(1, 201)) and messages < 200


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
