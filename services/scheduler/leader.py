"""Which scheduler runs the cluster's singleton loops (rescheduling,
auto-scaling and its launcher, KunServe). Every scheduler serves Dispatch
from its own view of the meta store; only the leader orders migrations,
scales and forms groups.

- ``SoleLeader``: no etcd: this scheduler leads from its start (one scheduler
  per cluster, as before);
- ``EtcdLeadership``: schedulers campaign for one key (``scheduler/leader``)
  on a lease of ``ttl_s``; the winner renews it, the others watch the key and
  campaign again the moment it is deleted (the leader resigned, or its lease
  ran out: it died or lost etcd). A leader that could not renew for ``ttl_s``
  steps down by itself before another can have taken over, so two never lead
  at once for longer than a renewal's round trip. Every write of the leader's
  state is fenced by its key (``fence()``): a deposed leader's writes fail.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Awaitable, Callable

from libs.common import etcd as etcdlib
from libs.common.logging import get_logger
from libs.common.backoff import Reconnect

log = get_logger(__name__)

Hook = Callable[[], Awaitable[None]]


class Leadership:
    """``start(on_elected, on_deposed)``: the hooks run on this scheduler's
    task, one at a time, elected and deposed alternating."""

    is_leader: bool = False
    scheduler_id: str = ""

    async def start(self, on_elected: Hook, on_deposed: Hook) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        """Resign (a standby takes over at once) and stop campaigning."""


class SoleLeader(Leadership):
    def __init__(self, scheduler_id: str = "scheduler"):
        self.scheduler_id = scheduler_id

    async def start(self, on_elected: Hook, on_deposed: Hook) -> None:
        self.is_leader = True
        await on_elected()


class EtcdLeadership(Leadership):
    def __init__(self, endpoints: str, prefix: str = "/ferry", *, ttl_s: float = 1.0, scheduler_id: str = "",
                 address: str = ""):
        self.endpoints = endpoints
        self.keys = etcdlib.Keys(prefix)
        self.ttl = etcdlib.lease_ttl(ttl_s)
        self.scheduler_id = scheduler_id or f"scheduler-{uuid.uuid4().hex[:6]}"
        self.address = address
        self.etcd = None
        self.revision = 0  # the leader key's create revision while this one leads (the fence)
        self.elected_at: float | None = None  # wall time of the last election won
        self.terms = 0
        self._lease_id: int | None = None
        self._task: asyncio.Task | None = None
        self._hooks: tuple[Hook, Hook] | None = None

    async def start(self, on_elected: Hook, on_deposed: Hook) -> None:
        self._hooks = (on_elected, on_deposed)
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.is_leader:
            await self._step_down("stopping")
        if self.etcd is not None and self._lease_id is not None:
            try:  # resign: the standby sees the key go now, not after the TTL
                async with asyncio.timeout(1.0):
                    await self.etcd.revoke_lease(self._lease_id)
                log.info("leadership resigned", scheduler_id=self.scheduler_id)
            except (*etcdlib.errors(), asyncio.CancelledError):
                pass
        if self.etcd is not None:
            await self.etcd.close()

    def fence(self):
        """The comparison every write of the leader's state carries."""
        return self.etcd.transactions.create(self.keys.leader) == self.revision

    # --- the campaign ----------------------------------------------------------------
    async def _run(self) -> None:
        backoff = Reconnect()
        while True:
            self.etcd = etcdlib.client(self.endpoints, timeout_s=max(0.2, self.ttl / 3))
            try:
                await self._campaign()
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except (*etcdlib.errors(), ConnectionError) as e:
                log.warning("leadership: etcd unreachable", error=repr(e))
            except Exception:  # noqa: BLE001 - keep campaigning
                log.exception("leadership: campaign failed")
            if self.is_leader:
                await self._step_down("lost etcd")
            self._lease_id = None
            await self.etcd.close()
            await backoff.wait()

    async def _campaign(self) -> None:
        t = self.etcd.transactions
        while True:
            lease = await self.etcd.lease(self.ttl)
            self._lease_id = lease.id
            won, res = await self.etcd.transaction(
                compare=[t.create(self.keys.leader) == 0],
                success=[t.put(self.keys.leader, self._value(), lease=lease), t.get(self.keys.leader)],
                failure=[t.get(self.keys.leader)])
            got = res[-1][0][1] if res and res[-1] else None
            if won and got is not None:
                self.revision = got.create_revision
                await self._lead(lease.id)  # returns when the lease is lost
                return
            await self.etcd.revoke_lease(lease.id)
            self._lease_id = None
            if got is None:
                continue  # deleted meanwhile: campaign again
            await self._wait_vacant(got.mod_revision)

    def _value(self) -> bytes:
        return f"{self.scheduler_id} {self.address}".strip().encode()

    async def _wait_vacant(self, revision: int) -> None:
        """Until the leader key is deleted (or a re-check finds it gone)."""
        watch = await self.etcd.watch(self.keys.leader, start_revision=revision + 1)
        try:
            async for ev in watch:
                if ev.kind == "DELETE":
                    return
        finally:
            await watch.cancel()

    async def _lead(self, lease_id: int) -> None:
        self.is_leader = True
        self.terms += 1
        self.elected_at = time.time()
        log.info("leadership won", scheduler_id=self.scheduler_id, revision=self.revision, term=self.terms)
        # The hook (taking over the state) runs while the lease is renewed.
        elected = asyncio.create_task(self._hooks[0]())
        keeper = etcdlib.LeaseKeeper(self.etcd)
        renewed = time.monotonic()
        try:
            while True:
                await asyncio.sleep(self.ttl / 3)
                if elected.done() and not elected.cancelled() and elected.exception() is not None:
                    log.error("leadership: taking over failed", error=repr(elected.exception()))
                try:
                    gone = await keeper.renew([lease_id], timeout_s=self.ttl / 3)
                except (*etcdlib.errors(), ConnectionError) as e:
                    # NOTE: another may take over once the lease runs out:
                    # step down before that, whatever happens next.
                    if time.monotonic() - renewed > self.ttl * 0.6:
                        raise ConnectionError(f"leadership lease not renewed for {self.ttl} s") from e
                    continue
                if gone:
                    raise ConnectionError("leadership lease expired")
                renewed = time.monotonic()
        finally:
            keeper.reset()
            if not elected.done():
                elected.cancel()
            await asyncio.gather(elected, return_exceptions=True)

    async def _step_down(self, why: str) -> None:
        self.is_leader = False
        log.warning("leadership lost", scheduler_id=self.scheduler_id, why=why)
        try:
            await self._hooks[1]()
        except Exception:  # noqa: BLE001
            log.exception("leadership: stepping down failed")
