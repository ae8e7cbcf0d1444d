"""The registry of one meta-store replica when the cluster's registry and
leases live in etcd (``ferry serve meta-store --etcd``), so that several
replicas serve one cluster.

What lives where:

- etcd holds each instance's registration (``instances/<id>``) on a lease of
  its own (the store's TTL, in whole seconds). The replica an instance reports
  to renews that lease; an instance that stops reporting anywhere loses its
  lease, etcd deletes its keys, and every replica sees the deletion;
- statuses arrive at the replica the instance reports to and are kept there in
  memory, as in the in-memory store, and sent to its watchers at once; the
  other replicas get them through etcd (``status/<id>``, on the same lease),
  at most every ``share_interval_s`` per instance, and only while another
  replica is alive (``meta-stores/<replica>``, on the replica's own lease);
- the local ``Registry`` underneath is each replica's view: watchers and
  ``List`` read it, so a watcher of any replica sees the whole cluster.

While etcd is unreachable a replica goes on from memory as the embedded store
does (local TTL: instances reporting elsewhere expire after the TTL since
their last shared status); when etcd returns it reads the whole prefix again
and puts back the instances that still report to it but lost their keys.

NOTE: liveness has one authority at a time: etcd's leases while etcd is
reachable (a replica never deletes an instance by its own TTL then), the
local TTL while it is not."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Callable

import grpc

from libs.pb import common_pb2 as cpb
from libs.common import convert
from libs.common import etcd as etcdlib
from libs.common.logging import get_logger
from libs.common.types import InstanceInfo
from libs.common.backoff import Reconnect
from services.meta_store.registry import Registry

log = get_logger(__name__)

TXN_OPS = 64  # etcd refuses transactions of more than --max-txn-ops (128 by default)


class EtcdRegistry(Registry):
    def __init__(self, ttl_s: float, endpoints: str, prefix: str = "/ferry", *, share_interval_s: float = 0.2,
                 replica_id: str = "", clock: Callable[[], float] = time.monotonic,
                 watch_queue_size: int = 10_000):
        super().__init__(ttl_s, clock, watch_queue_size)
        self.endpoints = endpoints
        self.keys = etcdlib.Keys(prefix)
        self.share_interval_s = share_interval_s
        self.replica_id = replica_id or uuid.uuid4().hex[:8]
        self.address = ""
        self.etcd = None
        self.connected = False  # etcd is this replica's liveness authority now
        self.peers: set[str] = set()  # other live replicas
        self._leases: dict[str, int] = {}  # instance -> its lease (as etcd has it)
        self._stored: dict[str, InstanceInfo] = {}  # instance -> its registration in etcd
        self._reported: dict[str, float] = {}  # instance -> its last report to this replica (clock)
        self._renewed: dict[int, float] = {}  # lease -> when this replica last renewed it
        self._to_register: dict[str, InstanceInfo] = {}
        self._to_delete: dict[str, int | None] = {}  # instance -> its lease to revoke
        self._to_share: dict[str, object] = {}  # instance -> latest status (wire form) not yet shared
        self._shared_seq: dict[str, int] = {}  # instance -> seq last put in etcd by anyone
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.etcd_writes = 0

    # --- commands from the servicer ------------------------------------------------
    def register(self, info: InstanceInfo) -> None:
        super().register(info)
        rec = self._records.get(info.instance_id)
        if rec is None or rec.info != info:
            return
        self._reported[info.instance_id] = self.clock()
        self._to_delete.pop(info.instance_id, None)
        if self._stored.get(info.instance_id) != info or info.instance_id not in self._leases:
            self._to_register[info.instance_id] = info
            self._wake.set()

    def deregister(self, instance_id: str) -> bool:
        existed = self._forget(instance_id)
        self._to_register.pop(instance_id, None)
        self._to_delete[instance_id] = self._leases.get(instance_id)
        self._wake.set()
        return existed

    def report(self, status) -> bool:
        if not super().report(status):
            return False
        iid = status.instance_id
        self._reported[iid] = self.clock()
        if self.peers:
            self._to_share[iid] = status
        return True

    def expire(self) -> list[str]:
        """Only while etcd is unreachable: then the local TTL decides, for
        every instance this replica knows (etcd's leases decide otherwise)."""
        if self.connected:
            return []
        now = self.clock()
        dead = [i for i, r in self._records.items() if now - r.last_seen > self.ttl_s]
        for i in dead:
            self._forget(i)
        return dead

    def _forget(self, instance_id: str) -> bool:
        """Remove locally (watchers get REMOVED); etcd is not touched."""
        self._reported.pop(instance_id, None)
        self._to_share.pop(instance_id, None)
        self._shared_seq.pop(instance_id, None)
        return super().deregister(instance_id)

    # --- the connection to etcd ------------------------------------------------------
    def start(self, address: str) -> None:
        self.address = address
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.etcd is not None:
            try:  # leave at once rather than when the session lease runs out
                async with asyncio.timeout(1.0):
                    await self.etcd.delete(self.keys.replica(self.replica_id))
            except (*etcdlib.errors(), asyncio.CancelledError):
                pass
            await self.etcd.close()

    async def _run(self) -> None:
        backoff = Reconnect(first_s=0.1)
        while True:
            self.etcd = etcdlib.client(self.endpoints)
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except (*etcdlib.errors(), ConnectionError) as e:
                if self.connected:
                    log.warning("etcd lost; the local TTL decides liveness until it returns", error=repr(e))
            except Exception:  # noqa: BLE001 - a bug here must not end the replica's tie to etcd
                log.exception("etcd session failed")
            if self.connected:
                backoff.reset()  # a session that ran: the first retry is quick again
            self.connected = False
            self.peers.clear()
            await self.etcd.close()
            await backoff.wait()

    async def _session(self) -> None:
        session = await self.etcd.lease(etcdlib.lease_ttl(self.ttl_s))
        await self.etcd.put(self.keys.replica(self.replica_id), self.address.encode(), lease=session)
        snapshot = await self.etcd.get_prefix(self.keys.root)
        self._resync(snapshot.kvs)
        watch = await self.etcd.watch_prefix(self.keys.root, start_revision=snapshot.header.revision + 1)
        self.connected = True
        log.info("etcd connected", instances=len(self._stored), peers=len(self.peers))
        keeper = etcdlib.LeaseKeeper(self.etcd)
        tasks = [asyncio.create_task(self._read(watch)), asyncio.create_task(self._write(keeper, session.id))]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()
            raise ConnectionError("etcd watch ended")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            keeper.reset()

    # --- etcd -> this replica ----------------------------------------------------------
    def _resync(self, kvs) -> None:
        """The whole prefix, read after a (re)connection: etcd wins, except for
        instances that report here and lost their keys meanwhile (put back)."""
        infos, statuses, peers = {}, {}, set()
        for kv in kvs:
            kind, key = self._split(kv.key)
            if kind == "instances":
                infos[key] = (kv.value, kv.lease)
            elif kind == "status":
                statuses[key] = kv.value
            elif kind == "meta-stores" and key != self.replica_id:
                peers.add(key)
        self.peers = peers
        self._stored.clear()
        self._leases.clear()
        for iid, (value, lease) in infos.items():
            self._apply_instance(iid, value, lease)
        now = self.clock()
        for iid in [i for i in self._records if i not in infos]:
            rec = self._records[iid]
            if now - self._reported.get(iid, -1e18) <= self.ttl_s:
                self._to_register[iid] = rec.info  # alive here: put it back
            else:
                self._forget(iid)
        for iid, value in statuses.items():
            self._apply_status(iid, value)
        self._wake.set()

    async def _read(self, watch) -> None:
        async for ev in watch:
            kind, key = self._split(ev.kv.key)
            put = ev.kind == "PUT"
            if kind == "instances":
                if put:
                    self._apply_instance(key, ev.kv.value, ev.kv.lease)
                else:
                    self._stored.pop(key, None)
                    self._leases.pop(key, None)
                    if key not in self._to_register and self._forget(key):
                        log.info("instance removed (etcd)", instance_id=key)
            elif kind == "status" and put:
                self._apply_status(key, ev.kv.value)
            elif kind == "meta-stores" and key != self.replica_id:
                (self.peers.add if put else self.peers.discard)(key)

    def _apply_instance(self, iid: str, value: bytes, lease: int) -> None:
        info = convert.info_from_pb(cpb.InstanceInfo.FromString(value))
        self._stored[iid] = info
        self._leases[iid] = lease
        rec = self._records.get(iid)
        if rec is None or rec.info != info:
            Registry.register(self, info)

    def _apply_status(self, iid: str, value: bytes) -> None:
        status = cpb.InstanceStatus.FromString(value)
        self._shared_seq[iid] = status.seq
        rec = self._records.get(iid)
        if rec is None or (rec.status is not None and rec.status.seq == status.seq):
            return  # unknown, or this replica's own status coming back
        Registry.report(self, status)

    def _split(self, key: bytes) -> tuple[str, str]:
        rest = key[len(self.keys.root):].decode()
        kind, _, name = rest.partition("/")
        return kind, name

    # --- this replica -> etcd ----------------------------------------------------------
    async def _write(self, keeper: etcdlib.LeaseKeeper, session_id: int) -> None:
        renew_every = max(0.05, etcdlib.lease_ttl(self.ttl_s) / 3)
        last_renewal = 0.0
        last_share = 0.0
        while True:
            try:
                async with asyncio.timeout(min(renew_every, self.share_interval_s)):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            await self._flush_registrations()
            await self._flush_deletions()
            now = self.clock()
            if now - last_renewal >= renew_every:
                last_renewal = now
                await self._renew(keeper, session_id)
            if self._to_share and now - last_share >= self.share_interval_s:
                last_share = now
                await self._share()

    async def _flush_registrations(self) -> None:
        ttl = etcdlib.lease_ttl(self.ttl_s)
        while self._to_register:
            iid, info = next(iter(self._to_register.items()))
            lease = await self.etcd.lease(ttl)
            await self.etcd.put(self.keys.instance(iid), convert.info_to_pb(info).SerializeToString(), lease=lease)
            self.etcd_writes += 1
            if self._to_register.get(iid) == info:
                del self._to_register[iid]
            self._stored[iid], self._leases[iid] = info, lease.id
            self._renewed[lease.id] = self.clock()
            status = self._records[iid].status if iid in self._records else None
            self._shared_seq.pop(iid, None)  # its status key was on the old lease: put it again
            if status is not None and self.peers:
                self._to_share[iid] = status

    async def _flush_deletions(self) -> None:
        t = self.etcd.transactions
        while self._to_delete:
            iid, lease = next(iter(self._to_delete.items()))
            await self.etcd.transaction(compare=[], success=[t.delete(self.keys.instance(iid)),
                                                             t.delete(self.keys.status(iid))], failure=[])
            if lease:
                try:
                    await self.etcd.revoke_lease(lease)
                except etcdlib.errors():
                    pass  # already gone
            self.etcd_writes += 1
            self._to_delete.pop(iid, None)
            self._stored.pop(iid, None)
            self._leases.pop(iid, None)

    async def _renew(self, keeper: etcdlib.LeaseKeeper, session_id: int) -> None:
        """The session's lease and the leases of instances that reported here
        within the TTL (an instance that went silent is left to expire)."""
        now = self.clock()
        live = {self._leases[i] for i, t in self._reported.items() if now - t <= self.ttl_s and i in self._leases}
        gone = await keeper.renew([session_id, *live])
        for lid in live:
            self._renewed[lid] = now
        if session_id in gone:
            raise ConnectionError("this replica's etcd session expired")
        for lid in gone:
            self._renewed.pop(lid, None)
        # Forget renewal times of leases nobody holds any more.
        held = set(self._leases.values())
        for lid in [x for x in self._renewed if x not in held]:
            del self._renewed[lid]

    async def _share(self) -> None:
        t = self.etcd.transactions
        batch = []
        for iid, status in list(self._to_share.items()):
            lease = self._leases.get(iid)
            if lease is None:
                continue  # not in etcd yet: shared once registered
            del self._to_share[iid]
            if self._shared_seq.get(iid) == status.seq:
                continue
            self._shared_seq[iid] = status.seq
            wire = status if isinstance(status, cpb.InstanceStatus) else convert.status_to_pb(status)
            batch.append(t.put(self.keys.status(iid), wire.SerializeToString(), lease=lease))
        for i in range(0, len(batch), TXN_OPS):
            await self._put_all(batch[i:i + TXN_OPS])

    async def _put_all(self, puts: list) -> None:
        """Puts in one transaction; where one's lease has just expired (its
        instance died: etcd refuses the whole transaction), the others one by
        one."""
        try:
            await self.etcd.transaction(compare=[], success=puts, failure=[])
            self.etcd_writes += 1
            return
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
        for op in puts:
            try:
                await self.etcd.put(op.key, op.value, lease=op.lease)
                self.etcd_writes += 1
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise
