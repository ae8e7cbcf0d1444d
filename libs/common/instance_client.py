"""How the control plane reaches an instance: one client protocol on domain
types (libs/common/types.py), so that the scheduler's loops (the autoscaler
the rescheduler and KunServe's monitor) run the same code against
instance processes over gRPC and against the simulator's instances on its
virtual clock (ferry/sim/control.py's clients).

``InstanceClients`` gives the client of an instance by its id and address;
``GrpcInstanceClients`` keeps one channel per address (libs/common/rpc.py,
whose keepalive ends the calls of a peer that froze), instead of a channel
dialled and closed per call. A failure is a FerryError (errors.from_grpc)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

import grpc

from libs.pb import instance_pb2 as ipb
from libs.pb import instance_pb2_grpc as ipb_grpc
from libs.common import convert, rpc
from libs.common.errors import from_grpc
from libs.common.types import InstanceStatus, LayerChange, MigrateOutOrder, OrderResult, Role

# KunServe's calls move a layer range's weights and KV between instances: minutes at worst, never
# forever (a member that stopped answering fails the call, which the monitor retries).
LAYERS_TIMEOUT_S = 300.0


class InstanceClient(Protocol):
    async def set_terminating(self, value: bool) -> None:
        """Mark the instance terminating (its fake request drains it by migration) or not."""

    async def status(self) -> InstanceStatus:
        """Its status now (not the view's last report)."""

    async def set_role(self, role: Role, drain_to: list[tuple[str, str]] = ()) -> tuple[Role, int]:
        """Change what it runs (Splitwise); becoming prefill, its decoding
        requests move to ``drain_to`` ((id, address), in order). Returns (the
        role before, requests it started to move)."""

    async def migrate_out(self, order: MigrateOutOrder) -> OrderResult:
        """Run the order's migrations (libs/common/policies/migration) and answer when they ended."""

    # KunServe (services/instance/kunserve.py, docs/kunserve.md)
    async def drop_layers(self, layers: range, hold: bool = False, prepare: bool = False) -> LayerChange:
        """Give the parameter memory of ``layers`` to the KV pool; ``hold``:
        take no step until set_pipeline; ``prepare``: only make the grown
        storage now (the next drop of the same layers uses it), and with
        ``hold`` hold the steps from now (a merge's first round; no layers:
        only that)."""

    async def set_pipeline(self, own: range, peers: Sequence[tuple[range, str]] = (),
                           pause_exchange: bool = False, hold: bool = False) -> int:
        """Run ``own`` and the rest on ``peers`` ((layers, address)); every
        layer and no peers: alone again. Returns the requests whose KV moved.
        ``hold``: re-forming (a merge), take no step after the KV moved until
        the same stages are set again."""

    async def restore_layers(self, layers: range, from_address: str) -> LayerChange:
        """Take ``layers`` back from the instance at ``from_address``."""


class InstanceClients(Protocol):
    def __call__(self, instance_id: str, address: str) -> InstanceClient: ...

    def forget(self, instance_id: str) -> None:
        """An instance that left: whatever was kept to reach it goes."""


class GrpcInstanceClient:
    def __init__(self, stub: ipb_grpc.InstanceStub, timeout_s: float = 5.0, order_timeout_s: float = 60.0,
                 layers_timeout_s: float = LAYERS_TIMEOUT_S):
        self._stub = stub
        self.timeout_s = timeout_s
        self.order_timeout_s = order_timeout_s  # an order runs its migrations before it answers
        self.layers_timeout_s = layers_timeout_s

    async def _call(self, method, request, timeout_s: float):
        """One unary call; a gRPC failure becomes a FerryError."""
        try:
            return await method(request, timeout=timeout_s)
        except grpc.RpcError as e:
            raise from_grpc(e) from e

    async def set_terminating(self, value: bool) -> None:
        await self._call(self._stub.SetTerminating, ipb.SetInstanceTerminatingRequest(terminating=value),
                         self.timeout_s)

    async def status(self) -> InstanceStatus:
        return convert.status_from_pb(await self._call(self._stub.GetStatus, ipb.GetStatusRequest(), self.timeout_s))

    async def set_role(self, role: Role, drain_to=()) -> tuple[Role, int]:
        req = ipb.SetRoleRequest(role=convert.role_to_pb(role),
                                 drain_to=[ipb.Handoff(instance_id=i, address=a) for i, a in drain_to])
        reply = await self._call(self._stub.SetRole, req, self.timeout_s)
        return convert.role_from_pb(reply.previous), reply.draining

    async def migrate_out(self, order: MigrateOutOrder) -> OrderResult:
        reply = await self._call(self._stub.MigrateOut, convert.migrate_out_to_pb(order), self.order_timeout_s)
        return convert.order_result_from_pb(reply)

    async def drop_layers(self, layers: range, hold: bool = False, prepare: bool = False) -> LayerChange:
        req = ipb.DropLayersRequest(layers=convert.layers_to_pb(layers), hold=hold, prepare=prepare)
        reply = await self._call(self._stub.DropLayers, req, self.layers_timeout_s)
        return LayerChange(reply.blocks_added, reply.total_blocks)

    async def set_pipeline(self, own: range, peers=(), pause_exchange: bool = False, hold: bool = False) -> int:
        req = ipb.SetPipelineRequest(own=convert.layers_to_pb(own), pause_exchange=pause_exchange, hold=hold,
                                     peers=[ipb.PipelinePeer(layers=convert.layers_to_pb(r), address=a)
                                            for r, a in peers])
        return (await self._call(self._stub.SetPipeline, req, self.layers_timeout_s)).requests_moved

    async def restore_layers(self, layers: range, from_address: str) -> LayerChange:
        req = ipb.RestoreLayersRequest(layers=convert.layers_to_pb(layers), from_address=from_address)
        reply = await self._call(self._stub.RestoreLayers, req, self.layers_timeout_s)
        return LayerChange(reply.blocks_returned, reply.total_blocks)


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
