"""Registers the instance with the meta store and reports its status after
every change of load (rate-limited), with a heartbeat below the TTL. Survives
meta store restarts: retries, and registers again when told it is unknown."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import grpc

from ferry.pb import meta_store_pb2 as mpb
from ferry.pb import meta_store_pb2_grpc as mpb_grpc
from libs.common import convert
from libs.common.logging import get_logger
from libs.common.server import GRPC_OPTIONS
from libs.common.types import InstanceInfo, InstanceStatus

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
                async with grpc.aio.insecure_channel(self.meta_store, options=GRPC_OPTIONS) as ch:
                    await mpb_grpc.MetaStoreStub(ch).Deregister(
                        mpb.DeregisterRequest(instance_id=self.info.instance_id), timeout=1.0)
            except grpc.RpcError:
                pass

    async def _loop(self) -> None:
        backoff = 0.05
        while True:
            try:
                async with grpc.aio.insecure_channel(self.meta_store, options=GRPC_OPTIONS) as ch:
                    stub = mpb_grpc.MetaStoreStub(ch)
                    await stub.Register(mpb.RegisterRequest(info=convert.info_to_pb(self.info)), timeout=2.0)
                    if not self.registered:
                        log.info("registered", meta_store=self.meta_store)
                    self.registered = True
                    backoff = 0.05
                    while True:
                        t0 = time.monotonic()
                        reply = await stub.ReportStatus(convert.status_to_pb(self.snapshot()), timeout=2.0)
                        self.reports += 1
                        if not reply.known:
                            log.info("meta store forgot us; registering again")
                            break
                        try:
                            await asyncio.wait_for(self._dirty.wait(), self.heartbeat_s)
                        except asyncio.TimeoutError:
                            pass
                        self._dirty.clear()
                        await asyncio.sleep(max(0.0, self.min_interval_s - (time.monotonic() - t0)))
            except asyncio.CancelledError:
                raise
            except grpc.RpcError as e:
                if self.registered:
                    log.warning("meta store unreachable; retrying", error=e.code().name)
                self.registered = False
                await asyncio.sleep(backoff)
                backoff = min(1.0, backoff * 2)
