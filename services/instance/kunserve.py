"""KunServe's pipeline between instance agents (docs/kunserve.md): the gRPC
side of services/instance/engine/native/kunserve.py.

- ``GrpcPeer`` is a ``LayerPeer`` for an engine thread: each owner step is one
  ``LayerStep`` on a ``ForwardLayers`` stream to the peer holding the layers,
  and its reply. Releases travel on the same stream, so that a release never
  overtakes the step before it nor follows the next. While it waits, the engine
  thread runs the peers' steps queued for it (``EngineRunner.wait_serving_guests``):
  two instances that are each other's peers never wait on each other. A
  peer that cannot be reached raises EngineBroken: this instance has dropped
  layers that nobody runs, so it stops and its requests resume elsewhere
  (docs/design.md §7).
- ``PipelineHost`` serves ``DropLayers``, ``SetPipeline`` and the peers'
  ``ForwardLayers`` streams (their steps run on the engine thread via
  ``EngineRunner.guest_call``).
- Remote attention (the live KV exchange): inside a step, the peer may
  answer with an ``AttendRequest`` instead of the step's hidden states; the
  owner runs that attention on its engine thread (``EngineRunner.attend_call``)
  and writes the output back on the stream, then reads on. The peer's engine
  thread waits for it serving only attention (runner.py), so two members that
  each attend at the other never wait on each other.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import grpc
from prometheus_client import Counter

from libs.pb import instance_pb2 as pb
from libs.pb import instance_pb2_grpc as pb_grpc
from libs.common import convert, rpc
from libs.common.errors import FailedPrecondition, InvalidArgument
from libs.common.logging import get_logger
from libs.common.types import LayerChange
from services.instance.engine.base import EngineBroken, EngineError, PeerShort

log = get_logger(__name__)

# Exported on the instance's --metrics-port.
PEER_STEPS = Counter("ferry_pipeline_peer_steps_total", "Steps of this instance's requests run on a pipeline peer")
ATTENDS = Counter("ferry_pipeline_remote_attention_total",
                  "Remote attention (one layer of one step) this instance ran for a pipeline peer")
KV_BYTES = Counter("ferry_pipeline_kv_bytes_total",
                   "KV bytes of this instance's requests handed to pipeline peers (out) or taken back (back)",
                   ["direction"])
LAYER_CHANGES = Counter("ferry_pipeline_layer_changes_total", "Layer ranges dropped or restored here", ["op"])

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


def _raw(t, dtype: str) -> bytes:
    """A tensor's values as row-major bytes of ``dtype``."""
    return encode_hidden(t.reshape(t.shape[0], -1).to(_dtypes()[dtype]))[0]


def _attend(attend, a: pb.AttendRequest) -> bytes:
    """On the owner's engine thread: a peer's AttendRequest through ``attend``
    (model.Attend) -> its output's bytes in the request's dtype."""
    if a.rows <= 0 or a.head_dim <= 0:
        raise ValueError(f"attention for {a.rows} rows of head_dim {a.head_dim}")
    q, k, v = (decode_hidden(b, a.dtype, a.head_dim).view(a.rows, -1, a.head_dim) for b in (a.q, a.k, a.v))
    return _raw(attend(a.layer, q, k, v), a.dtype)


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
        self.attends = 0  # remote attention answered for the peer

    async def _exchange(self, msg: pb.LayerStep, attend=None) -> pb.LayerStepReply:
        if self._call is None:
            self._channel = rpc.channel(self.address)
            self._call = pb_grpc.InstanceStub(self._channel).ForwardLayers()
        await self._call.write(msg)
        while True:
            reply = await self._call.read()
            if reply is grpc.aio.EOF:
                raise ConnectionError("the peer ended the stream")
            if not reply.HasField("attend"):
                return reply
            try:  # the peer asks for attention over our cache (module doc)
                if attend is None:
                    raise EngineError("remote attention asked outside a step that has KV here")
                answer = pb.LayerStep(attended=await self.runner.attend_call(_attend, attend, reply.attend))
                self.attends += 1
                ATTENDS.inc()
            except (EngineError, ValueError, RuntimeError) as e:
                answer = pb.LayerStep(attend_error=str(e) or repr(e))
            await self._call.write(answer)

    def _send(self, msg: pb.LayerStep, attend=None) -> pb.LayerStepReply:
        fut = asyncio.run_coroutine_threadsafe(self._exchange(msg, attend), self.loop)
        try:
            return self.runner.wait_serving_guests(fut, self.timeout_s)
        except (grpc.RpcError, ConnectionError, TimeoutError) as e:
            self._call = None
            raise EngineBroken(f"pipeline peer {self.address} is gone ({e!r}): layers dropped here have no "
                               "holder") from e

    def forward_layers(self, layers: range, chunks, hidden, attend=None):
        data, dtype, size = encode_hidden(hidden)
        msg = pb.LayerStep(layers=convert.layers_to_pb(layers), hidden=data, dtype=dtype, hidden_size=size,
                           chunks=[pb.GuestChunk(request_id=c.request_id, start=c.start, num_new=c.num_new,
                                                 kv_at_owner=c.kv_at_owner) for c in chunks])
        reply = self._send(msg, attend)
        if reply.short:
            raise PeerShort(f"pipeline peer {self.address}: {reply.error}")
        if reply.error:
            raise RuntimeError(f"pipeline peer {self.address}: {reply.error}")
        self.steps += 1
        PEER_STEPS.inc()
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
            reply = self._send(pb.LayerStep(layers=convert.layers_to_pb(piece), fetch_kv=request_id, kv_tokens=num_tokens))
            if reply.error:
                raise EngineError(f"pipeline peer {self.address}: {reply.error}")
            parts.append(reply.kv)
            KV_BYTES.labels("back").inc(len(reply.kv))
        return b"".join(parts)

    def push_kv(self, layers: range, request_id: str, num_tokens: int, data) -> None:
        per = len(data) // max(1, len(layers))
        view = memoryview(data)
        for piece in self._pieces(layers, per):
            at = (piece.start - layers.start) * per
            reply = self._send(pb.LayerStep(layers=convert.layers_to_pb(piece), push_kv=request_id, kv_tokens=num_tokens,
                                            kv=bytes(view[at:at + len(piece) * per])))
            if reply.error:
                raise EngineError(f"pipeline peer {self.address}: {reply.error}")
            KV_BYTES.labels("out").inc(len(piece) * per)

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
        self._prepared: tuple[range, object] | None = None  # (layers, storage) of the latest DropLayers(prepare)

    def _native(self):
        if not hasattr(self.engine, "drop_layers"):
            raise FailedPrecondition(f"the {self.engine.name} engine cannot drop layers or join a pipeline")
        return self.engine

    def _check(self, r: range, what: str) -> range:
        layers = self.engine.kv_layout.num_layers
        if not 0 <= r.start < r.stop <= layers:
            raise InvalidArgument(f"{what}: layers {r.start}..{r.stop - 1} of a {layers}-layer model", param=what)
        return r

    async def drop_layers(self, layers: range, hold: bool = False, prepare: bool = False) -> LayerChange:
        """Drop these layers (their memory becomes KV blocks); ``hold``: take
        no step until the pipeline is set. ``prepare``: only make the grown
        storage now, and with ``hold`` also hold the steps from now (between
        two steps), as a merge's first round asks every member before any
        drops a layer the others' steps run (``NativeEngine.hold_steps``); a
        member that drops nothing is asked that with no layers."""
        engine = self._native()
        if prepare and hold and not len(layers):
            await self.runner.call(engine.hold_steps)
            return LayerChange(0, engine.num_total_blocks)
        layers = self._check(layers, "layers")
        t0 = time.perf_counter()
        try:
            # The grown KV storage is made off the engine thread (it steps on meanwhile), ahead
            # when the scheduler asks for it (prepare), else now.
            fresh = self._prepared[1] if self._prepared is not None and self._prepared[0] == layers else None
            self._prepared = None
            if fresh is None:
                fresh = await asyncio.to_thread(engine.prepare_drop, layers)
            prepared = time.perf_counter()
            if prepare:
                self._prepared = (layers, fresh)
                if hold:
                    await self.runner.call(engine.hold_steps)
                log.info("layers ready to drop", layers=f"{layers.start}-{layers.stop - 1}",
                         prepare_ms=round((prepared - t0) * 1000, 1))
                return LayerChange(0, engine.num_total_blocks)
            added, work = await self.runner.call(_timed, engine.drop_layers, layers, hold, fresh)
        except EngineError as e:
            raise FailedPrecondition(str(e)) from None
        LAYER_CHANGES.labels("drop").inc()
        log.info("layers dropped", layers=f"{layers.start}-{layers.stop - 1}", blocks_added=added,
                 prepare_ms=round((prepared - t0) * 1000, 1), work_ms=round(work * 1000, 1),
                 took_ms=round((time.perf_counter() - t0) * 1000, 1))
        return LayerChange(added, engine.num_total_blocks)

    async def set_pipeline(self, own: range, peers: Sequence[tuple[range, str]] = (),
                           pause_exchange: bool = False, hold: bool = False) -> int:
        """Run ``own`` here and the other layers on ``peers`` ((layers,
        address)); no peers and every layer: alone again. Returns the running
        requests whose KV went to the peers or came back."""
        engine = self._native()
        own = self._check(own, "own")
        stages = []
        for layers, address in peers:
            if not address:
                raise InvalidArgument("a pipeline peer without an address", param="peers")
            if address not in self.peers:
                self.peers[address] = GrpcPeer(address, self.runner)
            stages.append((self._check(layers, "peers"), self.peers[address]))
        solo = not stages and len(own) == engine.kv_layout.num_layers
        exchange = "left" if solo else ("pause" if pause_exchange else "live")
        if not solo and engine.executor.pipelined:
            exchange = "re-formed (pause)"  # a merge: NativeEngine._regroup
        t0 = time.perf_counter()
        try:
            if solo:
                moved, work = await self.runner.call(_timed, engine.leave_pipeline, not pause_exchange)
            else:
                moved, work = await self.runner.call(_timed, engine.enter_pipeline, own, stages, not pause_exchange,
                                                     hold)
        except EngineError as e:
            raise FailedPrecondition(str(e)) from None
        log.info("pipeline set", own=f"{own.start}-{own.stop - 1}", requests_moved=moved,
                 exchange=exchange,
                 peers=[f"{r.start}-{r.stop - 1}@{p.address}" for r, p in stages], work_ms=round(work * 1000, 1),
                 took_ms=round((time.perf_counter() - t0) * 1000, 1))
        return moved

    async def restore_layers(self, layers: range, from_address: str) -> LayerChange:
        """Fetch the layers' parameters from the peer that holds them, then
        take them back between steps (the pool gives their memory back)."""
        engine = self._native()
        layers = self._check(layers, "layers")
        if not from_address:
            raise InvalidArgument("from_address: the instance that holds the layers", param="from_address")
        states: dict[int, dict] = {i: {} for i in layers}
        t0 = time.perf_counter()
        async with rpc.channel(from_address) as ch:
            try:
                async for t in pb_grpc.InstanceStub(ch).FetchLayers(convert.layers_to_pb(layers)):
                    if t.layer not in states:
                        raise FailedPrecondition(f"the peer sent layer {t.layer}, not asked for")
                    states[t.layer][t.name] = decode_hidden(t.data, t.dtype, 1).view(tuple(t.shape))
            except grpc.aio.AioRpcError as e:
                raise FailedPrecondition(f"layers from {from_address}: {e.details()}") from None
        fetched = time.perf_counter()
        try:
            # Loaded and prepacked off the engine thread (it steps on meanwhile); installed between steps.
            built = await asyncio.to_thread(engine.build_layers, states)
            prepared = time.perf_counter()
            back, work = await self.runner.call(_timed, engine.restore_layers, states, built)
        except (EngineError, RuntimeError) as e:  # a missing or misshapen tensor: load_state_dict says which
            raise FailedPrecondition(f"restoring layers: {e}") from None
        LAYER_CHANGES.labels("restore").inc()
        log.info("layers restored", layers=f"{layers.start}-{layers.stop - 1}", source=from_address,
                 blocks_returned=back, fetch_ms=round((fetched - t0) * 1000, 1),
                 prepare_ms=round((prepared - fetched) * 1000, 1), work_ms=round(work * 1000, 1),
                 took_ms=round((time.perf_counter() - t0) * 1000, 1))
        return LayerChange(back, engine.pool.capacity - engine.pool.shrinking)

    async def fetch_layers(self, request: pb.LayerRange):
        """This instance's parameters of these layers, one tensor per message."""
        engine = self._native()
        layers = self._check(convert.layers_from_pb(request), "layers")
        try:
            states = await self.runner.call(engine.layer_states, layers)
        except EngineError as e:
            raise FailedPrecondition(str(e)) from None
        for i, state in states.items():
            for name, t in state.items():
                data, dtype, _ = encode_hidden(t.reshape(1, -1))
                yield pb.LayerTensor(layer=i, name=name, dtype=dtype, shape=list(t.shape), data=data)

    async def serve(self, steps):
        """The peers' steps, one reply each, in order (and the attention a
        step asks its owner for, module doc)."""
        steps = steps.__aiter__()
        while True:
            try:
                step = await steps.__anext__()
            except StopAsyncIteration:
                return
            if step.release:
                await self.runner.guest_call(self.engine.release_guests, list(step.release))
            if step.push_kv or step.fetch_kv:
                yield await self._kv(step)
                continue
            if step.attended or step.attend_error:
                yield pb.LayerStepReply(error="an attention answer outside a step that asked for one")
                continue
            if not step.chunks:
                yield pb.LayerStepReply()
                continue
            async for reply in self._forward(step, steps):
                yield reply

    async def _forward(self, step: pb.LayerStep, steps):
        """One peer's step here; while it runs, the attention it asks the
        owner for goes out as replies and the answers come in on ``steps``."""
        from services.instance.engine.native.kunserve import GuestChunk

        loop = asyncio.get_running_loop()
        asks: asyncio.Queue = asyncio.Queue()
        gone = pb.LayerStep(attend_error="the owner's stream ended")
        closed = False

        async def ask(request: pb.AttendRequest):
            if closed:  # the owner is gone: fail the step now, not after STEP_TIMEOUT_S
                return gone
            answer = loop.create_future()
            await asks.put((request, answer))
            return await answer

        def attend(layer, q, k, v):  # on the engine thread, inside forward_guest
            request = pb.AttendRequest(layer=layer, rows=q.shape[0], head_dim=q.shape[-1], dtype=step.dtype,
                                       q=_raw(q, step.dtype), k=_raw(k, step.dtype), v=_raw(v, step.dtype))
            fut = asyncio.run_coroutine_threadsafe(ask(request), loop)
            msg = self.runner.wait_serving_guests(fut, STEP_TIMEOUT_S, attends_only=True)
            if msg.attend_error or not msg.attended:
                raise EngineError(f"remote attention at the owner: {msg.attend_error or 'no answer'}")
            return decode_hidden(msg.attended, step.dtype, q.shape[1] * q.shape[2])

        try:
            hidden = decode_hidden(step.hidden, step.dtype, step.hidden_size)
        except ValueError as e:
            yield pb.LayerStepReply(error=str(e))
            return
        chunks = [GuestChunk(c.request_id, c.start, c.num_new, c.kv_at_owner) for c in step.chunks]
        task = asyncio.ensure_future(self.runner.guest_call(self.engine.forward_guest, convert.layers_from_pb(step.layers), chunks,
                                                            hidden, attend))
        answer = None
        try:
            while True:
                getter = asyncio.ensure_future(asks.get())
                try:
                    await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not getter.done():
                        getter.cancel()
                if not getter.done() or getter.cancelled():
                    break
                request, answer = getter.result()
                yield pb.LayerStepReply(attend=request)
                try:
                    msg = await steps.__anext__()
                except StopAsyncIteration:
                    msg = gone
                answer.set_result(msg)
                answer = None
        finally:  # the stream may end mid-step (the owner died): no engine thread waits on it then
            closed = True
            if answer is not None and not answer.done():
                answer.set_result(gone)
            while not asks.empty():
                asks.get_nowait()[1].set_result(gone)
        try:
            out = await task
        except (EngineError, ValueError) as e:
            yield pb.LayerStepReply(error=str(e), short=isinstance(e, PeerShort))
            return
        yield pb.LayerStepReply(hidden=encode_hidden(out)[0])

    async def _kv(self, step: pb.LayerStep) -> pb.LayerStepReply:
        layers = convert.layers_from_pb(step.layers)
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
