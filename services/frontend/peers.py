"""How the frontend reaches an instance, whatever the transport: a call that
yields StreamEvents and can be cancelled (which aborts the request there),
over gRPC (``GrpcPeers``) or straight into instances of this process
(``InProcessPeers``: agents, for the exactly-once tests of
services/frontend/generation.py without sockets; the nodes of the in-process
cluster of ferry/inprocess.py, whose Client follows moves
with the same loop). A call that fails raises ``PeerError``, a
FerryError with the instance's status code."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc

from libs.common import convert, tracing
from libs.common.errors import Code, FerryError, from_grpc
from libs.common.types import GenerateOrder, StreamEvent
from libs.pb import instance_pb2 as ipb
from services.frontend.tracing import CallTrace, call_span


class PeerError(FerryError):
    """The instance call failed (its status): not an error the frontend's own
    loop raised."""


class InstanceCall(Protocol):
    def __aiter__(self) -> AsyncIterator[StreamEvent]: ...

    def cancel(self) -> None: ...


class InstancePeers(Protocol):
    def generate(self, address: str, order: GenerateOrder) -> InstanceCall: ...

    def attach(self, address: str, request_id: str, from_index: int, flush_interval_ms: int = 0) -> InstanceCall: ...


class LocalInstance(Protocol):
    """What InProcessPeers calls: services/instance/agent.py's Agent, or a
    Node of ferry/inprocess.py. Both raise FerryErrors."""

    def generate(self, order: GenerateOrder) -> AsyncIterator[StreamEvent]: ...

    def attach(self, request_id: str, from_index: int, flush_interval_ms: int = 0) -> AsyncIterator[StreamEvent]: ...


class _GrpcCall:
    def __init__(self, call, trace: CallTrace | None = None):
        self._call = call
        self._trace = trace

    def cancel(self) -> None:
        self._call.cancel()
        if self._trace is not None:
            self._trace.end()

    async def __aiter__(self):
        t = self._trace
        try:
            async for m in self._call:
                ev = convert.stream_event_from_pb(m)
                if t is not None:
                    t.saw(ev)
                yield ev
        except grpc.RpcError as e:
            err = from_grpc(e)
            if t is not None:
                t.end(err.code.name)
            raise PeerError(str(err), code=err.code) from e
        finally:
            if t is not None:
                t.end()


class GrpcPeers:
    """Instances over gRPC; ``stub_for(address)`` gives the (pooled) stub."""

    def __init__(self, stub_for: Callable[[str], object]):
        self._stub = stub_for

    def generate(self, address: str, order: GenerateOrder) -> InstanceCall:
        t = call_span("generate", address, order.request_id, len(order.resume_token_ids))
        if t is None:
            return _GrpcCall(self._stub(address).Generate(convert.order_to_pb(order)))
        with tracing.use(t.span):  # the call's metadata carries its context
            return _GrpcCall(self._stub(address).Generate(convert.order_to_pb(order)), t)

    def attach(self, address: str, request_id: str, from_index: int, flush_interval_ms: int = 0) -> InstanceCall:
        req = ipb.AttachRequest(request_id=request_id, from_index=from_index, flush_interval_ms=flush_interval_ms)
        t = call_span("attach", address, request_id)
        if t is None:
            return _GrpcCall(self._stub(address).Attach(req))
        with tracing.use(t.span):
            return _GrpcCall(self._stub(address).Attach(req), t)


_DONE = object()


class _LocalCall:
    """An agent's stream run on a task of its own, as a gRPC call runs on the
    server: cancel() cancels that task (the agent sees its client go away and
    aborts the request) and ends the iteration with CancelledError, as a
    cancelled gRPC call does."""

    def __init__(self, events: AsyncIterator[StreamEvent], trace: CallTrace | None = None):
        self._q: asyncio.Queue = asyncio.Queue()
        self._trace = trace
        with tracing.use(trace.span if trace is not None else None):  # the agent's side runs under the call's span
            self._task = asyncio.get_running_loop().create_task(self._pump(events))
        self._cancelled = False

    async def _pump(self, events: AsyncIterator[StreamEvent]) -> None:
        try:
            async for e in events:
                self._q.put_nowait(e)
        except FerryError as e:
            self._q.put_nowait(PeerError(str(e), code=e.code))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a transport ends a call on any server error
            self._q.put_nowait(PeerError(repr(e), code=Code.INTERNAL))
        finally:
            await events.aclose()
            self._q.put_nowait(_DONE)

    def cancel(self) -> None:
        if not self._task.done():
            self._cancelled = True
            self._task.cancel()
            self._q.put_nowait(asyncio.CancelledError())
        if self._trace is not None:
            self._trace.end()

    async def __aiter__(self):
        t = self._trace
        try:
            while True:
                item = await self._q.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    if t is not None:
                        t.end(item.code.name if isinstance(item, PeerError) else "cancelled")
                    raise item
                if t is not None:
                    t.saw(item)
                yield item
        finally:
            self.cancel()


class InProcessPeers:
    """Instances of this process by address (LocalInstance: agents, or the
    in-process cluster's nodes)."""

    def __init__(self, agents: dict[str, LocalInstance] | None = None):
        self.agents: dict[str, LocalInstance] = agents if agents is not None else {}

    def _agent(self, address: str) -> LocalInstance:
        agent = self.agents.get(address)
        if agent is None:
            raise PeerError(f"no instance at {address}", code=Code.UNAVAILABLE)
        return agent

    def generate(self, address: str, order: GenerateOrder) -> InstanceCall:
        agent = self._agent(address)
        return _LocalCall(agent.generate(order),
                          call_span("generate", address, order.request_id, len(order.resume_token_ids)))

    def attach(self, address: str, request_id: str, from_index: int, flush_interval_ms: int = 0) -> InstanceCall:
        agent = self._agent(address)
        return _LocalCall(agent.attach(request_id, from_index, flush_interval_ms),
                          call_span("attach", address, request_id))
