"""The scheduler's KunServe loop (services/scheduler/kunserve.py): its
decisions on hand-made status reports (fake instances record the orders),
and its orders carried out by two real instance agents over gRPC while a
request decodes: the request's tokens are those of an undisturbed run."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from libs.pb import instance_pb2 as ipb
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

    def __call__(self, instance_id, address):
        assert address == f"addr-{instance_id}"
        rec = self

        class Client:
            async def drop_layers(self, layers, hold=False, prepare=False):
                rec.calls.append((address, "drop_layers", {"layers": layers, "hold": hold, "prepare": prepare}))
                return LayerChange(0, 0)

            async def set_pipeline(self, own, peers=(), pause_exchange=False):
                rec.calls.append((address, "set_pipeline",
                                  {"own": own, "peers": list(peers), "pause_exchange": pause_exchange}))
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

