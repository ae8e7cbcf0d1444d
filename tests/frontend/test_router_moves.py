"""The frontend follows a move only to an instance the meta store knows at
that address (issue 39: the cluster token is not root); it waits briefly for
a view that lags a registration."""

from __future__ import annotations

import asyncio

from libs.common.types import InstanceInfo, InstanceRecord
from services.frontend.router import Router


def _record(iid: str, address: str) -> InstanceRecord:
    return InstanceRecord(InstanceInfo(iid, address, "fake", "fake", 16, 64, 2048))


async def test_a_move_is_followed_only_to_a_registered_instance_at_its_address():
    router = Router("127.0.0.1:1", "127.0.0.1:1")  # never started: its view is filled by hand
    router.view.records["instance-1"] = _record("instance-1", "127.0.0.1:7101")
    assert await router.is_registered("instance-1", "127.0.0.1:7101")
    assert not await router.is_registered("instance-1", "10.6.6.6:666", wait_s=0.05)  # not its address
    assert not await router.is_registered("thief", "10.6.6.6:666", wait_s=0.05)  # nobody

    async def register_late():
        await asyncio.sleep(0.05)
        router.view.records["instance-2"] = _record("instance-2", "127.0.0.1:7102")
        router.view.changed.set()
    late = asyncio.create_task(register_late())
    assert await router.is_registered("instance-2", "127.0.0.1:7102", wait_s=2.0)  # the view caught up
    await late
    await router.close()
