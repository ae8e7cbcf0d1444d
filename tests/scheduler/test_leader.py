"""Leader election of schedulers on a real etcd (services/scheduler/leader.py)
and the leader's fenced state (state.py)."""

from __future__ import annotations

import asyncio
import time

from services.scheduler.leader import EtcdLeadership
from services.scheduler.state import EtcdState
from tests.etcd_fixture import etcd_server  # noqa: F401 - a fixture


class Candidate:
    def __init__(self, endpoint: str, name: str):
        self.lead = EtcdLeadership(endpoint, "/t", ttl_s=1.0, scheduler_id=name)
        self.events: list[tuple[str, float]] = []

    async def start(self) -> "Candidate":
        async def elected():
            self.events.append(("elected", time.monotonic()))

        async def deposed():
            self.events.append(("deposed", time.monotonic()))

        await self.lead.start(elected, deposed)
        return self


async def until(cond, timeout_s: float = 10.0) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "condition not met in time"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def test_one_leads_and_a_resignation_hands_over_at_once(etcd_server):  # noqa: F811
    a = await Candidate(etcd_server.endpoint, "a").start()
    await until(lambda: a.lead.is_leader)
    b = await Candidate(etcd_server.endpoint, "b").start()
    await asyncio.sleep(1.5)
    assert a.lead.is_leader and not b.lead.is_leader  # b waits; a's lease is renewed
    await a.lead.stop()
    took = await until(lambda: b.lead.is_leader)
    assert took < 1.0, took  # the key was deleted: no TTL to wait for
    assert [e for e, _ in a.events] == ["elected", "deposed"]
    await b.lead.stop()


async def test_a_leader_that_dies_silently_is_replaced_after_its_lease(etcd_server):  # noqa: F811
    a = await Candidate(etcd_server.endpoint, "a").start()
    await until(lambda: a.lead.is_leader)
    b = await Candidate(etcd_server.endpoint, "b").start()
    # a "dies": its campaign stops without resigning (as under SIGKILL).
    a.lead._task.cancel()
    await asyncio.gather(a.lead._task, return_exceptions=True)
    # Its key outlives it by its lease (1 s): b does not lead at once, and then does (how soon the
    # lease ends is etcd's, and on a loaded machine later than its TTL: no bound on the time here).
    assert not b.lead.is_leader
    await until(lambda: b.lead.is_leader, timeout_s=15)
    assert [e for e, _ in b.events] == ["elected"]
    await b.lead.stop()
    await a.lead.etcd.close()


async def test_a_deposed_leaders_state_writes_are_refused(etcd_server):  # noqa: F811
    a = await Candidate(etcd_server.endpoint, "a").start()
    await until(lambda: a.lead.is_leader)
    state_a = EtcdState(a.lead)
    assert await state_a.put("launched", "i-1", {"pid": 1})
    b = await Candidate(etcd_server.endpoint, "b").start()
    a.lead._task.cancel()  # dies silently; keeps its client and stale fence
    await asyncio.gather(a.lead._task, return_exceptions=True)
    await until(lambda: b.lead.is_leader, timeout_s=5)
    state_b = EtcdState(b.lead)
    assert await state_b.load("launched") == {"i-1": {"pid": 1}}  # handed over
    assert not await state_a.put("launched", "i-2", {"pid": 2})  # fenced out
    assert await state_b.put("launched", "i-3", {"pid": 3})
    assert set(await state_b.load("launched")) == {"i-1", "i-3"}
    await b.lead.stop()
    await a.lead.etcd.close()
