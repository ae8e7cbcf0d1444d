"""Prefix caching through the shared core (fake and sim engines): the tokens
are those of the cache off at every hit length, hits are whole blocks and
never the last token, preempted and migrated requests keep exact tokens, the
load counts shared blocks once and a waiting request's demand net of its hit."""

from __future__ import annotations

import json

import pytest

from libs.common.kv_events import apply
from tests.instance.engine.helpers import migrate, req, run, step_collect
from tests.instance.engine.test_core_engines import expected

BS = 16
BASE = [97 + (i * 11) % 26 for i in range(80)]  # 5 blocks of 16


@pytest.fixture(params=["fake", "sim"])
def kind(request, tmp_path):
    if request.param == "fake":
        return {"engine": "fake"}
    prof = tmp_path / "fast.json"
    prof.write_text(json.dumps({"name": "fast", "block_size": BS, "kv_capacity_tokens": BS * 64,
                                "prefill_ms_per_token": 0.001, "decode_base_ms": 0.1, "decode_ms_per_seq": 0.01}))
    return {"engine": "sim", "profile": str(prof)}


def other(n: int) -> list[int]:
    return [97 + (i * 5 + 3) % 26 for i in range(n)]


# (name, second prompt, expected hit in tokens): the first request's prompt is BASE[:65]
CASES = [
    ("none", other(40), 0),
    ("one_block", BASE[:16] + other(20), 16),
    ("many_blocks", BASE[:64] + other(7), 64),
    ("all_but_last", BASE[:65], 64),  # 65 tokens: 4 full blocks cached, the last token computed
    ("partial_block_is_no_hit", BASE[:15] + other(30), 0),
]


@pytest.mark.parametrize("name,prompt,hit", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_tokens_equal_the_cache_off_at_every_hit_length(make_engine, kind, name, prompt, hit, seed):
    outs = {}
    for caching in (True, False):
        e = make_engine(**kind, num_blocks=64, prefix_caching=caching)
        sp = {} if seed is None else {"seed": seed, "temperature": 0.8}
        e.add_request(req("first", BASE[:65], max_tokens=5, **sp))
        run(e)
        e.add_request(req("second", prompt, max_tokens=12, **sp))
        o: dict = {}
        step_collect(e, o, 1)
        stats = e.request_stats("second")
        run(e, o)
        outs[caching] = o["second"]
        assert stats["prefix_hit_tokens"] == (hit if caching else 0)
        pc = e.load().prefix_cache
        assert pc.enabled is caching
        if caching:
            assert (pc.requests, pc.queries, pc.hits) == (2, 65 + len(prompt), hit)
    assert outs[True] == outs[False] == expected(prompt, 12)


def test_a_conversation_hits_the_previous_turns_output(make_engine, kind):
    e = make_engine(**kind, num_blocks=64)
    e.add_request(req("turn1", BASE[:40], max_tokens=30))
    out1 = run(e)["turn1"]
    turn2 = BASE[:40] + out1 + other(9)
    e.add_request(req("turn2", turn2, max_tokens=10))
    outs: dict = {}
    step_collect(e, outs, 1)
    # 70 tokens had KV (the last output token never ran): 4 full blocks
    assert e.request_stats("turn2")["prefix_hit_tokens"] == 64
    assert run(e, outs)["turn2"] == expected(turn2, 10)


def test_preempted_requests_restart_from_their_cached_blocks(make_engine, kind):
    e = make_engine(**kind, num_blocks=8, watermark=0.0)  # 128 tokens of KV for 3 requests of 40+30
    prompts = {f"r{i}": BASE[i:i + 40] for i in range(3)}
    for i, (rid, p) in enumerate(prompts.items()):
        e.add_request(req(rid, p, max_tokens=30, arrival=float(i + 1)))
    outs = run(e)
    assert e.load().num_preemptions > 0
    pc = e.load().prefix_cache
    assert pc.preempted_hits > 0, "a preempted request found its own blocks again"
    assert pc.requests == 3 and pc.queries == 120  # each request's first admission only
    for rid, p in prompts.items():
        assert outs[rid] == expected(p, 30)


def test_migration_with_shared_blocks_is_exact_and_registers_at_the_destination(make_engine, kind):
    src, dst = make_engine(**kind, num_blocks=64), make_engine(**kind, num_blocks=64)
    dst.take_kv_events()
    shared = BASE[:48]
    src.add_request(req("a", shared + other(5), max_tokens=40))
    outs: dict = {}
    step_collect(src, outs, 2)
    src.add_request(req("b", shared + other(9), max_tokens=40))
    step_collect(src, outs, 3)
    assert src.request_stats("b")["prefix_hit_tokens"] == 48
    assert src.load().shared_blocks == 3
    at = migrate(src, dst, "b")
    assert at == len(outs["b"])
    run(src, outs)
    run(dst, outs)
    assert outs["a"] == expected(shared + other(5), 40)
    assert outs["b"] == expected(shared + other(9), 40)
    # b's full blocks were named at the destination when installed: a new request there hits them
    held: dict = {}
    apply(held, dst.take_kv_events())
    assert set(held) == set(dst.cached_hashes()) and len(held) >= 3
    c = shared + other(9)[:4] + other(30)
    dst.add_request(req("c", c, max_tokens=3))
    step_collect(dst, outs, 1)
    assert dst.request_stats("c")["prefix_hit_tokens"] == 48
    assert run(dst, outs)["c"] == expected(c, 3)


def test_load_counts_shared_blocks_once_and_demand_net_of_the_hit(make_engine, kind):
    e = make_engine(**kind, num_blocks=32, max_num_seqs=2)
    e.add_request(req("a", BASE[:64] + [98], max_tokens=50))
    e.step()
    e.add_request(req("b", BASE[:64] + [99], max_tokens=50))
    e.step()
    load = e.load()
    # a holds 5 blocks, b hit a's 4 full ones and added its own last block
    assert load.shared_blocks == 4
    assert sorted(r.physical_blocks for r in load.requests) == [1, 1]
    used = load.total_blocks - load.free_blocks
    assert sum(r.physical_blocks for r in load.requests) + load.shared_blocks == used == 6
    e.add_request(req("c", BASE[:64] + other(40), max_tokens=5))  # waits: max_num_seqs
    load = e.load()
    assert load.head_of_line_demand_blocks == 7 - 4  # 104 tokens = 7 blocks, 4 cached and in use
    e.abort_request("a")
    e.abort_request("b")
    run(e)


def test_the_events_replay_to_the_cache(make_engine, kind):
    e = make_engine(**kind, num_blocks=12, watermark=0.0)
    assert e.take_kv_events() == []
    held: dict = {}
    for i in range(6):
        e.add_request(req(f"r{i}", BASE[(i % 3) * 8:][:50] + other(i + 1), max_tokens=20))
        if i % 2:
            run(e)
        apply(held, e.take_kv_events())
    run(e)
    apply(held, e.take_kv_events())
    assert set(held) == set(e.cached_hashes())
    assert e.load().prefix_cache.evictions > 0
