"""The stall watchdog's verdicts: a request its instance lost, or one whose
engine makes no step, is stalled; one that waits in a queue while the engine
steps is only loaded."""

from __future__ import annotations

import asyncio

import grpc

from libs.pb import common_pb2 as cpb
from services.frontend.watchdog import StallWatchdog


class FakeCall:
    def __init__(self):
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


class FakeInstance:
    """GetStatus of one instance: the requests it holds and its engine steps."""

    def __init__(self, held=("r",), steps=0, down=False):
        self.held, self.steps, self.down = list(held), steps, down

    async def GetStatus(self, request, timeout=None):
        if self.down:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "down")
        return cpb.InstanceStatus(engine_steps=self.steps, requests=[
            cpb.RequestLoad(request_id=r, state=cpb.RequestLoad.WAITING) for r in self.held])


async def watch_for(inst: FakeInstance, seconds: float, advance_steps: bool = False):
    dog = StallWatchdog(lambda address: inst, stall_s=0.2, interval_s=0.05)
    call = FakeCall()
    w = dog.watch("r", "i0", "addr", call)
    dog.start()
    try:
        for _ in range(int(seconds / 0.05)):
            await asyncio.sleep(0.05)
            if advance_steps:
                inst.steps += 1
    finally:
        await dog.stop()
    return w, call


async def test_a_request_the_instance_does_not_hold_is_stalled():
    w, call = await watch_for(FakeInstance(held=()), 0.6)
    assert call.cancelled and "does not hold" in w.stalled


async def test_a_request_waiting_while_the_engine_steps_is_not_stalled():
    w, call = await watch_for(FakeInstance(), 1.0, advance_steps=True)
    assert not call.cancelled and w.stalled is None


async def test_steps_longer_than_the_check_interval_are_not_a_stall():
    """An engine whose steps take longer than the watchdog's interval (but
    less than its period) is slow, not dead."""
    inst = FakeInstance()
    dog = StallWatchdog(lambda address: inst, stall_s=0.2, interval_s=0.05)
    call = FakeCall()
    w = dog.watch("r", "i0", "addr", call)
    dog.start()
    try:
        for i in range(24):
            await asyncio.sleep(0.05)
            if i % 3 == 2:  # a step every 0.15 s
                inst.steps += 1
    finally:
        await dog.stop()
    assert not call.cancelled and w.stalled is None


async def test_a_request_on_an_engine_that_makes_no_step_is_stalled():
    w, call = await watch_for(FakeInstance(steps=5), 0.8)
    assert call.cancelled and "made no step" in w.stalled


async def test_an_unreachable_instance_stalls_its_requests():
    w, call = await watch_for(FakeInstance(down=True), 0.6)
    assert call.cancelled and "does not answer" in w.stalled


async def test_events_keep_a_request_unchecked():
    inst = FakeInstance(held=())
    dog = StallWatchdog(lambda address: inst, stall_s=0.2, interval_s=0.05)
    call = FakeCall()
    w = dog.watch("r", "i0", "addr", call)
    dog.start()
    try:
        for _ in range(12):
            await asyncio.sleep(0.05)
            w.touch()
    finally:
        await dog.stop()
    assert not call.cancelled
