"""The live migration code on the simulator's virtual clock (ferry/sim/aio.py):
asyncio's sleeps, events and timeouts in model time, interleaved with the
simulator's own processes; the live MigrationManager, SourceMigration and
Destination moving a request between two simulated instances over a peer
that charges the cost model's delays, with exact tokens and the downtime
in model time."""

from __future__ import annotations

import asyncio

from ferry.sim.aio import DelayedPeer, SimLoop
from ferry.sim.instance import SimInstance
from ferry.sim.kernel import Delay, Kernel
from libs.common.types import GenerateOrder, MigrateOutOrder, SamplingParams
from services.instance.engine.base import EngineConfig
from services.instance.engine.fake import fake_generate
from services.instance.engine.sim import SimProfile
from services.instance.migration.messages import MigrationConfig
from services.instance.migration.peer import InProcessPeer


def test_asyncio_runs_on_the_kernels_clock():
    k = Kernel()
    loop = SimLoop(k)
    log = []

    async def a():
        log.append(("start", loop.time()))
        await asyncio.sleep(2.5)
        log.append(("slept", loop.time()))
        ev = asyncio.Event()
        loop.call_later(1.0, ev.set)
        await ev.wait()
        log.append(("event", loop.time()))
        try:
            await asyncio.wait_for(asyncio.sleep(10), 0.5)
        except TimeoutError:
            log.append(("timeout", loop.time()))
        log.append((tuple(await asyncio.gather(asyncio.sleep(1, "x"), asyncio.sleep(2, "y"))), loop.time()))
        return 42

    def process():
        yield Delay(1.0)
        log.append(("process", k.now))

    k.spawn(process())
    task = loop.create_task(a())
    loop.run(until=100.0)
    assert task.result() == 42
    assert log == [("start", 1.0), ("process", 2.0), ("slept", 3.5), ("event", 4.5), ("timeout", 5.0),
                   (("x", "y"), 7.0)]


PROMPT = [97 + (i * 7) % 26 for i in range(300)]
N = 60


def _instance(k: Kernel, iid: str, tokens: dict) -> SimInstance:
    profile = SimProfile.load("llama-7b-a10")

    def on_step(inst, outputs):
        for o in outputs:
            if o.token_id is not None:
                tokens.setdefault(o.request_id, []).append(o.token_id)

    return SimInstance(k, iid, profile, EngineConfig(engine="sim", num_blocks=400, block_size=16), {}, 0.1, 1.0,
                       1e-4, on_step, lambda inst, status: None, fake_tokens=True)


def test_the_live_migration_protocol_moves_a_request_between_simulated_instances():
    k = Kernel()
    loop = SimLoop(k)
    tokens: dict[str, list[int]] = {}
    a, b = _instance(k, "a", tokens), _instance(k, "b", tokens)
    rpc_s, per_block_s = 0.0016, 0.0004
    result = {}

    async def main():
        insts = {i.instance_id: i for i in (a, b)}

        def peer(address):
            return DelayedPeer(InProcessPeer(insts[address].manager.dest), rpc_s, lambda n: n * per_block_s)

        config = MigrationConfig(max_stages=4, last_stage_max_blocks=2, join_notice=False, shared_kv=False)
        for inst in insts.values():
            inst.serve(loop, config, peer, fault=lambda point: None, expire_interval_s=0.05)
        managers = {iid: inst.manager for iid, inst in insts.items()}
        await a.agent.admit(GenerateOrder("r", tuple(PROMPT), SamplingParams(max_tokens=N, ignore_eos=True)))
        while len(tokens.get("r", ())) < 10:
            await asyncio.sleep(0.01)
        t0 = loop.time()
        result["order"] = await managers["a"].migrate_out(MigrateOutOrder("b", "b", request_id="r"))
        result["took_s"] = loop.time() - t0
        while len(tokens["r"]) < N:
            await asyncio.sleep(0.05)
        for m in managers.values():
            await m.close()

    task = loop.create_task(main())
    loop.run(until=200.0)
    task.result()
    order = result["order"]
    assert order.committed == 1, order
    out = order.results[0]
    assert tokens["r"] == fake_generate(PROMPT, N)  # the fake model reads its KV back: the blocks moved intact
    assert out.blocks >= len(PROMPT) // 16 and out.stages >= 2
    # Measured in model time: the order's duration is the loop's, the suspend -> commit acknowledgement is
    # the last stage's round trips and blocks (here 1.6 ms each, 0.4 ms a block), not wall time.
    assert abs(out.duration_ms - result["took_s"] * 1000) < out.duration_ms * 0.05
    assert 2 * rpc_s * 1000 < out.commit_ack_ms < 100
    for inst in (a, b):
        inst.engine.check_integrity()
