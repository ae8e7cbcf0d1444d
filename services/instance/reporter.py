"""Registers the instance with the meta store and reports its status when
poked (a step changed blocks, queue or request states; rate-limited), with a
heartbeat below the TTL, as messages on one long-lived StreamStatus call.
Survives meta store restarts: retries, and registers again when told it is
unknown. When a report goes is ``ReportTimer``'s, with no transport: the
simulator's instances report on it too (ferry/sim/instance.py)."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import grpc

from libs.pb import meta_store_pb2 as mpb
from libs.pb import meta_store_pb2_grpc as mpb_grpc
from libs.common import convert, rpc
from libs.common.logging import get_logger
from libs.common.types import InstanceInfo, InstanceStatus
from libs.common.backoff import Reconnect

log = get_logger(__name__)


class ReportTimer:
    """When an instance reports, on any clock (the event loop's, or the
    simulator's virtual one): soon after a ``poke``, at most every
    ``min_interval_s``, and every ``heartbeat_s`` without one. Each report
    is ``snapshot()`` handed to ``send``; a snapshot of None (the
    simulator's load cannot be read mid-step) is late: it goes when
    ``readable()`` says it can. ``call_at(when, fn, *args)`` schedules on
    that clock (``loop.call_at``, ``Kernel.at``)."""

    def __init__(self, snapshot: Callable[[], InstanceStatus | None], send: Callable[[InstanceStatus], Any],
                 min_interval_s: float, heartbeat_s: float, clock: Callable[[], float], call_at: Callable):
        self.snapshot, self.send = snapshot, send
        self.min_interval_s, self.heartbeat_s = min_interval_s, heartbeat_s
        self.clock, self.call_at = clock, call_at
        self.due: float | None = None  # when the next report is set to go (None: none set yet)
        self.reports = 0
        self.late_reports = 0  # reports that found no status to read and went when there was one
        self.stopped = False
        self._last = float("-inf")
        self._gen = 0  # a report set for an earlier time than ``due`` does nothing
        self._late = False

    def poke(self) -> None:
        """The load changed: report soon (at most every ``min_interval_s``)."""
        if self.stopped:
            return
        at = max(self._last + self.min_interval_s, self.clock())
        if self.due is None or at < self.due:
            self._set(at)

    def readable(self) -> None:
        """A status can be read again: a report that could not read one goes now."""
        if self._late:
            self._late = False
            self._report(self._gen)

    def stop(self) -> None:
        self.stopped = True
        self._gen += 1

    def _set(self, at: float) -> None:
        self._gen += 1
        self.due = at
        self.call_at(at, self._report, self._gen)

    def _report(self, gen: int) -> None:
        if gen != self._gen or self.stopped:
            return
        status = self.snapshot()
        if status is None:
            self._late = True
            self.late_reports += 1
            return
        self.reports += 1
        self._last = self.clock()
        self.send(status)
        self._set(self._last + self.heartbeat_s)


class StatusReporter:
    def __init__(self, meta_store: str, info: InstanceInfo, snapshot: Callable[[], InstanceStatus],
                 min_interval_s: float = 0.05, heartbeat_s: float = 0.5):
        self.meta_store = meta_store
        self.info = info
        self.snapshot = snapshot
        self.min_interval_s = min_interval_s
        self.heartbeat_s = heartbeat_s
        self.timer: ReportTimer | None = None  # set in start(), on the running loop
        self._pending: InstanceStatus | None = None  # the timer's latest report, not written yet
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.registered = False
        self.reports = 0  # written to the meta store

    def poke(self) -> None:
        """The load changed: report soon."""
        if self.timer is not None:
            self.timer.poke()

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.timer = ReportTimer(self.snapshot, self._queue, self.min_interval_s, self.heartbeat_s, loop.time,
                                 loop.call_at)
        self.timer.poke()
        self._task = asyncio.create_task(self._loop())

    def _queue(self, status: InstanceStatus) -> None:
        self._pending = status  # a later one replaces one not written yet
        self._ready.set()

    async def stop(self, deregister: bool = True) -> None:
        if self.timer is not None:
            self.timer.stop()
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if deregister:
            try:
                async with rpc.channel(self.meta_store) as ch:
                    await mpb_grpc.MetaStoreStub(ch).Deregister(
                        mpb.DeregisterRequest(instance_id=self.info.instance_id), timeout=1.0)
            except grpc.RpcError:
                pass

    async def _loop(self) -> None:
        backoff = Reconnect()
        while True:
            try:
                async with rpc.channel(self.meta_store) as ch:
                    stub = mpb_grpc.MetaStoreStub(ch)
                    await stub.Register(mpb.RegisterRequest(info=convert.info_to_pb(self.info)), timeout=2.0)
                    if not self.registered:
                        log.info("registered", meta_store=self.meta_store)
                    self.registered = True
                    backoff.reset()
                    if await self._report(stub):
                        log.info("meta store forgot us; registering again")
                    else:
                        log.info("meta store ended the status stream; reconnecting")
                        await backoff.wait()
            except asyncio.CancelledError:
                raise
            except grpc.RpcError as e:
                if self.registered:
                    log.warning("meta store unreachable; retrying", error=e.code().name, details=e.details())
                self.registered = False
                await backoff.wait()
            except Exception as e:  # noqa: BLE001 - NOTE: a reporter that stops lets the instance expire
                log.error("status report failed; retrying", error=repr(e))
                self.registered = False
                await backoff.wait()

    async def _report(self, stub: mpb_grpc.MetaStoreStub) -> bool:
        """Report over one long-lived call: a fresh status at once, then each
        report the timer makes (``ReportTimer``). Returns True when the store
        says it does not know us, False when it ended the call without a
        word; raises grpc.RpcError when the connection fails."""
        call = stub.StreamStatus()
        answer = asyncio.ensure_future(call.read())  # the store speaks only to end the call
        try:
            self._pending = None
            status: InstanceStatus | None = self.snapshot()
            while not answer.done():
                if status is not None:
                    await call.write(convert.status_to_pb(status))
                    self.reports += 1
                ready = asyncio.ensure_future(self._ready.wait())
                await asyncio.wait((ready, answer), return_when=asyncio.FIRST_COMPLETED)
                ready.cancel()
                self._ready.clear()
                status, self._pending = self._pending, None
            reply = answer.result()  # raises the call's error if it failed
            return reply is not grpc.aio.EOF and not reply.known
        finally:
            answer.cancel()
            call.cancel()
