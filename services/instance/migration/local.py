"""An in-process cluster of instances: each an engine on its own runner
thread, a stream table and a MigrationManager; peers call each other's
Destination directly (InProcessPeer). A Client follows ``moved`` events like
the frontend does and checks exactly-once, in-order delivery. The protocol
tests and ``ferry bench migration-local`` use it: no gRPC, the migration's
own costs only."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from libs.common.types import SamplingParams
from services.instance.engine.base import Engine, EngineRequest
from services.instance.migration.host import MigrationHost
from services.instance.migration.manager import MigrationManager
from services.instance.migration.messages import MigrationConfig
from services.instance.migration.peer import InProcessPeer
from services.instance.runner import EngineRunner
from services.instance.streams import StreamTable


class Node:
    def __init__(self, name: str, engine: Engine, cluster: Cluster, config: MigrationConfig | None = None):
        config = config or MigrationConfig()
        self.name = name
        self.engine = engine
        self.streams = StreamTable()
        self.load = engine.load()
        self.faults: dict[str, Callable[[], None]] = {}  # fault point -> action
        self.runner = EngineRunner(engine, asyncio.get_running_loop(), self._on_step, idle_wait_s=0.01)
        self.host = MigrationHost(name, self.runner, self.streams, load=lambda: self.load)
        self.runner.start()
        self.manager = MigrationManager(self.host, config, peers=cluster.peer, fault=self._fault,
                                        expire_interval_s=0.02)

    def _fault(self, point: str) -> None:
        action = self.faults.get(point)
        if action is not None:
            action()

    def _on_step(self, outputs, load) -> None:  # the agent's step callback, without its status and health
        self.streams.deliver(outputs, self.manager.handoffs.on_output)
        if load is not None:
            self.load = load

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

    async def stop(self) -> None:
        await self.manager.close()
        self.runner.stop()


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
    """One request followed across migrations."""

    cluster: Cluster
    request_id: str
    tokens: list[int] = dataclasses.field(default_factory=list)
    path: list[str] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    first_token: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    moved_at: list[int] = dataclasses.field(default_factory=list)  # token index of each `moved`
    times: list[float] = dataclasses.field(default_factory=list)  # perf_counter() at each token's arrival

    @property
    def where(self) -> str:
        return self.path[-1]

    async def run(self, node: str, prompt: list[int], max_tokens: int, handoff: str | None = None,
                  **sampling) -> list[int]:
        """``handoff``: a node to hand the request to once its prompt is done
        (Splitwise), planned and added as the instance agent does at Generate
        (Handoffs.plan, Handoffs.add: the mode by the node's threshold)."""
        n = self.cluster.nodes[node]
        stream = n.streams.open(self.request_id)
        stream.attached = True
        self.path.append(node)
        plan = None if handoff is None else n.manager.handoffs.plan(self.request_id, handoff, handoff, len(prompt))
        await n.manager.handoffs.add(EngineRequest(
            self.request_id, tuple(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling), 0,
            time.time()), plan)
        return await self.follow(node)

    async def follow(self, node: str) -> list[int]:
        """Read the request's stream at ``node`` (opened and attached there
        already) to its end, following every ``moved``."""
        stream = self.cluster.nodes[node].streams.get(self.request_id)
        while True:
            ev = None
            async for ev in stream.events(len(self.tokens)):
                if ev.token_id is not None:
                    assert ev.index == len(self.tokens), f"index {ev.index} after {len(self.tokens)} tokens"
                    self.tokens.append(ev.token_id)
                    self.times.append(time.perf_counter())
                    self.first_token.set()
                if ev.final:
                    break
            if ev.moved_to is None:
                self.finish_reason = ev.finish_reason
                return self.tokens
            assert ev.index == len(self.tokens), "moved at an index the client has not reached"
            self.moved_at.append(ev.index)
            n = self.cluster.nodes[ev.moved_to[0]]
            stream = n.streams.get(self.request_id)
            assert stream is not None and not stream.attached, "nothing to attach to at the destination"
            stream.attached = True
            self.path.append(n.name)

    async def wait_tokens(self, k: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.tokens) < k:
            assert time.monotonic() < deadline, f"{len(self.tokens)} tokens after {timeout_s} s"
            await asyncio.sleep(0.002)
