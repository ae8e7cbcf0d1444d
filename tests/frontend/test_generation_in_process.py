"""The frontend's promise without sockets: run_generation (dispatch, stream,
follow moves, resume after failures, exactly once by index) over in-process
peers (services/frontend/peers.py) into real instance agents
(services/instance/agent.py) that migrate, die and hand off mid-stream.
The fake engine reads its tokens back from its KV cache, so a request whose
KV was moved wrongly gets other tokens than an undisturbed run."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from libs.common.errors import FailedPrecondition
from libs.common.types import MigrateOutOrder, Priority, SamplingParams
from services.frontend.generation import Generation, run_generation
from services.frontend.peers import InProcessPeers
from services.frontend.router import Dispatched
from services.instance.agent import Agent
from services.instance.config import InstanceConfig
from services.instance.migration.peer import InProcessPeer

PROMPT = list(range(100, 140))
N = 60


class Registry:
    """The meta store's answer for agents of this process: who is where."""

    def __init__(self, agents: dict[str, Agent]):
        self.agents = agents

    async def check(self, instance_id: str, address: str, what: str = "destination") -> None:
        a = self.agents.get(address)
        if a is None or a.instance_id != instance_id:
            raise FailedPrecondition(f"{what} {instance_id!r} at {address} is not registered")

    async def close(self) -> None:
        pass


class _Watched:
    stalled = None

    def touch(self) -> None:
        pass


class LocalRouter:
    """The frontend's router over agents of this process: dispatch in order
    of ``plan`` (instance, decode instance or None) among those not excluded."""

    def __init__(self, agents: dict[str, Agent], plan: list[tuple[str, str | None]]):
        self.agents = agents
        self.by_id = {a.instance_id: (addr, a) for addr, a in agents.items()}
        self.plan = list(plan)
        self.peers = InProcessPeers(agents)
        self.watchdog = SimpleNamespace(stall_s=1e9, watch=lambda *a: _Watched(), unwatch=lambda w: None)
        self.view = SimpleNamespace(records=agents)
        self.dispatched: list[str] = []

    async def dispatch(self, request_id, num_prompt_tokens, priority, exclude, token_ids=None, affinity="",
                       program_id="") -> Dispatched:
        for iid, decode in self.plan:
            if iid not in exclude:
                self.dispatched.append(iid)
                addr = self.by_id[iid][0]
                if decode is None:
                    return Dispatched(iid, addr, priority)
                return Dispatched(iid, addr, priority, decode, self.by_id[decode][0])
        raise AssertionError(f"nothing to dispatch to: {exclude}")

    async def is_registered(self, instance_id: str, address: str) -> bool:
        return self.by_id.get(instance_id, (None,))[0] == address


@pytest.fixture
async def cluster():
    agents: dict[str, Agent] = {}

    async def add(name: str, port: int, **kw) -> Agent:
        cfg = InstanceConfig(engine="fake", instance_id=name, host="127.0.0.1", meta_store="127.0.0.1:1",
                             heartbeat_s=5.0, drain_timeout_s=0.0, num_blocks=256, **kw)
        a = Agent(cfg, migration_peers=lambda address: InProcessPeer(agents[address].migration.dest),
                  registered=Registry(agents))
        await a.start(f"127.0.0.1:{port}")
        agents[a.info.address] = a
        return a

    yield SimpleNamespace(agents=agents, add=add)
    for a in agents.values():
        await a.stop()


def _gen(rid: str) -> Generation:
    return Generation(rid, PROMPT, SamplingParams(max_tokens=N, min_tokens=N), Priority.NORMAL)


async def _collect(router, gen: Generation, got: list[int]) -> None:
    async for t in run_generation(router, gen):
        got.append(t)


async def _reference(cluster) -> list[int]:
    a = await cluster.add("ref", 1000, token_delay_ms=1)
    got: list[int] = []
    await _collect(LocalRouter({a.info.address: a}, [("ref", None)]), _gen("r"), got)
    del cluster.agents[a.info.address]
    await a.stop()
    return got


async def _idle_and_clean(*agents: Agent) -> None:
    for a in agents:
        for _ in range(200):
            r = await a.check_integrity()
            if r.num_requests == 0 and r.num_reservations == 0:
                break
            await asyncio.sleep(0.02)
        assert not r.error and r.free_blocks == r.total_blocks, r


async def _until_tokens(got: list[int], k: int) -> None:
    for _ in range(1000):
        if len(got) >= k:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{len(got)} tokens, waited for {k}")


async def test_a_request_migrated_mid_stream_arrives_exactly_once(cluster):
    want = await _reference(cluster)
    assert len(want) == N
    a = await cluster.add("a", 1001, token_delay_ms=10)
    b = await cluster.add("b", 1002, token_delay_ms=10)
    router = LocalRouter(cluster.agents, [("a", None), ("b", None)])
    gen, got = _gen("m"), []
    task = asyncio.create_task(_collect(router, gen, got))
    await _until_tokens(got, 10)
    result = await a.migration.migrate_out(MigrateOutOrder("b", b.info.address, request_id="m"))
    assert result.committed == 1, result
    await asyncio.wait_for(task, 30)
    assert got == want and gen.finish_reason == "length"
    assert gen.instances == ["a", "b"] and gen.num_migrations == 1 and gen.num_resumes == 0
    await _idle_and_clean(a, b)


async def test_a_request_whose_instance_dies_mid_stream_resumes_elsewhere_exactly_once(cluster):
    want = await _reference(cluster)
    a = await cluster.add("a", 1001, token_delay_ms=10)
    b = await cluster.add("b", 1002, token_delay_ms=10)
    router = LocalRouter(cluster.agents, [("a", None), ("b", None)])
    gen, got = _gen("d"), []
    task = asyncio.create_task(_collect(router, gen, got))
    await _until_tokens(got, 10)
    a._engine_died()  # every stream of a ends UNAVAILABLE, as when its engine thread dies
    await asyncio.wait_for(task, 30)
    assert got == want  # recomputed on b from the prompt and the delivered tokens; none twice, none lost
    assert gen.instances == ["a", "b"] and gen.num_resumes == 1 and router.dispatched == ["a", "b"]
    assert gen.recomputed_tokens >= len(PROMPT) + 10
    await _idle_and_clean(b)


async def test_a_request_handed_off_after_its_prompt_arrives_exactly_once(cluster):
    want = await _reference(cluster)
    a = await cluster.add("a", 1001, token_delay_ms=5, role="prefill")
    b = await cluster.add("b", 1002, token_delay_ms=5, role="decode")
    router = LocalRouter(cluster.agents, [("a", "b")])
    gen, got = _gen("h"), []
    await asyncio.wait_for(_collect(router, gen, got), 30)
    assert got == want
    assert gen.instances == ["a", "b"] and gen.num_migrations == 1 and gen.num_resumes == 0
    await _idle_and_clean(a, b)


async def test_a_client_that_leaves_aborts_its_request_at_the_instance(cluster):
    a = await cluster.add("a", 1001, token_delay_ms=10)
    router = LocalRouter(cluster.agents, [("a", None)])
    gen, got = _gen("gone"), []
    task = asyncio.create_task(_collect(router, gen, got))
    await _until_tokens(got, 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _idle_and_clean(a)
