"""How the control plane reaches an instance: one client protocol on domain
types (libs/common/types.py), so that the scheduler's loops (the autoscaler
and the rescheduler here; KunServe's monitor next) run the same code against
instance processes over gRPC and against the simulator's instances on its
virtual clock (ferry/sim/run.py's clients).

``InstanceClients`` gives the client of an instance by its id and address;
``GrpcInstanceClients`` keeps one channel per address (libs/common/rpc.py,
whose keepalive ends the calls of a peer that froze), instead of a channel
dialled and closed per call. A failure is a FerryError (errors.from_grpc)."""

from __future__ import annotations

import asyncio
from typing import Protocol

import grpc

from libs.pb import instance_pb2 as ipb
from libs.pb import instance_pb2_grpc as ipb_grpc
from libs.common import convert, rpc
from libs.common.errors import from_grpc
from libs.common.types import InstanceStatus, MigrateOutOrder, OrderResult, Role


class InstanceClient(Protocol):
    async def set_terminating(self, value: bool) -> None:
        """Mark the instance terminating (its fake request drains it by migration) or not."""

    async def status(self) -> InstanceStatus:
        """Its status now (not the view's last report)."""

    async def set_role(self, role: Role, drain_to: list[tuple[str, str]] = ()) -> tuple[Role, int]:
        """Change what it runs (Splitwise); becoming prefill, its decoding
        requests move to ``drain_to`` ((id, address), in order). Returns (the
        role before, requests it started to move)."""


class InstanceClients(Protocol):
    def __call__(self, instance_id: str, address: str) -> InstanceClient: ...

    def forget(self, instance_id: str) -> None:
        """An instance that left: whatever was kept to reach it goes."""


class GrpcInstanceClient:
    def __init__(self, stub: ipb_grpc.InstanceStub, timeout_s: float = 5.0, order_timeout_s: float = 60.0):
        self._stub = stub
        self.timeout_s = timeout_s
        self.order_timeout_s = order_timeout_s  # an order runs its migrations before it answers

    async def set_terminating(self, value: bool) -> None:
        try:
            await self._stub.SetTerminating(ipb.SetInstanceTerminatingRequest(terminating=value),
                                            timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise from_grpc(e) from e

    async def status(self) -> InstanceStatus:
        try:
            return convert.status_from_pb(await self._stub.GetStatus(ipb.GetStatusRequest(), timeout=self.timeout_s))
        except grpc.RpcError as e:
            raise from_grpc(e) from e

    async def set_role(self, role: Role, drain_to=()) -> tuple[Role, int]:
        req = ipb.SetRoleRequest(role=convert.role_to_pb(role),
                                 drain_to=[ipb.Handoff(instance_id=i, address=a) for i, a in drain_to])
        try:
            reply = await self._stub.SetRole(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise from_grpc(e) from e
        return convert.role_from_pb(reply.previous), reply.draining

    async def migrate_out(self, order: MigrateOutOrder) -> OrderResult:
        try:
            reply = await self._stub.MigrateOut(convert.migrate_out_to_pb(order), timeout=self.order_timeout_s)
        except grpc.RpcError as e:
            raise from_grpc(e) from e
        return convert.order_result_from_pb(reply)


class GrpcInstanceClients:
    """Clients over one channel per address, kept until ``close``."""

    def __init__(self, timeout_s: float = 5.0, order_timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self.order_timeout_s = order_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._addresses: dict[str, str] = {}  # instance id -> the address it was last reached at

    def __call__(self, instance_id: str, address: str) -> GrpcInstanceClient:
        old = self._addresses.get(instance_id)
        self._addresses[instance_id] = address
        if old is not None and old != address:
            self._drop_unused(old)  # restarted elsewhere
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = rpc.channel(address)
        return GrpcInstanceClient(ipb_grpc.InstanceStub(ch), self.timeout_s, self.order_timeout_s)

    def forget(self, instance_id: str) -> None:
        """An instance that left: its channel goes (closed when its calls end)."""
        address = self._addresses.pop(instance_id, None)
        if address is not None:
            self._drop_unused(address)

    def _drop_unused(self, address: str) -> None:
        if address in self._addresses.values():
            return
        ch = self._channels.pop(address, None)
        if ch is not None:
            asyncio.ensure_future(ch.close())

    @property
    def open_channels(self) -> int:
        return len(self._channels)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
