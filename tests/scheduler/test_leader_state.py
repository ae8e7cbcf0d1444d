"""What a new leader takes over from the state the previous one wrote
(services/scheduler/state.py): the autoscaler's drains and cooldown, KunServe's
groups. Pure, on MemoryState (EtcdState is tested on etcd in test_leader.py)."""

from __future__ import annotations

import time

from libs.common.policies.kunserve import BuddyGroup, Member
from services.scheduler.autoscaler import AutoscalePolicy, Autoscaler
from services.scheduler.kunserve import KunServeConfig, KunServeLoop, LiveGroup
from services.scheduler.state import MemoryState


async def test_the_autoscaler_takes_over_drains_and_the_cooldown():
    state = MemoryState()
    await state.put("draining", "auto-1", {"since": time.time() - 5.0})
    await state.put("autoscaler", "last_action", {"t": time.time() - 2.0})
    a = Autoscaler(view=None, launcher=None, policy=AutoscalePolicy(), state=state)
    await a.adopt()
    assert list(a.draining) == ["auto-1"] and a.draining["auto-1"].marked
    assert 4.0 < time.monotonic() - a.draining["auto-1"].since < 7.0
    assert 1.5 < time.monotonic() - a.last_action_at < 4.0


async def test_kunserve_groups_survive_a_change_of_leader():
    state = MemoryState()
    g = LiveGroup(BuddyGroup((Member("a", 0, 15, 40), Member("b", 15, 30, 40))),
                  {"a": "127.0.0.1:1", "b": "127.0.0.1:2"}, time.time() - 3.0, {"a": 500, "b": 500})
    assert LiveGroup.from_json(g.to_json()) == g
    await state.put("kunserve", g.key, g.to_json())
    loop = KunServeLoop(view=None, config=KunServeConfig(num_layers=30, layer_blocks=19), state=state)
    await loop.adopt()
    assert loop.groups["a"] is loop.groups["b"] and loop.groups["a"] == g
