"""KunServe's pipeline between instance agents (docs/kunserve.md): the gRPC
side of services/instance/engine/native/pipeline.py.

- ``GrpcPeer`` is a ``LayerPeer`` for an engine thread: each owner step is one
  ``LayerStep`` on a ``ForwardLayers`` stream to the peer holding the layers,
  and its reply. Releases travel on the same stream, so that a release never
  overtakes the step before it nor follows the next. While it waits, the engine
  thread runs the peers' steps queued for it (``EngineRunner.wait_serving_guests``):
  two instances that are each other's peers never wait on each other. A
  peer that cannot be reached raises EngineBroken: this instance has dropped
  layers that nobody runs, so it stops and its requests resume elsewhere
  (DESIGN §7).
- ``PipelineHost`` serves ``DropLayers``, ``SetPipeline`` and the peers'
  ``ForwardLayers`` streams (their steps run on the engine thread via
  ``EngineRunner.guest_call``).
"""

from __future__ import annotations

import asyncio
import time

import grpc

from ferry.pb import instance_pb2 as pb
from ferry.pb import instance_pb2_grpc as pb_grpc
from libs.common import rpc
from libs.common.errors import FailedPrecondition, InvalidArgument
from libs.common.logging import get_logger
from services.instance.engine.base import EngineBroken, EngineError, PeerShort

log = get_logger(__name__)

STEP_TIMEOUT_S = 60.0
KV_MESSAGE_BYTES = 32 * 2**20


def _timed(fn, *args):
    """fn(*args) and how long it ran (on the engine thread: without the wait for a step to end)."""
    t = time.perf_counter()
    return fn(*args), time.perf_counter() - t


def _dtypes():
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def encode_hidden(hidden) -> tuple[bytes, str, int]:
    """A [T, H] tensor -> (row-major bytes, dtype name, H)."""
    import torch

    names = {v: k for k, v in _dtypes().items()}
    h = hidden.detach().to("cpu").contiguous()
    return h.view(torch.uint8).numpy().tobytes(), names[h.dtype], int(h.shape[1]) if h.dim() == 2 else 0


def decode_hidden(data: bytes, dtype: str, hidden_size: int):
    import torch

    try:
        dt = _dtypes()[dtype]
    except KeyError:
        raise ValueError(f"hidden states of dtype {dtype!r}; known: {', '.join(_dtypes())}") from None
    if hidden_size <= 0:
        raise ValueError(f"hidden_size {hidden_size}")
    elt = torch.tensor([], dtype=dt).element_size()
    if len(data) % (elt * hidden_size):
        raise ValueError(f"{len(data)} bytes are not rows of {hidden_size} {dtype} values")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).view(-1, hidden_size)


def _range(r: pb.LayerRange) -> range:
    return range(r.start, r.stop)


def _pb_range(r: range) -> pb.LayerRange:
    return pb.LayerRange(start=r.start, stop=r.stop)


class GrpcPeer:
    """A LayerPeer over gRPC, called from the engine thread (module doc)."""

    def __init__(self, address: str, runner, timeout_s: float = STEP_TIMEOUT_S):
        self.address = address
        self.runner = runner
        self.loop = runner.loop
        self.timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._call = None
        self.steps = 0

    async def _exchange(self, msg: pb.LayerStep) -> pb.LayerStepReply:
        if self._call is None:
            self._channel = rpc.channel(self.address)
            self._call = pb_grpc.InstanceStub(self._channel).ForwardLayers()
        await self._call.write(msg)
        reply = await self._call.read()
        if reply is grpc.aio.EOF:
            raise ConnectionError("the peer ended the stream")
        return reply

    def _send(self, msg: pb.LayerStep) -> pb.LayerStepReply:
        fut = asyncio.run_coroutine_threadsafe(self._exchange(msg), self.loop)
        try:
            return self.runner.wait_serving_guests(fut, self.timeout_s)
        except (grpc.RpcError, ConnectionError, TimeoutError) as e:
            self._call = None
            raise EngineBroken(f"pipeline peer {self.address} is gone ({e!r}): layers dropped here have no "
                               "holder") from e

    def forward_layers(self, layers: range, chunks, hidden):
        data, dtype, size = encode_hidden(hidden)
        msg = pb.LayerStep(layers=_pb_range(layers), hidden=data, dtype=dtype, hidden_size=size,
                           chunks=[pb.GuestChunk(request_id=c.request_id, start=c.start, num_new=c.num_new)
                                   for c in chunks])
        reply = self._send(msg)
        if reply.short:
            raise PeerShort(f"pipeline peer {self.address}: {reply.error}")
        if reply.error:
            raise RuntimeError(f"pipeline peer {self.address}: {reply.error}")
        self.steps += 1
        return decode_hidden(reply.hidden, dtype, size).to(hidden.device)

    def release(self, request_ids: list[str]) -> None:
        self._send(pb.LayerStep(release=list(request_ids)))

    # A request's KV moves in as few messages as fit KV_MESSAGE_BYTES, whole
    # layers each (a message is at most 64 MiB: rpc.GRPC_OPTIONS). Each one
    # waits for the peer's engine thread to be between steps: one message per
    # layer made a 2-member group take 3-5 s to form on 4 busy instances.
    def _pieces(self, layers: range, layer_bytes: int) -> list[range]:
        per = max(1, KV_MESSAGE_BYTES // max(1, layer_bytes))
        return [range(i, min(i + per, layers.stop)) for i in range(layers.start, layers.stop, per)]

    def fetch_kv(self, layers: range, request_id: str, num_tokens: int, layer_bytes: int = 0) -> bytes:
        parts = []
        for piece in self._pieces(layers, layer_bytes):
            reply = self._send(pb.LayerStep(layers=_pb_range(piece), fetch_kv=request_id, kv_tokens=num_tokens))
            if reply.error:
                raise EngineError(f"pipeline peer {self.address}: {reply.error}")
            parts.append(reply.kv)
        return b"".join(parts)

    def push_kv(self, layers: range, request_id: str, num_tokens: int, data) -> None:
        per = len(data) // max(1, len(layers))
        view = memoryview(data)
        for piece in self._pieces(layers, per):
            at = (piece.start - layers.start) * per
            reply = self._send(pb.LayerStep(layers=_pb_range(piece), push_kv=request_id, kv_tokens=num_tokens,
                                            kv=bytes(view[at:at + len(piece) * per])))
            if reply.error:
                raise EngineError(f"pipeline peer {self.address}: {reply.error}")

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._channel is not None:
            await self._channel.close()


class PipelineHost:
    """The agent's side of KunServe's pipeline (module doc)."""

    def __init__(self, engine, runner):
        self.engine = engine
        self.runner = runner
        self.peers: dict[str, GrpcPeer] = {}

    def _native(self):
        if not hasattr(self.engine, "drop_layers"):
            raise FailedPrecondition(f"the {self.engine.name} engine cannot drop layers or join a pipeline")
        return self.engine

    def _check(self, r: range, what: str) -> range:
        layers = self.engine.kv_layout.num_layers
        if not 0 <= r.start < r.stop <= layers:
            raise InvalidArgument(f"{what}: layers {r.start}..{r.stop - 1} of a {layers}-layer model", param=what)
        return r

    async def drop_layers(self, request: pb.DropLayersRequest) -> pb.DropLayersReply:
        engine = self._native()
        layers = self._check(_range(request.layers), "layers")
        t0 = time.perf_counter()
        try:
            added, work = await self.runner.call(_timed, engine.drop_layers, layers, request.hold)
        except EngineError as e:
            raise FailedPrecondition(str(e)) from None
        log.info("layers dropped", layers=f"{layers.start}-{layers.stop - 1}", blocks_added=added,
                 work_ms=round(work * 1000, 1), took_ms=round((time.perf_counter() - t0) * 1000, 1))
        return pb.DropLayersReply(blocks_added=added, total_blocks=engine.num_total_blocks)

    async def set_pipeline(self, request: pb.SetPipelineRequest) -> pb.SetPipelineReply:
        engine = self._native()
        own = self._check(_range(request.own), "own")
        peers = []
        for p in request.peers:
            if not p.address:
                raise InvalidArgument("a pipeline peer without an address", param="peers")
            if p.address not in self.peers:
                self.peers[p.address] = GrpcPeer(p.address, self.runner)
            peers.append((self._check(_range(p.layers), "peers"), self.peers[p.address]))
        solo = not peers and len(own) == engine.kv_layout.num_layers
        t0 = time.perf_counter()
        try:
            if solo:
                moved, work = await self.runner.call(_timed, engine.leave_pipeline)
            else:
                moved, work = await self.runner.call(_timed, engine.enter_pipeline, own, peers)
        except EngineError as e:
            raise FailedPrecondition(str(e)) from None
        log.info("pipeline set", own=f"{own.start}-{own.stop - 1}", requests_moved=moved,
                 peers=[f"{r.start}-{r.stop - 1}@{p.address}" for r, p in peers], work_ms=round(work * 1000, 1),
                 took_ms=round((time.perf_counter() - t0) * 1000, 1))
        return pb.SetPipelineReply(requests_moved=moved)

    async def restore_layers(self, request: pb.RestoreLayersRequest) -> pb.RestoreLayersReply:
        """Fetch the layers' parameters from the peer that holds them, then
        take them back between steps (the pool gives their memory back)."""
        engine = self._native()
        layers = self._check(_range(request.layers), "layers")
        if not request.from_address:
            raise InvalidArgument("from_address: the instance that holds the layers", param="from_address")
        states: dict[int, dict] = {i: {} for i in layers}
        t0 = time.perf_counter()
        async with rpc.channel(request.from_address) as ch:
            try:
                async for t in pb_grpc.InstanceStub(ch).FetchLayers(_pb_range(layers)):
                    if t.layer not in states:
                        raise FailedPrecondition(f"the peer sent layer {t.layer}, not asked for")
                    states[t.layer][t.name] = decode_hidden(t.data, t.dtype, 1).view(tuple(t.shape))
            except grpc.aio.AioRpcError as e:
                raise FailedPrecondition(f"layers from {request.from_address}: {e.details()}") from None
        fetched = time.perf_counter()
        try:
            back, work = await self.runner.call(_timed, engine.restore_layers, states)
        except (EngineError, RuntimeError) as e:  # a missing or misshapen tensor: load_state_dict says which
            raise FailedPrecondition(f"restoring layers: {e}") from None
        log.info("layers restored", layers=f"{layers.start}-{layers.stop - 1}", source=request.from_address,
                 blocks_returned=back, fetch_ms=round((fetched - t0) * 1000, 1), work_ms=round(work * 1000, 1),
                 took_ms=round((time.perf_counter() - t0) * 1000, 1))
        return pb.RestoreLayersReply(blocks_returned=back,
                                     total_blocks=engine.pool.capacity - engine.pool.shrinking)

    async def fetch_layers(self, request: pb.LayerRange):
        """This instance's parameters of these layers, one tensor per message."""
        engine = self._native()
        layers = self._check(_range(request), "layers")
        try:
            states = await self.runner.call(engine.layer_states, layers)
        except EngineError as e:
            raise FailedPrecondition(str(e)) from None
        for i, state in states.items():
            for name, t in state.items():
                data, dtype, _ = encode_hidden(t.reshape(1, -1))
                yield pb.LayerTensor(layer=i, name=name, dtype=dtype, shape=list(t.shape), data=data)

    async def serve(self, steps):
        """The peers' steps, one reply each, in order."""
        from services.instance.engine.native.pipeline import GuestChunk

        async for step in steps:
            if step.release:
                await self.runner.guest_call(self.engine.release_guests, list(step.release))
            if step.push_kv or step.fetch_kv:
                yield await self._kv(step)
                continue
            if not step.chunks:
                yield pb.LayerStepReply()
                continue
            try:
                hidden = decode_hidden(step.hidden, step.dtype, step.hidden_size)
                chunks = [GuestChunk(c.request_id, c.start, c.num_new) for c in step.chunks]
                out = await self.runner.guest_call(self.engine.forward_guest, _range(step.layers), chunks, hidden)
            except (EngineError, ValueError) as e:
                yield pb.LayerStepReply(error=str(e), short=isinstance(e, PeerShort))
                continue
            yield pb.LayerStepReply(hidden=encode_hidden(out)[0])

    async def _kv(self, step: pb.LayerStep) -> pb.LayerStepReply:
        layers = _range(step.layers)
        try:
            if step.push_kv:
                await self.runner.guest_call(self.engine.adopt_guest_kv, step.push_kv, layers, step.kv_tokens,
                                             step.kv)
                return pb.LayerStepReply()
            kv = await self.runner.guest_call(self.engine.guest_kv, step.fetch_kv, layers, step.kv_tokens)
            return pb.LayerStepReply(kv=bytes(kv))
        except (EngineError, ValueError) as e:
            return pb.LayerStepReply(error=str(e))

    async def close(self) -> None:
        for p in self.peers.values():
            await p.close()
