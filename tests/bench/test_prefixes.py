"""Workloads with prefix structure (ferry/measure/prefixes.py) and the hit-rate
upper bound (ferry/measure/hit_rate.py): pure, seeded, and the block hashes of
the prompts they make follow the structure."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from ferry.measure import hit_rate, prefixes
from ferry.measure import workload as wl
from libs.common.prefix_hash import block_hashes

LO, HI = 97, 123


def ids(w, i):
    return wl.prompt_ids(w.requests[i], w.seed, LO, HI)


def test_system_prompts_are_shared_with_zipf_popularity():
    w = prefixes.build("poisson:5", "fixed:40:8", 2000, "system:5:64:1.2", seed=3)
    assert w.prefix == "system:5:64:1.2" and all(r.prompt_len == 104 for r in w.requests)
    firsts = Counter(tuple(ids(w, i)[:64]) for i in range(2000))
    assert len(firsts) == 5
    counts = sorted(firsts.values(), reverse=True)
    # Zipf 1.2 over 5: P(rank 1) = 0.46, P(rank 5) = 0.067
    assert 0.40 < counts[0] / 2000 < 0.52 and counts[-1] / 2000 < 0.10
    # the own parts differ, and the same seed gives the same prompts
    assert len({tuple(ids(w, i)[64:]) for i in range(50)}) == 50
    again = prefixes.build("poisson:5", "fixed:40:8", 2000, "system:5:64:1.2", seed=3)
    assert ids(again, 7) == ids(w, 7)


def test_system_prompt_own_part_shrinks_to_the_context():
    w = prefixes.build("poisson:5", "fixed:400:100", 5, "system:2:300", max_model_len=512)
    assert all(r.prompt_len + r.output_len <= 512 and r.prompt_len > 300 for r in w.requests)


def test_sessions_grow_their_context_and_follow_the_think_time():
    w = prefixes.build("poisson:1", "fixed:30:10", 12, "sessions:4:2", seed=1)
    by = {}
    for r in w.requests:
        by.setdefault(r.session, []).append(r)
    assert sorted(len(v) for v in by.values()) == [4, 4, 4]
    for turns in by.values():
        assert [t.turn for t in turns] == [0, 1, 2, 3]
        assert [t.prompt_len for t in turns] == [30, 70, 110, 150]  # every message and answer so far
        assert turns[0].think_s == 0 and all(t.think_s > 0 for t in turns[1:])
        assert len({t.arrival_s for t in turns}) == 1  # the session's start
    capped = prefixes.build("poisson:1", "fixed:30:10", 12, "sessions:4:2", seed=1, max_model_len=120)
    assert max(r.turn for r in capped.requests) == 2 and capped.clip.clipped == 3


def test_mooncake_trace_blocks_become_shared_prefixes(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]},
            {"timestamp": 500, "input_length": 1200, "output_length": 5, "hash_ids": [1, 2, 3]},
            {"timestamp": 1500, "input_length": 300, "output_length": 7, "hash_ids": [9]}]
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    w = prefixes.build("ignored", "ignored", 3, f"trace:{p}:512")
    assert [r.arrival_s for r in w.requests] == [0.0, 0.5, 1.5]
    assert [(r.prompt_len, r.output_len) for r in w.requests] == [(1000, 10), (1200, 5), (300, 7)]
    a, b, c = (ids(w, i) for i in range(3))
    # a's second block is the first 488 tokens of b's (the same hash id)
    assert a == b[:1000] and c[:300] != a[:300]
    # the engines' hashes at 16-token blocks: a's 62 full blocks are b's first ones
    ha, hb, hc = block_hashes(a, 16), block_hashes(b, 16), block_hashes(c, 16)
    assert len(ha) == 62 and ha == hb[:62] and not set(hc) & set(hb)
    with pytest.raises(wl.WorkloadError, match="block size"):
        prefixes.build("x", "x", 3, f"trace:{p}:256")
    with pytest.raises(wl.WorkloadError):
        prefixes.build("poisson:1", "fixed:1:1", 3, "system:0:10")
    with pytest.raises(wl.WorkloadError, match="unknown prefix"):
        prefixes.build("poisson:1", "fixed:1:1", 3, "nonsense")


def test_upper_bound_is_one_unbounded_cache_in_order():
    a = list(range(100, 165))  # 4 blocks of 16 and one token
    b = a[:40] + [1, 2, 3]
    reqs = [(a, [7, 8, 9]), (a, []), (b, []), (a + [7, 8, 9] + [5] * 20, [])]
    bound = hit_rate.upper_bound(reqs, 16)
    # a: miss; a again: 4 blocks (never the last token); b: 2 blocks; the
    # next turn: 68 tokens of a and its answer, 4 blocks (a's 5th block is its
    # last token then 7, 8: its answer but the last token made it whole)
    assert bound["queries"] == 65 + 65 + 43 + 88
    assert bound["hits"] == (4 + 2 + 4) * 16
    assert hit_rate.upper_bound([], 16)["hit_rate"] is None


def test_cluster_summary_sums_the_instances():
    from libs.common.types import PrefixCacheStats

    s = hit_rate.summary({"a": PrefixCacheStats(True, 2, 100, 40, 1, 5, 2), "b": PrefixCacheStats(True, 1, 100, 0)},
                         [([1] * 40, [])], 16)
    assert s["queries"] == 200 and s["hits"] == 40 and s["hit_rate"] == 0.2
    assert s["instances"]["a"]["hit_rate"] == 0.4 and s["upper_bound"]["queries"] == 40
