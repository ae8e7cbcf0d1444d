"""Migration between two simulated instances, as the simulator runs it: the
live MigrationManager, SourceMigration and Destination on the virtual clock
(ferry/sim/aio.py), the round trips and blocks charged by the cost model. A
committed migration moves every block, keeps the token stream exact and
costs what the model says in downtime; a refused one leaves the request
running at the source; no block leaks on either side. (Splitwise handoffs
run the same code: tests/sim/test_splitwise.py.)"""

import pytest

from ferry.sim.aio import DelayedPeer, SimLoop, TaskDone
from ferry.sim.instance import SimInstance
from ferry.sim.kernel import START, Kernel
from ferry.sim.params import Delays, TransferModel
from libs.common.types import MigrateOutOrder, SamplingParams
from services.instance.engine.base import EngineConfig, EngineRequest
from services.instance.engine.sim import SimProfile
from services.instance.migration.peer import InProcessPeer
from services.instance.migration.source import MigrationConfig

PROFILE = SimProfile.load("llama-7b-a10")
DELAYS = Delays(rpc_s=0.004, hop_s=0.0005)
TRANSFER = TransferModel(bytes_per_block=8 << 20, bandwidth_bytes_per_s=8e9)


def pair(dst_blocks: int | None = None):
    k = Kernel()
    tokens: dict[str, list[tuple[str, int]]] = {}

    def on_step(inst, outputs):
        for o in outputs:
            tokens.setdefault(o.request_id, []).append((inst.instance_id, o.index))

    def make(iid, blocks):
        cfg = EngineConfig(engine="sim", profile="llama-7b-a10", num_blocks=blocks)
        return SimInstance(k, iid, PROFILE, cfg, {}, 0.05, 0.5, DELAYS.hop_s, on_step, lambda i, s: None)

    return k, make("src", None), make("dst", dst_blocks), tokens


def live(k, src, dst, config=None):
    """The instances' live migration managers on a SimLoop over the kernel."""
    loop = SimLoop(k)
    k.loop = loop
    insts = {i.instance_id: i for i in (src, dst)}
    for inst in insts.values():
        inst.serve(loop, config or MigrationConfig(),
                   lambda a: DelayedPeer(InProcessPeer(insts[a].manager.dest), DELAYS.rpc_s, TRANSFER.seconds),
                   fault=lambda point: None, expire_interval_s=0.05)
    return loop


def order(k, loop, src, dst, outcomes, **kw):
    """A migrate-out order from src to dst as a kernel process (the
    simulator's scheduler runs it so); its outcomes go to ``outcomes``."""
    def run():
        task = loop.create_task(src.manager.migrate_out(MigrateOutOrder(
            dst.instance_id, dst.instance_id, stop_when_freeness_above=10.0, **kw)))
        result = yield TaskDone(task)
        outcomes.extend(result.results)
        return result.started, result.committed

    return k.spawn(run())


def idle(inst) -> bool:
    m = inst.manager
    return not m.reservations and m.migrating_in == m.migrating_out == 0


def start(k, src, n_prompt=1000, n_out=400):
    r = EngineRequest("r", (3,) * n_prompt, SamplingParams(max_tokens=n_out, min_tokens=n_out, ignore_eos=True),
                      arrival_time=k.now)
    src.submit(src.engine.add_request, r)
    k.run(until=START + 0.5)  # prefill and a few decode steps
    assert src.engine.request_phase("r")[0] == "running"


def test_a_committed_migration_moves_every_block_and_keeps_the_stream_exact():
    k, src, dst, tokens = pair()
    start(k, src)
    loop = live(k, src, dst)
    outcomes = []
    proc = order(k, loop, src, dst, outcomes)
    k.run(until=START + 60)
    assert proc.result == (1, 1)
    (out,) = outcomes
    assert out.committed and out.reason == ""
    on_src = sum(1 for iid, _ in tokens["r"] if iid == "src")
    assert out.blocks == -(-(1000 + on_src - 1) // 16)  # every block with KV at the suspend
    assert out.stages == 2  # a pre-copy stage, then the last one: the copy is fast against a step
    # Downtime, in model time: pre-allocate the last stage from the spare blocks (one round trip), copy
    # what is left, 1 to last_stage_max_blocks + 2 blocks (a round trip and bytes / bandwidth), commit,
    # and the engine calls' hops to the loop; the destination was idle (its first step at once).
    low = 3 * DELAYS.rpc_s + TRANSFER.seconds(1)
    assert low <= out.downtime_ms / 1000 <= 3 * DELAYS.rpc_s + TRANSFER.seconds(4) + 4 * DELAYS.hop_s
    seq = tokens["r"]
    assert [i for _, i in seq] == list(range(400))  # no token lost or repeated
    assert {iid for iid, _ in seq[:5]} == {"src"} and seq[-1][0] == "dst"
    for inst in (src, dst):
        inst.engine.check_integrity()
        assert inst.engine.pool.num_free == inst.engine.pool.num_blocks
        assert idle(inst)


def test_a_refused_migration_leaves_the_request_at_the_source():
    k, src, dst, tokens = pair(dst_blocks=20)  # 1000 tokens need 63 blocks: never fits
    start(k, src)
    loop = live(k, src, dst)
    outcomes = []
    proc = order(k, loop, src, dst, outcomes)
    k.run(until=START + 60)
    assert proc.result == (1, 0)
    (out,) = outcomes
    assert not out.committed and "refused" in out.reason
    assert [i for _, i in tokens["r"]] == list(range(400)) and {iid for iid, _ in tokens["r"]} == {"src"}
    for inst in (src, dst):
        inst.engine.check_integrity()
        assert inst.engine.pool.num_free == inst.engine.pool.num_blocks


def test_transfer_time_is_bytes_over_bandwidth_plus_stage_overhead():
    t = TransferModel.from_profile(PROFILE, stage_overhead_s=0.001)
    bpb = PROFILE.kv_bytes_per_token * PROFILE.block_size
    assert t.bytes_per_block == bpb
    assert t.seconds(0) == 0.0
    assert t.seconds(10) == pytest.approx(0.001 + 10 * bpb / (PROFILE.migration_bandwidth_gbps * 1e9 / 8))


def start_many(k, inst, n, n_prompt=400, n_out=400, prefix="r"):
    for i in range(n):
        # prompts of their own: one request's prefix would be a cache hit for the next
        r = EngineRequest(f"{prefix}{i}", (3 + i,) * n_prompt,
                          SamplingParams(max_tokens=n_out, min_tokens=n_out, ignore_eos=True), arrival_time=k.now)
        inst.submit(inst.engine.add_request, r)


def test_a_destination_with_a_queue_of_its_own_refuses():
    k, src, dst, _ = pair(dst_blocks=40)
    start(k, src)
    start_many(k, dst, 2, n_prompt=400, prefix="d")  # 25 blocks each: the second waits
    k.run(until=START + 0.6)
    assert sum(r.state == "waiting" for r in dst.engine.load().requests) == 1
    loop = live(k, src, dst)
    outcomes = []
    proc = order(k, loop, src, dst, outcomes)
    k.run(until=START + 1.0)
    assert proc.result == (1, 0)
    (out,) = outcomes
    assert "queue" in out.reason
    src.engine.check_integrity()
    dst.engine.check_integrity()


def test_an_order_runs_up_to_max_migrate_out_migrations_at_once():
    k, src, dst, _ = pair()
    start_many(k, src, 6)
    k.run(until=START + 0.5)
    loop = live(k, src, dst, MigrationConfig(max_migrate_out=3, max_migrate_in=8, max_migrate_out_per_dest=3))
    seen: list[int] = []

    def watch():
        seen.append(src.manager.migrating_out)
        if not proc.done:
            k.after(0.001, watch)

    src.set_terminating(True)  # a draining source moves everything
    outcomes = []
    proc = order(k, loop, src, dst, outcomes, max_requests=6)
    k.after(0.0, watch)
    k.run(until=START + 60)
    assert max(seen) == 3  # never more than the bound, and it is reached
    assert proc.result[1] == sum(o.committed for o in outcomes) > 0
    for inst in (src, dst):
        inst.engine.check_integrity()
        assert idle(inst)
