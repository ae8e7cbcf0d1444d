"""etcd for the replicated control plane (``--etcd``): the one client
factory, the key layout every service shares, and a lease kept alive.

The client is ``aetcd`` (asyncio, etcd's v3 gRPC API; its generated code
loads under the project's protobuf 7). Where its wrappers fall short, the
raw stubs it exposes are used: one long-lived ``LeaseKeepAlive`` stream
renews many leases (``LeaseKeeper``), instead of a stream per renewal.

Key layout under a prefix (``--etcd-prefix``, one per cluster):

- ``instances/<id>``: an instance's registration (InstanceInfo, protobuf),
  attached to the instance's lease: it disappears when nobody renews it;
- ``status/<id>``: its latest status as a meta-store replica last shared it
  (InstanceStatus, protobuf), on the same lease;
- ``meta-stores/<replica>``: a live meta-store replica (its session lease);
- ``scheduler/leader``: the leading scheduler's id (its session lease);
- ``scheduler/state/<kind>/<key>``: what the leader must hand over (JSON).
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
from dataclasses import dataclass

import grpc

from libs.common.logging import get_logger

log = get_logger(__name__)


def _errors() -> tuple[type[BaseException], ...]:
    from aetcd import exceptions

    return (exceptions.ClientError, grpc.RpcError, OSError, asyncio.TimeoutError)


def target(endpoints: str) -> tuple[str, int]:
    """``host:port[,host:port...]`` (an optional ``http://`` is dropped) as
    the (host, port) aetcd builds its gRPC target from. Several endpoints
    (IPv4 addresses) become one ``ipv4:`` target (gRPC's pick_first: the
    first that answers); one DNS name resolves to every address it has (a
    headless Service of the etcd members does that)."""
    eps = [e.strip().removeprefix("http://") for e in endpoints.split(",") if e.strip()]
    if not eps:
        raise ValueError("no etcd endpoint given")
    for e in eps:
        host, sep, port = e.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"etcd endpoint {e!r} is not host:port")
    host, _, port = eps[-1].rpartition(":")
    if len(eps) == 1:
        return host, int(port)
    for e in eps:
        try:
            ipaddress.IPv4Address(e.rpartition(":")[0])
        except ValueError:
            raise ValueError(f"several etcd endpoints must be IPv4 addresses ({e!r} is not); give one DNS name "
                             f"that resolves to every member instead") from None
    return "ipv4:" + ",".join([*eps[:-1], host]), int(port)


def client(endpoints: str, timeout_s: float = 2.0):
    """An aetcd client (connects on first use; ``await c.close()``)."""
    import aetcd

    host, port = target(endpoints)
    return aetcd.Client(host=host, port=port, timeout=timeout_s,
                        options={"grpc.max_reconnect_backoff_ms": 1000,
                                 "grpc.max_receive_message_length": 64 << 20})


def lease_ttl(ttl_s: float) -> int:
    """etcd leases count whole seconds (and etcd may round a short one up)."""
    return max(1, math.ceil(ttl_s))


def prefix_end(prefix: bytes) -> bytes:
    """The end of the key range that holds every key starting with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


@dataclass(frozen=True)
class Keys:
    prefix: str = "/ferry"

    def _k(self, *parts: str) -> bytes:
        return "/".join([self.prefix.rstrip("/"), *parts]).encode()

    @property
    def root(self) -> bytes:
        return self._k("")

    @property
    def instances(self) -> bytes:
        return self._k("instances", "")

    @property
    def statuses(self) -> bytes:
        return self._k("status", "")

    @property
    def replicas(self) -> bytes:
        return self._k("meta-stores", "")

    def instance(self, instance_id: str) -> bytes:
        return self._k("instances", instance_id)

    def status(self, instance_id: str) -> bytes:
        return self._k("status", instance_id)

    def replica(self, replica_id: str) -> bytes:
        return self._k("meta-stores", replica_id)

    @property
    def leader(self) -> bytes:
        return self._k("scheduler", "leader")

    def state(self, kind: str, key: str = "") -> bytes:
        return self._k("scheduler", "state", kind, key)

    def document(self, kind: str, key: str) -> bytes:
        return self._k("documents", kind, key)


class LeaseKeeper:
    """Renews a set of leases over one ``LeaseKeepAlive`` stream, each at
    most every ``interval_s``. ``renew(ids)`` sends one round and returns
    the ids etcd no longer knows (expired: their keys are gone)."""

    def __init__(self, etcd):
        self.etcd = etcd
        self._call = None
        self._lock = asyncio.Lock()

    async def renew(self, lease_ids: list[int], timeout_s: float = 2.0) -> list[int]:
        from aetcd import rpc

        if not lease_ids:
            return []
        async with self._lock:
            await self.etcd.connect()
            try:
                if self._call is None:
                    self._call = self.etcd.leasestub.LeaseKeepAlive(metadata=self.etcd.metadata)
                for lid in lease_ids:
                    await self._call.write(rpc.LeaseKeepAliveRequest(ID=lid))
                gone = []
                for _ in lease_ids:
                    async with asyncio.timeout(timeout_s):
                        reply = await self._call.read()
                    if reply is grpc.aio.EOF:
                        raise ConnectionError("etcd ended the keep-alive stream")
                    if reply.TTL <= 0:
                        gone.append(reply.ID)
                return gone
            except BaseException:
                self.reset()
                raise

    def reset(self) -> None:
        if self._call is not None:
            self._call.cancel()
        self._call = None


ERRORS: tuple[type[BaseException], ...] = ()


def errors() -> tuple[type[BaseException], ...]:
    """What a failing etcd call raises (connection, timeout, server errors)."""
    global ERRORS
    if not ERRORS:
        ERRORS = _errors()
    return ERRORS
