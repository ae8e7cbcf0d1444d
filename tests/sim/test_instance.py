"""A simulated instance is the live sim engine on a virtual clock: the same
tokens at the same step ends as a SimEngine stepped by hand where every step
lasts what its executor computed (no sleeping), preemptions and priorities
included; and its cheap report trigger fires whenever the live one would."""

import itertools
import random

from ferry.sim.instance import SimInstance
from ferry.sim.kernel import START, Kernel
from libs.common.types import Priority, SamplingParams
from services.instance.engine.base import EngineConfig, EngineRequest
from services.instance.engine.sim import SimEngine, SimProfile
from services.instance.status import material

PROFILE = SimProfile.load("llama-7b-a10")
CONFIG = EngineConfig(engine="sim", profile="llama-7b-a10", num_blocks=60, max_num_batched_tokens=256)


def workload(seed: int, n: int = 40) -> list[tuple[float, EngineRequest]]:
    rng = random.Random(seed)
    t, out = START, []
    for i in range(n):
        t += rng.expovariate(20.0)
        p, o = rng.randint(1, 300), rng.randint(1, 120)
        prio = Priority.HIGH if rng.random() < 0.2 else Priority.NORMAL
        out.append((t, EngineRequest(f"r{i}", (5,) * p, SamplingParams(max_tokens=o, min_tokens=o, ignore_eos=True),
                                     prio, arrival_time=t)))
    return out


def reference(reqs) -> tuple[list, dict]:
    """The live sim engine, stepped like the runner does (calls between
    steps, jump to the next arrival when idle), on a hand-moved clock."""
    eng = SimEngine(CONFIG)
    clock = [0.0]
    eng.clock = eng.scheduler.clock = lambda: clock[0]
    ex = eng.executor
    ex.paced = lambda chunks, step_s: ex.compute(chunks)  # no sleep: the clock moves instead
    original = ex.execute

    def execute(chunks):
        out = original(chunks)
        clock[0] += ex.last_step_ms / 1000.0
        return out

    ex.execute = execute
    pending = list(reqs)
    tokens, stats = [], {}
    clock[0] = pending[0][0]
    while pending or eng.has_work():
        while pending and pending[0][0] <= clock[0]:
            eng.add_request(pending.pop(0)[1])
        if not eng.has_work():
            clock[0] = pending[0][0]
            continue
        for o in eng.step():
            tokens.append((o.request_id, o.index, clock[0], o.finish_reason))
            if o.stats:
                stats[o.request_id] = o.stats
        eng.check_integrity()
    return tokens, stats


def simulated(reqs) -> tuple[list, dict, SimInstance]:
    k = Kernel()
    tokens, stats = [], {}

    def on_step(inst, outputs):
        for o in outputs:
            tokens.append((o.request_id, o.index, k.now, o.finish_reason))
            if o.stats:
                stats[o.request_id] = o.stats

    inst = SimInstance(k, "i0", PROFILE, CONFIG, {}, 0.05, 0.5, 0.0, on_step, lambda i, s: None)
    for t, r in reqs:
        k.at(t, inst.submit, inst.engine.add_request, r)
    k.run(until=START + 3600)
    inst.engine.check_integrity()
    return tokens, stats, inst


def test_simulated_instance_matches_the_sim_engine_stepped_by_hand():
    for seed in range(3):
        reqs = workload(seed)
        want_tokens, want_stats = reference(reqs)
        got_tokens, got_stats, inst = simulated(reqs)
        assert [t[:2] + t[3:] for t in got_tokens] == [t[:2] + t[3:] for t in want_tokens]
        assert [t[2] for t in got_tokens] == [t[2] for t in want_tokens]  # the same clock, to the bit
        assert got_stats == want_stats
        assert sum(s["num_preemptions"] for s in got_stats.values()) > 0  # the small pool preempts
        assert not inst.engine.has_work()


def test_cheap_report_trigger_fires_whenever_material_changes():
    reqs = workload(7, n=60)
    k = Kernel()
    inst = SimInstance(k, "i0", PROFILE, CONFIG, {}, 0.05, 0.5, 0.0, lambda i, o: None, lambda i, s: None)
    seen = []
    publish = inst._publish

    def recording_publish():
        seen.append((material(inst.engine.load()), inst._cheap_key()))
        publish()

    inst._publish = recording_publish
    for t, r in reqs:
        k.at(t, inst.submit, inst.engine.add_request, r)
    k.run(until=START + 3600)
    changes = 0
    for (m0, c0), (m1, c1) in itertools.pairwise(seen):
        if m0 != m1:
            changes += 1
            assert c0 != c1, (m0, m1)
    assert changes > 100


def test_reports_carry_the_load_published_at_the_last_step_boundary():
    """A report due in the middle of a step carries the load of the step's
    start (what the live agent published), not the engine's state ahead."""
    reqs = workload(3, n=30)
    k = Kernel()
    boundaries = []  # (time, material of the load published then)
    reports = []
    inst = SimInstance(k, "i0", PROFILE, CONFIG, {}, 0.013, 0.5, 0.0, lambda i, o: None,
                       lambda i, s: reports.append((k.now, s)))
    boundaries.append((k.now, material(inst.engine.load())))  # published when it started
    publish = inst._publish

    def recording_publish():
        boundaries.append((k.now, material(inst.engine.load())))
        publish()

    inst._publish = recording_publish
    for t, r in reqs:
        k.at(t, inst.submit, inst.engine.add_request, r)
    k.run(until=START + 3600)
    assert inst.late_reports == 0 and len(reports) > 100
    for t, s in reports:
        last = [m for bt, m in boundaries if bt <= t][-1]
        assert (s.free_blocks, tuple((r.request_id, r.state, r.physical_blocks) for r in s.requests)) == \
            (last[0], tuple((r[0], r[1], r[3]) for r in last[5]))
