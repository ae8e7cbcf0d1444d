"""The scheduler's KunServe loop (services/scheduler/kunserve.py): its
decisions on hand-made status reports (fake instances record the orders):
forming, restoring, merging groups throttled again (and a member refusing
to); and its orders carried out by two real instance agents over gRPC while a
request decodes: the request's tokens are those of an undisturbed run."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from libs.pb import instance_pb2 as ipb
from libs.common.errors import FailedPrecondition
from libs.common.policies.kunserve import buddy_group
from libs.common.types import InstanceStatus, LayerChange
from services.scheduler.kunserve import KunServeConfig, KunServeLoop, dropped_ranges, holders

LAYERS, LAYER_BLOCKS = 4, 25  # 100 blocks of parameters per replica


@dataclass
class FakeView:
    statuses: dict

    def views(self):
        return [SimpleNamespace(instance_id=i, status=s) for i, s in self.statuses.items()]

    def address(self, iid):
        return f"addr-{iid}" if iid in self.statuses else None


class Recorder:
    """Instance clients (libs/common/instance_client.InstanceClients) that
    record the loop's KunServe calls: (address, call, its arguments)."""

    def __init__(self):
        self.calls: list[tuple[str, str, dict]] = []
        self.refuse: dict[tuple[str, bool], str] = {}  # (instance, prepare) -> the error its drop raises

    def __call__(self, instance_id, address):
        assert address == f"addr-{instance_id}"
        rec = self

        class Client:
            async def drop_layers(self, layers, hold=False, prepare=False):
                rec.calls.append((address, "drop_layers", {"layers": layers, "hold": hold, "prepare": prepare}))
                if (instance_id, prepare) in rec.refuse:
                    raise FailedPrecondition(rec.refuse[instance_id, prepare])
                return LayerChange(0, 0)

            async def set_pipeline(self, own, peers=(), pause_exchange=False, hold=False):
                rec.calls.append((address, "set_pipeline",
                                  {"own": own, "peers": list(peers), "pause_exchange": pause_exchange, "hold": hold}))
                return 0

            async def restore_layers(self, layers, from_address):
                rec.calls.append((address, "restore_layers", {"layers": layers, "from_address": from_address}))
                return LayerChange(0, 0)
        return Client()

    def forget(self, instance_id):
        pass


def _st(iid: str, t: float, used: int, total: int = 200, waiting_demand: int = 0) -> InstanceStatus:
    return InstanceStatus(iid, timestamp=t, total_blocks=total, free_blocks=max(0, total - used), used_blocks=used,
                          num_waiting=1 if waiting_demand else 0, head_of_line_demand_blocks=waiting_demand,
                          waiting_demand_blocks=waiting_demand)


def test_helpers():
    assert dropped_ranges(4, 0, 2) == [range(2, 4)]
    assert dropped_ranges(6, 2, 4) == [range(2), range(4, 6)]
    g = buddy_group(["a", "b", "c"], 6, 1)
    assert holders(g, range(6)) == [(range(2), "a"), (range(2, 4), "b"), (range(4, 6), "c")]
    assert holders(g, range(3, 5)) == [(range(3, 4), "b"), (range(4, 5), "c")]


async def test_throttle_forms_a_group_and_pressure_gone_restores_it():
    now = [0.0]
    view = FakeView({})
    rec = Recorder()
    loop = KunServeLoop(view, KunServeConfig(LAYERS, LAYER_BLOCKS, min_group_s=5.0), clients=rec,
                        clock=lambda: now[0])
    # a: its queue needs 60 blocks more than it has, and growing; b: half empty.
    for t, used in ((0.0, 180), (0.5, 190), (1.0, 200)):
        now[0] = t
        view.statuses = {"a": _st("a", t, used, waiting_demand=60), "b": _st("b", t, 100)}
        await loop.tick()
    assert set(loop.groups) == {"a", "b"}
    names = [(a, n) for a, n, _ in rec.calls]
    # Both drop (and hold) before either enters: each then has room for the KV the other hands over.
    # Both get the storage ready (no step held), then both drop and hold, then both enter.
    assert names == [("addr-a", "drop_layers"), ("addr-b", "drop_layers")] * 2 + [("addr-a", "set_pipeline"),
                                                                                  ("addr-b", "set_pipeline")]
    prep_a, prep_b, drop_a, drop_b, sp_a, sp_b = (r for _, _, r in rec.calls)
    assert prep_a["prepare"] and prep_b["prepare"] and not prep_a["hold"] and not prep_b["hold"]
    assert prep_a["layers"] == range(2, 4)
    assert drop_a["hold"] and drop_b["hold"] and not drop_a["prepare"]
    assert sp_a["own"] == range(0, 2)
    assert sp_a["peers"] == [(range(2, 4), "addr-b")]
    assert drop_a["layers"] == range(2, 4)
    assert drop_b["layers"] == range(0, 2)
    assert sp_b["own"] == range(2, 4) and sp_b["peers"] == [(range(0, 2), "addr-a")]
    assert not sp_a["pause_exchange"] and not sp_b["pause_exchange"]  # live exchange: requests decode on
    rec.calls.clear()

    # Pressure gone (both at 50 of their own 200), but the group is young: nothing.
    now[0] = 3.0
    view.statuses = {"a": _st("a", 3.0, 50, total=250), "b": _st("b", 3.0, 50, total=250)}
    await loop.tick()
    assert rec.calls == []
    # Old enough: each member fetches its layers from the other, then leaves the pipeline.
    for t in (6.0, 6.5):
        now[0] = t
        view.statuses = {"a": _st("a", t, 50, total=250), "b": _st("b", t, 50, total=250)}
        await loop.tick()
    assert not loop.groups
    calls = [(a, n, r.get("from_address"), r.get("layers", r.get("own"))) for a, n, r in rec.calls]
    assert calls == [("addr-a", "restore_layers", "addr-b", range(2, 4)), ("addr-a", "set_pipeline", None, range(4)),
                     ("addr-b", "restore_layers", "addr-a", range(0, 2)), ("addr-b", "set_pipeline", None, range(4))]
    assert all(r["peers"] == [] for _, n, r in rec.calls if n == "set_pipeline")
    assert [e["event"] for e in loop.log] == ["drop", "restore"]


async def test_no_throttle_no_order():
    view = FakeView({"a": _st("a", 1.0, 100), "b": _st("b", 1.0, 20)})
    rec = Recorder()
    loop = KunServeLoop(view, KunServeConfig(LAYERS, LAYER_BLOCKS), clients=rec, clock=lambda: 1.0)
    await loop.tick()
    assert rec.calls == [] and not loop.groups


async def _two_pairs(rec, **cfg):
    """A loop with groups a+b and c+d formed at t=1 (every member at 250
    blocks: its own 200 and 50 lent); the clock in ``now``."""
    now = [1.0]
    view = FakeView({i: _st(i, 1.0, 100) for i in "abcd"})
    loop = KunServeLoop(view, KunServeConfig(LAYERS, LAYER_BLOCKS, **cfg), clients=rec, clock=lambda: now[0])
    for pair in ("ab", "cd"):
        assert await loop.form(buddy_group(list(pair), LAYERS, LAYER_BLOCKS), {i: 200 for i in pair})
    rec.calls.clear()
    return loop, view, now


async def _ticks(loop, view, now, times, **used):
    for t in times:
        now[0] = t
        view.statuses = {i: _st(i, t, u, total=250, waiting_demand=60 if u >= 250 else 0)
                         for i, u in used.items()}
        await loop.tick()


async def test_a_pair_throttled_again_merges_with_the_other_into_four_stages():
    rec = Recorder()
    loop, view, now = await _two_pairs(rec)
    # a is full again with a queue 60 blocks short (P = 100 covers it); c and d have room.
    await _ticks(loop, view, now, (1.5, 2.0), a=250, b=240, c=120, d=100)
    g = loop.groups["a"]
    assert all(loop.groups[i] is g for i in "abcd") and len(loop._live_groups()) == 1
    # Each member keeps half of what it kept (the first pair's the lower halves): it only drops.
    assert [(m.instance_id, m.start, m.end, m.freed_blocks) for m in g.plan.members] == [
        ("a", 0, 1, 75), ("c", 1, 2, 75), ("b", 2, 3, 75), ("d", 3, 4, 75)]
    drops = [(a, r["layers"], r["prepare"], r["hold"]) for a, n, r in rec.calls if n == "drop_layers"]
    want = [("addr-a", range(1, 2)), ("addr-c", range(0, 1)), ("addr-b", range(3, 4)), ("addr-d", range(2, 3))]
    # The first round holds every member's steps (prepare, hold) before any drops.
    assert drops == [(a, r, True, True) for a, r in want] + [(a, r, False, True) for a, r in want]
    assert [n for _, n, _ in rec.calls][8:] == ["set_pipeline"] * 8  # all dropped before any re-forms
    # Each re-forms and stays held; once all have, the same stages again release them.
    assert [r["hold"] for _, n, r in rec.calls if n == "set_pipeline"] == [True] * 4 + [False] * 4
    stages = {a: (r["own"], r["peers"]) for a, n, r in rec.calls if n == "set_pipeline"}
    assert stages == {
        "addr-a": (range(0, 1), [(range(1, 2), "addr-c"), (range(2, 3), "addr-b"), (range(3, 4), "addr-d")]),
        "addr-c": (range(1, 2), [(range(0, 1), "addr-a"), (range(2, 3), "addr-b"), (range(3, 4), "addr-d")]),
        "addr-b": (range(2, 3), [(range(0, 1), "addr-a"), (range(1, 2), "addr-c"), (range(3, 4), "addr-d")]),
        "addr-d": (range(3, 4), [(range(0, 1), "addr-a"), (range(1, 2), "addr-c"), (range(2, 3), "addr-b")])}
    merge = loop.log[-1]
    assert merge["event"] == "merge" and merge["groups"] == [["a", "b"], ["c", "d"]]
    assert merge["freed_blocks"] == LAYERS * LAYER_BLOCKS  # one replica more
    assert set(await loop.state.load("kunserve")) == {"a+c+b+d"}
    # Its members have not reported since: the same throttled window does not merge again.
    rec.calls.clear()
    await loop.tick()
    assert rec.calls == []


async def test_no_merge_when_the_groups_have_room_or_no_partner_fits():
    rec = Recorder()
    loop, view, now = await _two_pairs(rec)
    await _ticks(loop, view, now, (1.5, 2.0, 2.5), a=200, b=150, c=120, d=100)
    assert rec.calls == [] and len(loop._live_groups()) == 2
    rec = Recorder()
    loop, view, now = await _two_pairs(rec, max_group_size=3)  # two pairs would make four
    await _ticks(loop, view, now, (1.5, 2.0), a=250, b=240, c=120, d=100)
    assert rec.calls == [] and len(loop._live_groups()) == 2


async def test_a_merged_group_restores_each_member_from_the_new_holders():
    rec = Recorder()
    loop, view, now = await _two_pairs(rec)
    await _ticks(loop, view, now, (1.5, 2.0), a=250, b=240, c=120, d=100)
    rec.calls.clear()
    # Pressure gone: young (merged at t=2), nothing; 5 s after the merge, every member restores.
    await _ticks(loop, view, now, (4.0, 7.5, 8.0), a=50, b=50, c=50, d=50)
    assert not loop.groups and await loop.state.load("kunserve") == {}
    calls = [(a, n, r.get("from_address"), r.get("layers", r.get("own"))) for a, n, r in rec.calls]
    assert calls[:4] == [("addr-a", "restore_layers", "addr-c", range(1, 2)),
                         ("addr-a", "restore_layers", "addr-b", range(2, 3)),
                         ("addr-a", "restore_layers", "addr-d", range(3, 4)), ("addr-a", "set_pipeline", None, range(4))]
    restored = {}
    for a, n, _, r in calls:
        if n == "restore_layers":
            restored.setdefault(a, []).extend(r)
    assert restored == {"addr-a": [1, 2, 3], "addr-c": [0, 2, 3], "addr-b": [0, 1, 3], "addr-d": [0, 1, 2]}
    assert [e["event"] for e in loop.log] == ["drop", "drop", "merge", "restore"]


async def test_a_member_that_cannot_regroup_refuses_before_anything_changes():
    rec = Recorder()
    loop, view, now = await _two_pairs(rec)
    rec.refuse["c", True] = "this engine cannot re-form a live pipeline"  # it formed its pair, no more
    await _ticks(loop, view, now, (1.5, 2.0), a=250, b=240, c=120, d=100)
    # Only the first round was asked (the storage, prepare): nothing dropped. Then every
    # member sets the stages it runs again, which ends the holds the first round began.
    prepared = [c for c in rec.calls if c[1] == "drop_layers"]
    assert prepared and all(r["prepare"] and r["hold"] for _, _, r in prepared)
    assert {a: (r["own"], r["peers"]) for a, n, r in rec.calls[len(prepared):]} == {
        "addr-a": (range(0, 2), [(range(2, 4), "addr-b")]), "addr-b": (range(2, 4), [(range(0, 2), "addr-a")]),
        "addr-c": (range(0, 2), [(range(2, 4), "addr-d")]), "addr-d": (range(2, 4), [(range(0, 2), "addr-c")])}
    assert all(n == "set_pipeline" for _, n, _ in rec.calls[len(prepared):])
    groups = loop._live_groups()
    assert sorted(g.key for g in groups) == ["a+b", "c+d"] and not any(g.mergeable for g in groups)
    assert [e["event"] for e in loop.log] == ["drop", "drop"]
    rec.calls.clear()  # not asked again while those groups last
    await _ticks(loop, view, now, (2.5, 3.0), a=250, b=240, c=120, d=100)
    assert rec.calls == []


async def test_a_merge_failing_midway_takes_the_dropped_layers_back_and_the_old_stages():
    rec = Recorder()
    loop, view, now = await _two_pairs(rec)
    rec.refuse["d", False] = "peer gone"
    await _ticks(loop, view, now, (1.5, 2.0), a=250, b=240, c=120, d=100)
    assert sorted(g.key for g in loop._live_groups()) == ["a+b", "c+d"]
    after = [(a, n, r) for a, n, r in rec.calls if not (n == "drop_layers")]
    # a, c and b dropped a layer each: each takes it back from the member keeping it in the
    # merged plan; d dropped nothing. Then every member sets its pair's stages again.
    assert [(a, r["layers"], r["from_address"]) for a, n, r in after if n == "restore_layers"] == [
        ("addr-a", range(1, 2), "addr-c"), ("addr-c", range(0, 1), "addr-a"), ("addr-b", range(3, 4), "addr-d")]
    assert {a: (r["own"], r["peers"]) for a, n, r in after if n == "set_pipeline"} == {
        "addr-a": (range(0, 2), [(range(2, 4), "addr-b")]), "addr-b": (range(2, 4), [(range(0, 2), "addr-a")]),
        "addr-c": (range(0, 2), [(range(2, 4), "addr-d")]), "addr-d": (range(2, 4), [(range(0, 2), "addr-c")])}


@pytest.mark.model
async def test_a_merge_of_two_live_native_pairs_keeps_every_members_requests_exact():
    # Two pairs of SmolLM2 agents over gRPC, a request decoding on each member. The loop
    # merges them into four stages (each member drops half of its layers; every request's
    # KV of the layers whose holder changed moves) and later restores the merged group:
    # every request's tokens are those of an undisturbed run, and nothing is left behind.
    from libs.common import convert
    from libs.common.policies.kunserve import merge_groups
    from libs.common.types import SamplingParams
    from services.instance.engine import create_engine
    from services.instance.engine.base import EngineConfig
    from tests.instance.engine.helpers import req, run_alone
    from tests.instance.test_pipeline_grpc import Agents

    n, ids = 40, "acbd"
    prompts = {i: list(range(2000 + 97 * k, 2036 + 97 * k)) for k, i in enumerate(ids)}
    sampling = {i: SamplingParams(max_tokens=n, min_tokens=n, temperature=0.8, seed=7 + k)
                for k, i in enumerate(ids)}
    ref = create_engine(EngineConfig(engine="native", model="smollm2", num_blocks=64,
                                     extra={"share_weights": True, "warmup": False}))
    want = {i: run_alone(ref, req(i, prompts[i], max_tokens=n, min_tokens=n, temperature=0.8, seed=7 + k))
            for k, i in enumerate(ids)}
    agents = Agents()
    try:
        stubs = {}
        for i in ids:
            stubs[i] = await agents.start(engine="native", model="smollm2", num_blocks=64, dtype="float32",
                                          torch_threads=1, instance_id=i)
        addr = dict(zip(ids, agents.addresses))
        svc = dict(zip(ids, agents.services))
        loop = KunServeLoop(SimpleNamespace(address=addr.get), KunServeConfig(30, 19))
        g = await loop.form(buddy_group(["a", "b"], 30, 19), {"a": 64, "b": 64})
        h = await loop.form(buddy_group(["c", "d"], 30, 19), {"c": 64, "d": 64})
        assert g is not None and h is not None
        tokens = {i: [] for i in ids}
        merged_at = {}

        async def generate(i):
            call = stubs[i].Generate(ipb.GenerateRequest(request_id=i, prompt_token_ids=prompts[i],
                                                         sampling=convert.sampling_to_pb(sampling[i])))
            async for ev in call:
                tokens[i] += list(ev.token_ids)

        async def reform():
            while min(len(t) for t in tokens.values()) < 8:
                await asyncio.sleep(0.02)
            plan = merge_groups(g.plan, h.plan, 30, 19)
            merged = await loop.merge(g, h, plan)
            assert merged is not None, loop.log
            merged_at.update({i: len(t) for i, t in tokens.items()})
            assert {i: svc[i].engine.executor.model.dropped() for i in ids} == {
                m.instance_id: [k for k in range(30) if not m.start <= k < m.end] for m in plan.members}
            assert all(svc[i].engine.guests for i in ids)  # each holds KV for the others' requests
            while min(len(t) for t in tokens.values()) < 24:
                await asyncio.sleep(0.02)
            assert await loop.restore(merged)

        await asyncio.gather(reform(), *(generate(i) for i in ids))
        assert all(merged_at[i] < n for i in ids)  # every request decoded before and after the merge
        assert tokens == want
        assert not loop.groups and [e["event"] for e in loop.log] == ["drop", "drop", "merge", "restore"]
        for i in ids:
            engine = svc[i].engine
            assert not engine.guests and engine.executor.model.dropped() == []
            assert engine.pool.capacity - engine.pool.shrinking == 64
            engine.check_integrity()
        await loop.stop()
    finally:
        await agents.stop()


@pytest.mark.model
async def test_the_loops_orders_carried_out_by_agents_keep_a_decoding_requests_tokens():


    from libs.common import convert
    from libs.common.types import SamplingParams
    from services.instance.engine import create_engine
    from services.instance.engine.base import EngineConfig
    from tests.instance.engine.helpers import req, run
    from tests.instance.test_pipeline_grpc import Agents

    n, prompt = 48, list(range(2000, 2040))
    ref = create_engine(EngineConfig(engine="native", model="smollm2", num_blocks=64,
                                     extra={"share_weights": True, "warmup": False}))
    ref.add_request(req("r", prompt, max_tokens=n, min_tokens=n))
    want = run(ref)["r"]
    agents = Agents()
    try:
        a = await agents.start(engine="native", model="smollm2", num_blocks=64, dtype="float32", torch_threads=1,
                               instance_id="a")
        await agents.start(engine="native", model="smollm2", num_blocks=64, dtype="float32", torch_threads=1,
                           instance_id="b")
        addr = dict(zip("ab", agents.addresses))
        view = SimpleNamespace(address=addr.get)
        loop = KunServeLoop(view, KunServeConfig(30, 19))
        plan = buddy_group(["a", "b"], 30, 19)
        tokens, group = [], None
        call = a.Generate(ipb.GenerateRequest(request_id="r", prompt_token_ids=prompt, sampling=convert.sampling_to_pb(
            SamplingParams(max_tokens=n, min_tokens=n))))
        async for ev in call:
            tokens += list(ev.token_ids)
            if len(tokens) >= 6 and group is None:
                group = await loop.form(plan, {"a": 64, "b": 64})
                assert group is not None
                assert agents.services[0].engine.num_total_blocks > 64  # dropped layers became blocks
            elif len(tokens) >= 24 and group is not None and loop.groups:
                assert await loop.restore(group)
        assert tokens == want
        assert not loop.groups
        for svc in agents.services:
            assert not svc.engine.guests and svc.engine.executor.model.dropped() == []
            assert svc.engine.pool.capacity - svc.engine.pool.shrinking == 64
        await loop.stop()
    finally:
        await agents.stop()

