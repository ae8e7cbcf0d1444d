"""Registers the instance with the meta store and reports its status when
poked (a step changed blocks, queue or request states; rate-limited), with a
heartbeat below the TTL, as messages on one long-lived StreamStatus call.
Survives meta store restarts: retries, and registers again when told it is
unknown."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import grpc

from libs.pb import meta_store_pb2 as mpb
from libs.pb import meta_store_pb2_grpc as mpb_grpc
from libs.common import convert, rpc
from libs.common.logging import get_logger
from libs.common.types import InstanceInfo, InstanceStatus
from libs.common.backoff import Reconnect

log = get_logger(__name__)


class StatusReporter:
    def __init__(self, meta_store: str, info: InstanceInfo, snapshot: Callable[[], InstanceStatus],
                 min_interval_s: float = 0.05, heartbeat_s: float = 0.5):
        self.meta_store = meta_store
        self.info = info
        self.snapshot = snapshot
        self.min_interval_s = min_interval_s
        self.heartbeat_s = heartbeat_s
        self._dirty = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.registered = False
        self.reports = 0

    def poke(self) -> None:
        """The load changed: report soon."""
        self._dirty.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self, deregister: bool = True) -> None:
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
        """Report over one long-lived call after every poke (at most every
        ``min_interval_s``) and at least every ``heartbeat_s``. Returns True
        when the store says it does not know us, False when it ended the call
        without a word; raises grpc.RpcError when the connection fails."""
        call = stub.StreamStatus()
        answer = asyncio.ensure_future(call.read())  # the store speaks only to end the call
        try:
            while not answer.done():
                t0 = time.monotonic()
                await call.write(convert.status_to_pb(self.snapshot()))
                self.reports += 1
                poked = asyncio.ensure_future(self._dirty.wait())
                await asyncio.wait((poked, answer), timeout=self.heartbeat_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                poked.cancel()
                self._dirty.clear()
                if not answer.done():
                    await asyncio.sleep(max(0.0, self.min_interval_s - (time.monotonic() - t0)))
            reply = answer.result()  # raises the call's error if it failed
            return reply is not grpc.aio.EOF and not reply.known
        finally:
            answer.cancel()
            call.cancel()
