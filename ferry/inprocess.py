"""An in-process cluster of instances: each a real instance ``Agent`` with
its engine on its own runner thread; peers call each other's Destination
directly (InProcessPeer). A Client reads its request with
the frontend's own loop (services/frontend/generation.py: run_generation
over InProcessPeers), following ``moved`` events, with a strict check of
exactly-once, in-order delivery. The protocol tests and ``ferry bench
migration-local`` use it: no gRPC, the migration's own costs only."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from types import SimpleNamespace

from libs.common.types import GenerateOrder, Priority, SamplingParams
from services.frontend.generation import Generation, run_generation
from services.frontend.peers import InProcessPeers, InstanceCall
from services.frontend.router import Dispatched
from services.instance.agent import Agent
from services.instance.config import InstanceConfig
from services.instance.engine.base import Engine
from services.instance.migration.messages import MigrationConfig
from services.instance.migration.peer import InProcessPeer
from services.instance.registered import Everyone
from services.instance.runner import EngineRunner


class Node(Agent):
    """An instance agent in this process: a real ``Agent`` on an engine
    thread (EngineRunner), with peers that call each other's Destination
    directly, no queue bound and no meta store (every instance known), and
    the tests' hooks: ``faults`` (fault point -> action), ``check_clean``."""

    def __init__(self, name: str, engine: Engine, cluster: Cluster, config: MigrationConfig | None = None):
        super().__init__(InstanceConfig(instance_id=name, max_queued_tokens=0, drain_timeout_s=0),
                         registered=Everyone(), engine=engine)
        self.name = name
        self.faults: dict[str, Callable[[], None]] = {}  # fault point -> action
        runner = EngineRunner(engine, asyncio.get_running_loop(), self._on_step, idle_wait_s=0.01)
        runner.start()
        self.attach_ports(runner, migration_config=config or MigrationConfig(), fault=self._fault,
                          expire_interval_s=0.02, peers=cluster.peer)

    @property
    def manager(self):
        """The agent's MigrationManager."""
        return self.migration

    @property
    def host(self):
        return self.migration.host

    def _fault(self, point: str) -> None:
        action = self.faults.get(point)
        if action is not None:
            action()

    async def check_clean(self, timeout_s: float = 5.0) -> None:
        """Idle, no reservation, every block free, check_integrity passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            idle = not await self.runner.call(self.engine.has_work)
            free = await self.runner.call(lambda: self.engine.num_free_blocks)
            if idle and not self.manager.reservations and free == self.engine.num_total_blocks \
                    and not self.manager.outgoing:
                break
            assert time.monotonic() < deadline, (
                f"{self.name}: idle={idle} reservations={dict(self.manager.reservations)} "
                f"free={free}/{self.engine.num_total_blocks} outgoing={list(self.manager.outgoing)}")
            await asyncio.sleep(0.02)
        await self.runner.call(self.engine.check_integrity)


class Cluster:
    def __init__(self):
        self.nodes: dict[str, Node] = {}
        self.peer_wrappers: dict[str, Callable] = {}  # node name -> wrap(InProcessPeer)

    def add(self, name: str, engine: Engine, config: MigrationConfig | None = None) -> Node:
        self.nodes[name] = Node(name, engine, self, config)
        return self.nodes[name]

    def peer(self, address: str):
        p = InProcessPeer(self.nodes[address].manager.dest)
        wrap = self.peer_wrappers.get(address)
        return wrap(p) if wrap else p

    async def stop(self) -> None:
        for n in self.nodes.values():
            await n.stop()


@dataclasses.dataclass
class Client:
    """One request followed across migrations by the frontend's loop
    (run_generation), never resumed elsewhere: a stream that fails fails
    the Client. Its transport (``_ClientRouter``) checks every event
    strictly: tokens at exactly the index the client reached, a ``moved``
    only there, and a stream to attach to at the destination."""

    cluster: Cluster
    request_id: str
    tokens: list[int] = dataclasses.field(default_factory=list)
    path: list[str] = dataclasses.field(default_factory=list)  # the nodes it ran on, in order
    finish_reason: str | None = None
    first_token: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    moved_at: list[int] = dataclasses.field(default_factory=list)  # token index of each `moved`
    times: list[float] = dataclasses.field(default_factory=list)  # perf_counter() at each token's arrival

    @property
    def where(self) -> str:
        return self.path[-1]

    async def run(self, node: str, prompt: list[int], max_tokens: int, handoff: str | None = None,
                  program_id: str = "", **sampling) -> list[int]:
        """Generate at ``node`` and read to the end. ``handoff``: a node to
        hand the request to once its prompt is done (Splitwise), planned and
        added as the instance agent does at Generate; ``program_id``: the
        program it is a turn of."""
        gen = Generation(self.request_id, list(prompt),
                         SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling), program_id=program_id)
        return await self._read(gen, _ClientRouter(self, node, handoff or ""))

    async def follow(self, node: str) -> list[int]:
        """Read the stream of a request the test entered at ``node`` itself
        (its stream opened there, nobody attached) to its end: Generate is
        Attach from the first token."""
        gen = Generation(self.request_id, [], SamplingParams())
        return await self._read(gen, _ClientRouter(self, node, "", entered=True))

    async def _read(self, gen: Generation, router: _ClientRouter) -> list[int]:
        gen.instances = self.path  # run_generation appends where it starts and each move it follows
        async for token in run_generation(router, gen, max_resumes=0):
            self.tokens.append(token)
            self.times.append(time.perf_counter())
            self.first_token.set()
        self.finish_reason = gen.finish_reason
        return self.tokens

    async def wait_tokens(self, k: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.tokens) < k:
            assert time.monotonic() < deadline, f"{len(self.tokens)} tokens after {timeout_s} s"
            await asyncio.sleep(0.002)


class _Unwatched:
    """run_generation's stall watchdog, off (the tests' own timeouts), and
    what it watches."""

    stall_s = 0.0
    stalled = None

    def watch(self, *_) -> _Unwatched:
        return self

    def touch(self) -> None:
        pass

    def unwatch(self, _) -> None:
        pass


class _ClientRouter:
    """What run_generation asks of the frontend's router, for one Client:
    the request starts at ``node`` (with its Splitwise ``handoff`` node, or
    ""), a move is followed to any node of the cluster (name = address), and
    the nodes are reached through InProcessPeers, every call checked by
    ``_Checked``."""

    def __init__(self, client: Client, node: str, handoff: str, entered: bool = False):
        self.client, self.node, self.handoff, self.entered = client, node, handoff, entered
        self.nodes = client.cluster.nodes
        self.inner = InProcessPeers(self.nodes)
        self.peers = self
        self.watchdog = _Unwatched()
        self.view = SimpleNamespace(records=self.nodes)

    async def dispatch(self, request_id: str, num_prompt_tokens: int, priority: Priority, exclude: frozenset,
                       token_ids=None, affinity: str = "", program_id: str = "") -> Dispatched:
        assert not exclude, f"{request_id} would resume elsewhere (excluded: {sorted(exclude)})"
        return Dispatched(self.node, self.node, priority, self.handoff, self.handoff)

    async def is_registered(self, instance_id: str, address: str) -> bool:
        return instance_id == address and address in self.nodes

    def generate(self, address: str, order: GenerateOrder) -> InstanceCall:
        if self.entered:  # follow(): the request is at the node already
            return self.attach(address, order.request_id, 0)
        return _Checked(self.client, self.inner.generate(address, order))

    def attach(self, address: str, request_id: str, from_index: int, flush_interval_ms: int = 0) -> InstanceCall:
        stream = self.nodes[address].streams.get(request_id)
        assert stream is not None and not stream.attached, f"nothing to attach to at {address}"
        return _Checked(self.client, self.inner.attach(address, request_id, from_index, flush_interval_ms))


class _Checked:
    """A node's call as the Client reads it, checked strictly: tokens only
    at exactly the index the client reached (run_generation itself raises on
    a gap but drops a repeat silently), a
    ``moved`` only there (recorded in ``moved_at``). The client has taken
    every token of an event before run_generation reads the next one."""

    def __init__(self, client: Client, call: InstanceCall):
        self.client, self.call = client, call

    def cancel(self) -> None:
        self.call.cancel()

    async def __aiter__(self):
        async for ev in self.call:
            reached = len(self.client.tokens)
            if ev.token_ids:
                assert ev.index == reached, f"index {ev.index} after {reached} tokens"
            if ev.moved is not None:
                assert ev.moved.next_index == reached + len(ev.token_ids), "moved at an index the client has not reached"
                self.client.moved_at.append(ev.moved.next_index)
            yield ev
