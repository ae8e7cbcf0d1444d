import asyncio

from libs.common.types import InstanceInfo, InstanceStatus
from services.meta_store.registry import ChangeType, Registry


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def info(i: str) -> InstanceInfo:
    return InstanceInfo(i, f"127.0.0.1:{1000 + int(i[-1])}", "fake", "fake", 16, 100, 2048)


def test_ttl_expiry_removes_only_silent_instances():
    clock = Clock()
    reg = Registry(ttl_s=3.0, clock=clock)
    reg.register(info("i0"))
    reg.register(info("i1"))
    clock.t = 2.0
    assert reg.report(InstanceStatus("i1", seq=1))
    clock.t = 3.5
    assert reg.expire() == ["i0"]
    assert [r.info.instance_id for r in reg.list()] == ["i1"]
    clock.t = 5.1
    assert reg.expire() == ["i1"]
    assert reg.list() == []


def test_report_from_unknown_instance_asks_to_register():
    reg = Registry(ttl_s=1.0)
    assert reg.report(InstanceStatus("ghost", seq=1)) is False


def test_stale_report_is_ignored():
    reg = Registry(ttl_s=1.0)
    reg.register(info("i0"))
    reg.report(InstanceStatus("i0", seq=5, free_blocks=10))
    reg.report(InstanceStatus("i0", seq=4, free_blocks=99))
    assert reg.list()[0].status.free_blocks == 10


async def test_watch_gets_snapshot_then_changes():
    reg = Registry(ttl_s=1.0)
    reg.register(info("i0"))
    q = reg.subscribe()
    first, synced = q.get_nowait(), q.get_nowait()
    assert (first.type, first.record.info.instance_id) == (ChangeType.ADDED, "i0")
    assert synced.type == ChangeType.SYNCED
    reg.register(info("i1"))
    reg.report(InstanceStatus("i1", seq=1, freeness=3.0))
    reg.deregister("i0")
    changes = [q.get_nowait() for _ in range(3)]
    assert [c.type for c in changes] == [ChangeType.ADDED, ChangeType.UPDATED, ChangeType.REMOVED]
    assert changes[1].record.status.freeness == 3.0
    assert q.empty()


async def test_slow_watcher_is_dropped_not_blocking():
    reg = Registry(ttl_s=1.0, watch_queue_size=4)
    q = reg.subscribe()
    for i in range(10):
        reg.register(info(f"i{i % 10}"))
    await asyncio.sleep(0)
    assert q.get_nowait() is None  # told to re-watch


def test_a_live_instance_id_cannot_be_taken_over_by_another_address():
    import dataclasses

    import pytest

    from services.meta_store.registry import TakenOver

    clock = Clock()
    reg = Registry(ttl_s=3.0, clock=clock)
    reg.register(info("i0"))
    thief = dataclasses.replace(info("i0"), address="10.6.6.6:666")
    clock.t = 2.9
    with pytest.raises(TakenOver, match="is registered at 127.0.0.1:1000 and alive"):
        reg.register(thief)
    assert reg.list()[0].info.address == "127.0.0.1:1000"
    reg.register(info("i0"))  # its owner again, same address: fine
    clock.t = 6.0  # the owner went silent past the TTL: the id is free (a restart on a new port)
    reg.register(thief)
    assert reg.list()[0].info.address == "10.6.6.6:666"
